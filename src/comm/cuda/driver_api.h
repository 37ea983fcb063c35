// The CUDA driver functions of the communication layer (virtual memory,
// shareable handles, multicast), reached through the runtime's
// cudaGetDriverEntryPointByVersion so that no binary links libcuda: a build
// made on the CI image starts on machines without a driver, and uses the
// driver of the machine it runs on (as src/ops/cuda/tensor_map.cc does).
//
// Threads: driver_api() is safe to call from any thread (loaded once).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include "core/status.h"

namespace moe::comm::cuda {

struct DriverApi {
  PFN_cuDeviceGet_v2000 device_get = nullptr;
  PFN_cuDeviceGetAttribute_v2000 device_get_attribute = nullptr;
  PFN_cuGetErrorString_v6000 get_error_string = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 mem_get_allocation_granularity = nullptr;
  PFN_cuMemCreate_v10020 mem_create = nullptr;
  PFN_cuMemRelease_v10020 mem_release = nullptr;
  PFN_cuMemExportToShareableHandle_v10020 mem_export_to_shareable_handle = nullptr;
  PFN_cuMemImportFromShareableHandle_v10020 mem_import_from_shareable_handle = nullptr;
  PFN_cuMemAddressReserve_v10020 mem_address_reserve = nullptr;
  PFN_cuMemAddressFree_v10020 mem_address_free = nullptr;
  PFN_cuMemMap_v10020 mem_map = nullptr;
  PFN_cuMemUnmap_v10020 mem_unmap = nullptr;
  PFN_cuMemSetAccess_v10020 mem_set_access = nullptr;
  // Multicast (NVLS); only the NVLS setup touches these, after the safety check.
  PFN_cuMulticastCreate_v12010 multicast_create = nullptr;
  PFN_cuMulticastAddDevice_v12010 multicast_add_device = nullptr;
  PFN_cuMulticastBindMem_v12010 multicast_bind_mem = nullptr;
  PFN_cuMulticastUnbind_v12010 multicast_unbind = nullptr;
  PFN_cuMulticastGetGranularity_v12010 multicast_get_granularity = nullptr;
};

// The table, or Unavailable naming the first function the driver lacks.
Expected<const DriverApi*> driver_api();

// "cuMemMap: CUDA_ERROR_INVALID_VALUE (invalid argument)" as a Status.
Status driver_status(CUresult result, const char* what);

}  // namespace moe::comm::cuda

#define MOE_CU_RETURN_IF_ERROR(expr) MOE_RETURN_IF_ERROR(::moe::comm::cuda::driver_status((expr), #expr))
