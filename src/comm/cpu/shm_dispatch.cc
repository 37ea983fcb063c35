// Decode DP+EP dispatch and combine on shared memory: both are one sparse
// all-to-all of rows (exchange()), pulled by the receivers.
//
// exchange(), on every rank:
//   1. write this rank's row count and hidden size into its control words,
//      and into its buffer: counts[world] (i64), then meta [num_rows, 3] (i32)
//      grouped by destination;                                        barrier
//   2. check every rank agrees (hidden) and fits (metadata); read the meta
//      destined here from each peer;                                  barrier
//   3. rows in rounds of R = buffer_bytes / (hidden * 4): each rank writes its
//      rows [kR, (k+1)R) into its buffer;                             barrier
//      each rank copies out the ones destined to it;                  barrier
// The number of rounds is max over ranks of ceil(num_rows / R), which every
// rank computes from the control words, so all ranks meet at every barrier
// (a rank with no tokens included). The GPU kernels push instead of pull
// (comm/cuda/dispatch_combine.cu); the data layout is the same.
#include <algorithm>
#include <cstring>

#include "comm/cpu/shm_communicator_impl.h"

namespace moe::comm {
namespace {

// Stable counting sort of `keys` (values in [0, num_keys)): returns the
// permutation order[i] = index of the i-th item, and offsets [num_keys + 1].
std::vector<int64_t> stable_order(const std::vector<int32_t>& keys, int num_keys, std::vector<int64_t>& offsets) {
  offsets.assign(num_keys + 1, 0);
  for (int32_t key : keys) ++offsets[key + 1];
  for (int k = 0; k < num_keys; ++k) offsets[k + 1] += offsets[k];
  std::vector<int64_t> next(offsets.begin(), offsets.end() - 1), order(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) order[next[keys[i]]++] = static_cast<int64_t>(i);
  return order;
}

}  // namespace

Status ShmCommunicator::exchange(const ExchangeSend& send, const OnMeta& on_meta,
                                 const std::function<void()>& after_meta, const OnRow& on_row) {
  const int world = world_size(), me = rank();
  CHECK(send.hidden > 0, "dispatch/combine: hidden size {}", send.hidden);
  const int64_t num_rows = static_cast<int64_t>(send.rows.size());
  const size_t meta_bytes = world * sizeof(int64_t) + send.meta.size() * sizeof(int32_t);
  memory_->set_control(0, static_cast<uint64_t>(num_rows));
  memory_->set_control(1, static_cast<uint64_t>(send.hidden));
  if (meta_bytes <= memory_->buffer_bytes()) {
    std::memcpy(memory_->local_buffer(), send.counts.data(), world * sizeof(int64_t));
    if (!send.meta.empty())
      std::memcpy(memory_->local_buffer() + world * sizeof(int64_t), send.meta.data(),
                  send.meta.size() * sizeof(int32_t));
  }
  MOE_RETURN_IF_ERROR(memory_->barrier("exchange: metadata written"));
  // Every rank reaches the same verdict from the same control words.
  int64_t max_rows = 0;
  for (int r = 0; r < world; ++r) {
    max_rows = std::max<int64_t>(max_rows, static_cast<int64_t>(memory_->control(r, 0)));
    if (memory_->control(r, 1) != static_cast<uint64_t>(send.hidden))
      return invalid_argument("dispatch/combine: rank {} has hidden size {}, rank {} has {}", r,
                              memory_->control(r, 1), me, send.hidden);
  }
  if (world * sizeof(int64_t) + static_cast<size_t>(max_rows) * kMetaInts * sizeof(int32_t) >
      memory_->buffer_bytes())
    return resource_exhausted("dispatch/combine: the metadata of {} rows does not fit the {}-byte buffer", max_rows,
                              memory_->buffer_bytes());
  const int64_t row_capacity = static_cast<int64_t>(memory_->buffer_bytes() / (send.hidden * sizeof(float)));
  if (max_rows > 0 && row_capacity == 0)
    return resource_exhausted("dispatch/combine: a row of {} floats does not fit the {}-byte buffer", send.hidden,
                              memory_->buffer_bytes());
  std::vector<int64_t> recv_offset(world), recv_count(world);
  for (int r = 0; r < world; ++r) {
    const auto* counts = memory_->buffer_as<const int64_t>(r);
    for (int d = 0; d < me; ++d) recv_offset[r] += counts[d];
    recv_count[r] = counts[me];
    const auto* meta = reinterpret_cast<const int32_t*>(memory_->buffer(r) + world * sizeof(int64_t));
    on_meta(r, {meta + recv_offset[r] * kMetaInts, static_cast<size_t>(recv_count[r] * kMetaInts)});
  }
  MOE_RETURN_IF_ERROR(memory_->barrier("exchange: metadata read"));
  after_meta();
  return exchange_rows(send, recv_offset, recv_count, max_rows, on_row);
}

Status ShmCommunicator::exchange_rows(const ExchangeSend& send, const std::vector<int64_t>& recv_offset,
                                      const std::vector<int64_t>& recv_count, int64_t max_rows, const OnRow& on_row) {
  const int world = world_size();
  const int64_t num_rows = static_cast<int64_t>(send.rows.size()), hidden = send.hidden;
  const size_t row_bytes = static_cast<size_t>(hidden) * sizeof(float);
  if (max_rows == 0) return Status::ok();
  const int64_t capacity = static_cast<int64_t>(memory_->buffer_bytes() / row_bytes);
  for (int64_t begin = 0; begin < max_rows; begin += capacity) {
    const int64_t end = begin + capacity;
    float* mine = memory_->buffer_as<float>(rank());
    for (int64_t i = begin; i < std::min(end, num_rows); ++i)
      std::memcpy(mine + (i - begin) * hidden, send.rows[i], row_bytes);
    MOE_RETURN_IF_ERROR(memory_->barrier("exchange: rows written"));
    for (int r = 0; r < world; ++r) {
      const int64_t lo = std::max(begin, recv_offset[r]), hi = std::min(end, recv_offset[r] + recv_count[r]);
      const float* theirs = memory_->buffer_as<const float>(r);
      for (int64_t i = lo; i < hi; ++i) on_row(r, i - recv_offset[r], theirs + (i - begin) * hidden);
    }
    MOE_RETURN_IF_ERROR(memory_->barrier("exchange: rows read"));
  }
  return Status::ok();
}

// Send order: this rank's (token, slot) pairs grouped by destination rank,
// ascending (token, slot) within each. Receive order: by local expert, then
// (source rank, token, slot) ascending.
Expected<Dispatched> ShmCommunicator::dispatch(TensorView x, TensorView expert_ids, int num_experts) {
  const int world = world_size(), me = rank();
  CHECK(x.rank() == 2 && x.dtype() == DType::kF32, "dispatch: x {} {} is not f32 [num_tokens, hidden]",
        dtype_name(x.dtype()), x.shape().to_string());
  CHECK(expert_ids.rank() == 2 && expert_ids.dtype() == DType::kI32 && expert_ids.dim(0) == x.dim(0),
        "dispatch: expert_ids {} {} for {} tokens", dtype_name(expert_ids.dtype()), expert_ids.shape().to_string(),
        x.dim(0));
  CHECK(num_experts > 0 && num_experts % world == 0, "dispatch: {} experts over {} ranks", num_experts, world);
  const int64_t num_tokens = x.dim(0), hidden = x.dim(1), k = expert_ids.dim(1);
  const int experts_per_rank = num_experts / world;
  const int32_t* ids = expert_ids.data_as<const int32_t>();

  std::vector<int32_t> dst(static_cast<size_t>(num_tokens * k));
  for (int64_t i = 0; i < num_tokens * k; ++i) {
    CHECK(ids[i] >= 0 && ids[i] < num_experts, "dispatch: expert id {} of {}", ids[i], num_experts);
    dst[i] = ids[i] / experts_per_rank;
  }
  std::vector<int64_t> dst_offsets;
  const std::vector<int64_t> order = stable_order(dst, world, dst_offsets);
  ExchangeSend send;
  send.hidden = hidden;
  send.counts.resize(world);
  for (int d = 0; d < world; ++d) send.counts[d] = dst_offsets[d + 1] - dst_offsets[d];
  send.meta.reserve(order.size() * kMetaInts);
  send.rows.reserve(order.size());
  for (int64_t pair : order) {
    const int64_t token = pair / k, slot = pair % k;
    send.meta.insert(send.meta.end(), {static_cast<int32_t>(token), static_cast<int32_t>(slot), ids[pair]});
    send.rows.push_back(x.data_as<const float>() + token * hidden);
  }

  // Received entries in arrival order (source rank, then its send order).
  Dispatched out;
  std::vector<int32_t> local_expert;
  std::vector<int64_t> src_base(world), position;  // position[arrival index] -> row of out.x
  auto on_meta = [&](int src, std::span<const int32_t> meta) {
    src_base[src] = static_cast<int64_t>(out.src_rank.size());
    for (size_t i = 0; i < meta.size(); i += kMetaInts) {
      const int32_t e = meta[i + 2] - me * experts_per_rank;
      CHECK(e >= 0 && e < experts_per_rank, "dispatch: rank {} sent expert {} to rank {}", src, meta[i + 2], me);
      out.src_rank.push_back(src);
      out.src_token.push_back(meta[i]);
      out.src_slot.push_back(meta[i + 1]);
      local_expert.push_back(e);
    }
  };
  auto after_meta = [&] {
    std::vector<int64_t> offsets;
    const std::vector<int64_t> by_expert = stable_order(local_expert, experts_per_rank, offsets);
    position.resize(by_expert.size());
    for (size_t row = 0; row < by_expert.size(); ++row) position[by_expert[row]] = static_cast<int64_t>(row);
    auto permute = [&](std::vector<int32_t>& v) {
      std::vector<int32_t> sorted(v.size());
      for (size_t row = 0; row < by_expert.size(); ++row) sorted[row] = v[by_expert[row]];
      v = std::move(sorted);
    };
    permute(out.src_rank);
    permute(out.src_token);
    permute(out.src_slot);
    out.expert_offsets.assign(offsets.begin(), offsets.end());
    out.x = Tensor(DType::kF32, {static_cast<int64_t>(by_expert.size()), hidden});
  };
  auto on_row = [&](int src, int64_t index, const float* row) {
    std::memcpy(out.x.data_as<float>() + position[src_base[src] + index] * hidden, row, hidden * sizeof(float));
  };
  MOE_RETURN_IF_ERROR(exchange(send, on_meta, after_meta, on_row));
  return out;
}

// Rows go back to their source rank, in (expert, source token, slot) order;
// the source stages them per (token, slot) and sums over slots ascending.
Status ShmCommunicator::combine(const Dispatched& d, TensorView y, TensorView weights, TensorView out) {
  const int world = world_size();
  CHECK(out.rank() == 2 && out.dtype() == DType::kF32, "combine: out {} is not f32 [num_tokens, hidden]",
        out.shape().to_string());
  const int64_t num_tokens = out.dim(0), hidden = out.dim(1);
  CHECK(y.dtype() == DType::kF32 && y.shape() == Shape({d.num_recv(), hidden}), "combine: y {} for {} rows of {}",
        y.shape().to_string(), d.num_recv(), hidden);
  CHECK(weights.rank() == 2 && weights.dtype() == DType::kF32 && weights.dim(0) == num_tokens,
        "combine: weights {} for {} tokens", weights.shape().to_string(), num_tokens);
  const int64_t k = weights.dim(1);

  std::vector<int64_t> src_offsets;
  const std::vector<int64_t> order = stable_order(d.src_rank, world, src_offsets);
  ExchangeSend send;
  send.hidden = hidden;
  send.counts.resize(world);
  for (int r = 0; r < world; ++r) send.counts[r] = src_offsets[r + 1] - src_offsets[r];
  for (int64_t row : order) {
    send.meta.insert(send.meta.end(), {d.src_token[row], d.src_slot[row], 0});
    send.rows.push_back(y.data_as<const float>() + row * hidden);
  }

  // staged[(token * k + slot)] <- the expert output for that pair.
  std::vector<float> staged(static_cast<size_t>(num_tokens * k * hidden));
  std::vector<std::vector<int64_t>> pair_of(world);  // [src][index] -> token * k + slot
  std::vector<uint8_t> filled(static_cast<size_t>(num_tokens * k), 0);
  auto on_meta = [&](int src, std::span<const int32_t> meta) {
    for (size_t i = 0; i < meta.size(); i += kMetaInts) {
      const int64_t token = meta[i], slot = meta[i + 1];
      CHECK(token >= 0 && token < num_tokens && slot >= 0 && slot < k, "combine: rank {} returned (token {}, slot {})",
            src, token, slot);
      const int64_t pair = token * k + slot;
      CHECK(!filled[pair], "combine: (token {}, slot {}) returned twice", token, slot);
      filled[pair] = 1;
      pair_of[src].push_back(pair);
    }
  };
  auto on_row = [&](int src, int64_t index, const float* row) {
    std::memcpy(staged.data() + pair_of[src][index] * hidden, row, hidden * sizeof(float));
  };
  MOE_RETURN_IF_ERROR(exchange(send, on_meta, [] {}, on_row));
  CHECK(std::all_of(filled.begin(), filled.end(), [](uint8_t f) { return f != 0; }),
        "combine: some (token, slot) pairs got no expert output back");

  const float* w = weights.data_as<const float>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    float* o = out.data_as<float>() + t * hidden;
    std::fill(o, o + hidden, 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      const float wj = w[t * k + j];
      const float* row = staged.data() + (t * k + j) * hidden;
      for (int64_t i = 0; i < hidden; ++i) o[i] += wj * row[i];
    }
  }
  return Status::ok();
}

}  // namespace moe::comm
