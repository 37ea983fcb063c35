// Offline conversion of a bf16 (or f16/f32) Hugging Face checkpoint into one of
// our quantized formats: `moeserve quantize` (docs/quantization.md).
//
// Policy (as the official Qwen3 FP8 checkpoints): the linear projections are
// quantized — every expert's gate/up/down_proj, dense MLP gate/up/down_proj and
// (unless quantize_attention is off) the attention q/k/v/o_proj. The
// embeddings, lm_head, norms and the router (mlp.gate) keep the checkpoint's
// dtype. For nvfp4 an MLP's gate_proj and up_proj share one global scale
// (computed from both), so that the loader can fuse them.
//
// Streaming: the input is memory-mapped and converted one tensor at a time,
// 128 rows per task on num_threads threads; at most one output shard
// (max_shard_bytes) plus 128 rows in f32 per thread is held in memory. The
// output directory gets model-0000i-of-0000N.safetensors shards,
// model.safetensors.index.json, config.json with its quantization_config, and
// a copy of every other top-level regular file of the input (tokenizer files,
// generation_config.json, ...).
//
// Errors (Status): missing or unreadable input, an input that is already
// quantized, a tensor whose shape the format cannot store (every tensor is
// checked before anything is written), an existing non-empty output directory
// without `force`, the output directory equal to the input, I/O failures.
// One call at a time per output directory; the caller's thread runs it.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "core/status.h"
#include "ops/quant.h"

namespace moe::model {

struct QuantizeOptions {
  std::string model_dir;
  std::string out_dir;
  ops::QuantFormat format = ops::QuantFormat::kFp8Block;
  bool force = false;               // write into an existing non-empty out_dir
  bool quantize_attention = true;   // q/k/v/o_proj too
  uint64_t max_shard_bytes = 5'000'000'000;
  int num_threads = 0;              // 0: one per hardware thread
};

struct QuantizeProgress {
  int64_t num_tensors_done = 0;
  int64_t num_tensors = 0;
  uint64_t input_bytes_done = 0;
  uint64_t input_bytes = 0;
  uint64_t output_bytes_done = 0;
  double elapsed_s = 0.0;
};

struct QuantizeSummary {
  int64_t num_tensors = 0;
  int64_t num_quantized = 0;
  int num_shards = 0;
  uint64_t input_bytes = 0;
  uint64_t output_bytes = 0;
};

// Whether `moeserve quantize` converts the tensor named `name` (a weight of a
// linear projection, per the policy above).
bool is_quantized_projection(const std::string& name, bool quantize_attention);

// Converts options.model_dir into options.out_dir; `progress` (may be empty)
// is called after every tensor.
Expected<QuantizeSummary> quantize_checkpoint(const QuantizeOptions& options,
                                              const std::function<void(const QuantizeProgress&)>& progress);

}  // namespace moe::model
