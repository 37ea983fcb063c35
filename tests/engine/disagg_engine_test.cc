// The engine paths of disaggregated serving (docs/disagg.md) on the real CPU
// model, with the transfer done in-process: a prefill engine runs each prompt
// to its first token, exporting every layer's KV (prefix-cache hits and
// chunked prefills included) into pages reserved on a decode engine, which
// then decodes from the committed first token. First token + decode tokens
// must equal transformers' greedy goldens. The prefill engine keeps the
// exported pages until the sink releases them. Scheduler-level checks cover
// reserve / add_prefilled / release bookkeeping.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <future>
#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "model/config.h"
#include "model/weights.h"

namespace moe::engine {
namespace {

std::string golden_dir(const std::string& name) {
  return std::string(MOE_SOURCE_DIR) + "/tests/data/golden/" + name;
}

// Copies a prompt's KV, as each layer is written, into another cache's pages
// (position p: src pages[p / ps] -> dst pages[p / dst_ps], every head, K and V).
class CopySink final : public KvExportSink {
 public:
  CopySink(const kv::KvCache& src, const kv::KvCache& dst, std::vector<int32_t> dst_pages)
      : src_(src), dst_(dst), dst_pages_(std::move(dst_pages)) {}
  void on_layer_written(int layer, int32_t start, int32_t num_tokens,
                        std::span<const int32_t> pages) override {
    const ops::PagedKv s = src_.layer(layer), d = dst_.layer(layer);
    const int heads = s.num_kv_heads(), hd = s.head_dim(), sps = s.page_size(), dps = d.page_size();
    for (int32_t p = start; p < start + num_tokens; ++p)
      for (int h = 0; h < heads; ++h)
        for (auto [from, to] : {std::pair{s.k_pages, d.k_pages}, std::pair{s.v_pages, d.v_pages}}) {
          const float* src = static_cast<const float*>(from.data()) +
                             ((static_cast<int64_t>(pages[p / sps]) * heads + h) * sps + p % sps) * hd;
          float* dst = static_cast<float*>(to.data()) +
                       ((static_cast<int64_t>(dst_pages_[p / dps]) * heads + h) * dps + p % dps) * hd;
          std::memcpy(dst, src, sizeof(float) * hd);
        }
    ++num_calls_;
  }
  void on_finished(std::function<void()> release) override { release_ = std::move(release); }
  std::function<void()> release_;
  std::atomic<int> num_calls_{0};

 private:
  const kv::KvCache& src_;
  const kv::KvCache& dst_;
  std::vector<int32_t> dst_pages_;
};

TEST(DisaggEngine, PrefillHereDecodeThereEqualsTransformers) {
  const std::string dir = golden_dir("moe_basic");
  std::ifstream in(dir + "/golden.json");
  ASSERT_TRUE(in.good());
  const auto golden = nlohmann::json::parse(in);
  ThreadPool pool(1);
  auto config = model::load_model_config(dir);
  ASSERT_TRUE(config.has_value());
  auto weights = model::ModelWeights::load(dir, *config, pool);
  ASSERT_TRUE(weights.has_value());
  model::Qwen3MoeModel model(*weights);
  auto make = [&](int page_size, int budget, const kv::KvCache** cache) {
    EngineOptions options;
    options.scheduler = {.page_size = page_size,
                         .num_pages = 200,
                         .max_num_seqs = 16,
                         .max_num_batched_tokens = budget,
                         .max_model_len = 96,
                         .enable_prefix_caching = true};
    options.check_invariants = true;
    const kv::KvCacheLayout layout{config->num_layers, config->num_kv_heads, config->head_dim, page_size, 200,
                                   DType::kF32};
    auto runner = std::make_unique<Qwen3Runner>(model, pool, layout);
    *cache = &runner->cache();
    return std::make_unique<Engine>(std::move(runner), options);
  };
  const kv::KvCache *p_cache = nullptr, *d_cache = nullptr;
  auto prefill = make(4, 9, &p_cache);  // chunked prefill
  auto decode = make(8, 64, &d_cache);  // another page size
  const size_t n = golden["prompts"].size();
  for (int copy = 0; copy < 2; ++copy) {  // the second copy hits the prefill side's prefix cache
    std::vector<std::shared_ptr<CopySink>> sinks(n);
    std::vector<std::promise<int32_t>> first(n);
    std::vector<std::vector<int32_t>> reserved(n);
    for (size_t i = 0; i < n; ++i) {
      const auto prompt = golden["prompts"][i]["ids"].get<std::vector<int32_t>>();
      std::promise<Expected<std::vector<int32_t>>> pages;
      decode->reserve(static_cast<int32_t>(prompt.size()),
                      [&](Expected<std::vector<int32_t>> p) { pages.set_value(std::move(p)); });
      auto got = pages.get_future().get();
      ASSERT_TRUE(got.has_value()) << got.status().to_string();
      reserved[i] = *got;
      sinks[i] = std::make_shared<CopySink>(*p_cache, *d_cache, *got);
      EngineRequest request;
      request.prompt = prompt;
      request.max_tokens = 1;
      request.sampling.temperature = 0;
      request.ignore_eos = true;
      request.kv_export = sinks[i];
      auto* promise = &first[i];
      ASSERT_TRUE(prefill
                      ->submit(request,
                               [promise](const EngineOutput& out) {
                                 if (out.finish != FinishReason::kNone) promise->set_value(out.token);
                               })
                      .has_value());
    }
    std::vector<std::vector<int32_t>> tokens(n);
    std::vector<std::promise<void>> done(n);
    for (size_t i = 0; i < n; ++i) {
      const int32_t token = first[i].get_future().get();
      ASSERT_GE(token, 0);
      EXPECT_GT(sinks[i]->num_calls_.load(), 0);
      tokens[i].push_back(token);
      EngineRequest request;
      request.prompt = golden["prompts"][i]["ids"].get<std::vector<int32_t>>();
      request.max_tokens = 24;
      request.sampling.temperature = 0;
      request.ignore_eos = true;
      auto* out_tokens = &tokens[i];
      auto* promise = &done[i];
      ASSERT_TRUE(decode
                      ->submit_prefilled(request, reserved[i], token,
                                         [out_tokens, promise](const EngineOutput& out) {
                                           if (out.token >= 0) out_tokens->push_back(out.token);
                                           if (out.finish != FinishReason::kNone) promise->set_value();
                                         })
                      .has_value());
    }
    for (size_t i = 0; i < n; ++i) {
      done[i].get_future().wait();
      EXPECT_EQ(tokens[i], golden["prompts"][i]["greedy"].get<std::vector<int32_t>>())
          << "copy " << copy << " prompt " << i;
    }
    // The prefill side holds every exported prompt's pages until released.
    EXPECT_GT(prefill->metrics().kv_cache_usage_perc, 0);
    for (auto& sink : sinks) {
      ASSERT_TRUE(sink->release_);
      sink->release_();
    }
  }
  // Two round trips through the engine's command queue (a reserve of 0 tokens
  // is refused there): the releases before them have run, and so has the
  // gauge update that follows them.
  const auto flushed = [](Engine& e) {
    for (int i = 0; i < 2; ++i) {
      std::promise<void> p;
      e.reserve(0, [&](Expected<std::vector<int32_t>> r) {
        EXPECT_FALSE(r.has_value());
        p.set_value();
      });
      p.get_future().wait();
    }
    return e.metrics().kv_cache_usage_perc;
  };
  EXPECT_EQ(flushed(*prefill), 0);
  EXPECT_EQ(flushed(*decode), 0);
  EXPECT_GT(prefill->metrics().prefix_cache_hits_total, 0);
}

TEST(DisaggScheduler, ReservePrefilledAndRelease) {
  SchedulerOptions options{.page_size = 4,
                           .num_pages = 8,
                           .max_num_seqs = 4,
                           .max_num_batched_tokens = 16,
                           .max_model_len = 32,
                           .enable_prefix_caching = true};
  Scheduler s(options);
  EXPECT_EQ(s.reserve_pages(33).status().code(), StatusCode::kInvalidArgument);  // over max_model_len
  auto a = s.reserve_pages(10);                                                  // 3 pages
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->size(), 3u);
  auto b = s.reserve_pages(20);  // 5 pages: all taken
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(s.reserve_pages(1).status().code(), StatusCode::kResourceExhausted);
  s.check_invariants();
  // Too few pages for the prompt: refused, the pages stay reserved.
  SequenceSpec spec{.id = 1, .prompt = std::vector<int32_t>(13, 5), .max_tokens = 4, .eos_token_ids = {2}};
  EXPECT_EQ(s.add_prefilled(spec, *a, 7).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.num_reserved_pages(), 8);
  // A first token that is eos ends it at once and frees its pages.
  spec.prompt.resize(10);
  auto u = s.add_prefilled(spec, *a, 2);
  ASSERT_TRUE(u.has_value());
  EXPECT_EQ(u->finish, FinishReason::kStop);
  EXPECT_EQ(u->num_output_tokens, 1);
  EXPECT_EQ(s.cache().num_used(), 5);
  s.check_invariants();
  // Otherwise it decodes from the first token: one decode chunk at the prompt's end.
  SequenceSpec spec2{.id = 2, .prompt = std::vector<int32_t>(20, 5), .max_tokens = 3, .eos_token_ids = {2}};
  ASSERT_TRUE(s.add_prefilled(spec2, *b, 9).has_value());
  EXPECT_EQ(s.num_reserved_pages(), 0);
  StepPlan plan = s.schedule(0);
  ASSERT_EQ(plan.chunks.size(), 1u);
  EXPECT_EQ(plan.chunks[0].start, 20);
  EXPECT_EQ(plan.chunks[0].num_tokens, 1);
  EXPECT_TRUE(plan.chunks[0].sample);
  const auto batch = s.build_batch(plan);
  EXPECT_EQ(batch.token_ids, std::vector<int32_t>{9});
  const int32_t sampled[] = {11};
  auto updates = s.complete_step(plan, sampled);
  ASSERT_EQ(updates.size(), 1u);
  EXPECT_EQ(updates[0].num_output_tokens, 2);
  s.check_invariants();
  EXPECT_TRUE(s.abort(2));
  EXPECT_EQ(s.cache().num_used(), 0);
  s.check_invariants();
}

}  // namespace
}  // namespace moe::engine
