// The KV cache of one model instance: for every layer a pool of pages, HND
// within a page (DESIGN section 4):
//   k_pages, v_pages [num_pages, num_kv_heads, page_size, head_dim]
// and the per-sequence page tables that map a sequence's positions to pages.
// Not thread-safe: owned by the engine thread.
#pragma once

#include <vector>

#include "core/tensor.h"
#include "kv/page_allocator.h"
#include "ops/attention.h"

namespace moe::kv {

struct KvCacheLayout {
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int page_size = 16;
  int32_t num_pages = 0;
  DType dtype = DType::kF32;
  // Bytes of K plus V for one page of one layer.
  size_t page_bytes() const { return 2 * dtype_bytes(dtype, static_cast<int64_t>(num_kv_heads) * page_size * head_dim); }
  // Bytes of the whole cache (every layer's K and V pools).
  size_t num_bytes() const { return page_bytes() * static_cast<size_t>(num_pages) * num_layers; }
};

class KvCache {
 public:
  explicit KvCache(const KvCacheLayout& layout);
  // Over `memory` (num_bytes() bytes, not owned, zeroed by its owner):
  // layer l's K pages, then its V pages, layer after layer. The ranks of a
  // parallel instance keep their caches in shared memory this way, and the
  // CUDA runner its device pool (`device` cuda: device memory, which only
  // kernels and the TransferEngine may touch; the views carry the device).
  KvCache(const KvCacheLayout& layout, void* memory, Device device = Device::cpu());

  const KvCacheLayout& layout() const { return layout_; }
  ops::PagedKv layer(int layer) const;
  PageAllocator& allocator() { return allocator_; }
  size_t num_bytes() const { return layout_.num_bytes(); }
  // Where the pages are: host memory, or the CUDA device that holds them.
  Device device() const { return device_; }
  bool on_device() const { return device_.kind == DeviceKind::kCuda; }

 private:
  KvCacheLayout layout_;
  Device device_;
  std::vector<Tensor> owned_;
  std::vector<TensorView> k_pages_, v_pages_;
  PageAllocator allocator_;
};

// A sequence's pages, in position order: position p is in pages[p / page_size].
class PageTable {
 public:
  const std::vector<int32_t>& pages() const { return pages_; }
  int32_t capacity_tokens(int page_size) const { return static_cast<int32_t>(pages_.size()) * page_size; }
  // Grows the table so it covers `num_tokens` positions; on failure nothing is taken.
  Status reserve(int32_t num_tokens, int page_size, PageAllocator& allocator);
  // Returns every page to the allocator.
  void release(PageAllocator& allocator);

 private:
  std::vector<int32_t> pages_;
};

}  // namespace moe::kv
