// CUDA kernels of the communication layer: all-reduce (one-shot, two-shot,
// NVLS multicast), the fused all-reduce + residual add + RMSNorm of the layer
// boundary, and the decode DP+EP dispatch/combine. Each works on symmetric
// memory (symmetric_memory.h): the same-sized allocation on every rank, every
// rank's mapped here; the CPU twins in comm/cpu are their reference.
//
// Launchers take raw device pointers, a params struct (layouts as shape
// comments) and a stream, and return cudaError_t. No kernel synchronises with
// the host: every rank of the group launches the same kernels with the same
// sizes in the same order, and ranks meet through sequence-numbered flags in
// symmetric memory whose counters live on the device, so the launches can be
// captured in a CUDA graph and replayed.
//
// Synchronisation (all kernels): block b of rank r raises flag [set][b][r] in
// every rank's signal area to its next sequence number (st.release.sys) and
// waits until flags [set][b][p] of its own area reach it (ld.acquire.sys).
// Counters never reset, so consecutive launches cannot race. The data area is
// split in two halves used by alternate launches of a signal set: the barrier
// of launch L+1 proves every peer finished launch L, so launch L+2 may
// overwrite what L used. A wait longer than timeout_cycles traps (the launch
// fails with an error instead of hanging on a rank that never came).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace moe::comm::cuda {

using bf16 = __nv_bfloat16;

inline constexpr int kMaxRanks = 8;
inline constexpr int kMaxBlocks = 64;
inline constexpr int kNumSignalSets = 3;
inline constexpr int kSetAllReduce = 0, kSetDispatch = 1, kSetCombine = 2;
// The signal area at the start of every symmetric allocation:
// uint32 [kNumSignalSets][kMaxBlocks][kMaxRanks].
inline constexpr size_t kSignalBytes = 64 << 10;
static_assert(kNumSignalSets * kMaxBlocks * kMaxRanks * 4 <= kSignalBytes);

// This rank's counters for one signal set, in its own device memory (zeroed at setup).
struct DeviceCounters {
  uint32_t barrier[kMaxBlocks];  // the last sequence number block b raised
  uint32_t launch;               // launches of this set so far (its parity picks the data half)
  uint32_t done;                 // blocks finished in the current launch
};

// A symmetric allocation as one rank sees it.
struct SymmetricView {
  char* base[kMaxRanks];      // rank r's allocation, mapped in this process
  DeviceCounters* counters;   // [kNumSignalSets], this rank's
  size_t data_bytes;          // bytes after the signal area
  int rank, world;
  unsigned long long timeout_cycles;  // 0: wait forever
  // A word of mapped host memory (null: none): once nonzero, a wait that has
  // lasted kAbortCheckCycles gives up (a rank is gone; the result is garbage
  // and the host, which set it, fails the step).
  const volatile uint32_t* abort = nullptr;
};

// --- all-reduce ---------------------------------------------------------------
// output = sum over ranks 0..N-1 (in that order, f32 accumulation, one bf16
// rounding) of every rank's input. n * 2 bytes must fit half the data area;
// input and output 16-byte aligned (output may alias input).
struct AllReduceParams {
  SymmetricView sym;
  const bf16* input;  // [n]
  bf16* output;       // [n]
  int64_t n;
};
cudaError_t all_reduce_one_shot(const AllReduceParams& p, cudaStream_t stream);
cudaError_t all_reduce_two_shot(const AllReduceParams& p, cudaStream_t stream);
// Largest n the kernels take for a view (elements per call; callers chunk).
int64_t all_reduce_max_elements(const SymmetricView& sym);

// The default algorithm choice (--all-reduce auto): one-shot below
// two_shot_min_bytes(world), two-shot from there, in chunks of
// all_reduce_max_elements. At 2 ranks both move the same bytes over NVLink and
// the one-shot saves a barrier, so it runs up to 8 MB; from 4 ranks the
// one-shot's (N - 1)-fold reads lose above ~256 KB. Initial values from that
// arithmetic, to be replaced by the table tools/gpu/comm_check.sh measures.
size_t two_shot_min_bytes(int world);
cudaError_t all_reduce_auto(const AllReduceParams& p, cudaStream_t stream);

// NVLS: the reduction by the NVSwitch (multimem.ld_reduce) and the result
// multicast to every rank (multimem.st). multicast points at the multicast
// mapping of the same symmetric allocation (nvls.h). Sum order is the
// switch's, but one rank computes each element, so all ranks agree.
struct NvlsAllReduceParams {
  AllReduceParams base;
  char* multicast;  // the multicast address of the allocation's start
};
cudaError_t all_reduce_nvls(const NvlsAllReduceParams& p, cudaStream_t stream);

// --- the layer boundary, fused ------------------------------------------------
// residual += sum over ranks of delta; out = bf16(rms_norm(residual) * weight).
// residual is the replicated f32 stream (identical on every rank before and
// after). two_shot: rows split over ranks, each rank reduces and normalises
// its rows and the results are gathered; else every rank does every row.
// Needs hidden % 8 == 0, hidden <= 12288; bytes: one-shot n*hidden*2, two-shot
// n*hidden*8, within half the data area.
struct FusedAllReduceNormParams {
  SymmetricView sym;
  const bf16* delta;   // [num_tokens, hidden] this rank's partial sum
  float* residual;     // [num_tokens, hidden]
  const bf16* weight;  // [hidden]
  bf16* out;           // [num_tokens, hidden]
  int num_tokens, hidden;
  float eps;
  bool two_shot;
};
cudaError_t fused_all_reduce_add_rms_norm(const FusedAllReduceNormParams& p, cudaStream_t stream);

// --- decode DP+EP dispatch / combine -----------------------------------------
// The expert exchange's own symmetric allocation, laid out as ExpertLayout
// says on every rank. Received rows share one pool per rank, in arrival order:
// a token sends a rank at most min(k, experts_per_rank) rows (its experts are
// distinct), so world * max_tokens * that many rows always fit, whatever the
// routing (a region per expert would need world * max_tokens rows for each:
// experts_per_rank / k times more, 8x at 128 experts, top-8, 2 ranks). The
// rows travel in bf16, or (fp8) as E4M3 rows with their f32 scales per 128
// columns (fp8-block activations, ops/quant.h): half the bytes, and what the
// FP8 expert GEMMs read.
struct ExpertLayout {
  int world, experts_per_rank, max_tokens, k, hidden;
  bool fp8 = false;
  // Rows a rank can receive in one dispatch.
  __host__ __device__ int64_t pool_rows() const {
    return static_cast<int64_t>(world) * max_tokens * (k < experts_per_rank ? k : experts_per_rank);
  }
  __host__ __device__ static size_t align(size_t bytes) { return (bytes + 255) / 256 * 256; }
  __host__ __device__ int row_bytes() const { return fp8 ? hidden : 2 * hidden; }
  __host__ __device__ int scale_cols() const { return fp8 ? (hidden + 127) / 128 : 0; }
  // int32 [2 parities][experts_per_rank + 1]: rows received per local expert,
  // then in all (the pool's next free row)
  __host__ __device__ size_t counts_offset() const { return kSignalBytes; }
  // int4 [pool_rows]: (source rank, token, slot, local expert) of each received row
  __host__ __device__ size_t meta_offset() const { return align(counts_offset() + 8 * (experts_per_rank + 1)); }
  // int32 [pool_rows]: each received row's place in received_groups' order (its GEMM row)
  __host__ __device__ size_t order_offset() const { return align(meta_offset() + 16 * pool_rows()); }
  // [pool_rows][row_bytes()]: the rows
  __host__ __device__ size_t recv_offset() const { return align(order_offset() + 4 * pool_rows()); }
  // f32 [pool_rows][scale_cols()]: the rows' scales (fp8)
  __host__ __device__ size_t scales_offset() const {
    return align(recv_offset() + static_cast<size_t>(row_bytes()) * pool_rows());
  }
  // bf16 [max_tokens * k][hidden]: expert outputs coming back to this rank
  __host__ __device__ size_t combine_offset() const {
    return align(scales_offset() + 4 * static_cast<size_t>(scale_cols()) * pool_rows());
  }
  __host__ __device__ size_t total_bytes() const {
    return align(combine_offset() + 2 * static_cast<size_t>(max_tokens) * k * hidden);
  }
};

// Sends each (token, slot) row of x to the rank owning expert_ids[t, slot]
// (expert e on rank e / experts_per_rank): the row lands at the next free row
// of the owner's pool, and its origin and expert in meta. After the kernel,
// this rank's pool holds counts[parity][experts_per_rank] rows, of which
// counts[parity][e] for local expert e, in arrival order (results do not
// depend on it). parity = the number of dispatches so far & 1, on the device.
struct DispatchParams {
  SymmetricView sym;  // the ExpertLayout allocation
  ExpertLayout layout;
  const void* x;              // [num_tokens, hidden] bf16, or E4M3 with layout.fp8
  const int32_t* expert_ids;  // [num_tokens, k] global expert ids
  int num_tokens;             // <= layout.max_tokens; 0 is fine (the rank still takes part)
  const float* x_scales = nullptr;  // layout.fp8: [num_tokens, layout.scale_cols()]
};
cudaError_t dispatch(const DispatchParams& p, cudaStream_t stream);

// The rows this rank received in its last dispatch as the contiguous groups
// of a grouped GEMM (ops/cuda/kernels.h GroupedGemmParams): local expert e's
// rows are GEMM rows [expert_offsets[e], expert_offsets[e + 1]), GEMM row i
// reading received row gather[i] (of the pool, received_rows() below),
// and tile_offsets counts tiles of tile_rows rows. It also records each
// received row's GEMM row for combine's y_rows. One block; the counts stay on
// the device, so a CUDA graph can hold it. experts_per_rank <= 8192.
struct ReceivedGroupsParams {
  SymmetricView sym;  // the ExpertLayout allocation
  ExpertLayout layout;
  int32_t* expert_offsets;  // [experts_per_rank + 1]
  int32_t* tile_offsets;    // [experts_per_rank + 1]
  int32_t* gather;          // [max_received_rows(layout)]
  int tile_rows;
};
cudaError_t received_groups(const ReceivedGroupsParams& p, cudaStream_t stream);
// A bound on the rows a rank receives (its pool).
inline int64_t max_received_rows(const ExpertLayout& l) {
  return l.pool_rows();
}
// This rank's pool: [pool_rows, hidden] bf16 or E4M3, and (fp8) the rows'
// scales [pool_rows, scale_cols()].
inline const void* received_rows(const SymmetricView& v, const ExpertLayout& l) {
  return v.base[v.rank] + l.recv_offset();
}
inline const float* received_scales(const SymmetricView& v, const ExpertLayout& l) {
  return l.fp8 ? reinterpret_cast<const float*>(v.base[v.rank] + l.scales_offset()) : nullptr;
}

// Sends each received row's expert output back to its (rank, token, slot) and
// sums them there: out[t] = sum over slots j ascending of weights[t, j] * y(t, j).
// The outputs are either y, bf16 at the received rows' places in the pool, or
// y_rows, f32 in the order of received_groups (what the grouped GEMM over
// those groups writes; received_groups must have run since the dispatch),
// rounded to bf16 on the way.
struct CombineParams {
  SymmetricView sym;
  ExpertLayout layout;
  const bf16* y;         // [pool_rows, hidden] outputs of the received rows, or null
  const float* weights;  // [num_tokens, k] of this rank's dispatch
  float* out;            // [num_tokens, hidden]
  int num_tokens;        // as in this rank's dispatch
  const float* y_rows = nullptr;  // with y null: [received rows, hidden], in GEMM row order
};
cudaError_t combine(const CombineParams& p, cudaStream_t stream);

// Dispatch and combine always run this many blocks (the flags of block b pair
// with block b of every peer, so both sides must use the same grid).
inline constexpr int kExpertBlocks = 32;

}  // namespace moe::comm::cuda
