#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <unordered_map>
#include <vector>

#include "core/check.h"

namespace moe::engine {

Status validate_sampling(const SamplingParams& p, int64_t vocab_size) {
  if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature))
    return invalid_argument("temperature must be a finite number >= 0, got {}", p.temperature);
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) return invalid_argument("top_p must be in (0, 1], got {}", p.top_p);
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) return invalid_argument("min_p must be in [0, 1], got {}", p.min_p);
  if (p.top_k < -1) return invalid_argument("top_k must be -1, 0 (off) or positive, got {}", p.top_k);
  if (!(p.presence_penalty >= -2.0f && p.presence_penalty <= 2.0f))
    return invalid_argument("presence_penalty must be in [-2, 2], got {}", p.presence_penalty);
  if (!(p.frequency_penalty >= -2.0f && p.frequency_penalty <= 2.0f))
    return invalid_argument("frequency_penalty must be in [-2, 2], got {}", p.frequency_penalty);
  if (!(p.repetition_penalty > 0.0f && p.repetition_penalty <= 2.0f))
    return invalid_argument("repetition_penalty must be in (0, 2], got {}", p.repetition_penalty);
  if (p.min_tokens < 0) return invalid_argument("min_tokens must be >= 0, got {}", p.min_tokens);
  for (const auto& [token, bias] : p.logit_bias) {
    if (token < 0 || (vocab_size > 0 && token >= vocab_size))
      return invalid_argument("logit_bias names token {}, outside the vocabulary [0, {})", token, vocab_size);
    if (!(bias >= -100.0f && bias <= 100.0f))
      return invalid_argument("logit_bias values must be in [-100, 100], got {} for token {}", bias, token);
  }
  return Status::ok();
}

std::vector<ops::LogitAdjustment> logit_adjustments(int32_t row, const SamplingParams& p,
                                                    std::span<const int32_t> tokens, size_t num_output,
                                                    std::span<const int32_t> stop_ids, int64_t vocab_size) {
  CHECK(num_output <= tokens.size(), "{} output tokens of {}", num_output, tokens.size());
  auto in_vocab = [&](int32_t t) { return t >= 0 && t < vocab_size; };
  std::map<int32_t, ops::LogitAdjustment> entries;
  auto entry = [&](int32_t t) -> ops::LogitAdjustment& {
    auto [it, added] = entries.try_emplace(t, ops::LogitAdjustment{row, t, 0.0f, 1.0f, 0.0f});
    return it->second;
  };
  constexpr float kBanned = -std::numeric_limits<float>::infinity();
  if (static_cast<int64_t>(num_output) < p.min_tokens)
    for (int32_t t : stop_ids)
      if (in_vocab(t)) entry(t).bias = kBanned;
  for (const auto& [t, bias] : p.logit_bias)
    if (in_vocab(t)) entry(t).bias += bias;  // stays -inf where banned
  if (p.repetition_penalty != 1.0f || p.frequency_penalty != 0.0f || p.presence_penalty != 0.0f) {
    std::unordered_map<int32_t, int> counts;  // each token seen: its output count (0: the prompt's only)
    const size_t prompt_len = tokens.size() - num_output;
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (!in_vocab(tokens[i])) continue;
      int& count = counts[tokens[i]];
      if (i >= prompt_len) ++count;
    }
    for (const auto& [t, count] : counts) {
      if (p.repetition_penalty == 1.0f && count == 0) continue;
      ops::LogitAdjustment& e = entry(t);
      e.repetition = p.repetition_penalty;
      if (count > 0) e.subtract = static_cast<float>(count) * p.frequency_penalty + p.presence_penalty;
    }
  }
  std::vector<ops::LogitAdjustment> out;
  out.reserve(entries.size());
  for (const auto& [t, e] : entries) out.push_back(e);
  return out;
}

void adjust_logits(std::span<float> logits, const SamplingParams& params, std::span<const int32_t> tokens,
                   size_t num_output, std::span<const int32_t> stop_ids) {
  for (const ops::LogitAdjustment& a :
       logit_adjustments(0, params, tokens, num_output, stop_ids, static_cast<int64_t>(logits.size())))
    logits[a.token] = ops::adjusted_logit(logits[a.token], a);
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
  size_t best = 0;
  float best_value = logits[0];
  for (size_t i = 1; i < logits.size(); ++i)
    if (logits[i] > best_value) best = i, best_value = logits[i];
  return static_cast<int32_t>(best);
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
