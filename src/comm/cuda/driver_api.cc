#include "comm/cuda/driver_api.h"

#include <cuda_runtime.h>

namespace moe::comm::cuda {
namespace {

template <typename Fn>
bool load(const char* name, int version, Fn& fn, std::string& missing) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(name, &p, version, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess || p == nullptr) {
    cudaGetLastError();
    if (missing.empty()) missing = name;
    return false;
  }
  fn = reinterpret_cast<Fn>(p);
  return true;
}

struct Loaded {
  DriverApi api;
  std::string missing;
};

Loaded load_all() {
  Loaded l;
  DriverApi& a = l.api;
  std::string& m = l.missing;
  load("cuDeviceGet", 2000, a.device_get, m);
  load("cuDeviceGetAttribute", 2000, a.device_get_attribute, m);
  load("cuGetErrorString", 6000, a.get_error_string, m);
  load("cuMemGetAllocationGranularity", 10020, a.mem_get_allocation_granularity, m);
  load("cuMemCreate", 10020, a.mem_create, m);
  load("cuMemRelease", 10020, a.mem_release, m);
  load("cuMemExportToShareableHandle", 10020, a.mem_export_to_shareable_handle, m);
  load("cuMemImportFromShareableHandle", 10020, a.mem_import_from_shareable_handle, m);
  load("cuMemAddressReserve", 10020, a.mem_address_reserve, m);
  load("cuMemAddressFree", 10020, a.mem_address_free, m);
  load("cuMemMap", 10020, a.mem_map, m);
  load("cuMemUnmap", 10020, a.mem_unmap, m);
  load("cuMemSetAccess", 10020, a.mem_set_access, m);
  // Multicast may be missing on old drivers: not fatal here, the NVLS setup checks.
  std::string optional;
  load("cuMulticastCreate", 12010, a.multicast_create, optional);
  load("cuMulticastAddDevice", 12010, a.multicast_add_device, optional);
  load("cuMulticastBindMem", 12010, a.multicast_bind_mem, optional);
  load("cuMulticastUnbind", 12010, a.multicast_unbind, optional);
  load("cuMulticastGetGranularity", 12010, a.multicast_get_granularity, optional);
  return l;
}

}  // namespace

Expected<const DriverApi*> driver_api() {
  static const Loaded loaded = load_all();
  if (!loaded.missing.empty())
    return unavailable("the CUDA driver has no {} (no driver, or one older than the CUDA 12 API)", loaded.missing);
  return &loaded.api;
}

Status driver_status(CUresult result, const char* what) {
  if (result == CUDA_SUCCESS) return Status::ok();
  const char* text = "unknown error";
  if (auto api = driver_api(); api.has_value()) (*api)->get_error_string(result, &text);
  const StatusCode code = result == CUDA_ERROR_OUT_OF_MEMORY ? StatusCode::kResourceExhausted
                          : result == CUDA_ERROR_NOT_SUPPORTED ? StatusCode::kUnimplemented
                                                               : StatusCode::kInternal;
  return Status(code, fmt::format("{}: {} (CUresult {})", what, text, static_cast<int>(result)));
}

}  // namespace moe::comm::cuda
