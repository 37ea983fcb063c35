// The distribution a sampler should draw from, and a chi-square statistic,
// written independently of engine/sampler.cc from the definition of each
// filter. Shared by the CPU and GPU sampler tests.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "engine/sampler.h"

namespace moe::engine::testing_oracle {

// Filter by rank (top-k), by cumulative mass (top-p), by ratio (min-p).
std::vector<double> expected_distribution(const std::vector<float>& logits, const SamplingParams& p) {
  const size_t n = logits.size();
  std::vector<size_t> rank(n);
  std::iota(rank.begin(), rank.end(), 0);
  std::stable_sort(rank.begin(), rank.end(), [&](size_t a, size_t b) { return logits[a] > logits[b]; });
  size_t keep = (p.top_k > 0) ? std::min<size_t>(p.top_k, n) : n;
  std::vector<double> w(n, 0.0);
  double z = 0;
  for (size_t i = 0; i < keep; ++i) z += w[rank[i]] = std::exp((logits[rank[i]] - logits[rank[0]]) / p.temperature);
  double mass = 0;
  size_t nucleus = 0;
  while (nucleus < keep && mass < p.top_p) mass += w[rank[nucleus++]] / z;
  keep = std::max<size_t>(nucleus, 1);
  const double top = w[rank[0]] / z;
  size_t above = 1;
  while (above < keep && w[rank[above]] / z >= p.min_p * top) ++above;
  keep = above;
  std::vector<double> probs(n, 0.0);
  double kept = 0;
  for (size_t i = 0; i < keep; ++i) kept += w[rank[i]];
  for (size_t i = 0; i < keep; ++i) probs[rank[i]] = w[rank[i]] / kept;
  return probs;
}

// Pearson chi-square statistic of `counts` against `probs` over the support.
double chi_square(const std::vector<int>& counts, const std::vector<double>& probs, int draws, int* dof) {
  double stat = 0;
  *dof = -1;
  for (size_t i = 0; i < probs.size(); ++i) {
    if (probs[i] == 0) {
      EXPECT_EQ(counts[i], 0) << "token " << i << " is outside the filtered support";
      continue;
    }
    const double expected = probs[i] * draws;
    stat += (counts[i] - expected) * (counts[i] - expected) / expected;
    ++*dof;
  }
  return stat;
}

// Eight logits and five filter settings (plain, top-k, top-p, min-p, all
// three) that every sampler is checked on.
inline std::vector<float> standard_logits() { return {1.0f, 2.5f, 0.3f, 2.4f, -1.0f, 1.9f, 0.0f, 3.0f}; }
inline std::vector<SamplingParams> standard_cases() {
  std::vector<SamplingParams> cases(5);
  cases[0].temperature = 1.0f;
  cases[1].temperature = 0.7f, cases[1].top_k = 3;
  cases[2].temperature = 1.3f, cases[2].top_p = 0.8f;
  cases[3].temperature = 1.0f, cases[3].min_p = 0.3f;
  cases[4].temperature = 0.9f, cases[4].top_k = 6, cases[4].top_p = 0.9f, cases[4].min_p = 0.1f;
  return cases;
}
// The 99.9th percentile of chi-square with <= 7 degrees of freedom: with fixed
// seeds a test against it is deterministic, not flaky.
inline constexpr double kChiSquare999 = 24.3;

}  // namespace moe::engine::testing_oracle
