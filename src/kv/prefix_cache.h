// Page ownership for the serving engine: reference counts over the pages of a
// PageAllocator, and a prefix cache of full pages keyed by hash chains.
//
// A full page whose KV is computed can be published under the hash of its
// tokens chained with the hash of every page before it, so a hash names a whole
// prefix, not one page. A new sequence acquires the longest run of published
// pages that starts its tokens and computes only the rest. Pages are shared by
// reference count; a published page whose count drops to zero is kept (with its
// KV) as "evictable" and reused for a later hit, or evicted, least recently
// released first, when allocate() runs out of free pages. An unpublished page
// goes back to the allocator as soon as its count is zero.
//
// The hash map entry keeps the page's tokens and parent hash, so a 64-bit hash
// collision is detected and treated as a miss, never as wrong KV.
//
// Deterministic (no clocks, no randomness). Not thread-safe: owned by the
// engine thread, like the allocator it wraps.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <unordered_map>
#include <vector>

#include "core/status.h"
#include "kv/page_allocator.h"

namespace moe::kv {

// Hash of a page's tokens chained to the hash of the prefix before it
// (kRootHash for the first page).
inline constexpr uint64_t kRootHash = 0x6d6f657365727665ull;
uint64_t chain_hash(uint64_t parent, std::span<const int32_t> page_tokens);

class PrefixCache {
 public:
  // `enabled` false: publish() and acquire_prefix() do nothing, so released
  // pages are freed at once (plain reference-counted pages).
  PrefixCache(int32_t num_pages, int page_size, bool enabled);

  int page_size() const { return page_size_; }
  int32_t num_pages() const { return allocator_.num_pages(); }
  // Pages allocate() can hand out now: free plus evictable.
  int32_t num_available() const { return allocator_.num_free() + static_cast<int32_t>(evictable_.size()); }
  // Pages referenced by at least one sequence.
  int32_t num_used() const { return num_pages() - num_available(); }
  int32_t num_evictable() const { return static_cast<int32_t>(evictable_.size()); }

  // The longest run of published pages that starts `tokens`, at most
  // `max_pages` of them; each returned page gains a reference.
  std::vector<int32_t> acquire_prefix(std::span<const int32_t> tokens, int32_t max_pages);

  // `count` pages with one reference each, evicting cached pages when needed;
  // kResourceExhausted (and nothing taken) when fewer are available.
  Expected<std::vector<int32_t>> allocate(int32_t count);

  // Drops one reference from each page.
  void release(std::span<const int32_t> pages);

  // Publishes `page` (referenced, its KV complete) as the page holding
  // `page_tokens` after the prefix hashed `parent`; returns the chain hash. When
  // that prefix is already published by another page, this one stays private.
  uint64_t publish(uint64_t parent, std::span<const int32_t> page_tokens, int32_t page);

  // CHECKs: counts, the evictable set, the hash map and the allocator agree.
  void check_invariants() const;

 private:
  struct Entry {
    int32_t page = -1;
    uint64_t parent = 0;
    std::vector<int32_t> tokens;
  };
  void evict_one();

  PageAllocator allocator_;
  int page_size_;
  bool enabled_;
  std::vector<int32_t> ref_count_;             // by page
  std::vector<uint64_t> hash_of_page_;         // by page; 0: not published
  std::vector<uint64_t> evict_tick_;           // by page; key into evictable_
  std::unordered_map<uint64_t, Entry> by_hash_;
  std::map<uint64_t, int32_t> evictable_;      // release tick -> page, oldest first
  uint64_t tick_ = 0;
};

}  // namespace moe::kv
