// The sampler against exact distributions computed here in double precision
// from the definition of each filter, with a chi-square goodness-of-fit test.
#include "engine/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>

#include "engine/speculative.h"
#include "tests/engine/sampling_oracle.h"

namespace moe::engine {
namespace {

using testing_oracle::chi_square;
using testing_oracle::expected_distribution;

TEST(Sampler, GreedyIsArgmaxWithLowestIdOnTies) {
  std::vector<float> logits = {0.5f, 2.0f, -1.0f, 2.0f};
  SamplingParams greedy;
  greedy.temperature = 0;
  EXPECT_EQ(sample_token(logits, greedy, 0, 0), 1);
}

TEST(Sampler, MatchesTheFilteredDistribution) {
  const std::vector<float> logits = testing_oracle::standard_logits();
  const std::vector<SamplingParams> cases = testing_oracle::standard_cases();
  constexpr int kDraws = 40000;
  for (size_t c = 0; c < cases.size(); ++c) {
    const auto probs = expected_distribution(logits, cases[c]);
    std::vector<int> counts(logits.size());
    for (int i = 0; i < kDraws; ++i) ++counts[sample_token(logits, cases[c], 1234 + c, i)];
    int dof = 0;
    const double stat = chi_square(counts, probs, kDraws, &dof);
    EXPECT_LT(stat, testing_oracle::kChiSquare999) << "case " << c << " dof " << dof;
  }
}

// At Qwen3's vocabulary (151,936 logits, a few peaks over a wide tail, ties
// included), where the candidates are sorted only as far as read: the
// distribution equals the oracle's, and every draw is the oracle's inverse
// CDF (descending order, lower id first on ties) at the same uniform draw.
TEST(Sampler, LargeVocabularyDrawsAreTheOraclesInverseCdf) {
  constexpr int kVocab = 151936;
  std::vector<float> logits(kVocab);
  uint64_t state = 12345;
  for (int i = 0; i < kVocab; ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    const double u = static_cast<double>(state >> 11) * (1.0 / 9007199254740992.0);
    logits[i] =
        static_cast<float>(std::round(8 * std::log(u / (1 - u + 1e-12) + 1e-12)) / 8);  // logistic, 1/8 steps
  }
  for (int i = 0; i < 40; ++i) logits[(i * 7919) % kVocab] = 14.0f - 0.25f * static_cast<float>(i % 20);
  std::vector<SamplingParams> cases(5);
  cases[0].temperature = 1.0f;
  cases[1].temperature = 0.7f, cases[1].top_p = 0.9f;
  cases[2].temperature = 1.0f, cases[2].top_p = 0.999f;
  cases[3].temperature = 0.8f, cases[3].min_p = 0.01f;
  cases[4].temperature = 0.6f, cases[4].top_k = 2000, cases[4].top_p = 0.95f;
  for (size_t c = 0; c < cases.size(); ++c) {
    SCOPED_TRACE(testing::Message() << "case " << c);
    const std::vector<double> want = expected_distribution(logits, cases[c]);
    const std::vector<double> got = sampling_distribution(logits, cases[c]);
    size_t support = 0;
    for (int i = 0; i < kVocab; ++i) {
      ASSERT_EQ(got[i] == 0, want[i] == 0) << "token " << i;
      ASSERT_NEAR(got[i], want[i], 1e-5 * want[i] + 1e-15) << "token " << i;  // the oracle subtracts in float
      support += want[i] > 0;
    }
    std::vector<int32_t> descending(kVocab);
    std::iota(descending.begin(), descending.end(), 0);
    std::stable_sort(descending.begin(), descending.end(),
                     [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
    // The draws' oracle: the kept tokens' softmax in double precision.
    std::vector<double> p(kVocab, 0.0);
    double z = 0;
    for (int32_t t : descending)
      if (want[t] > 0)
        z += p[t] = std::exp((static_cast<double>(logits[t]) - logits[descending[0]]) / cases[c].temperature);
    for (double& v : p) v /= z;
    constexpr int kDraws = 60;
    for (int step = 0; step < kDraws; ++step) {
      const double u = uniform_draw(7 + c, step);
      double cumulative = 0;
      int32_t expected = -1;
      for (int32_t t : descending) {
        if (p[t] == 0) continue;
        expected = t;
        if (u < (cumulative += p[t])) break;
      }
      ASSERT_EQ(sample_token(logits, cases[c], 7 + c, step), expected) << "step " << step;
    }
    EXPECT_GT(support, 1u);
  }
}

TEST(Sampler, SeededDrawsAreReproducible) {
  std::vector<float> logits(1000);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = std::sin(static_cast<float>(i) * 0.37f) * 3;
  SamplingParams p;
  p.temperature = 1.0f;
  std::vector<int32_t> a, b, c;
  for (int step = 0; step < 50; ++step) {
    a.push_back(sample_token(logits, p, 42, step));
    b.push_back(sample_token(logits, p, 42, step));
    c.push_back(sample_token(logits, p, 43, step));
  }
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
}

TEST(Sampler, UniformDrawsAreUniform) {
  std::vector<int> buckets(10);
  for (int i = 0; i < 100000; ++i) {
    const double u = uniform_draw(9, i);
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    ++buckets[static_cast<int>(u * 10)];
  }
  int dof = 0;
  const double stat = chi_square(buckets, std::vector<double>(10, 0.1), 100000, &dof);
  EXPECT_LT(stat, 27.9);  // 99.9th percentile, 9 dof
}

TEST(Sampler, ValidationNamesTheParameter) {
  SamplingParams p;
  p.temperature = -1;
  EXPECT_NE(validate_sampling(p).message().find("temperature"), std::string::npos);
  p = {};
  p.top_p = 0;
  EXPECT_NE(validate_sampling(p).message().find("top_p"), std::string::npos);
  p = {};
  p.min_p = 1.5f;
  EXPECT_NE(validate_sampling(p).message().find("min_p"), std::string::npos);
  p = {};
  p.top_k = -5;
  EXPECT_NE(validate_sampling(p).message().find("top_k"), std::string::npos);
  p = {};
  p.repetition_penalty = 0;
  EXPECT_NE(validate_sampling(p).message().find("repetition_penalty"), std::string::npos);
  p = {};
  p.frequency_penalty = 2.5f;
  EXPECT_NE(validate_sampling(p).message().find("frequency_penalty"), std::string::npos);
  p = {};
  p.logit_bias = {{600, 1.0f}};
  EXPECT_TRUE(validate_sampling(p).is_ok());  // no vocabulary to check against
  EXPECT_NE(validate_sampling(p, 512).message().find("logit_bias"), std::string::npos);
  p.logit_bias = {{6, 100.5f}};
  EXPECT_NE(validate_sampling(p, 512).message().find("logit_bias"), std::string::npos);
  EXPECT_TRUE(validate_sampling(SamplingParams{}).is_ok());
}

// The adjustments' bookkeeping, each written out from its definition: the
// frequency and presence penalties count output tokens only, the repetition
// penalty reaches the prompt's tokens once however often they occur,
// min_tokens bans the stop ids until that many tokens exist (ids outside the
// vocabulary are skipped), and a draw after the adjustments follows the
// adjusted distribution.
TEST(Sampler, AdjustmentsFollowTheirDefinitions) {
  const std::vector<float> base = testing_oracle::standard_logits();  // 8 tokens
  const std::vector<int32_t> tokens = {1, 1, 5, 3, 3, 3, 6};          // prompt {1, 1, 5}, output {3, 3, 3, 6}
  SamplingParams p;
  p.repetition_penalty = 2.0f;
  p.frequency_penalty = 0.25f;
  p.presence_penalty = 0.5f;
  p.logit_bias = {{0, 1.5f}, {6, -0.75f}};
  p.min_tokens = 5;
  std::vector<float> v = base;
  adjust_logits(v, p, tokens, 4, std::vector<int32_t>{7, 99});
  std::vector<float> want = base;
  want[7] = -std::numeric_limits<float>::infinity();  // 4 output tokens < min_tokens 5
  want[0] += 1.5f;
  want[6] += -0.75f;
  auto repeat = [](float x) { return x > 0 ? x / 2.0f : x * 2.0f; };
  want[1] = repeat(want[1]);  // prompt only: no count
  want[5] = repeat(want[5]);
  want[3] = repeat(want[3]) - (3 * 0.25f + 0.5f);  // three times in the output
  want[6] = repeat(want[6]) - (1 * 0.25f + 0.5f);
  EXPECT_EQ(v, want);
  v = base;
  adjust_logits(v, p, tokens, 4, std::vector<int32_t>{});
  EXPECT_TRUE(std::isfinite(v[7]));
  p = {};
  p.min_tokens = 4;
  v = base;
  adjust_logits(v, p, tokens, 4, std::vector<int32_t>{7});
  EXPECT_EQ(v, base) << "min_tokens reached";
  // Sampling then draws from the adjusted logits.
  p = {};
  p.temperature = 0.8f;
  p.top_k = 6;
  p.frequency_penalty = 1.0f;
  p.logit_bias = {{2, 2.0f}};
  std::vector<float> adjusted = base;
  adjust_logits(adjusted, p, tokens, 4, {});
  const auto probs = expected_distribution(adjusted, p);
  constexpr int kDraws = 40000;
  std::vector<int> counts(base.size());
  for (int i = 0; i < kDraws; ++i) ++counts[sample_token(adjusted, p, 77, i)];
  int dof = 0;
  EXPECT_LT(chi_square(counts, probs, kDraws, &dof), testing_oracle::kChiSquare999) << dof;
  EXPECT_GT(probs[2], expected_distribution(base, p)[2]);
}

// bad_words: a word's last token is banned where its other tokens end the
// output (not the prompt); a one-token word always; logit_bias cannot lift a
// ban. Validation names the field.
TEST(Sampler, BadWordsBanTheirLastTokenAfterTheirPrefix) {
  const std::vector<float> base = testing_oracle::standard_logits();  // 8 tokens
  const std::vector<int32_t> tokens = {4, 2, 5, 3};                   // prompt {4, 2}, output {5, 3}
  SamplingParams p;
  p.bad_words = {{1}, {5, 3, 6}, {3, 7}, {2, 5, 0}, {4, 2, 5, 3, 2}, {9, 9}};
  p.logit_bias = {{1, 50.0f}};
  EXPECT_TRUE(p.adjusts_logits());
  std::vector<float> v = base;
  adjust_logits(v, p, tokens, 2, {});
  std::vector<float> want = base;
  const float banned = -std::numeric_limits<float>::infinity();
  want[1] = banned;  // one token, biased or not
  want[6] = banned;  // 5 3 ends the output
  want[7] = banned;  // 3 ends the output
  EXPECT_EQ(v, want) << "{2, 5, 0} and {4, 2, 5, 3, 2} reach into the prompt; 9 is outside the vocabulary";
  v = base;
  adjust_logits(v, p, tokens, 4, {});  // all four tokens are output now: 4 2 5 3 ends it
  want[2] = banned;
  EXPECT_EQ(v, want);
  for (const auto& [words, field] : std::vector<std::pair<std::vector<std::vector<int32_t>>, std::string>>{
           {{{1}, {}}, "bad_words"}, {{{1, 8}}, "bad_words"}, {{{-1}}, "bad_words"}}) {
    SamplingParams bad;
    bad.bad_words = words;
    const Status s = validate_sampling(bad, 8);
    EXPECT_FALSE(s.is_ok());
    EXPECT_NE(s.message().find(field), std::string::npos) << s.to_string();
  }
  SamplingParams allowed;
  allowed.allowed_token_ids = {0, 8};
  EXPECT_NE(validate_sampling(allowed, 8).message().find("allowed_token_ids"), std::string::npos);
  allowed.allowed_token_ids = {0, 7};
  EXPECT_TRUE(validate_sampling(allowed, 8).is_ok());
  EXPECT_FALSE(allowed.adjusts_logits()) << "a mask, not an adjustment";
}

// Token masks: a masked row keeps exactly the tokens whose bits are set (bit
// t % 32 of word t / 32, the last word partly used) after its adjustments;
// other rows are left alone; the sampler then picks among the kept tokens.
TEST(Sampler, TokenMasksKeepTheirTokensAfterTheAdjustments) {
  constexpr int64_t kVocab = 40;  // two words, the second 8 bits used
  ASSERT_EQ(mask_words_per_row(kVocab), 2);
  ASSERT_EQ(mask_words_per_row(32), 1);
  Tensor logits(DType::kF32, {3, kVocab});
  for (int64_t i = 0; i < 3 * kVocab; ++i) logits.data_as<float>()[i] = static_cast<float>(i % kVocab) * 0.1f;
  StepSampling sampling;
  for (int r = 0; r < 3; ++r) {
    SamplingParams greedy;
    greedy.temperature = 0;
    sampling.rows.push_back({greedy, 0, 0});
    sampling.drafts.push_back(-1);
  }
  // Row 2 keeps tokens 3, 33 and 39; row 0 keeps 5 and 6, 6 banned by its adjustment.
  sampling.mask_rows = {2, 0};
  sampling.mask_words = {1u << 3, (1u << 1) | (1u << 7), (1u << 5) | (1u << 6), 0u};
  sampling.adjustments.push_back({0, 6, -std::numeric_limits<float>::infinity(), 1.0f, 0.0f});
  const Tensor before = Tensor::copy_of(logits.view());
  const SampledStep out = sample_on_host(logits, sampling);
  EXPECT_EQ(out.tokens, (std::vector<int32_t>{5, 39, 39}));  // row 1: its argmax, unmasked
  for (int64_t t = 0; t < kVocab; ++t) {
    const float v0 = logits.data_as<float>()[t], v1 = logits.data_as<float>()[kVocab + t],
                v2 = logits.data_as<float>()[2 * kVocab + t];
    EXPECT_EQ(std::isinf(v0), t != 5) << t;
    EXPECT_EQ(v1, before.data_as<float>()[kVocab + t]) << t;
    EXPECT_EQ(std::isinf(v2), t != 3 && t != 33 && t != 39) << t;
  }
}

}  // namespace
}  // namespace moe::engine
