// Multi-rank instances (engine/rank_group.h): the step plan's wire format, a
// leader driving followers through the serving scheduler (== the golden
// greedy ids), and liveness both ways. Ranks are threads here; the serve
// test (tests/server/parallel_test.mjs) runs them as processes.
#include "engine/rank_group.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <future>
#include <nlohmann/json.hpp>
#include <thread>

#include "comm/cpu/shm_communicator.h"
#include "engine/engine.h"
#include "engine/generator.h"
#include "model/config.h"
#include "model/weights.h"

namespace moe::engine {
namespace {

model::ForwardBatch sample_batch() {
  model::ForwardBatch b;
  b.token_ids = {5, 6, 7, 8};
  b.positions = {0, 1, 2, 9};
  b.query_start = {0, 3, 4};
  b.page_table = {0, 1, -1, 4, 5, 6};
  b.max_pages_per_seq = 3;
  b.logits_rows = {2, 3};
  return b;
}

TEST(StepPlan, RoundTrips) {
  const model::ForwardBatch b = sample_batch();
  auto back = decode_step_plan(encode_step_plan(b));
  ASSERT_TRUE(back.has_value()) << back.status().to_string();
  EXPECT_EQ(back->token_ids, b.token_ids);
  EXPECT_EQ(back->positions, b.positions);
  EXPECT_EQ(back->query_start, b.query_start);
  EXPECT_EQ(back->page_table, b.page_table);
  EXPECT_EQ(back->max_pages_per_seq, b.max_pages_per_seq);
  EXPECT_EQ(back->logits_rows, b.logits_rows);
  auto empty = decode_step_plan(encode_step_plan(model::ForwardBatch{{}, {}, {0}, {}, 0, {}}));
  ASSERT_TRUE(empty.has_value());
  EXPECT_EQ(empty->num_tokens(), 0);
}

TEST(StepPlan, CorruptPlansAreErrors) {
  const std::vector<uint8_t> good = encode_step_plan(sample_batch());
  auto broken = [&](auto edit) {
    std::vector<uint8_t> b = good;
    edit(b);
    return decode_step_plan(b).has_value();
  };
  auto word = [](std::vector<uint8_t>& b, size_t i, int32_t v) { std::memcpy(b.data() + 4 * i, &v, 4); };
  EXPECT_FALSE(broken([](auto& b) { b.resize(b.size() - 4); }));
  EXPECT_FALSE(broken([](auto& b) { b.resize(3); }));
  EXPECT_FALSE(broken([&](auto& b) { word(b, 0, 1234); }));             // magic
  EXPECT_FALSE(broken([&](auto& b) { word(b, 2, 1 << 30); }));          // token count
  EXPECT_FALSE(broken([&](auto& b) { word(b, 5, 2); }));                // pages per sequence vs table
  EXPECT_FALSE(broken([&](auto& b) { word(b, 8 + 8 + 1, 5); }));        // query starts decrease
  EXPECT_FALSE(broken([&](auto& b) { word(b, b.size() / 4 - 1, 9); }));  // logits row past the tokens
  EXPECT_TRUE(broken([](auto&) {}));
}

std::string golden_dir() { return std::string(MOE_SOURCE_DIR) + "/tests/data/golden/moe_basic"; }

class RankGroupTest : public testing::Test {
 protected:
  void SetUp() override {
    config_ = model::load_model_config(golden_dir()).value();
    weights_ = std::make_unique<model::ModelWeights>(model::ModelWeights::load(golden_dir(), config_, pool_).value());
    std::ifstream in(golden_dir() + "/golden.json");
    const auto j = nlohmann::json::parse(in);
    for (const auto& p : j["prompts"]) {
      prompts_.push_back(p["ids"].get<std::vector<int32_t>>());
      greedy_.push_back(p["greedy"].get<std::vector<int32_t>>());
      greedy_.back().resize(12);
    }
  }
  kv::KvCacheLayout layout(int kv_heads) const {
    return {config_.num_layers, kv_heads, config_.head_dim, 4, 256, DType::kF32};
  }
  kv::KvCacheLayout layout(const model::Qwen3MoeModel& m) const { return layout(m.shard().num_kv_heads); }
  std::unique_ptr<comm::Communicator> open(const std::string& group, int rank, int world) {
    comm::ShmGroupOptions o;
    o.name = group, o.rank = rank, o.world_size = world, o.buffer_bytes = 1 << 20, o.timeout_ms = 5000;
    auto c = comm::open_shm_communicator(o);
    EXPECT_TRUE(c.has_value()) << c.status().to_string();
    return c.has_value() ? std::move(c).value() : nullptr;
  }

  ThreadPool pool_{1};
  model::ModelConfig config_;
  std::unique_ptr<model::ModelWeights> weights_;
  std::vector<std::vector<int32_t>> prompts_, greedy_;
};

TEST_F(RankGroupTest, LeaderAndFollowersGenerateTheGoldenIds) {
  const std::string group = "moeserve-rank-group-" + std::to_string(getpid());
  constexpr int kWorld = 2;
  int fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  Status follower_status;
  // The follower's KV cache in shared memory, as `serve --tp` lays it out.
  const int follower_heads = model::rank_shard(config_, {kWorld, 1, kWorld, 1, false, nullptr}).num_kv_heads;
  auto region = kv::ShmRegion::create(kv_region_name(group, 1), layout(follower_heads).num_bytes());
  ASSERT_TRUE(region.has_value()) << region.status().to_string();
  void* follower_kv = region->data();
  std::thread follower([&] {
    ThreadPool pool(1);
    auto c = open(group, 1, kWorld);
    if (!c) return;
    model::Qwen3MoeModel m(*weights_, {kWorld, 1, kWorld, 1, false, c.get()});
    follower_status = signal_ready(fds[1]);
    if (follower_status.is_ok()) follower_status = run_follower(m, pool, layout(m), follower_kv, fds[1]);
    ::close(fds[1]);
  });
  {
    auto c = open(group, 0, kWorld);
    ASSERT_TRUE(c);
    model::Qwen3MoeModel m(*weights_, {kWorld, 0, kWorld, 0, false, c.get()});
    ASSERT_TRUE(wait_for_followers({{fds[0]}}).is_ok());
    std::vector<kv::ShmRegion> regions;
    regions.push_back(std::move(region).value());
    LeaderRunner runner(m, pool_, layout(m), {fds[0]}, std::move(regions));
    ASSERT_EQ(runner.rank_caches().size(), 2u);
    std::vector<GenerationRequest> requests;
    for (const auto& p : prompts_) {
      GenerationRequest r;
      r.prompt = p, r.max_tokens = 12, r.sampling.temperature = 0.0f, r.ignore_eos = true;
      requests.push_back(r);
    }
    GeneratorOptions options;
    options.page_size = 4;
    options.max_tokens_per_step = 13;
    Generator generator(runner, 256, options);
    auto results = generator.generate(requests);
    ASSERT_TRUE(results.has_value()) << results.status().to_string();
    for (size_t i = 0; i < prompts_.size(); ++i) EXPECT_EQ((*results)[i].token_ids, greedy_[i]) << "prompt " << i;
  }  // the runner tells the follower to stop
  follower.join();
  EXPECT_TRUE(follower_status.is_ok()) << follower_status.to_string();
}

TEST_F(RankGroupTest, FollowerStopsWhenTheLeaderGoesAway) {
  int fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  model::Qwen3MoeModel m(*weights_);
  Status status = internal_error("not run");
  Tensor kv_memory(DType::kF32, {static_cast<int64_t>(layout(m).num_bytes() / 4)});
  std::thread follower([&] { status = run_follower(m, pool_, layout(m), kv_memory.data(), fds[1]); });
  ::close(fds[0]);  // as if the leader were killed
  follower.join();
  ::close(fds[1]);
  EXPECT_TRUE(status.is_ok()) << status.to_string();
}

TEST(RankGroup, StartUpFailsWhenAFollowerExitsFirst) {
  int fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  ::close(fds[1]);
  const Status s = wait_for_followers({{fds[0]}});
  ::close(fds[0]);
  EXPECT_NE(s.message().find("rank 1 exited during start-up"), std::string::npos) << s.to_string();
}

TEST_F(RankGroupTest, LeaderStepFailsWhenAFollowerIsGone) {
  int fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  ::close(fds[1]);
  model::Qwen3MoeModel m(*weights_);
  LeaderRunner runner(m, pool_, layout(m), {fds[0]}, {});
  auto logits = runner.forward(sample_batch());
  ASSERT_FALSE(logits.has_value());
  EXPECT_NE(logits.status().message().find("rank 1 of this instance is gone"), std::string::npos)
      << logits.status().to_string();
  EXPECT_FALSE(runner.forward(sample_batch()).has_value()) << "and stays failed";
}

}  // namespace
}  // namespace moe::engine

namespace moe::engine {
namespace {

// Data-parallel attention + expert-parallel MoE: two engines (the ranks), each
// with its own requests and KV cache, their MoE layers exchanging tokens.
// Rank 0 gets every golden prompt twice, rank 1 only one prompt and then
// nothing: it keeps joining rank 0's steps with empty batches, and both give
// transformers' greedy ids.
TEST_F(RankGroupTest, DataParallelEnginesStepTogether) {
  const std::string group = "moeserve-dp-" + std::to_string(getpid());
  struct Rank {
    std::unique_ptr<comm::Communicator> comm;
    std::unique_ptr<model::Qwen3MoeModel> model;
    std::unique_ptr<ThreadPool> pool;
    std::unique_ptr<Engine> engine;
    const LockstepRunner* runner = nullptr;
  };
  std::vector<Rank> ranks(2);
  std::vector<std::thread> openers;
  for (int r = 0; r < 2; ++r) openers.emplace_back([&, r] { ranks[r].comm = open(group, r, 2); });
  for (auto& t : openers) t.join();
  for (int r = 0; r < 2; ++r) {
    Rank& k = ranks[r];
    ASSERT_TRUE(k.comm);
    k.pool = std::make_unique<ThreadPool>(1);
    k.model = std::make_unique<model::Qwen3MoeModel>(*weights_, model::ParallelPlan{1, 0, 2, r, true, k.comm.get()});
    auto runner = std::make_unique<LockstepRunner>(*k.model, *k.pool, layout(*k.model));
    k.runner = runner.get();
    EngineOptions options;
    options.scheduler = {.page_size = 4, .num_pages = 256, .max_num_seqs = 16, .max_num_batched_tokens = 9,
                         .max_model_len = 96, .enable_prefix_caching = true};
    options.check_invariants = true;
    k.engine = std::make_unique<Engine>(std::move(runner), options);
  }
  struct Result {
    std::vector<int32_t> tokens;
    std::promise<void> done;
  };
  std::vector<std::pair<size_t, std::unique_ptr<Result>>> results;
  auto submit = [&](int rank, size_t prompt) {
    results.emplace_back(prompt, std::make_unique<Result>());
    Result* res = results.back().second.get();
    EngineRequest request;
    request.prompt = prompts_[prompt], request.max_tokens = 12, request.sampling.temperature = 0;
    request.ignore_eos = true;
    ASSERT_TRUE(ranks[rank].engine->submit(request, [res](const EngineOutput& out) {
      if (out.token >= 0) res->tokens.push_back(out.token);
      if (out.finish != FinishReason::kNone) res->done.set_value();
    }).has_value());
  };
  submit(1, 2);
  for (int copy = 0; copy < 2; ++copy)
    for (size_t i = 0; i < prompts_.size(); ++i) submit(0, i);
  for (auto& [prompt, res] : results) {
    ASSERT_EQ(res->done.get_future().wait_for(std::chrono::seconds(60)), std::future_status::ready);
    EXPECT_EQ(res->tokens, greedy_[prompt]) << "prompt " << prompt;
  }
  EXPECT_GT(ranks[1].runner->num_idle_forwards(), 0) << "rank 1 ran empty batches for rank 0's steps";
  EXPECT_TRUE(ranks[0].engine->healthy() && ranks[1].engine->healthy());
  // Rank 0 stops: rank 1 learns it at its next vote, well inside the
  // communicator's 5 s timeout, and fails instead of waiting.
  const auto stop = std::chrono::steady_clock::now();
  ranks[0].engine->shutdown();
  while (ranks[1].engine->healthy() && std::chrono::steady_clock::now() - stop < std::chrono::seconds(10))
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_FALSE(ranks[1].engine->healthy());
  EXPECT_LT(std::chrono::steady_clock::now() - stop, std::chrono::seconds(2));
  ranks[1].engine->shutdown();
}

}  // namespace
}  // namespace moe::engine
