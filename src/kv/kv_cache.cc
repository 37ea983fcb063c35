#include "kv/kv_cache.h"

namespace moe::kv {

namespace {
Shape pool_shape(const KvCacheLayout& l) { return {l.num_pages, l.num_kv_heads, l.page_size, l.head_dim}; }
void check_dtype(const KvCacheLayout& l) {
  CHECK(l.dtype == DType::kF32 || l.dtype == DType::kBF16, "KV dtype {}", dtype_name(l.dtype));
}
}  // namespace

KvCache::KvCache(const KvCacheLayout& layout) : layout_(layout), allocator_(layout.num_pages) {
  check_dtype(layout);
  for (int l = 0; l < layout.num_layers; ++l) {
    owned_.emplace_back(layout.dtype, pool_shape(layout));
    k_pages_.push_back(owned_.back());
    owned_.emplace_back(layout.dtype, pool_shape(layout));
    v_pages_.push_back(owned_.back());
  }
}

KvCache::KvCache(const KvCacheLayout& layout, void* memory, Device device)
    : layout_(layout), device_(device), allocator_(layout.num_pages) {
  check_dtype(layout);
  auto* at = static_cast<char*>(memory);
  const size_t pool_bytes = layout.page_bytes() / 2 * static_cast<size_t>(layout.num_pages);
  for (int l = 0; l < layout.num_layers; ++l) {
    k_pages_.emplace_back(at, layout.dtype, pool_shape(layout), device);
    v_pages_.emplace_back(at + pool_bytes, layout.dtype, pool_shape(layout), device);
    at += 2 * pool_bytes;
  }
}

ops::PagedKv KvCache::layer(int layer) const {
  return {k_pages_.at(static_cast<size_t>(layer)), v_pages_.at(static_cast<size_t>(layer))};
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
