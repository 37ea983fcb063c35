// cuMemCreate-based symmetric memory: see symmetric_memory.h.
#include "comm/cuda/symmetric_memory.h"

#include <cuda_runtime.h>
#include <unistd.h>

#include <cstring>

#include "comm/cuda/driver_api.h"
#include "comm/fd_exchange.h"
#include "core/cuda/cuda_check.h"

namespace moe::comm::cuda {
namespace {

CUmemAllocationHandleType handle_type(HandleKind kind) {
  return kind == HandleKind::kFabric ? CU_MEM_HANDLE_TYPE_FABRIC : CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
}

CUmemAllocationProp allocation_prop(int device, HandleKind kind) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = handle_type(kind);
  return prop;
}

}  // namespace

Expected<std::unique_ptr<CudaSymmetricMemory>> CudaSymmetricMemory::create(const SymmetricMemoryOptions& options,
                                                                           TcpBootstrap& bootstrap) {
  if (bootstrap.world_size() > kMaxRanks)
    return invalid_argument("symmetric memory: {} ranks, at most {}", bootstrap.world_size(), kMaxRanks);
  MOE_ASSIGN_OR_RETURN(const DriverApi* api, driver_api());
  (void)api;
  std::unique_ptr<CudaSymmetricMemory> mem(new CudaSymmetricMemory());
  mem->device_ = options.device;
  const int world = bootstrap.world_size();
  mem->handles_.assign(world, 0);
  mem->mapped_.assign(world, 0);
  mem->is_mapped_.assign(world, false);
  mem->view_.rank = bootstrap.rank();
  mem->view_.world = world;
  mem->view_.timeout_cycles = options.kernel_timeout_cycles;
  MOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.device));
  void* word = nullptr;
  MOE_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&word, sizeof(uint32_t), cudaHostAllocMapped | cudaHostAllocPortable));
  mem->abort_word_ = static_cast<volatile uint32_t*>(word);
  *mem->abort_word_ = 0;
  void* device_word = nullptr;
  MOE_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&device_word, word, 0));
  mem->view_.abort = static_cast<const volatile uint32_t*>(device_word);
  MOE_RETURN_IF_ERROR(mem->allocate_local(options));
  MOE_RETURN_IF_ERROR(mem->import_peers(options, bootstrap));
  MOE_RETURN_IF_ERROR(mem->map_all());
  // Counters and the whole local allocation start at zero on every rank
  // before anyone signals anyone.
  void* counters = nullptr;
  MOE_CUDA_RETURN_IF_ERROR(cudaMalloc(&counters, kNumSignalSets * sizeof(DeviceCounters)));
  mem->view_.counters = static_cast<DeviceCounters*>(counters);
  MOE_CUDA_RETURN_IF_ERROR(cudaMemset(counters, 0, kNumSignalSets * sizeof(DeviceCounters)));
  MOE_CUDA_RETURN_IF_ERROR(cudaMemset(mem->view_.base[mem->rank()], 0, mem->allocation_bytes_));
  MOE_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  MOE_RETURN_IF_ERROR(bootstrap.barrier());
  return mem;
}

Status CudaSymmetricMemory::allocate_local(const SymmetricMemoryOptions& options) {
  const DriverApi& api = **driver_api();
  const CUmemAllocationProp prop = allocation_prop(options.device, options.handle_kind);
  size_t granularity = 0;
  MOE_CU_RETURN_IF_ERROR(
      api.mem_get_allocation_granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  const size_t wanted = kSignalBytes + options.data_bytes;
  allocation_bytes_ = (wanted + granularity - 1) / granularity * granularity;
  view_.data_bytes = allocation_bytes_ - kSignalBytes;
  CUmemGenericAllocationHandle handle = 0;
  MOE_CU_RETURN_IF_ERROR(api.mem_create(&handle, allocation_bytes_, &prop, 0));
  handles_[view_.rank] = handle;
  return Status::ok();
}

Status CudaSymmetricMemory::import_peers(const SymmetricMemoryOptions& options, TcpBootstrap& bootstrap) {
  const DriverApi& api = **driver_api();
  const int world = view_.world, me = view_.rank;
  // Every rank must agree on the size before importing.
  const uint64_t bytes = allocation_bytes_;
  MOE_ASSIGN_OR_RETURN(auto sizes, bootstrap.all_gather({reinterpret_cast<const uint8_t*>(&bytes), sizeof bytes}));
  for (int r = 0; r < world; ++r) {
    uint64_t theirs = 0;
    if (sizes[r].size() == sizeof theirs) std::memcpy(&theirs, sizes[r].data(), sizeof theirs);
    if (theirs != bytes)
      return invalid_argument("symmetric memory: rank {} allocated {} bytes, rank {} {}", r, theirs, me, bytes);
  }
  if (options.handle_kind == HandleKind::kFabric) {
    CUmemFabricHandle fabric{};
    MOE_CU_RETURN_IF_ERROR(api.mem_export_to_shareable_handle(&fabric, handles_[me], CU_MEM_HANDLE_TYPE_FABRIC, 0));
    MOE_ASSIGN_OR_RETURN(auto all,
                         bootstrap.all_gather({reinterpret_cast<const uint8_t*>(&fabric), sizeof fabric}));
    for (int r = 0; r < world; ++r) {
      if (r == me) continue;
      if (all[r].size() != sizeof fabric) return data_loss("symmetric memory: rank {} sent a bad fabric handle", r);
      std::memcpy(&fabric, all[r].data(), sizeof fabric);
      MOE_CU_RETURN_IF_ERROR(api.mem_import_from_shareable_handle(&handles_[r], &fabric, CU_MEM_HANDLE_TYPE_FABRIC));
    }
    return Status::ok();
  }
  int fd = -1;
  MOE_CU_RETURN_IF_ERROR(
      api.mem_export_to_shareable_handle(&fd, handles_[me], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  auto group = bootstrap.agree_on_name("symm");
  if (!group) {
    close(fd);
    return group.status();
  }
  auto fds = exchange_fds(*group, me, world, fd, options.timeout_ms);
  close(fd);
  if (!fds) return fds.status();
  Status status;
  for (int r = 0; r < world; ++r) {
    if (r == me) continue;
    if (status.is_ok())
      status = driver_status(api.mem_import_from_shareable_handle(
                                 &handles_[r], reinterpret_cast<void*>(static_cast<uintptr_t>((*fds)[r])),
                                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                             "cuMemImportFromShareableHandle");
    close((*fds)[r]);  // the imported handle keeps the memory alive
  }
  return status;
}

Status CudaSymmetricMemory::map_all() {
  const DriverApi& api = **driver_api();
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device_;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  for (int r = 0; r < view_.world; ++r) {
    MOE_CU_RETURN_IF_ERROR(api.mem_address_reserve(&mapped_[r], allocation_bytes_, 0, 0, 0));
    MOE_CU_RETURN_IF_ERROR(api.mem_map(mapped_[r], allocation_bytes_, 0, handles_[r], 0));
    is_mapped_[r] = true;
    MOE_CU_RETURN_IF_ERROR(api.mem_set_access(mapped_[r], allocation_bytes_, &access, 1));
    view_.base[r] = reinterpret_cast<char*>(mapped_[r]);
  }
  return Status::ok();
}

CudaSymmetricMemory::~CudaSymmetricMemory() {
  auto api = driver_api();
  if (!api.has_value()) return;
  cudaSetDevice(device_);
  cudaDeviceSynchronize();  // no kernel of ours may still use the mappings
  if (view_.counters != nullptr) cudaFree(view_.counters);
  if (abort_word_ != nullptr) cudaFreeHost(const_cast<uint32_t*>(abort_word_));
  for (size_t r = 0; r < handles_.size(); ++r) {
    if (is_mapped_[r]) (*api)->mem_unmap(mapped_[r], allocation_bytes_);
    if (mapped_[r] != 0) (*api)->mem_address_free(mapped_[r], allocation_bytes_);
    if (handles_[r] != 0) (*api)->mem_release(handles_[r]);
  }
}

}  // namespace moe::comm::cuda
