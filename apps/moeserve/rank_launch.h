// Ranks of a multi-rank instance on one host (DESIGN section 3, docs/parallel.md):
// `moeserve serve --tp N --ep N` is the leader (rank 0); it starts ranks
// 1..N-1 as copies of itself (the same binary and arguments plus hidden
// --internal-* flags), each with a stream socket for step plans
// (engine/rank_group.h) and a shared-memory communicator group (comm/cpu).
//
// With --dp (decode instances) every rank is a decode instance of its own,
// registering with the router, its MoE layers joined to its peers'
// (engine::LockstepRunner); the socket only carries start-up and liveness.
//
// TP/EP followers ignore SIGINT/SIGTERM: they stop when the leader tells them
// or goes away (their plan socket closes), so a Ctrl-C reaches the leader,
// which shuts the instance down in order.
//
// Threads: the serve command's main thread.
#pragma once

#include <sys/types.h>

#include <algorithm>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "core/status.h"

namespace moe::apps {

struct ParallelArgs {
  int tp = 1, ep = 1, dp = 1;
  // Set by the leader on the followers it starts.
  int internal_rank = 0;
  std::string internal_group;
  int internal_plan_fd = -1;
  int internal_num_pages = 0;
  int internal_bootstrap_port = 0;  // GPU ranks: the leader's TCP rendezvous on 127.0.0.1

  int world() const { return std::max({tp, ep, dp}); }
  bool follower() const { return internal_rank > 0; }
};

void add_parallel_options(CLI::App* cmd, ParallelArgs& args);

// The leader's followers: their plan sockets (handed to the LeaderRunner) and
// processes. The destructor waits for them to exit (they do once their plan
// socket closes), killing any still running after a few seconds.
class Followers {
 public:
  Followers() = default;
  Followers(Followers&& other) noexcept : fds(std::move(other.fds)), pids_(std::move(other.pids_)) {}
  Followers& operator=(Followers&&) = delete;
  ~Followers();
  std::vector<int> fds;
  const std::vector<pid_t>& pids() const { return pids_; }  // rank r + 1's process at index r

 private:
  friend Expected<Followers> spawn_followers(const ParallelArgs& args, const std::string& group, int32_t num_pages,
                                             int bootstrap_port);
  std::vector<pid_t> pids_;
};

// Starts ranks 1..world-1 of `args` in group `group` with `num_pages` KV pages
// (GPU ranks: 0, they agree on it later) and, for GPU ranks, the port of the
// leader's rendezvous (0: none).
Expected<Followers> spawn_followers(const ParallelArgs& args, const std::string& group, int32_t num_pages,
                                    int bootstrap_port = 0);

// A data-parallel follower (its own decode instance) stops like on SIGTERM
// once its leader's plan socket closes: a watcher thread calls before_stop
// (if any), then raises SIGTERM.
void stop_when_leader_exits(int plan_fd, std::function<void()> before_stop = {});

// A GPU follower exits (_exit, 2 s after the close, so that a "stop" sent
// before it is obeyed first) when its leader's plan socket closes, also in the
// middle of its start-up or of a step whose collectives would otherwise wait
// for the leader until the GPU's timeout.
void exit_when_leader_exits(int plan_fd);

// A group name unique on this host.
std::string new_group_name();

}  // namespace moe::apps
