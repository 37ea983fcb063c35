#include "kv/page_allocator.h"

#include <algorithm>
#include <functional>

#include "core/check.h"

namespace moe::kv {

PageAllocator::PageAllocator(int32_t num_pages) : num_pages_(num_pages), in_use_(static_cast<size_t>(num_pages)) {
  CHECK(num_pages >= 0, "num_pages {}", num_pages);
  free_.resize(static_cast<size_t>(num_pages));
  for (int32_t i = 0; i < num_pages; ++i) free_[i] = i;
  std::make_heap(free_.begin(), free_.end(), std::greater<>());
}

Expected<std::vector<int32_t>> PageAllocator::allocate(int32_t count) {
  CHECK(count >= 0, "allocate {}", count);
  if (count > num_free())
    return resource_exhausted("need {} KV pages, {} of {} are free", count, num_free(), num_pages_);
  std::vector<int32_t> pages;
  pages.reserve(static_cast<size_t>(count));
  for (int32_t i = 0; i < count; ++i) {
    std::pop_heap(free_.begin(), free_.end(), std::greater<>());
    pages.push_back(free_.back());
    free_.pop_back();
    in_use_[pages.back()] = true;
  }
  return pages;
}

void PageAllocator::free(std::span<const int32_t> pages) {
  for (int32_t page : pages) {
    CHECK(page >= 0 && page < num_pages_, "free of page {} (pool of {})", page, num_pages_);
    CHECK(in_use_[page], "page {} freed twice", page);
    in_use_[page] = false;
    free_.push_back(page);
    std::push_heap(free_.begin(), free_.end(), std::greater<>());
  }
}

void PageAllocator::check_invariants() const {
  std::vector<int> seen(static_cast<size_t>(num_pages_));
  for (int32_t page : free_) {
    CHECK(page >= 0 && page < num_pages_ && !in_use_[page], "free list holds page {} in use", page);
    CHECK(++seen[page] == 1, "page {} twice on the free list", page);
  }
  const auto in_use = std::count(in_use_.begin(), in_use_.end(), true);
  CHECK(static_cast<size_t>(in_use) + free_.size() == static_cast<size_t>(num_pages_), "{} in use + {} free != {}",
        in_use, free_.size(), num_pages_);
}

}  // namespace moe::kv
