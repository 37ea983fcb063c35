// Disaggregated serving on GPUs (docs/disagg.md, docs/gpu.md), below the HTTP
// layer: a prefill engine on GPU 0 exports each layer's KV, as the forward
// pass writes it, through the TransferEngine's CUDA IPC transport (the real
// KvTransferPlan, one batch per layer) into pages reserved on a decode engine
// on GPU 1 (GPU 0 too when only one is present), which decodes from the
// prefill's first token once every batch has landed. Oracles:
// - a colocated engine on GPU 0 with the same prefill configuration, one
//   request at a time on both sides: the tokens must be identical (same
//   kernels on the same shapes, and the KV moved byte for byte);
// - transformers' greedy goldens, up to the first step whose golden top-1 /
//   top-2 margin is below bf16 noise (as model_cuda_test), with chunked
//   prefills, prefix-cache hits and different page sizes on the two sides.
// Skips without a GPU. The two-process path (cudaIpcOpenMemHandle, HTTP
// control) is tools/gpu/disagg_check.sh.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <future>
#include <mutex>
#include <nlohmann/json.hpp>
#include <numeric>

#include "engine/cuda_runner.h"
#include "engine/engine.h"
#include "model/config.h"
#include "model/weights.h"
#include "transfer/kv_plan.h"
#include "transfer/transfer_engine.h"

namespace moe::engine {
namespace {

using nlohmann::json;

constexpr double kBf16Margin = 0.1;  // as model_cuda_test: a smaller golden margin may flip in bf16
constexpr auto kTimeout = std::chrono::seconds(60);

int num_gpus() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

struct GoldenPrompt {
  std::vector<int32_t> ids, greedy;
  int robust_steps = 0;  // greedy tokens whose golden margin is at least kBf16Margin, from the first
};

// tests/data/golden/*/golden.json ("prompts") or the demo model's ("texts", "chats").
std::vector<GoldenPrompt> golden_prompts(const std::string& dir) {
  std::ifstream in(dir + "/golden.json");
  const json golden = json::parse(in);
  std::vector<GoldenPrompt> out;
  for (const char* kind : {"prompts", "texts", "chats"}) {
    if (!golden.contains(kind)) continue;
    for (const json& p : golden[kind]) {
      GoldenPrompt g{p["ids"].get<std::vector<int32_t>>(), p["greedy"].get<std::vector<int32_t>>(), 0};
      const auto margins = p["greedy_margins"].get<std::vector<double>>();
      while (g.robust_steps < static_cast<int>(margins.size()) && margins[g.robust_steps] >= kBf16Margin)
        ++g.robust_steps;
      out.push_back(std::move(g));
    }
  }
  return out;
}

struct Side {
  std::unique_ptr<Engine> engine;
  const kv::KvCache* cache = nullptr;
};

Side make_side(const model::ModelConfig& config, const model::ModelWeights& weights, int device, int page_size,
               int budget) {
  model::CudaModelOptions o;
  o.device = device;
  o.page_size = page_size;
  o.num_pages = 4096 / page_size;
  o.max_num_tokens = std::max(budget, 16);
  o.max_num_seqs = 16;
  o.max_model_len = 256;
  auto runner = CudaRunner::create(config, &weights, 0, o);
  EXPECT_TRUE(runner.has_value()) << runner.status().to_string();
  if (!runner) return {};
  EngineOptions options;
  options.scheduler = {.page_size = page_size,
                       .num_pages = (*runner)->num_pages(),
                       .max_num_seqs = 16,
                       .max_num_batched_tokens = budget,
                       .max_model_len = 256,
                       .enable_prefix_caching = true};
  options.check_invariants = true;
  Side side;
  side.cache = &(*runner)->cache();
  EXPECT_TRUE(side.cache->on_device());
  side.engine = std::make_unique<Engine>(std::move(runner).value(), options);
  return side;
}

// Registers every layer's K and V pool of a device cache (CUDA IPC).
struct Regions {
  std::vector<transfer::RegionId> k, v;
  std::vector<transfer::RegionDescriptor> k_desc, v_desc;
};
Regions register_cache(transfer::TransferEngine& transfer, const kv::KvCache& cache) {
  Regions r;
  for (int l = 0; l < cache.layout().num_layers; ++l) {
    const ops::PagedKv kv = cache.layer(l);
    for (const TensorView* pool : {&kv.k_pages, &kv.v_pages}) {
      auto id = transfer.register_region(pool->data(), pool->num_bytes(), transfer::MemoryKind::kDevice,
                                         pool->device().index);
      EXPECT_TRUE(id.has_value()) << id.status().to_string();
      auto desc = transfer.describe(*id);
      EXPECT_EQ(desc->transport, transfer::TransportKind::kCudaIpc);
      (pool == &kv.k_pages ? r.k : r.v).push_back(*id);
      (pool == &kv.k_pages ? r.k_desc : r.v_desc).push_back(*desc);
    }
  }
  return r;
}

// What PrefillService's exporter does, without HTTP: in the step that
// completes the prompt, one CUDA IPC batch per layer as soon as the layer's
// KV is stored.
class IpcSink final : public KvExportSink {
 public:
  IpcSink(transfer::TransferEngine& transfer, const Regions& src, const kv::KvCache& src_cache, const Regions& dst,
          const kv::KvCache& dst_cache, std::vector<int32_t> dst_pages, int32_t num_prompt_tokens, uint32_t imm)
      : transfer_(transfer),
        src_(src),
        dst_(dst),
        src_layout_(src_cache.layout()),
        dst_layout_(dst_cache.layout()),
        dst_pages_(std::move(dst_pages)),
        num_prompt_tokens_(num_prompt_tokens),
        imm_(imm) {}

  void on_layer_written(int layer, int32_t start, int32_t num_tokens, std::span<const int32_t> pages) override {
    std::lock_guard lock(mutex_);
    if (!error_.is_ok() || start + num_tokens < num_prompt_tokens_) return;
    if (!plan_) {
      const transfer::KvSideLayout src{src_layout_.num_kv_heads, src_layout_.head_dim, src_layout_.page_size,
                                       src_layout_.dtype, 1, 0};
      const transfer::KvSideLayout dst{dst_layout_.num_kv_heads, dst_layout_.head_dim, dst_layout_.page_size,
                                       dst_layout_.dtype, 1, 0};
      const size_t n = static_cast<size_t>((num_prompt_tokens_ + src.page_size - 1) / src.page_size);
      auto plan = transfer::KvTransferPlan::build(src, 0, dst, pages.subspan(0, std::min(n, pages.size())),
                                                  dst_pages_, num_prompt_tokens_);
      if (!plan) return void(error_ = plan.status());
      plan_.emplace(std::move(plan).value());
    }
    const size_t l = static_cast<size_t>(layer);
    const auto groups = plan_->layer_writes({src_.k[l], 0, src_.v[l], 0}, {dst_.k_desc[l], 0, dst_.v_desc[l], 0});
    auto id = transfer_.submit_scattered(groups, imm_);
    if (!id) return void(error_ = id.status());
    batches_.push_back(*id);
  }
  void on_finished(std::function<void()> release) override {
    std::lock_guard lock(mutex_);
    release_ = std::move(release);
  }
  // Waits until every batch is done at this end, then gives the pages back.
  Status finish() {
    std::function<void()> release;
    std::vector<transfer::TransferId> batches;
    {
      std::lock_guard lock(mutex_);
      MOE_RETURN_IF_ERROR(error_);
      batches = batches_;
      release.swap(release_);
    }
    for (transfer::TransferId id : batches) MOE_RETURN_IF_ERROR(transfer_.wait(id, kTimeout));
    if (release) release();
    return Status::ok();
  }
  size_t num_batches() {
    std::lock_guard lock(mutex_);
    return batches_.size();
  }

 private:
  transfer::TransferEngine& transfer_;
  const Regions& src_;
  const Regions& dst_;
  const kv::KvCacheLayout src_layout_, dst_layout_;
  const std::vector<int32_t> dst_pages_;
  const int32_t num_prompt_tokens_;
  const uint32_t imm_;
  std::mutex mutex_;
  std::optional<transfer::KvTransferPlan> plan_;
  std::vector<transfer::TransferId> batches_;
  std::function<void()> release_;
  Status error_;
};

EngineRequest greedy_request(const std::vector<int32_t>& prompt, int max_tokens) {
  EngineRequest r;
  r.prompt = prompt;
  r.max_tokens = max_tokens;
  r.sampling.temperature = 0;
  r.ignore_eos = true;
  return r;
}

// Every output token of one request on one engine (colocated).
std::vector<int32_t> run_colocated(Engine& engine, const std::vector<int32_t>& prompt, int max_tokens) {
  std::vector<int32_t> tokens;
  std::promise<void> done;
  auto id = engine.submit(greedy_request(prompt, max_tokens), [&](const EngineOutput& out) {
    if (out.token >= 0) tokens.push_back(out.token);
    if (out.finish != FinishReason::kNone) done.set_value();
  });
  EXPECT_TRUE(id.has_value()) << id.status().to_string();
  if (id) done.get_future().wait();
  return tokens;
}

class DisaggCuda : public testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const int n = num_gpus();
    if (n == 0) GTEST_SKIP() << "no CUDA device";
    decode_device_ = n > 1 ? 1 : 0;
    dir_ = std::string(MOE_SOURCE_DIR) + "/" + GetParam();
    auto config = model::load_model_config(dir_);
    ASSERT_TRUE(config.has_value()) << config.status().to_string();
    config_ = *config;
    auto weights = model::ModelWeights::load(dir_, config_, pool_);
    ASSERT_TRUE(weights.has_value()) << weights.status().to_string();
    weights_.emplace(std::move(weights).value());
    prompts_ = golden_prompts(dir_);
    ASSERT_FALSE(prompts_.empty());
    transfer::EngineOptions o;
    sender_ = std::move(transfer::TransferEngine::create(o)).value();
    receiver_ = std::move(transfer::TransferEngine::create(o)).value();
  }

  // Prefill on `prefill`, decode on `decode` with the KV moved by CUDA IPC;
  // `order` lists the prompts to run (indices), `concurrent` submits them all
  // at once. Returns each run's tokens (first token + decoded ones).
  std::vector<std::vector<int32_t>> run_disagg(Side& prefill, Side& decode, const std::vector<size_t>& order,
                                               int max_tokens, bool concurrent) {
    const Regions src = register_cache(*sender_, *prefill.cache);
    const Regions dst = register_cache(*receiver_, *decode.cache);
    std::vector<std::vector<int32_t>> results(order.size());
    // Reserves on the decode side and submits the prefill; returns what remains
    // (wait for the first token and the batches, then decode).
    auto run_one = [&](size_t slot) -> std::function<void()> {
      const std::vector<int32_t>& prompt = prompts_[order[slot]].ids;
      std::promise<Expected<std::vector<int32_t>>> reserved;
      decode.engine->reserve(static_cast<int32_t>(prompt.size()),
                             [&](Expected<std::vector<int32_t>> p) { reserved.set_value(std::move(p)); });
      auto pages = reserved.get_future().get();
      EXPECT_TRUE(pages.has_value()) << pages.status().to_string();
      if (!pages) return [] {};
      const uint32_t imm = next_imm_++;
      EXPECT_TRUE(receiver_->arm(imm, sender_->endpoint()).is_ok());
      auto sink = std::make_shared<IpcSink>(*sender_, src, *prefill.cache, dst, *decode.cache, *pages,
                                            static_cast<int32_t>(prompt.size()), imm);
      EngineRequest request = greedy_request(prompt, 1);
      request.kv_export = sink;
      auto first = std::make_shared<std::promise<int32_t>>();
      EXPECT_TRUE(prefill.engine
                      ->submit(request,
                               [first](const EngineOutput& out) {
                                 if (out.finish != FinishReason::kNone) first->set_value(out.token);
                               })
                      .has_value());
      return [&, slot, imm, sink, first, reserved_pages = *pages, prompt] {
        const int32_t token = first->get_future().get();
        ASSERT_GE(token, 0);
        const Status sent = sink->finish();
        ASSERT_TRUE(sent.is_ok()) << sent.to_string();
        ASSERT_EQ(sink->num_batches(), static_cast<size_t>(config_.num_layers));
        const Status landed = receiver_->wait_for(imm, config_.num_layers, kTimeout);
        ASSERT_TRUE(landed.is_ok()) << landed.to_string();
        (void)receiver_->disarm(imm);
        std::vector<int32_t>& tokens = results[slot];
        tokens.push_back(token);
        std::promise<void> done;
        auto id = decode.engine->submit_prefilled(greedy_request(prompt, max_tokens), {reserved_pages, token, {}},
                                                  [&](const EngineOutput& out) {
                                                    if (out.token >= 0) tokens.push_back(out.token);
                                                    if (out.finish != FinishReason::kNone) done.set_value();
                                                  });
        ASSERT_TRUE(id.has_value()) << id.status().to_string();
        done.get_future().wait();
      };
    };
    if (!concurrent) {
      for (size_t slot = 0; slot < order.size(); ++slot) run_one(slot)();
    } else {
      std::vector<std::function<void()>> rest;
      for (size_t slot = 0; slot < order.size(); ++slot) rest.push_back(run_one(slot));
      for (auto& r : rest) r();  // decodes one after another; prefills ran batched
    }
    for (int l = 0; l < config_.num_layers; ++l) {
      (void)sender_->deregister_region(src.k[l]), (void)sender_->deregister_region(src.v[l]);
      (void)receiver_->deregister_region(dst.k[l]), (void)receiver_->deregister_region(dst.v[l]);
    }
    return results;
  }

  std::string dir_;
  ThreadPool pool_{2};
  model::ModelConfig config_;
  std::optional<model::ModelWeights> weights_;
  std::vector<GoldenPrompt> prompts_;
  std::unique_ptr<transfer::TransferEngine> sender_, receiver_;
  int decode_device_ = 0;
  uint32_t next_imm_ = 1;
};

// Same page size and prefill budget as the colocated reference, one request
// at a time: every token equal, and the goldens where bf16 cannot flip them.
TEST_P(DisaggCuda, PrefillOnGpu0DecodeOnGpu1EqualsColocatedEngine) {
  constexpr int kMaxTokens = 24;
  std::vector<size_t> order(prompts_.size());
  std::iota(order.begin(), order.end(), 0);
  std::vector<std::vector<int32_t>> expected;
  {
    Side colocated = make_side(config_, *weights_, 0, 16, 512);
    ASSERT_TRUE(colocated.engine);
    for (size_t i : order) expected.push_back(run_colocated(*colocated.engine, prompts_[i].ids, kMaxTokens));
  }
  Side prefill = make_side(config_, *weights_, 0, 16, 512);
  Side decode = make_side(config_, *weights_, decode_device_, 16, 512);
  ASSERT_TRUE(prefill.engine && decode.engine);
  const auto got = run_disagg(prefill, decode, order, kMaxTokens, false);
  int compared = 0;
  for (size_t i = 0; i < order.size(); ++i) {
    EXPECT_EQ(got[i], expected[i]) << "prompt " << i << " (" << prompts_[i].ids.size() << " tokens)";
    const int n = std::min<int>(prompts_[i].robust_steps, static_cast<int>(got[i].size()));
    EXPECT_TRUE(std::equal(got[i].begin(), got[i].begin() + n, prompts_[i].greedy.begin()))
        << "prompt " << i << ": the first " << n << " tokens against transformers";
    compared += n;
  }
  std::printf("%s: GPU 0 -> GPU %d, %zu prompts equal to the colocated engine; %d tokens equal to transformers\n",
              GetParam().c_str(), decode_device_, order.size(), compared);
}

// Chunked prefill (8 tokens a step) in pages of 4 on the prefill side, pages
// of 16 on the decode side, every prompt twice and all at once (the second
// copy hits the prefill side's prefix cache): the goldens where bf16 cannot
// flip them, and both sides back at their KV baseline afterwards.
TEST_P(DisaggCuda, ChunkedPrefixCachedAndOtherPageSizes) {
  constexpr int kMaxTokens = 24;
  Side prefill = make_side(config_, *weights_, 0, 4, 8);
  Side decode = make_side(config_, *weights_, decode_device_, 16, 64);
  ASSERT_TRUE(prefill.engine && decode.engine);
  std::vector<size_t> order;
  for (int copy = 0; copy < 2; ++copy)
    for (size_t i = 0; i < prompts_.size(); ++i) order.push_back(i);
  const auto got = run_disagg(prefill, decode, order, kMaxTokens, true);
  for (size_t slot = 0; slot < order.size(); ++slot) {
    const GoldenPrompt& p = prompts_[order[slot]];
    ASSERT_EQ(got[slot].size(), static_cast<size_t>(kMaxTokens)) << "slot " << slot;
    const int n = std::min<int>(p.robust_steps, kMaxTokens);
    EXPECT_TRUE(std::equal(got[slot].begin(), got[slot].begin() + n, p.greedy.begin()))
        << "prompt " << order[slot] << " (copy " << slot / prompts_.size() << "): first " << n << " tokens";
  }
  EXPECT_GT(prefill.engine->metrics().prefix_cache_hits_total, 0);
}

INSTANTIATE_TEST_SUITE_P(Models, DisaggCuda,
                         testing::Values("tests/data/golden/moe_basic", "tests/data/golden/moe_dense_layer",
                                         "models/moeserve-demo"),
                         [](const testing::TestParamInfo<std::string>& info) {
                           std::string name = info.param.substr(info.param.rfind('/') + 1);
                           for (char& c : name)
                             if (c == '-') c = '_';
                           return name;
                         });

}  // namespace
}  // namespace moe::engine
