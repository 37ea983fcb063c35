// GPU sampling against the definition of the filtered distribution (the same
// oracle as the CPU sampler's test) with a chi-square test over many seeded
// rows; greedy rows against the CPU argmax; kept-set checks at Qwen3's vocab.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
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

// Samples `rows` rows of `logits` (repeated) with params, seeds and steps per
// row; with a draft, every row verifies it and `accepted` gets the verdicts.
std::vector<int32_t> sample_on_gpu(const std::vector<float>& logits, int rows, const SamplingParams& params,
                                   uint64_t seed, int32_t draft = -1,
                                   std::vector<uint8_t>* accepted = nullptr) {
  const int vocab = static_cast<int>(logits.size());
  std::vector<float> all(static_cast<size_t>(rows) * vocab);
  for (int r = 0; r < rows; ++r) std::copy(logits.begin(), logits.end(), all.begin() + static_cast<int64_t>(r) * vocab);
  std::vector<SampleRow> row_params(rows);
  for (int r = 0; r < rows; ++r)
    row_params[r] = {params.temperature,       params.top_k,   params.top_p, params.min_p, seed,
                     static_cast<uint64_t>(r), seed ^ 0x9e37u, draft};
  auto d_logits = DeviceBuffer::allocate(all.size() * sizeof(float));
  auto d_rows = DeviceBuffer::allocate(row_params.size() * sizeof(SampleRow));
  auto d_tokens = DeviceBuffer::allocate(rows * sizeof(int32_t));
  auto d_accepted = DeviceBuffer::allocate(rows);
  EXPECT_TRUE(d_logits && d_rows && d_tokens && d_accepted);
  cudaMemcpy(d_logits->data(), all.data(), all.size() * sizeof(float), cudaMemcpyHostToDevice);
  cudaMemcpy(d_rows->data(), row_params.data(), row_params.size() * sizeof(SampleRow), cudaMemcpyHostToDevice);
  EXPECT_EQ(sample({d_logits->data_as<float>(), d_rows->data_as<SampleRow>(), d_tokens->data_as<int32_t>(),
                    d_accepted->data_as<uint8_t>(), rows, vocab},
                   nullptr),
            cudaSuccess);
  std::vector<int32_t> tokens(rows);
  EXPECT_EQ(cudaMemcpy(tokens.data(), d_tokens->data(), rows * sizeof(int32_t), cudaMemcpyDeviceToHost), cudaSuccess);
  if (accepted != nullptr) {
    accepted->resize(static_cast<size_t>(rows));
    EXPECT_EQ(cudaMemcpy(accepted->data(), d_accepted->data(), rows, cudaMemcpyDeviceToHost), cudaSuccess);
  }
  return tokens;
}

// Each row's token follows the filtered distribution: plain rows, and rows
// verifying a proposed-as-certain draft (rejection sampling), whatever the
// draft (a likely and an unlikely one). A row reports its draft accepted
// exactly when it emits it (the resample never returns the draft), at the
// draft's probability. Greedy rows accept the argmax only.
TEST(CudaSampling, MatchesTheFilteredDistributionWithAndWithoutDrafts) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const std::vector<float> logits = engine::testing_oracle::standard_logits();
  const std::vector<SamplingParams> cases = engine::testing_oracle::standard_cases();
  constexpr int kDraws = 40000;
  for (size_t c = 0; c < cases.size(); ++c) {
    const auto probs = engine::testing_oracle::expected_distribution(logits, cases[c]);
    for (int32_t draft : {-1, 7, 4}) {
      std::vector<uint8_t> accepted;
      const std::vector<int32_t> tokens = sample_on_gpu(logits, kDraws, cases[c], 500 + c, draft, &accepted);
      std::vector<int> counts(logits.size());
      int num_accepted = 0;
      for (int i = 0; i < kDraws; ++i) {
        ASSERT_GE(tokens[i], 0);
        ASSERT_LT(tokens[i], static_cast<int32_t>(logits.size()));
        ASSERT_EQ(accepted[i] != 0, tokens[i] == draft) << "case " << c << " draw " << i;
        ++counts[tokens[i]];
        num_accepted += accepted[i];
      }
      int dof = 0;
      const double stat = engine::testing_oracle::chi_square(counts, probs, kDraws, &dof);
      EXPECT_LT(stat, engine::testing_oracle::kChiSquare999)
          << "case " << c << " draft " << draft << " dof " << dof;
      // The acceptance rate is the draft's probability (5 standard deviations).
      if (draft < 0) {
        EXPECT_EQ(num_accepted, 0);
        continue;
      }
      const double p = probs[static_cast<size_t>(draft)];
      EXPECT_NEAR(num_accepted / double{kDraws}, p, 5 * std::sqrt(p * (1 - p) / kDraws) + 1e-9)
          << "case " << c;
    }
  }
  SamplingParams greedy;
  greedy.temperature = 0;
  const int32_t best = engine::argmax(logits);
  for (int32_t draft : {best, (best + 1) % static_cast<int32_t>(logits.size())}) {
    std::vector<uint8_t> accepted;
    const auto tokens = sample_on_gpu(logits, 4, greedy, 1, draft, &accepted);
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(tokens[i], best);
      EXPECT_EQ(accepted[i] != 0, draft == best);
    }
  }
}

// Penalties, bias and min_tokens' ban as sparse entries on the GPU equal the
// CPU's adjust_logits on Qwen3-sized rows (the same float operations).
TEST(CudaSampling, AdjustLogitsEqualsTheCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  constexpr int kVocab = 151936, kRows = 4;
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::uniform_int_distribution<int32_t> token(0, kVocab - 1);
  std::vector<float> logits(static_cast<size_t>(kRows) * kVocab);
  for (auto& v : logits) v = normal(rng);
  std::vector<float> expected = logits;
  std::vector<LogitAdjustment> entries;
  for (int r = 0; r < kRows; ++r) {
    SamplingParams p;
    p.repetition_penalty = r == 0 ? 1.0f : 1.3f;
    p.presence_penalty = r == 1 ? 0.0f : 0.7f;
    p.frequency_penalty = r == 3 ? -0.4f : 0.5f;
    p.min_tokens = r == 2 ? 200 : 0;  // 120 output tokens: row 2 bans the stop tokens
    p.logit_bias = {{token(rng), 5.0f}, {token(rng), -100.0f}, {7, 1.5f}};
    std::vector<int32_t> tokens;
    for (int i = 0; i < 300; ++i)
      tokens.push_back(i % 3 == 0 ? token(rng) % 50 : token(rng));  // repeats among 0..49
    const std::vector<int32_t> stop = {7, 151645};
    const auto row = engine::logit_adjustments(r, p, tokens, 120, stop, kVocab);
    ASSERT_FALSE(row.empty());
    entries.insert(entries.end(), row.begin(), row.end());
    engine::adjust_logits(std::span<float>(expected.data() + static_cast<int64_t>(r) * kVocab, kVocab), p,
                          tokens, 120, stop);
  }
  auto d_logits = DeviceBuffer::allocate(logits.size() * sizeof(float));
  auto d_entries = DeviceBuffer::allocate(entries.size() * sizeof(LogitAdjustment));
  ASSERT_TRUE(d_logits && d_entries);
  cudaMemcpy(d_logits->data(), logits.data(), logits.size() * sizeof(float), cudaMemcpyHostToDevice);
  cudaMemcpy(d_entries->data(), entries.data(), entries.size() * sizeof(LogitAdjustment),
             cudaMemcpyHostToDevice);
  ASSERT_EQ(adjust_logits({d_logits->data_as<float>(), d_entries->data_as<LogitAdjustment>(),
                           static_cast<int>(entries.size()), kVocab},
                          nullptr),
            cudaSuccess);
  std::vector<float> got(logits.size());
  ASSERT_EQ(cudaMemcpy(got.data(), d_logits->data(), got.size() * sizeof(float), cudaMemcpyDeviceToHost),
            cudaSuccess);
  int changed = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i], expected[i]) << "row " << i / kVocab << " token " << i % kVocab;
    changed += got[i] != logits[i];
  }
  EXPECT_GT(changed, 4 * 50);
}

// Structured outputs' token masks on the GPU equal the CPU's
// apply_token_masks on Qwen3-sized rows: masks from dense to a handful of
// tokens on rows 1, 4 and 2 of five (0 and 3 untouched), the vocabulary not
// a multiple of 32 (the last word partly used).
TEST(CudaSampling, MaskLogitsEqualsTheCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  constexpr int kVocab = 151669, kRows = 5;
  const int64_t words = engine::mask_words_per_row(kVocab);
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> logits(static_cast<size_t>(kRows) * kVocab);
  for (auto& v : logits) v = normal(rng);
  engine::StepSampling sampling;
  sampling.rows.resize(kRows);
  sampling.mask_rows = {1, 4, 2};
  const double keep[] = {0.9, 0.001, 0.3};
  for (double k : keep) {
    std::bernoulli_distribution bit(k);
    std::vector<uint32_t> mask(static_cast<size_t>(words), 0);
    for (int32_t t = 0; t < kVocab; ++t)
      if (bit(rng) || t == kVocab - 1) mask[static_cast<size_t>(t) / 32] |= 1u << (t % 32);
    sampling.mask_words.insert(sampling.mask_words.end(), mask.begin(), mask.end());
  }
  std::vector<float> expected = logits;
  engine::apply_token_masks(expected, kVocab, sampling);
  auto d_logits = DeviceBuffer::allocate(logits.size() * sizeof(float));
  auto d_rows = DeviceBuffer::allocate(sampling.mask_rows.size() * sizeof(int32_t));
  auto d_words = DeviceBuffer::allocate(sampling.mask_words.size() * sizeof(uint32_t));
  ASSERT_TRUE(d_logits && d_rows && d_words);
  cudaMemcpy(d_logits->data(), logits.data(), logits.size() * sizeof(float), cudaMemcpyHostToDevice);
  cudaMemcpy(d_rows->data(), sampling.mask_rows.data(), sampling.mask_rows.size() * sizeof(int32_t),
             cudaMemcpyHostToDevice);
  cudaMemcpy(d_words->data(), sampling.mask_words.data(), sampling.mask_words.size() * sizeof(uint32_t),
             cudaMemcpyHostToDevice);
  ASSERT_EQ(mask_logits({d_logits->data_as<float>(), d_rows->data_as<int32_t>(), d_words->data_as<uint32_t>(),
                         static_cast<int>(sampling.mask_rows.size()), kVocab},
                        nullptr),
            cudaSuccess);
  std::vector<float> got(logits.size());
  ASSERT_EQ(cudaMemcpy(got.data(), d_logits->data(), got.size() * sizeof(float), cudaMemcpyDeviceToHost),
            cudaSuccess);
  int64_t banned[kRows] = {};
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i], expected[i]) << "row " << i / kVocab << " token " << i % kVocab;
    banned[i / kVocab] += std::isinf(got[i]);
  }
  EXPECT_EQ(banned[0], 0);
  EXPECT_EQ(banned[3], 0);
  EXPECT_NEAR(static_cast<double>(banned[1]) / kVocab, 0.1, 0.01);
  EXPECT_NEAR(static_cast<double>(banned[4]) / kVocab, 0.999, 0.001);
  EXPECT_NEAR(static_cast<double>(banned[2]) / kVocab, 0.7, 0.01);
  EXPECT_FALSE(std::isinf(got[static_cast<size_t>(4) * kVocab + kVocab - 1])) << "the last token, kept";
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
