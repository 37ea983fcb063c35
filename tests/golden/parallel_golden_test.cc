// Parallel layouts (model/parallel.h) equal the single rank on the golden
// models: tensor parallel attention (TP 2 and 4, k/v heads split or
// replicated), expert parallel MoE on replicated input (EP 2 and 4), both
// together, and data-parallel attention with the expert exchange (DP 2 + EP 2,
// including a rank with no tokens). Ranks are threads joined by the
// shared-memory communicator (comm/cpu), the same code as separate processes.
//
// Oracles: transformers' greedy ids (tests/data/golden, tools/make_golden.py)
// and the single-rank CPU reference's logits. The parallel sums add the same
// terms in another order, so logits move by float32 rounding only (~1e-6
// relative); 1e-4 is the golden tests' bound (golden_test.cc says why).
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>
#include <unistd.h>

#include "comm/cpu/shm_communicator.h"
#include "engine/generator.h"
#include "engine/sampler.h"
#include "kv/kv_cache.h"
#include "model/config.h"
#include "model/parallel.h"
#include "model/qwen3_moe.h"
#include "model/weights.h"

namespace moe {
namespace {

using nlohmann::json;

constexpr double kLogitTolerance = 1e-4;
constexpr int kMaxTokens = 16;

std::string golden_dir(const std::string& name) { return std::string(MOE_SOURCE_DIR) + "/tests/data/golden/" + name; }

struct Golden {
  model::ModelConfig config;
  std::unique_ptr<model::ModelWeights> weights;
  std::vector<std::vector<int32_t>> prompts, greedy;
  std::vector<std::vector<float>> last_logits;
};

Golden load(const std::string& name, ThreadPool& pool) {
  Golden g;
  auto config = model::load_model_config(golden_dir(name));
  CHECK(config.has_value(), "{}", config.status().to_string());
  g.config = *config;
  auto weights = model::ModelWeights::load(golden_dir(name), g.config, pool);
  CHECK(weights.has_value(), "{}", weights.status().to_string());
  g.weights = std::make_unique<model::ModelWeights>(std::move(weights).value());
  std::ifstream in(golden_dir(name) + "/golden.json");
  const json j = json::parse(in);
  for (const auto& p : j["prompts"]) {
    g.prompts.push_back(p["ids"].get<std::vector<int32_t>>());
    auto greedy = p["greedy"].get<std::vector<int32_t>>();
    greedy.resize(kMaxTokens);
    g.greedy.push_back(greedy);
    g.last_logits.push_back(p["last_logits"].get<std::vector<float>>());
  }
  return g;
}

double relative_error(std::span<const float> ours, std::span<const float> ref) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    diff += (ours[i] - ref[i]) * static_cast<double>(ours[i] - ref[i]);
    norm += ref[i] * static_cast<double>(ref[i]);
  }
  return std::sqrt(diff / norm);
}

// Runs fn(rank, comm) on `world` threads joined by one shared-memory group.
template <typename Fn>
void run_ranks(int world, Fn fn) {
  static std::atomic<int> group{0};
  const std::string name = "moeserve-test-" + std::to_string(getpid()) + "-" + std::to_string(group++);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      comm::ShmGroupOptions o;
      o.name = name, o.rank = r, o.world_size = world, o.buffer_bytes = 1 << 20, o.timeout_ms = 60000;
      auto c = comm::open_shm_communicator(o);
      ASSERT_TRUE(c.has_value()) << c.status().to_string();
      fn(r, c->get());
    });
  for (auto& t : threads) t.join();
}

struct Layout {
  const char* name;
  int tp, ep;
  bool dp;
};

// Greedy generation through the serving scheduler: every rank runs the same
// requests and, since all ranks see the same logits, the same schedule.
std::vector<std::vector<int32_t>> generate(const model::Qwen3MoeModel& m, ThreadPool& pool,
                                           const std::vector<std::vector<int32_t>>& prompts) {
  std::vector<engine::GenerationRequest> requests;
  for (const auto& p : prompts) {
    engine::GenerationRequest r;
    r.prompt = p, r.max_tokens = kMaxTokens, r.sampling.temperature = 0.0f, r.ignore_eos = true;
    requests.push_back(r);
  }
  engine::GeneratorOptions options;
  options.max_tokens_per_step = 11;  // chunked prefill mixed with decodes
  options.page_size = 4;
  engine::Generator generator(m, pool, options);
  auto results = generator.generate(requests);
  CHECK(results.has_value(), "{}", results.status().to_string());
  std::vector<std::vector<int32_t>> ids;
  for (const auto& r : *results) ids.push_back(r.token_ids);
  return ids;
}

// DP attention: each rank owns some sequences and its own KV cache; all ranks
// step together (a rank with no sequence runs empty batches). One prefill of
// all its prompts, then greedy decode steps. Returns its sequences' ids and
// the prefill's last-position logits.
struct RankRun {
  std::vector<std::vector<int32_t>> ids;
  std::vector<std::vector<float>> last_logits;
};
RankRun lockstep_greedy(const model::Qwen3MoeModel& m, ThreadPool& pool, const std::vector<std::vector<int32_t>>& prompts,
                        int* error_count) {
  const auto& c = m.config();
  constexpr int kPageSize = 4;
  const int pages_per_seq = 96 / kPageSize;  // the longest golden prompt (60) + kMaxTokens
  kv::KvCache cache({c.num_layers, m.shard().num_kv_heads, c.head_dim, kPageSize,
                     std::max<int32_t>(1, static_cast<int32_t>(prompts.size()) * pages_per_seq), DType::kF32});
  std::vector<ops::PagedKv> layers;
  for (int l = 0; l < c.num_layers; ++l) layers.push_back(cache.layer(l));
  RankRun run;
  run.ids.resize(prompts.size());
  std::vector<int32_t> length(prompts.size()), last(prompts.size());
  for (int step = 0; step <= kMaxTokens - 1; ++step) {
    model::ForwardBatch b;
    b.max_pages_per_seq = pages_per_seq;
    b.query_start = {0};
    for (size_t s = 0; s < prompts.size(); ++s) {
      const std::vector<int32_t> tokens = step == 0 ? prompts[s] : std::vector<int32_t>{last[s]};
      for (size_t i = 0; i < tokens.size(); ++i) {
        b.token_ids.push_back(tokens[i]);
        b.positions.push_back(length[s] + static_cast<int32_t>(i));
      }
      length[s] += static_cast<int32_t>(tokens.size());
      b.query_start.push_back(b.num_tokens());
      b.logits_rows.push_back(b.num_tokens() - 1);
      for (int p = 0; p < pages_per_seq; ++p) b.page_table.push_back(static_cast<int32_t>(s) * pages_per_seq + p);
    }
    auto logits = m.try_forward(pool, b, layers);
    if (!logits) {
      ADD_FAILURE() << logits.status().to_string();
      ++*error_count;
      return run;
    }
    for (size_t s = 0; s < prompts.size(); ++s) {
      std::span<const float> row(logits->data_as<float>() + s * c.vocab_size, c.vocab_size);
      if (step == 0) run.last_logits.emplace_back(row.begin(), row.end());
      last[s] = engine::argmax(row);
      run.ids[s].push_back(last[s]);
    }
  }
  return run;
}

// Whether the layout fits the model (heads, experts, widths): the plan's own
// checks say so.
bool applies(const Golden& g, const Layout& l) {
  const Status fits = model::check_parallel_plan(g.config, *g.weights, {l.tp, 0, l.ep, 0, l.dp, nullptr});
  if (!fits) {
    std::printf("%s: not applicable (%s)\n", l.name, fits.message().c_str());
    return false;
  }
  return true;
}

class ParallelGoldenTest : public testing::TestWithParam<std::string> {};

TEST_P(ParallelGoldenTest, TensorAndExpertParallelEqualSingleRank) {
  ThreadPool pool(1);
  const Golden g = load(GetParam(), pool);
  const Layout layouts[] = {{"TP2", 2, 1, false}, {"TP4", 4, 1, false}, {"EP2", 1, 2, false},
                            {"EP4", 1, 4, false}, {"TP2+EP2", 2, 2, false}, {"TP4+EP4", 4, 4, false}};
  int ran = 0;
  for (const Layout& l : layouts) {
    if (!applies(g, l)) continue;
    ++ran;
    run_ranks(std::max(l.tp, l.ep), [&](int rank, comm::Communicator* c) {
      ThreadPool rank_pool(1);
      model::Qwen3MoeModel m(*g.weights, {l.tp, l.tp > 1 ? rank : 0, l.ep, l.ep > 1 ? rank : 0, false, c});
      const auto ids = generate(m, rank_pool, g.prompts);
      for (size_t i = 0; i < ids.size(); ++i)
        EXPECT_EQ(ids[i], g.greedy[i]) << GetParam() << " " << l.name << " rank " << rank << " prompt " << i;
    });
  }
  EXPECT_GE(ran, 3) << "most layouts apply to every golden model";
}

TEST_P(ParallelGoldenTest, PrefillLogitsMatchSingleRank) {
  ThreadPool pool(1);
  const Golden g = load(GetParam(), pool);
  const model::Qwen3MoeModel single(*g.weights);
  int errors = 0;
  const RankRun ref = lockstep_greedy(single, pool, g.prompts, &errors);
  const Layout layouts[] = {{"TP2+EP2", 2, 2, false}, {"TP4", 4, 1, false}, {"DP2+EP2", 1, 2, true}};
  for (const Layout& l : layouts) {
    if (!applies(g, l)) continue;
    const int world = std::max(l.tp, l.ep);
    std::vector<RankRun> runs(world);
    run_ranks(world, [&](int rank, comm::Communicator* c) {
      ThreadPool rank_pool(1);
      model::Qwen3MoeModel m(*g.weights, {l.tp, l.tp > 1 ? rank : 0, l.ep, l.ep > 1 ? rank : 0, l.dp, c});
      // DP: rank r owns prompts r, r + world, ...; TP/EP: every rank runs all.
      std::vector<std::vector<int32_t>> mine;
      for (size_t i = 0; i < g.prompts.size(); ++i)
        if (!l.dp || static_cast<int>(i) % world == rank) mine.push_back(g.prompts[i]);
      runs[rank] = lockstep_greedy(m, rank_pool, mine, &errors);
    });
    ASSERT_EQ(errors, 0);
    for (size_t i = 0; i < g.prompts.size(); ++i) {
      const int rank = l.dp ? static_cast<int>(i) % world : 0;
      const size_t slot = l.dp ? i / world : i;
      ASSERT_LT(slot, runs[rank].ids.size());
      EXPECT_EQ(runs[rank].ids[slot], ref.ids[i]) << l.name << " prompt " << i;
      EXPECT_EQ(runs[rank].ids[slot], g.greedy[i]) << l.name << " prompt " << i << " vs transformers";
      EXPECT_LT(relative_error(runs[rank].last_logits[slot], ref.last_logits[i]), kLogitTolerance) << l.name;
      EXPECT_LT(relative_error(runs[rank].last_logits[slot], g.last_logits[i]), kLogitTolerance) << l.name;
    }
  }
}

// A DP rank with no requests still steps (empty batches), so the other
// rank's expert exchange completes.
TEST(ParallelGolden, IdleDataParallelRankKeepsStepping) {
  ThreadPool pool(1);
  const Golden g = load("moe_basic", pool);
  std::vector<RankRun> runs(2);
  int errors = 0;
  run_ranks(2, [&](int rank, comm::Communicator* c) {
    ThreadPool rank_pool(1);
    model::Qwen3MoeModel m(*g.weights, {1, 0, 2, rank, true, c});
    runs[rank] = lockstep_greedy(m, rank_pool, rank == 0 ? g.prompts : std::vector<std::vector<int32_t>>{}, &errors);
  });
  ASSERT_EQ(errors, 0);
  for (size_t i = 0; i < g.prompts.size(); ++i) EXPECT_EQ(runs[0].ids[i], g.greedy[i]) << "prompt " << i;
  EXPECT_TRUE(runs[1].ids.empty());
}

TEST(ParallelGolden, PlansThatDoNotFitAreRefusedWithAReason) {
  ThreadPool pool(1);
  const Golden g = load("moe_dense_layer", pool);  // 4 q heads, 1 k/v head, 6 experts, dense width 96
  auto message = [&](model::ParallelPlan p) { return model::check_parallel_plan(g.config, *g.weights, p).message(); };
  EXPECT_NE(message({1, 0, 4, 0, false, nullptr}).find("6 experts do not split over expert parallel size 4"),
            std::string::npos);
  EXPECT_NE(message({3, 0, 1, 0, false, nullptr}).find("attention heads do not split"), std::string::npos);
  EXPECT_NE(message({2, 0, 4, 0, false, nullptr}).find("must be equal"), std::string::npos);
  EXPECT_NE(message({2, 0, 1, 0, true, nullptr}).find("tensor parallel size must be 1"), std::string::npos);
  EXPECT_NE(model::check_communicator({2, 0, 1, 0, false, nullptr}).message().find("needs a communicator"),
            std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(Models, ParallelGoldenTest,
                         testing::Values("moe_basic", "moe_dense_layer", "moe_sparse_step", "dense_qwen3"));

}  // namespace
}  // namespace moe
