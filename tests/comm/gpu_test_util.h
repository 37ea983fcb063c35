// Helpers of the comm GPU test and benchmark: ranks as threads of one
// process, one GPU each, or (fewer GPUs than ranks) as processes sharing
// them, bootstrapped over 127.0.0.1.
#pragma once

#include <cuda_runtime.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "comm/bootstrap.h"

namespace moe::comm::testing {

inline int gpu_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

// Runs body(bootstrap) for ranks 0..world-1 on threads (rank r on GPU r);
// returns the first error any rank's bootstrap met ("" when none).
inline std::string run_gpu_ranks(int world, const std::function<void(TcpBootstrap&)>& body) {
  auto listener = BootstrapListener::bind("127.0.0.1", 0);
  if (!listener) return listener.status().to_string();
  const int port = listener->port();
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      cudaSetDevice(r);
      auto b = r == 0 ? TcpBootstrap::accept(std::move(listener).value(), world, 30000)
                      : TcpBootstrap::connect("127.0.0.1", port, r, world, 30000);
      if (!b) {
        errors[r] = b.status().to_string();
        return;
      }
      body(**b);
    });
  for (auto& t : threads) t.join();
  for (const auto& e : errors)
    if (!e.empty()) return e;
  return "";
}

// Ranks as processes, for a machine with fewer GPUs than ranks (rank r on
// GPU r % gpu_count()): in one process, a device-wide synchronisation of one
// rank (cudaMalloc, cudaFree) would wait for the other rank's kernel spinning
// on its peer, for ever; processes have contexts of their own, which the
// GPU time-slices. The parent re-executes this binary once per rank with
// `args` (e.g. a gtest filter naming the running test) and MOE_TEST_RANK,
// MOE_TEST_WORLD, MOE_TEST_PORT set; each child calls rank_process_body()
// instead of starting ranks. Returns "" when every child exited 0, or the
// failing ranks' output (children past timeout_s are killed).
inline bool in_rank_process() {
  return std::getenv("MOE_TEST_RANK") != nullptr;
}

inline std::string run_rank_processes(int world, const std::vector<std::string>& args, int timeout_s = 300) {
  int port = 0;
  {
    auto probe = BootstrapListener::bind("127.0.0.1", 0);  // a free port for rank 0 to listen on
    if (!probe) return probe.status().to_string();
    port = probe->port();
  }
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) env_strings.emplace_back(*e);
  const std::string exe = "/proc/self/exe";
  std::vector<pid_t> pids(world, -1);
  std::vector<std::string> logs(world);
  std::string error;
  for (int r = 0; r < world && error.empty(); ++r) {
    logs[r] = "/tmp/moe_rank_process_" + std::to_string(getpid()) + "_" + std::to_string(r) + ".log";
    std::vector<std::string> env = env_strings;
    env.push_back("MOE_TEST_RANK=" + std::to_string(r));
    env.push_back("MOE_TEST_WORLD=" + std::to_string(world));
    env.push_back("MOE_TEST_PORT=" + std::to_string(port));
    std::vector<char*> argv{const_cast<char*>(exe.c_str())}, envp;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    posix_spawn_file_actions_t files;
    posix_spawn_file_actions_init(&files);
    posix_spawn_file_actions_addopen(&files, 1, logs[r].c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&files, 1, 2);
    if (posix_spawn(&pids[r], exe.c_str(), &files, nullptr, argv.data(), envp.data()) != 0)
      error = "could not start rank " + std::to_string(r);
    posix_spawn_file_actions_destroy(&files);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  std::vector<int> status(world, -1);
  bool killed = false;
  for (int left = world; left > 0;) {
    left = 0;
    for (int r = 0; r < world; ++r) {
      if (pids[r] <= 0 || status[r] != -1) continue;
      int s = 0;
      if (waitpid(pids[r], &s, WNOHANG) == pids[r]) {
        status[r] = WIFEXITED(s) ? WEXITSTATUS(s) : 128 + WTERMSIG(s);
      } else {
        ++left;
      }
    }
    if (left > 0 && !killed && std::chrono::steady_clock::now() > deadline) {
      for (int r = 0; r < world; ++r)
        if (pids[r] > 0 && status[r] == -1) kill(pids[r], SIGKILL);
      error += "ranks still running after " + std::to_string(timeout_s) + " s were killed; ";
      killed = true;
    }
    if (left > 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (int r = 0; r < world; ++r) {
    std::ifstream in(logs[r]);
    std::stringstream text;
    text << in.rdbuf();
    std::remove(logs[r].c_str());
    if (status[r] != 0)
      error += "rank " + std::to_string(r) + " exited " + std::to_string(status[r]) + ":\n" + text.str();
  }
  return error;
}

// In a child of run_rank_processes: bootstraps this rank (on GPU rank % gpu_count())
// and runs body; returns the bootstrap's error, "" when none.
inline std::string rank_process_body(const std::function<void(TcpBootstrap&)>& body) {
  const int rank = std::atoi(std::getenv("MOE_TEST_RANK"));
  const int world = std::atoi(std::getenv("MOE_TEST_WORLD"));
  const int port = std::atoi(std::getenv("MOE_TEST_PORT"));
  cudaSetDevice(rank % std::max(1, gpu_count()));
  auto b = [&]() -> Expected<std::unique_ptr<TcpBootstrap>> {
    if (rank != 0) return TcpBootstrap::connect("127.0.0.1", port, rank, world, 60000);
    auto listener = BootstrapListener::bind("127.0.0.1", port);
    if (!listener) return listener.status();
    return TcpBootstrap::accept(std::move(listener).value(), world, 60000);
  }();
  if (!b) return b.status().to_string();
  body(**b);
  return "";
}

}  // namespace moe::comm::testing
