// Symmetric memory on the CPU: one POSIX shared-memory segment per rank, every
// rank's segment mapped by every rank, so the collectives read like their GPU
// twins (comm/cuda): write into your own buffer, raise a flag in each peer's
// flag area, wait for the peers' flags in yours, read the peers' buffers.
//
// Segment of rank r ("/moe_<name>_<r>"), page aligned:
//   [0, 4 KiB)        header: magic (written last, release), geometry, the
//                     "mapped everything" flag, one control word
//   [4 KiB, 8 KiB)    flags[kMaxRanks]: 64-byte slots; slot s is written only by
//                     rank s (a sequence number, only ever increased)
//   [8 KiB, ...)      the data buffer, buffer_bytes
// Works when ranks are processes (fork, separate launches) and when they are
// threads of one process (each maps every segment itself). A segment's name is
// unlinked by its owner as soon as every rank has mapped everything, and on
// every error path, so nothing stays in /dev/shm unless a process is killed
// during setup.
//
// Synchronisation: barrier() is an all-to-all of sequence numbers. Every rank
// calls the same barriers in the same order, so the n-th barrier carries
// sequence n on every rank; a rank waits until each peer's slot holds >= n.
// Nothing is ever reset, so consecutive barriers cannot race. Data written
// before barrier() is visible to every peer after its barrier() (release on
// the flag store, acquire on the flag load). A wait spins, then yields, and
// fails with DeadlineExceeded naming the ranks that did not arrive, or, as
// soon as it sees one (it looks every 20 ms), with Unavailable naming a rank
// whose process has exited: the header records each owner's pid and start
// time, and a zombie counts as exited.
//
// Threads: one thread per rank uses its ShmSymmetricMemory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace moe::comm {

class ShmSymmetricMemory {
 public:
  static constexpr int kMaxRanks = 64;

  // Creates this rank's segment, maps every peer's (waiting up to timeout_ms
  // for them to appear), and unlinks its own name once all ranks have mapped
  // all segments. world_size 1 uses private anonymous memory and no names.
  static Expected<std::unique_ptr<ShmSymmetricMemory>> open(const std::string& name, int rank, int world_size,
                                                            size_t buffer_bytes, int timeout_ms);
  ~ShmSymmetricMemory();
  ShmSymmetricMemory(const ShmSymmetricMemory&) = delete;
  ShmSymmetricMemory& operator=(const ShmSymmetricMemory&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  size_t buffer_bytes() const { return buffer_bytes_; }
  const std::string& name() const { return name_; }

  // The data buffer of rank r as mapped in this process (r == rank(): ours).
  std::byte* buffer(int r) const { return segments_[r] + kDataOffset; }
  std::byte* local_buffer() const { return buffer(rank_); }
  template <typename T>
  T* buffer_as(int r) const {
    return reinterpret_cast<T*>(buffer(r));
  }

  // kControlWords 64-bit words per rank that the owner writes before a
  // barrier and the peers read after it (sizes, counts: what every rank must
  // agree on before it can act).
  static constexpr int kControlWords = 4;
  void set_control(int word, uint64_t value);
  uint64_t control(int r, int word) const;

  // All ranks meet. `what` names the step in the timeout message.
  Status barrier(std::string_view what);

  // After a failed barrier the group is out of step; every later call fails.
  bool broken() const { return broken_; }

 private:
  static constexpr size_t kHeaderBytes = 4096;
  static constexpr size_t kFlagBytes = 4096;
  static constexpr size_t kDataOffset = kHeaderBytes + kFlagBytes;

  ShmSymmetricMemory() = default;
  Status create_local();
  Status map_peer(int r, int64_t deadline_ns);
  Status wait_all_mapped(int64_t deadline_ns);
  void unlink_own_name();
  uint64_t* flag_slot(int owner, int writer) const;
  bool peer_exited(int r) const;
  std::string segment_name(int r) const;

  std::string name_;
  int rank_ = 0, world_size_ = 1;
  size_t buffer_bytes_ = 0, segment_bytes_ = 0;
  int timeout_ms_ = 0;
  std::vector<std::byte*> segments_;  // [world_size]; nullptr until mapped
  bool own_name_linked_ = false;
  uint64_t sequence_ = 0;
  bool broken_ = false;
};

// Wait helpers shared by the CPU waits.
int64_t monotonic_ns();
void cpu_relax();    // a pause instruction
void yield_thread();  // sched_yield

// Spins, then yields, until ready() or the deadline; false on timeout.
template <typename Ready>
bool wait_until(Ready ready, int64_t deadline_ns) {
  for (int i = 0; i < 2048; ++i) {
    if (ready()) return true;
    cpu_relax();
  }
  while (!ready()) {
    if (monotonic_ns() > deadline_ns) return ready();
    yield_thread();
  }
  return true;
}

}  // namespace moe::comm
