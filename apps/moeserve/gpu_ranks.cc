#include "apps/moeserve/gpu_ranks.h"

#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>

#include "apps/moeserve/device_options.h"
#include "core/logging.h"

namespace moe::apps {

namespace {

// The leader's watch over its followers, every 20 ms: one that exits ends the
// waits of the collectives in flight (`abort`, the symmetric memory's), so a step
// that needed it fails in milliseconds instead of trapping after ~10 s; the
// steps after fail at their plan's send. Exit status 0 is a follower told to
// stop (shutdown); anything else is logged as an error.
void watch_followers(const std::stop_token& stop, const std::vector<pid_t>& pids,
                     const std::function<void()>& abort) {
  while (!stop.stop_requested()) {
    for (size_t i = 0; i < pids.size(); ++i) {
      siginfo_t info{};
      if (::waitid(P_PID, pids[i], &info, WEXITED | WNOHANG | WNOWAIT) != 0 || info.si_pid != pids[i])
        continue;
      abort();
      if (info.si_code == CLD_EXITED && info.si_status == 0) {
        log_info("GPU rank {} (pid {}) exited", i + 1, pids[i]);
      } else {
        log_error("GPU rank {} (pid {}) {} {}: this instance's collectives are abandoned, requests fail",
                  i + 1, pids[i], info.si_code == CLD_EXITED ? "exited with status" : "was killed by signal",
                  info.si_status);
      }
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

constexpr int kGpuRankTimeoutMs = 600000;  // a rank loading a large checkpoint

}  // namespace

Expected<GpuRanks> meet_gpu_ranks(const ServeArgs& args, int max_tokens, const model::ModelConfig& config,
                                  bool fp8_experts) {
  const ParallelArgs& p = args.parallel;
  GpuRanks g;
  g.device = args.device.gpu;  // rank r's: run_serve has added r
  MOE_RETURN_IF_ERROR(engine::use_cuda_device(g.device));
  if (p.follower()) {
    MOE_ASSIGN_OR_RETURN(g.bootstrap,
                         comm::TcpBootstrap::connect("127.0.0.1", p.internal_bootstrap_port, p.internal_rank,
                                                     p.world(), kGpuRankTimeoutMs));
  } else {
    for (int rank = 1; rank < p.world(); ++rank) {
      MOE_ASSIGN_OR_RETURN(const int gpu, rank_gpu(args.device, rank, p.world()));
      if (Status usable = engine::cuda_device_status(gpu); !usable)
        return invalid_argument("GPU rank {} of {} needs GPU {} (--gpu/--gpus): {}", rank, p.world(), gpu,
                                usable.message());
    }
    if (gpus_repeat(args.device))
      log_warn("GPU ranks share GPUs (--gpus {}): their kernels time-slice, which only tests should do",
               fmt::join(args.device.gpus, ","));
    MOE_ASSIGN_OR_RETURN(auto listener, comm::BootstrapListener::bind("127.0.0.1", 0));
    const int port = listener.port();
    MOE_ASSIGN_OR_RETURN(auto started, spawn_followers(p, new_group_name(), 0, port));
    g.followers.emplace(std::move(started));
    MOE_ASSIGN_OR_RETURN(g.bootstrap,
                         comm::TcpBootstrap::accept(std::move(listener), p.world(), kGpuRankTimeoutMs));
  }
  const int hidden = static_cast<int>(config.hidden_size);
  std::function<void()> abort;
  if (p.dp > 1) {
    MOE_ASSIGN_OR_RETURN(g.experts, model::SymmetricExpertExchange::create(
                                        *g.bootstrap, g.device, config.num_experts,
                                        config.num_experts_per_tok, max_tokens, hidden, fp8_experts));
    log_info("GPU rank {} of {} on GPU {}: expert exchange ready ({:.1f} MB)", p.internal_rank, p.world(),
             g.device, static_cast<double>(g.experts->allocation_bytes()) / 1e6);
    abort = [experts = g.experts.get()] { experts->abort(); };
  } else {
    MOE_ASSIGN_OR_RETURN(g.comm,
                         model::SymmetricLayerComm::create(*g.bootstrap, g.device, max_tokens, hidden));
    log_info("GPU rank {} of {} on GPU {}: layer collective ready", p.internal_rank, p.world(), g.device);
    abort = [comm = g.comm.get()] { comm->abort(); };
  }
  g.abandon = AbandonGuard(std::make_shared<CollectiveAbandon>(abort));
  if (g.followers) {
    g.watchdog = std::jthread([pids = g.followers->pids(), abort](const std::stop_token& stop) {
      watch_followers(stop, pids, abort);
    });
  }
  return g;
}

Expected<int32_t> agree_on_pages(comm::TcpBootstrap& bootstrap, int32_t mine) {
  const auto* bytes = reinterpret_cast<const uint8_t*>(&mine);
  MOE_ASSIGN_OR_RETURN(auto all, bootstrap.all_gather(std::span<const uint8_t>(bytes, sizeof mine)));
  int32_t pages = mine;
  for (const auto& blob : all) {
    if (blob.size() != sizeof(int32_t))
      return internal_error("a rank sent {} bytes for its page count", blob.size());
    int32_t theirs = 0;
    std::memcpy(&theirs, blob.data(), sizeof theirs);
    pages = std::min(pages, theirs);
  }
  return pages;
}

bool sends_rank_kv(const ServeArgs& args) {
  return args.role == "prefill" && args.parallel.tp > 1;
}

Expected<std::vector<std::unique_ptr<engine::SharedKvPool>>> share_kv_pools(
    comm::TcpBootstrap& bootstrap, const model::CudaQwen3MoeModel& model) {
  MOE_ASSIGN_OR_RETURN(const std::vector<uint8_t> mine, engine::describe_kv_pool(model));
  MOE_ASSIGN_OR_RETURN(auto all, bootstrap.all_gather(mine));
  std::vector<std::unique_ptr<engine::SharedKvPool>> pools;
  if (bootstrap.rank() != 0) return pools;
  for (size_t rank = 1; rank < all.size(); ++rank) {
    auto pool = engine::SharedKvPool::open(all[rank]);
    if (!pool) return pool.status().with_context(fmt::format("the KV pool of GPU rank {}", rank));
    pools.push_back(std::move(pool).value());
  }
  return pools;
}

Status gpu_ranks_ready(GpuRanks& g, const ParallelArgs& par) {
  if (par.follower()) {
    MOE_RETURN_IF_ERROR(engine::signal_ready(par.internal_plan_fd));
    stop_when_leader_exits(par.internal_plan_fd, [abandon = g.abandon.handle] { abandon->fire(); });
    return Status::ok();
  }
  MOE_RETURN_IF_ERROR(engine::wait_for_followers(g.followers->fds));
  log_info("{} data-parallel GPU ranks ready (ep {}), each a decode instance of its own", par.world(),
           par.ep);
  return Status::ok();
}

}  // namespace moe::apps
