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
  auto outside = [&](int32_t t) { return t < 0 || (vocab_size > 0 && t >= vocab_size); };
  for (const auto& word : p.bad_words) {
    if (word.empty()) return invalid_argument("bad_words holds a word of no tokens");
    for (int32_t t : word)
      if (outside(t)) return invalid_argument("bad_words names token {}, outside the vocabulary [0, {})", t, vocab_size);
  }
  for (int32_t t : p.allowed_token_ids)
    if (outside(t))
      return invalid_argument("allowed_token_ids names token {}, outside the vocabulary [0, {})", t, vocab_size);
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
  const std::span<const int32_t> output = tokens.last(num_output);
  for (const auto& word : p.bad_words) {
    const size_t prefix = word.size() - 1;
    if (in_vocab(word.back()) && prefix <= output.size() &&
        std::equal(word.begin(), word.end() - 1, output.end() - static_cast<std::ptrdiff_t>(prefix)))
      entry(word.back()).bias = kBanned;
  }
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

void apply_token_masks(std::span<float> logits, int64_t vocab, const StepSampling& sampling) {
  const int64_t words = mask_words_per_row(vocab);
  const int64_t rows =
      std::min(vocab > 0 ? static_cast<int64_t>(logits.size()) / vocab : 0, static_cast<int64_t>(sampling.rows.size()));
  CHECK(static_cast<int64_t>(sampling.mask_words.size()) == static_cast<int64_t>(sampling.mask_rows.size()) * words,
        "{} mask words for {} masked rows of {} tokens", sampling.mask_words.size(), sampling.mask_rows.size(), vocab);
  for (size_t i = 0; i < sampling.mask_rows.size(); ++i) {
    const int64_t r = sampling.mask_rows[i];
    CHECK(r >= 0 && r < rows, "masked row {} of {} sampled rows", r, rows);
    const std::span<const uint32_t> mask(sampling.mask_words.data() + static_cast<int64_t>(i) * words,
                                         static_cast<size_t>(words));
    float* row = logits.data() + r * vocab;
    for (int32_t t = 0; t < vocab; ++t)
      if (!mask_keeps(mask, t)) row[t] = -std::numeric_limits<float>::infinity();
  }
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

namespace {

// A non-greedy draw's candidates, sorted only as far as they are read: ids in
// descending logit order (ties: lower id first), their probabilities (the
// softmax over the top_k set, or the vocabulary), and the cuts of top_p and
// min_p. A cut or a draw usually ends within the first hundred tokens, so
// without top_k the vocabulary is sorted in growing prefixes rather than
// whole: at Qwen3's 151,936 tokens a top_p 0.9 draw took 22-27 ms with the
// full sort, ~1.5-2 ms now (one core, the same draws).
class Candidates {
 public:
  Candidates(std::span<const float> logits, const SamplingParams& params)
      : logits_(logits), temperature_(params.temperature) {
    const auto vocab = static_cast<int32_t>(logits.size());
    order_.resize(static_cast<size_t>(vocab));
    std::iota(order_.begin(), order_.end(), 0);
    if (params.top_k > 0 && params.top_k < vocab) {
      sort_prefix(params.top_k);
      order_.resize(static_cast<size_t>(params.top_k));
    }
    max_scaled_ = scaled(id(0));
    for (int32_t t : order_) total_ += std::exp(scaled(t) - max_scaled_);
    kept_ = size();
    bool in_order = sorted_ == size();  // the kept mass sums in descending order (as the cuts do)
    if (params.top_p < 1.0f) {
      double mass = 0.0;
      int32_t i = 0;
      while (i < kept_ && mass < params.top_p) mass += prob(i++);
      kept_ = std::max(i, 1);
      in_order = true;
    }
    if (params.min_p > 0.0f) {
      const double threshold = params.min_p * prob(0);
      int32_t i = 1;
      while (i < kept_ && prob(i) >= threshold) ++i;
      kept_ = i;
      in_order = true;
    }
    if (in_order) {
      for (int32_t i = 0; i < kept_; ++i) kept_mass_ += prob(i);
    } else {  // the whole vocabulary, unsorted
      for (int32_t t : order_) kept_mass_ += std::exp(scaled(t) - max_scaled_) / total_;
    }
  }

  int32_t size() const { return static_cast<int32_t>(order_.size()); }
  int32_t kept() const { return kept_; }
  double kept_mass() const { return kept_mass_; }
  // The i-th most probable candidate and its probability.
  int32_t id(int32_t i) {
    if (i >= sorted_) sort_prefix(std::min(size(), std::max({i + 1, 2 * sorted_, 128})));
    return order_[static_cast<size_t>(i)];
  }
  double prob(int32_t i) { return std::exp(scaled(id(i)) - max_scaled_) / total_; }

 private:
  double scaled(int32_t t) const {
    return static_cast<double>(logits_[static_cast<size_t>(t)]) / temperature_;
  }
  // Sorts order_[sorted_, n): the rest holds no larger logit than the sorted
  // part. A heap-based partial_sort for short prefixes; for long ones
  // selection then a sort of the selected (partial_sort of a growing prefix
  // cost several full sorts in a deep walk).
  void sort_prefix(int32_t n) {
    auto by_logit = [this](int32_t a, int32_t b) {
      const float la = logits_[static_cast<size_t>(a)], lb = logits_[static_cast<size_t>(b)];
      return la > lb || (la == lb && a < b);
    };
    if (n - sorted_ <= 1024) {
      std::partial_sort(order_.begin() + sorted_, order_.begin() + n, order_.end(), by_logit);
    } else {
      if (n < size()) std::nth_element(order_.begin() + sorted_, order_.begin() + n, order_.end(), by_logit);
      std::sort(order_.begin() + sorted_, order_.begin() + n, by_logit);
    }
    sorted_ = n;
  }

  std::span<const float> logits_;
  float temperature_;
  double max_scaled_ = 0, total_ = 0, kept_mass_ = 0;
  std::vector<int32_t> order_;
  int32_t sorted_ = 0, kept_ = 0;
};

}  // namespace

SamplingCandidates sampling_candidates(std::span<const float> logits, const SamplingParams& params) {
  CHECK(!params.is_greedy(), "a greedy request has no candidates to draw from");
  Candidates candidates(logits, params);
  SamplingCandidates c;
  for (int32_t i = 0; i < candidates.kept(); ++i) {
    c.ids.push_back(candidates.id(i));
    c.probs.push_back(candidates.prob(i));
  }
  c.kept_mass = candidates.kept_mass();
  return c;
}

int32_t sample_token(std::span<const float> logits, const SamplingParams& params, uint64_t seed, uint64_t step) {
  if (params.is_greedy()) return argmax(logits);
  Candidates c(logits, params);
  const double target = uniform_draw(seed, step) * c.kept_mass();
  double cumulative = 0.0;
  for (int32_t i = 0; i < c.kept(); ++i) {
    cumulative += c.prob(i);
    if (target < cumulative) return c.id(i);
  }
  return c.id(c.kept() - 1);
}

}  // namespace moe::engine
