// The sampler against exact distributions computed here in double precision
// from the definition of each filter, with a chi-square goodness-of-fit test.
#include "engine/sampler.h"

#include "tests/engine/sampling_oracle.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>

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
  EXPECT_TRUE(validate_sampling(SamplingParams{}).is_ok());
}

}  // namespace
}  // namespace moe::engine
