// The engine paths of disaggregated serving (docs/disagg.md) on the real CPU
// model, with the transfer done in-process: a prefill engine runs each prompt
// to its first token, exporting every layer's KV (prefix-cache hits and
// chunked prefills included) into pages reserved on a decode engine, which
// then decodes from the committed first token. First token + decode tokens
// must equal transformers' greedy goldens. The prefill engine keeps the
// exported pages until the sink releases them. With speculative decoding the
// MTP layer and the last hidden state go along, and the decode side drafts as
// a colocated engine would. Scheduler-level checks cover reserve /
// add_prefilled / release bookkeeping.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <future>
#include <nlohmann/json.hpp>
#include <optional>

#include "engine/engine.h"
#include "model/config.h"
#include "model/weights.h"

namespace moe::engine {
namespace {

std::string golden_dir(const std::string& name) {
  return std::string(MOE_SOURCE_DIR) + "/tests/data/golden/" + name;
}

// Copies positions [start, start + num_tokens) of one layer's K and V from
// `from` (position p in src_pages[p / its page size]) to `to` (dst_pages).
void copy_positions(const ops::PagedKv& from, const ops::PagedKv& to, int32_t start, int32_t num_tokens,
                    std::span<const int32_t> src_pages, std::span<const int32_t> dst_pages) {
  const int heads = from.num_kv_heads(), hd = from.head_dim(), sps = from.page_size(), dps = to.page_size();
  for (int32_t p = start; p < start + num_tokens; ++p)
    for (int h = 0; h < heads; ++h)
      for (auto [s, d] : {std::pair{from.k_pages, to.k_pages}, std::pair{from.v_pages, to.v_pages}}) {
        const float* src = static_cast<const float*>(s.data()) +
                           ((static_cast<int64_t>(src_pages[p / sps]) * heads + h) * sps + p % sps) * hd;
        float* dst = static_cast<float*>(d.data()) +
                     ((static_cast<int64_t>(dst_pages[p / dps]) * heads + h) * dps + p % dps) * hd;
        std::memcpy(dst, src, sizeof(float) * hd);
      }
}

// Copies a prompt's KV, as each layer is written, into another cache's pages
// (position p: src pages[p / ps] -> dst pages[p / dst_ps], every head, K and
// V). With MTP caches on both sides it also takes the MTP layer and keeps the
// last hidden state, as a prefill instance sends them.
class CopySink final : public KvExportSink {
 public:
  CopySink(const kv::KvCache& src, const kv::KvCache& dst, std::vector<int32_t> dst_pages,
           const kv::KvCache* src_mtp = nullptr, const kv::KvCache* dst_mtp = nullptr)
      : src_(src), dst_(dst), dst_pages_(std::move(dst_pages)), src_mtp_(src_mtp), dst_mtp_(dst_mtp) {}
  void on_layer_written(int layer, int32_t start, int32_t num_tokens,
                        std::span<const int32_t> pages) override {
    copy_positions(src_.layer(layer), dst_.layer(layer), start, num_tokens, pages, dst_pages_);
    ++num_calls_;
  }
  bool wants_mtp() const override { return src_mtp_ && dst_mtp_; }
  void on_mtp_written(int32_t num_tokens, std::span<const int32_t> pages,
                      std::span<const float> last_hidden) override {
    copy_positions(src_mtp_->layer(0), dst_mtp_->layer(0), 0, num_tokens, pages, dst_pages_);
    last_hidden_.assign(last_hidden.begin(), last_hidden.end());
  }
  void on_finished(std::function<void()> release) override { release_ = std::move(release); }
  std::function<void()> release_;
  std::atomic<int> num_calls_{0};
  std::vector<float> last_hidden_;  // set by on_mtp_written (engine thread, before the final output)

 private:
  const kv::KvCache& src_;
  const kv::KvCache& dst_;
  std::vector<int32_t> dst_pages_;
  const kv::KvCache* src_mtp_;
  const kv::KvCache* dst_mtp_;
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
                      ->submit_prefilled(request, {reserved[i], token, {}},
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

// ---- Speculative decoding across the handover (docs/speculative.md) ----
//
// The prefill engine (with a drafter) writes the MTP layer's KV of the prompt
// and hands over the last hidden state; the decode engine drafts from there.
// Oracles: plain greedy decoding on one engine (the tokens), and colocated
// speculation on one engine with the same k (the draft and accepted counts
// per request: the decode side must draft exactly as if it had prefilled).

struct SpecModel {
  ThreadPool pool{2};  // loading only
  model::ModelConfig config;
  std::optional<model::ModelWeights> weights;
  std::optional<model::Qwen3MoeModel> model;
  std::optional<model::MtpWeights> mtp_weights;
  std::optional<model::MtpModel> mtp;
};

// A model and an MTP layer: `mtp_dir` when given, else random weights (seed 7).
std::unique_ptr<SpecModel> load_spec_model(const std::string& dir, const std::string& mtp_dir, bool moe_mtp) {
  auto m = std::make_unique<SpecModel>();
  auto config = model::load_model_config(dir);
  EXPECT_TRUE(config.has_value()) << config.status().to_string();
  m->config = *config;
  auto weights = model::ModelWeights::load(dir, m->config, m->pool);
  EXPECT_TRUE(weights.has_value()) << weights.status().to_string();
  m->weights.emplace(std::move(*weights));
  m->model.emplace(*m->weights);
  if (mtp_dir.empty()) {
    m->mtp_weights.emplace(model::MtpWeights::dummy(m->config, 7, moe_mtp));
  } else {
    auto mtp = model::MtpWeights::load(mtp_dir, m->config);
    EXPECT_TRUE(mtp.has_value()) << mtp.status().to_string();
    m->mtp_weights.emplace(std::move(*mtp));
  }
  m->mtp.emplace(*m->mtp_weights, *m->weights);
  return m;
}

// One engine with its own thread pool (a pool runs one parallel_for at a
// time, and the engines of a test step concurrently).
struct Side {
  std::unique_ptr<ThreadPool> pool;  // declared first: outlives the engine
  std::unique_ptr<Engine> engine;
  const kv::KvCache* cache = nullptr;
};

// An engine over `m`'s model with a drafter of k tokens (none for k = 0).
Side make_side(SpecModel& m, int page_size, int budget, int k) {
  EngineOptions options;
  options.scheduler = {.page_size = page_size,
                       .num_pages = 160,
                       .max_num_seqs = 8,
                       .max_num_batched_tokens = budget,
                       .max_model_len = 96,
                       .enable_prefix_caching = true};
  options.check_invariants = true;
  const kv::KvCacheLayout layout{m.config.num_layers, m.config.num_kv_heads, m.config.head_dim, page_size, 160,
                                 DType::kF32};
  Side side;
  side.pool = std::make_unique<ThreadPool>(2);
  auto runner = std::make_unique<Qwen3Runner>(*m.model, *side.pool, layout);
  side.cache = &runner->cache();
  std::unique_ptr<MtpDrafter> drafter;
  if (k > 0) drafter = std::make_unique<MtpDrafter>(*m.mtp, *side.pool, layout, k);
  side.engine = std::make_unique<Engine>(std::move(runner), options, std::move(drafter));
  return side;
}

struct Result {
  std::vector<int32_t> tokens;
  FinishReason finish = FinishReason::kNone;
  Status error;
  int drafts = 0, accepted = 0;
  int num_logprobs = 0;  // outputs that carried logprobs
};

// Collects a request's outputs; `done` once the final one arrived.
OutputCallback collect(Result* result, std::promise<void>* done) {
  return [result, done](const EngineOutput& out) {
    if (out.token >= 0) result->tokens.push_back(out.token);
    if (out.logprobs) ++result->num_logprobs;
    if (out.finish == FinishReason::kNone) return;
    result->finish = out.finish, result->error = out.error;
    result->drafts = out.num_draft_tokens, result->accepted = out.num_accepted_draft_tokens;
    done->set_value();
  };
}

Result run_colocated(Engine& engine, const EngineRequest& request) {
  Result result;
  std::promise<void> done;
  auto id = engine.submit(request, collect(&result, &done));
  EXPECT_TRUE(id.has_value()) << id.status().to_string();
  if (id) done.get_future().wait();
  return result;
}

// Prefill on `p` (max_tokens 1, exporting into pages reserved on `d`, with
// the MTP layer and the last hidden state when `send_mtp`), then decode on
// `d` from the first token. The prefill side's held pages are released.
Result run_disagg(Side& p, Side& d, EngineRequest request, bool send_mtp) {
  Result result;
  std::promise<Expected<std::vector<int32_t>>> reserved;
  d.engine->reserve(static_cast<int32_t>(request.prompt.size()),
                    [&](Expected<std::vector<int32_t>> pages) { reserved.set_value(std::move(pages)); });
  auto pages = reserved.get_future().get();
  EXPECT_TRUE(pages.has_value()) << pages.status().to_string();
  if (!pages) return result;
  auto sink = std::make_shared<CopySink>(*p.cache, *d.cache, *pages, send_mtp ? p.engine->mtp_cache() : nullptr,
                                         send_mtp ? d.engine->mtp_cache() : nullptr);
  EngineRequest prefill = request;
  prefill.max_tokens = 1;
  prefill.kv_export = sink;
  std::promise<EngineOutput> first;
  auto pid = p.engine->submit(prefill, [&first](const EngineOutput& out) {
    if (out.finish != FinishReason::kNone) first.set_value(out);
  });
  EXPECT_TRUE(pid.has_value()) << pid.status().to_string();
  if (!pid) return result;
  const EngineOutput head = first.get_future().get();
  EXPECT_GE(head.token, 0);
  EXPECT_EQ(sink->last_hidden_.empty(), !sink->wants_mtp());
  result.tokens.push_back(head.token);
  if (head.logprobs) ++result.num_logprobs;  // the first token's come from the prefill side
  std::promise<void> done;
  auto id = d.engine->submit_prefilled(request, {*pages, head.token, sink->last_hidden_}, collect(&result, &done));
  EXPECT_TRUE(id.has_value()) << id.status().to_string();
  if (id) done.get_future().wait();
  sink->release_();
  return result;
}

// The KV usage once the engine's command queue has run twice (see above).
double flushed_kv_usage(Engine& e) {
  for (int i = 0; i < 2; ++i) {
    std::promise<void> p;
    e.reserve(0, [&](Expected<std::vector<int32_t>>) { p.set_value(); });
    p.get_future().wait();
  }
  return e.metrics().kv_cache_usage_perc;
}

std::vector<EngineRequest> spec_requests(int64_t vocab) {
  std::vector<EngineRequest> requests;
  for (int i = 0; i < 4; ++i) {  // prompts of 3..18 tokens: one chunk to several on the prefill side
    EngineRequest r;
    for (int t = 0; t < 3 + 5 * i; ++t) r.prompt.push_back(static_cast<int32_t>((17 * t + 31 * i + 5) % vocab));
    r.max_tokens = 20 - 3 * i;
    r.sampling.temperature = 0;
    r.ignore_eos = true;
    requests.push_back(std::move(r));
  }
  return requests;
}

// For k = 1..4: disaggregated speculation == plain greedy (tokens) and ==
// colocated speculation (drafts and accepted drafts per request), each
// request twice (the second hits the prefill side's prefix cache, MTP KV
// included); every page back at the end on all sides.
void check_disagg_speculation(SpecModel& m, const std::vector<EngineRequest>& requests, bool expect_acceptance) {
  Side plain = make_side(m, 4, 9, 0);
  std::vector<Result> want;
  for (const auto& r : requests) want.push_back(run_colocated(*plain.engine, r));
  for (int k = 1; k <= 4; ++k) {
    Side colocated = make_side(m, 4, 9, k);
    Side prefill = make_side(m, 4, 9, k);   // chunked prefill
    Side decode = make_side(m, 8, 64, k);   // another page size
    int64_t accepted = 0;
    for (int copy = 0; copy < 2; ++copy) {
      for (size_t i = 0; i < requests.size(); ++i) {
        const Result spec = run_colocated(*colocated.engine, requests[i]);
        const Result got = run_disagg(prefill, decode, requests[i], true);
        EXPECT_EQ(got.tokens, want[i].tokens) << "k " << k << " request " << i << " copy " << copy;
        EXPECT_EQ(got.finish, want[i].finish);
        EXPECT_GT(got.drafts, 0) << "k " << k << " request " << i;
        EXPECT_EQ(got.drafts, spec.drafts) << "k " << k << " request " << i << " copy " << copy;
        EXPECT_EQ(got.accepted, spec.accepted) << "k " << k << " request " << i << " copy " << copy;
        accepted += got.accepted;
      }
    }
    std::printf("k=%d: %lld drafts verified on the decode side, %lld accepted\n", k,
                static_cast<long long>(decode.engine->metrics().spec_decode_num_draft_tokens_total),
                static_cast<long long>(decode.engine->metrics().spec_decode_num_accepted_tokens_total));
    EXPECT_EQ(decode.engine->metrics().spec_decode_num_accepted_tokens_total, accepted);
    if (expect_acceptance) {
      EXPECT_GT(accepted, 0) << "k " << k;
    }
    EXPECT_EQ(flushed_kv_usage(*prefill.engine), 0) << "k " << k;
    EXPECT_EQ(flushed_kv_usage(*decode.engine), 0) << "k " << k;
    EXPECT_GT(prefill.engine->metrics().prefix_cache_hits_total, 0);
  }
}

class DisaggSpeculation : public testing::TestWithParam<std::tuple<std::string, bool>> {};

// Random MTP weights (MoE and dense MLP): acceptance near zero, so this
// checks the handover's bookkeeping and exactness, not the MTP's quality.
TEST_P(DisaggSpeculation, GreedyEqualsPlainAndDraftsAsColocatedForEveryK) {
  const auto& [name, moe_mtp] = GetParam();
  auto m = load_spec_model(golden_dir(name), "", moe_mtp);
  check_disagg_speculation(*m, spec_requests(m->config.vocab_size), false);
}

INSTANTIATE_TEST_SUITE_P(Models, DisaggSpeculation,
                         testing::Values(std::make_tuple("moe_basic", true), std::make_tuple("dense_qwen3", false),
                                         std::make_tuple("moe_dense_layer", true)));

// The demo model with its trained MTP layer: real acceptance, which a lost or
// misplaced MTP layer or hidden state would change.
TEST(DisaggSpeculationDemo, TrainedMtpAcceptsAsColocated) {
  const std::string demo = std::string(MOE_SOURCE_DIR) + "/models/moeserve-demo";
  auto m = load_spec_model(demo, demo + "-mtp", false);
  std::vector<EngineRequest> requests;
  for (const std::vector<int32_t>& prompt : std::vector<std::vector<int32_t>>{
           {1, 317, 201, 386, 330, 263, 409, 16, 2, 201, 1, 319, 201},              // "Tell me a fortune."
           {1, 317, 201, 454, 330, 263, 453, 355, 1096, 16, 2, 201, 1, 319, 201},  // "Give me a quote about science."
           {35, 1067}}) {                                                          // "A computer"
    EngineRequest r;
    r.prompt = prompt;
    r.max_tokens = 32;
    r.sampling.temperature = 0;
    r.ignore_eos = true;
    requests.push_back(r);
  }
  check_disagg_speculation(*m, requests, true);
}

// Requests that must not draft on the decode side, mixed with speculating
// ones (one with logprobs), all at once: max_tokens 1 and a first token
// that is a stop id (the sequence ends at the handover: the drafter never
// runs on it), max_tokens 2 (no room for a draft); a seeded sampled request.
// Then the mismatches: MTP on one side only decodes without drafts.
TEST(DisaggSpeculationEdges, NonDraftingRequestsAndOneSidedMtp) {
  auto m = load_spec_model(golden_dir("moe_basic"), "", true);
  std::vector<EngineRequest> requests = spec_requests(m->config.vocab_size);
  Side plain = make_side(*m, 4, 9, 0);
  std::vector<Result> want;
  for (const auto& r : requests) want.push_back(run_colocated(*plain.engine, r));
  requests[1].num_logprobs = 2;
  EngineRequest one = requests[2], stop_first = requests[3], two = requests[0], sampled = requests[0];
  one.max_tokens = 1;
  stop_first.stop_token_ids = {want[3].tokens[0]};
  two.max_tokens = 2;
  sampled.sampling.temperature = 0.8f, sampled.sampling.seed = 11;
  requests.insert(requests.end(), {one, stop_first, two, sampled});

  Side prefill = make_side(*m, 4, 9, 2), decode = make_side(*m, 8, 64, 2);
  std::vector<std::future<Result>> running;
  for (const auto& r : requests)
    running.push_back(std::async(std::launch::async, [&, r] { return run_disagg(prefill, decode, r, true); }));
  std::vector<Result> got;
  for (auto& f : running) got.push_back(f.get());
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(got[i].tokens, want[i].tokens) << "request " << i;
  EXPECT_GT(got[0].drafts, 0);
  EXPECT_GT(got[1].drafts, 0) << "logprobs requests draft too";
  EXPECT_EQ(got[1].num_logprobs, static_cast<int>(got[1].tokens.size())) << "one logprobs entry per token";
  EXPECT_EQ(got[4].tokens, std::vector<int32_t>{want[2].tokens[0]});
  EXPECT_EQ(got[4].finish, FinishReason::kLength);
  EXPECT_EQ(got[5].tokens, std::vector<int32_t>{want[3].tokens[0]});
  EXPECT_EQ(got[5].finish, FinishReason::kStop);
  EXPECT_EQ(got[6].tokens, std::vector<int32_t>(want[0].tokens.begin(), want[0].tokens.begin() + 2));
  EXPECT_EQ(got[7].tokens.size(), static_cast<size_t>(sampled.max_tokens));
  for (size_t i = 4; i < 7; ++i) EXPECT_EQ(got[i].drafts, 0) << "request " << i;
  EXPECT_GT(decode.engine->metrics().spec_decode_num_drafts_total, 0);
  EXPECT_EQ(flushed_kv_usage(*prefill.engine), 0);
  EXPECT_EQ(flushed_kv_usage(*decode.engine), 0);

  // MTP on the prefill side only (the decode side advertises no MTP layer, so
  // none is sent), and on the decode side only (nothing to draft from): plain.
  Side no_mtp_decode = make_side(*m, 8, 64, 0), no_mtp_prefill = make_side(*m, 4, 9, 0);
  for (size_t i = 0; i < 4; ++i) {
    if (i == 1) continue;  // the logprobs request
    const Result a = run_disagg(prefill, no_mtp_decode, requests[i], false);
    const Result b = run_disagg(no_mtp_prefill, decode, requests[i], false);
    EXPECT_EQ(a.tokens, want[i].tokens) << "request " << i;
    EXPECT_EQ(b.tokens, want[i].tokens) << "request " << i;
    EXPECT_EQ(a.drafts + b.drafts, 0);
  }
  // An MTP state the decode engine cannot use is refused at submission.
  EngineRequest r = requests[0];
  const std::vector<float> hidden(static_cast<size_t>(m->config.hidden_size), 0.5f);
  EXPECT_EQ(no_mtp_decode.engine->submit_prefilled(r, {{0}, 1, hidden}, [](const EngineOutput&) {}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(decode.engine->submit_prefilled(r, {{0}, 1, {0.5f, 1.0f}}, [](const EngineOutput&) {}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(flushed_kv_usage(*no_mtp_decode.engine), 0);
  EXPECT_EQ(flushed_kv_usage(*decode.engine), 0);
  EXPECT_EQ(flushed_kv_usage(*prefill.engine), 0);
  EXPECT_EQ(flushed_kv_usage(*no_mtp_prefill.engine), 0);
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
