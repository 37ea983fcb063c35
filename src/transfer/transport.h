// Internal pieces shared by the transports of the TransferEngine (not part of
// the public API; see transfer_engine.h):
// - BatchTracker: sender-side state of submitted batches (one result each).
// - Receiver: the registered regions and the armed imms with their counters;
//   every transport stores incoming bytes only through it, so bounds checks,
//   imm arming and the disarm fence live in one place.
// - Transport: the interface each transport class implements.
//
// Threads: BatchTracker and Receiver are thread-safe (one mutex each, condition
// variables for waits). Callbacks run with no lock held.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "transfer/transfer_engine.h"
#include "transfer/wire.h"

namespace moe::transfer {

struct LocalRegion {
  RegionId id = 0;
  uint8_t* base = nullptr;
  uint64_t length_bytes = 0;
  MemoryKind memory = MemoryKind::kHost;
  int device = -1;
  TransportKind transport = TransportKind::kTcp;
};

// ---------------------------------------------------------------- sender side

struct BatchState {
  TransferId id = 0;
  uint32_t imm = 0;
  std::string peer;
  std::function<void(TransferId, const Status&)> on_done;
  // Frames not yet fully handed to the transport; the batch is done at 0.
  std::atomic<uint64_t> num_frames_left{0};
  std::atomic<bool> finished{false};  // set once, by BatchTracker::finish
};

class BatchTracker {
 public:
  std::shared_ptr<BatchState> start(uint32_t imm, std::string peer, SubmitOptions options, uint64_t num_frames);
  // Records the result (the first call wins) and wakes waiters / runs on_done.
  void finish(const std::shared_ptr<BatchState>& batch, const Status& status);
  // One frame handed over; finishes the batch with ok at the last one.
  void frame_sent(const std::shared_ptr<BatchState>& batch);
  Status wait(TransferId id, std::chrono::milliseconds timeout);
  std::optional<Status> poll(TransferId id);
  // Drops the entry now if done, else as soon as it finishes.
  void forget(TransferId id);
  // Unfinished batches of imm (for cancel).
  std::vector<std::shared_ptr<BatchState>> unfinished(uint32_t imm);
  // Fails every unfinished batch (engine shutdown).
  void fail_all(const Status& status);

 private:
  struct Entry {
    std::shared_ptr<BatchState> batch;
    std::optional<Status> result;
    bool forgotten = false;
  };
  std::mutex mutex_;
  std::condition_variable done_cv_;
  TransferId next_id_ = 1;
  std::unordered_map<TransferId, Entry> entries_;
};

// A validated batch, ready for a transport: pointers into local memory and
// destination (region, offset) pairs, already cut into frames.
struct OutFrame {
  const uint8_t* src = nullptr;
  size_t dst_index = 0;  // into OutBatch::dsts
  uint64_t dst_offset = 0;
  uint64_t length_bytes = 0;
};
struct OutBatch {
  std::shared_ptr<BatchState> state;
  std::vector<RegionDescriptor> dsts;
  std::vector<OutFrame> frames;  // empty: an imm-only batch (one notify frame)
  MemoryKind src_memory = MemoryKind::kHost;  // of the first group's source region
  int src_device = -1;
};

// -------------------------------------------------------------- receiver side

// A connection that can be torn down to fence an imm (the TCP transport).
class Fenceable {
 public:
  virtual ~Fenceable() = default;
  virtual void abort_connection() = 0;
};

class Receiver {
 public:
  // ---- regions
  void add_region(const LocalRegion& region);
  Status remove_region(RegionId id);  // waits until no store into it is running
  std::optional<LocalRegion> find_region(RegionId id) const;

  // ---- imms (public API, see TransferEngine)
  Status arm(uint32_t imm, std::optional<std::string> writer);
  Status disarm(uint32_t imm);
  Status wait_for(uint32_t imm, uint64_t expected_batches, std::chrono::milliseconds timeout);
  ImmState poll_imm(uint32_t imm) const;
  void set_completion_callback(std::function<void(uint32_t, uint64_t)> callback);

  // ---- transports
  // Decides what to do with a write frame: store at the returned pointer, or
  // drop (imm not armed), or reject (an error message; the connection closes).
  struct StoreTicket {
    enum class Kind { kStore, kDrop, kReject } kind = Kind::kDrop;
    uint8_t* dst = nullptr;
    std::string reject_reason;
  };
  StoreTicket begin_store(const wire::FrameHeader& header, Fenceable* connection);
  // After a kStore ticket: the payload was stored (ok) or the connection failed.
  // Counts the frame toward its batch when ok. Returns false when a limit was hit
  // (the connection must be closed).
  bool end_store(const wire::FrameHeader& header, uint64_t sender_nonce, Fenceable* connection, bool ok);
  // A kNotify frame (or a transport's out-of-band completion).
  bool notify_frame(const wire::FrameHeader& header, uint64_t sender_nonce);
  // A peer's connection ended without goodbye: fail imms armed for that writer,
  // forget its partial batches.
  void peer_lost(const std::string& peer, uint64_t sender_nonce, const Status& why);

  void count_dropped_frame() { num_dropped_frames_.fetch_add(1); }
  uint64_t num_dropped_frames() const { return num_dropped_frames_.load(); }
  uint64_t num_batches_completed() const { return num_batches_completed_.load(); }
  uint64_t num_bytes_received() const { return num_bytes_received_.load(); }

 private:
  struct Imm {
    std::optional<std::string> writer;
    uint64_t num_completed = 0;
    uint64_t num_bytes = 0;
    Status error;
    bool disarming = false;
    uint64_t generation = 0;          // tells a waiter that its imm was disarmed (and maybe re-armed)
    std::vector<Fenceable*> storing;  // connections storing a frame of this imm now
  };
  struct RegionEntry {
    LocalRegion region;
    std::vector<Fenceable*> storing;  // connections storing into this region now
    bool removing = false;
  };
  // Must hold mutex_. Counts one frame of (nonce, batch_id); true when the batch is complete.
  bool count_frame_locked(uint64_t sender_nonce, const wire::FrameHeader& header, bool& limit_hit);

  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::unordered_map<RegionId, RegionEntry> regions_;
  std::unordered_map<uint32_t, Imm> imms_;
  // Partial batches: (sender nonce, batch id) -> (imm, frames left).
  std::map<std::pair<uint64_t, uint64_t>, std::pair<uint32_t, uint32_t>> partial_;
  uint64_t next_generation_ = 1;
  std::shared_ptr<std::function<void(uint32_t, uint64_t)>> on_complete_;
  std::atomic<uint64_t> num_dropped_frames_{0};
  std::atomic<uint64_t> num_batches_completed_{0};
  std::atomic<uint64_t> num_bytes_received_{0};
};

// ---------------------------------------------------------------- transports

class Transport {
 public:
  virtual ~Transport() = default;
  virtual TransportKind kind() const = 0;
  // Fills the transport-specific fields of a local region's descriptor.
  virtual Status export_region(const LocalRegion& region, RegionDescriptor& descriptor) = 0;
  virtual void forget_region(RegionId /*id*/) {}
  // Takes a validated batch; finishes batch.state exactly once, now or later.
  virtual Status submit(OutBatch batch) = 0;
  // Stops sending the given (already failed) batches; returns when no byte of
  // them is in flight any more.
  virtual void cancel(const std::vector<std::shared_ptr<BatchState>>& batches) = 0;
  // Stops the I/O threads (called once, before destruction).
  virtual void shutdown() = 0;
};

}  // namespace moe::transfer
