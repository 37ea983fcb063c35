// Symmetric device memory: one cuMemCreate allocation of the same size per
// rank (one GPU each), every rank's allocation mapped into every rank's
// address space, so a kernel reads and writes peers' memory over NVLink with
// plain pointers (SymmetricView).
//
// Sharing: kPosixFd (one host): each rank exports its allocation as a POSIX
// file descriptor and passes it to the others over Unix-domain sockets
// (fd_exchange.h); kFabric (multi-node NVLink, NVL72 trays, needs IMEX): the
// 64-byte fabric handles travel through the bootstrap's all-gather. Either
// way the peers import, cuMemMap and cuMemSetAccess the allocations.
//
// Setup is collective (every rank calls create with the same options through
// the same TcpBootstrap). The whole local allocation is zeroed (signal
// counters included) before the ranks meet, so no flag starts stale. Driver
// functions come from driver_api.h (no libcuda link).
//
// Threads: created and destroyed by the rank's thread; view() may be read by
// any thread and passed to kernels on any stream of this rank's device.
#pragma once

#include <cuda.h>

#include <memory>
#include <string>
#include <vector>

#include "comm/bootstrap.h"
#include "comm/cuda/kernels.h"
#include "core/status.h"

namespace moe::comm::cuda {

enum class HandleKind { kPosixFd, kFabric };

struct SymmetricMemoryOptions {
  int device = 0;                    // this rank's CUDA device
  size_t data_bytes = 64 << 20;      // after the signal area; rounded up to the granularity
  HandleKind handle_kind = HandleKind::kPosixFd;
  int timeout_ms = 30000;            // for the exchange of handles
  // A wait inside a kernel longer than this traps (0: never); ~10 s at 2 GHz.
  unsigned long long kernel_timeout_cycles = 20'000'000'000ull;
};

class CudaSymmetricMemory {
 public:
  static Expected<std::unique_ptr<CudaSymmetricMemory>> create(const SymmetricMemoryOptions& options,
                                                               TcpBootstrap& bootstrap);
  ~CudaSymmetricMemory();
  CudaSymmetricMemory(const CudaSymmetricMemory&) = delete;
  CudaSymmetricMemory& operator=(const CudaSymmetricMemory&) = delete;

  const SymmetricView& view() const { return view_; }
  int rank() const { return view_.rank; }
  int world_size() const { return view_.world; }
  int device() const { return device_; }
  size_t allocation_bytes() const { return allocation_bytes_; }
  // The local allocation's handle (for binding to a multicast object, nvls.h).
  CUmemGenericAllocationHandle local_handle() const { return handles_[view_.rank]; }
  // Ends every wait of this rank's kernels on peers, now and later (a peer is
  // gone): they finish with garbage instead of trapping after the timeout.
  // Any thread; async-signal-safe.
  void abort() { *abort_word_ = 1; }
  bool aborted() const { return *abort_word_ != 0; }

 private:
  CudaSymmetricMemory() = default;
  Status allocate_local(const SymmetricMemoryOptions& options);
  Status import_peers(const SymmetricMemoryOptions& options, TcpBootstrap& bootstrap);
  Status map_all();

  int device_ = 0;
  size_t allocation_bytes_ = 0;
  std::vector<CUmemGenericAllocationHandle> handles_;  // [world]; 0 until held
  std::vector<CUdeviceptr> mapped_;                    // [world]; 0 until reserved
  std::vector<bool> is_mapped_;                        // [world]
  volatile uint32_t* abort_word_ = nullptr;            // mapped pinned host memory (view_.abort on the device)
  SymmetricView view_{};
};

}  // namespace moe::comm::cuda
