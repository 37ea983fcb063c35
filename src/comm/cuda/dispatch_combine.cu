// Decode DP+EP expert exchange over NVLink: one kernel each way, pushing rows
// straight into the peers' symmetric receive areas (ExpertLayout).
//
// dispatch: a warp takes kPairsPerWarp (token, slot) pairs: its first lanes
// count their pair in the destination expert's counter and take rows of the
// destination rank's pool, one system-scope atomicAdd per destination rank
// for the warp's pairs going there (over NVLink for a remote owner; the round
// trips overlap), then the warp writes the rows (hidden bf16, or hidden E4M3
// bytes and their scales; 16-byte stores) and their origins (rank, token,
// slot) and expert.
// Then every block raises its flag in every rank, and block 0 waits for all
// blocks of all ranks, so when the kernel ends every row for this rank has
// landed. Counters alternate between two parities; a dispatch zeroes the
// other parity, which no rank can touch before the next dispatch (it needs
// this rank's combine barrier first).
// Floor: the bytes leaving a rank, num_tokens * k * (N - 1) / N * hidden * 2,
// over 395 GB/s: 128 tokens x top-8 x 4096 at N = 2 is 4 MB, ~11 us, plus one
// barrier; dispatch target <= 20 us at 128 tokens.
//
// combine: one warp per received row: read its origin, write the expert
// output row into the source rank's combine area at (token * k + slot); all
// blocks meet all blocks of all ranks; then each block sums the k rows of its
// tokens, ascending slot, weighted, in f32 into out. Floor as dispatch (the
// same bytes go back) plus the local k-way sum; target <= 25 us at 128 tokens.
//
// With the expert outputs as the grouped GEMM writes them (f32, in the order
// received_groups gives the received rows), combine rounds each row to bf16
// as it sends it, so no pass over them comes between the GEMM and combine.
//
// received_groups: one block turns the last dispatch's per-expert counts into
// the grouped GEMM's offsets, tile offsets and gather index, and notes each
// pool row's GEMM row for combine (no host sync).
//
// A rank with zero tokens still launches both kernels and takes part in the
// barriers. Both kernels always run kExpertBlocks blocks. Expert ids must be
// distinct within a token (a top-k), else the receive capacity may overflow,
// which traps.
#include "comm/cuda/kernels.h"
#include "comm/cuda/sync.cuh"

namespace moe::comm::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kPairsPerWarp = 8;  // their counter atomics in flight together
constexpr int kMaxK = 8;          // combine's loads in flight per token (larger k: in rounds)
constexpr int kMaxGroupExperts = 8192;  // received_groups' per-expert counters in shared memory

__device__ int32_t* counts_of(const SymmetricView& v, const ExpertLayout& l, int r, int parity) {
  return reinterpret_cast<int32_t*>(v.base[r] + l.counts_offset()) + parity * (l.experts_per_rank + 1);
}
__device__ int4* meta_of(const SymmetricView& v, const ExpertLayout& l, int r) {
  return reinterpret_cast<int4*>(v.base[r] + l.meta_offset());
}
__device__ int32_t* order_of(const SymmetricView& v, const ExpertLayout& l) {
  return reinterpret_cast<int32_t*>(v.base[v.rank] + l.order_offset());
}
__device__ uint4* recv_row(const SymmetricView& v, const ExpertLayout& l, int r, int64_t row) {
  return reinterpret_cast<uint4*>(v.base[r] + l.recv_offset() + row * l.row_bytes());
}
__device__ float* recv_scales(const SymmetricView& v, const ExpertLayout& l, int r, int64_t row) {
  return reinterpret_cast<float*>(v.base[r] + l.scales_offset()) + row * l.scale_cols();
}
__device__ uint4* combine_row(const SymmetricView& v, const ExpertLayout& l, int r, int64_t row) {
  return reinterpret_cast<uint4*>(v.base[r] + l.combine_offset() + 2 * row * l.hidden);
}

// Raises this block's flag `seq` in every rank.
__device__ void signal_all(const SymmetricView& v, int set, uint32_t seq) {
  __syncthreads();
  if (threadIdx.x < v.world) {
    __threadfence_system();
    store_release(flag_of(v, threadIdx.x, set, blockIdx.x, v.rank), seq);
  }
}

// Waits until every block of every rank has raised `seq` in this rank.
__device__ void wait_all(const SymmetricView& v, int set, uint32_t seq) {
  for (int i = threadIdx.x; i < kExpertBlocks * v.world; i += blockDim.x)
    wait_flag(v, flag_of(v, v.rank, set, i / v.world, i % v.world), seq);
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads) dispatch_kernel(DispatchParams p) {
  const SymmetricView& v = p.sym;
  const ExpertLayout& l = p.layout;
  const uint32_t launch = launch_index(v, kSetDispatch);
  const uint32_t seq = v.counters[kSetDispatch].barrier[blockIdx.x] + 1;
  const int parity = launch & 1, lane = threadIdx.x & 31, vectors = l.row_bytes() / 16;
  if (blockIdx.x == 0)
    for (int e = threadIdx.x; e <= l.experts_per_rank; e += blockDim.x) counts_of(v, l, v.rank, parity ^ 1)[e] = 0;

  const int num_experts = l.experts_per_rank * v.world;
  const int64_t pairs = static_cast<int64_t>(p.num_tokens) * l.k;
  const int64_t warp_stride = static_cast<int64_t>(kExpertBlocks) * kWarps * kPairsPerWarp;
  for (int64_t first = (static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5)) * kPairsPerWarp; first < pairs;
       first += warp_stride) {
    const bool active = lane < kPairsPerWarp && first + lane < pairs;
    int dst = 0, local = 0;
    if (active) {
      const int e = p.expert_ids[first + lane];
      if (e < 0 || e >= num_experts) __trap();
      dst = e / l.experts_per_rank, local = e % l.experts_per_rank;
      atomicAdd_system(counts_of(v, l, dst, parity) + local, 1);
    }
    // Pool rows: one atomicAdd per destination rank for the lanes going there.
    const unsigned same = __match_any_sync(0xffffffffu, active ? dst : -1 - lane);
    const int leader = __ffs(same) - 1;
    int base = 0;
    if (active && lane == leader)
      base = atomicAdd_system(counts_of(v, l, dst, parity) + l.experts_per_rank, __popc(same));
    base = __shfl_sync(0xffffffffu, base, leader);
    const int pool_row = base + __popc(same & ((1u << lane) - 1));
    if (active && pool_row >= l.pool_rows()) __trap();
    const int n = pairs - first < kPairsPerWarp ? static_cast<int>(pairs - first) : kPairsPerWarp;
    for (int j = 0; j < n; ++j) {
      const int to_rank = __shfl_sync(0xffffffffu, dst, j);
      const int expert = __shfl_sync(0xffffffffu, local, j);
      const int64_t row = __shfl_sync(0xffffffffu, pool_row, j);
      const int t = static_cast<int>((first + j) / l.k), slot = static_cast<int>((first + j) % l.k);
      uint4* to = recv_row(v, l, to_rank, row);
      const uint4* from = reinterpret_cast<const uint4*>(static_cast<const char*>(p.x) +
                                                         static_cast<int64_t>(t) * l.row_bytes());
      for (int c = lane; c < vectors; c += 32) to[c] = from[c];
      if (l.fp8) {
        float* to_scales = recv_scales(v, l, to_rank, row);
        for (int c = lane; c < l.scale_cols(); c += 32)
          to_scales[c] = p.x_scales[int64_t{t} * l.scale_cols() + c];
      }
      if (lane == 0) meta_of(v, l, to_rank)[row] = make_int4(v.rank, t, slot, expert);
    }
  }
  signal_all(v, kSetDispatch, seq);
  if (blockIdx.x == 0) wait_all(v, kSetDispatch, seq);
  finish_launch(v, kSetDispatch, launch, seq);
}

__global__ void __launch_bounds__(kThreads) combine_kernel(CombineParams p) {
  const SymmetricView& v = p.sym;
  const ExpertLayout& l = p.layout;
  const uint32_t launch = launch_index(v, kSetCombine);
  const uint32_t seq = v.counters[kSetCombine].barrier[blockIdx.x] + 1;
  // The counters of the dispatch this combine answers (the last one).
  const int parity = (launch_index(v, kSetDispatch) - 1) & 1, lane = threadIdx.x & 31, vectors = l.hidden / 8;
  const int received = counts_of(v, l, v.rank, parity)[l.experts_per_rank];
  const int4* meta = meta_of(v, l, v.rank);
  const int32_t* order = order_of(v, l);
  for (int row = blockIdx.x * kWarps + (threadIdx.x >> 5); row < received; row += kExpertBlocks * kWarps) {
    const int4 m = meta[row];  // (source rank, token, slot, expert)
    uint4* to = combine_row(v, l, m.x, static_cast<int64_t>(m.y) * l.k + m.z);
    if (p.y != nullptr) {
      const uint4* from = reinterpret_cast<const uint4*>(p.y + int64_t{row} * l.hidden);
      for (int c = lane; c < vectors; c += 32) to[c] = from[c];
    } else {  // f32 rows in the grouped GEMM's order, 8 per 16-byte store
      const float4* from = reinterpret_cast<const float4*>(p.y_rows + int64_t{order[row]} * l.hidden);
      for (int c = lane; c < vectors; c += 32) {
        const float4 a = from[2 * c], b = from[2 * c + 1];
        to[c] = make_uint4(pack_pair(a.x, a.y), pack_pair(a.z, a.w), pack_pair(b.x, b.y), pack_pair(b.z, b.w));
      }
    }
  }
  signal_all(v, kSetCombine, seq);
  wait_all(v, kSetCombine, seq);

  for (int t = blockIdx.x; t < p.num_tokens; t += kExpertBlocks)
    for (int c = threadIdx.x; c < vectors; c += blockDim.x) {
      float acc[8] = {};
      for (int j0 = 0; j0 < l.k; j0 += kMaxK) {  // the k rows' loads in flight together, summed in slot order
        Vec8 y[kMaxK];
        float w[kMaxK];
#pragma unroll
        for (int j = 0; j < kMaxK; ++j)
          if (j0 + j < l.k) {
            w[j] = p.weights[static_cast<int64_t>(t) * l.k + j0 + j];
            y[j] = load_peer(combine_row(v, l, v.rank, static_cast<int64_t>(t) * l.k + j0 + j) + c);
          }
#pragma unroll
        for (int j = 0; j < kMaxK; ++j)
          if (j0 + j < l.k)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const float2 f = pair_of(y[j], i);
              acc[2 * i] += w[j] * f.x;
              acc[2 * i + 1] += w[j] * f.y;
            }
      }
      float4* out = reinterpret_cast<float4*>(p.out + static_cast<int64_t>(t) * l.hidden + 8 * c);
      out[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
      out[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    }
  finish_launch(v, kSetCombine, launch, seq);
}

// One block: the counts of the last dispatch, scanned (kThreads >= experts is
// not assumed: each thread scans a run of experts, then the runs' totals).
__global__ void __launch_bounds__(kThreads) received_groups_kernel(ReceivedGroupsParams p) {
  const SymmetricView& v = p.sym;
  const ExpertLayout& l = p.layout;
  const int parity = (launch_index(v, kSetDispatch) - 1) & 1, E = l.experts_per_rank;
  const int32_t* counts = counts_of(v, l, v.rank, parity);
  __shared__ int32_t rows[kThreads + 1], tiles[kThreads + 1];
  const int per_thread = (E + kThreads - 1) / kThreads, first = threadIdx.x * per_thread;
  int32_t my_rows = 0, my_tiles = 0;
  for (int e = first; e < first + per_thread && e < E; ++e) {
    my_rows += counts[e];
    my_tiles += (counts[e] + p.tile_rows - 1) / p.tile_rows;
  }
  rows[threadIdx.x + 1] = my_rows, tiles[threadIdx.x + 1] = my_tiles;
  if (threadIdx.x == 0) rows[0] = tiles[0] = 0;
  __syncthreads();
  if (threadIdx.x == 0)
    for (int i = 1; i <= kThreads; ++i) rows[i] += rows[i - 1], tiles[i] += tiles[i - 1];
  __syncthreads();
  int32_t row = rows[threadIdx.x], tile = tiles[threadIdx.x];
  for (int e = first; e < first + per_thread && e < E; ++e) {
    p.expert_offsets[e] = row, p.tile_offsets[e] = tile;
    row += counts[e];
    tile += (counts[e] + p.tile_rows - 1) / p.tile_rows;
  }
  if (threadIdx.x == 0) p.expert_offsets[E] = rows[kThreads], p.tile_offsets[E] = tiles[kThreads];
  // Each pool row's place among its expert's rows (arrival order within a
  // block's rows; any order is a valid grouping).
  extern __shared__ int32_t next[];  // [E]
  for (int e = threadIdx.x; e < E; e += kThreads) next[e] = 0;
  __syncthreads();  // the offsets (read back below by other threads) and next
  const int4* meta = meta_of(v, l, v.rank);
  int32_t* order = order_of(v, l);
  const int received = counts[E];
  for (int row = threadIdx.x; row < received; row += kThreads) {
    const int e = meta[row].w;
    const int32_t gemm_row = p.expert_offsets[e] + atomicAdd(&next[e], 1);
    p.gather[gemm_row] = row;
    order[row] = gemm_row;
  }
}

bool valid(const SymmetricView& v, const ExpertLayout& l, int num_tokens) {
  return v.world >= 1 && v.world <= kMaxRanks && l.world == v.world && l.experts_per_rank > 0 && l.k > 0 &&
         l.hidden > 0 && l.hidden % 8 == 0 && num_tokens >= 0 && num_tokens <= l.max_tokens &&
         l.total_bytes() <= kSignalBytes + v.data_bytes;
}

}  // namespace

cudaError_t dispatch(const DispatchParams& p, cudaStream_t stream) {
  if (!valid(p.sym, p.layout, p.num_tokens) ||
      (p.layout.fp8 && (p.x_scales == nullptr || p.layout.hidden % 16 != 0)))
    return cudaErrorInvalidValue;
  if (reinterpret_cast<uintptr_t>(p.x) % 16 != 0) return cudaErrorMisalignedAddress;
  dispatch_kernel<<<kExpertBlocks, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t combine(const CombineParams& p, cudaStream_t stream) {
  if (!valid(p.sym, p.layout, p.num_tokens) || (p.y == nullptr && p.y_rows == nullptr))
    return cudaErrorInvalidValue;
  if ((reinterpret_cast<uintptr_t>(p.y) | reinterpret_cast<uintptr_t>(p.y_rows) |
       reinterpret_cast<uintptr_t>(p.out)) %
          16 !=
      0)
    return cudaErrorMisalignedAddress;
  combine_kernel<<<kExpertBlocks, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t received_groups(const ReceivedGroupsParams& p, cudaStream_t stream) {
  if (!valid(p.sym, p.layout, 0) || p.tile_rows < 1 || p.layout.experts_per_rank > kMaxGroupExperts)
    return cudaErrorInvalidValue;
  received_groups_kernel<<<1, kThreads, p.layout.experts_per_rank * sizeof(int32_t), stream>>>(p);
  return cudaGetLastError();
}

}  // namespace moe::comm::cuda
