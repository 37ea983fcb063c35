// The CPU communicator's all-reduces, fused layer boundary, broadcast and
// barrier (see shm_communicator.h); dispatch/combine are in shm_dispatch.cc.
//
// Every collective ends with a barrier: after it no peer reads this rank's
// buffer any more, so the next collective may overwrite it. (The GPU kernels
// save that barrier by alternating two buffers; on the CPU the barrier costs
// well under the copy it protects.)
#include "comm/cpu/shm_communicator.h"

#include <algorithm>
#include <cstring>

#include "comm/cpu/shm_communicator_impl.h"
#include "ops/norm.h"

namespace moe::comm {
namespace {

constexpr size_t kSumBlock = 1024;  // floats summed in a stack block, so dst may alias an input

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// [begin, end) of part `i` when n items are split in `parts` pieces of
// round_up(ceil(n / parts), align) items (the last ones may be short or empty).
std::pair<size_t, size_t> part_range(size_t n, int parts, int i, size_t align) {
  const size_t each = round_up((n + parts - 1) / parts, align);
  const size_t begin = std::min(n, each * i);
  return {begin, std::min(n, begin + each)};
}

void check_rows(TensorView t, const char* what, const Shape& shape) {
  CHECK(t.dtype() == DType::kF32 && t.shape() == shape && t.device() == Device::cpu(),
        "all_reduce_add_rms_norm: {} is {} {}, expected f32 {}", what, dtype_name(t.dtype()), t.shape().to_string(),
        shape.to_string());
}

}  // namespace

Expected<std::unique_ptr<Communicator>> open_shm_communicator(const ShmGroupOptions& options) {
  MOE_ASSIGN_OR_RETURN(auto memory, ShmSymmetricMemory::open(options.name, options.rank, options.world_size,
                                                             options.buffer_bytes, options.timeout_ms));
  return std::unique_ptr<Communicator>(new ShmCommunicator(std::move(memory)));
}

ShmCommunicator::ShmCommunicator(std::unique_ptr<ShmSymmetricMemory> memory) : memory_(std::move(memory)) {}

void ShmCommunicator::sum_over_ranks(size_t offset, size_t n, float* dst) const {
  const int world = world_size();
  alignas(64) float block[kSumBlock];
  for (size_t begin = 0; begin < n; begin += kSumBlock) {
    const size_t len = std::min(kSumBlock, n - begin);
    const float* first = memory_->buffer_as<float>(0) + offset + begin;
    std::copy(first, first + len, block);
    for (int r = 1; r < world; ++r) {
      const float* src = memory_->buffer_as<float>(r) + offset + begin;
      for (size_t i = 0; i < len; ++i) block[i] += src[i];
    }
    std::copy(block, block + len, dst + begin);
  }
}

Status ShmCommunicator::all_reduce_sum(std::span<float> data) {
  if (world_size() == 1) return Status::ok();
  const size_t capacity = memory_->buffer_bytes() / sizeof(float);
  const bool two_shot = data.size_bytes() >= kShmTwoShotMinBytes;
  for (size_t begin = 0; begin < data.size(); begin += capacity) {
    const size_t n = std::min(capacity, data.size() - begin);
    MOE_RETURN_IF_ERROR(two_shot ? this->two_shot(data.data() + begin, n) : one_shot(data.data() + begin, n));
  }
  // An empty message still meets the others (every rank calls every collective).
  if (data.empty()) return memory_->barrier("all_reduce_sum (empty)");
  return Status::ok();
}

// One-shot: every rank copies its input into its buffer, then reads all N
// buffers and sums them. Per rank: n writes, N * n reads; two barriers.
Status ShmCommunicator::one_shot(float* data, size_t n) {
  std::memcpy(memory_->local_buffer(), data, n * sizeof(float));
  MOE_RETURN_IF_ERROR(memory_->barrier("all_reduce one-shot: inputs written"));
  sum_over_ranks(0, n, data);
  return memory_->barrier("all_reduce one-shot: sums read");
}

// Two-shot: rank r sums part r of all buffers into part r of its own buffer
// (reduce-scatter), then every rank copies part p from rank p (all-gather).
// Per rank: 2n reads, ~2n writes; three barriers.
Status ShmCommunicator::two_shot(float* data, size_t n) {
  const int world = world_size();
  std::memcpy(memory_->local_buffer(), data, n * sizeof(float));
  MOE_RETURN_IF_ERROR(memory_->barrier("all_reduce two-shot: inputs written"));
  const auto [begin, end] = part_range(n, world, rank(), 16);
  sum_over_ranks(begin, end - begin, memory_->buffer_as<float>(rank()) + begin);
  MOE_RETURN_IF_ERROR(memory_->barrier("all_reduce two-shot: reduce-scatter"));
  for (int r = 0; r < world; ++r) {
    const auto [b, e] = part_range(n, world, r, 16);
    std::memcpy(data + b, memory_->buffer_as<float>(r) + b, (e - b) * sizeof(float));
  }
  return memory_->barrier("all_reduce two-shot: all-gather");
}

Status ShmCommunicator::all_reduce_add_rms_norm(TensorView delta, TensorView residual, TensorView norm_weight,
                                                float eps, TensorView normed) {
  CHECK(delta.rank() == 2, "all_reduce_add_rms_norm: delta {} is not [n, hidden]", delta.shape().to_string());
  const int64_t num_rows = delta.dim(0), hidden = delta.dim(1);
  check_rows(delta, "delta", delta.shape());
  check_rows(residual, "residual", delta.shape());
  check_rows(normed, "normed", delta.shape());
  CHECK(norm_weight.rank() == 1 && norm_weight.dim(0) == hidden &&
            (norm_weight.dtype() == DType::kF32 || norm_weight.dtype() == DType::kBF16),
        "all_reduce_add_rms_norm: norm_weight {} {} for hidden {}", dtype_name(norm_weight.dtype()),
        norm_weight.shape().to_string(), hidden);
  if (world_size() == 1) {
    ops::cpu::add_rms_norm(pool_, residual, delta, norm_weight, eps, normed);
    return Status::ok();
  }
  // Chunks of rows that fit twice (the two-shot gathers residual and normed rows).
  const size_t row_bytes = static_cast<size_t>(hidden) * sizeof(float);
  const int64_t chunk_rows = row_bytes == 0 ? num_rows : static_cast<int64_t>(memory_->buffer_bytes() / (2 * row_bytes));
  if (num_rows > 0 && chunk_rows == 0)
    return invalid_argument("all_reduce_add_rms_norm: a row of {} floats does not fit twice in the {}-byte buffer",
                            hidden, memory_->buffer_bytes());
  const bool two_shot = delta.num_bytes() >= kShmTwoShotMinBytes;
  for (int64_t begin = 0; begin < num_rows; begin += chunk_rows) {
    const int64_t end = std::min(num_rows, begin + chunk_rows);
    const TensorView d = delta.rows(begin, end), res = residual.rows(begin, end), out = normed.rows(begin, end);
    MOE_RETURN_IF_ERROR(two_shot ? fused_two_shot(d, res, norm_weight, eps, out)
                                 : fused_one_shot(d, res, norm_weight, eps, out));
  }
  if (num_rows == 0) return memory_->barrier("all_reduce_add_rms_norm (no rows)");
  return Status::ok();
}

// One-shot fused: the one-shot all-reduce into delta, then add + norm of every
// row locally (each rank does all rows; they are identical everywhere).
Status ShmCommunicator::fused_one_shot(TensorView delta, TensorView residual, TensorView weight, float eps,
                                       TensorView normed) {
  std::memcpy(memory_->local_buffer(), delta.data(), delta.num_bytes());
  MOE_RETURN_IF_ERROR(memory_->barrier("fused one-shot: inputs written"));
  sum_over_ranks(0, static_cast<size_t>(delta.num_elements()), delta.data_as<float>());
  MOE_RETURN_IF_ERROR(memory_->barrier("fused one-shot: sums read"));
  ops::cpu::add_rms_norm(pool_, residual, delta, weight, eps, normed);
  return Status::ok();
}

// Two-shot fused, split by rows: rank r reduces its rows, adds them to the
// residual and normalises them, and publishes the new residual rows over its
// delta copy and the normed rows in the buffer's second half; then every rank
// gathers both from their owners.
//   buffer: [0, n*hidden) delta copy -> residual rows; [n*hidden, 2*n*hidden) normed rows
Status ShmCommunicator::fused_two_shot(TensorView delta, TensorView residual, TensorView weight, float eps,
                                       TensorView normed) {
  const int world = world_size();
  const size_t n = static_cast<size_t>(delta.dim(0)), hidden = static_cast<size_t>(delta.dim(1));
  std::memcpy(memory_->local_buffer(), delta.data(), delta.num_bytes());
  MOE_RETURN_IF_ERROR(memory_->barrier("fused two-shot: inputs written"));
  const auto [row_begin, row_end] = part_range(n, world, rank(), 1);
  if (row_end > row_begin) {
    const auto rb = static_cast<int64_t>(row_begin), re = static_cast<int64_t>(row_end);
    sum_over_ranks(row_begin * hidden, (row_end - row_begin) * hidden, delta.data_as<float>() + row_begin * hidden);
    ops::cpu::add_rms_norm(pool_, residual.rows(rb, re), delta.rows(rb, re), weight, eps, normed.rows(rb, re));
    float* mine = memory_->buffer_as<float>(rank());
    const size_t bytes = (row_end - row_begin) * hidden * sizeof(float);
    std::memcpy(mine + row_begin * hidden, residual.data_as<float>() + row_begin * hidden, bytes);
    std::memcpy(mine + (n + row_begin) * hidden, normed.data_as<float>() + row_begin * hidden, bytes);
  }
  MOE_RETURN_IF_ERROR(memory_->barrier("fused two-shot: rows reduced"));
  for (int r = 0; r < world; ++r) {
    if (r == rank()) continue;
    const auto [b, e] = part_range(n, world, r, 1);
    const float* theirs = memory_->buffer_as<float>(r);
    const size_t bytes = (e - b) * hidden * sizeof(float);
    std::memcpy(residual.data_as<float>() + b * hidden, theirs + b * hidden, bytes);
    std::memcpy(normed.data_as<float>() + b * hidden, theirs + (n + b) * hidden, bytes);
  }
  return memory_->barrier("fused two-shot: rows gathered");
}

// The root publishes the size in its control word and the bytes in chunks of
// its buffer; every other rank copies each chunk between two barriers.
Status ShmCommunicator::broadcast_bytes(std::vector<uint8_t>& data, int root) {
  CHECK(root >= 0 && root < world_size(), "broadcast_bytes: root {} of {} ranks", root, world_size());
  if (world_size() == 1) return Status::ok();
  const bool is_root = rank() == root;
  const size_t capacity = memory_->buffer_bytes();
  if (is_root) memory_->set_control(0, data.size());
  size_t size = is_root ? data.size() : 0;
  for (size_t offset = 0;; offset += capacity) {
    if (is_root && offset < size) std::memcpy(memory_->local_buffer(), data.data() + offset, std::min(capacity, size - offset));
    MOE_RETURN_IF_ERROR(memory_->barrier("broadcast_bytes: chunk written"));
    if (offset == 0 && !is_root) {
      size = memory_->control(root, 0);
      data.resize(size);
    }
    if (!is_root && offset < size)
      std::memcpy(data.data() + offset, memory_->buffer(root), std::min(capacity, size - offset));
    MOE_RETURN_IF_ERROR(memory_->barrier("broadcast_bytes: chunk read"));
    if (offset + capacity >= size) break;
  }
  return Status::ok();
}

Status ShmCommunicator::barrier() { return memory_->barrier("barrier"); }

}  // namespace moe::comm
