// The GPU ranks of one instance (docs/parallel.md, "On GPUs"): how the
// processes of `serve|prefill --tp/--ep --device cuda` and `decode --dp N --ep
// N --device cuda` meet, open their collective (the layer all-reduce, or the
// decode ranks' expert exchange), agree on their KV pages and share them. The
// serve command (serve_command.cc) builds its runner and followers over these.
//
// Threads: the serve command's main thread (the leader's watchdog has its own).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "apps/moeserve/rank_launch.h"
#include "apps/moeserve/serve_command.h"
#include "comm/bootstrap.h"
#include "core/status.h"
#include "engine/cuda_runner.h"
#include "model/config.h"
#include "model/cuda/symmetric_expert_exchange.h"
#include "model/cuda/symmetric_layer_comm.h"

namespace moe::apps {

// GPU ranks of a --tp/--ep instance (docs/parallel.md, "On GPUs"): one process
// per GPU, rank r on GPU --gpu + r (or --gpus[r]). They meet over TCP on the loopback (the
// leader listens on a free port that its followers get as a flag), open the
// symmetric memory of their layer collective, load their weights, and create
// their models together (the warm-up pass runs the collectives); then they
// agree on the KV page count (the smallest, so every page id exists on every
// rank) and the followers run the leader's step plans.
//
// Data-parallel ranks (--dp, decode instances) meet the same way, but each is
// a decode instance of its own; they open the expert exchange instead of the
// layer collective, and their engines step together, voting over the bootstrap.
// Ends the waits of a rank's collective kernels in flight (the collective's
// abort), from any thread, until disarmed: a watcher thread that fires after
// the collective is gone does nothing.
class CollectiveAbandon {
 public:
  explicit CollectiveAbandon(std::function<void()> abort) : abort_(std::move(abort)) {}
  void fire() {
    std::lock_guard lock(mutex_);
    if (abort_) abort_();
  }
  void disarm() {
    std::lock_guard lock(mutex_);
    abort_ = nullptr;
  }

 private:
  std::mutex mutex_;
  std::function<void()> abort_;
};

// Holds a CollectiveAbandon and disarms it when it goes (before the collective does).
struct AbandonGuard {
  std::shared_ptr<CollectiveAbandon> handle;
  AbandonGuard() = default;
  explicit AbandonGuard(std::shared_ptr<CollectiveAbandon> h) : handle(std::move(h)) {}
  AbandonGuard(AbandonGuard&&) noexcept = default;
  AbandonGuard& operator=(AbandonGuard&&) noexcept = default;
  ~AbandonGuard() {
    if (handle) handle->disarm();
  }
};

struct GpuRanks {
  std::optional<Followers> followers;  // the leader's
  std::unique_ptr<comm::TcpBootstrap> bootstrap;
  std::unique_ptr<model::SymmetricLayerComm> comm;          // --tp/--ep
  std::unique_ptr<model::SymmetricExpertExchange> experts;  // --dp
  int device = 0;
  AbandonGuard abandon;   // the collective's abort; disarmed before the collective goes
  std::jthread watchdog;  // the leader's (watch_followers); declared last, so it stops first
};

// Every rank of the instance calls it (rank r on its GPU: run_serve has set
// args.device.gpu). The leader starts ranks 1.. and watches them; every rank
// opens the layer collective, or with --dp the expert exchange sized for
// max_tokens per rank (fp8_experts: FP8 rows, for fp8-block experts).
Expected<GpuRanks> meet_gpu_ranks(const ServeArgs& args, int max_tokens, const model::ModelConfig& config,
                                  bool fp8_experts = false);

// Every rank calls it once its model exists: the page count all can hold.
Expected<int32_t> agree_on_pages(comm::TcpBootstrap& bootstrap, int32_t mine);

// A prefill instance with heads split over GPU ranks sends every rank's KV
// pages, so the leader maps the others' pools (one host).
bool sends_rank_kv(const ServeArgs& args);

// Every rank calls it after agree_on_pages: the other ranks' KV pools, mapped
// on the leader (the followers drop theirs: only the leader sends).
Expected<std::vector<std::unique_ptr<engine::SharedKvPool>>> share_kv_pools(
    comm::TcpBootstrap& bootstrap, const model::CudaQwen3MoeModel& model);

// Data-parallel GPU ranks, each model built: a follower says so and goes
// with its leader (ending its exchange's waits first, so a step in flight
// fails at once rather than at the kernels' ~10 s timeout); the leader waits
// for every rank.
Status gpu_ranks_ready(GpuRanks& g, const ParallelArgs& par);

}  // namespace moe::apps
