#include "ops/rope.h"

#include <algorithm>
#include <cmath>

namespace moe::ops {
namespace {

double yarn_mscale(double scale, double mscale) {
  return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

// The dimension index at which a frequency completes `num_rotations` turns over
// the original context (YaRN paper, eq. 17).
double correction_dim(double num_rotations, int dim, double base, int max_positions) {
  return dim * std::log(max_positions / (num_rotations * 2.0 * M_PI)) / (2.0 * std::log(base));
}

}  // namespace

RopeTable make_rope_table(const RopeSpec& spec) {
  CHECK(spec.head_dim > 0 && spec.head_dim % 2 == 0, "rope head_dim {}", spec.head_dim);
  const int dim = spec.head_dim, half = dim / 2;
  RopeTable table;
  table.inv_freq.resize(half);
  // Same float32 arithmetic as transformers: base ** (2i / dim) in f32.
  std::vector<float> pos_freqs(half);
  for (int i = 0; i < half; ++i)
    pos_freqs[i] = std::pow(static_cast<float>(spec.theta), static_cast<float>(2 * i) / static_cast<float>(dim));
  if (spec.type == "default") {
    for (int i = 0; i < half; ++i) table.inv_freq[i] = 1.0f / pos_freqs[i];
    return table;
  }
  CHECK(spec.type == "yarn", "rope type '{}'", spec.type);
  const double factor = spec.factor;
  double attention_factor = spec.attention_factor;
  if (attention_factor == 0.0) {
    attention_factor = (spec.mscale != 0.0 && spec.mscale_all_dim != 0.0)
                           ? yarn_mscale(factor, spec.mscale) / yarn_mscale(factor, spec.mscale_all_dim)
                           : yarn_mscale(factor, 1.0);
  }
  double low = correction_dim(spec.beta_fast, dim, spec.theta, spec.original_max_position_embeddings);
  double high = correction_dim(spec.beta_slow, dim, spec.theta, spec.original_max_position_embeddings);
  if (spec.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;
  for (int i = 0; i < half; ++i) {
    const float ramp = std::clamp(static_cast<float>((i - low) / (high - low)), 0.0f, 1.0f);
    const float extrapolation_weight = 1.0f - ramp;
    const float extrapolation = 1.0f / pos_freqs[i];
    const float interpolation = 1.0f / (static_cast<float>(factor) * pos_freqs[i]);
    table.inv_freq[i] = interpolation * (1.0f - extrapolation_weight) + extrapolation * extrapolation_weight;
  }
  table.attention_factor = static_cast<float>(attention_factor);
  return table;
}

namespace cpu {

void apply_rope(ThreadPool& pool, TensorView x, std::span<const int32_t> positions, const RopeTable& table) {
  CHECK(x.rank() == 3 && x.dtype() == DType::kF32, "apply_rope: x {}", x.shape().to_string());
  const int64_t num_tokens = x.dim(0), num_heads = x.dim(1), head_dim = x.dim(2), half = head_dim / 2;
  CHECK(static_cast<int64_t>(positions.size()) == num_tokens, "apply_rope: {} positions for {} tokens",
        positions.size(), num_tokens);
  CHECK(static_cast<int64_t>(table.inv_freq.size()) == half, "apply_rope: table for head_dim {}, x has {}",
        2 * table.inv_freq.size(), head_dim);
  pool.parallel_for(0, num_tokens, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> cos_v(half), sin_v(half);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < half; ++i) {
        const float angle = static_cast<float>(positions[t]) * table.inv_freq[i];
        cos_v[i] = std::cos(angle) * table.attention_factor;
        sin_v[i] = std::sin(angle) * table.attention_factor;
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        float* v = x.data_as<float>() + (t * num_heads + h) * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float a = v[i], b = v[i + half];
          v[i] = a * cos_v[i] - b * sin_v[i];
          v[i + half] = b * cos_v[i] + a * sin_v[i];
        }
      }
    }
  });
}

}  // namespace cpu
}  // namespace moe::ops
