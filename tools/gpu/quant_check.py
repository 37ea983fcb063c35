#!/usr/bin/env python3
"""Checks `moeserve quantize` output against PyTorch's own float8 types.

An oracle independent of our C++ (core/dtype.h, ops/quant.h): for each
converted directory DIR/<format> of the bf16 model SOURCE, every quantized
projection is re-derived here from the bf16 weight with the documented rules
(docs/quantization.md) using torch.float8_e4m3fn / float8_e8m0fnu casts and an
E2M1 lookup table, then compared with what our converter wrote:

  fp8-block  scale == amax/448 per 128x128 block (f32, bit-exact); the E4M3
             codes == (w / s).to(float8_e4m3fn) (bit-exact)
  mxfp8/mxfp4 E8M0 code == floor(log2 amax) - emax + 127 (exact); E4M3 codes as
             above; E2M1 values nearest to w / X (ties may go either way)
  nvfp4      weight_scale_2 == amax(gate, up) / 2688; E4M3 block scales ==
             (amax / 6 / g).to(float8_e4m3fn); E2M1 values nearest
and the dequantized weight (as vLLM / ModelOpt / DeepSeek's weight_dequant
define it) stays within the format's half-ulp bound of the bf16 weight.
Unquantized tensors must be bitwise copies. Prints one line per format and
exits non-zero on any mismatch. Runs on the CPU (torch only).

Usage: python3 tools/gpu/quant_check.py SOURCE DIR
"""
import json
import os
import sys

import torch

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.uint8,
          "U8": torch.uint8}


def load_file(path):
    """A minimal safetensors reader (no dependence on the library's dtype support)."""
    data = open(path, "rb").read()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        raw = bytearray(data[8 + n + begin:8 + n + end])
        t = torch.frombuffer(raw, dtype=DTYPES[info["dtype"]]) if raw else torch.empty(0, dtype=DTYPES[info["dtype"]])
        out[name] = t.reshape(info["shape"])
    return out

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def load_dir(path):
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        files = sorted(set(json.load(open(index))["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = {}
    for f in files:
        out.update(load_file(os.path.join(path, f)))
    return out


def is_projection(name):
    if not name.startswith("model.layers.") or not name.endswith(".weight"):
        return False
    mlp = any(name.endswith(s) for s in (".gate_proj.weight", ".up_proj.weight", ".down_proj.weight"))
    attn = any(name.endswith(f".self_attn.{p}_proj.weight") for p in "qkvo")
    return mlp or attn


def unpack_e2m1(packed, k):
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)[:, :k]
    return E2M1[codes.long()]


def blocks_along_k(w, bk):
    """[N, K] -> [N, ceil(K/bk), bk] zero-padded."""
    n, k = w.shape
    pad = (-k) % bk
    return torch.nn.functional.pad(w, (0, pad)).reshape(n, -1, bk)


def nearest_ok(elem, x, table):
    """elem is a nearest value of `table` to x (ties either way), saturating."""
    dist = (table.view(1, -1) - x.reshape(-1, 1)).abs().min(dim=1).values.reshape(x.shape)
    mx = table.abs().max()
    sat = x.abs() >= mx
    ok_sat = (elem.abs() == mx) | ~sat
    ok = ((elem - x).abs() <= dist + 1e-6 * x.abs()) | sat
    return bool(ok.all() and ok_sat.all())


def check_fp8_block(w, q, s):
    n, k = w.shape
    pad_n, pad_k = (-n) % 128, (-k) % 128
    wb = torch.nn.functional.pad(w, (0, pad_k, 0, pad_n)).reshape((n + pad_n) // 128, 128, (k + pad_k) // 128, 128)
    amax = wb.abs().amax(dim=(1, 3))
    expected = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    if not torch.equal(expected, s):
        return "scale"
    full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    codes = (w / full).to(torch.float8_e4m3fn)
    if not torch.equal(codes.view(torch.uint8), q.view(torch.uint8)):
        return "codes"
    deq = q.float() * full  # DeepSeek-V3 weight_dequant / vLLM block dequant
    if not bool(((deq - w).abs() <= torch.maximum(w.abs() / 16, full * 2.0**-10) * (1 + 1e-6)).all()):
        return "bound"
    return None


def check_mx(w, q, s, fp4):
    n, k = w.shape
    emax = 2 if fp4 else 8
    amax = blocks_along_k(w, 32).abs().amax(dim=2)
    exp = torch.floor(torch.log2(amax.double())).clamp(-127 - emax, 127 + emax) - emax
    expected = torch.where(amax > 0, (exp.clamp(-127, 127) + 127), torch.zeros_like(exp)).to(torch.uint8)
    codes = s.view(torch.uint8)
    if not torch.equal(expected, codes):
        return "scale"
    scale = torch.pow(2.0, codes.double() - 127).float().repeat_interleave(32, 1)[:, :k]
    x = w / scale
    if fp4:
        elem = unpack_e2m1(q, k)
        if not nearest_ok(elem, x, E2M1):
            return "codes"
    else:
        if not torch.equal(x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8), q.view(torch.uint8)):
            return "codes"
    return None


def check_nvfp4(w, q, s, g, amax_shared):
    n, k = w.shape
    expected_g = torch.tensor(amax_shared, dtype=torch.float32) / 2688.0
    if g.item() != expected_g.item():
        return "global %r vs %r" % (g.item(), expected_g.item())
    amax = blocks_along_k(w, 16).abs().amax(dim=2)
    expected = (amax / 6.0 / g).clamp(max=448).to(torch.float8_e4m3fn)
    if not torch.equal(expected.view(torch.uint8), s.view(torch.uint8)):
        return "scale"
    scale = (s.float() * g).repeat_interleave(16, 1)[:, :k]
    elem = unpack_e2m1(q, k)
    x = torch.where(scale > 0, w / scale, torch.zeros_like(w))
    if not nearest_ok(elem, x, E2M1):
        return "codes"
    return None


def main():
    source, root = sys.argv[1], sys.argv[2]
    src = {k: v for k, v in load_dir(source).items()}
    status = 0
    for fmt in ["fp8-block", "mxfp8", "nvfp4", "mxfp4"]:
        out = load_dir(os.path.join(root, fmt))
        config = json.load(open(os.path.join(root, fmt, "config.json")))["quantization_config"]
        bad, checked = [], 0
        for name, bf16 in src.items():
            if not is_projection(name):
                if not torch.equal(out[name].view(torch.uint8), bf16.view(torch.uint8)):
                    bad.append(name + ": copy")
                continue
            w = bf16.float()
            base = name[: -len(".weight")]
            q = out[name]
            if fmt == "fp8-block":
                err = check_fp8_block(w, q, out[base + ".weight_scale_inv"])
            elif fmt in ("mxfp8", "mxfp4"):
                err = check_mx(w, q, out[base + ".weight_scale"], fmt == "mxfp4")
            else:
                amax = w.abs().max().item()
                for a, b in ((".gate_proj.", ".up_proj."), (".up_proj.", ".gate_proj.")):
                    if a in name:
                        amax = max(amax, src[name.replace(a, b)].float().abs().max().item())
                err = check_nvfp4(w, q, out[base + ".weight_scale"], out[base + ".weight_scale_2"], amax)
            checked += 1
            if err:
                bad.append(f"{name}: {err}")
        print(f"{fmt}: quant_method={config['quant_method']} {checked} projections checked, "
              f"{len(src) - checked} copies, {len(bad)} mismatches {bad[:3]}")
        status |= bool(bad)
    print("torch", torch.__version__)
    return status


if __name__ == "__main__":
    sys.exit(main())
