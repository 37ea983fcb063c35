// Token sampling from a row of logits.
//
// A request may first adjust its logits (adjust_logits, before the argmax or
// the draw), in vLLM's order: min_tokens bans the stop tokens while fewer
// tokens were generated; logit_bias adds to chosen logits; the repetition
// penalty r divides the positive logits of every token of the prompt or the
// output by r and multiplies the others by r (as transformers'
// RepetitionPenaltyLogitsProcessor); the frequency and presence penalties
// subtract count x frequency + (count > 0) x presence, counting the output
// tokens only (OpenAI's definition).
//
// temperature == 0 is greedy: the highest logit, the lowest token id on ties
// (as torch.argmax). Otherwise, in this order (vLLM's): logits / temperature,
// keep the top_k highest (top_k <= 0: all), softmax, keep the smallest set of
// most probable tokens whose mass reaches top_p, drop tokens whose probability
// is below min_p * the highest probability, renormalise, and draw.
//
// Draws are reproducible: the uniform number for step s of a sequence comes
// from a counter-based generator keyed by (seed, s), so a seeded request gives
// the same tokens whatever else is in its batch. Pure functions: any thread.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "ops/logit_adjust.h"

namespace moe::engine {

struct SamplingParams {
  float temperature = 1.0f;
  int top_k = 0;        // <= 0: off
  float top_p = 1.0f;   // (0, 1]
  float min_p = 0.0f;   // [0, 1]
  std::optional<uint64_t> seed;  // unseeded requests get a random seed at admission
  // Logits adjustments (the neutral values leave the logits alone).
  float presence_penalty = 0.0f;                      // [-2, 2]
  float frequency_penalty = 0.0f;                     // [-2, 2]
  float repetition_penalty = 1.0f;                    // (0, 2]
  int min_tokens = 0;                                 // >= 0
  std::vector<std::pair<int32_t, float>> logit_bias;  // (token id, bias in [-100, 100])
  // vLLM's bad_words, as token sequences (non-empty): the last token of each
  // is banned wherever the output so far ends with the others (a one-token
  // word: always).
  std::vector<std::vector<int32_t>> bad_words;
  // vLLM's allowed_token_ids: every other token is masked out, as a structured
  // output's mask is (and together with it). Empty: no such restriction.
  std::vector<int32_t> allowed_token_ids;

  bool is_greedy() const { return temperature == 0.0f; }
  bool adjusts_logits() const {
    return presence_penalty != 0.0f || frequency_penalty != 0.0f || repetition_penalty != 1.0f ||
           min_tokens > 0 || !logit_bias.empty() || !bad_words.empty();
  }
};

// What one logits row needs to be sampled anywhere: the draw for (seed, step).
struct RowSampling {
  SamplingParams params;
  uint64_t seed = 0;
  uint64_t step = 0;
};

// What a step samples: the first rows.size() logits rows of the batch, one
// RowSampling each. A row with a draft verifies it by rejection sampling
// against the row's distribution (the draft proposed as certain: accepted
// with the probability the row gives it, else a token drawn from the row's
// distribution without it; greedy rows accept a draft equal to their argmax).
// The adjustments (logit_adjustments below) apply to their rows
// before sampling, then the token masks (structured outputs): row
// mask_rows[i] keeps the tokens whose bit is set in its mask -- words
// [i * w, (i + 1) * w) of mask_words, w = mask_words_per_row(vocab), bit
// t % 32 of word t / 32 for token t -- and every other token's logit
// becomes -inf. fetch_rows (any logits rows, prompt-logits rows included)
// come back as the model produced them, for logprobs.
struct StepSampling {
  std::vector<RowSampling> rows;
  std::vector<int32_t> drafts;  // per row: the draft token it verifies, or -1
  std::vector<ops::LogitAdjustment> adjustments;
  std::vector<int32_t> mask_rows;    // distinct sampled rows
  std::vector<uint32_t> mask_words;  // [mask_rows.size(), mask_words_per_row(vocab)]
  std::vector<int32_t> fetch_rows;
};
inline int64_t mask_words_per_row(int64_t vocab_size) { return (vocab_size + 31) / 32; }
// Whether a mask keeps token `t`.
inline bool mask_keeps(std::span<const uint32_t> mask, int32_t t) {
  return (mask[static_cast<size_t>(t) / 32] >> (static_cast<uint32_t>(t) % 32)) & 1u;
}
// The masks of `sampling` applied to logits [rows, vocab] (the host's
// sampler; the GPU's is ops/cuda/kernels.h mask_logits). The rows and the
// words' count must be in range (CHECK).
void apply_token_masks(std::span<float> logits, int64_t vocab, const StepSampling& sampling);
struct SampledStep {
  std::vector<int32_t> tokens;    // per row: the sample; a draft row's draft when accepted
  std::vector<uint8_t> accepted;  // per row: 1 where its draft was accepted
  Tensor fetched;                 // [fetch_rows, vocab] f32
};

// Checks ranges; the message names the parameter (it reaches API users).
// With vocab_size > 0, also that logit_bias, bad_words and allowed_token_ids
// name tokens of the vocabulary.
Status validate_sampling(const SamplingParams& params, int64_t vocab_size = 0);

// The adjustments above (and bad_words' bans, first) for logits row `row` of a sequence whose prompt and
// output so far are `tokens` (the output is the last num_output of them), as
// one entry per touched token of the vocabulary (ascending ids); `stop_ids`
// are the tokens min_tokens bans (eos unless ignored, and the request's stop
// token ids). Empty when the request adjusts nothing.
std::vector<ops::LogitAdjustment> logit_adjustments(int32_t row, const SamplingParams& params,
                                                    std::span<const int32_t> tokens, size_t num_output,
                                                    std::span<const int32_t> stop_ids, int64_t vocab_size);
// The same, applied in place to one row.
void adjust_logits(std::span<float> logits, const SamplingParams& params, std::span<const int32_t> tokens,
                   size_t num_output, std::span<const int32_t> stop_ids);

// A uniform double in [0, 1) for draw `step` of generator `seed`.
double uniform_draw(uint64_t seed, uint64_t step);

int32_t argmax(std::span<const float> logits);

// The tokens a non-greedy draw chooses among: ids in descending logit order
// (ties: lower id first), cut by top_k, top_p and min_p, with their
// probabilities (the softmax over the top_k, before the final
// renormalisation by `kept_mass`, their sum).
struct SamplingCandidates {
  std::vector<int32_t> ids;
  std::vector<double> probs;
  double kept_mass = 0;
};
SamplingCandidates sampling_candidates(std::span<const float> logits, const SamplingParams& params);

// `seed` must be set unless greedy.
int32_t sample_token(std::span<const float> logits, const SamplingParams& params, uint64_t seed, uint64_t step);

}  // namespace moe::engine
