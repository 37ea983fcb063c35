// Greedy decoding through the serving engine (continuous batching, chunked
// prefill, prefix caching, a KV cache small enough to force preemption) on the
// real CPU model equals transformers' greedy continuations
// (tests/data/golden, tools/make_golden.py).
#include <gtest/gtest.h>

#include <fstream>
#include <future>
#include <nlohmann/json.hpp>
#include <optional>

#include "engine/engine.h"
#include "model/config.h"
#include "model/weights.h"

namespace moe::engine {
namespace {

std::string golden_dir(const std::string& name) { return std::string(MOE_SOURCE_DIR) + "/tests/data/golden/" + name; }

struct Result {
  std::vector<int32_t> tokens;
  FinishReason finish = FinishReason::kNone;
  std::promise<void> done;
};

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  return in.good() ? nlohmann::json::parse(in) : nlohmann::json::object();
}

// A golden model on the CPU behind an engine with a small page size and batch
// budget (chunked prefill), prefix caching, and `num_pages` KV pages.
struct GoldenEngine {
  ThreadPool pool;
  std::optional<model::ModelWeights> weights;
  std::optional<model::Qwen3MoeModel> model;
  std::unique_ptr<Engine> engine;

  GoldenEngine(const std::string& name, int32_t num_pages, std::vector<int32_t> eos_token_ids = {}) {
    auto config = model::load_model_config(golden_dir(name));
    EXPECT_TRUE(config.has_value()) << config.status().to_string();
    if (!config) return;
    auto loaded = model::ModelWeights::load(golden_dir(name), *config, pool);
    EXPECT_TRUE(loaded.has_value()) << loaded.status().to_string();
    if (!loaded) return;
    weights.emplace(std::move(*loaded));
    model.emplace(*weights);
    EngineOptions options;
    options.scheduler = {.page_size = 4,
                         .num_pages = num_pages,
                         .max_num_seqs = 16,
                         .max_num_batched_tokens = 9,
                         .max_model_len = 96,
                         .enable_prefix_caching = true};
    options.check_invariants = true;
    options.eos_token_ids = std::move(eos_token_ids);
    const kv::KvCacheLayout layout{config->num_layers, config->num_kv_heads, config->head_dim, 4,
                                   num_pages,          DType::kF32};
    engine = std::make_unique<Engine>(std::make_unique<Qwen3Runner>(*model, pool, layout), options);
  }
};

class EngineGoldenTest : public testing::TestWithParam<std::tuple<std::string, int32_t>> {};

TEST_P(EngineGoldenTest, GreedyThroughTheEngineEqualsTransformers) {
  const auto& [name, num_pages] = GetParam();
  const auto golden = read_json(golden_dir(name) + "/golden.json");
  GoldenEngine g(name, num_pages);
  ASSERT_TRUE(g.engine);
  Engine& engine = *g.engine;
  // Every prompt twice (the second copy hits the prefix cache), all at once.
  std::vector<std::unique_ptr<Result>> results;
  for (int copy = 0; copy < 2; ++copy) {
    for (const auto& prompt : golden["prompts"]) {
      results.push_back(std::make_unique<Result>());
      Result* r = results.back().get();
      EngineRequest request;
      request.prompt = prompt["ids"].get<std::vector<int32_t>>();
      request.max_tokens = 24;
      request.sampling.temperature = 0;
      request.ignore_eos = true;
      auto id = engine.submit(request, [r](const EngineOutput& out) {
        if (out.token >= 0) r->tokens.push_back(out.token);
        if (out.finish != FinishReason::kNone) r->finish = out.finish, r->done.set_value();
      });
      ASSERT_TRUE(id.has_value()) << id.status().to_string();
    }
  }
  const size_t n = golden["prompts"].size();
  for (size_t i = 0; i < results.size(); ++i) {
    results[i]->done.get_future().wait();
    EXPECT_EQ(results[i]->tokens, golden["prompts"][i % n]["greedy"].get<std::vector<int32_t>>()) << name << " " << i;
    EXPECT_EQ(results[i]->finish, FinishReason::kLength);
  }
  const EngineMetrics m = engine.metrics();
  if (num_pages < 40) {
    EXPECT_GT(m.num_preemptions_total, 0);  // the small cache forces recomputes
  } else {
    EXPECT_GT(m.prefix_cache_hits_total, 0);  // second copies reuse the first's pages
  }
}

INSTANTIATE_TEST_SUITE_P(Models, EngineGoldenTest,
                         testing::Values(std::make_tuple("moe_basic", 200), std::make_tuple("moe_basic", 30),
                                         std::make_tuple("moe_yarn", 200), std::make_tuple("dense_qwen3", 200)));

// The request's logits adjustments (penalties, logit_bias, min_tokens) equal
// transformers' logits processors and OpenAI's penalty definition applied to
// the float32 model (tools/make_penalty_golden.py), each case beside a plain
// greedy copy of its prompt (batches mix adjusted and plain rows); with 30
// pages the sequences are preempted and recomputed, keeping their history.
class PenaltyGoldenTest : public testing::TestWithParam<std::tuple<std::string, int32_t>> {};

TEST_P(PenaltyGoldenTest, AdjustedGreedyEqualsTransformers) {
  const auto& [name, num_pages] = GetParam();
  const auto golden = read_json(golden_dir(name) + "/golden.json");
  const auto penalties = read_json(golden_dir(name) + "/penalties.json");
  const int32_t eos = penalties["eos_token_id"].get<int32_t>();
  GoldenEngine g(name, num_pages, {eos});
  ASSERT_TRUE(g.engine);
  struct Case {
    std::string name;
    std::vector<int32_t> expected, expected_plain;
    std::vector<int32_t> stop_ids;
    Result result, plain;
  };
  std::vector<std::unique_ptr<Case>> cases;
  int num_differing = 0;
  for (const auto& c : penalties["cases"]) {
    auto k = std::make_unique<Case>();
    k->name = c["name"].get<std::string>() + " prompt " + std::to_string(c["prompt_index"].get<int>());
    k->expected = c["greedy"].get<std::vector<int32_t>>();
    num_differing += c["differs_from_plain"].get<bool>();
    const auto& params = c["params"];
    const auto& prompt = golden["prompts"][c["prompt_index"].get<size_t>()];
    EngineRequest request;
    request.prompt = prompt["ids"].get<std::vector<int32_t>>();
    request.max_tokens = penalties["n_greedy"].get<int>();
    k->expected_plain = prompt["greedy"].get<std::vector<int32_t>>();
    k->expected_plain.resize(static_cast<size_t>(request.max_tokens));
    request.sampling.temperature = 0;
    request.sampling.repetition_penalty = params.value("repetition_penalty", 1.0f);
    request.sampling.presence_penalty = params.value("presence_penalty", 0.0f);
    request.sampling.frequency_penalty = params.value("frequency_penalty", 0.0f);
    request.sampling.min_tokens = params.value("min_tokens", 0);
    const auto logit_bias = params.value("logit_bias", nlohmann::json::object());
    for (const auto& [token, bias] : logit_bias.items())
      request.sampling.logit_bias.emplace_back(std::stoi(token), bias.get<float>());
    request.stop_token_ids = params.value("stop_token_ids", std::vector<int32_t>{});
    k->stop_ids = request.stop_token_ids;
    k->stop_ids.push_back(eos);
    auto collect = [](Result* r) {
      return [r](const EngineOutput& out) {
        if (out.token >= 0) r->tokens.push_back(out.token);
        if (out.finish != FinishReason::kNone) r->finish = out.finish, r->done.set_value();
      };
    };
    auto id = g.engine->submit(request, collect(&k->result));
    ASSERT_TRUE(id.has_value()) << k->name << ": " << id.status().to_string();
    EngineRequest plain = request;
    plain.sampling = SamplingParams{.temperature = 0};
    plain.stop_token_ids.clear();
    plain.ignore_eos = true;
    ASSERT_TRUE(g.engine->submit(plain, collect(&k->plain)).has_value());
    cases.push_back(std::move(k));
  }
  ASSERT_GE(cases.size(), 20u);
  EXPECT_GE(num_differing, 20) << "the goldens should mostly differ from plain greedy decoding";
  for (auto& k : cases) {
    k->result.done.get_future().wait();
    k->plain.done.get_future().wait();
    EXPECT_EQ(k->result.tokens, k->expected) << name << " " << k->name;
    const bool stopped =
        std::find(k->stop_ids.begin(), k->stop_ids.end(), k->expected.back()) != k->stop_ids.end();
    EXPECT_EQ(k->result.finish, stopped ? FinishReason::kStop : FinishReason::kLength) << k->name;
    EXPECT_EQ(k->plain.tokens, k->expected_plain) << k->name << " (plain)";
    EXPECT_EQ(k->plain.finish, FinishReason::kLength) << k->name;
  }
  if (num_pages < 40) {
    EXPECT_GT(g.engine->metrics().num_preemptions_total, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Models, PenaltyGoldenTest,
                         testing::Values(std::make_tuple("moe_basic", 200), std::make_tuple("moe_basic", 30),
                                         std::make_tuple("dense_qwen3", 200)));

}  // namespace
}  // namespace moe::engine
