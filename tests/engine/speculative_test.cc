// Speculative decoding (engine/speculative.h): the config parser, rejection
// sampling against the target distribution (chi-square), and greedy outputs
// with MTP drafts equal to plain greedy decoding through the Generator and
// the serving Engine (continuous batching, mixed requests, stop conditions
// inside accepted runs, pages back to zero afterwards), on the golden models
// with random MTP weights and on the demo model with its trained MTP layer.
#include "engine/speculative.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <functional>
#include <future>
#include <limits>
#include <set>
#include <thread>

#include "engine/engine.h"
#include "engine/generator.h"
#include "model/config.h"
#include "model/weights.h"
#include "structured/matcher.h"
#include "tests/engine/sampling_oracle.h"
#include "tests/engine/structured_oracle.h"
#include "tokenizer/tokenizer.h"

namespace moe::engine {
namespace {

using testing_oracle::chi_square;
using testing_oracle::kChiSquare999;

TEST(SpeculativeConfig, ParsesVllmSpelling) {
  auto c = parse_speculative_config(R"({"method":"mtp","num_speculative_tokens":3})");
  ASSERT_TRUE(c.has_value()) << c.status().to_string();
  EXPECT_EQ(c->method, "mtp");
  EXPECT_EQ(c->num_speculative_tokens, 3);
  auto off = parse_speculative_config("");
  ASSERT_TRUE(off.has_value());
  EXPECT_FALSE(off->enabled());
}

TEST(SpeculativeConfig, RefusesBadConfigsWithAClearMessage) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{method:mtp}", "JSON object"},
      {"[1]", "JSON object"},
      {R"({"method":"eagle","num_speculative_tokens":2})", "not supported"},
      {R"({"method":"mtp","num_speculative_tokens":0})", "1..8"},
      {R"({"method":"mtp","num_speculative_tokens":9})", "1..8"},
      {R"({"method":"mtp","num_speculative_tokens":"2"})", "integer"},
      {R"({"method":"mtp"})", "missing"},
      {R"({"num_speculative_tokens":2})", "missing"},
      {R"({"method":"mtp","num_speculative_tokens":2,"draft_tp":1})", "unknown field"},
  };
  for (const auto& [text, expected] : cases) {
    auto c = parse_speculative_config(text);
    ASSERT_FALSE(c.has_value()) << text;
    EXPECT_NE(c.status().message().find(expected), std::string::npos) << text << ": " << c.status().to_string();
  }
}

// Rejection sampling keeps the target distribution: the emitted token of one
// position, over many draws with fixed seeds, fits p by a chi-square test at
// significance 0.001 (critical value kChiSquare999 for <= 7 degrees of freedom).
TEST(RejectionSampling, KeepsTheTargetDistribution) {
  const std::vector<float> logits = testing_oracle::standard_logits();
  constexpr int kDraws = 40000;
  for (const SamplingParams& params : testing_oracle::standard_cases()) {
    const std::vector<double> p = sampling_distribution(logits, params);
    const std::vector<double> expected = testing_oracle::expected_distribution(logits, params);
    for (size_t i = 0; i < p.size(); ++i) ASSERT_NEAR(p[i], expected[i], 1e-6);  // f32 vs f64 scaling
    // q one-hot at a likely token, at an unlikely one, and a general q (draft drawn from it).
    const std::vector<double> q_general = {0.3, 0.05, 0.2, 0.05, 0.1, 0.1, 0.1, 0.1};
    for (int draft_case = 0; draft_case < 3; ++draft_case) {
      std::vector<int> counts(p.size());
      for (int i = 0; i < kDraws; ++i) {
        const double u_draft = uniform_draw(77, static_cast<uint64_t>(i));
        int32_t draft = draft_case == 0 ? 7 : 4;
        std::vector<double> q;
        if (draft_case == 2) {
          q = q_general;
          double c = 0;
          for (draft = 0; draft < 7 && u_draft >= (c += q[static_cast<size_t>(draft)]); ++draft) {}
        }
        const RejectionResult r = rejection_step(p, q, draft, uniform_draw(1, static_cast<uint64_t>(i)),
                                                 uniform_draw(2, static_cast<uint64_t>(i)));
        ++counts[static_cast<size_t>(r.token)];
      }
      int dof = 0;
      EXPECT_LT(chi_square(counts, p, kDraws, &dof), kChiSquare999) << "draft case " << draft_case;
    }
  }
}

// One sequence's run from its verified rows ([1 + drafts, vocab]) through the
// step's sampling on the host (sample_on_host, runs_from_samples).
std::vector<int32_t> verify(const std::vector<float>& rows, int64_t vocab, std::vector<int32_t> drafts,
                            const SamplingParams& params, uint64_t seed, uint64_t first_step) {
  StepPlan plan;
  ScheduledChunk chunk;
  chunk.num_drafts = static_cast<int32_t>(drafts.size());
  chunk.num_tokens = chunk.num_drafts + 1;
  chunk.sample = true;
  plan.chunks.push_back(chunk);
  model::ForwardBatch batch;
  batch.token_ids = {0};
  batch.token_ids.insert(batch.token_ids.end(), drafts.begin(), drafts.end());
  batch.query_start = {0, chunk.num_tokens};
  StepSampling sampling;
  add_chunk_rows(sampling, plan, batch, 0, {params, seed, first_step});
  Tensor logits(DType::kF32, {chunk.num_tokens, vocab});
  std::copy(rows.begin(), rows.end(), logits.data_as<float>());
  return runs_from_samples(plan, sample_on_host(logits, sampling)).at(0);
}

// The step's sampling end to end: the first emitted token of a sampled
// request is distributed as p whatever the draft.
TEST(RejectionSampling, VerifyDraftsFirstTokenFollowsTheTarget) {
  const std::vector<float> row = testing_oracle::standard_logits();
  std::vector<float> rows = row;
  rows.insert(rows.end(), row.begin(), row.end());  // 1 draft: 2 rows
  SamplingParams params;
  params.temperature = 0.8f;
  const std::vector<double> p = sampling_distribution(row, params);
  constexpr int kDraws = 40000;
  std::vector<int> counts(p.size());
  for (int i = 0; i < kDraws; ++i) {
    const int32_t draft = 1;
    const auto run = verify(rows, 8, {draft}, params, 1000 + i, 0);
    ++counts[static_cast<size_t>(run[0])];
    ASSERT_TRUE(run.size() == 1 || (run.size() == 2 && run[0] == draft));
  }
  int dof = 0;
  EXPECT_LT(chi_square(counts, p, kDraws, &dof), kChiSquare999);
}

TEST(RejectionSampling, GreedyAcceptsWhileDraftsMatchTheArgmax) {
  const std::vector<float> a = {0, 3, 1}, b = {2, 0, 1}, c = {0, 0, 5};
  std::vector<float> rows;
  for (const auto* r : {&a, &b, &c}) rows.insert(rows.end(), r->begin(), r->end());
  SamplingParams greedy;
  greedy.temperature = 0;
  EXPECT_EQ(verify(rows, 3, {1, 0}, greedy, 0, 0), (std::vector<int32_t>{1, 0, 2}));
  EXPECT_EQ(verify(rows, 3, {1, 2}, greedy, 0, 0), (std::vector<int32_t>{1, 0}));
  EXPECT_EQ(verify(rows, 3, {2, 0}, greedy, 0, 0), (std::vector<int32_t>{1}));
}

// A chunk's rows with drafts get the adjustments of the plain step that would
// follow accepting the drafts before them: output counts, the repetition set
// and min_tokens' ban move with each draft.
TEST(RejectionSampling, DraftRowsAdjustAsIfTheirDraftsWereAccepted) {
  SamplingParams params;
  params.presence_penalty = 0.5f, params.frequency_penalty = 0.25f, params.repetition_penalty = 1.2f;
  params.min_tokens = 3;
  params.logit_bias = {{4, 2.0f}, {9, -1.0f}};
  const std::vector<int32_t> tokens = {1, 2, 3, 2, 5, 7, 8};  // prompt of 5, output of 2
  const std::vector<int32_t> drafts = {7, 7, 9}, stop = {0, 9};
  constexpr int64_t kVocab = 16;
  StepSampling sampling;
  add_chunk_adjustments(sampling, 4, params, tokens, 2, drafts, stop, kVocab);
  std::vector<int32_t> history = tokens;
  size_t next = 0;
  for (int32_t j = 0; j <= 3; ++j) {
    if (j > 0) history.push_back(drafts[j - 1]);
    for (const ops::LogitAdjustment& want : logit_adjustments(4 + j, params, history, 2 + j, stop, kVocab)) {
      ASSERT_LT(next, sampling.adjustments.size());
      const ops::LogitAdjustment& got = sampling.adjustments[next++];
      EXPECT_EQ(got.row, want.row);
      EXPECT_EQ(got.token, want.token) << "row " << want.row;
      EXPECT_EQ(got.bias, want.bias) << "row " << want.row << " token " << want.token;
      EXPECT_EQ(got.repetition, want.repetition) << "row " << want.row << " token " << want.token;
      EXPECT_EQ(got.subtract, want.subtract) << "row " << want.row << " token " << want.token;
    }
  }
  EXPECT_EQ(next, sampling.adjustments.size());
  // Row 4 (2 outputs) still bans the stop tokens, row 5 (3) no longer does.
  auto bias_of = [&](int32_t row, int32_t token) {
    for (const auto& a : sampling.adjustments)
      if (a.row == row && a.token == token) return a.bias;
    return 0.0f;
  };
  EXPECT_EQ(bias_of(4, 0), -std::numeric_limits<float>::infinity());
  EXPECT_EQ(bias_of(5, 0), 0.0f);
}

// A step's runs over chunks with and without drafts, accepted and rejected,
// and a chunk that does not sample, equal greedy verification by definition
// (the argmax while it equals the draft), chunk by chunk.
TEST(RejectionSampling, StepRunsAreEachChunksGreedyVerification) {
  const int64_t vocab = 11;
  StepPlan plan;
  model::ForwardBatch batch;
  batch.query_start = {0};
  const std::vector<std::pair<int, bool>> chunks = {{3, true}, {0, true}, {2, true}, {0, false}, {4, true}};
  uint64_t id = 1;
  for (const auto& [drafts, sample] : chunks) {
    ScheduledChunk chunk;
    chunk.id = id++;
    chunk.num_tokens = 1 + drafts;
    chunk.num_drafts = drafts;
    chunk.sample = sample;
    plan.chunks.push_back(chunk);
    for (int t = 0; t <= drafts; ++t) batch.token_ids.push_back(static_cast<int32_t>((t * 5 + id) % vocab));
    batch.query_start.push_back(batch.num_tokens());
  }
  for (uint64_t seed = 0; seed < 50; ++seed) {
    std::vector<float> logits;
    std::vector<int32_t> ids;
    std::vector<std::vector<int32_t>> expected;
    for (size_t c = 0; c < chunks.size(); ++c) {
      if (!chunks[c].second) continue;
      const size_t first = ids.size();
      for (int r = 0; r <= chunks[c].first; ++r) {
        std::vector<float> row(vocab);
        // Rows whose argmax often equals the draft at that row, so runs of accepted drafts happen.
        const int32_t draft = batch.token_ids[batch.query_start[c + 1] - chunks[c].first + std::min(r, chunks[c].first - 1)];
        for (int64_t v = 0; v < vocab; ++v) row[v] = static_cast<float>(uniform_draw(seed, c * 100 + r * vocab + v));
        if (chunks[c].first > 0 && uniform_draw(seed + 7, c * 10 + r) < 0.7) row[draft] += 2.0f;
        ids.push_back(argmax(row));
        logits.insert(logits.end(), row.begin(), row.end());
      }
      const int32_t* drafts = batch.token_ids.data() + batch.query_start[c + 1] - chunks[c].first;
      std::vector<int32_t> run;
      for (int j = 0; j <= chunks[c].first; ++j) {
        run.push_back(ids[first + j]);
        if (j == chunks[c].first || run.back() != drafts[j]) break;
      }
      expected.push_back(run);
    }
    const int64_t rows = static_cast<int64_t>(ids.size());
    Tensor t(DType::kF32, {rows, vocab});
    std::copy(logits.begin(), logits.end(), t.data_as<float>());
    StepSampling sampling;
    RowSampling greedy;
    greedy.params.temperature = 0;
    for (size_t c = 0; c < chunks.size(); ++c)
      if (chunks[c].second) add_chunk_rows(sampling, plan, batch, c, greedy);
    EXPECT_EQ(runs_from_samples(plan, sample_on_host(t, sampling)), expected) << "seed " << seed;
  }
}

std::string golden_dir(const std::string& name) { return std::string(MOE_SOURCE_DIR) + "/tests/data/golden/" + name; }

struct Loaded {
  ThreadPool pool{2};
  model::ModelConfig config;
  std::optional<model::ModelWeights> weights;
  std::optional<model::Qwen3MoeModel> model;
  std::optional<model::MtpWeights> mtp_weights;
  std::optional<model::MtpModel> mtp;
};

// A model and an MTP layer: `mtp_dir` when given, else random weights.
std::unique_ptr<Loaded> load(const std::string& dir, const std::string& mtp_dir, bool moe_mtp) {
  auto l = std::make_unique<Loaded>();
  auto config = model::load_model_config(dir);
  EXPECT_TRUE(config.has_value()) << config.status().to_string();
  l->config = *config;
  auto weights = model::ModelWeights::load(dir, l->config, l->pool);
  EXPECT_TRUE(weights.has_value()) << weights.status().to_string();
  l->weights.emplace(std::move(*weights));
  l->model.emplace(*l->weights);
  if (mtp_dir.empty()) {
    l->mtp_weights.emplace(model::MtpWeights::dummy(l->config, 7, moe_mtp));
  } else {
    auto mtp = model::MtpWeights::load(mtp_dir, l->config);
    EXPECT_TRUE(mtp.has_value()) << mtp.status().to_string();
    l->mtp_weights.emplace(std::move(*mtp));
  }
  l->mtp.emplace(*l->mtp_weights, *l->weights);
  return l;
}

std::vector<GenerationRequest> prompts(int64_t vocab, int num, int max_tokens) {
  std::vector<GenerationRequest> requests;
  for (int i = 0; i < num; ++i) {
    GenerationRequest r;
    for (int t = 0; t < 3 + 5 * i; ++t) r.prompt.push_back(static_cast<int32_t>((17 * t + 31 * i + 5) % vocab));
    r.max_tokens = max_tokens - 3 * i;
    r.sampling.temperature = 0;
    r.ignore_eos = true;
    requests.push_back(std::move(r));
  }
  return requests;
}

Expected<std::vector<GenerationResult>> generate(Loaded& l, const std::vector<GenerationRequest>& requests, int k,
                                                 GenerationStats* stats = nullptr) {
  GeneratorOptions options;
  options.page_size = 4;
  options.max_tokens_per_step = 7;  // chunked prefill, decodes mixed with prefill chunks
  options.mtp = &*l.mtp;
  options.num_speculative_tokens = k;
  Generator generator(*l.model, l.pool, options);
  auto results = generator.generate(requests);
  if (stats) *stats = generator.stats();
  return results;
}

class GoldenSpeculation : public testing::TestWithParam<std::tuple<std::string, bool>> {};

// Random MTP weights: near-zero acceptance, and outputs identical to plain greedy for k = 1..4.
TEST_P(GoldenSpeculation, GreedyEqualsPlainGreedyForEveryK) {
  const auto& [name, moe_mtp] = GetParam();
  auto l = load(golden_dir(name), "", moe_mtp);
  const auto requests = prompts(l->config.vocab_size, 4, 20);
  auto plain = generate(*l, requests, 0);
  ASSERT_TRUE(plain.has_value()) << plain.status().to_string();
  for (int k = 1; k <= 4; ++k) {
    GenerationStats stats;
    auto spec = generate(*l, requests, k, &stats);
    ASSERT_TRUE(spec.has_value()) << spec.status().to_string();
    for (size_t i = 0; i < requests.size(); ++i) {
      EXPECT_EQ((*spec)[i].token_ids, (*plain)[i].token_ids) << name << " k " << k << " request " << i;
      EXPECT_EQ((*spec)[i].finish_reason, (*plain)[i].finish_reason);
    }
    EXPECT_GT(stats.num_draft_tokens, 0) << "k " << k;
    std::printf("%s k=%d: %lld drafts, %lld accepted\n", name.c_str(), k, static_cast<long long>(stats.num_draft_tokens),
                static_cast<long long>(stats.num_accepted_tokens));
  }
}

INSTANTIATE_TEST_SUITE_P(Models, GoldenSpeculation,
                         testing::Values(std::make_tuple("moe_basic", true), std::make_tuple("moe_basic", false),
                                         std::make_tuple("dense_qwen3", false),
                                         std::make_tuple("moe_dense_layer", true)));

std::string demo_dir() { return std::string(MOE_SOURCE_DIR) + "/models/moeserve-demo"; }
std::string demo_mtp_dir() { return std::string(MOE_SOURCE_DIR) + "/models/moeserve-demo-mtp"; }

// Prompts of the demo's training text's kind: chat turns asking for a fortune, and a text start.
std::vector<GenerationRequest> demo_requests(int max_tokens) {
  const std::vector<std::vector<int32_t>> texts = {
      {1, 317, 201, 386, 330, 263, 409, 16, 2, 201, 1, 319, 201},              // "Tell me a fortune."
      {1, 317, 201, 454, 330, 263, 453, 355, 1096, 16, 2, 201, 1, 319, 201},  // "Give me a quote about science."
      {35, 1067},                                                             // "A computer"
  };
  std::vector<GenerationRequest> requests;
  for (const auto& t : texts) {
    GenerationRequest r;
    r.prompt = t;
    r.max_tokens = max_tokens;
    r.sampling.temperature = 0;
    r.ignore_eos = true;
    requests.push_back(r);
  }
  return requests;
}

// The demo model's trained MTP layer (tools/train_mtp.py): the same greedy
// tokens, with most drafts accepted.
TEST(DemoSpeculation, TrainedMtpIsAcceptedAndExact) {
  auto l = load(demo_dir(), demo_mtp_dir(), false);
  const std::vector<GenerationRequest> requests = demo_requests(40);
  auto plain = generate(*l, requests, 0);
  ASSERT_TRUE(plain.has_value()) << plain.status().to_string();
  for (int k = 1; k <= 4; ++k) {
    GenerationStats stats;
    auto spec = generate(*l, requests, k, &stats);
    ASSERT_TRUE(spec.has_value()) << spec.status().to_string();
    for (size_t i = 0; i < requests.size(); ++i)
      EXPECT_EQ((*spec)[i].token_ids, (*plain)[i].token_ids) << "k " << k << " request " << i;
    const double acceptance =
        static_cast<double>(stats.num_accepted_tokens) / static_cast<double>(std::max<int64_t>(1, stats.num_draft_tokens));
    std::printf("demo k=%d: %lld drafts, %lld accepted (%.1f%%)\n", k, static_cast<long long>(stats.num_draft_tokens),
                static_cast<long long>(stats.num_accepted_tokens), 100 * acceptance);
    EXPECT_GT(acceptance, k == 1 ? 0.2 : 0.1) << "k " << k;  // random MTP weights accept ~0
  }
}

// An MTP batch of two sequences (3 and 2 positions, pages 0 and 1) of the
// demo's tokens, and hidden states for it.
model::MtpBatch two_sequence_mtp_batch(std::vector<int32_t> output_rows) {
  model::MtpBatch batch;
  batch.token_ids = {317, 201, 386, 35, 1067};
  batch.positions = {0, 1, 2, 0, 1};
  batch.query_start = {0, 3, 5};
  batch.page_table = {0, 1};
  batch.max_pages_per_seq = 1;
  batch.output_rows = std::move(output_rows);
  return batch;
}

Tensor sine_rows(int64_t rows, int64_t cols) {
  Tensor t(DType::kF32, {rows, cols});
  for (int64_t i = 0; i < t.num_elements(); ++i)
    t.data_as<float>()[i] = std::sin(0.11f * static_cast<float>(i));
  return t;
}

// What the drafter reads of an MTP forward: each output row's greedy token,
// the argmax of the logits the CPU runner computes (lowest id on ties).
TEST(DemoSpeculation, CpuMtpRunnerGivesEachRowsArgmax) {
  auto l = load(demo_dir(), demo_mtp_dir(), false);
  const kv::KvCacheLayout layout{l->config.num_layers, l->config.num_kv_heads, l->config.head_dim, 4, 8,
                                 DType::kF32};
  CpuMtpRunner runner(*l->mtp, l->pool, layout);
  const model::MtpBatch batch = two_sequence_mtp_batch({1, 2, 4});
  const Tensor hidden = sine_rows(5, l->config.hidden_size);
  auto out = runner.forward(batch, hidden.view());
  ASSERT_TRUE(out.has_value()) << out.status().to_string();
  ASSERT_EQ(out->greedy.size(), 3u);
  const int64_t vocab = l->config.vocab_size;
  std::set<int32_t> distinct;
  for (int64_t r = 0; r < 3; ++r) {
    const float* row = out->logits.data_as<float>() + r * vocab;
    EXPECT_EQ(out->greedy[static_cast<size_t>(r)], std::max_element(row, row + vocab) - row) << "row " << r;
    distinct.insert(out->greedy[static_cast<size_t>(r)]);
  }
  EXPECT_GT(distinct.size(), 1u) << "rows of different inputs draft different tokens";
}

// forward_chain's passes (here MtpRunner's own: forward() pass by pass)
// take the row of the pass before that previous_rows names, its output as h
// and its greedy token as the token: the same as forward() given those.
TEST(DemoSpeculation, ChainedPassesReadTheRowsTheyName) {
  auto l = load(demo_dir(), demo_mtp_dir(), false);
  const kv::KvCacheLayout layout{l->config.num_layers, l->config.num_kv_heads, l->config.head_dim, 4, 8,
                                 DType::kF32};
  const int64_t h = l->config.hidden_size;
  CpuMtpRunner runner(*l->mtp, l->pool, layout);
  const model::MtpBatch first_batch = two_sequence_mtp_batch({2, 4});
  const Tensor hidden = sine_rows(5, h);
  auto first = runner.forward(first_batch, hidden.view());
  ASSERT_TRUE(first.has_value()) << first.status().to_string();
  // Pass 0: both sequences, the second first; pass 1: the first sequence alone (row 1 of pass 0).
  std::vector<model::MtpBatch> passes(2);
  passes[0].token_ids = {0, 0};
  passes[0].previous_rows = {1, 0};
  passes[0].positions = {2, 3};
  passes[0].query_start = {0, 1, 2};
  passes[0].page_table = {1, 0};
  passes[0].max_pages_per_seq = 1;
  passes[0].output_rows = {0, 1};
  passes[1].token_ids = {0};
  passes[1].previous_rows = {1};
  passes[1].positions = {4};
  passes[1].query_start = {0, 1};
  passes[1].page_table = {0, 2};
  passes[1].max_pages_per_seq = 2;
  passes[1].output_rows = {0};
  auto chained = runner.forward_chain(*first, passes);
  ASSERT_TRUE(chained.has_value()) << chained.status().to_string();
  ASSERT_EQ(chained->size(), 2u);

  // The same by hand, on a runner of its own (a fresh MTP KV cache written alike).
  CpuMtpRunner by_hand(*l->mtp, l->pool, layout);
  auto again = by_hand.forward(first_batch, hidden.view());
  ASSERT_TRUE(again.has_value());
  ASSERT_EQ(again->greedy, first->greedy);
  auto rows_of = [&](const model::MtpOutput& out, std::initializer_list<int64_t> rows) {
    Tensor t(DType::kF32, {static_cast<int64_t>(rows.size()), h});
    int64_t i = 0;
    for (int64_t r : rows) std::copy_n(out.hidden.data_as<float>() + r * h, h, t.data_as<float>() + h * i++);
    return t;
  };
  model::MtpBatch pass0 = passes[0];
  pass0.previous_rows.clear();
  pass0.token_ids = {again->greedy[1], again->greedy[0]};
  auto out0 = by_hand.forward(pass0, rows_of(*again, {1, 0}).view());
  ASSERT_TRUE(out0.has_value());
  EXPECT_EQ((*chained)[0], out0->greedy);
  model::MtpBatch pass1 = passes[1];
  pass1.previous_rows.clear();
  pass1.token_ids = {out0->greedy[1]};
  auto out1 = by_hand.forward(pass1, rows_of(*out0, {1}).view());
  ASSERT_TRUE(out1.has_value());
  EXPECT_EQ((*chained)[1], out1->greedy);

  passes[1].previous_rows = {2};
  EXPECT_FALSE(runner.forward_chain(*first, passes).has_value()) << "a row past the pass before is refused";
  passes[1].previous_rows = {};
  EXPECT_FALSE(runner.forward_chain(*first, passes).has_value()) << "one previous row per token";
}

struct EngineRun {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<std::vector<TokenLogprobs>> logprobs;  // per token, for requests that asked
  std::vector<FinishReason> finish;
  std::vector<int> drafts, accepted;
  EngineMetrics metrics;
};

// Runs `requests` through the serving engine all at once (k = 0: no drafter).
// With `vocabulary`, structured outputs are served, eos being token `eos_id`.
EngineRun run_engine(Loaded& l, const std::vector<EngineRequest>& requests, int k,
                     std::shared_ptr<const structured::TokenVocabulary> vocabulary = nullptr, int32_t eos_id = -1) {
  EngineOptions options;
  options.scheduler = {.page_size = 4, .num_pages = 60, .max_num_seqs = 8, .max_num_batched_tokens = 12,
                       .max_model_len = 64, .enable_prefix_caching = true};
  options.check_invariants = true;
  options.vocabulary = std::move(vocabulary);
  if (eos_id >= 0) options.eos_token_ids = {eos_id};
  const kv::KvCacheLayout layout{l.config.num_layers, l.config.num_kv_heads, l.config.head_dim, 4, 60, DType::kF32};
  std::unique_ptr<MtpDrafter> drafter;
  if (k > 0) drafter = std::make_unique<MtpDrafter>(*l.mtp, l.pool, layout, k);
  Engine engine(std::make_unique<Qwen3Runner>(*l.model, l.pool, layout), options, std::move(drafter));
  EngineRun run;
  const size_t n = requests.size();
  run.tokens.resize(n), run.logprobs.resize(n), run.finish.resize(n), run.drafts.resize(n),
      run.accepted.resize(n);
  std::vector<std::promise<void>> done(n);
  for (size_t i = 0; i < n; ++i) {
    auto id = engine.submit(requests[i], [&run, &done, i](const EngineOutput& out) {
      if (out.token >= 0) run.tokens[i].push_back(out.token);
      if (out.logprobs) run.logprobs[i].push_back(*out.logprobs);
      if (out.finish != FinishReason::kNone) {
        run.finish[i] = out.finish, run.drafts[i] = out.num_draft_tokens;
        run.accepted[i] = out.num_accepted_draft_tokens;
        done[i].set_value();
      }
    });
    EXPECT_TRUE(id.has_value()) << id.status().to_string();
  }
  for (auto& d : done) d.get_future().wait();
  // Pages back to zero once the last step's gauges are updated (prefix-cached pages are evictable, not used).
  for (int i = 0; i < 200 && (engine.metrics().kv_cache_usage_perc != 0 || engine.metrics().num_requests_running); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  run.metrics = engine.metrics();
  return run;
}

// Request i's logprobs with drafts equal plain decoding's: one per token, for
// the same token, the same value and the same top list (each verified row
// holds the logits a plain step computes for that position; the CPU model's
// rows do not depend on the batch around them, up to summation order).
void expect_same_logprobs(const EngineRun& spec, const EngineRun& plain, size_t i, int k) {
  ASSERT_EQ(spec.logprobs[i].size(), spec.tokens[i].size()) << "k " << k;
  ASSERT_EQ(spec.logprobs[i].size(), plain.logprobs[i].size()) << "k " << k;
  for (size_t t = 0; t < spec.logprobs[i].size(); ++t) {
    const TokenLogprobs &a = spec.logprobs[i][t], &b = plain.logprobs[i][t];
    SCOPED_TRACE(testing::Message() << "k " << k << " request " << i << " token " << t);
    EXPECT_EQ(a.token, spec.tokens[i][t]);
    EXPECT_EQ(a.token, b.token);
    EXPECT_NEAR(a.logprob, b.logprob, 1e-4);
    EXPECT_EQ(a.rank, b.rank);
    ASSERT_EQ(a.top.size(), b.top.size());
    for (size_t j = 0; j < a.top.size(); ++j) {
      EXPECT_EQ(a.top[j].first, b.top[j].first);
      EXPECT_NEAR(a.top[j].second, b.top[j].second, 1e-4);
    }
  }
}

// Continuous batching with mixed requests: speculating greedy ones, one with
// logprobs (drafting too), one seeded sampled one, stop ids and max_tokens
// inside accepted runs. Greedy outputs and the logprobs equal the plain
// engine's; KV pages are all released at the end.
void check_mixed_batch(Loaded& l, std::vector<EngineRequest> requests, bool expect_acceptance) {
  requests[1].num_logprobs = 2;
  requests[3].max_tokens = 2;
  EngineRequest sampled = requests[0];
  sampled.sampling.temperature = 0.9f, sampled.sampling.seed = 5;
  requests.push_back(sampled);
  const EngineRun plain = run_engine(l, requests, 0);
  // A stop id inside a run: the 6th token of request 2's plain output.
  requests[2].stop_token_ids = {plain.tokens[2][5]};
  const EngineRun plain_stop = run_engine(l, requests, 0);
  for (int k : {1, 3}) {
    const EngineRun spec = run_engine(l, requests, k);
    for (size_t i = 0; i + 1 < requests.size(); ++i) {  // the sampled one draws differently
      EXPECT_EQ(spec.tokens[i], plain_stop.tokens[i]) << "k " << k << " request " << i;
      EXPECT_EQ(spec.finish[i], plain_stop.finish[i]) << "k " << k << " request " << i;
    }
    EXPECT_EQ(spec.tokens.back().size(), static_cast<size_t>(requests.back().max_tokens));
    EXPECT_GT(spec.drafts[1], 0) << "logprobs requests draft too";
    expect_same_logprobs(spec, plain_stop, 1, k);
    if (expect_acceptance) {
      EXPECT_GT(spec.accepted[1], 0) << "k " << k << ": no accepted draft of the logprobs request";
    }
    EXPECT_GT(spec.drafts[0], 0);
    const EngineMetrics& m = spec.metrics;
    EXPECT_GT(m.spec_decode_num_draft_tokens_total, 0);
    if (expect_acceptance) {
      EXPECT_GT(m.spec_decode_num_accepted_tokens_total, 0) << "k " << k;
    }
    EXPECT_EQ(m.spec_decode_acceptance_length.count, static_cast<uint64_t>(m.spec_decode_num_drafts_total));
    EXPECT_EQ(m.kv_cache_usage_perc, 0.0) << "pages leaked, k " << k;
    EXPECT_EQ(m.num_requests_running, 0);
    std::printf("engine k=%d: %lld drafts, %lld accepted\n", k,
                static_cast<long long>(m.spec_decode_num_draft_tokens_total),
                static_cast<long long>(m.spec_decode_num_accepted_tokens_total));
  }
  EXPECT_EQ(plain.metrics.kv_cache_usage_perc, 0.0);
}

std::vector<EngineRequest> engine_requests(const std::vector<GenerationRequest>& generation) {
  std::vector<EngineRequest> requests;
  for (const auto& g : generation) {
    EngineRequest r;
    r.prompt = g.prompt, r.max_tokens = g.max_tokens, r.sampling = g.sampling, r.ignore_eos = true;
    requests.push_back(r);
  }
  return requests;
}

TEST(EngineSpeculation, MixedBatchEqualsPlainAndReleasesEveryPage) {
  auto l = load(golden_dir("moe_basic"), "", true);
  check_mixed_batch(*l, engine_requests(prompts(l->config.vocab_size, 5, 24)), false);
}

// The same with the demo's trained MTP layer, so runs of accepted drafts meet
// the stop id and max_tokens.
TEST(EngineSpeculation, MixedBatchWithAcceptedDraftsOnTheDemo) {
  auto l = load(demo_dir(), demo_mtp_dir(), false);
  auto requests = engine_requests(demo_requests(24));
  requests.push_back(requests[0]);
  requests.push_back(requests[1]);
  check_mixed_batch(*l, requests, true);
}

// Penalties, logit_bias and min_tokens with drafts: each verified row counts
// the drafts before it as output (the adjustments of rows 0..k differ), so
// greedy outputs equal the plain engine's, with drafts accepted; a sampled
// penalized request completes.
TEST(EngineSpeculation, PenalizedRequestsSpeculateAndEqualPlain) {
  auto l = load(demo_dir(), demo_mtp_dir(), false);
  auto requests = engine_requests(demo_requests(24));
  requests[0].sampling.presence_penalty = 2.0f;
  requests[0].sampling.logit_bias = {{397, -100.0f}};  // the demo's first greedy token: a new continuation
  requests[1].sampling.frequency_penalty = 0.8f, requests[1].sampling.repetition_penalty = 1.3f;
  requests[2].sampling.min_tokens = 10, requests[2].ignore_eos = false;
  requests[2].sampling.logit_bias = {{201, 4.0f}, {16, -3.0f}};
  EngineRequest sampled = requests[0];
  sampled.sampling.temperature = 0.8f, sampled.sampling.seed = 3;
  requests.push_back(sampled);
  const EngineRun plain = run_engine(*l, requests, 0);
  for (int k : {1, 2}) {
    const EngineRun spec = run_engine(*l, requests, k);
    for (size_t i = 0; i + 1 < requests.size(); ++i) {
      EXPECT_EQ(spec.tokens[i], plain.tokens[i]) << "k " << k << " request " << i;
      EXPECT_GT(spec.drafts[i], 0) << "k " << k << " request " << i;
    }
    EXPECT_EQ(spec.tokens.back().size(), static_cast<size_t>(requests.back().max_tokens));
    EXPECT_GT(spec.metrics.spec_decode_num_accepted_tokens_total, 0) << "k " << k;
    EXPECT_EQ(spec.metrics.kv_cache_usage_perc, 0.0) << "pages leaked, k " << k;
    std::printf("penalized, k=%d: %lld drafts, %lld accepted\n", k,
                static_cast<long long>(spec.metrics.spec_decode_num_draft_tokens_total),
                static_cast<long long>(spec.metrics.spec_decode_num_accepted_tokens_total));
  }
  for (size_t i = 0; i + 1 < requests.size(); ++i)  // the adjustments change the demo's greedy output
    EXPECT_NE(plain.tokens[i], run_engine(*l, {engine_requests(demo_requests(24))[i]}, 0).tokens[0]) << i;
}

// Structured outputs through the engine on the demo model, with and without
// drafts. Oracle: every output token is the argmax of the model's own logits
// (all 4096 logprobs come back) over the tokens the grammar allows there,
// found by trying each token's bytes on the byte matcher (not the token
// filter's trie walk), eos where the output may end; finished outputs parse
// (nlohmann) with the schema's values; greedy outputs with drafts equal plain.
TEST(EngineSpeculation, StructuredOutputsTakeTheBestAllowedTokenWithAndWithoutDrafts) {
  auto l = load(demo_dir(), demo_mtp_dir(), false);
  auto tok = tokenizer::Tokenizer::load(demo_dir());
  ASSERT_TRUE(tok.has_value());
  constexpr int32_t kEos = 2;
  auto vocabulary = structured::TokenVocabulary::from_tokenizer(*tok, l->config.vocab_size);
  auto person =
      structured::Grammar::from_json_schema(nlohmann::ordered_json::parse(testing_oracle::kVerdictSchema));
  ASSERT_TRUE(person.has_value());
  auto choice = structured::Grammar::from_choices({"The fortune", "A computer is", "no"});
  ASSERT_TRUE(choice.has_value());
  std::vector<std::shared_ptr<const structured::Grammar>> grammars = {*person, structured::Grammar::json_object(),
                                                                        *choice};
  std::vector<EngineRequest> requests = engine_requests(demo_requests(44));
  for (size_t i = 0; i < requests.size(); ++i) {
    requests[i].grammar = grammars[i % grammars.size()];
    requests[i].ignore_eos = false;
    requests[i].max_tokens = 64 - static_cast<int>(requests[i].prompt.size());
  }
  // The grammar after a token (a reasoning's end): the third of the free greedy output.
  EngineRequest after = engine_requests(demo_requests(40))[0];
  const int32_t third = run_engine(*l, {after}, 0).tokens[0][2];
  after.grammar = *person, after.grammar_after_token = third, after.ignore_eos = false;
  requests.push_back(after);
  EngineRequest sampled = requests[0];
  sampled.sampling.temperature = 1.0f, sampled.sampling.seed = 9;
  requests.push_back(sampled);
  std::vector<EngineRequest> with_logprobs = requests;
  for (auto& r : with_logprobs) r.num_logprobs = l->config.vocab_size;
  const EngineRun plain = run_engine(*l, with_logprobs, 0, vocabulary, kEos);
  for (size_t i = 0; i < requests.size(); ++i) {
    SCOPED_TRACE(testing::Message() << "request " << i);
    const structured::Grammar& g = *requests[i].grammar;
    auto [m, text] = testing_oracle::expect_allowed_tokens(g, *vocabulary, kEos, requests[i].grammar_after_token,
                                                           i + 1 < requests.size(), plain.tokens[i],
                                                           plain.logprobs[i]);
    std::printf("structured request %zu (%s): '%s'\n", i, plain.finish[i] == FinishReason::kStop ? "stop" : "length",
                text.c_str());
    if (plain.finish[i] != FinishReason::kStop) continue;
    EXPECT_TRUE(m.accepting());
    if (&g == choice->get()) {
      EXPECT_TRUE(text == "The fortune" || text == "A computer is" || text == "no") << text;
      continue;
    }
    nlohmann::json j;
    ASSERT_NO_THROW(j = nlohmann::json::parse(text)) << text;
    ASSERT_TRUE(j.is_object()) << text;
    if (&g == person->get()) {
      EXPECT_TRUE(j["answer"] == "yes" || j["answer"] == "no") << text;
      EXPECT_TRUE(j["score"].is_number_integer()) << text;
      EXPECT_TRUE(j["note"].is_string()) << text;
    }
  }
  EXPECT_EQ(plain.finish[2], FinishReason::kStop) << "a choice ends";
  EXPECT_EQ(plain.metrics.kv_cache_usage_perc, 0.0);
  for (int k : {1, 3}) {
    const EngineRun spec = run_engine(*l, requests, k, vocabulary, kEos);
    for (size_t i = 0; i + 1 < requests.size(); ++i) {
      EXPECT_EQ(spec.tokens[i], plain.tokens[i]) << "k " << k << " request " << i;
      EXPECT_EQ(spec.finish[i], plain.finish[i]) << "k " << k << " request " << i;
    }
    EXPECT_GT(spec.metrics.spec_decode_num_draft_tokens_total, 0);
    EXPECT_EQ(spec.metrics.kv_cache_usage_perc, 0.0) << "pages leaked, k " << k;
  }
}

// A grammar whose only continuation is the end, with min_tokens banning the
// end: the request ends with an error (abort), not a stop that breaks either.
TEST(EngineSpeculation, StructuredOutputsConflictingWithMinTokensEndInAnError) {
  auto l = load(demo_dir(), demo_mtp_dir(), false);
  auto tok = tokenizer::Tokenizer::load(demo_dir());
  ASSERT_TRUE(tok.has_value());
  auto vocabulary = structured::TokenVocabulary::from_tokenizer(*tok, l->config.vocab_size);
  auto choice = structured::Grammar::from_choices({"no"});
  ASSERT_TRUE(choice.has_value());
  EngineRequest r = engine_requests(demo_requests(20))[0];
  r.grammar = *choice, r.ignore_eos = false;
  const EngineRun free = run_engine(*l, {r}, 0, vocabulary, 2);
  EXPECT_EQ(free.finish[0], FinishReason::kStop);
  r.sampling.min_tokens = 8;
  const EngineRun banned = run_engine(*l, {r}, 0, vocabulary, 2);
  EXPECT_EQ(banned.finish[0], FinishReason::kAbort);
  EXPECT_EQ(banned.tokens[0], std::vector<int32_t>(free.tokens[0].begin(), free.tokens[0].end() - 1))
      << "the choice's tokens, then the error instead of eos";
  EXPECT_EQ(banned.metrics.kv_cache_usage_perc, 0.0);
}

// The best token the model's own logits (a full logprobs row, most probable
// first, ties by id) give among those `permitted` keeps: the argmax a
// greedy request with bans or masks must take.
int32_t best_permitted(const TokenLogprobs& row, const std::function<bool(int32_t)>& permitted) {
  for (const auto& [id, logprob] : row.top)
    if (permitted(id)) return id;
  return -1;
}

// vLLM's bad_words and allowed_token_ids through the engine on the demo model,
// with and without drafts. Oracle: every greedy token is the argmax of the
// model's logits over the tokens the definitions permit there -- bad_words: not
// the last token of a word whose other tokens end the output so far;
// allowed_token_ids: in the set -- and each word and set did take the model's
// argmax somewhere; no bad word occurs in an output, sampled included; greedy
// outputs with drafts equal plain.
TEST(EngineSpeculation, BadWordsAndAllowedTokensTakeTheBestPermittedTokenWithAndWithoutDrafts) {
  auto l = load(demo_dir(), demo_mtp_dir(), false);
  const int64_t vocab = l->config.vocab_size;
  std::vector<EngineRequest> requests = engine_requests(demo_requests(30));
  const EngineRun free = run_engine(*l, requests, 0);
  // Each word is taken from the output under the words before it, at its
  // `at`-th token, so that it would occur.
  auto add_word = [&](EngineRequest& r, size_t at, size_t length) {
    const std::vector<int32_t> out = run_engine(*l, {r}, 0).tokens[0];
    r.sampling.bad_words.emplace_back(out.begin() + static_cast<std::ptrdiff_t>(at - length + 1),
                                      out.begin() + static_cast<std::ptrdiff_t>(at + 1));
  };
  // Request 0: a two-token word, a three-token word, a one-token word.
  add_word(requests[0], 4, 2);
  add_word(requests[0], 12, 3);
  add_word(requests[0], 20, 1);
  // Request 1: every other token id, and the free output's second token left out.
  for (int32_t t = 0; t < vocab; t += 2)
    if (t != free.tokens[1][1]) requests[1].sampling.allowed_token_ids.push_back(t);
  // Request 2: both, the allowed set holding its free output and a few hundred
  // more, but its 7th token.
  std::set<int32_t> allowed(free.tokens[2].begin(), free.tokens[2].end());
  for (int32_t t = 3; t < vocab; t += 13) allowed.insert(t);
  allowed.erase(free.tokens[2][6]);
  requests[2].sampling.allowed_token_ids.assign(allowed.begin(), allowed.end());
  add_word(requests[2], 9, 2);
  add_word(requests[2], 16, 1);
  EngineRequest sampled = requests[2];
  sampled.sampling.temperature = 0.9f, sampled.sampling.seed = 4;
  requests.push_back(sampled);
  std::vector<EngineRequest> with_logprobs = requests;
  for (auto& r : with_logprobs) r.num_logprobs = static_cast<int>(vocab);
  const EngineRun plain = run_engine(*l, with_logprobs, 0);
  for (size_t i = 0; i < requests.size(); ++i) {
    SCOPED_TRACE(testing::Message() << "request " << i);
    const SamplingParams& p = requests[i].sampling;
    const std::vector<int32_t>& out = plain.tokens[i];
    std::set<size_t> took_argmax;  // bad words (by index), and the allowed set (bad_words.size())
    ASSERT_EQ(out.size(), static_cast<size_t>(requests[i].max_tokens));
    ASSERT_EQ(plain.logprobs[i].size(), out.size());
    for (size_t t = 0; t < out.size(); ++t) {
      auto ends_output = [&](const std::vector<int32_t>& word) {  // the word's other tokens end out[0, t)
        const size_t n = word.size() - 1;
        return n <= t && std::equal(word.begin(), word.end() - 1, out.begin() + static_cast<std::ptrdiff_t>(t - n));
      };
      auto permitted = [&](int32_t id) {
        if (!p.allowed_token_ids.empty() &&
            !std::binary_search(p.allowed_token_ids.begin(), p.allowed_token_ids.end(), id))
          return false;
        for (const auto& word : p.bad_words)
          if (word.back() == id && ends_output(word)) return false;
        return true;
      };
      EXPECT_TRUE(permitted(out[t])) << "token " << t;
      if (i + 1 == requests.size()) continue;  // (sampled)
      EXPECT_EQ(out[t], best_permitted(plain.logprobs[i][t], permitted)) << "token " << t;
      // Where a restriction took the model's own argmax.
      const int32_t argmax = plain.logprobs[i][t].top[0].first;
      for (size_t w = 0; w < p.bad_words.size(); ++w)
        if (p.bad_words[w].back() == argmax && ends_output(p.bad_words[w])) took_argmax.insert(w);
      if (!p.allowed_token_ids.empty() &&
          !std::binary_search(p.allowed_token_ids.begin(), p.allowed_token_ids.end(), argmax))
        took_argmax.insert(p.bad_words.size());
    }
    if (i + 1 < requests.size()) {  // every word and every allowed set changed the output somewhere
      EXPECT_EQ(took_argmax.size(), p.bad_words.size() + (p.allowed_token_ids.empty() ? 0 : 1));
    }
  }
  EXPECT_EQ(plain.metrics.kv_cache_usage_perc, 0.0);
  // Words are matched in the output only (vLLM's): one that the prompt's last
  // token and the first output token would make bans nothing.
  EngineRequest prompt_word = engine_requests(demo_requests(30))[2];
  const std::vector<int32_t> pair = {prompt_word.prompt.back(), free.tokens[2][0]};
  ASSERT_EQ(std::search(free.tokens[2].begin(), free.tokens[2].end(), pair.begin(), pair.end()), free.tokens[2].end());
  prompt_word.sampling.bad_words = {pair};
  EXPECT_EQ(run_engine(*l, {prompt_word}, 0).tokens[0], free.tokens[2]);
  for (int k : {1, 3}) {
    const EngineRun spec = run_engine(*l, requests, k);
    for (size_t i = 0; i + 1 < requests.size(); ++i)
      EXPECT_EQ(spec.tokens[i], plain.tokens[i]) << "k " << k << " request " << i;
    EXPECT_GT(spec.metrics.spec_decode_num_accepted_tokens_total, 0) << "k " << k;
    EXPECT_EQ(spec.metrics.kv_cache_usage_perc, 0.0) << "pages leaked, k " << k;
  }
}

// allowed_token_ids with a grammar: the masks are and'ed (the output spells a
// choice with the allowed tokens only); a mask every token of which the
// request's own bans take (min_tokens with only eos allowed; a bad word that is
// the one allowed token) ends the request with an error at that token.
TEST(EngineSpeculation, AllowedTokensMeetTheGrammarAndTheirConflictsEndInAnError) {
  auto l = load(demo_dir(), demo_mtp_dir(), false);
  auto tok = tokenizer::Tokenizer::load(demo_dir());
  ASSERT_TRUE(tok.has_value());
  constexpr int32_t kEos = 2;
  auto vocabulary = structured::TokenVocabulary::from_tokenizer(*tok, l->config.vocab_size);
  auto choice = structured::Grammar::from_choices({"The fortune", "A computer is"});
  ASSERT_TRUE(choice.has_value());
  EngineRequest r = engine_requests(demo_requests(20))[0];
  r.grammar = *choice, r.ignore_eos = false;
  const EngineRun free = run_engine(*l, {r}, 0, vocabulary, kEos);
  ASSERT_EQ(free.finish[0], FinishReason::kStop);
  std::string free_text;
  for (int32_t t : free.tokens[0]) free_text += vocabulary->bytes(t);
  // Ban (by leaving out) every token holding the first letter of the free choice.
  const char letter = free_text[0];
  EngineRequest masked = r;
  for (int32_t t = 0; t < l->config.vocab_size; ++t)
    if (vocabulary->bytes(t).find(letter) == std::string::npos) masked.sampling.allowed_token_ids.push_back(t);
  for (int k : {0, 2}) {
    const EngineRun run = run_engine(*l, {masked}, k, vocabulary, kEos);
    ASSERT_EQ(run.finish[0], FinishReason::kStop) << "k " << k;
    std::string text;
    for (int32_t t : run.tokens[0]) {
      EXPECT_EQ(vocabulary->bytes(t).find(letter), std::string::npos) << t;
      if (t != kEos) text += vocabulary->bytes(t);
    }
    EXPECT_EQ(text, free_text.starts_with("The") ? "A computer is" : "The fortune") << "k " << k;
    EXPECT_EQ(run.metrics.kv_cache_usage_perc, 0.0);
  }
  EngineRequest only_eos = engine_requests(demo_requests(20))[0];
  only_eos.ignore_eos = false, only_eos.sampling.allowed_token_ids = {kEos}, only_eos.sampling.min_tokens = 3;
  EngineRequest banned_word = engine_requests(demo_requests(20))[1];
  banned_word.sampling.allowed_token_ids = {401, 402};
  banned_word.sampling.bad_words = {{401}, {402, 402}};  // 402 then 402 once it was chosen
  const EngineRun conflicts = run_engine(*l, {only_eos, banned_word}, 0, vocabulary, kEos);
  EXPECT_EQ(conflicts.finish[0], FinishReason::kAbort);
  EXPECT_TRUE(conflicts.tokens[0].empty());
  EXPECT_EQ(conflicts.finish[1], FinishReason::kAbort);
  EXPECT_EQ(conflicts.tokens[1], std::vector<int32_t>{402});
  EXPECT_EQ(conflicts.metrics.kv_cache_usage_perc, 0.0);
}

// Without a vocabulary the engine refuses a structured request at submission.
TEST(EngineSpeculation, StructuredOutputsNeedAVocabulary) {
  auto l = load(golden_dir("moe_basic"), "", true);
  EngineOptions options;
  options.scheduler = {.page_size = 4, .num_pages = 8, .max_num_seqs = 2, .max_num_batched_tokens = 8,
                       .max_model_len = 32};
  const kv::KvCacheLayout layout{l->config.num_layers, l->config.num_kv_heads, l->config.head_dim, 4, 8, DType::kF32};
  Engine engine(std::make_unique<Qwen3Runner>(*l->model, l->pool, layout), options);
  EngineRequest r;
  r.prompt = {1, 2, 3};
  r.grammar = structured::Grammar::json_object();
  auto id = engine.submit(r, [](const EngineOutput&) {});
  ASSERT_FALSE(id.has_value());
  EXPECT_NE(id.status().message().find("tokenizer"), std::string::npos) << id.status().to_string();
}

}  // namespace
}  // namespace moe::engine
