// Decode DP+EP dispatch and combine on the CPU communicator. Every token row
// is tagged with its (source rank, token), and every expert output with the
// expert that made it, so a row delivered to the wrong rank, expert or slot
// changes the result. Checks: dispatch delivers exactly the pairs routed to
// each rank's experts, grouped by local expert in (source rank, token, slot)
// order; combine after dispatch equals the reference weighted sum computed on
// one rank; ranks with zero tokens take part.
#include <gtest/gtest.h>

#include <cmath>

#include "comm_test_util.h"

namespace moe::comm {
namespace {

using namespace moe::comm::testing;

struct Routing {
  int num_experts = 8, k = 2;
  int64_t hidden = 32;
  std::vector<int> tokens_per_rank;  // [world]
};

// The routing of token t of rank r: k distinct experts (mixed hash).
std::vector<int32_t> experts_of(const Routing& s, int r, int64_t t) {
  std::vector<int32_t> ids;
  uint64_t h = static_cast<uint64_t>(r) * 7919 + static_cast<uint64_t>(t) * 104729 + 13;
  while (static_cast<int>(ids.size()) < s.k) {
    h = h * 6364136223846793005ull + 1442695040888963407ull;
    const auto e = static_cast<int32_t>((h >> 33) % static_cast<uint64_t>(s.num_experts));
    if (std::find(ids.begin(), ids.end(), e) == ids.end()) ids.push_back(e);
  }
  return ids;
}
// Token rows tag their origin exactly (small integers are exact in f32).
float x_of(int r, int64_t t, int64_t i) { return static_cast<float>(r * 100000 + t * 100 + i % 50); }
float weight_of(int r, int64_t t, int64_t j) { return 0.25f + 0.125f * static_cast<float>((r + t + j) % 5); }
// The "expert": y = x * (1 + global expert id) + expert id / 8.
float y_of(float x, int32_t expert) { return x * static_cast<float>(1 + expert) + static_cast<float>(expert) * 0.125f; }

void run_round_trip(Communicator& comm, const Routing& s) {
  const int world = comm.world_size(), me = comm.rank();
  const int experts_per_rank = s.num_experts / world;
  const int64_t n = s.tokens_per_rank[me], hidden = s.hidden;
  Tensor x(DType::kF32, {n, hidden}), ids(DType::kI32, {n, s.k}), weights(DType::kF32, {n, s.k});
  for (int64_t t = 0; t < n; ++t) {
    const auto e = experts_of(s, me, t);
    for (int j = 0; j < s.k; ++j) {
      ids.data_as<int32_t>()[t * s.k + j] = e[j];
      weights.data_as<float>()[t * s.k + j] = weight_of(me, t, j);
    }
    for (int64_t i = 0; i < hidden; ++i) x.data_as<float>()[t * hidden + i] = x_of(me, t, i);
  }
  auto dispatched = comm.dispatch(x, ids, s.num_experts);
  ASSERT_TRUE(dispatched.has_value()) << dispatched.status().to_string();
  const Dispatched& d = *dispatched;

  // Expected arrivals: every (src, token, slot) routed to my experts, by
  // local expert then (src, token, slot) ascending.
  struct Arrival {
    int e, src;
    int64_t token;
    int slot;
  };
  std::vector<Arrival> expected;
  for (int e = 0; e < experts_per_rank; ++e)
    for (int src = 0; src < world; ++src)
      for (int64_t t = 0; t < s.tokens_per_rank[src]; ++t) {
        const auto ex = experts_of(s, src, t);
        for (int j = 0; j < s.k; ++j)
          if (ex[j] == me * experts_per_rank + e) expected.push_back({e, src, t, j});
      }
  ASSERT_EQ(d.num_recv(), static_cast<int>(expected.size()));
  ASSERT_EQ(d.expert_offsets.size(), static_cast<size_t>(experts_per_rank + 1));
  ASSERT_EQ(d.x.shape(), Shape({d.num_recv(), hidden}));
  Tensor y(DType::kF32, {d.num_recv(), hidden});
  for (int row = 0; row < d.num_recv(); ++row) {
    const Arrival& a = expected[row];
    ASSERT_TRUE(d.expert_offsets[a.e] <= row && row < d.expert_offsets[a.e + 1]) << "row " << row;
    ASSERT_EQ(d.src_rank[row], a.src);
    ASSERT_EQ(d.src_token[row], a.token);
    ASSERT_EQ(d.src_slot[row], a.slot);
    for (int64_t i = 0; i < hidden; ++i) {
      const float v = d.x.data_as<float>()[row * hidden + i];
      ASSERT_EQ(v, x_of(a.src, a.token, i)) << "row " << row << " from rank " << a.src << " token " << a.token;
      y.data_as<float>()[row * hidden + i] = y_of(v, me * experts_per_rank + a.e);
    }
  }

  Tensor out(DType::kF32, {n, hidden});
  ASSERT_TRUE(comm.combine(d, y, weights, out).is_ok());
  for (int64_t t = 0; t < n; ++t) {
    const auto e = experts_of(s, me, t);
    for (int64_t i = 0; i < hidden; ++i) {
      float ref = 0.0f;
      for (int j = 0; j < s.k; ++j) ref += weight_of(me, t, j) * y_of(x_of(me, t, i), e[j]);
      const float got = out.data_as<float>()[t * hidden + i];
      ASSERT_NEAR(got, ref, 1e-6f * std::abs(ref)) << "rank " << me << " token " << t << " element " << i;
    }
  }
}

TEST(ShmDispatch, RoundTripTwoRanks) {
  Routing s{8, 2, 64, {5, 9}};
  run_threads(2, 64 << 10, [&](Communicator& comm) { run_round_trip(comm, s); });
}

TEST(ShmDispatch, RoundTripFourRanksWithAnIdleRank) {
  Routing s{16, 4, 48, {7, 0, 13, 1}};
  run_threads(4, 64 << 10, [&](Communicator& comm) {
    run_round_trip(comm, s);
    run_round_trip(comm, s);  // back to back: no state left from the first
  });
}

TEST(ShmDispatch, EveryRankIdle) {
  Routing s{8, 2, 16, {0, 0, 0, 0}};
  run_threads(4, 64 << 10, [&](Communicator& comm) { run_round_trip(comm, s); });
}

TEST(ShmDispatch, ManyRowsGoInRounds) {
  // 32 KiB buffer: 32 rows of 256 floats per round; 337 tokens x top-8 = 2696 rows.
  Routing s{16, 8, 256, {300, 37}};
  run_threads(2, 32 << 10, [&](Communicator& comm) { run_round_trip(comm, s); });
}

TEST(ShmDispatch, DecodeShapesAtHidden4096) {
  // 32 tokens per rank, top-8 of 128 experts, hidden 4096 (Qwen3-235B's).
  Routing s{128, 8, 4096, {32, 32}};
  run_threads(2, 4 << 20, [&](Communicator& comm) { run_round_trip(comm, s); });
}

TEST(ShmDispatch, SingleRank) {
  Routing s{4, 2, 8, {6}};
  auto comm = open_shm_communicator(group(unique_name("s"), 0, 1, 1 << 20, 1000));
  ASSERT_TRUE(comm.has_value());
  run_round_trip(**comm, s);
}

TEST(ShmDispatch, ForkedProcesses) {
  Routing s{8, 2, 64, {11, 4}};
  run_processes(2, 64 << 10, [&](Communicator& comm) {
    run_round_trip(comm, s);
    return ::testing::Test::HasFailure() ? std::string("round trip failed") : std::string();
  });
}

}  // namespace
}  // namespace moe::comm
