// Greedy decoding through the serving engine (continuous batching, chunked
// prefill, prefix caching, a KV cache small enough to force preemption) on the
// real CPU model equals transformers' greedy continuations
// (tests/data/golden, tools/make_golden.py).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <future>
#include <nlohmann/json.hpp>
#include <numeric>
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

namespace moe::engine {
namespace {

// Prompt logprobs (num_prompt_logprobs): every prompt token after the first,
// given the ones before it, equals transformers' log-softmax of the logits at
// every position of a golden prompt; and on a long prompt made of a golden
// prompt and its greedy continuation (chunked: 9 tokens per step; with 64
// pages two such prompts at a time; after a plain copy filled the prefix
// cache) the continuation's
// tokens are the top-1 of their positions. The first output carries them.
class PromptLogprobsTest : public testing::TestWithParam<int32_t> {};

TEST_P(PromptLogprobsTest, EqualTransformersAtEveryPosition) {
  const int32_t num_pages = GetParam();
  const auto golden = read_json(golden_dir("moe_basic") + "/golden.json");
  GoldenEngine g("moe_basic", num_pages);
  ASSERT_TRUE(g.engine);
  struct Run {
    std::vector<int32_t> tokens;
    std::vector<TokenLogprobs> prompt_logprobs;
    int outputs_with_prompt_logprobs = 0;
    int num_cached_tokens = 0;
    std::promise<void> done;
  };
  auto submit = [&](std::vector<int32_t> prompt, int num_prompt_logprobs, Run& run, int max_tokens = 1) {
    EngineRequest request;
    request.prompt = std::move(prompt);
    request.max_tokens = max_tokens;
    request.sampling.temperature = 0;
    request.ignore_eos = true;
    request.num_prompt_logprobs = num_prompt_logprobs;
    auto id = g.engine->submit(request, [&run](const EngineOutput& out) {
      if (out.token >= 0) run.tokens.push_back(out.token);
      if (!out.prompt_logprobs.empty())
        run.prompt_logprobs = out.prompt_logprobs, ++run.outputs_with_prompt_logprobs;
      run.num_cached_tokens = std::max(run.num_cached_tokens, out.num_cached_tokens);
      if (out.finish != FinishReason::kNone) run.done.set_value();
    });
    ASSERT_TRUE(id.has_value()) << id.status().to_string();
  };
  // A golden prompt with the logits of all its positions.
  const auto& all = golden["all_positions"];
  const auto& short_prompt = golden["prompts"][all["prompt_index"].get<size_t>()];
  const auto short_ids = short_prompt["ids"].get<std::vector<int32_t>>();
  // The longest golden prompt and 23 of its 24 greedy tokens.
  const auto& long_prompt = golden["prompts"][golden["prompts"].size() - 1];
  std::vector<int32_t> long_ids = long_prompt["ids"].get<std::vector<int32_t>>();
  const auto greedy = long_prompt["greedy"].get<std::vector<int32_t>>();
  const size_t continuation_start = long_ids.size();
  long_ids.insert(long_ids.end(), greedy.begin(), greedy.end() - 1);
  Run plain, plain_again, short_run, long_run, long_run_top0;
  submit(long_ids, -1, plain);
  plain.done.get_future().wait();  // its pages are in the prefix cache now
  submit(short_ids, 2, short_run);
  submit(long_ids, 1, long_run, 12);  // decoding on: with 30 pages, preemptions and recomputes
  submit(long_ids, 0, long_run_top0, 12);
  submit(long_ids, -1, plain_again);
  for (Run* r : {&short_run, &long_run, &long_run_top0, &plain_again}) r->done.get_future().wait();

  ASSERT_EQ(short_run.prompt_logprobs.size(), short_ids.size() - 1);
  EXPECT_EQ(short_run.outputs_with_prompt_logprobs, 1);
  for (size_t p = 0; p + 1 < short_ids.size(); ++p) {
    const auto logits = all["logits"][p].get<std::vector<float>>();
    double max_logit = *std::max_element(logits.begin(), logits.end()), z = 0;
    for (float x : logits) z += std::exp(x - max_logit);
    const double log_z = max_logit + std::log(z);
    const TokenLogprobs& lp = short_run.prompt_logprobs[p];
    EXPECT_EQ(lp.token, short_ids[p + 1]);
    EXPECT_NEAR(lp.logprob, logits[static_cast<size_t>(short_ids[p + 1])] - log_z, 2e-3)
        << "position " << p + 1;
    ASSERT_EQ(lp.top.size(), 2u);
    std::vector<int32_t> order(logits.size());
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + 2, order.end(),
                      [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
    EXPECT_EQ(lp.top[0].first, order[0]) << "position " << p + 1;
    EXPECT_NEAR(lp.top[0].second, logits[static_cast<size_t>(order[0])] - log_z, 2e-3);
  }
  ASSERT_EQ(long_run.prompt_logprobs.size(), long_ids.size() - 1);
  ASSERT_EQ(long_run_top0.prompt_logprobs.size(), long_ids.size() - 1);
  for (size_t p = 0; p + 1 < long_ids.size(); ++p) {
    const TokenLogprobs& lp = long_run.prompt_logprobs[p];
    EXPECT_EQ(lp.token, long_ids[p + 1]);
    EXPECT_LE(lp.logprob, 0.0f);
    ASSERT_EQ(lp.top.size(), 1u);
    EXPECT_TRUE(long_run_top0.prompt_logprobs[p].top.empty());
    EXPECT_EQ(long_run_top0.prompt_logprobs[p].logprob, lp.logprob);
    if (p + 1 >= continuation_start) {  // a greedy token: the most probable one
      EXPECT_EQ(lp.top[0].first, long_ids[p + 1]) << "position " << p + 1;
      EXPECT_NEAR(lp.logprob, lp.top[0].second, 1e-6);
    }
  }
  ASSERT_EQ(long_run.tokens.size(), 12u);
  EXPECT_EQ(long_run.tokens[0], greedy.back());
  EXPECT_EQ(long_run_top0.tokens, long_run.tokens);
  EXPECT_EQ(long_run_top0.outputs_with_prompt_logprobs, 1);
  EXPECT_EQ(plain.tokens, std::vector<int32_t>{greedy.back()});
  EXPECT_TRUE(plain.prompt_logprobs.empty());
  EXPECT_EQ(long_run.num_cached_tokens, 0) << "prompt logprobs compute the whole prompt";
  EXPECT_EQ(long_run_top0.num_cached_tokens, 0);
  if (num_pages == 200) {  // (with 64 the prompt-logprobs runs' pages evict the cached ones)
    EXPECT_GT(plain_again.num_cached_tokens, 0) << "a plain copy does hit the cache";
  }
}

INSTANTIATE_TEST_SUITE_P(Pages, PromptLogprobsTest, testing::Values(200, 64));

}  // namespace
}  // namespace moe::engine
