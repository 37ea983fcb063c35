#include "kv/prefix_cache.h"

#include <gtest/gtest.h>

#include <random>

namespace moe::kv {
namespace {

TEST(PrefixCache, PublishedPagesAreSharedAndEvictedLeastRecentlyReleasedFirst) {
  PrefixCache cache(6, 2, true);
  const std::vector<int32_t> tokens = {1, 2, 3, 4, 5};
  auto pages = cache.allocate(3);
  ASSERT_TRUE(pages.has_value());
  uint64_t h0 = cache.publish(kRootHash, std::span(tokens).subspan(0, 2), (*pages)[0]);
  cache.publish(h0, std::span(tokens).subspan(2, 2), (*pages)[1]);
  // A second sequence with the same first four tokens shares two pages.
  auto hit = cache.acquire_prefix(tokens, 10);
  EXPECT_EQ(hit, (std::vector<int32_t>{(*pages)[0], (*pages)[1]}));
  auto partial = cache.acquire_prefix(std::vector<int32_t>{1, 2, 9, 9}, 10);  // diverges in page 2
  EXPECT_EQ(partial, std::vector<int32_t>{(*pages)[0]});
  cache.release(partial);
  EXPECT_TRUE(cache.acquire_prefix(std::vector<int32_t>{2, 1}, 10).empty());
  EXPECT_EQ(cache.acquire_prefix(tokens, 1).size(), 1u);  // max_pages
  cache.release(std::vector<int32_t>{(*pages)[0]});
  cache.check_invariants();
  cache.release(*pages);
  cache.release(hit);
  cache.check_invariants();
  EXPECT_EQ(cache.num_used(), 0);
  EXPECT_EQ(cache.num_evictable(), 2);  // the published pages stay cached
  EXPECT_EQ(cache.num_available(), 6);
  auto all = cache.allocate(5);  // needs one eviction: the page released first
  ASSERT_TRUE(all.has_value());
  EXPECT_EQ(cache.num_evictable(), 1);
  cache.check_invariants();
  EXPECT_FALSE(cache.allocate(2).has_value());
  EXPECT_EQ(cache.num_available(), 1);
}

TEST(PrefixCache, DisabledCacheFreesAtOnce) {
  PrefixCache cache(4, 2, false);
  auto pages = cache.allocate(2);
  ASSERT_TRUE(pages.has_value());
  const std::vector<int32_t> t = {1, 2};
  cache.publish(kRootHash, t, (*pages)[0]);
  EXPECT_TRUE(cache.acquire_prefix(t, 1).empty());
  cache.release(*pages);
  EXPECT_EQ(cache.num_evictable(), 0);
  cache.check_invariants();
}

TEST(PrefixCache, RandomWorkloadKeepsInvariants) {
  PrefixCache cache(32, 2, true);
  std::mt19937 rng(5);
  std::vector<std::vector<int32_t>> held;
  for (int step = 0; step < 3000; ++step) {
    if (rng() % 2 == 0 && !held.empty()) {
      const size_t i = rng() % held.size();
      cache.release(held[i]);
      held.erase(held.begin() + static_cast<long>(i));
    } else {
      std::vector<int32_t> tokens(8);
      for (auto& t : tokens) t = static_cast<int32_t>(rng() % 3);
      auto pages = cache.acquire_prefix(tokens, 4);
      uint64_t parent = kRootHash;
      for (size_t p = 0; p < pages.size(); ++p) parent = chain_hash(parent, std::span(tokens).subspan(p * 2, 2));
      auto more = cache.allocate(4 - static_cast<int32_t>(pages.size()));
      if (!more) {
        cache.release(pages);
        continue;
      }
      for (int32_t page : *more) {
        parent = cache.publish(parent, std::span(tokens).subspan(pages.size() * 2, 2), page);
        pages.push_back(page);
      }
      held.push_back(pages);
    }
    cache.check_invariants();
  }
}

}  // namespace
}  // namespace moe::kv
