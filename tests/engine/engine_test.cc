// The engine loop (threads, queue, callbacks, cancellation, deadlines,
// shutdown) over the fake runner (fake_runner.h).
#include "engine/engine.h"

#include <gtest/gtest.h>

#include <future>
#include <set>
#include <thread>

#include "fake_runner.h"

namespace moe::engine {
namespace {

using testing_fake::FakeRunner;
using testing_fake::oracle_greedy;

constexpr int64_t kVocab = 97;

struct Collected {
  std::mutex mutex;
  std::vector<int32_t> tokens;
  EngineOutput final_output;
  std::promise<void> done;
  int num_finals = 0;
};

OutputCallback collect(std::shared_ptr<Collected> c) {
  return [c](const EngineOutput& out) {
    std::lock_guard lock(c->mutex);
    if (out.token >= 0) c->tokens.push_back(out.token);
    if (out.finish != FinishReason::kNone) {
      c->final_output = out;
      if (++c->num_finals == 1) c->done.set_value();
    }
  };
}

EngineOptions options(int32_t num_pages = 256) {
  EngineOptions o;
  o.scheduler = {.page_size = 4, .num_pages = num_pages, .max_num_seqs = 8, .max_num_batched_tokens = 16,
                 .max_model_len = 128, .enable_prefix_caching = true};
  o.check_invariants = true;
  return o;
}

EngineRequest greedy(std::vector<int32_t> prompt, int max_tokens) {
  EngineRequest r;
  r.prompt = std::move(prompt);
  r.max_tokens = max_tokens;
  r.sampling.temperature = 0;
  return r;
}

TEST(Engine, ConcurrentSubmittersGetOracleTokens) {
  auto o = options();
  Engine engine(std::make_unique<FakeRunner>(kVocab, 4, 256), o);
  std::vector<std::shared_ptr<Collected>> results(40);
  std::vector<std::vector<int32_t>> prompts(40);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = t; i < 40; i += 4) {
        prompts[i] = {i % 7, i, 3, i % 5, 11};
        results[i] = std::make_shared<Collected>();
        auto id = engine.submit(greedy(prompts[i], 5 + i % 9), collect(results[i]));
        EXPECT_TRUE(id.has_value());
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < 40; ++i) {
    results[i]->done.get_future().wait();
    EXPECT_EQ(results[i]->tokens, oracle_greedy(prompts[i], 5 + i % 9, kVocab)) << i;
    EXPECT_EQ(results[i]->final_output.finish, FinishReason::kLength);
    EXPECT_EQ(results[i]->num_finals, 1);
  }
  // Gauges update right after the step whose callbacks ran.
  for (int i = 0; i < 500 && engine.metrics().num_requests_running > 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const EngineMetrics m = engine.metrics();
  EXPECT_EQ(m.num_requests_running, 0);
  EXPECT_EQ(m.kv_cache_usage_perc, 0.0);
  EXPECT_EQ(m.request_success_total[static_cast<int>(FinishReason::kLength)], 40);
  EXPECT_EQ(m.e2e_request_latency_seconds.count, 40u);
  EXPECT_GT(m.prefix_cache_queries_total, 0);
}

TEST(Engine, CancelEndsTheRequestAndFreesItsPages) {
  auto runner = std::make_unique<FakeRunner>(kVocab, 4, 256);
  runner->step_delay_ms = 2;
  Engine engine(std::move(runner), options());
  auto c = std::make_shared<Collected>();
  auto id = engine.submit(greedy({1, 2, 3}, 120), collect(c));
  ASSERT_TRUE(id.has_value());
  while (true) {
    {
      std::lock_guard lock(c->mutex);
      if (c->tokens.size() >= 3) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  engine.cancel(*id);
  c->done.get_future().wait();
  EXPECT_EQ(c->final_output.finish, FinishReason::kAbort);
  EXPECT_TRUE(c->final_output.error.is_ok());
  EXPECT_LT(c->tokens.size(), 120u);
  // Gauges update after the step that handled the cancel.
  for (int i = 0; i < 200 && engine.metrics().num_requests_running > 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(engine.metrics().kv_cache_usage_perc, 0.0);
  engine.cancel(*id);  // twice: harmless
  engine.cancel(12345);
}

TEST(Engine, DeadlineFailsWithDeadlineExceeded) {
  auto runner = std::make_unique<FakeRunner>(kVocab, 4, 256);
  runner->step_delay_ms = 5;
  Engine engine(std::move(runner), options());
  auto c = std::make_shared<Collected>();
  auto r = greedy({1, 2, 3}, 120);
  r.timeout_s = 0.05;
  ASSERT_TRUE(engine.submit(r, collect(c)).has_value());
  c->done.get_future().wait();
  EXPECT_EQ(c->final_output.finish, FinishReason::kAbort);
  EXPECT_EQ(c->final_output.error.code(), StatusCode::kDeadlineExceeded);
}

TEST(Engine, RejectsInvalidRequestsAndFullQueues) {
  auto runner = std::make_unique<FakeRunner>(kVocab, 4, 256);
  runner->step_delay_ms = 20;
  auto o = options();
  o.max_waiting = 2;
  o.scheduler.max_num_seqs = 1;
  Engine engine(std::move(runner), o);
  auto noop = [](const EngineOutput&) {};
  EXPECT_EQ(engine.submit(greedy({}, 4), noop).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(engine.submit(greedy({kVocab}, 4), noop).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(engine.submit(greedy({1}, 0), noop).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(engine.submit(greedy({1}, 200), noop).status().code(), StatusCode::kInvalidArgument);
  auto bad = greedy({1}, 4);
  bad.sampling.temperature = -1;
  EXPECT_EQ(engine.submit(bad, noop).status().code(), StatusCode::kInvalidArgument);
  // Fill the queue: the running one, then two waiting; the next is refused.
  std::vector<std::shared_ptr<Collected>> cs;
  int refused = 0;
  for (int i = 0; i < 6; ++i) {
    cs.push_back(std::make_shared<Collected>());
    auto id = engine.submit(greedy({1, 2}, 50), collect(cs.back()));
    if (!id) {
      EXPECT_EQ(id.status().code(), StatusCode::kResourceExhausted);
      ++refused;
      cs.pop_back();
    }
  }
  EXPECT_GT(refused, 0);
  engine.shutdown();  // what is left ends with an error, exactly once each
  for (auto& c : cs) {
    c->done.get_future().wait();
    EXPECT_EQ(c->num_finals, 1);
  }
  EXPECT_EQ(engine.submit(greedy({1}, 4), noop).status().code(), StatusCode::kUnavailable);
}

TEST(Engine, SeededSamplingIsReproducibleAcrossBatches) {
  Engine engine(std::make_unique<FakeRunner>(kVocab, 4, 256), options());
  auto sampled = [&](int num_others) {
    std::vector<std::shared_ptr<Collected>> others;
    for (int i = 0; i < num_others; ++i) {
      others.push_back(std::make_shared<Collected>());
      EXPECT_TRUE(engine.submit(greedy({i, 4, 4}, 20), collect(others.back())).has_value());
    }
    auto c = std::make_shared<Collected>();
    EngineRequest r = greedy({5, 6, 7}, 20);
    r.sampling.temperature = 1.0f;
    r.sampling.seed = 42;
    r.num_logprobs = 3;
    EXPECT_TRUE(engine.submit(r, collect(c)).has_value());
    c->done.get_future().wait();
    for (auto& o : others) o->done.get_future().wait();
    return c->tokens;
  };
  const auto alone = sampled(0);
  EXPECT_EQ(alone.size(), 20u);
  EXPECT_EQ(sampled(5), alone);
  EXPECT_NE(alone, oracle_greedy({5, 6, 7}, 20, kVocab));
}

TEST(Engine, LogprobsAreTheLogSoftmaxOfTheLogits) {
  Engine engine(std::make_unique<FakeRunner>(kVocab, 4, 256), options());
  std::promise<TokenLogprobs> first;
  bool set = false;
  EngineRequest r = greedy({3, 1, 4}, 1);
  r.num_logprobs = 5;
  ASSERT_TRUE(engine.submit(r, [&](const EngineOutput& out) {
    if (!set && out.logprobs) set = true, first.set_value(*out.logprobs);
  }).has_value());
  const TokenLogprobs lp = first.get_future().get();
  const auto logits = testing_fake::next_token_logits(std::vector<int32_t>{3, 1, 4}, kVocab);
  double z = 0;
  for (float x : logits) z += std::exp(static_cast<double>(x));
  ASSERT_EQ(lp.top.size(), 5u);
  EXPECT_EQ(lp.top[0].first, lp.token);  // greedy: the top token
  EXPECT_NEAR(lp.logprob, logits[lp.token] - std::log(z), 1e-5);
  for (size_t i = 1; i < lp.top.size(); ++i) EXPECT_GE(lp.top[i - 1].second, lp.top[i].second);
}

}  // namespace
}  // namespace moe::engine

namespace moe::engine {
namespace {

// Fails its first forward pass, once `gate` opens: the test submits all its
// requests first (a dead engine refuses new ones, so without the gate the
// engine thread could fail the first request before the others are in).
class ThrowingRunner final : public ModelRunner {
 public:
  int64_t vocab_size() const override { return 97; }
  ThrowingRunner(bool as_status, std::shared_future<void> gate) : as_status_(as_status), gate_(std::move(gate)) {}
  Expected<Tensor> forward(const model::ForwardBatch&) override {
    gate_.wait();
    if (as_status_) return unavailable("device lost");
    throw std::runtime_error("device lost");
  }

 private:
  bool as_status_;
  std::shared_future<void> gate_;
};

class FailingForward : public testing::TestWithParam<bool> {};

TEST_P(FailingForward, FailsEveryRequestAndMarksTheEngineDead) {
  std::promise<void> open;
  Engine engine(std::make_unique<ThrowingRunner>(GetParam(), open.get_future().share()), options());
  std::vector<std::shared_ptr<Collected>> cs;
  int accepted = 0;
  for (int i = 0; i < 3; ++i) {
    cs.push_back(std::make_shared<Collected>());
    accepted += engine.submit(greedy({1, 2, 3}, 4), collect(cs.back())).has_value();
  }
  open.set_value();  // before any assertion can return: the engine's thread waits on it
  ASSERT_EQ(accepted, 3);
  for (auto& c : cs) {
    c->done.get_future().wait();
    EXPECT_EQ(c->final_output.error.code(), StatusCode::kInternal);
    EXPECT_NE(c->final_output.error.message().find("device lost"), std::string::npos);
    EXPECT_EQ(c->num_finals, 1);
  }
  EXPECT_FALSE(engine.healthy());
  EXPECT_EQ(engine.submit(greedy({1}, 2), [](const EngineOutput&) {}).status().code(), StatusCode::kUnavailable);
}

INSTANTIATE_TEST_SUITE_P(StatusOrException, FailingForward, testing::Bool());

}  // namespace
}  // namespace moe::engine

namespace moe::engine {
namespace {

// Each step hands the runner one sampled row per sequence, fetches back only
// the rows of requests that want logprobs, and adjusts only the rows of
// requests with penalties (a GPU runner samples the rest on its device).
// Tokens are the oracle's: greedy, and greedy after the presence penalty.
TEST(Engine, StepSamplingFetchesOnlyTheRowsLogprobsNeed) {
  auto runner = std::make_unique<FakeRunner>(kVocab, 4, 256);
  runner->record_sampling = true;
  runner->step_delay_ms = 5;  // so that the three requests share steps
  FakeRunner* fake = runner.get();
  Engine engine(std::move(runner), options());
  const std::vector<int32_t> prompt = {3, 1, 4, 1, 5};
  constexpr int kTokens = 6;
  std::vector<std::promise<std::vector<int32_t>>> done(3);
  std::vector<std::vector<int32_t>> tokens(3);
  for (int i = 0; i < 3; ++i) {
    EngineRequest r;
    r.prompt = prompt;
    r.prompt.push_back(i);
    r.max_tokens = kTokens;
    r.sampling.temperature = 0;
    r.ignore_eos = true;
    if (i == 1) r.num_logprobs = 2;
    if (i == 2) r.sampling.presence_penalty = 2.0f;
    auto on_output = [&, i](const EngineOutput& out) {
      if (out.token >= 0) tokens[i].push_back(out.token);
      if (out.finish != FinishReason::kNone) done[i].set_value(tokens[i]);
    };
    ASSERT_TRUE(engine.submit(r, on_output).has_value());
  }
  std::vector<std::vector<int32_t>> got;
  for (auto& d : done) got.push_back(d.get_future().get());
  for (int i = 0; i < 2; ++i) {
    std::vector<int32_t> p = prompt;
    p.push_back(i);
    EXPECT_EQ(got[i], testing_fake::oracle_greedy(p, kTokens, kVocab)) << "request " << i;
  }
  std::vector<int32_t> context = prompt, penalized;
  context.push_back(2);
  for (int t = 0; t < kTokens; ++t) {
    auto logits = testing_fake::next_token_logits(context, kVocab);
    SamplingParams params;
    params.presence_penalty = 2.0f;
    adjust_logits(logits, params, context, penalized.size(), {});
    penalized.push_back(argmax(logits));
    context.push_back(penalized.back());
  }
  EXPECT_EQ(got[2], penalized);
  int fetched = 0, adjusted_rows = 0, shared_steps = 0;
  for (const StepSampling& s : fake->samplings) {
    EXPECT_LE(s.fetch_rows.size(), 1u);
    fetched += static_cast<int>(s.fetch_rows.size());
    std::set<int32_t> rows;
    for (const auto& a : s.adjustments) rows.insert(a.row);
    EXPECT_LE(rows.size(), 1u);
    adjusted_rows += static_cast<int>(rows.size());
    shared_steps += s.rows.size() == 3;
  }
  EXPECT_EQ(fetched, kTokens);  // request 1's rows only
  EXPECT_EQ(adjusted_rows,
            kTokens - 1);  // request 2's rows once it has output (the penalty counts output tokens)
  EXPECT_GT(shared_steps, 0);
}

}  // namespace
}  // namespace moe::engine
