// Speculative decoding with the target on the GPU (docs/speculative.md): the
// CUDA model's hidden states and its MTP forward against the CPU reference's,
// and greedy outputs with MTP drafts (the MTP layer on the GPU, and on the CPU
// fed the GPU's hidden states) equal to plain greedy decoding on the GPU for
// k = 1..4, on the golden model with a random MoE MTP layer and on the demo
// model with its trained dense one (whose drafts must be accepted). Prints
// acceptance and the decode speed with and without drafts. Also structured
// outputs through the serving engine on the GPU, with and without drafts.
// Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <future>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "engine/cuda_runner.h"
#include "engine/engine.h"
#include "engine/generator.h"
#include "kv/kv_cache.h"
#include "model/config.h"
#include "model/mtp.h"
#include "model/weights.h"
#include "structured/grammar.h"
#include "structured/token_filter.h"
#include "tests/engine/structured_oracle.h"
#include "tokenizer/tokenizer.h"

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

// The MTP layer runs on the GPU when `gpu_mtp` (CudaRunner::mtp_runner), else on the CPU.
std::unique_ptr<Loaded> load(const std::string& dir, const std::string& mtp_dir, bool gpu_mtp = true,
                             bool graphs = true) {
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
  options.mtp = gpu_mtp ? &*l->mtp_weights : nullptr;
  options.use_cuda_graphs = graphs;
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
  if (k > 0 && l.runner->mtp_runner() != nullptr) {
    options.make_mtp_runner = [&l] { return l.runner->mtp_runner(); };
  } else if (k > 0) {
    options.mtp = &*l.mtp;
  }
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

// A chat turn and a text start of the demo model, 10 + 2 tokens on pages 0 and 1.
model::ForwardBatch demo_batch() {
  model::ForwardBatch batch;
  batch.token_ids = {1, 317, 201, 386, 330, 263, 409, 16, 2, 201, 35, 1067};
  batch.positions = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1};
  batch.query_start = {0, 10, 12};
  batch.max_pages_per_seq = 1;
  batch.page_table = {0, 1};
  batch.logits_rows = {9, 11};
  return batch;
}

// An MTP batch of two sequences (3 and 2 positions, pages 2 and 3), output rows their last.
model::MtpBatch demo_mtp_batch() {
  model::MtpBatch mb;
  mb.token_ids = {330, 263, 409, 1067, 17};
  mb.positions = {0, 1, 2, 0, 1};
  mb.query_start = {0, 3, 5};
  mb.page_table = {2, 3};
  mb.max_pages_per_seq = 1;
  mb.output_rows = {2, 4};
  return mb;
}

// The GPU's final-normed hidden states (bf16 there) against the CPU's f32 ones.
TEST(CudaSpeculation, HiddenStatesMatchTheCpuReference) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  auto l = load(source("models/moeserve-demo"), source("models/moeserve-demo-mtp"));
  ASSERT_NE(l, nullptr);
  const model::ForwardBatch batch = demo_batch();
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

// One MTP forward and a chained step that reads the KV the first wrote, on
// the GPU against MtpModel on the CPU: the MoE MTP layer of the golden
// checkpoint and the demo's dense one, fed the same hidden states.
TEST(CudaMtp, ForwardMatchesTheCpuMtpLayer) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  for (const auto& [dir, mtp_dir] : {std::pair{source("tests/data/golden/moe_basic"), source("tests/data/mtp_golden")},
                                     std::pair{source("models/moeserve-demo"), source("models/moeserve-demo-mtp")}}) {
    auto l = load(dir, mtp_dir, true);
    ASSERT_NE(l, nullptr);
    auto gpu = l->runner->mtp_runner();
    ASSERT_NE(gpu, nullptr);
    const int64_t H = l->config.hidden_size, V = l->config.vocab_size;
    kv::KvCache cpu_cache({1, l->config.num_kv_heads, l->config.head_dim, 16, l->runner->num_pages() + 1, DType::kF32});
    // Two sequences (pages 3 and 5), 9 and 4 positions, then one chained token each.
    model::MtpBatch first;
    first.query_start = {0, 9, 13};
    for (int t = 0; t < 13; ++t) {
      first.token_ids.push_back(static_cast<int32_t>((37 * t + 11) % V));
      first.positions.push_back(t < 9 ? t : t - 9);
    }
    first.page_table = {3, 5};
    first.max_pages_per_seq = 1;
    first.output_rows = {8, 12};
    Tensor hidden(DType::kF32, {13, H});
    for (int64_t i = 0; i < hidden.num_elements(); ++i)
      hidden.data_as<float>()[i] = std::sin(0.37f * static_cast<float>(i)) * 2.0f;
    auto got = gpu->forward(first, hidden.view());
    ASSERT_TRUE(got.has_value()) << got.status().to_string();
    const model::MtpOutput want = l->mtp->forward(l->pool, first, hidden.view(), cpu_cache.layer(0));
    for (int r = 0; r < 2; ++r) {
      EXPECT_LT(relative_error(got->logits.data_as<float>() + r * V, want.logits.data_as<float>() + r * V, V), 3e-2)
          << dir << " row " << r;
      EXPECT_LT(relative_error(got->hidden.data_as<float>() + r * H, want.hidden.data_as<float>() + r * H, H), 3e-2)
          << dir << " row " << r;
    }
    model::MtpBatch next;
    next.query_start = {0, 1, 2};
    next.token_ids = {7, 9};
    next.positions = {9, 4};
    next.page_table = {3, 5};
    next.max_pages_per_seq = 1;
    next.output_rows = {0, 1};
    auto got2 = gpu->forward(next, want.hidden.view());
    ASSERT_TRUE(got2.has_value()) << got2.status().to_string();
    const model::MtpOutput want2 = l->mtp->forward(l->pool, next, want.hidden.view(), cpu_cache.layer(0));
    for (int r = 0; r < 2; ++r)
      EXPECT_LT(relative_error(got2->logits.data_as<float>() + r * V, want2.logits.data_as<float>() + r * V, V), 3e-2)
          << dir << " chained row " << r;
    // The greedy tokens (the drafter's): the argmax of the GPU's own logits,
    // the same without the logits copied back.
    model::MtpBatch tokens_only = next;
    tokens_only.want_logits = false;
    auto got3 = gpu->forward(tokens_only, want.hidden.view());
    ASSERT_TRUE(got3.has_value()) << got3.status().to_string();
    ASSERT_EQ(got2->greedy.size(), 2u);
    for (int r = 0; r < 2; ++r) {
      const float* row = got2->logits.data_as<float>() + r * V;
      EXPECT_EQ(got2->greedy[r], std::max_element(row, row + V) - row) << dir << " chained row " << r;
    }
    EXPECT_EQ(got3->greedy, got2->greedy) << dir;
    EXPECT_EQ(got3->logits.num_elements(), 0) << dir << ": no logits when not wanted";
    model::MtpBatch bad = next;
    bad.output_rows = {2};
    EXPECT_FALSE(gpu->forward(bad, want.hidden.view()).has_value()) << "an output row past the batch is refused";
  }
}

// The MTP's first pass reading the target's hidden rows where they already are
// (MtpBatch::target_rows, no round trip through the host) computes exactly
// what it does from the same rows sent up from the host.
TEST(CudaMtp, TargetRowsOnTheDeviceEqualTheHostRoundTrip) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  // Eager, the two inputs run the same kernels: bitwise equal. With graphs the
  // device-kept rows run as one-token sequences (the decode attention kernel,
  // a graph replay), the host's as the batch's sequences (the prefill kernel):
  // equal to rounding.
  for (const bool graphs : {false, true}) {
    SCOPED_TRACE(graphs ? "CUDA graphs" : "eager");
    auto l = load(source("models/moeserve-demo"), source("models/moeserve-demo-mtp"), true, graphs);
    ASSERT_NE(l, nullptr);
    auto gpu = l->runner->mtp_runner();
    ASSERT_NE(gpu, nullptr);
    EXPECT_TRUE(gpu->keeps_target_hidden());
    const model::ForwardBatch batch = demo_batch();
    const std::vector<int32_t> rows = {9, 4, 0, 11, 10};  // not in order: the rows are gathered
    Tensor hidden;
    auto target = l->runner->forward_with_hidden(batch, rows, hidden);
    ASSERT_TRUE(target.has_value()) << target.status().to_string();
    model::MtpBatch mb = demo_mtp_batch();
    auto via_host = gpu->forward(mb, hidden.view());
    ASSERT_TRUE(via_host.has_value()) << via_host.status().to_string();
    mb.target_rows = rows;
    const Tensor none(DType::kF32, {0, l->config.hidden_size});
    for (int replay = 0; replay < 2; ++replay) {  // graphs: captured, then replayed
      auto via_device = gpu->forward(mb, none.view());
      ASSERT_TRUE(via_device.has_value()) << via_device.status().to_string();
      ASSERT_EQ(via_device->logits.num_bytes(), via_host->logits.num_bytes());
      EXPECT_EQ(via_device->greedy, via_host->greedy);
      const auto* dl = via_device->logits.data_as<float>();
      const auto* hl = via_host->logits.data_as<float>();
      const auto* dh = via_device->hidden.data_as<float>();
      const auto* hh = via_host->hidden.data_as<float>();
      if (!graphs) {
        EXPECT_EQ(std::memcmp(dl, hl, via_host->logits.num_bytes()), 0);
        EXPECT_EQ(std::memcmp(dh, hh, via_host->hidden.num_bytes()), 0);
      } else {
        EXPECT_LT(relative_error(dl, hl, via_host->logits.num_elements()), 1e-2);
        EXPECT_LT(relative_error(dh, hh, via_host->hidden.num_elements()), 1e-2);
      }
    }
    mb.target_rows = {9, 4, 0, 11, 12};
    EXPECT_FALSE(gpu->forward(mb, none.view()).has_value())
        << "a row past the target's last forward is refused";
    mb.target_rows = {9, 4};
    EXPECT_FALSE(gpu->forward(mb, none.view()).has_value()) << "one target row per MTP token";
  }
}

// forward_chain on the GPU queues its passes with their inputs (the pass
// before's normed rows and greedy tokens) gathered on the device, and waits
// once: the same drafts as MtpRunner's own chain through the host (forward()
// pass by pass, bf16-rounded rows widened alike).
TEST(CudaMtp, ChainedPassesOnTheDeviceEqualTheHostRoundTrip) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  auto l = load(source("models/moeserve-demo"), source("models/moeserve-demo-mtp"));
  ASSERT_NE(l, nullptr);
  auto gpu = l->runner->mtp_runner();
  ASSERT_NE(gpu, nullptr);
  model::MtpBatch first_batch = demo_mtp_batch();
  Tensor hidden(DType::kF32, {5, l->config.hidden_size});
  for (int64_t i = 0; i < hidden.num_elements(); ++i)
    hidden.data_as<float>()[i] = std::sin(0.07f * static_cast<float>(i));
  // Pass 0: both sequences, the second first; passes 1 and 2: the first one alone.
  std::vector<model::MtpBatch> passes(3);
  passes[0].token_ids = {0, 0};
  passes[0].previous_rows = {1, 0};
  passes[0].positions = {2, 3};
  passes[0].query_start = {0, 1, 2};
  passes[0].page_table = {3, 2};
  passes[0].output_rows = {0, 1};
  for (int j = 1; j < 3; ++j) {
    passes[j].token_ids = {0};
    passes[j].previous_rows = {j == 1 ? 1 : 0};
    passes[j].positions = {3 + j};
    passes[j].query_start = {0, 1};
    passes[j].page_table = {2};
    passes[j].output_rows = {0};
  }
  for (auto& pass : passes) pass.max_pages_per_seq = 1, pass.want_logits = false, pass.want_hidden = false;

  auto first = gpu->forward(first_batch, hidden.view());
  ASSERT_TRUE(first.has_value()) << first.status().to_string();
  auto via_host = gpu->MtpRunner::forward_chain(*first, passes);  // the base class's: through the host
  ASSERT_TRUE(via_host.has_value()) << via_host.status().to_string();
  first_batch.want_hidden = false;  // the device chain reads the rows kept there
  auto again = gpu->forward(first_batch, hidden.view());
  ASSERT_TRUE(again.has_value()) << again.status().to_string();
  EXPECT_EQ(again->hidden.num_elements(), 0);
  EXPECT_EQ(again->greedy, first->greedy);
  auto via_device = gpu->forward_chain(*again, passes);
  ASSERT_TRUE(via_device.has_value()) << via_device.status().to_string();
  EXPECT_EQ(*via_device, *via_host);
  ASSERT_EQ(via_device->size(), 3u);
  EXPECT_EQ((*via_device)[0].size(), 2u);
  EXPECT_EQ((*via_device)[2].size(), 1u);

  ASSERT_TRUE(gpu->forward(first_batch, hidden.view()).has_value());
  passes[1].previous_rows = {2};
  EXPECT_FALSE(gpu->forward_chain(*again, passes).has_value()) << "a row past the pass before is refused";
  passes[1].previous_rows = {1};
  ASSERT_TRUE(gpu->forward(first_batch, hidden.view()).has_value());
  Tensor target_hidden;
  ASSERT_TRUE(l->runner->forward_with_hidden(demo_batch(), {}, target_hidden).has_value());
  EXPECT_FALSE(gpu->forward_chain(*again, passes).has_value())
      << "after a target forward the MTP's rows are gone and a chain is refused";
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

// Logit margin under which bf16 rounding may flip a greedy choice (as in
// model_cuda_test.cc): verification runs several tokens per sequence through
// the prefill kernels, plain decoding one token through the decode kernels and
// CUDA graphs, so their logits agree only to bf16 rounding.
constexpr float kBf16Margin = 0.1f;

// The top-1 minus top-2 logit after `tokens` (one sequence, pages from 0).
float margin_after(Loaded& l, const std::vector<int32_t>& tokens) {
  model::ForwardBatch batch;
  batch.token_ids = tokens;
  for (size_t i = 0; i < tokens.size(); ++i) batch.positions.push_back(static_cast<int32_t>(i));
  batch.query_start = {0, static_cast<int32_t>(tokens.size())};
  batch.max_pages_per_seq = static_cast<int>((tokens.size() + 15) / 16);
  for (int p = 0; p < batch.max_pages_per_seq; ++p) batch.page_table.push_back(p);
  batch.logits_rows = {static_cast<int32_t>(tokens.size()) - 1};
  auto logits = l.runner->forward(batch);
  EXPECT_TRUE(logits.has_value()) << logits.status().to_string();
  if (!logits) return 0.0f;
  std::vector<float> row(logits->data_as<float>(), logits->data_as<float>() + l.config.vocab_size);
  std::partial_sort(row.begin(), row.begin() + 2, row.end(), std::greater<float>());
  return row[0] - row[1];
}

// Speculative greedy output equals plain greedy output, token for token, up
// to a divergence only where plain decoding's own margin is within bf16
// rounding (then the rest of the sequence is not compared, and it is printed).
void expect_same_tokens(Loaded& l, const std::vector<GenerationRequest>& requests, const GenRun& spec,
                        const GenRun& plain, int k) {
  ASSERT_EQ(spec.results.size(), plain.results.size());
  for (size_t i = 0; i < plain.results.size(); ++i) {
    const auto& a = spec.results[i].token_ids;
    const auto& b = plain.results[i].token_ids;
    if (a == b) continue;
    size_t at = 0;
    while (at < a.size() && at < b.size() && a[at] == b[at]) ++at;
    std::vector<int32_t> context = requests[i].prompt;
    context.insert(context.end(), b.begin(), b.begin() + static_cast<std::ptrdiff_t>(at));
    const float margin = margin_after(l, context);
    std::printf("k=%d request %zu: diverges at token %zu, where plain decoding's margin is %.4f\n", k, i, at, margin);
    EXPECT_LT(margin, kBf16Margin) << "k " << k << " request " << i << ": speculation changed a clear greedy choice";
  }
}

class CudaSpeculation : public testing::TestWithParam<bool> {};  // the MTP layer on the GPU?

// A random MTP layer (tests/data/mtp_golden): drafts are nearly all rejected,
// and the output is plain greedy's, with chunked prefill mixed in.
TEST_P(CudaSpeculation, GoldenGreedyEqualsPlainForEveryK) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  auto l = load(source("tests/data/golden/moe_basic"), source("tests/data/mtp_golden"), GetParam());
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
    expect_same_tokens(*l, requests, spec, plain, k);
    EXPECT_GT(spec.stats.num_draft_tokens, 0) << "k " << k;
  }
}

// The demo model's trained MTP layer: the same greedy tokens, most drafts
// accepted; prints acceptance and decode speed against plain GPU decoding
// (the demo is tiny: step time is launch-bound, so this shows the mechanics,
// not the speed-up on a large model).
TEST_P(CudaSpeculation, DemoTrainedMtpIsAcceptedAndExact) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  auto l = load(source("models/moeserve-demo"), source("models/moeserve-demo-mtp"), GetParam());
  ASSERT_NE(l, nullptr);
  const auto requests = requests_of({{1, 317, 201, 386, 330, 263, 409, 16, 2, 201, 1, 319, 201},
                                     {1, 317, 201, 454, 330, 263, 453, 355, 1096, 16, 2, 201, 1, 319, 201},
                                     {35, 1067}},
                                    64);
  (void)generate(*l, requests, 0, 0);  // warm-up: graphs captured, kernels loaded
  const GenRun plain = generate(*l, requests, 0, 0);
  const char* where = GetParam() ? "GPU" : "CPU";
  std::printf("demo on the GPU, plain: %d steps, %.3f s\n", plain.stats.num_steps, plain.seconds);
  for (int k = 1; k <= 4; ++k) {
    const GenRun spec = generate(*l, requests, k, 0);
    expect_same_tokens(*l, requests, spec, plain, k);
    const double acceptance = static_cast<double>(spec.stats.num_accepted_tokens) /
                              static_cast<double>(std::max<int64_t>(1, spec.stats.num_draft_tokens));
    std::printf("demo on the GPU, MTP on the %s, k=%d: %lld drafts, %lld accepted (%.1f%%), %d steps, %.3f s "
                "(%.2fx plain)\n", where, k,
                static_cast<long long>(spec.stats.num_draft_tokens),
                static_cast<long long>(spec.stats.num_accepted_tokens), 100 * acceptance, spec.stats.num_steps,
                spec.seconds, plain.seconds / spec.seconds);
    EXPECT_GT(acceptance, k == 1 ? 0.2 : 0.1) << "k " << k;  // random MTP weights accept ~0
  }
}

// Sampled requests verify their drafts on the GPU (rejection sampling in the
// sampling kernel): a request's second token (the first verified one) follows
// the same distribution with MTP drafts as without them -- a two-sample
// chi-square over 1000 seeded requests each, independent seeds -- and the
// demo's trained MTP layer still gets drafts accepted at temperature 0.7.
TEST(CudaSpeculationSampled, VerifiedTokensKeepTheDistribution) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  auto l = load(source("models/moeserve-demo"), source("models/moeserve-demo-mtp"));
  ASSERT_NE(l, nullptr);
  constexpr int kRequests = 1000;
  auto requests_with_seeds = [&](uint64_t first_seed) {
    std::vector<GenerationRequest> out;
    for (int i = 0; i < kRequests; ++i) {
      GenerationRequest r;
      r.prompt = {1, 317, 201, 386, 330, 263, 409, 16, 2, 201, 1, 319, 201};
      r.max_tokens = 3;  // a draft only where more than one token remains
      r.sampling.temperature = 1.0f;
      r.sampling.seed = first_seed + static_cast<uint64_t>(i);
      r.ignore_eos = true;
      out.push_back(r);
    }
    return out;
  };
  const GenRun plain = generate(*l, requests_with_seeds(1), 0, 256);  // steps within max_num_tokens
  const GenRun spec = generate(*l, requests_with_seeds(1000000), 2, 256);
  ASSERT_EQ(plain.results.size(), static_cast<size_t>(kRequests));
  ASSERT_EQ(spec.results.size(), static_cast<size_t>(kRequests));
  std::map<int32_t, std::pair<int, int>> counts;  // second token: (plain, speculative)
  for (int i = 0; i < kRequests; ++i) {
    ASSERT_EQ(plain.results[i].token_ids.size(), 3u);
    ASSERT_EQ(spec.results[i].token_ids.size(), 3u);
    ++counts[plain.results[i].token_ids[1]].first;
    ++counts[spec.results[i].token_ids[1]].second;
  }
  // Categories with fewer than 10 draws in all pool into one.
  std::vector<std::pair<double, double>> bins(1, {0, 0});
  for (const auto& [token, c] : counts) {
    if (c.first + c.second >= 10)
      bins.emplace_back(c.first, c.second);
    else
      bins[0].first += c.first, bins[0].second += c.second;
  }
  if (bins[0].first + bins[0].second == 0) bins.erase(bins.begin());
  double stat = 0;
  for (const auto& [a, b] : bins) {  // equal sample sizes: expected (a + b) / 2 each
    const double e = (a + b) / 2;
    stat += (a - e) * (a - e) / e + (b - e) * (b - e) / e;
  }
  const double dof = static_cast<double>(bins.size()) - 1;
  // Wilson-Hilferty: the chi-square quantile at 0.999 (z = 3.09).
  const double h = 2.0 / (9.0 * dof), critical = dof * std::pow(1 - h + 3.09 * std::sqrt(h), 3);
  std::printf(
      "second token: %zu categories, chi-square %.1f (critical %.1f at 0.001); %lld drafts, %lld accepted\n",
      bins.size(), stat, critical, static_cast<long long>(spec.stats.num_draft_tokens),
      static_cast<long long>(spec.stats.num_accepted_tokens));
  ASSERT_GE(bins.size(), 3u) << "the second token should vary at temperature 1";
  EXPECT_LT(stat, critical);
  EXPECT_GT(spec.stats.num_draft_tokens, kRequests / 2);

  std::vector<GenerationRequest> longer = requests_with_seeds(7);
  longer.resize(3);
  for (auto& r : longer) r.max_tokens = 64, r.sampling.temperature = 0.7f;
  const GenRun sampled = generate(*l, longer, 2, 0);
  for (const auto& r : sampled.results) EXPECT_EQ(r.token_ids.size(), 64u);
  const double acceptance = static_cast<double>(sampled.stats.num_accepted_tokens) /
                            static_cast<double>(std::max<int64_t>(1, sampled.stats.num_draft_tokens));
  std::printf("demo, temperature 0.7, k=2: %lld drafts, %.1f%% accepted\n",
              static_cast<long long>(sampled.stats.num_draft_tokens), 100 * acceptance);
  EXPECT_GT(acceptance, 0.1);
}

INSTANTIATE_TEST_SUITE_P(MtpPlacement, CudaSpeculation, testing::Values(true, false),
                         [](const testing::TestParamInfo<bool>& info) { return info.param ? "GpuMtp" : "CpuMtp"; });


// Structured outputs through the serving engine on the GPU (token masks
// applied by mask_logits before the sampling kernel), with and without the
// GPU MTP layer's drafts. Oracle (tests/engine/structured_oracle.h): every
// greedy token is the best of the GPU model's own logits (all 4096 logprobs
// come back, as produced) among the tokens the byte matcher allows there; a
// sampled request's tokens are all allowed; finished outputs are whole.
struct EngineRun {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<std::vector<TokenLogprobs>> logprobs;
  std::vector<FinishReason> finish;
  EngineMetrics metrics;
};

EngineRun run_engine(Loaded& l, const std::vector<EngineRequest>& requests, int k,
                     std::shared_ptr<const structured::TokenVocabulary> vocabulary, int32_t eos) {
  EngineOptions options;
  options.scheduler = {.page_size = 16, .num_pages = l.runner->num_pages(), .max_num_seqs = 8,
                       .max_num_batched_tokens = 64, .max_model_len = 128};
  options.check_invariants = true;
  options.vocabulary = std::move(vocabulary);
  options.eos_token_ids = {eos};
  std::unique_ptr<MtpDrafter> drafter;
  if (k > 0) drafter = std::make_unique<MtpDrafter>(l.runner->mtp_runner(), k);
  Engine engine(std::move(l.runner), options, std::move(drafter));
  EngineRun run;
  const size_t n = requests.size();
  run.tokens.resize(n), run.logprobs.resize(n), run.finish.resize(n);
  std::vector<std::promise<void>> done(n);
  for (size_t i = 0; i < n; ++i) {
    auto id = engine.submit(requests[i], [&run, &done, i](const EngineOutput& out) {
      if (out.token >= 0) run.tokens[i].push_back(out.token);
      if (out.logprobs) run.logprobs[i].push_back(*out.logprobs);
      if (out.finish != FinishReason::kNone) run.finish[i] = out.finish, done[i].set_value();
    });
    EXPECT_TRUE(id.has_value()) << id.status().to_string();
    if (!id) done[i].set_value();
  }
  for (auto& d : done) d.get_future().wait();
  for (int i = 0; i < 200 && (engine.metrics().kv_cache_usage_perc != 0 || engine.metrics().num_requests_running); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  run.metrics = engine.metrics();
  return run;
}

TEST(CudaStructured, EngineTakesTheBestAllowedTokenWithAndWithoutDrafts) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const std::string demo = source("models/moeserve-demo");
  auto tok = tokenizer::Tokenizer::load(demo);
  ASSERT_TRUE(tok.has_value()) << tok.status().to_string();
  constexpr int32_t kEos = 2;
  auto schema =
      structured::Grammar::from_json_schema(nlohmann::ordered_json::parse(testing_oracle::kVerdictSchema));
  ASSERT_TRUE(schema.has_value());
  auto choice = structured::Grammar::from_choices({"The fortune", "A computer is", "no"});
  ASSERT_TRUE(choice.has_value());
  const std::vector<std::shared_ptr<const structured::Grammar>> grammars = {*schema, structured::Grammar::json_object(),
                                                                              *choice};
  const std::vector<std::vector<int32_t>> prompts = {{1, 317, 201, 386, 330, 263, 409, 16, 2, 201, 1, 319, 201},
                                                     {1, 317, 201, 454, 330, 263, 453, 355, 1096, 16, 2, 201, 1, 319, 201},
                                                     {35, 1067}};
  std::vector<EngineRequest> requests;
  for (size_t i = 0; i < 6; ++i) {
    EngineRequest r;
    r.prompt = prompts[i % prompts.size()];
    r.grammar = grammars[i % grammars.size()];
    r.max_tokens = 48;
    r.ignore_eos = false;
    r.sampling.temperature = 0;
    r.num_logprobs = 4096;
    requests.push_back(r);
  }
  requests[5].sampling.temperature = 1.0f, requests[5].sampling.seed = 9;
  for (int k : {0, 2}) {
    auto l = load(demo, source("models/moeserve-demo-mtp"), true);
    ASSERT_NE(l, nullptr);
    ASSERT_EQ(l->config.vocab_size, 4096);
    auto vocabulary = structured::TokenVocabulary::from_tokenizer(*tok, l->config.vocab_size);
    const EngineRun run = run_engine(*l, requests, k, vocabulary, kEos);
    int stopped = 0;
    for (size_t i = 0; i < requests.size(); ++i) {
      SCOPED_TRACE(testing::Message() << "k " << k << ", request " << i);
      auto [m, text] = testing_oracle::expect_allowed_tokens(*requests[i].grammar, *vocabulary, kEos, -1,
                                                             requests[i].sampling.is_greedy(), run.tokens[i],
                                                             run.logprobs[i]);
      std::printf("k=%d structured request %zu (%s): '%s'\n", k, i,
                  run.finish[i] == FinishReason::kStop ? "stop" : "length", text.c_str());
      ASSERT_NE(run.finish[i], FinishReason::kAbort);
      if (run.finish[i] != FinishReason::kStop) continue;
      EXPECT_TRUE(m.accepting()) << text;
      ++stopped;
    }
    EXPECT_GE(stopped, 2) << "the choices end";
    if (k > 0) {
      EXPECT_GT(run.metrics.spec_decode_num_draft_tokens_total, 0);
    }
    EXPECT_EQ(run.metrics.kv_cache_usage_perc, 0.0) << "pages leaked, k " << k;
  }
}

}  // namespace
}  // namespace moe::engine
