// The scheduler against a fake model runner whose outputs depend on the whole
// context read back through the page tables (fake_runner.h): every schedule
// (continuous batching, chunked prefill, preemption, prefix reuse) must give
// exactly the oracle's greedy tokens, with the page bookkeeping checked after
// every step.
#include "engine/scheduler.h"

#include <gtest/gtest.h>

#include <map>
#include <numeric>
#include <random>

#include "engine/sampler.h"
#include "fake_runner.h"

namespace moe::engine {
namespace {

using testing_fake::FakeRunner;
using testing_fake::next_token_logits;
using testing_fake::oracle_greedy;

constexpr int64_t kVocab = 97;

struct DriveResult {
  std::map<uint64_t, std::vector<int32_t>> outputs;
  std::map<uint64_t, FinishReason> finish;
  std::vector<StepPlan> plans;
};

// Drives schedule -> fake forward -> greedy -> complete_step until idle.
DriveResult drive(Scheduler& scheduler, FakeRunner& runner, int max_steps = 10000,
          const std::function<void(int step, Scheduler&)>& between_steps = {}) {
  DriveResult run;
  for (int step = 0; step < max_steps && scheduler.has_work(); ++step) {
    if (between_steps) between_steps(step, scheduler);
    StepPlan plan = scheduler.schedule(static_cast<double>(step));
    for (uint64_t id : plan.expired) run.finish[id] = FinishReason::kAbort;
    if (plan.empty()) continue;
    int total = 0;
    for (const auto& c : plan.chunks) total += c.num_tokens;
    EXPECT_LE(total, scheduler.options().max_num_batched_tokens);
    EXPECT_LE(static_cast<int>(plan.chunks.size()), scheduler.options().max_num_seqs);
    Tensor logits = *runner.forward(scheduler.build_batch(plan));
    std::vector<int32_t> sampled;
    for (size_t r = 0; r < static_cast<size_t>(logits.shape()[0]); ++r) {
      std::span<const float> row(logits.data_as<float>() + r * kVocab, kVocab);
      sampled.push_back(argmax(row));
    }
    for (const auto& u : scheduler.complete_step(plan, sampled)) {
      run.outputs[u.id].push_back(u.token);
      if (u.finish != FinishReason::kNone) run.finish[u.id] = u.finish;
    }
    scheduler.check_invariants();
    run.plans.push_back(std::move(plan));
  }
  EXPECT_FALSE(scheduler.has_work());
  return run;
}

std::vector<int32_t> random_prompt(std::mt19937& rng, int min_len, int max_len) {
  std::uniform_int_distribution<int> len(min_len, max_len), tok(0, kVocab - 1);
  std::vector<int32_t> p(static_cast<size_t>(len(rng)));
  for (auto& t : p) t = tok(rng);
  return p;
}

SequenceSpec spec(uint64_t id, std::vector<int32_t> prompt, int max_tokens) {
  SequenceSpec s;
  s.id = id;
  s.prompt = std::move(prompt);
  s.max_tokens = max_tokens;
  return s;
}

TEST(Scheduler, ContinuousBatchingWithChunkedPrefillMatchesOracle) {
  SchedulerOptions options{.page_size = 4, .num_pages = 400, .max_num_seqs = 6, .max_num_batched_tokens = 7,
                           .max_model_len = 96, .enable_prefix_caching = false};
  Scheduler scheduler(options);
  FakeRunner runner(kVocab, options.page_size, options.num_pages);
  std::mt19937 rng(1);
  std::map<uint64_t, std::vector<int32_t>> expected;
  for (uint64_t id = 1; id <= 20; ++id) {
    auto prompt = random_prompt(rng, 1, 30);
    const int max_tokens = 1 + static_cast<int>(rng() % 20);
    expected[id] = oracle_greedy(prompt, max_tokens, kVocab);
    ASSERT_TRUE(scheduler.add(spec(id, prompt, max_tokens)).is_ok());
  }
  DriveResult run = drive(scheduler, runner);
  EXPECT_EQ(run.outputs, expected);
  for (const auto& [id, reason] : run.finish) EXPECT_EQ(reason, FinishReason::kLength);
  // Continuous batching: some step mixes decode tokens with a prompt chunk.
  bool mixed = false;
  for (const auto& p : run.plans) mixed |= p.num_decode_tokens > 0 && p.num_prefill_tokens > 0;
  EXPECT_TRUE(mixed);
  EXPECT_EQ(scheduler.cache().num_used(), 0);
}

TEST(Scheduler, PreemptionByRecomputeMatchesOracle) {
  // 12 pages of 4 tokens: four sequences that each grow to 40 tokens cannot all fit.
  SchedulerOptions options{.page_size = 4, .num_pages = 12, .max_num_seqs = 8, .max_num_batched_tokens = 64,
                           .max_model_len = 44, .enable_prefix_caching = false};
  Scheduler scheduler(options);
  FakeRunner runner(kVocab, options.page_size, options.num_pages);
  std::mt19937 rng(2);
  std::map<uint64_t, std::vector<int32_t>> expected;
  for (uint64_t id = 1; id <= 4; ++id) {
    auto prompt = random_prompt(rng, 5, 8);
    expected[id] = oracle_greedy(prompt, 32, kVocab);
    ASSERT_TRUE(scheduler.add(spec(id, prompt, 32)).is_ok());
  }
  DriveResult run = drive(scheduler, runner);
  EXPECT_EQ(run.outputs, expected);
  EXPECT_GT(scheduler.num_preemptions(), 0);
  // The oldest sequence is never the victim while a newer one runs.
  for (const auto& p : run.plans)
    for (uint64_t victim : p.preempted) EXPECT_NE(victim, 1u);
}

TEST(Scheduler, PrefixCacheReusesFullPagesAndMatchesOracle) {
  SchedulerOptions options{.page_size = 4, .num_pages = 64, .max_num_seqs = 4, .max_num_batched_tokens = 32,
                           .max_model_len = 64, .enable_prefix_caching = true};
  Scheduler scheduler(options);
  FakeRunner runner(kVocab, options.page_size, options.num_pages);
  std::mt19937 rng(3);
  const auto shared = random_prompt(rng, 13, 13);  // 3 full pages + 1 token
  auto a = shared, b = shared;
  a.push_back(5);
  b.push_back(6);
  ASSERT_TRUE(scheduler.add(spec(1, a, 6)).is_ok());
  DriveResult first = drive(scheduler, runner);
  EXPECT_EQ(first.outputs[1], oracle_greedy(a, 6, kVocab));
  EXPECT_EQ(scheduler.cache().num_used(), 0);
  EXPECT_GT(scheduler.cache().num_evictable(), 0);  // kept for reuse

  ASSERT_TRUE(scheduler.add(spec(2, b, 6)).is_ok());
  StepPlan plan = scheduler.schedule(0);
  ASSERT_EQ(plan.chunks.size(), 1u);
  EXPECT_EQ(plan.chunks[0].start, 12);  // three cached pages skipped
  EXPECT_EQ(scheduler.num_cached_tokens(2), 12);
  Tensor logits = *runner.forward(scheduler.build_batch(plan));
  const int32_t t = argmax(std::span<const float>(logits.data_as<float>(), kVocab));
  scheduler.complete_step(plan, std::vector<int32_t>{t});
  DriveResult second = drive(scheduler, runner);
  std::vector<int32_t> out{t};
  out.insert(out.end(), second.outputs[2].begin(), second.outputs[2].end());
  EXPECT_EQ(out, oracle_greedy(b, 6, kVocab));
  EXPECT_EQ(scheduler.prefix_hit_tokens(), 12);
  EXPECT_EQ(scheduler.prefix_query_tokens(), 28);

  // The identical prompt again: all but the last token's page comes from the cache.
  ASSERT_TRUE(scheduler.add(spec(3, a, 6)).is_ok());
  DriveResult third = drive(scheduler, runner);
  EXPECT_EQ(third.outputs[3], oracle_greedy(a, 6, kVocab));
  EXPECT_EQ(scheduler.num_cached_tokens(3), 0);  // gone after finishing
  EXPECT_EQ(scheduler.prefix_hit_tokens(), 24);
}

TEST(Scheduler, PrefixCacheUnderPressureEvictsAndStaysCorrect) {
  SchedulerOptions options{.page_size = 2, .num_pages = 24, .max_num_seqs = 5, .max_num_batched_tokens = 9,
                           .max_model_len = 40, .enable_prefix_caching = true};
  Scheduler scheduler(options);
  FakeRunner runner(kVocab, options.page_size, options.num_pages);
  std::mt19937 rng(4);
  const auto stem = random_prompt(rng, 6, 6);
  std::map<uint64_t, std::vector<int32_t>> expected;
  for (uint64_t id = 1; id <= 30; ++id) {
    auto prompt = stem;
    if (id % 3 == 0) prompt = random_prompt(rng, 3, 12);
    auto tail = random_prompt(rng, 0, 9);
    prompt.insert(prompt.end(), tail.begin(), tail.end());
    const int max_tokens = 1 + static_cast<int>(rng() % 12);
    expected[id] = oracle_greedy(prompt, max_tokens, kVocab);
    ASSERT_TRUE(scheduler.add(spec(id, prompt, max_tokens)).is_ok());
  }
  DriveResult run = drive(scheduler, runner);
  EXPECT_EQ(run.outputs, expected);
  EXPECT_GT(scheduler.prefix_hit_tokens(), 0);
}

TEST(Scheduler, AbortFreesPagesAtOnce) {
  SchedulerOptions options{.page_size = 4, .num_pages = 32, .max_num_seqs = 4, .max_num_batched_tokens = 64,
                           .max_model_len = 64, .enable_prefix_caching = false};
  Scheduler scheduler(options);
  FakeRunner runner(kVocab, options.page_size, options.num_pages);
  ASSERT_TRUE(scheduler.add(spec(1, std::vector<int32_t>(10, 3), 40)).is_ok());
  ASSERT_TRUE(scheduler.add(spec(2, std::vector<int32_t>(10, 4), 40)).is_ok());
  StepPlan plan = scheduler.schedule(0);
  EXPECT_EQ(plan.chunks.size(), 2u);
  EXPECT_EQ(scheduler.cache().num_used(), 6);
  const model::ForwardBatch batch = scheduler.build_batch(plan);
  EXPECT_TRUE(scheduler.abort(1));
  EXPECT_EQ(scheduler.cache().num_used(), 3);
  EXPECT_FALSE(scheduler.abort(1));
  // The step in flight completes; the aborted sequence's sample is dropped.
  Tensor logits = *runner.forward(batch);
  auto updates = scheduler.complete_step(plan, std::vector<int32_t>{1, 2});
  ASSERT_EQ(updates.size(), 1u);
  EXPECT_EQ(updates[0].id, 2u);
  EXPECT_TRUE(scheduler.abort(2));
  EXPECT_EQ(scheduler.cache().num_used(), 0);
  EXPECT_FALSE(scheduler.has_work());
  scheduler.check_invariants();
}

TEST(Scheduler, DeadlinesExpireWaitingAndRunningSequences) {
  SchedulerOptions options{.page_size = 4, .num_pages = 8, .max_num_seqs = 1, .max_num_batched_tokens = 64,
                           .max_model_len = 32, .enable_prefix_caching = false};
  Scheduler scheduler(options);
  FakeRunner runner(kVocab, options.page_size, options.num_pages);
  auto a = spec(1, {1, 2, 3}, 20), b = spec(2, {4, 5, 6}, 20);
  a.deadline_s = 5;
  b.deadline_s = 3;  // waits behind a (max_num_seqs 1) and expires while waiting
  ASSERT_TRUE(scheduler.add(a).is_ok());
  ASSERT_TRUE(scheduler.add(b).is_ok());
  DriveResult run = drive(scheduler, runner);
  EXPECT_EQ(run.finish[1], FinishReason::kAbort);
  EXPECT_EQ(run.finish[2], FinishReason::kAbort);
  EXPECT_EQ(run.outputs[1].size(), 5u);  // steps 0..4 ran, step 5 expired it
  EXPECT_EQ(run.outputs.count(2), 0u);
  EXPECT_EQ(scheduler.cache().num_used(), 0);
}

TEST(Scheduler, AdmissionWaitsForPagesInArrivalOrder) {
  SchedulerOptions options{.page_size = 4, .num_pages = 10, .max_num_seqs = 8, .max_num_batched_tokens = 256,
                           .max_model_len = 40, .enable_prefix_caching = false};
  Scheduler scheduler(options);
  ASSERT_TRUE(scheduler.add(spec(1, std::vector<int32_t>(24, 1), 4)).is_ok());  // 6 pages
  ASSERT_TRUE(scheduler.add(spec(2, std::vector<int32_t>(20, 2), 4)).is_ok());  // 5 pages: must wait
  ASSERT_TRUE(scheduler.add(spec(3, std::vector<int32_t>(4, 3), 4)).is_ok());   // fits, but FIFO
  StepPlan plan = scheduler.schedule(0);
  ASSERT_EQ(plan.chunks.size(), 1u);
  EXPECT_EQ(plan.chunks[0].id, 1u);
  EXPECT_EQ(scheduler.num_waiting(), 2);
  EXPECT_TRUE(scheduler.add(spec(4, std::vector<int32_t>(30, 1), 20)).code() == StatusCode::kInvalidArgument);
  EXPECT_TRUE(scheduler.add(spec(2, {1}, 1)).code() == StatusCode::kInvalidArgument);  // id in use
  EXPECT_TRUE(scheduler.add(spec(5, {}, 1)).code() == StatusCode::kInvalidArgument);
}

TEST(Scheduler, StopAndEosTokensFinish) {
  SchedulerOptions options{.page_size = 4, .num_pages = 16, .max_num_seqs = 4, .max_num_batched_tokens = 64,
                           .max_model_len = 64, .enable_prefix_caching = false};
  const std::vector<int32_t> prompt = {7, 8, 9};
  const auto free_run = oracle_greedy(prompt, 10, kVocab);
  for (int mode = 0; mode < 3; ++mode) {
    Scheduler scheduler(options);
    FakeRunner runner(kVocab, options.page_size, options.num_pages);
    auto s = spec(1, prompt, 10);
    if (mode == 0) s.eos_token_ids = {free_run[3]};
    if (mode == 1) s.stop_token_ids = {free_run[3]};
    if (mode == 2) s.eos_token_ids = {free_run[3]}, s.ignore_eos = true;
    ASSERT_TRUE(scheduler.add(s).is_ok());
    DriveResult run = drive(scheduler, runner);
    const size_t first = static_cast<size_t>(std::find(free_run.begin(), free_run.end(), free_run[3]) - free_run.begin());
    EXPECT_EQ(run.outputs[1].size(), mode == 2 ? 10u : first + 1) << mode;
    EXPECT_EQ(run.finish[1], mode == 2 ? FinishReason::kLength : FinishReason::kStop) << mode;
  }
}

TEST(Scheduler, SameInputsGiveTheSamePlans) {
  auto run_once = [] {
    SchedulerOptions options{.page_size = 2, .num_pages = 20, .max_num_seqs = 3, .max_num_batched_tokens = 5,
                             .max_model_len = 30, .enable_prefix_caching = true};
    Scheduler scheduler(options);
    FakeRunner runner(kVocab, options.page_size, options.num_pages);
    std::mt19937 rng(9);
    for (uint64_t id = 1; id <= 12; ++id)
      EXPECT_TRUE(scheduler.add(spec(id, random_prompt(rng, 1, 14), 1 + static_cast<int>(rng() % 14))).is_ok());
    std::vector<std::tuple<uint64_t, int32_t, int32_t, bool>> trace;
    for (const auto& p : drive(scheduler, runner).plans)
      for (const auto& c : p.chunks) trace.emplace_back(c.id, c.start, c.num_tokens, c.sample);
    return trace;
  };
  EXPECT_EQ(run_once(), run_once());
}

}  // namespace
}  // namespace moe::engine

namespace moe::engine {
namespace {

// Prompt-logits sequences (prompt logprobs) get a logits row for every prompt
// position with a successor, each exactly once, after the batch's usual rows,
// at most max_prompt_logits_tokens of them per step (their prompts advance in
// such chunks while plain sequences use the rest of the budget); outputs stay
// the oracle's, and they never take pages from the prefix cache.
TEST(Scheduler, PromptLogitsRowsFollowTheUsualOnesCappedPerStep) {
  SchedulerOptions options{.page_size = 4,
                           .num_pages = 200,
                           .max_num_seqs = 8,
                           .max_num_batched_tokens = 64,
                           .max_model_len = 96,
                           .enable_prefix_caching = true,
                           .max_prompt_logits_tokens = 10};
  Scheduler scheduler(options);
  FakeRunner runner(kVocab, options.page_size, options.num_pages);
  std::mt19937 rng(7);
  const auto shared = random_prompt(rng, 30, 30);
  std::map<uint64_t, std::vector<int32_t>> prompts = {
      {1, shared}, {2, shared}, {3, random_prompt(rng, 12, 12)}, {4, random_prompt(rng, 40, 40)}};
  std::map<uint64_t, std::vector<int32_t>> expected, outputs, rows_seen;
  for (const auto& [id, prompt] : prompts) {
    SequenceSpec s = spec(id, prompt, 3);
    s.prompt_logits = id != 1 && id != 4;
    expected[id] = oracle_greedy(prompt, 3, kVocab);
    ASSERT_TRUE(scheduler.add(s).is_ok());
    if (id == 1) outputs = drive(scheduler, runner).outputs;  // first: its pages are cached for sequence 2
  }
  bool capped = false;
  for (int step = 100; scheduler.has_work(); ++step) {
    StepPlan plan = scheduler.schedule(step);
    const model::ForwardBatch batch = scheduler.build_batch(plan);
    size_t usual = 0;
    for (size_t c = 0; c < plan.chunks.size(); ++c) {
      const ScheduledChunk& chunk = plan.chunks[c];
      if (chunk.sample) usual += static_cast<size_t>(chunk.num_drafts) + 1;
      if (chunk.id == 4 && chunk.start == 0) {
        EXPECT_EQ(chunk.num_tokens, 40) << "a plain prompt is not capped";
      }
      if (chunk.id == 2) {
        EXPECT_EQ(scheduler.num_cached_tokens(2), 0) << "no prefix-cache hit";
      }
    }
    const size_t extra = batch.logits_rows.size() - usual;
    EXPECT_LE(extra, 10u);
    capped |= extra == 10;
    for (size_t i = usual; i < batch.logits_rows.size();
         ++i) {  // which sequence and position each belongs to
      const int32_t row = batch.logits_rows[i];
      size_t c = 0;
      while (batch.query_start[c + 1] <= row) ++c;
      rows_seen[plan.chunks[c].id].push_back(batch.positions[static_cast<size_t>(row)]);
    }
    Tensor logits = *runner.forward(batch);
    std::vector<int32_t> sampled;
    for (size_t r = 0; r < usual; ++r)
      sampled.push_back(argmax(std::span<const float>(logits.data_as<float>() + r * kVocab, kVocab)));
    for (const auto& u : scheduler.complete_step(plan, sampled)) outputs[u.id].push_back(u.token);
    scheduler.check_invariants();
  }
  EXPECT_EQ(outputs, expected);
  EXPECT_TRUE(capped);
  for (uint64_t id : {2, 3}) {
    std::vector<int32_t> all(prompts[id].size() - 1);
    std::iota(all.begin(), all.end(), 0);
    EXPECT_EQ(rows_seen[id], all) << "sequence " << id;
  }
  EXPECT_EQ(rows_seen.count(4), 0u);
}

}  // namespace
}  // namespace moe::engine
