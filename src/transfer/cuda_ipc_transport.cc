// CUDA IPC transport: see cuda_ipc_transport.h.
#include "transfer/cuda_ipc_transport.h"

#include <cuda.h>
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>

#include "core/cuda/cuda_check.h"
#include "core/logging.h"
#include "transfer/copy_runs.h"

namespace moe::transfer {
namespace {

std::string to_hex(const void* data, size_t n) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * n);
  for (size_t i = 0; i < n; ++i) {
    const uint8_t byte = static_cast<const uint8_t*>(data)[i];
    out.push_back(kDigits[byte >> 4]);
    out.push_back(kDigits[byte & 15]);
  }
  return out;
}

bool from_hex(std::string_view text, void* out, size_t n) {
  if (text.size() != 2 * n) return false;
  for (size_t i = 0; i < n; ++i) {
    unsigned value = 0;
    auto [end, error] = std::from_chars(text.data() + 2 * i, text.data() + 2 * i + 2, value, 16);
    if (error != std::errc() || end != text.data() + 2 * i + 2) return false;
    static_cast<uint8_t*>(out)[i] = static_cast<uint8_t>(value);
  }
  return true;
}

struct ExportData {
  cudaIpcMemHandle_t handle{};
  uint64_t offset = 0;
  int64_t pid = 0;
};

// The export data of a region that can only be read here (see export_region).
constexpr const char* kNotExportable = "not-exportable";

Expected<ExportData> parse_export(const std::string& text) {
  if (text == kNotExportable)
    return invalid_argument(
        "CUDA IPC: the region was mapped into its owner from a third process and cannot be "
        "written by peers");
  const size_t a = text.find(':');
  const size_t b = a == std::string::npos ? a : text.find(':', a + 1);
  ExportData data;
  if (b == std::string::npos || !from_hex(std::string_view(text).substr(0, a), &data.handle, sizeof(data.handle)))
    return invalid_argument("CUDA IPC export data '{}' is malformed", text.substr(0, 40));
  auto r1 = std::from_chars(text.data() + a + 1, text.data() + b, data.offset);
  auto r2 = std::from_chars(text.data() + b + 1, text.data() + text.size(), data.pid);
  if (r1.ec != std::errc() || r2.ec != std::errc() || r2.ptr != text.data() + text.size())
    return invalid_argument("CUDA IPC export data '{}' is malformed", text.substr(0, 40));
  return data;
}

// Restores the calling thread's current device on scope exit.
class DeviceGuard {
 public:
  DeviceGuard() { cudaGetDevice(&saved_); }
  ~DeviceGuard() { cudaSetDevice(saved_); }

 private:
  int saved_ = 0;
};

}  // namespace

Expected<std::unique_ptr<CudaIpcTransport>> CudaIpcTransport::create(TcpTransport& control, BatchTracker& tracker,
                                                                      std::string host_id) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return unavailable("no CUDA device");
  }
  std::unique_ptr<CudaIpcTransport> transport(new CudaIpcTransport(control, tracker, std::move(host_id)));
  transport->completion_thread_ = std::thread([t = transport.get()] { t->completion_loop(); });
  return transport;
}

CudaIpcTransport::~CudaIpcTransport() { shutdown(); }

void CudaIpcTransport::shutdown() {
  {
    std::lock_guard lock(mutex_);
    if (stopping_) return;
    stopping_ = true;
  }
  cv_.notify_all();
  if (completion_thread_.joinable()) completion_thread_.join();
  DeviceGuard guard;
  for (auto& [key, base] : opened_) cudaIpcCloseMemHandle(base);
  for (auto& [device, table] : tables_) {
    cudaSetDevice(device);
    cudaFree(table.data);
  }
  for (auto& [device, events] : free_events_) {
    cudaSetDevice(device);
    for (void* event : events) cudaEventDestroy(static_cast<cudaEvent_t>(event));
  }
  for (auto& [device, stream] : streams_) {
    cudaSetDevice(device);
    cudaStreamDestroy(static_cast<cudaStream_t>(stream));
  }
}

Status CudaIpcTransport::export_region(const LocalRegion& region, RegionDescriptor& descriptor) {
  if (region.memory != MemoryKind::kDevice) return invalid_argument("the CUDA IPC transport takes device memory only");
  cudaPointerAttributes attributes{};
  MOE_CUDA_RETURN_IF_ERROR(cudaPointerGetAttributes(&attributes, region.base));
  if (attributes.type != cudaMemoryTypeDevice)
    return invalid_argument("register_region: {} is not cudaMalloc'ed device memory", static_cast<void*>(region.base));
  descriptor.device = attributes.device;
  DeviceGuard guard;  // the driver call below needs the region's device current
  MOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(attributes.device));
  // The driver's cuMemGetAddressRange, reached through the runtime so that
  // nothing links libcuda (binaries must start on machines without a driver).
  using GetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  void* entry = nullptr;
  cudaDriverEntryPointQueryResult found{};
  MOE_CUDA_RETURN_IF_ERROR(
      cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &entry, 12000, cudaEnableDefault, &found));
  if (entry == nullptr || found != cudaDriverEntryPointSuccess)
    return unavailable("CUDA driver has no cuMemGetAddressRange");
  CUdeviceptr allocation = 0;
  size_t allocation_bytes = 0;
  if (reinterpret_cast<GetAddressRange>(entry)(&allocation, &allocation_bytes,
                                               reinterpret_cast<CUdeviceptr>(region.base)) != CUDA_SUCCESS)
    return internal_error("cuMemGetAddressRange failed for {}", static_cast<void*>(region.base));
  const uint64_t offset = reinterpret_cast<CUdeviceptr>(region.base) - allocation;
  if (offset + region.length_bytes > allocation_bytes)
    return out_of_range("register_region: {} bytes at {} run past their allocation", region.length_bytes,
                        static_cast<void*>(region.base));
  cudaIpcMemHandle_t handle{};
  if (cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(allocation)) != cudaSuccess) {
    // Memory this process mapped from another one (a GPU rank's KV pool, seen
    // by its prefill leader) cannot be exported again: it stays a copy source
    // here, and a peer that tries to write into it gets kNotExportable.
    cudaGetLastError();
    descriptor.export_data = kNotExportable;
    return Status::ok();
  }
  descriptor.export_data = fmt::format("{}:{}:{}", to_hex(&handle, sizeof(handle)), offset, getpid());
  return Status::ok();
}

Expected<uint8_t*> CudaIpcTransport::map_region(const RegionDescriptor& dst) {
  if (dst.host_id != host_id_)
    return unavailable("CUDA IPC: region {} of {} is on another host", dst.region_id, dst.endpoint);
  MOE_ASSIGN_OR_RETURN(ExportData data, parse_export(dst.export_data));
  if (data.pid == getpid()) return reinterpret_cast<uint8_t*>(dst.base_address);  // same address space
  std::lock_guard lock(mutex_);
  // One mapping per allocation: the regions inside it share it.
  const auto key = std::make_pair(dst.endpoint, dst.export_data.substr(0, dst.export_data.find(':')));
  if (auto it = opened_.find(key); it != opened_.end()) return it->second + data.offset;
  void* base = nullptr;
  MOE_CUDA_RETURN_IF_ERROR(cudaIpcOpenMemHandle(&base, data.handle, cudaIpcMemLazyEnablePeerAccess));
  opened_[key] = static_cast<uint8_t*>(base);
  return static_cast<uint8_t*>(base) + data.offset;
}

Expected<void*> CudaIpcTransport::stream_for(int device) {
  std::lock_guard lock(mutex_);
  if (auto it = streams_.find(device); it != streams_.end()) return it->second;
  cudaStream_t stream = nullptr;
  MOE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  streams_[device] = stream;
  return static_cast<void*>(stream);
}

Status CudaIpcTransport::submit(OutBatch batch) {
  const std::string peer = batch.dsts.front().endpoint;
  if (batch.frames.empty()) return control_.send_notify(peer, batch.state, 1);
  std::vector<uint8_t*> dst_bases;
  for (const RegionDescriptor& dst : batch.dsts) {
    MOE_ASSIGN_OR_RETURN(uint8_t* base, map_region(dst));
    dst_bases.push_back(base);
  }
  DeviceGuard guard;
  // Copies run on the source's device (the destination's for a host source).
  int device = batch.src_memory == MemoryKind::kDevice ? batch.src_device : batch.dsts.front().device;
  if (device < 0) device = 0;
  MOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  MOE_ASSIGN_OR_RETURN(void* stream_ptr, stream_for(device));
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  // Same process, another device: the copy goes peer to peer once access is on.
  for (const RegionDescriptor& dst : batch.dsts) {
    if (dst.device < 0 || dst.device == device) continue;
    std::lock_guard lock(mutex_);
    auto [it, inserted] = peer_access_.try_emplace(std::make_pair(device, dst.device), false);
    if (!inserted) continue;
    int can = 0;
    if (cudaDeviceCanAccessPeer(&can, device, dst.device) == cudaSuccess && can) {
      const cudaError_t error = cudaDeviceEnablePeerAccess(dst.device, 0);
      it->second = error == cudaSuccess || error == cudaErrorPeerAccessAlreadyEnabled;
    }
    cudaGetLastError();
  }
  MOE_RETURN_IF_ERROR(issue_copies(batch, dst_bases, device, stream));
  cudaEvent_t event = nullptr;
  {
    std::lock_guard lock(mutex_);
    auto& pool = free_events_[device];
    if (!pool.empty()) {
      event = static_cast<cudaEvent_t>(pool.back());
      pool.pop_back();
    }
  }
  if (event == nullptr) MOE_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  if (cudaError_t error = cudaEventRecord(event, stream); error != cudaSuccess) {
    cudaEventDestroy(event);
    return cuda_status(error, "cudaEventRecord");
  }
  {
    std::lock_guard lock(mutex_);
    pending_.push_back(Pending{event, device, batch.state, peer});
  }
  cv_.notify_all();
  return Status::ok();
}

bool CudaIpcTransport::kernel_can_write(int device, const uint8_t* dst) {
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, dst) != cudaSuccess || attributes.type != cudaMemoryTypeDevice) {
    cudaGetLastError();
    return false;
  }
  if (attributes.device == device) return true;
  std::lock_guard lock(mutex_);
  auto [it, inserted] = peer_access_.try_emplace(std::make_pair(device, attributes.device), false);
  if (inserted) {
    int can = 0;
    if (cudaDeviceCanAccessPeer(&can, device, attributes.device) == cudaSuccess && can) {
      const cudaError_t error = cudaDeviceEnablePeerAccess(attributes.device, 0);
      it->second = error == cudaSuccess || error == cudaErrorPeerAccessAlreadyEnabled;
    }
    cudaGetLastError();
  }
  return it->second;
}

Status CudaIpcTransport::issue_copies(const OutBatch& batch, const std::vector<uint8_t*>& dst_bases, int device,
                                      cudaStream_t stream) {
  // Small runs from device memory go through one copy kernel when the device
  // can store into every destination; the rest are cudaMemcpyAsync each.
  std::vector<cuda::CopyRun> small;
  bool use_kernel = batch.src_memory == MemoryKind::kDevice;
  for (size_t i = 0; use_kernel && i < dst_bases.size(); ++i) use_kernel = kernel_can_write(device, dst_bases[i]);
  for (const OutFrame& frame : batch.frames) {
    uint8_t* dst = dst_bases[frame.dst_index] + frame.dst_offset;
    if (use_kernel && frame.length_bytes < kKernelRunBytes) {
      small.push_back(cuda::CopyRun{frame.src, dst, frame.length_bytes});
      continue;
    }
    MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, frame.src, frame.length_bytes, cudaMemcpyDefault, stream));
  }
  if (small.empty()) return Status::ok();
  if (small.size() == 1) {
    return cuda_status(cudaMemcpyAsync(small[0].dst, small[0].src, small[0].length_bytes, cudaMemcpyDefault, stream),
                       "cudaMemcpyAsync");
  }
  // The run table goes up in stream order, so one device buffer per device is
  // reused safely; the lock keeps another thread's table from slipping in
  // between this upload and this launch.
  std::lock_guard lock(issue_mutex_);
  Table& table = tables_[device];
  const size_t bytes = small.size() * sizeof(cuda::CopyRun);
  if (table.capacity_bytes < bytes) {
    if (table.data != nullptr) cudaFree(table.data);  // synchronises the device: rare
    table.capacity_bytes = std::max<size_t>(bytes, 64 << 10);
    MOE_CUDA_RETURN_IF_ERROR(cudaMalloc(&table.data, table.capacity_bytes));
  }
  MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(table.data, small.data(), bytes, cudaMemcpyHostToDevice, stream));
  return cuda_status(cuda::launch_copy_runs(static_cast<const cuda::CopyRun*>(table.data),
                                            static_cast<int>(small.size()), stream),
                     "copy_runs kernel");
}

void CudaIpcTransport::completion_loop() {
  // Waits for the oldest batch's event, then takes every later one that is
  // already done as well, so a train of small batches costs one wake-up and
  // one queueing of notices rather than one each.
  std::vector<Pending> done;
  for (;;) {
    done.clear();
    {
      std::unique_lock lock(mutex_);
      cv_.wait(lock, [&] { return stopping_ || !pending_.empty(); });
      if (pending_.empty()) return;  // stopping, and every copy is accounted for
      done.push_back(std::move(pending_.front()));
      pending_.pop_front();
      in_progress_.push_back(done.back().batch);
    }
    cudaSetDevice(done.front().device);
    std::vector<Status> results = {
        cuda_status(cudaEventSynchronize(static_cast<cudaEvent_t>(done.front().event)), "CUDA IPC copy")};
    {
      std::lock_guard lock(mutex_);
      while (!pending_.empty() && done.size() < 256 &&
             cudaEventQuery(static_cast<cudaEvent_t>(pending_.front().event)) == cudaSuccess) {
        done.push_back(std::move(pending_.front()));
        pending_.pop_front();
        in_progress_.push_back(done.back().batch);
        results.push_back(Status::ok());
      }
    }
    std::map<std::string, std::vector<std::shared_ptr<BatchState>>> notices;
    for (size_t i = 0; i < done.size(); ++i) {
      if (!results[i].is_ok()) {
        tracker_.finish(done[i].batch, results[i]);
      } else if (!done[i].batch->finished.load()) {
        notices[done[i].peer].push_back(done[i].batch);
      }
    }
    for (auto& [peer, batches] : notices) {
      if (Status sent = control_.send_notifies(peer, batches); !sent.is_ok()) {
        for (auto& batch : batches) tracker_.finish(batch, sent);
      }
    }
    {
      std::lock_guard lock(mutex_);
      for (Pending& pending : done) {
        std::erase(in_progress_, pending.batch);
        free_events_[pending.device].push_back(pending.event);
      }
    }
    cv_.notify_all();
  }
}

void CudaIpcTransport::cancel(const std::vector<std::shared_ptr<BatchState>>& batches) {
  // Issued copies cannot be recalled: wait until the cancelled ones have finished.
  std::unique_lock lock(mutex_);
  auto busy = [&] {
    for (auto& batch : batches) {
      if (std::find(in_progress_.begin(), in_progress_.end(), batch) != in_progress_.end()) return true;
      for (auto& pending : pending_) {
        if (pending.batch == batch) return true;
      }
    }
    return false;
  };
  cv_.wait(lock, [&] { return !busy(); });
}

}  // namespace moe::transfer
