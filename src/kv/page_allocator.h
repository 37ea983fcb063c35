// Fixed pool of KV pages handed out by id.
//
// Pages are numbered 0..num_pages-1. allocate() takes the lowest-numbered free
// pages first, so runs are deterministic for a given sequence of calls (the
// scheduler's tests rely on it). Not thread-safe: owned by the engine thread.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/status.h"

namespace moe::kv {

class PageAllocator {
 public:
  explicit PageAllocator(int32_t num_pages);

  int32_t num_pages() const { return num_pages_; }
  int32_t num_free() const { return static_cast<int32_t>(free_.size()); }

  // `count` pages, or kResourceExhausted (and nothing taken) when fewer are free.
  Expected<std::vector<int32_t>> allocate(int32_t count);
  // Returns pages to the pool; a page freed twice or out of range is a bug (CHECK).
  void free(std::span<const int32_t> pages);
  // CHECKs that every page is either free or in use, exactly once.
  void check_invariants() const;

 private:
  int32_t num_pages_;
  std::vector<int32_t> free_;  // a min-heap of free page ids
  std::vector<bool> in_use_;
};

}  // namespace moe::kv
