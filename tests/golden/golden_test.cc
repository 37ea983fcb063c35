// The CPU reference forward against transformers' golden outputs
// (tests/data/golden, made by tools/make_golden.py from the same bf16 weights,
// computed in float32).
//
// Logit tolerance: both sides compute in float32 from identical bf16 weights;
// they differ only in summation order (our 16-lane dot products vs PyTorch's
// BLAS), which perturbs each op by a few ulps and compounds over ~10 ops per
// layer. Measured differences are ~1e-6 relative; the bound of 1e-4 leaves
// headroom for that while any real mistake (a wrong RoPE pairing, norm, eps,
// routing rule or scale) moves logits by 1e-2 or more. The greedy tokens must
// match exactly: make_golden.py kept only prompts whose top-1/top-2 margins
// stay >= 1e-3 at every step, far above the float32 noise.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "engine/generator.h"
#include "kv/kv_cache.h"
#include "model/config.h"
#include "model/qwen3_moe.h"
#include "model/weights.h"

namespace moe {
namespace {

using nlohmann::json;

constexpr double kLogitTolerance = 1e-4;

std::string golden_dir(const std::string& name) { return std::string(MOE_SOURCE_DIR) + "/tests/data/golden/" + name; }

json read_golden(const std::string& name) {
  std::ifstream in(golden_dir(name) + "/golden.json");
  EXPECT_TRUE(in.good()) << name;
  return json::parse(in);
}

double relative_error(std::span<const float> ours, const std::vector<float>& ref) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    diff += (ours[i] - ref[i]) * static_cast<double>(ours[i] - ref[i]);
    norm += ref[i] * static_cast<double>(ref[i]);
  }
  return std::sqrt(diff / norm);
}

struct LoadedModel {
  model::ModelConfig config;
  std::unique_ptr<model::ModelWeights> weights;
  std::unique_ptr<model::Qwen3MoeModel> model;
};

LoadedModel load(const std::string& name, ThreadPool& pool) {
  LoadedModel m;
  auto config = model::load_model_config(golden_dir(name));
  EXPECT_TRUE(config.has_value()) << config.status().to_string();
  m.config = *config;
  auto weights = model::ModelWeights::load(golden_dir(name), m.config, pool);
  EXPECT_TRUE(weights.has_value()) << weights.status().to_string();
  m.weights = std::make_unique<model::ModelWeights>(std::move(weights).value());
  m.model = std::make_unique<model::Qwen3MoeModel>(*m.weights);
  return m;
}

// One prefill of `prompt` in a fresh cache; logits of every position.
Tensor prefill_logits(const model::Qwen3MoeModel& model, ThreadPool& pool, const std::vector<int32_t>& prompt,
                      int page_size = 16) {
  const auto& c = model.config();
  const auto n = static_cast<int32_t>(prompt.size());
  const int32_t pages = (n + page_size - 1) / page_size;
  kv::KvCache cache({c.num_layers, c.num_kv_heads, c.head_dim, page_size, pages + 3, DType::kF32});
  std::vector<ops::PagedKv> layers;
  for (int l = 0; l < c.num_layers; ++l) layers.push_back(cache.layer(l));
  model::ForwardBatch batch;
  batch.token_ids = prompt;
  for (int32_t i = 0; i < n; ++i) batch.positions.push_back(i), batch.logits_rows.push_back(i);
  batch.query_start = {0, n};
  // Pages in reverse order, so the test also covers a non-identity page table.
  for (int32_t p = 0; p < pages; ++p) batch.page_table.push_back(pages + 2 - p);
  batch.max_pages_per_seq = pages;
  return model.forward(pool, batch, layers);
}

std::vector<int32_t> ids_of(const json& j) { return j.get<std::vector<int32_t>>(); }

class GoldenTest : public testing::TestWithParam<std::string> {
 protected:
  ThreadPool pool_;
};

TEST_P(GoldenTest, LastLogitsMatchTransformers) {
  auto golden = read_golden(GetParam());
  auto m = load(GetParam(), pool_);
  ASSERT_TRUE(m.model);
  double max_err = 0;
  for (const auto& prompt : golden["prompts"]) {
    const auto ids = ids_of(prompt["ids"]);
    Tensor logits = prefill_logits(*m.model, pool_, ids);
    const auto vocab = m.config.vocab_size;
    std::span<const float> last(logits.data_as<float>() + (ids.size() - 1) * vocab, vocab);
    const double err = relative_error(last, prompt["last_logits"].get<std::vector<float>>());
    EXPECT_LT(err, kLogitTolerance) << GetParam() << " prompt of " << ids.size() << " tokens";
    max_err = std::max(max_err, err);
  }
  std::printf("%s: max relative logit error %.3g\n", GetParam().c_str(), max_err);
}

TEST_P(GoldenTest, AllPositionLogitsMatchTransformers) {
  auto golden = read_golden(GetParam());
  auto m = load(GetParam(), pool_);
  const auto& all = golden["all_positions"];
  const auto ids = ids_of(golden["prompts"][all["prompt_index"].get<int>()]["ids"]);
  Tensor logits = prefill_logits(*m.model, pool_, ids);
  const auto vocab = m.config.vocab_size;
  for (size_t pos = 0; pos < ids.size(); ++pos) {
    std::span<const float> row(logits.data_as<float>() + pos * vocab, vocab);
    EXPECT_LT(relative_error(row, all["logits"][pos].get<std::vector<float>>()), kLogitTolerance) << "position " << pos;
  }
}

std::vector<engine::GenerationResult> greedy(const model::Qwen3MoeModel& model, ThreadPool& pool,
                                             const std::vector<std::vector<int32_t>>& prompts, int max_tokens,
                                             engine::GeneratorOptions options = {}) {
  std::vector<engine::GenerationRequest> requests;
  for (const auto& p : prompts) {
    engine::GenerationRequest r;
    r.prompt = p;
    r.max_tokens = max_tokens;
    r.sampling.temperature = 0.0f;
    r.ignore_eos = true;
    requests.push_back(r);
  }
  engine::Generator generator(model, pool, options);
  auto results = generator.generate(requests);
  EXPECT_TRUE(results.has_value()) << results.status().to_string();
  return results.has_value() ? *results : std::vector<engine::GenerationResult>{};
}

TEST_P(GoldenTest, GreedyContinuationsMatchTransformers) {
  auto golden = read_golden(GetParam());
  auto m = load(GetParam(), pool_);
  for (const auto& prompt : golden["prompts"]) {
    auto results = greedy(*m.model, pool_, {ids_of(prompt["ids"])}, 24);
    ASSERT_EQ(results.size(), 1u);
    EXPECT_EQ(results[0].token_ids, ids_of(prompt["greedy"])) << "prompt of " << prompt["ids"].size() << " tokens";
    EXPECT_EQ(results[0].finish_reason, "length");
  }
}

TEST_P(GoldenTest, BatchedEqualsOneByOneAndChunkedPrefill) {
  auto golden = read_golden(GetParam());
  auto m = load(GetParam(), pool_);
  std::vector<std::vector<int32_t>> prompts;
  for (const auto& prompt : golden["prompts"]) prompts.push_back(ids_of(prompt["ids"]));
  auto batched = greedy(*m.model, pool_, prompts, 24);
  engine::GeneratorOptions chunked;
  chunked.max_tokens_per_step = 7;  // prompts split over several steps, mixed with decodes
  chunked.page_size = 4;
  auto batched_chunked = greedy(*m.model, pool_, prompts, 24, chunked);
  ASSERT_EQ(batched.size(), prompts.size());
  ASSERT_EQ(batched_chunked.size(), prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto alone = greedy(*m.model, pool_, {prompts[i]}, 24);
    EXPECT_EQ(batched[i].token_ids, alone[0].token_ids) << "prompt " << i;
    EXPECT_EQ(batched_chunked[i].token_ids, alone[0].token_ids) << "prompt " << i;
    EXPECT_EQ(alone[0].token_ids, ids_of(golden["prompts"][i]["greedy"])) << "prompt " << i;
  }
}

TEST_P(GoldenTest, CachedDecodeEqualsFullRecompute) {
  auto golden = read_golden(GetParam());
  auto m = load(GetParam(), pool_);
  const auto prompt = ids_of(golden["prompts"][3]["ids"]);
  auto cached = greedy(*m.model, pool_, {prompt}, 12);
  // Recompute: each next token from a fresh prefill over the whole sequence.
  std::vector<int32_t> seq = prompt;
  const auto vocab = m.config.vocab_size;
  for (int step = 0; step < 12; ++step) {
    Tensor logits = prefill_logits(*m.model, pool_, seq, 4);
    std::span<const float> last(logits.data_as<float>() + (seq.size() - 1) * vocab, vocab);
    seq.push_back(engine::argmax(last));
  }
  EXPECT_EQ(cached[0].token_ids, std::vector<int32_t>(seq.begin() + static_cast<long>(prompt.size()), seq.end()));
}

INSTANTIATE_TEST_SUITE_P(Models, GoldenTest,
                         testing::Values("moe_basic", "moe_dense_layer", "moe_sparse_step", "moe_sparse_step_single",
                                         "moe_yarn", "dense_qwen3"));

TEST(Golden, ShardedCheckpointEqualsSingleFile) {
  ThreadPool pool;
  auto sharded = load("moe_sparse_step", pool);
  auto single = load("moe_sparse_step_single", pool);
  const std::vector<int32_t> prompt = {5, 77, 300, 12, 9, 401, 3};
  Tensor a = prefill_logits(*sharded.model, pool, prompt);
  Tensor b = prefill_logits(*single.model, pool, prompt);
  ASSERT_EQ(a.num_bytes(), b.num_bytes());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.num_bytes()), 0);
}

TEST(Golden, Bf16KvCacheStaysClose) {
  // A bf16 KV cache rounds k and v to 8 mantissa bits: logits move by ~1e-3
  // relative, so this checks closeness, not equality.
  ThreadPool pool;
  auto golden = read_golden("moe_basic");
  auto m = load("moe_basic", pool);
  const auto ids = ids_of(golden["prompts"][4]["ids"]);
  const auto& c = m.config;
  kv::KvCache cache({c.num_layers, c.num_kv_heads, c.head_dim, 16, 8, DType::kBF16});
  std::vector<ops::PagedKv> layers;
  for (int l = 0; l < c.num_layers; ++l) layers.push_back(cache.layer(l));
  model::ForwardBatch batch;
  batch.token_ids = ids;
  for (int32_t i = 0; i < static_cast<int32_t>(ids.size()); ++i) batch.positions.push_back(i);
  batch.logits_rows = {static_cast<int32_t>(ids.size()) - 1};
  batch.query_start = {0, static_cast<int32_t>(ids.size())};
  batch.page_table = {0, 1, 2, 3, 4, 5, 6, 7};
  batch.max_pages_per_seq = 8;
  Tensor logits = m.model->forward(pool, batch, layers);
  std::span<const float> last(logits.data_as<float>(), c.vocab_size);
  EXPECT_LT(relative_error(last, golden["prompts"][4]["last_logits"].get<std::vector<float>>()), 2e-2);
}

}  // namespace
}  // namespace moe
