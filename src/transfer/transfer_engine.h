// TransferEngine: one-sided writes into a peer's registered memory, counted
// at the receiver per immediate value (DESIGN section 5). Modelled on RDMA
// WRITE_WITH_IMM (Mooncake, pplx-garden): nothing is read back, nothing is
// deserialised beyond a fixed binary header.
//
// Picture of one KV transfer (prefill P -> decode D):
//   D: id = register_region(kv_pool, bytes)          once, at start-up
//   D: arm(imm, writer = P's endpoint)               per request, before any write
//   D: describe(id).to_json()  --(router)-->  P: RegionDescriptor::from_json
//   P: submit_*(..., imm) one batch per layer         each batch = ONE completion at D
//   D: wait_for(imm, num_batches, timeout)            or poll / completion callback
//   D: disarm(imm)                                    after commit, abort or lease expiry
//
// Terms
// - Region: a registered range of local memory (host, or device for the CUDA IPC
//   transport). Its RegionDescriptor (endpoint, region id, base, length,
//   transport, memory kind, device, transport-specific export data) is plain
//   data and can travel as JSON to a peer, which writes into it.
// - Endpoint: "host:port" of an engine's TCP listener; it names the engine to its
//   peers (peer == endpoint string). The TCP listener also carries the control
//   frames of the other transports (completion notices of CUDA IPC writes).
// - Batch: what one submit_* call sends. It may hold many runs and touch
//   several destination regions of ONE peer. The receiver counts exactly one
//   completion for the batch's imm once every byte of it has been stored.
//   Runs of a batch and different batches may land in any order.
// - imm: a 32-bit value chosen by the protocol (e.g. one per reservation). The
//   receiver stores writes carrying `imm` only while `imm` is armed; frames for
//   an unarmed imm are dropped and counted (stats().num_dropped_frames).
//
// Errors: every run-time failure is a Status. A batch whose bytes or offsets fall
// outside a region fails with kOutOfRange before anything is sent (and the
// receiver checks again, closing the connection on a bad frame). A dead peer
// (connection reset, process killed, connect refused) fails the pending and
// later batches to it with kUnavailable naming the peer; waits on imms armed for
// that writer fail the same way; timeouts are kDeadlineExceeded.
//
// Guarantee used for page reuse (DESIGN section 2), per transport:
// - TCP: after disarm(imm) returns, no byte of any write carrying imm will be
//   stored any more (a frame being stored at that moment is finished or its
//   connection is closed before disarm returns). So D may reuse the pages.
// - CUDA IPC and ibverbs: the writer's hardware stores bytes directly; disarm only
//   stops counting. Reuse needs the writer's own cancel() + acknowledgement, or
//   proof that the writer died (peer lost).
//
// Threads: every public method of TransferEngine may be called from any thread
// concurrently, except the destructor (one thread, after all other calls have
// returned). The engine runs its own I/O threads. Callbacks (completion, peer
// lost) run on those I/O threads: they must be short, must not block and must
// not call wait()/wait_for()/disarm()/cancel()/the destructor of this engine.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/status.h"

namespace moe::transfer {

enum class TransportKind : uint8_t {
  kTcp,      // host memory; payload through TCP sockets (default, works everywhere)
  kCudaIpc,  // device memory of GPUs of one host; cudaMemcpyAsync peer copies
  kIbverbs,  // RC WRITE_WITH_IMM (compiled only when libibverbs is present)
};
enum class MemoryKind : uint8_t { kHost, kDevice };

const char* transport_name(TransportKind kind);  // "tcp", "cuda_ipc", "ibverbs"
const char* memory_kind_name(MemoryKind kind);   // "host", "device"

using RegionId = uint64_t;  // unique within one engine, never reused
using TransferId = uint64_t;  // sender side: one per submitted batch, never reused

// What a peer needs to write into a region. Plain data; to_json/from_json are
// the wire form (from_json validates every field and rejects unknown kinds).
struct RegionDescriptor {
  std::string endpoint;          // owning engine, "127.0.0.1:41234"
  RegionId region_id = 0;
  uint64_t base_address = 0;     // the owner's virtual address (ibverbs needs it; informational otherwise)
  uint64_t length_bytes = 0;
  TransportKind transport = TransportKind::kTcp;
  MemoryKind memory = MemoryKind::kHost;
  int device = -1;               // CUDA ordinal for device memory, else -1
  std::string host_id;           // the owner's host (boot id); CUDA IPC needs the same host
  std::string export_data;       // transport-specific, hex: cudaIpcMemHandle_t; ibverbs "qpn/rkey/gid"

  nlohmann::json to_json() const;
  static Expected<RegionDescriptor> from_json(const nlohmann::json& json);
};

// A contiguous copy inside a batch: src offset in the local source region,
// dst offset in destination region `dst_index` of the batch.
struct Run {
  uint64_t src_offset = 0;
  uint64_t dst_offset = 0;
  uint64_t length_bytes = 0;
};

// One (source region, destination region) pair and its runs.
struct RegionRuns {
  RegionId src_region = 0;
  RegionDescriptor dst;
  std::vector<Run> runs;
};

// Paged copy: page i goes from src_base_offset + src_pages[i] * src_page_stride_bytes
// to dst_base_offset + dst_pages[i] * dst_page_stride_bytes, page_bytes each.
// src_pages and dst_pages have the same length. Adjacent pages are coalesced.
struct PagedWrite {
  RegionId src_region = 0;
  RegionDescriptor dst;
  std::span<const int32_t> src_pages;
  std::span<const int32_t> dst_pages;
  uint64_t src_base_offset = 0;
  uint64_t src_page_stride_bytes = 0;
  uint64_t dst_base_offset = 0;
  uint64_t dst_page_stride_bytes = 0;
  uint64_t page_bytes = 0;
};

struct SubmitOptions {
  // Called once on an I/O thread when the batch is done at the sender (all bytes
  // handed to the transport and, for CUDA IPC, the copy finished) or failed.
  // "Done at the sender" is not "stored at the receiver": the receiver's
  // counter is the only proof of delivery.
  std::function<void(TransferId, const Status&)> on_done;
};

// Receiver-side state of one imm.
struct ImmState {
  bool armed = false;
  uint64_t num_completed = 0;  // whole batches stored
  uint64_t num_bytes = 0;      // payload bytes stored so far (all batches, partial ones too)
  Status error;                // set when the armed writer was lost
};

struct EngineStats {
  uint64_t num_bytes_sent = 0;
  uint64_t num_bytes_received = 0;
  uint64_t num_batches_completed = 0;  // at this engine as receiver
  uint64_t num_dropped_frames = 0;     // well-formed frames for an unarmed imm
  uint64_t num_bad_frames = 0;         // malformed / out-of-bounds frames (connection closed)
  uint64_t num_connections_lost = 0;   // inbound or outbound connections that ended uncleanly
};

struct EngineOptions {
  std::string listen_host = "127.0.0.1";
  uint16_t listen_port = 0;             // 0: any free port; endpoint() tells which
  int num_connections_per_peer = 4;     // TCP data connections opened to each peer (1..16)
  uint64_t max_frame_bytes = 1 << 20;   // a batch is cut into frames of at most this payload
  std::chrono::milliseconds connect_timeout{5000};
  bool enable_cuda_ipc = true;          // when compiled with CUDA and a device exists
  bool enable_ibverbs = false;          // when compiled with libibverbs and a device exists
  // Fault injection for protocol tests: this engine, as a sender, stops sending
  // (without closing its connections) once it has sent this many payload bytes
  // in total. Pending batches then complete only by cancel(), timeout or peer
  // loss. 0 = off. Also read from MOE_TRANSFER_STALL_AFTER_BYTES by
  // apply_env_overrides().
  uint64_t stall_after_bytes = 0;
};

// Returns `options` with fault-injection settings taken from the environment
// (MOE_TRANSFER_STALL_AFTER_BYTES); invalid values are an error.
Expected<EngineOptions> apply_env_overrides(EngineOptions options);

class TransferEngine {
 public:
  // Starts the listener and the I/O threads. Fails when the port cannot be bound.
  static Expected<std::unique_ptr<TransferEngine>> create(const EngineOptions& options);
  virtual ~TransferEngine() = default;

  // "host:port" of the listener; peers name this engine by it.
  virtual const std::string& endpoint() const = 0;
  // Transports usable here (kTcp always; others when compiled and a device exists).
  virtual std::vector<TransportKind> transports() const = 0;

  // ---- memory registration (sender and receiver) ----
  // Host memory goes to TCP (or ibverbs when enabled and a device exists); device
  // memory (cudaMalloc) to CUDA IPC, unless `transport` says otherwise. The memory
  // must outlive the registration and every local batch that reads it.
  virtual Expected<RegionId> register_region(void* base, uint64_t length_bytes, MemoryKind memory = MemoryKind::kHost,
                                             int device = -1, std::optional<TransportKind> transport = {}) = 0;
  // Waits until no write into the region is being stored, then forgets it;
  // later frames for it are bad frames. Local batches reading it must be done.
  virtual Status deregister_region(RegionId region) = 0;
  virtual Expected<RegionDescriptor> describe(RegionId region) const = 0;

  // ---- sender ----
  // Each call is one batch = one completion of `imm` at the receiver. Runs are
  // checked against both regions' bounds first (kOutOfRange, nothing sent).
  // Returns at once; the batch proceeds on the I/O threads.
  virtual Expected<TransferId> submit_write(RegionId src_region, uint64_t src_offset, const RegionDescriptor& dst,
                                            uint64_t dst_offset, uint64_t length_bytes, uint32_t imm,
                                            SubmitOptions options = {}) = 0;
  virtual Expected<TransferId> submit_paged(const PagedWrite& write, uint32_t imm, SubmitOptions options = {}) = 0;
  // Every group must name a destination on the same peer (same endpoint).
  virtual Expected<TransferId> submit_scattered(std::span<const RegionRuns> groups, uint32_t imm,
                                                SubmitOptions options = {}) = 0;
  // A batch with no bytes: one completion of `imm` at the peer (e.g. a commit marker).
  virtual Expected<TransferId> submit_notify(const std::string& peer_endpoint, uint32_t imm,
                                             SubmitOptions options = {}) = 0;

  // Sender-side completion of a batch (see SubmitOptions::on_done for its meaning).
  // wait: ok, the batch's error, or kDeadlineExceeded (the batch goes on).
  virtual Status wait(TransferId id, std::chrono::milliseconds timeout) = 0;
  // nullopt while pending; the result once done. A result is handed out once:
  // after wait() or poll() returned it (or on_done ran), the id is forgotten and
  // wait()/poll() on it give kNotFound.
  virtual std::optional<Status> poll(TransferId id) = 0;
  // Drops the result of a batch nobody will wait for: kept no longer once done.
  // (wait() with a zero timeout on a pending batch does not forget it.)
  virtual void forget(TransferId id) = 0;
  // Fails every batch of `imm` not yet fully sent, with kAborted; when it returns
  // no further byte of them leaves this engine (TCP, ibverbs), or for CUDA IPC every
  // issued copy has finished. Batches already done are unaffected.
  virtual Status cancel(uint32_t imm) = 0;

  // ---- receiver ----
  // Starts accepting writes for `imm` and resets its counter. With `writer`
  // (an endpoint), losing that peer fails the imm's waits with kUnavailable.
  virtual Status arm(uint32_t imm, std::optional<std::string> writer = {}) = 0;
  // Stops accepting writes for `imm` and forgets its counter (see the guarantee
  // per transport above). Waits on it end with kAborted. Idempotent.
  virtual Status disarm(uint32_t imm) = 0;
  // Blocks until `imm` has at least `expected_batches` completions: ok;
  // kDeadlineExceeded on timeout; kUnavailable if its writer was lost; kAborted if
  // disarmed meanwhile; kNotFound if not armed.
  virtual Status wait_for(uint32_t imm, uint64_t expected_batches, std::chrono::milliseconds timeout) = 0;
  // Non-blocking: the imm's state (armed == false if not armed).
  virtual ImmState poll_imm(uint32_t imm) const = 0;
  // Called after each completed batch with (imm, num_completed so far).
  virtual void set_completion_callback(std::function<void(uint32_t imm, uint64_t num_completed)> callback) = 0;
  // Called when a peer (inbound or outbound) is lost, with its endpoint and why;
  // possibly once per connection of that peer. Runs before waits on imms armed
  // for that writer fail.
  virtual void set_peer_lost_callback(std::function<void(const std::string& peer, const Status& why)> callback) = 0;

  virtual EngineStats stats() const = 0;
};

}  // namespace moe::transfer
