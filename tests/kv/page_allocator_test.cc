#include "kv/page_allocator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "kv/kv_cache.h"

namespace moe::kv {
namespace {

TEST(PageAllocator, AllocatesLowestPagesAndRefusesOverdraw) {
  PageAllocator allocator(8);
  auto a = allocator.allocate(3);
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(*a, (std::vector<int32_t>{0, 1, 2}));
  auto b = allocator.allocate(6);
  ASSERT_FALSE(b.has_value());
  EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(allocator.num_free(), 5);  // a failed allocation takes nothing
  allocator.free(std::vector<int32_t>{1});
  auto c = allocator.allocate(2);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(*c, (std::vector<int32_t>{1, 3}));
  allocator.check_invariants();
}

TEST(PageAllocator, RandomWorkloadKeepsInvariants) {
  PageAllocator allocator(64);
  std::mt19937 rng(7);
  std::vector<std::vector<int32_t>> held;
  for (int step = 0; step < 2000; ++step) {
    if (held.empty() || rng() % 2 == 0) {
      auto pages = allocator.allocate(static_cast<int32_t>(rng() % 9));
      if (pages) held.push_back(*pages);
    } else {
      const size_t i = rng() % held.size();
      allocator.free(held[i]);
      held.erase(held.begin() + static_cast<long>(i));
    }
    allocator.check_invariants();
    int32_t in_use = 0;
    for (const auto& h : held) in_use += static_cast<int32_t>(h.size());
    ASSERT_EQ(in_use + allocator.num_free(), 64);
  }
}

TEST(PageAllocatorDeathTest, DoubleFreeIsABug) {
  PageAllocator allocator(4);
  auto pages = allocator.allocate(1);
  allocator.free(*pages);
  EXPECT_DEATH(allocator.free(*pages), "freed twice");
  EXPECT_DEATH(allocator.free(std::vector<int32_t>{9}), "pool of 4");
}

TEST(PageTable, GrowsByWholePagesAndReleases) {
  PageAllocator allocator(10);
  PageTable table;
  ASSERT_TRUE(table.reserve(5, 4, allocator).is_ok());
  EXPECT_EQ(table.pages().size(), 2u);
  ASSERT_TRUE(table.reserve(8, 4, allocator).is_ok());
  EXPECT_EQ(table.pages().size(), 2u);
  ASSERT_TRUE(table.reserve(9, 4, allocator).is_ok());
  EXPECT_EQ(table.pages().size(), 3u);
  EXPECT_EQ(table.reserve(100, 4, allocator).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(table.pages().size(), 3u);
  table.release(allocator);
  EXPECT_EQ(allocator.num_free(), 10);
}

TEST(KvCache, LayersAreHndPools) {
  KvCache cache({3, 2, 8, 16, 5, DType::kBF16});
  auto layer = cache.layer(2);
  EXPECT_EQ(layer.k_pages.shape(), (Shape{5, 2, 16, 8}));
  EXPECT_EQ(layer.v_pages.dtype(), DType::kBF16);
  EXPECT_NE(cache.layer(0).k_pages.data(), cache.layer(1).k_pages.data());
  EXPECT_EQ(cache.num_bytes(), 3u * 5 * 2 * (2 * 16 * 8 * 2));
}

}  // namespace
}  // namespace moe::kv
