// The GPU ranks of one instance (docs/parallel.md, "On GPUs"): how the
// processes of `serve|prefill --tp/--ep --device cuda` and `decode --dp N --ep
// N --device cuda` meet, open their collective (the layer all-reduce, or the
// decode ranks' expert exchange), agree on their KV pages and share them. The
// serve command (serve_command.cc) builds its runner and followers over these.
//
// Threads: the serve command's main thread (the leader's watchdog has its own).
#pragma once

#include <cstdint>
#include <memory>
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
struct GpuRanks {
  std::optional<Followers> followers;  // the leader's
  std::unique_ptr<comm::TcpBootstrap> bootstrap;
  std::unique_ptr<model::SymmetricLayerComm> comm;          // --tp/--ep
  std::unique_ptr<model::SymmetricExpertExchange> experts;  // --dp
  int device = 0;
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
// with its leader; the leader waits for every rank.
Status gpu_ranks_ready(GpuRanks& g, const ParallelArgs& par);

}  // namespace moe::apps
