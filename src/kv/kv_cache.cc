#include "kv/kv_cache.h"

namespace moe::kv {

KvCache::KvCache(const KvCacheLayout& layout) : layout_(layout), allocator_(layout.num_pages) {
  CHECK(layout.dtype == DType::kF32 || layout.dtype == DType::kBF16, "KV dtype {}", dtype_name(layout.dtype));
  const Shape shape{layout.num_pages, layout.num_kv_heads, layout.page_size, layout.head_dim};
  for (int l = 0; l < layout.num_layers; ++l) {
    k_pages_.emplace_back(layout.dtype, shape);
    v_pages_.emplace_back(layout.dtype, shape);
  }
}

ops::PagedKv KvCache::layer(int layer) const {
  return {k_pages_.at(static_cast<size_t>(layer)).view(), v_pages_.at(static_cast<size_t>(layer)).view()};
}

Status PageTable::reserve(int32_t num_tokens, int page_size, PageAllocator& allocator) {
  const int32_t needed = (num_tokens + page_size - 1) / page_size - static_cast<int32_t>(pages_.size());
  if (needed <= 0) return Status::ok();
  MOE_ASSIGN_OR_RETURN(auto pages, allocator.allocate(needed));
  pages_.insert(pages_.end(), pages.begin(), pages.end());
  return Status::ok();
}

void PageTable::release(PageAllocator& allocator) {
  allocator.free(pages_);
  pages_.clear();
}

}  // namespace moe::kv
