"""Peers for gpu_bench, run in the same device call: PyTorch on the same shapes.

torch._grouped_mm for the MoE expert GEMMs at decode sizes (gate/up then down,
bf16), scaled_dot_product_attention (flash) for the 6k causal prefill, and SDPA
over contiguous KV for decode attention (a bandwidth peer; it has no paging).
At prefill size (375 rows per expert): torch._grouped_mm, and cuBLAS dense GEMMs
of the same FLOPs (torch.mm in bf16, torch._scaled_mm in FP8 with per-row and
per-column scales) as the compute peers of the grouped kernels.
Prints one line per result and writes JSON lines to the path in argv[1];
argv[2] == "attention" (or "gemm") runs those peers only.
"""
import json
import sys

import torch
import torch.nn.functional as F


def median_ms(fn, warmup=3, repeats=20):
    """Median of the mean of back-to-back calls spanning about 1 ms (as gpu_bench times)."""
    for _ in range(warmup):
        fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def measure(inner):
        start.record()
        for _ in range(inner):
            fn()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) / inner

    inner = min(100, max(1, int(1.0 / max(measure(1), 1e-3))))
    times = sorted(measure(inner) for _ in range(repeats))
    return times[len(times) // 2]


def main():
    out = open(sys.argv[1], "w") if len(sys.argv) > 1 else None
    dev = "cuda"
    results = []
    only = sys.argv[2] if len(sys.argv) > 2 else ""
    if only != "attention":
        gemm_peers(results, dev)
    if only != "gemm":
        attention_peers(results, dev)
    for r in results:
        print(json.dumps(r))
        if out:
            out.write(json.dumps(r) + "\n")


def gemm_peers(results, dev):
    E, H, I = 128, 4096, 1536
    w13 = torch.randn(E, H, 2 * I, device=dev, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, I, H, device=dev, dtype=torch.bfloat16) * 0.02
    for per_expert in [1, 2, 4, 8, 16, 32, 64]:
        m = per_expert * E
        x = torch.randn(m, H, device=dev, dtype=torch.bfloat16)
        offs = torch.arange(per_expert, m + 1, per_expert, device=dev, dtype=torch.int32)
        def run():
            h = torch._grouped_mm(x, w13, offs=offs)
            a = F.silu(h[:, :I]) * h[:, I:]
            return torch._grouped_mm(a, w2, offs=offs)
        try:
            ms = median_ms(run)
            results.append({"bench": "torch_grouped_mm", "shape": f"{per_expert} tok/expert", "ms": ms})
        except Exception as e:  # noqa: BLE001 - report and continue
            results.append({"bench": "torch_grouped_mm", "shape": f"{per_expert} tok/expert", "error": str(e)[:200]})
    # Prefill size: 48000 rows (6000 tokens x top-8), 375 per expert.
    per_expert = 375
    m = per_expert * E
    flops = 2.0 * m * 3 * H * I
    x = torch.randn(m, H, device=dev, dtype=torch.bfloat16)
    a = torch.randn(m, I, device=dev, dtype=torch.bfloat16)
    offs = torch.arange(per_expert, m + 1, per_expert, device=dev, dtype=torch.int32)
    def grouped():
        torch._grouped_mm(x, w13, offs=offs)
        torch._grouped_mm(a, w2, offs=offs)
    dense13 = w13[0].t().contiguous()  # [2I, H]: one expert's weights, as a dense GEMM of all rows
    dense2 = w2[0].t().contiguous()    # [H, I]
    def dense():
        torch.mm(x, dense13.t())
        torch.mm(a, dense2.t())
    for name, fn in [("torch_grouped_mm_prefill", grouped), ("cublas_dense_bf16", dense)]:
        try:
            ms = median_ms(fn)
            results.append({"bench": name, "shape": f"{per_expert} tok/expert", "ms": ms,
                            "tflops": flops / (ms * 1e9)})
        except Exception as e:  # noqa: BLE001 - report and continue
            results.append({"bench": name, "shape": f"{per_expert} tok/expert", "error": str(e)[:200]})
    try:
        f8 = torch.float8_e4m3fn
        x8, a8 = x.to(f8), a.to(f8)
        w13_8, w2_8 = dense13.to(f8), dense2.to(f8)
        sx = torch.ones(m, 1, device=dev, dtype=torch.float32)
        s13 = torch.ones(1, 2 * I, device=dev, dtype=torch.float32)
        s2 = torch.ones(1, H, device=dev, dtype=torch.float32)
        def dense_fp8():
            torch._scaled_mm(x8, w13_8.t(), scale_a=sx, scale_b=s13, out_dtype=torch.bfloat16)
            torch._scaled_mm(a8, w2_8.t(), scale_a=sx, scale_b=s2, out_dtype=torch.bfloat16)
        ms = median_ms(dense_fp8)
        results.append({"bench": "cublas_dense_fp8_rowwise", "shape": f"{per_expert} tok/expert", "ms": ms,
                        "tflops": flops / (ms * 1e9)})
    except Exception as e:  # noqa: BLE001
        results.append({"bench": "cublas_dense_fp8_rowwise", "shape": f"{per_expert} tok/expert", "error": str(e)[:200]})


def attention_peers(results, dev):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    T, Hq, Hkv, D = 6144, 64, 4, 128
    q = torch.randn(1, Hq, T, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, Hkv, T, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(1, Hkv, T, D, device=dev, dtype=torch.bfloat16)
    flops = 4.0 * Hq * D * (T * (T + 1) / 2)
    # The flash backend is the peer; cuDNN's, where it runs, for reference.
    for name, backend in [("torch_sdpa_prefill", SDPBackend.FLASH_ATTENTION),
                          ("torch_sdpa_prefill_cudnn", SDPBackend.CUDNN_ATTENTION)]:
        try:
            with sdpa_kernel(backend):
                ms = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
            results.append({"bench": name, "shape": "6144 tokens", "ms": ms, "tflops": flops / (ms * 1e9)})
        except Exception as e:  # noqa: BLE001 - report and continue
            results.append({"bench": name, "shape": "6144 tokens", "error": str(e)[:200]})
    for batch, context in [(64, 1024), (128, 1024), (256, 1024), (64, 8192), (256, 2048), (256, 8192), (64, 32768)]:
        q = torch.randn(batch, Hq, 1, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(batch, Hkv, context, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn(batch, Hkv, context, D, device=dev, dtype=torch.bfloat16)
        ms = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        kv_bytes = 2.0 * batch * context * Hkv * D * 2
        results.append({"bench": "torch_sdpa_decode", "shape": f"batch {batch}, context {context}", "ms": ms,
                        "gbs": kv_bytes / (ms * 1e6)})
        del k, v


if __name__ == "__main__":
    main()
