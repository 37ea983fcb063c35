// The TCP transport: host memory to host memory over plain sockets.
//
// Sender: per peer, num_connections_per_peer connections, each with its own
// thread and queue of frames; a batch's frames are dealt round-robin over the
// connections and written with writev (many small frames per system call).
// Receiver: one listener thread, one thread per inbound connection that reads
// each header, validates it (wire::validate_header, then region bounds and imm
// through the Receiver) and receives the payload straight into the region.
// It also carries the completion notices of the CUDA IPC transport
// (send_notify).
//
// Threads: all methods may be called from any thread; shutdown() once, before
// destruction. I/O threads call the Receiver, the BatchTracker and the peer-lost
// callback.
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "transfer/transport.h"

namespace moe::transfer {

struct TransportCounters {
  std::atomic<uint64_t> num_bytes_sent{0};
  std::atomic<uint64_t> num_bad_frames{0};
  std::atomic<uint64_t> num_connections_lost{0};
};

using PeerLostFn = std::function<void(const std::string& peer, const Status& why)>;

class TcpTransport final : public Transport {
 public:
  static Expected<std::unique_ptr<TcpTransport>> create(const EngineOptions& options, Receiver& receiver,
                                                        BatchTracker& tracker, TransportCounters& counters,
                                                        PeerLostFn on_peer_lost);
  ~TcpTransport() override;

  const std::string& endpoint() const { return endpoint_; }
  TransportKind kind() const override { return TransportKind::kTcp; }
  Status export_region(const LocalRegion& region, RegionDescriptor& descriptor) override;
  Status submit(OutBatch batch) override;
  // One kNotify frame for `batch` (an imm-only batch, or a CUDA IPC batch whose
  // copies finished); `batch` finishes once the frame is sent.
  Status send_notify(const std::string& peer, const std::shared_ptr<BatchState>& batch, uint32_t batch_num_frames);
  // One single-frame kNotify per batch, all to one peer, queued at once.
  Status send_notifies(const std::string& peer, const std::vector<std::shared_ptr<BatchState>>& batches);
  void cancel(const std::vector<std::shared_ptr<BatchState>>& batches) override;
  void shutdown() override;

  // ibverbs set-up over TCP. The receiving side answers a kQpConnect with what
  // `acceptor` returns (set once, before any peer connects); the sending side
  // calls exchange_qp_info on a connection of its own.
  using QpInfo = std::array<uint8_t, wire::kQpInfoBytes>;
  using QpAcceptor = std::function<Expected<QpInfo>(const std::string& peer, const QpInfo& remote)>;
  void set_qp_acceptor(QpAcceptor acceptor) {
    std::lock_guard lock(in_mutex_);
    qp_acceptor_ = std::move(acceptor);
  }
  Expected<QpInfo> exchange_qp_info(const std::string& peer, const QpInfo& local);

 private:
  struct Job {
    wire::FrameHeader header;
    const uint8_t* payload = nullptr;
    std::shared_ptr<BatchState> batch;
  };
  struct Peer;
  struct OutConnection {
    Peer* peer = nullptr;
    int fd = -1;
    std::thread thread;
    std::deque<Job> queue;                            // guarded by out_mutex_
    std::vector<std::shared_ptr<BatchState>> sending;  // batches in the current writev
    std::atomic<bool> exited{false};                  // send_loop returned
  };
  struct Peer {
    std::string endpoint;
    std::vector<std::unique_ptr<OutConnection>> connections;
    size_t next_connection = 0;
    Status failure;  // not ok once the peer was lost; the next submit reconnects
  };
  class InConnection;

  TcpTransport(const EngineOptions& options, Receiver& receiver, BatchTracker& tracker, TransportCounters& counters,
               PeerLostFn on_peer_lost);
  Status listen();
  void accept_loop();
  Expected<std::shared_ptr<Peer>> connected_peer(const std::string& endpoint);
  Expected<std::shared_ptr<Peer>> connect_peer(const std::string& endpoint);
  Status enqueue(const std::string& peer, std::vector<Job> jobs);
  void send_loop(OutConnection* connection);
  struct WriteResult {
    Status status;                  // the error that ended the connection, if any
    size_t num_sent = 0;            // jobs [0, num_sent) are entirely on the wire
    std::optional<size_t> partial;  // a job whose frame is half sent (stall)
    bool stalled = false;           // stall_after_bytes reached
  };
  // Writes jobs' headers and payloads, honouring stall_after_bytes.
  WriteResult write_jobs(OutConnection* connection, std::vector<Job>& jobs);
  // After a stall: requeues unsent jobs and blocks; returns why it ended.
  Status stall(OutConnection* connection, std::vector<Job>& jobs, const WriteResult& result);
  void fail_peer_locked(Peer& peer, const Status& why, std::vector<std::shared_ptr<BatchState>>& to_fail);
  // Whether a write of `peer`'s connections other than `except` holds `batch` (out_mutex_ held).
  bool in_flight_locked(const Peer& peer, const std::shared_ptr<BatchState>& batch, const OutConnection* except) const;
  void inbound_lost(const std::string& peer, const Status& why);

  EngineOptions options_;
  Receiver& receiver_;
  BatchTracker& tracker_;
  TransportCounters& counters_;
  PeerLostFn on_peer_lost_;
  QpAcceptor qp_acceptor_;
  uint64_t nonce_ = 0;
  std::string endpoint_;
  int listen_fd_ = -1;
  std::thread accept_thread_;
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> num_payload_bytes_sent_{0};  // for stall_after_bytes

  std::mutex out_mutex_;
  std::condition_variable out_cv_;  // queues, sending lists, stop
  std::unordered_map<std::string, std::shared_ptr<Peer>> peers_;
  std::vector<std::shared_ptr<Peer>> retired_peers_;  // failed peers whose threads are joined at shutdown
  std::mutex connect_mutex_;                          // one connect at a time

  std::mutex in_mutex_;
  std::list<std::unique_ptr<InConnection>> inbound_;
};

}  // namespace moe::transfer
