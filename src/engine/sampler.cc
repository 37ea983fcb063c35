#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/check.h"

namespace moe::engine {

Status validate_sampling(const SamplingParams& p) {
  if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature))
    return invalid_argument("temperature must be a finite number >= 0, got {}", p.temperature);
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) return invalid_argument("top_p must be in (0, 1], got {}", p.top_p);
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) return invalid_argument("min_p must be in [0, 1], got {}", p.min_p);
  if (p.top_k < -1) return invalid_argument("top_k must be -1, 0 (off) or positive, got {}", p.top_k);
  return Status::ok();
}

double uniform_draw(uint64_t seed, uint64_t step) {
  // Two rounds of splitmix64 over (seed, step): a counter-based generator.
  auto mix = [](uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  const uint64_t bits = mix(mix(seed) ^ step);
  return static_cast<double>(bits >> 11) * (1.0 / 9007199254740992.0);  // 53 bits
}

int32_t argmax(std::span<const float> logits) {
  CHECK(!logits.empty(), "argmax of nothing");
  int32_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i)
    if (logits[i] > logits[best]) best = static_cast<int32_t>(i);
  return best;
}

SamplingCandidates sampling_candidates(std::span<const float> logits, const SamplingParams& params) {
  CHECK(!params.is_greedy(), "a greedy request has no candidates to draw from");
  const auto vocab = static_cast<int32_t>(logits.size());
  std::vector<int32_t> order(static_cast<size_t>(vocab));
  std::iota(order.begin(), order.end(), 0);
  auto by_logit = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  int32_t kept = vocab;
  if (params.top_k > 0 && params.top_k < vocab) {
    kept = params.top_k;
    std::partial_sort(order.begin(), order.begin() + kept, order.end(), by_logit);
  } else {
    std::sort(order.begin(), order.end(), by_logit);
  }
  std::vector<double> probs(static_cast<size_t>(kept));
  const double max_scaled = static_cast<double>(logits[order[0]]) / params.temperature;
  double total = 0.0;
  for (int32_t i = 0; i < kept; ++i)
    total += probs[i] = std::exp(static_cast<double>(logits[order[i]]) / params.temperature - max_scaled);
  for (auto& p : probs) p /= total;
  if (params.top_p < 1.0f) {
    double mass = 0.0;
    int32_t i = 0;
    while (i < kept && mass < params.top_p) mass += probs[i++];
    kept = std::max(i, 1);
  }
  if (params.min_p > 0.0f) {
    const double threshold = params.min_p * probs[0];
    int32_t i = 1;
    while (i < kept && probs[i] >= threshold) ++i;
    kept = i;
  }
  SamplingCandidates c;
  c.ids.assign(order.begin(), order.begin() + kept);
  c.probs.assign(probs.begin(), probs.begin() + kept);
  for (double p : c.probs) c.kept_mass += p;
  return c;
}

int32_t sample_token(std::span<const float> logits, const SamplingParams& params, uint64_t seed, uint64_t step) {
  if (params.is_greedy()) return argmax(logits);
  const SamplingCandidates c = sampling_candidates(logits, params);
  const double target = uniform_draw(seed, step) * c.kept_mass;
  double cumulative = 0.0;
  for (size_t i = 0; i < c.ids.size(); ++i) {
    cumulative += c.probs[i];
    if (target < cumulative) return c.ids[i];
  }
  return c.ids.back();
}

}  // namespace moe::engine
