// Greedy decoding through the serving engine (continuous batching, chunked
// prefill, prefix caching, a KV cache small enough to force preemption) on the
// real CPU model equals transformers' greedy continuations
// (tests/data/golden, tools/make_golden.py).
#include <gtest/gtest.h>

#include <fstream>
#include <future>

#include <nlohmann/json.hpp>

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

class EngineGoldenTest : public testing::TestWithParam<std::tuple<std::string, int32_t>> {};

TEST_P(EngineGoldenTest, GreedyThroughTheEngineEqualsTransformers) {
  const auto& [name, num_pages] = GetParam();
  std::ifstream in(golden_dir(name) + "/golden.json");
  ASSERT_TRUE(in.good());
  const auto golden = nlohmann::json::parse(in);
  ThreadPool pool;
  auto config = model::load_model_config(golden_dir(name));
  ASSERT_TRUE(config.has_value()) << config.status().to_string();
  auto weights = model::ModelWeights::load(golden_dir(name), *config, pool);
  ASSERT_TRUE(weights.has_value()) << weights.status().to_string();
  model::Qwen3MoeModel model(*weights);
  EngineOptions options;
  options.scheduler = {.page_size = 4, .num_pages = num_pages, .max_num_seqs = 16, .max_num_batched_tokens = 9,
                       .max_model_len = 96, .enable_prefix_caching = true};
  options.check_invariants = true;
  const kv::KvCacheLayout layout{config->num_layers, config->num_kv_heads, config->head_dim, 4, num_pages, DType::kF32};
  Engine engine(std::make_unique<Qwen3Runner>(model, pool, layout), options);
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

}  // namespace
}  // namespace moe::engine
