// Quantized weight formats and the quantized linear, CPU reference.
//
// Four formats (docs/quantization.md has the full definitions and sources):
//
//   format     element        scale                    block (rows x K)   extra
//   fp8-block  E4M3 (1 byte)  f32 multiplier           128 x 128          activations: E4M3 per 1 x 128, f32 scale
//   mxfp8      E4M3 (1 byte)  E8M0 power of two        1 x 32             activations: MXFP8 per 1 x 32
//   nvfp4      E2M1 (4 bits)  E4M3 multiplier          1 x 16             one f32 global scale per matrix
//   mxfp4      E2M1 (4 bits)  E8M0 power of two        1 x 32             (nvfp4, mxfp4: weight-only, W4A16)
//
// A weight matrix W [N, K] (HF layout: N output features, K input features)
// dequantizes as W[n, k] = element[n, k] * scale[block of (n, k)] (* global for
// nvfp4). Scale choice per block, from the block's largest magnitude `amax`:
//   fp8-block  s = amax / 448 (f32), element = e4m3(w / s)
//              (DeepSeek-V3 / Qwen3-FP8 `weight_scale_inv`: the multiplier).
//   mx*        the OCP MX v1.0 rule (section 6.3): X = 2^(floor(log2 amax) - emax_elem),
//              emax_elem = 8 for E4M3, 2 for E2M1; element = round(w / X)
//              saturating to the element's max (448, 6). floor(log2) is exact
//              (frexp), not a float log2.
//   nvfp4      global g = amax_tensor / (448 * 6); s = e4m3(amax / 6 / g),
//              element = e2m1(w / (s * g)).
// Elements round to nearest, ties to even, saturating (core/dtype.h). A block of
// zeros gets scale 1 (fp8-block), code 0 = 2^-127 (mx), e4m3 0 (nvfp4); its
// elements are all 0 whatever the scale.
//
// Odd shapes. Along K and N the last block may be partial: scale tensors have
// ceil(K / block_k) columns (and ceil(N / 128) block rows for fp8-block), and
// a partial block is quantized as if zero-padded (padding never changes amax).
// The element tensors are not padded: [N, K] exactly. The E2M1 formats pack two
// elements per byte along K (element 2i in the low nibble, as PyTorch's
// float4_e2m1fn_x2 and ModelOpt pack), so they refuse an odd K
// (check_quantizable) rather than let a byte straddle two rows.
//
// Stacks. Grouped expert weights are [num_experts, N, K] with the scales
// [num_experts, ...] alongside. Fused gate|up (w13) keeps the gate's and the
// up's scale blocks separate: fp8-block scales are [.., 2 * ceil(inter/128),
// ceil(K/128)] and `scale_row_period` = inter says where block rows restart.
// When inter % 128 == 0 (every real Qwen3 model) that is the plain layout
// row n -> block row n / 128.
//
// Pure functions on caller-owned memory; any thread may call them. The ops
// taking a ThreadPool are called by the pool's owner only.
#pragma once

#include <string_view>

#include "core/status.h"
#include "core/tensor.h"
#include "core/thread_pool.h"

namespace moe::ops {

enum class QuantFormat : uint8_t { kNone, kFp8Block, kMxfp8, kNvfp4, kMxfp4 };

struct QuantFormatSpec {
  DType element;          // kF8E4M3 or kF4E2M1
  DType scale;            // kF32, kE8M0 or kF8E4M3
  int block_rows;         // 128 for fp8-block, else 1
  int block_cols;         // along K: 128, 32, 16 or 32
  bool has_global_scale;  // nvfp4
  float element_max;      // 448 or 6
  int element_emax;       // exponent of the largest normal: 8 (E4M3), 2 (E2M1)
};

const QuantFormatSpec& quant_format_spec(QuantFormat format);
// "none", "fp8-block", "mxfp8", "nvfp4", "mxfp4".
std::string_view quant_format_name(QuantFormat format);
Expected<QuantFormat> quant_format_from_name(std::string_view name);

// Ok when a [rows, cols] matrix can be stored in `format`; InvalidArgument
// naming the rule otherwise (E2M1 needs an even K).
Status check_quantizable(QuantFormat format, int64_t rows, int64_t cols);

// The scale tensor's shape for one [rows, cols] matrix. fp8-block with a
// row_period p (0: rows): (rows / p) * ceil(p / 128) block rows.
Shape quant_scale_shape(QuantFormat format, int64_t rows, int64_t cols, int64_t row_period = 0);

// A quantized matrix [N, K] or a stack [G, N, K]. Views: owns nothing.
//   values        [.., N, K] element dtype (E2M1: K / 2 bytes per row)
//   scales        [.., scale rows, ceil(K / block_cols)] (quant_scale_shape)
//   global_scale  nvfp4: f32 [G] for a stack, [1] for a matrix; empty otherwise
struct QuantizedTensor {
  QuantFormat format = QuantFormat::kNone;
  TensorView values;
  TensorView scales;
  TensorView global_scale;
  int64_t scale_row_period = 0;  // fp8-block only; 0 means N (no fused halves)

  bool empty() const { return format == QuantFormat::kNone; }
  int rank() const { return values.rank(); }
  int64_t rows() const { return values.dim(values.rank() - 2); }
  int64_t cols() const { return values.dim(values.rank() - 1); }
  // Matrix `g` of a stack.
  QuantizedTensor slice0(int64_t g) const;
  // Matrices [begin, end) of a stack (a rank's experts), still a stack.
  QuantizedTensor slice_stack(int64_t begin, int64_t end) const;
  size_t num_bytes() const { return values.num_bytes() + scales.num_bytes() + global_scale.num_bytes(); }
};

// Checks the views' ranks, dtypes and shapes against the format (a CHECK: a
// QuantizedTensor is built by our loader or quantizer, never from user input).
void check_quantized(const QuantizedTensor& w);

// nvfp4's per-matrix scale for a tensor whose largest magnitude is amax
// (1 when amax is 0).
float nvfp4_global_scale(float amax);

// Largest magnitude of n floats (NaN propagates).
float max_abs(const float* x, int64_t n);

// Quantizes one matrix src [rows, cols] f32 into `out` (a matrix, views of the
// right shapes; global_scale already holds nvfp4's g, see nvfp4_global_scale).
void quantize_matrix(const float* src, const QuantizedTensor& out);
// The same for rows [row_begin, row_begin + num_rows) of `out`, from src
// [num_rows, cols] f32 (those rows), writing only their values and scales, so
// that threads can quantize disjoint row ranges of one matrix. fp8-block: the
// range covers whole 128-row scale blocks (a period's last may be shorter).
void quantize_rows(const float* src, int64_t row_begin, int64_t num_rows, const QuantizedTensor& out);

// Dequantizes rows [row_begin, row_begin + num_rows) of a matrix into dst
// [num_rows, cols] f32.
void dequantize_rows(const QuantizedTensor& w, int64_t row_begin, int64_t num_rows, float* dst);

// How the activations are quantized before a quantized linear, emulated in
// f32 (quantize then dequantize), so the CPU reference computes what the GPU
// kernel does: fp8-block -> E4M3 per 1 x 128 group with s = max(amax, 1e-10) / 448
// (f32, DeepGEMM / vLLM per_token_group_quant_fp8); mxfp8 -> MXFP8 per 1 x 32
// (OCP rule above); nvfp4, mxfp4 -> none (weight-only kernels read bf16/f32
// activations).
void fake_quantize_activations(QuantFormat weight_format, float* x, int64_t num_tokens, int64_t cols);

// out [num_tokens, N] = act(x) [num_tokens, K] @ dequant(w)^T, f32 accumulation.
// w is one matrix. Weight rows are dequantized on the fly, 16 at a time, and
// reused for every token (the memory stays quantized).
namespace cpu {
void quantized_linear(ThreadPool& pool, TensorView x, const QuantizedTensor& w, TensorView out);
}  // namespace cpu

}  // namespace moe::ops
