// Internal to comm/cpu: the ShmCommunicator class, whose member functions are
// split between shm_communicator.cc (all-reduce, fused norm, broadcast) and
// shm_dispatch.cc (the sparse all-to-all of dispatch/combine).
//
// Threads: one thread per rank (communicator.h).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "comm/communicator.h"
#include "comm/cpu/shm_symmetric_memory.h"
#include "core/thread_pool.h"

namespace moe::comm {

class ShmCommunicator final : public Communicator {
 public:
  explicit ShmCommunicator(std::unique_ptr<ShmSymmetricMemory> memory);

  int rank() const override { return memory_->rank(); }
  int world_size() const override { return memory_->world_size(); }

  Status all_reduce_sum(std::span<float> data) override;
  Status all_reduce_add_rms_norm(TensorView delta, TensorView residual, TensorView norm_weight, float eps,
                                 TensorView normed) override;
  Expected<Dispatched> dispatch(TensorView x, TensorView expert_ids, int num_experts) override;
  Status combine(const Dispatched& d, TensorView y, TensorView weights, TensorView out) override;
  Status broadcast_bytes(std::vector<uint8_t>& data, int root) override;
  Status barrier() override;

 private:
  // All-reduce of data[0, n), n * 4 <= buffer_bytes.
  Status one_shot(float* data, size_t n);
  Status two_shot(float* data, size_t n);
  // The fused layer boundary on rows [0, n) of the views, 2 * n rows fit.
  Status fused_one_shot(TensorView delta, TensorView residual, TensorView weight, float eps, TensorView normed);
  Status fused_two_shot(TensorView delta, TensorView residual, TensorView weight, float eps, TensorView normed);
  // dst[i] = sum over ranks r = 0..N-1 (in order) of buffer_as<float>(r)[offset + i].
  // dst may be one of the buffers.
  void sum_over_ranks(size_t offset, size_t n, float* dst) const;

  // --- sparse all-to-all (shm_dispatch.cc) ---
  // This rank's rows grouped by destination rank, with kMetaInts ints each.
  static constexpr int kMetaInts = 3;
  struct ExchangeSend {
    std::vector<int64_t> counts;      // [world]
    std::vector<int32_t> meta;        // [num_rows, kMetaInts], grouped by destination
    std::vector<const float*> rows;   // [num_rows] -> [hidden] each
    int64_t hidden = 0;
  };
  // What this rank receives: on_meta(src, meta [count, kMetaInts]) for every
  // src in order first, then on_row(src, index within src's rows, row).
  using OnMeta = std::function<void(int, std::span<const int32_t>)>;
  using OnRow = std::function<void(int, int64_t, const float*)>;
  Status exchange(const ExchangeSend& send, const OnMeta& on_meta, const std::function<void()>& after_meta,
                  const OnRow& on_row);
  Status exchange_rows(const ExchangeSend& send, const std::vector<int64_t>& recv_offset,
                       const std::vector<int64_t>& recv_count, int64_t max_rows, const OnRow& on_row);

  std::unique_ptr<ShmSymmetricMemory> memory_;
  ThreadPool pool_{1};  // add_rms_norm's pool: the rank's own thread only
};

}  // namespace moe::comm
