// Quantized weights in checkpoints and in memory (docs/quantization.md).
//
// In a checkpoint, a projection `<base>.weight` [N, K] stored in a format is:
//   fp8-block  <base>.weight F8_E4M3 [N, K]
//              <base>.weight_scale_inv F32 [ceil(N/128), ceil(K/128)]  (official Qwen3-FP8 names)
//   mxfp8      <base>.weight F8_E4M3 [N, K]
//              <base>.weight_scale F8_E8M0 [N, ceil(K/32)]
//   nvfp4      <base>.weight U8 [N, K/2] (two E2M1 per byte, low nibble first)
//              <base>.weight_scale F8_E4M3 [N, ceil(K/16)]
//              <base>.weight_scale_2 F32 [] (the global scale; ModelOpt's names)
//   mxfp4      <base>.weight U8 [N, K/2]
//              <base>.weight_scale F8_E8M0 [N, ceil(K/32)]
// E8M0 scales are also accepted as U8 (what gpt-oss and compressed-tensors write).
//
// In memory, projections are ops::QuantizedTensor views over OwnedQuantized
// storage, experts stacked [num_experts, N, K] with gate|up fused (DESIGN 4).
// Functions here are pure or act on the caller's objects: any thread may call
// them on distinct objects.
#pragma once

#include <string>

#include "core/tensor.h"
#include "core/thread_pool.h"
#include "model/tensor_fetcher.h"
#include "ops/quant.h"

namespace moe::model {

struct QuantTensorNames {
  std::string values;        // <base>.weight
  std::string scales;        // <base>.weight_scale_inv (fp8-block) or <base>.weight_scale
  std::string global_scale;  // <base>.weight_scale_2 (nvfp4), else empty
};
// `weight_name` ends in ".weight".
QuantTensorNames quant_tensor_names(ops::QuantFormat format, const std::string& weight_name);

struct StoredTensorSpec {
  DType dtype;
  Shape shape;
};
// How the parts of a [rows, cols] matrix are stored in safetensors.
StoredTensorSpec stored_values_spec(ops::QuantFormat format, int64_t rows, int64_t cols);
StoredTensorSpec stored_scales_spec(ops::QuantFormat format, int64_t rows, int64_t cols);
inline StoredTensorSpec stored_global_scale_spec() { return {DType::kF32, Shape{}}; }

// Owning storage for a quantized matrix or stack; movable, not copyable.
struct OwnedQuantized {
  ops::QuantFormat format = ops::QuantFormat::kNone;
  Tensor values, scales, global_scale;
  int64_t scale_row_period = 0;
  ops::QuantizedTensor view() const;
};

// Zeroed storage for a [rows, cols] matrix (num_groups == 0) or a stack of
// num_groups of them. row_period: fused halves (fp8-block scale blocks restart
// every row_period rows); 0 for none.
OwnedQuantized allocate_quantized(ops::QuantFormat format, int64_t num_groups, int64_t rows, int64_t cols,
                                  int64_t row_period = 0);

// Quantizes a float matrix [rows, cols] (bf16, f16 or f32) into new storage,
// 128 rows per task on `pool` (the bytes do not depend on its size); nvfp4's
// global scale comes from `global_amax` when > 0 (so that fused halves share
// it), else from the matrix. InvalidArgument when the shape cannot be stored
// (check_quantizable).
Expected<OwnedQuantized> quantize_tensor(ThreadPool& pool, ops::QuantFormat format, TensorView src,
                                         float global_amax = 0.0f);

// Largest magnitude of a float tensor of any float dtype (NaN propagates).
float tensor_max_abs(ThreadPool& pool, TensorView src);

// Reads projection `weight_name` [rows, cols] from a checkpoint: every part
// present with its dtype and shape (InvalidArgument / NotFound naming the
// tensor otherwise). The views point into the checkpoint, possibly unaligned:
// copy them with copy_quantized_rows.
Expected<ops::QuantizedTensor> read_quantized(TensorFetcher& fetch, ops::QuantFormat format,
                                              const std::string& weight_name, int64_t rows, int64_t cols);

// Copies matrix `src` into rows [row_offset, row_offset + src.rows()) of `dst`
// (matrix `group` of a stack, or dst itself when group < 0). row_offset is a
// multiple of dst's row period. nvfp4: a matrix filled from two parts must get
// the same global scale from both (InvalidArgument naming `what` otherwise).
Status copy_quantized_rows(const ops::QuantizedTensor& src, const OwnedQuantized& dst, int64_t group,
                           int64_t row_offset, const std::string& what);

// Fills every matrix of dst with uniform values in [-scale, scale], quantized;
// deterministic in (seed, stream) whatever the thread count.
void fill_random_quantized(OwnedQuantized& dst, float scale, uint64_t seed, uint64_t stream, ThreadPool& pool);

}  // namespace moe::model
