#include "engine/cuda_runner.h"

#include <cuda_runtime.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "core/logging.h"
#include "engine/rank_group.h"
#include "engine/speculative.h"

namespace moe::engine {

Status cuda_device_status(int device) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) return unavailable("--device cuda: no usable GPU: {}", cudaGetErrorString(error));
  if (count == 0) return unavailable("--device cuda: no usable GPU: no CUDA device is visible");
  if (device < 0 || device >= count)
    return invalid_argument("--gpu {}: {} GPU(s) are visible (ordinals 0..{})", device, count, count - 1);
  return Status::ok();
}

Status use_cuda_device(int device) {
  MOE_RETURN_IF_ERROR(cuda_device_status(device));
  const cudaError_t error = cudaSetDevice(device);
  if (error != cudaSuccess) return unavailable("--gpu {}: cudaSetDevice: {}", device, cudaGetErrorString(error));
  return Status::ok();
}

kv::KvCacheLayout kv_cache_layout(const model::CudaKvPoolLayout& pool) {
  return {pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.page_size, pool.num_pages, DType::kBF16};
}

namespace {

// What describe_kv_pool() sends: fixed size, host byte order (one host).
struct KvPoolDescription {
  char magic[8] = {'m', 'o', 'e', 'k', 'v', 'i', 'p', 'c'};
  int32_t device = 0;
  int32_t num_layers = 0, num_kv_heads = 0, head_dim = 0, page_size = 0, num_pages = 0;
  uint64_t num_bytes = 0;
  cudaIpcMemHandle_t handle{};
};

}  // namespace

Expected<std::vector<uint8_t>> describe_kv_pool(const model::CudaQwen3MoeModel& model) {
  const model::CudaKvPoolLayout& pool = model.kv_pool_layout();
  KvPoolDescription d;
  d.device = model.device();
  d.num_layers = pool.num_layers, d.num_kv_heads = pool.num_kv_heads, d.head_dim = pool.head_dim;
  d.page_size = pool.page_size, d.num_pages = pool.num_pages;
  d.num_bytes = pool.num_bytes();
  const cudaError_t error = cudaIpcGetMemHandle(&d.handle, model.kv_pool());  // the pool is one cudaMalloc
  if (error != cudaSuccess)
    return unavailable("sharing the KV pool with the leader: cudaIpcGetMemHandle: {}",
                       cudaGetErrorString(error));
  const auto* bytes = reinterpret_cast<const uint8_t*>(&d);
  return std::vector<uint8_t>(bytes, bytes + sizeof d);
}

Expected<std::unique_ptr<SharedKvPool>> SharedKvPool::open(std::span<const uint8_t> description) {
  KvPoolDescription d;
  if (description.size() != sizeof d)
    return invalid_argument("a GPU rank's KV pool description has {} bytes, not {}", description.size(),
                            sizeof d);
  std::memcpy(&d, description.data(), sizeof d);
  if (std::memcmp(d.magic, KvPoolDescription{}.magic, sizeof d.magic) != 0)
    return invalid_argument("a GPU rank's KV pool description is not one");
  const model::CudaKvPoolLayout pool{d.num_layers, d.num_kv_heads, d.head_dim, d.page_size, d.num_pages};
  if (pool.num_bytes() != d.num_bytes)
    return invalid_argument(
        "a GPU rank's KV pool description is inconsistent ({} bytes for its layout, {} sent)",
        pool.num_bytes(), d.num_bytes);
  std::unique_ptr<SharedKvPool> shared(new SharedKvPool());
  // Mapped on the calling thread's device, which reaches the rank's GPU peer to peer.
  const cudaError_t error = cudaIpcOpenMemHandle(&shared->base_, d.handle, cudaIpcMemLazyEnablePeerAccess);
  if (error != cudaSuccess) {
    cudaGetLastError();
    return unavailable("mapping the KV pool of the GPU rank on GPU {}: cudaIpcOpenMemHandle: {}", d.device,
                       cudaGetErrorString(error));
  }
  shared->cache_.emplace(kv_cache_layout(pool), shared->base_, Device::cuda(d.device));
  return shared;
}

SharedKvPool::~SharedKvPool() {
  cache_.reset();
  if (base_ != nullptr) cudaIpcCloseMemHandle(base_);
}

CudaRunner::CudaRunner(std::unique_ptr<model::CudaQwen3MoeModel> model) : model_(std::move(model)) {
  const model::CudaKvPoolLayout& pool = model_->kv_pool_layout();
  cache_.emplace(kv_cache_layout(pool), model_->kv_pool(), Device::cuda(model_->device()));
  CHECK(cache_->num_bytes() == pool.num_bytes(), "the KV cache spans the CUDA model's pool");
  for (int l = 0; l < pool.num_layers; ++l) {
    const ops::PagedKv ours = model_->kv_layer(l), theirs = cache_->layer(l);
    CHECK(ours.k_pages.data() == theirs.k_pages.data() && ours.v_pages.data() == theirs.v_pages.data() &&
              ours.k_pages.shape() == theirs.k_pages.shape(),
          "layer {}: the CUDA model's KV pages sit where kv::KvCache's layout puts them", l);
  }
}

Expected<std::unique_ptr<CudaRunner>> CudaRunner::create(const model::ModelConfig& config,
                                                         const model::ModelWeights* weights, uint64_t dummy_seed,
                                                         const model::CudaModelOptions& options) {
  auto made = weights != nullptr ? model::CudaQwen3MoeModel::create(*weights, options)
                                 : model::CudaQwen3MoeModel::create_dummy(config, dummy_seed, options);
  if (!made) return made.status();
  return std::unique_ptr<CudaRunner>(new CudaRunner(std::move(made).value()));
}

namespace {
// The MTP forward of a CUDA model, its KV pool seen as a one-layer kv::KvCache.
class CudaMtpRunner final : public MtpRunner {
 public:
  explicit CudaMtpRunner(model::CudaQwen3MoeModel& model)
      : model_(model), cache_(kv_cache_layout(model.mtp_kv_pool_layout()), model.mtp_kv_pool(),
                              Device::cuda(model.device())) {}
  int64_t hidden_size() const override { return model_.config().hidden_size; }
  Expected<model::MtpOutput> forward(const model::MtpBatch& batch, TensorView hidden) override {
    return model_.forward_mtp(batch, hidden);
  }
  Expected<std::vector<std::vector<int32_t>>> forward_chain(
      const model::MtpOutput& /*first: kept on the device*/,
      std::span<const model::MtpBatch> passes) override {
    return model_.forward_mtp_chain(passes);
  }
  const kv::KvCache& cache() const override { return cache_; }
  bool keeps_target_hidden() const override { return true; }

 private:
  model::CudaQwen3MoeModel& model_;
  kv::KvCache cache_;
};
}  // namespace

std::unique_ptr<MtpRunner> CudaRunner::mtp_runner() {
  if (!model_->has_mtp()) return nullptr;
  return std::make_unique<CudaMtpRunner>(*model_);
}

CudaRunner::~CudaRunner() { send_stop(follower_fds_); }

// The followers run every plan they get, so a step this rank would refuse
// is refused before it is sent (or, in lockstep, before the vote).
Status CudaRunner::begin_step(const model::ForwardBatch& batch, std::span<const int32_t> hidden_rows) {
  if (lockstep_) {
    MOE_RETURN_IF_ERROR(model_->check_batch(batch, hidden_rows));
    return lockstep_->vote(true).status();
  }
  if (follower_fds_.empty()) return Status::ok();
  if (followers_failed_) return unavailable("a rank of this instance is gone");
  MOE_RETURN_IF_ERROR(model_->check_batch(batch, hidden_rows));
  Status sent = send_step_plan(follower_fds_, batch);
  followers_failed_ = !sent.is_ok();
  return sent;
}

Status CudaRunner::idle_step() {
  if (!lockstep_) return Status::ok();
  MOE_ASSIGN_OR_RETURN(const bool anyone, lockstep_->vote(false));
  if (!anyone) return Status::ok();
  return end_step(model_->exchange_idle());
}

void CudaRunner::leave() {
  if (lockstep_) lockstep_->leave();
}

Expected<Tensor> CudaRunner::forward(const model::ForwardBatch& batch) {
  MOE_RETURN_IF_ERROR(begin_step(batch, {}));
  return end_step(model_->forward(batch));
}

Expected<Tensor> CudaRunner::forward_with_hidden(const model::ForwardBatch& batch, std::span<const int32_t> hidden_rows,
                                                 Tensor& hidden) {
  MOE_RETURN_IF_ERROR(begin_step(batch, hidden_rows));
  return end_step(model_->forward_with_hidden(batch, hidden_rows, hidden));
}

Status run_cuda_follower(model::CudaQwen3MoeModel& model, int plan_fd) {
  // Fault injection for tools/gpu/serve_check.sh: MOESERVE_TEST_STALL_STEP=N
  // stops this rank for 60 s inside step N, after its first layer, so that a
  // kill then leaves the other ranks waiting inside the step's collectives.
  const char* stall = std::getenv("MOESERVE_TEST_STALL_STEP");
  const int64_t stall_step = stall != nullptr ? std::atoll(stall) : -1;
  for (int64_t step = 0;; ++step) {
    MOE_ASSIGN_OR_RETURN(std::optional<model::ForwardBatch> batch, receive_step_plan(plan_fd));
    if (!batch) {
      log_info("GPU rank: the leader stopped or went away after {} steps; stopping", step);
      return Status::ok();
    }
    if (step == stall_step) {
      model.set_layer_hook([step](int layer) {
        if (layer != 0) return;
        log_warn("GPU rank: stalling inside step {} for 60 s (MOESERVE_TEST_STALL_STEP)", step);
        std::this_thread::sleep_for(std::chrono::seconds(60));
      });
    }
    MOE_RETURN_IF_ERROR(model.forward_greedy(*batch).status());  // the leader samples; ids are cheap to fetch
    if (step == stall_step) model.set_layer_hook(nullptr);
  }
}

Expected<SampledStep> CudaRunner::forward_sample(const model::ForwardBatch& batch,
                                                 const StepSampling& sampling,
                                                 std::span<const int32_t> hidden_rows, Tensor& hidden) {
  if (sampling.drafts.size() != sampling.rows.size())
    return invalid_argument("{} drafts for {} sampled rows", sampling.drafts.size(), sampling.rows.size());
  MOE_RETURN_IF_ERROR(begin_step(batch, hidden_rows));
  std::vector<ops::cuda::SampleRow> rows;
  rows.reserve(sampling.rows.size());
  for (size_t r = 0; r < sampling.rows.size(); ++r) {
    const RowSampling& s = sampling.rows[r];
    rows.push_back({s.params.temperature, s.params.top_k, s.params.top_p, s.params.min_p, s.seed, s.step,
                    s.seed ^ kAcceptSalt, sampling.drafts[r]});
  }
  auto sampled = end_step(
      model_->forward_sample(batch, {rows, sampling.adjustments, sampling.fetch_rows, sampling.mask_rows, sampling.mask_words}, hidden_rows, hidden));
  if (!sampled) return sampled.status();
  return SampledStep{std::move(sampled->tokens), std::move(sampled->accepted), std::move(sampled->fetched)};
}

}  // namespace moe::engine
