// An instance made of several ranks (DESIGN section 3). Rank 0, the leader,
// owns the engine (scheduler, sampler, HTTP); each step it sends the step plan
// (the ForwardBatch: token ids, positions, page tables, logits rows) to every
// follower over a stream socket, then all ranks run that forward pass together,
// joined by their communicator (TP/EP collectives inside the model). The ranks
// hold the same page ids, so one scheduler drives every rank's KV cache.
//
// The plan travels as a fixed binary header and i32 arrays, validated on
// receipt. The socket also carries liveness: a follower whose leader went away
// (socket closed, even by kill -9) stops; a leader whose follower went away
// fails the step at once (the write fails) or within the communicator's
// timeout (a collective), and the engine reports it.
//
// Threads: LeaderRunner and LockstepRunner as every ModelRunner (the engine thread);
// run_follower on the follower's main thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/status.h"
#include "engine/model_runner.h"
#include "kv/kv_cache.h"
#include "kv/shm_region.h"
#include "model/qwen3_moe.h"

namespace moe::engine {

std::vector<uint8_t> encode_step_plan(const model::ForwardBatch& batch);
// Checks sizes and consistency (a corrupt plan is an error, never a crash).
Expected<model::ForwardBatch> decode_step_plan(std::span<const uint8_t> bytes);

// The shared-memory region holding rank `rank`'s KV cache in group `group`
// (created by the leader, mapped by the follower: the leader sends every
// rank's heads when it exports KV to a decode instance).
std::string kv_region_name(const std::string& group, int rank);

// A rank's runner: every forward pass, with or without hidden states, goes
// through run(). The hidden states are this rank's, which are every rank's
// (the residual stream is the same everywhere after each all-reduce), so an
// MTP drafter runs on one rank alone.
class RankRunner : public ModelRunner {
 public:
  Expected<Tensor> forward(const model::ForwardBatch& batch) final { return run(batch, {}, nullptr); }
  bool supports_hidden_states() const final { return true; }
  Expected<Tensor> forward_with_hidden(const model::ForwardBatch& batch, std::span<const int32_t> hidden_rows,
                                       Tensor& hidden) final {
    return run(batch, hidden_rows, &hidden);
  }

 protected:
  virtual Expected<Tensor> run(const model::ForwardBatch& batch, std::span<const int32_t> hidden_rows,
                               Tensor* hidden) = 0;
};

class LeaderRunner final : public RankRunner {
 public:
  // `model` is rank 0's share (its plan's rank 0); `layout` its KV cache
  // (Qwen3MoeModel::shard() heads); `follower_fds` one connected stream
  // socket per follower, owned from here on; `follower_kv` the followers' KV
  // caches (their regions, same layout), in rank order.
  LeaderRunner(const model::Qwen3MoeModel& model, ThreadPool& pool, const kv::KvCacheLayout& layout,
               std::vector<int> follower_fds, std::vector<kv::ShmRegion> follower_kv);
  ~LeaderRunner() override;  // tells the followers to stop
  LeaderRunner(const LeaderRunner&) = delete;
  LeaderRunner& operator=(const LeaderRunner&) = delete;

  int64_t vocab_size() const override { return model_.config().vocab_size; }
  // The hook runs once every rank has written the layer (disaggregated prefill).
  bool supports_layer_hook() const override { return true; }
  void set_layer_hook(std::function<void(int layer)> hook) override { hook_ = std::move(hook); }
  // Every rank's KV cache, rank order (the followers' through shared memory).
  std::vector<const kv::KvCache*> rank_caches() const;

 private:
  Expected<Tensor> run(const model::ForwardBatch& batch, std::span<const int32_t> hidden_rows,
                       Tensor* hidden) override;

  const model::Qwen3MoeModel& model_;
  ThreadPool& pool_;
  std::function<void(int)> hook_;
  kv::KvCache cache_;
  std::vector<kv::ShmRegion> follower_kv_;
  std::vector<std::unique_ptr<kv::KvCache>> follower_caches_;
  std::vector<ops::PagedKv> layers_;
  std::vector<int> fds_;
  bool failed_ = false;  // a follower is gone: every later step fails too
};

// The vote that opens every step of data-parallel attention ranks
// (LockstepRunner below, CudaRunner on GPU ranks): `sum` adds this rank's
// ballot to its peers' (every rank calls it the same number of times). A
// rank with a batch votes 1 and runs it; an idle one votes 0 and, when any
// peer voted 1, runs its share of the step with no tokens; a rank that stops
// votes "leave", after which every peer's vote fails. Any error fails every
// later vote: an instance with a rank missing cannot run its experts.
class LockstepVote {
 public:
  explicit LockstepVote(std::function<Expected<float>(float)> sum) : sum_(std::move(sum)) {}
  // Whether any rank has a batch (this one when have_batch).
  Expected<bool> vote(bool have_batch);
  void leave();
  // This rank's step failed after its vote: the peers will fail in their collectives.
  void fail() { failed_ = true; }

 private:
  std::function<Expected<float>(float)> sum_;
  bool failed_ = false;
};

// A data-parallel attention rank (decode instances, model plan dp_attention):
// its own engine, requests and KV cache, with the MoE layers exchanging
// tokens with its peers, so every rank must run every step. Each step opens
// with a LockstepVote (an all-reduce of the ballots): an idle rank
// (idle_step) runs an empty batch through the same collectives when a peer
// has a batch. When every rank is idle nobody runs anything; the engines vote
// again within a millisecond.
class LockstepRunner final : public RankRunner {
 public:
  LockstepRunner(const model::Qwen3MoeModel& model, ThreadPool& pool, const kv::KvCacheLayout& layout);
  int64_t vocab_size() const override { return model_.config().vocab_size; }
  bool steps_in_lockstep() const override { return true; }
  Status idle_step() override;
  void leave() override;
  const kv::KvCache& cache() const { return cache_; }
  int64_t num_idle_forwards() const { return num_idle_forwards_; }

 private:
  Expected<Tensor> run(const model::ForwardBatch& batch, std::span<const int32_t> hidden_rows,
                       Tensor* hidden) override;

  const model::Qwen3MoeModel& model_;
  ThreadPool& pool_;
  kv::KvCache cache_;
  std::vector<ops::PagedKv> layers_;
  LockstepVote vote_;
  int64_t num_idle_forwards_ = 0;
};

// The plan channel for any rank runner (the CPU ones here, the GPU ones in
// engine/cuda_runner.h): send_step_plan writes one plan to every follower
// (an error names the first rank whose socket is gone); send_stop tells them
// to stop and closes the sockets; receive_step_plan is a follower's next plan,
// nullopt when the leader said stop or went away.
Status send_step_plan(std::span<const int> follower_fds, const model::ForwardBatch& batch);
void send_stop(std::span<const int> follower_fds);
Expected<std::optional<model::ForwardBatch>> receive_step_plan(int plan_fd);

// Start-up over the plan sockets (no timeout: loading a checkpoint takes what
// it takes, and a rank that dies closes its socket): each follower sends one
// byte once its model is built; the leader waits for all of them.
Status signal_ready(int plan_fd);
Status wait_for_followers(std::span<const int> follower_fds);

// Runs the leader's plans on this rank until the leader says stop or goes
// away (both a clean return) or a step fails (its error).
// `kv_memory`: this rank's KV region (kv_region_name), layout's size.
Status run_follower(const model::Qwen3MoeModel& model, ThreadPool& pool, const kv::KvCacheLayout& layout,
                    void* kv_memory, int plan_fd);

}  // namespace moe::engine
