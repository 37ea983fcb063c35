// GPU sampling against the definition of the filtered distribution (the same
// oracle as the CPU sampler's test) with a chi-square test over many seeded
// rows; greedy rows against the CPU argmax; kept-set checks at Qwen3's vocab.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <numeric>
#include <random>
#include <set>

#include "core/cuda/device_buffer.h"
#include "engine/sampler.h"
#include "ops/cuda/kernels.h"
#include "tests/engine/sampling_oracle.h"

namespace moe::ops::cuda {
namespace {

using engine::SamplingParams;

bool have_gpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

// Samples `rows` rows of `logits` (repeated) with params, seeds and steps per row.
std::vector<int32_t> sample_on_gpu(const std::vector<float>& logits, int rows, const SamplingParams& params,
                                   uint64_t seed) {
  const int vocab = static_cast<int>(logits.size());
  std::vector<float> all(static_cast<size_t>(rows) * vocab);
  for (int r = 0; r < rows; ++r) std::copy(logits.begin(), logits.end(), all.begin() + static_cast<int64_t>(r) * vocab);
  std::vector<SampleRow> row_params(rows);
  for (int r = 0; r < rows; ++r)
    row_params[r] = {params.temperature, params.top_k, params.top_p, params.min_p, seed, static_cast<uint64_t>(r)};
  auto d_logits = DeviceBuffer::allocate(all.size() * sizeof(float));
  auto d_rows = DeviceBuffer::allocate(row_params.size() * sizeof(SampleRow));
  auto d_tokens = DeviceBuffer::allocate(rows * sizeof(int32_t));
  EXPECT_TRUE(d_logits && d_rows && d_tokens);
  cudaMemcpy(d_logits->data(), all.data(), all.size() * sizeof(float), cudaMemcpyHostToDevice);
  cudaMemcpy(d_rows->data(), row_params.data(), row_params.size() * sizeof(SampleRow), cudaMemcpyHostToDevice);
  EXPECT_EQ(sample({d_logits->data_as<float>(), d_rows->data_as<SampleRow>(), d_tokens->data_as<int32_t>(), rows, vocab},
                   nullptr),
            cudaSuccess);
  std::vector<int32_t> tokens(rows);
  EXPECT_EQ(cudaMemcpy(tokens.data(), d_tokens->data(), rows * sizeof(int32_t), cudaMemcpyDeviceToHost), cudaSuccess);
  return tokens;
}

TEST(CudaSampling, MatchesTheFilteredDistribution) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const std::vector<float> logits = engine::testing_oracle::standard_logits();
  const std::vector<SamplingParams> cases = engine::testing_oracle::standard_cases();
  constexpr int kDraws = 40000;
  for (size_t c = 0; c < cases.size(); ++c) {
    const auto probs = engine::testing_oracle::expected_distribution(logits, cases[c]);
    std::vector<int> counts(logits.size());
    for (int32_t token : sample_on_gpu(logits, kDraws, cases[c], 77 + c)) {
      ASSERT_GE(token, 0);
      ASSERT_LT(token, static_cast<int32_t>(logits.size()));
      ++counts[token];
    }
    int dof = 0;
    const double stat = engine::testing_oracle::chi_square(counts, probs, kDraws, &dof);
    EXPECT_LT(stat, engine::testing_oracle::kChiSquare999) << "case " << c << " dof " << dof;
  }
}

TEST(CudaSampling, GreedyAndKeptSetsAtFullVocabulary) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> logits(151936);
  for (auto& v : logits) v = normal(rng);
  SamplingParams greedy;
  greedy.temperature = 0;
  EXPECT_EQ(sample_on_gpu(logits, 4, greedy, 1)[0], engine::argmax(logits));
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  SamplingParams top_k;
  top_k.temperature = 1.0f, top_k.top_k = 50;
  const std::set<int32_t> top50(order.begin(), order.begin() + 50);
  for (int32_t token : sample_on_gpu(logits, 256, top_k, 3)) EXPECT_TRUE(top50.count(token)) << token;
  SamplingParams min_p;
  min_p.temperature = 1.0f, min_p.min_p = 0.2f;
  for (int32_t token : sample_on_gpu(logits, 256, min_p, 4))
    EXPECT_GE(logits[token], logits[order[0]] + std::log(0.2f) - 1e-4f) << token;
  SamplingParams seeded;
  seeded.temperature = 1.0f, seeded.top_p = 0.9f;
  EXPECT_EQ(sample_on_gpu(logits, 64, seeded, 9), sample_on_gpu(logits, 64, seeded, 9));
}

}  // namespace
}  // namespace moe::ops::cuda
