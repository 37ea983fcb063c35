// A named POSIX shared-memory region: the KV caches of a parallel instance's
// ranks live in such regions (created by the leader, mapped by each follower),
// so the leader can send every rank's heads to a decode instance
// (docs/parallel.md).
//
// Threads: any; the mapping is read and written by the ranks' engine threads,
// ordered by their collectives.
#pragma once

#include <cstddef>
#include <string>

#include "core/status.h"

namespace moe::kv {

class ShmRegion {
 public:
  // A new zeroed region of `num_bytes` (fails if the name exists).
  static Expected<ShmRegion> create(const std::string& name, size_t num_bytes);
  // An existing region, which must be `num_bytes` long.
  static Expected<ShmRegion> open(const std::string& name, size_t num_bytes);

  ShmRegion(ShmRegion&& other) noexcept;
  ShmRegion& operator=(ShmRegion&& other) noexcept;
  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;
  ~ShmRegion();  // unmaps (and unlinks the name if this process created it and has not yet)

  void* data() const { return data_; }
  size_t num_bytes() const { return num_bytes_; }
  // Removes the name (the mappings stay): once every rank has mapped it.
  void unlink();

 private:
  ShmRegion(std::string name, void* data, size_t num_bytes, bool owner)
      : name_(std::move(name)), data_(data), num_bytes_(num_bytes), linked_(owner) {}
  std::string name_;
  void* data_ = nullptr;
  size_t num_bytes_ = 0;
  bool linked_ = false;  // this process created the name and it still exists
};

}  // namespace moe::kv
