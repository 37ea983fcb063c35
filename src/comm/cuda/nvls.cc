// NVLS multicast setup: see nvls.h. Everything here runs only after
// check_nvls_allowed() and an explicit request.
#include "comm/cuda/nvls.h"

#include <cuda_runtime.h>
#include <fcntl.h>
#include <unistd.h>

#include "comm/cuda/driver_api.h"
#include "comm/fd_exchange.h"
#include "comm/nvls_policy.h"

namespace moe::comm::cuda {

Expected<std::unique_ptr<NvlsMulticast>> NvlsMulticast::create(CudaSymmetricMemory& memory, TcpBootstrap& bootstrap,
                                                               bool requested, int timeout_ms) {
  MOE_RETURN_IF_ERROR(nvls_preflight(requested));  // before any driver call
  std::unique_ptr<NvlsMulticast> nvls(new NvlsMulticast());
  MOE_RETURN_IF_ERROR(nvls->setup(memory, bootstrap, timeout_ms));
  return nvls;
}

Status NvlsMulticast::setup(CudaSymmetricMemory& memory, TcpBootstrap& bootstrap, int timeout_ms) {
  MOE_ASSIGN_OR_RETURN(const DriverApi* api, driver_api());
  if (api->multicast_create == nullptr || api->multicast_bind_mem == nullptr)
    return unavailable("the CUDA driver has no multicast objects (NVLS needs CUDA 12.1+ drivers)");
  device_ = memory.device();
  CUdevice device = 0;
  MOE_CU_RETURN_IF_ERROR(api->device_get(&device, device_));
  int supported = 0;
  MOE_CU_RETURN_IF_ERROR(api->device_get_attribute(&supported, CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED, device));
  // Every rank must agree, or some would wait for the others forever.
  const uint8_t mine = supported != 0;
  MOE_ASSIGN_OR_RETURN(auto all, bootstrap.all_gather({&mine, 1}));
  for (int r = 0; r < bootstrap.world_size(); ++r)
    if (all[r].size() != 1 || all[r][0] == 0) return unavailable("NVLS: rank {}'s GPU does not support multicast", r);

  CUmulticastObjectProp prop{};
  prop.numDevices = static_cast<unsigned>(bootstrap.world_size());
  prop.handleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t granularity = 0;
  prop.size = memory.allocation_bytes();
  MOE_CU_RETURN_IF_ERROR(api->multicast_get_granularity(&granularity, &prop, CU_MULTICAST_GRANULARITY_MINIMUM));
  bytes_ = (memory.allocation_bytes() + granularity - 1) / granularity * granularity;
  if (bytes_ != memory.allocation_bytes())
    return invalid_argument("NVLS: the allocation ({} bytes) is not a multiple of the multicast granularity {}",
                            memory.allocation_bytes(), granularity);
  prop.size = bytes_;

  // Rank 0 creates the object; the others import it from its descriptor
  // (they pass /dev/null, which the exchange needs and everyone ignores).
  int fd = -1;
  if (bootstrap.rank() == 0) {
    MOE_CU_RETURN_IF_ERROR(api->multicast_create(&handle_, &prop));
    MOE_CU_RETURN_IF_ERROR(
        api->mem_export_to_shareable_handle(&fd, handle_, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  } else {
    fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  }
  auto group = bootstrap.agree_on_name("nvls");
  auto fds = group.has_value() ? exchange_fds(*group, bootstrap.rank(), bootstrap.world_size(), fd, timeout_ms)
                               : Expected<std::vector<int>>(group.status());
  if (fd >= 0) close(fd);
  if (!fds) return fds.status();
  Status imported;
  if (bootstrap.rank() != 0)
    imported = driver_status(api->mem_import_from_shareable_handle(
                                 &handle_, reinterpret_cast<void*>(static_cast<uintptr_t>((*fds)[0])),
                                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                             "cuMemImportFromShareableHandle(multicast)");
  for (int other : *fds)
    if (other >= 0) close(other);
  MOE_RETURN_IF_ERROR(imported);

  MOE_CU_RETURN_IF_ERROR(api->multicast_add_device(handle_, device));
  MOE_RETURN_IF_ERROR(bootstrap.barrier());  // every device added before anyone binds
  MOE_CU_RETURN_IF_ERROR(api->multicast_bind_mem(handle_, 0, memory.local_handle(), 0, bytes_, 0));
  bound_ = true;
  MOE_CU_RETURN_IF_ERROR(api->mem_address_reserve(&address_, bytes_, granularity, 0, 0));
  MOE_CU_RETURN_IF_ERROR(api->mem_map(address_, bytes_, 0, handle_, 0));
  mapped_ = true;
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device_;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  MOE_CU_RETURN_IF_ERROR(api->mem_set_access(address_, bytes_, &access, 1));
  return bootstrap.barrier();
}

NvlsMulticast::~NvlsMulticast() {
  auto api = driver_api();
  if (!api.has_value() || handle_ == 0) return;
  cudaSetDevice(device_);
  cudaDeviceSynchronize();
  CUdevice device = 0;
  (*api)->device_get(&device, device_);
  if (mapped_) (*api)->mem_unmap(address_, bytes_);
  if (address_ != 0) (*api)->mem_address_free(address_, bytes_);
  if (bound_) (*api)->multicast_unbind(handle_, device, 0, bytes_);
  (*api)->mem_release(handle_);
}

}  // namespace moe::comm::cuda
