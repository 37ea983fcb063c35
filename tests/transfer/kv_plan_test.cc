// KV transfer plans, byte-exact against an independent reference: every
// element of the prefill pools carries a value derived from (layer, K/V, head,
// token, element byte), so after the transfer each decode element can be
// checked against the value its logical position must hold, and every byte
// no token maps to must be unchanged. Replicated heads (TP > kv heads) carry
// different bytes on non-writer replicas, so a write from them would show.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>

#include "tests/transfer/transfer_test_util.h"
#include "transfer/kv_plan.h"

namespace moe::transfer {
namespace {

using namespace moe::transfer::testing;

uint8_t value_of(int layer, int part, int head, int token, int byte, bool replica_copy) {
  uint32_t x = static_cast<uint32_t>(layer * 1000003 + part * 7919 + head * 104729 + token * 131 + byte * 31 + 17);
  x ^= x >> 13;
  x *= 0x5bd1e995u;
  x ^= x >> 15;
  return static_cast<uint8_t>(replica_copy ? ~x : x);
}

struct Case {
  int num_kv_heads;
  int tp;
  int src_page_size;
  int dst_page_size;
  int num_tokens;
  DType dtype = DType::kBF16;
  uint64_t src_page_pad_bytes = 0;  // page stride beyond a dense page
};

std::string describe(const Case& c) {
  return fmt::format("H={} tp={} pages {}->{} tokens={} {} pad={}", c.num_kv_heads, c.tp, c.src_page_size,
                     c.dst_page_size, c.num_tokens, dtype_name(c.dtype), c.src_page_pad_bytes);
}

constexpr int kHeadDim = 8;
constexpr int kNumLayers = 2;

// One side's pools: [layer][part] byte buffers.
using Pools = std::vector<std::array<std::vector<uint8_t>, 2>>;

struct PlanSetup {
  Case c;
  KvSideLayout src_layout, dst_layout;
  uint64_t token_bytes = 0;
  std::vector<std::vector<int32_t>> src_pages;  // per rank (all ranks use the same page ids)
  std::vector<int32_t> dst_pages;
  std::vector<Pools> src_pools;  // per rank
  Pools dst_pools;
  int num_dst_pages_total = 0;

  explicit PlanSetup(const Case& c_in, uint32_t seed) : c(c_in) {
    src_layout = KvSideLayout{c.num_kv_heads, kHeadDim, c.src_page_size, c.dtype, c.tp, 0};
    dst_layout = KvSideLayout{c.num_kv_heads, kHeadDim, c.dst_page_size, c.dtype, 1, 0};
    token_bytes = dtype_bytes(c.dtype, kHeadDim);
    std::mt19937 rng(seed);
    const int num_src = (c.num_tokens + c.src_page_size - 1) / c.src_page_size;
    const int num_dst = (c.num_tokens + c.dst_page_size - 1) / c.dst_page_size;
    num_dst_pages_total = num_dst + 5;
    std::vector<int32_t> all(num_dst_pages_total);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    dst_pages.assign(all.begin(), all.begin() + num_dst);
    const int num_src_total = num_src + 3;
    for (int r = 0; r < c.tp; ++r) {
      std::vector<int32_t> pages(num_src_total);
      std::iota(pages.begin(), pages.end(), 0);
      std::shuffle(pages.begin(), pages.end(), rng);
      pages.resize(num_src);
      src_pages.push_back(pages);
      HeadRange heads = local_heads(src_layout, r).value();
      const uint64_t stride = token_bytes * c.src_page_size * heads.count + c.src_page_pad_bytes;
      if (c.src_page_pad_bytes != 0) src_layout.page_stride_bytes = stride;
      Pools pools(kNumLayers);
      for (int l = 0; l < kNumLayers; ++l) {
        for (int p = 0; p < 2; ++p) {
          auto& pool = pools[l][p];
          pool = random_bytes(num_src_total * stride, seed + 100 * r + 10 * l + p);
          for (int t = 0; t < c.num_tokens; ++t) {
            for (int h = 0; h < heads.count; ++h) {
              const uint64_t at = pages[t / c.src_page_size] * stride +
                                  (static_cast<uint64_t>(h) * c.src_page_size + t % c.src_page_size) * token_bytes;
              for (uint64_t b = 0; b < token_bytes; ++b)
                pool[at + b] = value_of(l, p, heads.first + h, t, static_cast<int>(b), !is_writer_rank(src_layout, r));
            }
          }
        }
      }
      src_pools.push_back(std::move(pools));
    }
    const uint64_t dst_stride = token_bytes * c.dst_page_size * c.num_kv_heads;
    dst_pools.resize(kNumLayers);
    for (int l = 0; l < kNumLayers; ++l)
      for (int p = 0; p < 2; ++p) dst_pools[l][p] = random_bytes(num_dst_pages_total * dst_stride, seed + 7 + l * 2 + p);
  }

  // What the decode pools must hold after layers [0, num_layers): the logical
  // value at every (head, token), the old bytes everywhere else.
  Pools reference(int num_layers) const {
    Pools want = dst_pools;
    const uint64_t dst_stride = token_bytes * c.dst_page_size * c.num_kv_heads;
    for (int l = 0; l < num_layers; ++l) {
      for (int p = 0; p < 2; ++p) {
        for (int t = 0; t < c.num_tokens; ++t) {
          for (int h = 0; h < c.num_kv_heads; ++h) {
            const uint64_t at = dst_pages[t / c.dst_page_size] * dst_stride +
                                (static_cast<uint64_t>(h) * c.dst_page_size + t % c.dst_page_size) * token_bytes;
            for (uint64_t b = 0; b < token_bytes; ++b) want[l][p][at + b] = value_of(l, p, h, t, static_cast<int>(b), false);
          }
        }
      }
    }
    return want;
  }

  KvTransferPlan plan(int rank) const {
    auto plan = KvTransferPlan::build(src_layout, rank, dst_layout, src_pages[rank], dst_pages, c.num_tokens);
    EXPECT_TRUE(plan.has_value()) << plan.status().to_string();
    return std::move(plan).value();
  }
};

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (int heads : {4, 2}) {
    for (int tp : {1, 2, 4}) {
      for (auto [src_ps, dst_ps] : {std::pair{16, 16}, {16, 32}, {32, 16}, {16, 24}}) {
        for (int tokens : {1, 37, 64, 70}) cases.push_back(Case{heads, tp, src_ps, dst_ps, tokens});
      }
    }
  }
  cases.push_back(Case{4, 2, 16, 32, 45, DType::kF8E4M3});
  cases.push_back(Case{8, 4, 16, 16, 50, DType::kF32, 256});
  cases.push_back(Case{4, 1, 16, 16, 0});
  return cases;
}

TEST(KvPlan, ByteExactOnCpuForTpAndPageSizes) {
  uint32_t seed = 1;
  for (const Case& c : all_cases()) {
    SCOPED_TRACE(describe(c));
    PlanSetup s(c, seed++);
    const Pools want = s.reference(kNumLayers);
    int num_writers = 0;
    uint64_t bytes = 0;
    for (int r = 0; r < c.tp; ++r) {
      const KvTransferPlan plan = s.plan(r);
      num_writers += plan.is_writer();
      if (!plan.is_writer()) {
        EXPECT_TRUE(plan.runs().empty());
      }
      for (int l = 0; l < kNumLayers; ++l) {
        for (int p = 0; p < 2; ++p) {
          for (const transfer::Run& run : plan.layer_runs(l)) {
            ASSERT_LE(run.src_offset + run.length_bytes, s.src_pools[r][l][p].size());
            ASSERT_LE(run.dst_offset + run.length_bytes, s.dst_pools[l][p].size());
            std::memcpy(s.dst_pools[l][p].data() + run.dst_offset, s.src_pools[r][l][p].data() + run.src_offset,
                        run.length_bytes);
          }
        }
      }
      bytes += plan.bytes_per_layer();
    }
    EXPECT_EQ(num_writers, std::min(c.tp, c.num_kv_heads));
    EXPECT_EQ(bytes, 2ull * c.num_tokens * c.num_kv_heads * s.token_bytes);
    for (int l = 0; l < kNumLayers; ++l)
      for (int p = 0; p < 2; ++p) EXPECT_TRUE(s.dst_pools[l][p] == want[l][p]) << "layer " << l << " part " << p;
  }
}

TEST(KvPlan, RunsAreCoalesced) {
  // Equal page sizes, consecutive pages on both sides, full pages: one run for a
  // rank holding all heads, one run per page for a rank holding half of them.
  KvSideLayout src{4, 64, 16, DType::kBF16, 1, 0};
  KvSideLayout dst{4, 64, 16, DType::kBF16, 1, 0};
  std::vector<int32_t> pages = {3, 4, 5, 6};
  auto whole = KvTransferPlan::build(src, 0, dst, pages, pages, 64);
  ASSERT_TRUE(whole.has_value());
  ASSERT_EQ(whole->runs().size(), 1u);
  EXPECT_EQ(whole->runs()[0].length_bytes, 4u * 4 * 16 * 64 * 2);
  src.tp_size = 2;
  auto half = KvTransferPlan::build(src, 1, dst, pages, pages, 64);
  ASSERT_TRUE(half.has_value());
  EXPECT_EQ(half->runs().size(), 4u);
  // Tokens not filling the last page: the last page gives one run per head.
  auto partial = KvTransferPlan::build(src, 1, dst, pages, pages, 56);
  ASSERT_TRUE(partial.has_value());
  EXPECT_EQ(partial->runs().size(), 3u + 2u);
}

TEST(KvPlan, RejectsInconsistentLayouts) {
  KvSideLayout src{4, 64, 16, DType::kBF16, 2, 0};
  KvSideLayout dst{4, 64, 16, DType::kBF16, 1, 0};
  std::vector<int32_t> pages = {0, 1};
  auto build = [&](KvSideLayout s, KvSideLayout d, int rank, int tokens) {
    return KvTransferPlan::build(s, rank, d, pages, pages, tokens).status().code();
  };
  EXPECT_EQ(build(src, dst, 0, 32), StatusCode::kOk);
  EXPECT_EQ(build(src, dst, 0, 33), StatusCode::kInvalidArgument);  // too few pages
  EXPECT_EQ(build(src, dst, 2, 8), StatusCode::kInvalidArgument);   // rank outside tp
  auto other = dst;
  other.dtype = DType::kF32;
  EXPECT_EQ(build(src, other, 0, 8), StatusCode::kInvalidArgument);
  other = dst;
  other.num_kv_heads = 8;
  EXPECT_EQ(build(src, other, 0, 8), StatusCode::kInvalidArgument);
  auto odd = src;
  odd.tp_size = 3;
  EXPECT_EQ(build(odd, dst, 0, 8), StatusCode::kInvalidArgument);
  odd.tp_size = 6;
  EXPECT_EQ(build(odd, dst, 0, 8), StatusCode::kInvalidArgument);
  other = dst;
  other.tp_size = 2;
  EXPECT_EQ(build(src, other, 0, 8), StatusCode::kUnimplemented);
  auto tight = src;
  tight.page_stride_bytes = 100;
  EXPECT_EQ(build(tight, dst, 0, 8), StatusCode::kInvalidArgument);
  std::vector<int32_t> negative = {0, -1};
  EXPECT_EQ(KvTransferPlan::build(src, 0, dst, pages, negative, 20).status().code(), StatusCode::kInvalidArgument);
}

// The plan executed through the TCP transport, one batch per layer per writer
// rank, layer by layer: after layer 0's batches land, layer 0 matches the
// reference and layer 1 is untouched; then layer 1.
TEST(KvPlan, LayerByLayerThroughTcpMatchesReference) {
  for (const Case& c : {Case{4, 2, 16, 32, 70}, Case{2, 4, 32, 16, 45}, Case{4, 1, 16, 16, 64}}) {
    SCOPED_TRACE(describe(c));
    PlanSetup s(c, 77);
    const Pools want = s.reference(kNumLayers);
    const Pools untouched = s.dst_pools;
    auto prefill = make_engine();
    auto decode = make_engine();
    std::vector<KvLayerRemote> remote(kNumLayers);
    for (int l = 0; l < kNumLayers; ++l) {
      auto k = decode->register_region(s.dst_pools[l][0].data(), s.dst_pools[l][0].size());
      auto v = decode->register_region(s.dst_pools[l][1].data(), s.dst_pools[l][1].size());
      ASSERT_TRUE(k && v);
      remote[l] = KvLayerRemote{*decode->describe(*k), 0, *decode->describe(*v), 0};
    }
    std::vector<std::vector<KvLayerRegions>> local(c.tp, std::vector<KvLayerRegions>(kNumLayers));
    for (int r = 0; r < c.tp; ++r) {
      for (int l = 0; l < kNumLayers; ++l) {
        auto k = prefill->register_region(s.src_pools[r][l][0].data(), s.src_pools[r][l][0].size());
        auto v = prefill->register_region(s.src_pools[r][l][1].data(), s.src_pools[r][l][1].size());
        ASSERT_TRUE(k && v);
        local[r][l] = KvLayerRegions{*k, 0, *v, 0};
      }
    }
    const uint32_t imm = 500;
    ASSERT_TRUE(decode->arm(imm, prefill->endpoint()).is_ok());
    uint64_t expected = 0;
    for (int l = 0; l < kNumLayers; ++l) {
      for (int r = 0; r < c.tp; ++r) {
        const KvTransferPlan plan = s.plan(r);
        if (!plan.is_writer()) continue;
        auto groups = plan.layer_writes(local[r][l], remote[l]);
        auto id = prefill->submit_scattered(groups, imm);
        ASSERT_TRUE(id.has_value()) << id.status().to_string();
        ++expected;
      }
      ASSERT_TRUE(decode->wait_for(imm, expected, kTimeout).is_ok());
      for (int p = 0; p < 2; ++p) {
        EXPECT_TRUE(s.dst_pools[l][p] == want[l][p]) << "layer " << l << " part " << p;
        if (l + 1 < kNumLayers) {
          EXPECT_TRUE(s.dst_pools[l + 1][p] == untouched[l + 1][p]);
        }
      }
    }
    EXPECT_EQ(decode->poll_imm(imm).num_completed, expected);
    ASSERT_TRUE(decode->disarm(imm).is_ok());
  }
}

}  // namespace
}  // namespace moe::transfer
