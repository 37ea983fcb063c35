// ThreadPool: every index of every range covered exactly once, chunks of at
// least `grain` items, all threads taking part, nested calls run serially
// without deadlock, and many back-to-back jobs and pool lifetimes as a stress
// test (run this binary under -fsanitize=thread to check the locking).
// Also logging, whose contract is about threads too: level filtering, the line
// format, and whole lines when several threads log at once.

#include "core/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/logging.h"

namespace moe {
namespace {

struct Chunk {
  int64_t begin, end;
};

// Runs parallel_for and checks coverage and chunk sizes against the contract.
void check_covers_once(ThreadPool& pool, int64_t begin, int64_t end, int64_t grain) {
  const int64_t n = std::max<int64_t>(end - begin, 0);
  std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
  std::mutex mutex;
  std::vector<Chunk> chunks;
  pool.parallel_for(begin, end, grain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) hits[static_cast<size_t>(i - begin)].fetch_add(1, std::memory_order_relaxed);
    std::lock_guard lock(mutex);
    chunks.push_back({b, e});
  });
  const std::string where = "range [" + std::to_string(begin) + ", " + std::to_string(end) + ") grain " +
                            std::to_string(grain) + " threads " + std::to_string(pool.num_threads());
  int64_t missed_or_repeated = 0;
  for (auto& h : hits) missed_or_repeated += h.load() != 1;
  EXPECT_EQ(missed_or_repeated, 0) << where;
  if (n == 0) {
    EXPECT_TRUE(chunks.empty()) << where;
    return;
  }
  // At least `grain` items per chunk, unless the whole range is smaller; no
  // more chunks than 4 per thread (the split's stated cap).
  const int64_t min_chunk = std::min(std::max<int64_t>(grain, 1), n);
  for (const Chunk& c : chunks) {
    EXPECT_LE(begin, c.begin) << where;
    EXPECT_LE(c.end, end) << where;
    EXPECT_GE(c.end - c.begin, min_chunk) << where;
  }
  EXPECT_LE(static_cast<int64_t>(chunks.size()), 4 * pool.num_threads()) << where;
}

TEST(ThreadPool, NumThreads) {
  EXPECT_EQ(ThreadPool(1).num_threads(), 1);
  EXPECT_EQ(ThreadPool(3).num_threads(), 3);
  const int hardware = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  EXPECT_EQ(ThreadPool(0).num_threads(), hardware);
  EXPECT_EQ(ThreadPool(-2).num_threads(), hardware);
}

TEST(ThreadPool, CoversEveryIndexExactlyOnce) {
  const std::pair<int64_t, int64_t> ranges[] = {{0, 0},   {5, 5},     {7, 3},  {0, 1},   {10, 11}, {-3, 2},
                                                {0, 2},   {0, 7},     {0, 9},  {0, 100}, {3, 1000}, {-50, 50},
                                                {0, 4097}, {1, 65536}};
  const int64_t grains[] = {-1, 0, 1, 2, 3, 4, 7, 64, 1000, int64_t{1} << 40};
  for (int num_threads : {1, 2, 3, 4, 8}) {
    ThreadPool pool(num_threads);
    for (auto [begin, end] : ranges)
      for (int64_t grain : grains) check_covers_once(pool, begin, end, grain);
  }
}

TEST(ThreadPool, SmallRangesRunOnTheCaller) {
  ThreadPool pool(4);
  const auto caller = std::this_thread::get_id();
  int calls = 0;
  // One item, or fewer than two grains: one chunk, run inline.
  pool.parallel_for(0, 1, 1, [&](int64_t b, int64_t e) {
    EXPECT_EQ(std::this_thread::get_id(), caller);
    EXPECT_EQ(b, 0);
    EXPECT_EQ(e, 1);
    ++calls;
  });
  pool.parallel_for(10, 25, 8, [&](int64_t b, int64_t e) {
    EXPECT_EQ(std::this_thread::get_id(), caller);
    EXPECT_EQ(b, 10);
    EXPECT_EQ(e, 25);
    ++calls;
  });
  pool.parallel_for(3, 3, 1, [&](int64_t, int64_t) { ++calls; });
  EXPECT_EQ(calls, 2);
}

TEST(ThreadPool, EveryThreadTakesPart) {
  // One item per thread, and each chunk waits until all threads have arrived:
  // that finishes only if the workers and the caller run chunks concurrently.
  for (int num_threads : {2, 4, 6}) {
    ThreadPool pool(num_threads);
    std::mutex mutex;
    std::condition_variable all_arrived;
    int arrived = 0;
    std::set<std::thread::id> ids;
    pool.parallel_for(0, num_threads, 1, [&](int64_t, int64_t) {
      std::unique_lock lock(mutex);
      ids.insert(std::this_thread::get_id());
      if (++arrived == num_threads) all_arrived.notify_all();
      all_arrived.wait_for(lock, std::chrono::seconds(20), [&] { return arrived == num_threads; });
    });
    EXPECT_EQ(arrived, num_threads);
    EXPECT_EQ(static_cast<int>(ids.size()), num_threads);
  }
}

TEST(ThreadPool, NestedCallsRunSeriallyWithoutDeadlock) {
  ThreadPool pool(4);
  constexpr int64_t kOuter = 64, kInner = 100;
  std::vector<std::atomic<int>> hits(kOuter * kInner);
  pool.parallel_for(0, kOuter, 1, [&](int64_t ob, int64_t oe) {
    for (int64_t o = ob; o < oe; ++o) {
      const auto thread = std::this_thread::get_id();
      int inner_calls = 0;
      pool.parallel_for(0, kInner, 1, [&](int64_t ib, int64_t ie) {
        EXPECT_EQ(std::this_thread::get_id(), thread);  // serial, on this thread
        ++inner_calls;
        for (int64_t i = ib; i < ie; ++i) hits[o * kInner + i].fetch_add(1);
      });
      EXPECT_EQ(inner_calls, 1);
    }
  });
  for (auto& h : hits) ASSERT_EQ(h.load(), 1);
  // The pool is still usable in parallel afterwards.
  check_covers_once(pool, 0, 1000, 1);
}

TEST(ThreadPool, TwoPoolsNestedInEachOther) {
  ThreadPool outer(3), inner(3);
  std::atomic<int64_t> sum{0};
  outer.parallel_for(0, 30, 1, [&](int64_t ob, int64_t oe) {
    for (int64_t o = ob; o < oe; ++o)
      inner.parallel_for(0, 10, 1, [&](int64_t ib, int64_t ie) {
        for (int64_t i = ib; i < ie; ++i) sum += o * 10 + i;
      });
  });
  EXPECT_EQ(sum.load(), 299 * 300 / 2);
}

TEST(ThreadPool, StressManyBackToBackJobs) {
  constexpr int kRounds = 20000;
  for (int num_threads : {2, 5}) {
    ThreadPool pool(num_threads);
    std::vector<int64_t> data(512);
    for (int round = 0; round < kRounds; ++round) {
      const int64_t n = 1 + round % 512;
      pool.parallel_for(0, n, 1 + round % 7, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) data[i] += i;  // plain writes: chunks must not overlap
      });
    }
    // Element i was written in every round whose range covered it.
    for (int64_t i = 0; i < 512; ++i) {
      int64_t rounds = 0;
      for (int round = 0; round < kRounds; ++round) rounds += i < 1 + round % 512;
      ASSERT_EQ(data[i], i * rounds) << "element " << i;
    }
  }
}

TEST(ThreadPool, StressCreateUseDestroy) {
  for (int round = 0; round < 300; ++round) {
    ThreadPool pool(1 + round % 6);
    if (round % 3 == 0) continue;  // destroyed without ever running a job
    std::atomic<int64_t> sum{0};
    pool.parallel_for(0, 100, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) sum += i;
    });
    ASSERT_EQ(sum.load(), 4950);
  }
}

TEST(ThreadPool, DestroyWhileIdleAfterWork) {
  auto pool = std::make_unique<ThreadPool>(4);
  std::atomic<int> count{0};
  pool->parallel_for(0, 16, 1, [&](int64_t b, int64_t e) { count += static_cast<int>(e - b); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // workers back asleep
  pool.reset();
  EXPECT_EQ(count.load(), 16);
}

// --- Logging -------------------------------------------------------------------------

class Logging : public testing::Test {
 protected:
  void SetUp() override { saved_ = log_level(); }
  void TearDown() override { set_log_level(saved_); }
  LogLevel saved_ = LogLevel::kInfo;
};

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

TEST_F(Logging, LevelFilters) {
  set_log_level(LogLevel::kWarn);
  EXPECT_EQ(log_level(), LogLevel::kWarn);
  testing::internal::CaptureStderr();
  log_debug("debug {}", 1);
  log_info("info {}", 2);
  log_warn("warn {}", 3);
  log_error("error {}", 4);
  const auto lines = split_lines(testing::internal::GetCapturedStderr());
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_NE(lines[0].find(" W warn 3"), std::string::npos) << lines[0];
  EXPECT_NE(lines[1].find(" E error 4"), std::string::npos) << lines[1];

  set_log_level(LogLevel::kDebug);
  testing::internal::CaptureStderr();
  log_debug("a");
  log_info("b");
  EXPECT_EQ(split_lines(testing::internal::GetCapturedStderr()).size(), 2u);

  set_log_level(LogLevel::kError);
  testing::internal::CaptureStderr();
  log_warn("hidden");
  log(LogLevel::kError, "shown {}", "too");
  const auto last = split_lines(testing::internal::GetCapturedStderr());
  ASSERT_EQ(last.size(), 1u);
  EXPECT_NE(last[0].find(" E shown too"), std::string::npos);
}

TEST_F(Logging, LineFormat) {
  set_log_level(LogLevel::kDebug);
  testing::internal::CaptureStderr();
  log_debug("x={}", 7);
  log_info("hello {}", "world");
  const std::string text = testing::internal::GetCapturedStderr();
  // "2026-11-30 07:45:01.123 I message", one line per call.
  const std::regex line(R"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} [DIWE] .*)");
  const auto lines = split_lines(text);
  ASSERT_EQ(lines.size(), 2u) << text;
  EXPECT_TRUE(std::regex_match(lines[0], line)) << lines[0];
  EXPECT_TRUE(lines[0].ends_with(" D x=7")) << lines[0];
  EXPECT_TRUE(std::regex_match(lines[1], line)) << lines[1];
  EXPECT_TRUE(lines[1].ends_with(" I hello world")) << lines[1];
  EXPECT_TRUE(text.ends_with("\n"));
}

TEST_F(Logging, ConcurrentLinesStayWhole) {
  set_log_level(LogLevel::kInfo);
  ThreadPool pool(4);
  testing::internal::CaptureStderr();
  pool.parallel_for(0, 400, 1, [](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) log_info("item {} of a long enough message to interleave if it could", i);
  });
  const auto lines = split_lines(testing::internal::GetCapturedStderr());
  ASSERT_EQ(lines.size(), 400u);
  const std::regex line(R"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} I item (\d+) of a long enough message to interleave if it could)");
  std::set<int> seen;
  for (const auto& l : lines) {
    std::smatch m;
    ASSERT_TRUE(std::regex_match(l, m, line)) << l;
    seen.insert(std::stoi(m[1].str()));
  }
  EXPECT_EQ(seen.size(), 400u);
}

TEST(LoggingDeathTest, LevelFromEnvironment) {
  // In a fresh process (threadsafe style re-runs the binary), the first use
  // reads MOESERVE_LOG.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        setenv("MOESERVE_LOG", "error", 1);
        std::exit(log_level() == LogLevel::kError ? 0 : 1);
      },
      testing::ExitedWithCode(0), "");
  EXPECT_EXIT(
      {
        setenv("MOESERVE_LOG", "debug", 1);
        std::exit(log_level() == LogLevel::kDebug ? 0 : 1);
      },
      testing::ExitedWithCode(0), "");
  EXPECT_EXIT(
      {
        setenv("MOESERVE_LOG", "nonsense", 1);
        std::exit(log_level() == LogLevel::kInfo ? 0 : 1);
      },
      testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace moe
