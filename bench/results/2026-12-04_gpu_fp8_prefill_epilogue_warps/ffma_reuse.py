#!/usr/bin/env python3
"""Experiment: in the FP8 prefill kernels' promotion runs (16 or more consecutive FFMAs), ptxas
alternates the FFMAs' control bits: every other one may yield (no operand reuse), the others
keep the scale operand (slot B) in the reuse cache for the next. So half of the FFMAs read the
scale from the register file beside the two accumulator registers. This sets, on every FFMA whose
successor in the run reads the same slot-B register, the reuse flag for slot B and clears the
yield hint (the control bits the reuse-carrying FFMAs already have), except every `keep`-th one.
usage: ffma_reuse.py SASS_TXT BINARY OUT_BINARY KEEP kernel-substring ...
KEEP: 0 = change every such FFMA; k > 0 = leave every k-th FFMA of a run as ptxas made it."""
import re, sys
sass_path, src, dst, keep = sys.argv[1:5]
keep = int(keep)
kernels = sys.argv[5:]
REUSE_B, YIELD = 1 << 59, 1 << 45
runs, cur, func = [], [], ''
lines = open(sass_path).read().splitlines()
def flush():
    global cur
    if len(cur) >= 16 and any(k in func for k in kernels): runs.append((func, cur))
    cur = []
i = 0
while i < len(lines):
    ln = lines[i]
    if 'Function :' in ln:
        flush(); func = ln.split('Function :')[1].strip()
    m = re.search(r'/\*([0-9a-f]{4,})\*/\s+(.*?);\s*/\*\s*(0x[0-9a-f]+)\s*\*/', ln)
    if m and i + 1 < len(lines):
        hi = re.search(r'/\*\s*(0x[0-9a-f]+)\s*\*/', lines[i + 1])
        text = m.group(2).strip()
        if text.startswith('FFMA ') and hi:
            regs = re.findall(r'\bR\d+', text)
            cur.append([text, int(m.group(3), 16), int(hi.group(1), 16), regs])
            i += 2; continue
        flush()
    i += 1
flush()
data = bytearray(open(src, 'rb').read())
changed = 0
for func, run in runs:
    old = b''.join(lo.to_bytes(8, 'little') + hi.to_bytes(8, 'little') for _, lo, hi, _ in run)
    new_run = []
    for j, (text, lo, hi, regs) in enumerate(run):
        nxt = run[j + 1][3] if j + 1 < len(run) else None
        if nxt is not None and len(regs) == 4 and len(nxt) == 4 and regs[2] == nxt[2] and not (keep and j % keep == keep - 1):
            if not (hi & REUSE_B) or not (hi & YIELD): changed += 1
            hi |= REUSE_B | YIELD
        new_run.append((lo, hi))
    new = b''.join(lo.to_bytes(8, 'little') + hi.to_bytes(8, 'little') for lo, hi in new_run)
    pos, hits = data.find(old), 0
    while pos != -1:
        data[pos:pos + len(old)] = new; hits += 1
        pos = data.find(old, pos + 1)
    print(f'{func[:70]}: run of {len(run)} FFMA, {hits} place(s)')
open(dst, 'wb').write(bytes(data))
print(f'{len(runs)} runs, {changed} instructions changed')
