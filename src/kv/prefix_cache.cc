#include "kv/prefix_cache.h"

#include <algorithm>

#include "core/check.h"

namespace moe::kv {

uint64_t chain_hash(uint64_t parent, std::span<const int32_t> page_tokens) {
  // splitmix64 steps over the parent and each token: cheap, well mixed, stable
  // across runs and machines (no std::hash).
  auto mix = [](uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
  };
  uint64_t h = mix(parent);
  for (int32_t t : page_tokens) h = mix(h ^ static_cast<uint32_t>(t));
  return h == 0 ? 1 : h;  // 0 marks "not published"
}

PrefixCache::PrefixCache(int32_t num_pages, int page_size, bool enabled)
    : allocator_(num_pages),
      page_size_(page_size),
      enabled_(enabled),
      ref_count_(static_cast<size_t>(num_pages)),
      hash_of_page_(static_cast<size_t>(num_pages)),
      evict_tick_(static_cast<size_t>(num_pages)) {
  CHECK(page_size > 0, "page_size {}", page_size);
}

std::vector<int32_t> PrefixCache::acquire_prefix(std::span<const int32_t> tokens, int32_t max_pages) {
  std::vector<int32_t> pages;
  if (!enabled_) return pages;
  uint64_t parent = kRootHash;
  const auto full_pages = static_cast<int32_t>(tokens.size() / static_cast<size_t>(page_size_));
  for (int32_t i = 0; i < std::min(full_pages, max_pages); ++i) {
    auto page_tokens = tokens.subspan(static_cast<size_t>(i) * page_size_, static_cast<size_t>(page_size_));
    const uint64_t h = chain_hash(parent, page_tokens);
    auto it = by_hash_.find(h);
    if (it == by_hash_.end() || it->second.parent != parent ||
        !std::equal(page_tokens.begin(), page_tokens.end(), it->second.tokens.begin(), it->second.tokens.end()))
      break;
    const int32_t page = it->second.page;
    if (ref_count_[page]++ == 0) {
      evictable_.erase(evict_tick_[page]);
    }
    pages.push_back(page);
    parent = h;
  }
  return pages;
}

void PrefixCache::evict_one() {
  CHECK(!evictable_.empty(), "evict with nothing evictable");
  const int32_t page = evictable_.begin()->second;
  evictable_.erase(evictable_.begin());
  by_hash_.erase(hash_of_page_[page]);
  hash_of_page_[page] = 0;
  const int32_t one[] = {page};
  allocator_.free(one);
}

Expected<std::vector<int32_t>> PrefixCache::allocate(int32_t count) {
  CHECK(count >= 0, "allocate {}", count);
  if (count > num_available())
    return resource_exhausted("need {} KV pages, {} of {} are available", count, num_available(), num_pages());
  while (allocator_.num_free() < count) evict_one();
  MOE_ASSIGN_OR_RETURN(auto pages, allocator_.allocate(count));
  for (int32_t page : pages) ref_count_[page] = 1;
  return pages;
}

void PrefixCache::release(std::span<const int32_t> pages) {
  for (int32_t page : pages) {
    CHECK(page >= 0 && page < num_pages() && ref_count_[page] > 0, "release of unreferenced page {}", page);
    if (--ref_count_[page] > 0) continue;
    if (hash_of_page_[page] != 0) {
      evict_tick_[page] = ++tick_;
      evictable_.emplace(tick_, page);
    } else {
      const int32_t one[] = {page};
      allocator_.free(one);
    }
  }
}

uint64_t PrefixCache::publish(uint64_t parent, std::span<const int32_t> page_tokens, int32_t page) {
  CHECK(static_cast<int>(page_tokens.size()) == page_size_, "publish of a partial page ({} tokens)",
        page_tokens.size());
  CHECK(page >= 0 && page < num_pages() && ref_count_[page] > 0, "publish of unreferenced page {}", page);
  const uint64_t h = chain_hash(parent, page_tokens);
  if (!enabled_ || hash_of_page_[page] != 0) return h;
  auto [it, inserted] = by_hash_.try_emplace(h);
  if (!inserted) return h;  // another page already holds this prefix
  it->second = Entry{page, parent, std::vector<int32_t>(page_tokens.begin(), page_tokens.end())};
  hash_of_page_[page] = h;
  return h;
}

void PrefixCache::check_invariants() const {
  allocator_.check_invariants();
  CHECK(allocator_.num_free() + static_cast<int32_t>(evictable_.size()) +
                static_cast<int32_t>(std::count_if(ref_count_.begin(), ref_count_.end(), [](int32_t c) { return c > 0; })) ==
            num_pages(),
        "free + evictable + referenced != {} pages", num_pages());
  for (const auto& [tick, page] : evictable_) {
    CHECK(ref_count_[page] == 0 && hash_of_page_[page] != 0 && evict_tick_[page] == tick, "evictable page {}", page);
  }
  for (const auto& [h, entry] : by_hash_) CHECK(hash_of_page_[entry.page] == h, "hash map entry of page {}", entry.page);
  for (int32_t page = 0; page < num_pages(); ++page)
    if (hash_of_page_[page] != 0) CHECK(by_hash_.count(hash_of_page_[page]) == 1, "published page {} not in map", page);
}

}  // namespace moe::kv
