#!/usr/bin/env python3
"""The transformation of ffma_reuse.py (KEEP 0) without cuobjdump: walks the CUDA ELF images
embedded (uncompressed) in a host object or executable, takes the sm_90 ones (e_flags bits 8-15),
their `.text.<kernel>` sections whose name contains one of the given substrings, and in every run of
16 or more consecutive FFMA instructions (opcode bits 0-8 = 0x023: the register, immediate and
constant forms) sets, on each register-form FFMA (bits 0-11 = 0x223) whose successor is one too and
reads the same slot-B register (bits 32-39), the slot-B reuse flag (high word bit 59) and the
no-yield bit (high word bit 45); no RZ operand on either (ffma_reuse.py's four-register test).
usage: ffma_reuse_elf.py IN OUT kernel-substring ..."""
import struct, sys
src, dst = sys.argv[1:3]
kernels = [k.encode() for k in sys.argv[3:]]
REUSE_B, YIELD = 1 << 59, 1 << 45
data = bytearray(open(src, 'rb').read())

def regs(lo, hi):  # Rd, Ra, Rb, Rc
    return (lo >> 16) & 0xff, (lo >> 24) & 0xff, (lo >> 32) & 0xff, hi & 0xff

def patch_text(off, size):
    n = size // 16
    words = [struct.unpack_from('<QQ', data, off + 16 * i) for i in range(n)]
    changed, runs, i = 0, 0, 0
    while i < n:
        j = i
        while j < n and (words[j][0] & 0x1ff) == 0x023: j += 1
        if j - i >= 16:
            runs += 1
            for k in range(i, j - 1):
                (lo, hi), (nlo, nhi) = words[k], words[k + 1]
                if (lo & 0xfff) != 0x223 or (nlo & 0xfff) != 0x223: continue
                r, nr = regs(lo, hi), regs(nlo, nhi)
                if 255 in r or 255 in nr or r[2] != nr[2]: continue
                if (hi & (REUSE_B | YIELD)) != (REUSE_B | YIELD): changed += 1
                struct.pack_into('<Q', data, off + 16 * k + 8, hi | REUSE_B | YIELD)
        i = max(j, i + 1)
    return runs, changed

total_runs = total_changed = images = 0
pos = -1
while True:
    pos = data.find(b'\x7fELF', pos + 1)
    if pos < 0: break
    if data[pos + 4] != 2 or struct.unpack_from('<H', data, pos + 18)[0] != 190: continue  # ELF64, EM_CUDA
    if (struct.unpack_from('<I', data, pos + 0x30)[0] >> 8) & 0xff != 90: continue  # sm_90 / sm_90a only
    images += 1
    shoff = struct.unpack_from('<Q', data, pos + 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from('<HHH', data, pos + 0x3a)
    hdrs = [struct.unpack_from('<IIQQQQIIQQ', data, pos + shoff + i * shentsize) for i in range(shnum)]
    strtab = pos + hdrs[shstrndx][4]
    for name_off, _, _, _, off, size, *_ in hdrs:
        name = bytes(data[strtab + name_off:data.index(b'\0', strtab + name_off)])
        if name.startswith(b'.text.') and any(k in name for k in kernels):
            runs, changed = patch_text(pos + off, size)
            total_runs += runs; total_changed += changed
open(dst, 'wb').write(bytes(data))
print(f'{images} sm_90 images, {total_runs} FFMA runs, {total_changed} instructions changed')
