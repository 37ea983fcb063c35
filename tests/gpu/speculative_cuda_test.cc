// Speculative decoding with the target on the GPU (docs/speculative.md): the
// CUDA model's hidden states against the CPU reference's, and greedy outputs
// with MTP drafts (the MTP layer on the CPU, fed the GPU's hidden states)
// equal to plain greedy decoding on the GPU for k = 1..4, on the golden model
// with a random MTP layer and on the demo model with its trained one (whose
// drafts must be accepted). Prints acceptance and the decode speed with and
// without drafts. Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>

#include "engine/cuda_runner.h"
#include "engine/generator.h"
#include "kv/kv_cache.h"
#include "model/config.h"
#include "model/mtp.h"
#include "model/weights.h"

namespace moe::engine {
namespace {

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

std::string source(const std::string& path) { return std::string(MOE_SOURCE_DIR) + "/" + path; }

struct Loaded {
  ThreadPool pool{4};
  model::ModelConfig config;
  std::optional<model::ModelWeights> weights;
  std::optional<model::MtpWeights> mtp_weights;
  std::optional<model::MtpModel> mtp;
  std::unique_ptr<CudaRunner> runner;
};

std::unique_ptr<Loaded> load(const std::string& dir, const std::string& mtp_dir) {
  auto l = std::make_unique<Loaded>();
  auto config = model::load_model_config(dir);
  EXPECT_TRUE(config.has_value()) << config.status().to_string();
  if (!config) return nullptr;
  l->config = *config;
  auto weights = model::ModelWeights::load(dir, l->config, l->pool);
  EXPECT_TRUE(weights.has_value()) << weights.status().to_string();
  if (!weights) return nullptr;
  l->weights.emplace(std::move(*weights));
  auto mtp = model::MtpWeights::load(mtp_dir, l->config);
  EXPECT_TRUE(mtp.has_value()) << mtp.status().to_string();
  if (!mtp) return nullptr;
  l->mtp_weights.emplace(std::move(*mtp));
  l->mtp.emplace(*l->mtp_weights, *l->weights);
  model::CudaModelOptions options;
  options.page_size = 16;
  options.num_pages = 256;
  options.max_num_tokens = 256;
  auto runner = CudaRunner::create(l->config, &*l->weights, 0, options);
  EXPECT_TRUE(runner.has_value()) << runner.status().to_string();
  if (!runner) return nullptr;
  l->runner = std::move(*runner);
  return l;
}

struct GenRun {
  std::vector<GenerationResult> results;
  GenerationStats stats;
  double seconds = 0;
};

GenRun generate(Loaded& l, const std::vector<GenerationRequest>& requests, int k, int max_tokens_per_step) {
  GeneratorOptions options;
  options.page_size = 16;
  options.kv_dtype = DType::kBF16;
  options.max_tokens_per_step = max_tokens_per_step;
  options.mtp = k > 0 ? &*l.mtp : nullptr;
  options.num_speculative_tokens = k;
  Generator generator(*l.runner, l.runner->num_pages(), options, &l.pool);
  const auto start = std::chrono::steady_clock::now();
  auto results = generator.generate(requests);
  GenRun run;
  run.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_TRUE(results.has_value()) << results.status().to_string();
  if (results) run.results = std::move(*results);
  run.stats = generator.stats();
  return run;
}

double relative_error(const float* a, const float* b, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) num += (a[i] - b[i]) * (a[i] - b[i]), den += b[i] * b[i];
  return std::sqrt(num / std::max(den, 1e-30));
}

// The GPU's final-normed hidden states (bf16 there) against the CPU's f32 ones.
TEST(CudaSpeculation, HiddenStatesMatchTheCpuReference) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  auto l = load(source("models/moeserve-demo"), source("models/moeserve-demo-mtp"));
  ASSERT_NE(l, nullptr);
  model::ForwardBatch batch;
  batch.token_ids = {1, 317, 201, 386, 330, 263, 409, 16, 2, 201, 35, 1067};
  batch.positions = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1};
  batch.query_start = {0, 10, 12};
  batch.max_pages_per_seq = 1;
  batch.page_table = {0, 1};
  batch.logits_rows = {9, 11};
  const std::vector<int32_t> rows = {0, 4, 9, 10, 11};
  Tensor gpu_hidden;
  auto gpu_logits = l->runner->forward_with_hidden(batch, rows, gpu_hidden);
  ASSERT_TRUE(gpu_logits.has_value()) << gpu_logits.status().to_string();
  model::Qwen3MoeModel cpu(*l->weights);
  kv::KvCache cache({l->config.num_layers, l->config.num_kv_heads, l->config.head_dim, 16, 2, DType::kF32});
  std::vector<ops::PagedKv> layers;
  for (int i = 0; i < l->config.num_layers; ++i) layers.push_back(cache.layer(i));
  Tensor cpu_hidden;
  auto cpu_logits = cpu.try_forward(l->pool, batch, layers, {}, rows, &cpu_hidden);
  ASSERT_TRUE(cpu_logits.has_value()) << cpu_logits.status().to_string();
  ASSERT_EQ(gpu_hidden.shape(), cpu_hidden.shape());
  const int64_t H = l->config.hidden_size;
  for (size_t r = 0; r < rows.size(); ++r)
    EXPECT_LT(relative_error(gpu_hidden.data_as<float>() + r * H, cpu_hidden.data_as<float>() + r * H, H), 2e-2)
        << "row " << rows[r];
  Tensor unused;
  EXPECT_FALSE(l->runner->forward_with_hidden(batch, std::vector<int32_t>{12}, unused).has_value())
      << "a row past the batch is refused";
}

std::vector<GenerationRequest> requests_of(const std::vector<std::vector<int32_t>>& prompts, int max_tokens) {
  std::vector<GenerationRequest> out;
  for (const auto& p : prompts) {
    GenerationRequest r;
    r.prompt = p;
    r.max_tokens = max_tokens;
    r.sampling.temperature = 0;
    r.ignore_eos = true;
    out.push_back(r);
  }
  return out;
}

void expect_same_tokens(const GenRun& spec, const GenRun& plain, int k) {
  ASSERT_EQ(spec.results.size(), plain.results.size());
  for (size_t i = 0; i < plain.results.size(); ++i)
    EXPECT_EQ(spec.results[i].token_ids, plain.results[i].token_ids) << "k " << k << " request " << i;
}

// A random MTP layer (tests/data/mtp_golden): drafts are nearly all rejected,
// and the output is plain greedy's, with chunked prefill mixed in.
TEST(CudaSpeculation, GoldenGreedyEqualsPlainForEveryK) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  auto l = load(source("tests/data/golden/moe_basic"), source("tests/data/mtp_golden"));
  ASSERT_NE(l, nullptr);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 4; ++i) {
    prompts.emplace_back();
    for (int t = 0; t < 3 + 5 * i; ++t) prompts.back().push_back(static_cast<int32_t>((17 * t + 31 * i + 5) % l->config.vocab_size));
  }
  const auto requests = requests_of(prompts, 20);
  const GenRun plain = generate(*l, requests, 0, 7);
  for (int k = 1; k <= 4; ++k) {
    const GenRun spec = generate(*l, requests, k, 7);
    expect_same_tokens(spec, plain, k);
    EXPECT_GT(spec.stats.num_draft_tokens, 0) << "k " << k;
  }
}

// The demo model's trained MTP layer: the same greedy tokens, most drafts
// accepted; prints acceptance and decode speed against plain GPU decoding
// (the MTP layer runs on the CPU: this is not yet the speed-up a GPU MTP gives).
TEST(CudaSpeculation, DemoTrainedMtpIsAcceptedAndExact) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  auto l = load(source("models/moeserve-demo"), source("models/moeserve-demo-mtp"));
  ASSERT_NE(l, nullptr);
  const auto requests = requests_of({{1, 317, 201, 386, 330, 263, 409, 16, 2, 201, 1, 319, 201},
                                     {1, 317, 201, 454, 330, 263, 453, 355, 1096, 16, 2, 201, 1, 319, 201},
                                     {35, 1067}},
                                    64);
  (void)generate(*l, requests, 0, 0);  // warm-up: graphs captured, kernels loaded
  const GenRun plain = generate(*l, requests, 0, 0);
  std::printf("demo on the GPU, plain: %d steps, %.3f s\n", plain.stats.num_steps, plain.seconds);
  for (int k = 1; k <= 4; ++k) {
    const GenRun spec = generate(*l, requests, k, 0);
    expect_same_tokens(spec, plain, k);
    const double acceptance = static_cast<double>(spec.stats.num_accepted_tokens) /
                              static_cast<double>(std::max<int64_t>(1, spec.stats.num_draft_tokens));
    std::printf("demo on the GPU, k=%d: %lld drafts, %lld accepted (%.1f%%), %d steps, %.3f s (%.2fx plain)\n", k,
                static_cast<long long>(spec.stats.num_draft_tokens),
                static_cast<long long>(spec.stats.num_accepted_tokens), 100 * acceptance, spec.stats.num_steps,
                spec.seconds, plain.seconds / spec.seconds);
    EXPECT_GT(acceptance, k == 1 ? 0.2 : 0.1) << "k " << k;  // random MTP weights accept ~0
  }
}

}  // namespace
}  // namespace moe::engine
