// The CUDA IPC transport: device memory to device memory on GPUs of one host.
//
// A region is exported with cudaIpcGetMemHandle on its allocation (the
// descriptor's export_data is "<handle hex>:<offset in allocation>:<pid>");
// a writer in another process opens the handle once per peer allocation (the
// regions of one allocation, e.g. every layer's K and V pages of a KV pool,
// share the mapping)
// and copies with cudaMemcpyAsync on its own stream per device (peer copies
// over NVLink when the GPUs have peer access). A writer in the same process
// uses the region's address directly. Device memory that this process
// itself mapped from another (cudaIpcOpenMemHandle) registers as a source
// only: the driver does not export it again. When a batch's copies are done (its
// event completes, watched by one completion thread) the transport sends a
// kNotify frame over the TCP connection to the peer, which counts the batch
// for its imm. The receiver does not see the bytes: disarm() there cannot
// stop a live writer (see transfer_engine.h).
//
// Compiled only with CUDA (MOE_TRANSFER_HAVE_CUDA). Threads: any thread may
// submit; copies are issued on the calling thread, which keeps its current
// device (saved and restored). shutdown() once, before destruction.
#pragma once

struct CUstream_st;  // cudaStream_t, without the CUDA headers here

#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "transfer/tcp_transport.h"
#include "transfer/transport.h"

namespace moe::transfer {

class CudaIpcTransport final : public Transport {
 public:
  // Fails (kUnavailable) when no CUDA device is visible.
  static Expected<std::unique_ptr<CudaIpcTransport>> create(TcpTransport& control, BatchTracker& tracker,
                                                            std::string host_id);
  ~CudaIpcTransport() override;

  TransportKind kind() const override { return TransportKind::kCudaIpc; }
  Status export_region(const LocalRegion& region, RegionDescriptor& descriptor) override;
  Status submit(OutBatch batch) override;
  void cancel(const std::vector<std::shared_ptr<BatchState>>& batches) override;
  void shutdown() override;

 private:
  struct Pending {
    void* event = nullptr;  // cudaEvent_t
    int device = 0;
    std::shared_ptr<BatchState> batch;
    std::string peer;
  };

  CudaIpcTransport(TcpTransport& control, BatchTracker& tracker, std::string host_id)
      : control_(control), tracker_(tracker), host_id_(std::move(host_id)) {}
  // Device pointer of byte 0 of a peer's region, opening its handle if needed.
  Expected<uint8_t*> map_region(const RegionDescriptor& dst);
  Expected<void*> stream_for(int device);  // cudaStream_t, one per device
  // Issues the batch's copies on `stream` (cudaStream_t).
  Status issue_copies(const OutBatch& batch, const std::vector<uint8_t*>& dst_bases, int device, CUstream_st* stream);
  // Whether a kernel on `device` may store to `dst` (same device or peer access on).
  bool kernel_can_write(int device, const uint8_t* dst);

  struct Table {
    void* data = nullptr;  // device memory for the copy kernel's run table
    size_t capacity_bytes = 0;
  };
  // Runs below this go through the copy kernel; bigger ones are cudaMemcpyAsync.
  static constexpr uint64_t kKernelRunBytes = 256 << 10;
  void completion_loop();

  TcpTransport& control_;
  BatchTracker& tracker_;
  std::string host_id_;
  std::thread completion_thread_;

  std::mutex mutex_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::deque<Pending> pending_;
  std::vector<std::shared_ptr<BatchState>> in_progress_;  // popped, event not yet done
  // Mapped peer allocations: (peer endpoint, handle) -> the allocation's base here.
  std::map<std::pair<std::string, std::string>, uint8_t*> opened_;
  std::map<int, void*> streams_;
  std::map<int, std::vector<void*>> free_events_;  // cudaEvent_t per device, reused
  std::mutex issue_mutex_;                         // table upload + launch, per call
  std::map<int, Table> tables_;                    // by device, under issue_mutex_
  std::map<std::pair<int, int>, bool> peer_access_;  // (from, to) -> enabled
};

}  // namespace moe::transfer
