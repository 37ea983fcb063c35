#!/usr/bin/env python3
"""Experiment: in long runs of FFMA (the FP8 promotions), clear the operand
reuse flag and flip the yield flag of some instructions, so that the warp
scheduler can switch to the other consumer's warp (its wgmma) mid-run.
usage: ffma_yield.py SASS_TXT BINARY OUT_BINARY MODE [kernel-substring ...]
MODE: dg (flip reuse-carrying FFMAs in the first 9/16 of a run whose dst is new),
      alt (flip every other FFMA of a run that carries reuse),
      all (flip every FFMA of a run that carries reuse)"""
import re, sys
sass_path, src, dst, mode = sys.argv[1:5]
kernels = sys.argv[5:]
REUSE, YIELD = 1 << 59, 1 << 45
runs, cur, func = [], [], ''
lines = open(sass_path).read().splitlines()
i = 0
def flush():
    global cur
    if len(cur) >= 16 and any(k in func for k in kernels): runs.append((func, cur))
    cur = []
while i < len(lines):
    ln = lines[i]
    if 'Function :' in ln:
        flush(); func = ln.split('Function :')[1].strip()
    m = re.search(r'/\*([0-9a-f]{4,})\*/\s+(.*?);\s*/\*\s*(0x[0-9a-f]+)\s*\*/', ln)
    if m and i + 1 < len(lines):
        hi = re.search(r'/\*\s*(0x[0-9a-f]+)\s*\*/', lines[i + 1])
        text = m.group(2).strip()
        if text.startswith('FFMA') and hi:
            regs = re.findall(r'\bR\d+', text)
            cur.append([text, int(m.group(3), 16), int(hi.group(1), 16), regs[0] if regs else ''])
            i += 2; continue
        flush()
    i += 1
flush()
data = bytearray(open(src, 'rb').read())
changed = 0
for func, run in runs:
    old = b''.join(lo.to_bytes(8, 'little') + hi.to_bytes(8, 'little') for _, lo, hi, _ in run)
    new_run = []
    seen = set()
    limit = len(run) * 9 // 16 if mode == 'dg' else len(run)
    prev_flipped, prev_dst = False, None
    for j, (text, lo, hi, d) in enumerate(run):
        flip = False
        if j < limit and hi & REUSE:
            if mode == 'dg':
                flip = d not in seen
            elif mode == 'alt':
                flip = j % 2 == 0
            else:
                flip = True
        if flip:
            hi = (hi & ~REUSE) ^ YIELD; changed += 1
        seen.add(d); prev_dst = d; prev_flipped = flip
        new_run.append((lo, hi))
    new = b''.join(lo.to_bytes(8, 'little') + hi.to_bytes(8, 'little') for lo, hi in new_run)
    pos, hits = data.find(old), 0
    while pos != -1:
        data[pos:pos + len(old)] = new; hits += 1
        pos = data.find(old, pos + 1)
    print(f'{func[:60]}: run of {len(run)} FFMA, {hits} place(s)')
open(dst, 'wb').write(bytes(data))
print(f'{len(runs)} runs, {changed} instructions changed')
