// Helpers of the comm tests: groups of ranks as threads or forked processes,
// unique group names, deterministic per-(rank, index) values, and a check
// that no shared-memory segment is left behind.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "comm/cpu/shm_communicator.h"

namespace moe::comm::testing {

// "t<pid>_<n>": unique per group, so tests never collide in /dev/shm.
inline std::string unique_name(const std::string& tag) {
  static std::atomic<int> counter{0};
  return fmt::format("{}{}_{}", tag, getpid(), counter++);
}

// /dev/shm entries whose name starts with moe_<prefix>.
inline int count_segments(const std::string& prefix) {
  int n = 0;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", error))
    if (entry.path().filename().string().rfind("moe_" + prefix, 0) == 0) ++n;
  return n;
}

inline ShmGroupOptions group(const std::string& name, int rank, int world, size_t buffer_bytes, int timeout_ms) {
  ShmGroupOptions options;
  options.name = name;
  options.rank = rank;
  options.world_size = world;
  options.buffer_bytes = buffer_bytes;
  options.timeout_ms = timeout_ms;
  return options;
}

// Runs body(comm) for every rank of a fresh group, one thread per rank.
// Failures inside body are gtest failures (gtest assertions are thread-safe).
inline void run_threads(int world, size_t buffer_bytes, const std::function<void(Communicator&)>& body,
                        int timeout_ms = 20000) {
  const std::string name = unique_name("t");
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      auto comm = open_shm_communicator(group(name, r, world, buffer_bytes, timeout_ms));
      ASSERT_TRUE(comm.has_value()) << comm.status().to_string();
      body(**comm);
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(count_segments(name), 0) << "segments of " << name << " left in /dev/shm";
}

// Runs body(comm) in `world` forked processes; body returns "" or what went
// wrong. The parent reports each child's failure.
inline void run_processes(int world, size_t buffer_bytes, const std::function<std::string(Communicator&)>& body) {
  const std::string name = unique_name("p");
  std::vector<pid_t> children;
  for (int r = 0; r < world; ++r) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      auto comm = open_shm_communicator(group(name, r, world, buffer_bytes, 20000));
      std::string error = comm.has_value() ? body(**comm) : comm.status().to_string();
      if (!error.empty()) fprintf(stderr, "rank %d: %s\n", r, error.c_str());
      comm = Status(StatusCode::kAborted, "closing");  // unmap before _exit
      _exit(error.empty() ? 0 : 1);
    }
    children.push_back(pid);
  }
  for (int r = 0; r < world; ++r) {
    int status = 0;
    ASSERT_EQ(waitpid(children[r], &status, 0), children[r]);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "rank " << r << " process failed";
  }
  EXPECT_EQ(count_segments(name), 0) << "segments of " << name << " left in /dev/shm";
}

// A deterministic, non-trivial float per (rank, index): sums of these are
// rounded, so a different summation order shows. The value itself is exact
// (an integer times 2^-20), so a compiler contracting value * scale + sum into
// an FMA cannot change the reference sum.
inline float value_of(int rank, uint64_t i) {
  uint64_t h = (i + 1) * 0x9E3779B97F4A7C15ull ^ (static_cast<uint64_t>(rank) + 1) * 0xC2B2AE3D27D4EB4Full;
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  return static_cast<float>(static_cast<int64_t>(h % 2000001) - 1000000) * 0x1p-20f;
}

// The reference all-reduce of element i: ranks 0..N-1 in order.
inline float sum_of(int world, uint64_t i) {
  float s = value_of(0, i);
  for (int r = 1; r < world; ++r) s += value_of(r, i);
  return s;
}

}  // namespace moe::comm::testing
