// Rotary position embedding, "rotate half" form (Qwen3 / Llama in transformers):
// for pair (i, i + d/2) of a head, angle = position * inv_freq[i] and
//   x'[i]       = x[i] * cos - x[i + d/2] * sin
//   x'[i + d/2] = x[i + d/2] * cos + x[i] * sin,
// with cos and sin multiplied by attention_factor (1 except for YaRN).
//
//   apply_rope: x [num_tokens, num_heads, head_dim] f32, in place;
//               positions [num_tokens].
#pragma once

#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "core/thread_pool.h"

namespace moe::ops {

// What a config says about RoPE; filled by model/config.
struct RopeSpec {
  std::string type = "default";  // "default" or "yarn"
  double theta = 10000.0;
  int head_dim = 0;
  // YaRN (transformers 5.x semantics: the explicit factor wins).
  double factor = 1.0;
  int original_max_position_embeddings = 0;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double attention_factor = 0.0;  // 0: derived from factor (and mscale, mscale_all_dim)
  double mscale = 0.0;
  double mscale_all_dim = 0.0;
  bool truncate = true;
};

struct RopeTable {
  std::vector<float> inv_freq;  // [head_dim / 2]
  float attention_factor = 1.0f;
};

RopeTable make_rope_table(const RopeSpec& spec);

namespace cpu {
void apply_rope(ThreadPool& pool, TensorView x, std::span<const int32_t> positions, const RopeTable& table);
}  // namespace cpu

}  // namespace moe::ops
