// The CUDA model's KV pool (model/cuda/kv_pool.h) and kv::KvCache over
// external memory must put every layer's K and V pages at the same offsets:
// the CUDA runner describes its device pool as a KvCache, and the
// disaggregated roles register that cache's per-layer pools with the
// TransferEngine. Plain arithmetic: runs without a GPU (host memory stands in
// for the device pool; KvCache never touches the bytes).
#include <gtest/gtest.h>

#include <vector>

#include "kv/kv_cache.h"
#include "model/cuda/kv_pool.h"

namespace moe::kv {
namespace {

struct Case {
  int num_layers, num_kv_heads, head_dim, page_size;
  int32_t num_pages;
};

TEST(KvPoolLayout, CudaPoolOffsetsEqualKvCacheLayout) {
  // The golden models' shapes, the demo's, Qwen3-235B's (94 layers, 4 kv
  // heads, head_dim 128) with a large pool, odd page sizes, one page (the
  // scratch page alone, as during the CUDA model's warm-up sizing).
  const std::vector<Case> cases = {{2, 2, 32, 16, 65},  {3, 1, 16, 4, 9},     {4, 2, 16, 16, 2},
                                   {94, 4, 128, 16, 3}, {2, 8, 128, 7, 1},    {1, 1, 2, 1, 1},
                                   {48, 4, 128, 32, 5}, {94, 4, 128, 16, 100001}};
  for (const Case& c : cases) {
    SCOPED_TRACE(testing::Message() << c.num_layers << " layers, " << c.num_kv_heads << " heads x " << c.head_dim
                                    << ", page " << c.page_size << ", " << c.num_pages << " pages");
    const model::CudaKvPoolLayout pool{c.num_layers, c.num_kv_heads, c.head_dim, c.page_size, c.num_pages};
    const KvCacheLayout layout{c.num_layers, c.num_kv_heads, c.head_dim, c.page_size, c.num_pages, DType::kBF16};
    ASSERT_EQ(pool.num_bytes(), layout.num_bytes());
    ASSERT_EQ(2 * pool.page_bytes(), layout.page_bytes());
    // KvCache only computes views: any base address serves, no memory is read.
    auto* base = reinterpret_cast<uint8_t*>(uintptr_t{1} << 40);
    const KvCache cache(layout, base, Device::cuda(1));
    EXPECT_TRUE(cache.on_device());
    EXPECT_EQ(cache.device(), Device::cuda(1));
    size_t end = 0;
    for (int l = 0; l < c.num_layers; ++l) {
      const ops::PagedKv kv = cache.layer(l);
      EXPECT_EQ(static_cast<const uint8_t*>(kv.k_pages.data()) - base, static_cast<ptrdiff_t>(pool.k_offset(l)));
      EXPECT_EQ(static_cast<const uint8_t*>(kv.v_pages.data()) - base, static_cast<ptrdiff_t>(pool.v_offset(l)));
      EXPECT_EQ(kv.k_pages.num_bytes(), pool.pool_bytes());
      EXPECT_EQ(kv.v_pages.num_bytes(), pool.pool_bytes());
      EXPECT_EQ(kv.k_pages.shape(), (Shape{c.num_pages, c.num_kv_heads, c.page_size, c.head_dim}));
      EXPECT_EQ(kv.k_pages.device(), Device::cuda(1));
      EXPECT_EQ(pool.v_offset(l), pool.k_offset(l) + pool.pool_bytes());  // V right after K
      EXPECT_EQ(pool.k_offset(l), end);                                   // no gap between layers
      end = pool.v_offset(l) + pool.pool_bytes();
    }
    EXPECT_EQ(end, pool.num_bytes());
  }
}

TEST(KvPoolLayout, HostCachesStayOnTheHost) {
  const KvCacheLayout layout{2, 2, 8, 4, 3, DType::kF32};
  const KvCache owned(layout);
  EXPECT_FALSE(owned.on_device());
  EXPECT_EQ(owned.layer(1).k_pages.device(), Device::cpu());
  std::vector<uint8_t> memory(layout.num_bytes());
  const KvCache external(layout, memory.data());
  EXPECT_FALSE(external.on_device());
  EXPECT_EQ(external.layer(0).v_pages.device(), Device::cpu());
}

}  // namespace
}  // namespace moe::kv
