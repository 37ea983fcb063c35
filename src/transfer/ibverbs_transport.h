// The ibverbs transport: RC queue pairs, RDMA WRITE for a batch's runs and
// WRITE_WITH_IMM on its last one, so the receiver's NIC delivers one
// completion carrying imm per batch (writes on one RC queue pair are
// ordered, so that completion means every run of the batch has landed).
//
// Regions are host memory registered with ibv_reg_mr (remote write); the
// descriptor's export_data is the rkey in decimal, base_address the remote
// address. The NIC enforces region bounds through the rkey. Queue pairs are
// set up per peer over TCP (a kQpConnect frame and its answer, see wire.h).
// One thread polls the completion queue: send completions finish batches,
// receive completions count the imm through the Receiver (only while armed;
// the bytes land regardless, so disarm() cannot fence an ibverbs writer).
//
// Compiled when libibverbs is found (MOE_TRANSFER_HAVE_IBVERBS); used when an
// RDMA device exists and EngineOptions::enable_ibverbs is set. Not done: GPU
// memory (dma-buf), more than one device/port, batches larger than the send
// queue (kResourceExhausted).
//
// Threads: any thread may call submit/cancel/export; one poller thread;
// shutdown() once, before destruction.
#pragma once

#include <memory>

#include "transfer/tcp_transport.h"
#include "transfer/transport.h"

namespace moe::transfer {

class IbverbsTransport final : public Transport {
 public:
  // kUnavailable (with the reason) when there is no usable RDMA device.
  static Expected<std::unique_ptr<IbverbsTransport>> create(Receiver& receiver, BatchTracker& tracker,
                                                            TcpTransport& control);
  ~IbverbsTransport() override;

  TransportKind kind() const override { return TransportKind::kIbverbs; }
  Status export_region(const LocalRegion& region, RegionDescriptor& descriptor) override;
  void forget_region(RegionId id) override;
  Status submit(OutBatch batch) override;
  void cancel(const std::vector<std::shared_ptr<BatchState>>& batches) override;
  void shutdown() override;

  // Names of the RDMA devices present ("" when none), for tests' skip messages.
  static std::string list_devices();

 private:
  struct State;
  explicit IbverbsTransport(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace moe::transfer
