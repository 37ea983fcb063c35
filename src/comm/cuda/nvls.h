// The NVLS (NVLink SHARP) multicast mapping of a symmetric allocation, for
// all_reduce_nvls (kernels.h).
//
// SAFETY (DESIGN section 3): multicast objects can take a shared host's GPUs
// down where the operator disabled them. So setup REFUSES before any driver
// call unless the caller asked for NVLS explicitly (--all-reduce nvls; off by
// default) and check_nvls_allowed() (comm/nvls_policy.h) finds none of
// NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
// NVSHMEM_DISABLE_NVLS=1. No test creates a multicast object.
//
// Setup is collective: rank 0 creates the object and passes it as a POSIX
// file descriptor; every rank adds its device, binds its allocation and maps
// the multicast address.
//
// Threads: created and destroyed by the rank's thread.
#pragma once

#include <cuda.h>

#include <memory>

#include "comm/bootstrap.h"
#include "comm/cuda/symmetric_memory.h"

namespace moe::comm::cuda {

class NvlsMulticast {
 public:
  // `requested`: the user chose NVLS. False gives an error, never a multicast object.
  static Expected<std::unique_ptr<NvlsMulticast>> create(CudaSymmetricMemory& memory, TcpBootstrap& bootstrap,
                                                         bool requested, int timeout_ms = 30000);
  ~NvlsMulticast();
  NvlsMulticast(const NvlsMulticast&) = delete;
  NvlsMulticast& operator=(const NvlsMulticast&) = delete;

  // The multicast address of the allocation's first byte (NvlsAllReduceParams::multicast).
  char* multicast_base() const { return reinterpret_cast<char*>(address_); }

 private:
  NvlsMulticast() = default;
  Status setup(CudaSymmetricMemory& memory, TcpBootstrap& bootstrap, int timeout_ms);

  CUmemGenericAllocationHandle handle_ = 0;
  CUdeviceptr address_ = 0;
  size_t bytes_ = 0;
  int device_ = 0;
  bool bound_ = false, mapped_ = false;
};

}  // namespace moe::comm::cuda
