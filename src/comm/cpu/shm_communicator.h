// The CPU communicator: ranks on one host (processes or threads) meeting in
// POSIX shared memory (ShmSymmetricMemory). The CI path of every parallel
// layout, and the reference the CUDA kernels are checked against: same
// algorithms (one-shot / two-shot all-reduce, row-split fused all-reduce +
// residual + RMSNorm, sparse all-to-all dispatch/combine), same flags.
//
// Results are bit-identical on every rank: sums run over ranks 0..N-1 in that
// order on whichever rank computes them.
//
// Threads: one thread per rank calls its communicator (communicator.h).
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "comm/communicator.h"
#include "core/status.h"

namespace moe::comm {

struct ShmGroupOptions {
  std::string name;                 // unique per group; every rank passes the same
  int rank = 0, world_size = 1;
  size_t buffer_bytes = 64 << 20;   // per-rank symmetric buffer; larger messages go in chunks
  int timeout_ms = 30000;           // a rank that does not arrive: error naming it, never a hang
};

// Opens this rank's end of the group; returns once every rank has mapped every
// rank's buffer (or fails within timeout_ms naming the missing ranks).
// world_size 1 needs no peers and makes every collective a local operation.
Expected<std::unique_ptr<Communicator>> open_shm_communicator(const ShmGroupOptions& options);

// Messages of at least this many bytes take the two-shot all-reduce
// (reduce-scatter + all-gather); smaller ones the one-shot. On the CPU the
// one-shot's N-fold read traffic stays in cache up to a few hundred KiB, and
// below that the two-shot's extra barrier costs more than it saves. (Reasoned,
// not measured; both variants give bit-identical results.)
inline constexpr size_t kShmTwoShotMinBytes = 256 << 10;

}  // namespace moe::comm
