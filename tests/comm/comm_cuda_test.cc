// The CUDA comm kernels with two ranks (on two GPUs: threads, one GPU each;
// on one GPU: processes sharing it), sharing cuMemCreate memory through POSIX
// file descriptors, against the CPU:
//   all-reduce (one-shot, two-shot, auto with chunks) == the bf16 rounding of
//     the f32 sum in rank order, bit for bit, odd sizes included;
//   fused all-reduce + residual + RMSNorm == sum, then ops::cpu::add_rms_norm
//     (residual exact; normed within bf16 rounding, 1e-2 relative);
//   dispatch then combine == the reference weighted sum, rows tagged with
//     (source rank, token) so misrouting shows, twice (both counter parities);
//   NCCL (when libnccl loads) == ours on the same inputs.
// Skips with a message on machines without a GPU (NCCL's check: with fewer
// than two). Never creates a multicast object (the NVLS kernel is compiled,
// not run).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>

#include "comm/cuda/kernels.h"
#include "comm/cuda/symmetric_memory.h"
#include "core/dtype.h"
#include "gpu_test_util.h"
#include "ops/norm.h"
#ifdef MOE_COMM_HAVE_NCCL
#include "comm/cuda/nccl_communicator.h"
#endif

namespace moe::comm::cuda {
namespace {

using moe::comm::testing::gpu_count;

#define SKIP_WITHOUT_GPU()                              \
  do {                                                  \
    if (gpu_count() < 1) GTEST_SKIP() << "needs a GPU"; \
  } while (0)

// body(bootstrap) on every rank: threads with a GPU each where there are
// enough GPUs, else processes (this test again, run_rank_processes) sharing them.
std::string run_ranks(int world, const std::function<void(TcpBootstrap&)>& body) {
  using namespace moe::comm::testing;
  if (in_rank_process()) return rank_process_body(body);
  if (gpu_count() >= world) return run_gpu_ranks(world, body);
  const auto* test = ::testing::UnitTest::GetInstance()->current_test_info();
  return run_rank_processes(
      world,
      {std::string("--gtest_filter=") + test->test_suite_name() + "." + test->name(), "--gtest_color=no"});
}

// A bf16 value per (rank, index), in [-4, 4).
uint16_t value_of(int rank, int64_t i) {
  const uint64_t h = (static_cast<uint64_t>(i) * 2654435761u + static_cast<uint64_t>(rank) * 40503u) % 8191u;
  return float_to_bf16((static_cast<float>(h) - 4095.0f) / 1024.0f);
}

template <typename T>
T* device_copy(const std::vector<T>& host) {
  T* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(16, host.size() * sizeof(T))), cudaSuccess);
  if (!host.empty()) {
    EXPECT_EQ(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  return p;
}

template <typename T>
std::vector<T> host_copy(const void* device, size_t count) {
  std::vector<T> host(count);
  EXPECT_EQ(cudaMemcpy(host.data(), device, count * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

std::unique_ptr<CudaSymmetricMemory> open_memory(TcpBootstrap& b, size_t data_bytes) {
  SymmetricMemoryOptions options;
  options.device = b.rank() % gpu_count();
  options.data_bytes = data_bytes;
  auto mem = CudaSymmetricMemory::create(options, b);
  EXPECT_TRUE(mem.has_value()) << mem.status().to_string();
  return mem.has_value() ? std::move(mem).value() : nullptr;
}

enum class Algo { kOneShot, kTwoShot, kAuto };

// One all-reduce of n elements on this rank; "" or the first mismatch.
std::string check_all_reduce(const SymmetricView& view, int64_t n, Algo algo) {
  std::vector<uint16_t> input(n);
  for (int64_t i = 0; i < n; ++i) input[i] = value_of(view.rank, i);
  uint16_t* data = device_copy(input);
  AllReduceParams p{view, reinterpret_cast<const bf16*>(data), reinterpret_cast<bf16*>(data), n};
  const cudaError_t e = algo == Algo::kOneShot   ? all_reduce_one_shot(p, nullptr)
                        : algo == Algo::kTwoShot ? all_reduce_two_shot(p, nullptr)
                                                 : all_reduce_auto(p, nullptr);
  std::string error;
  if (e != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) error = cudaGetErrorString(cudaGetLastError());
  const auto out = host_copy<uint16_t>(data, n);
  cudaFree(data);
  for (int64_t i = 0; i < n && error.empty(); ++i) {
    float sum = 0.0f;
    for (int r = 0; r < view.world; ++r) sum += bf16_to_float(value_of(r, i));
    if (out[i] != float_to_bf16(sum))
      error = fmt::format("n {} algo {}: element {} is {}, expected {}", n, static_cast<int>(algo), i,
                          bf16_to_float(out[i]), sum);
  }
  return error;
}

TEST(CommCuda, AllReduceEqualsCpuSum) {
  SKIP_WITHOUT_GPU();
  const std::string e = run_ranks(2, [](TcpBootstrap& b) {
    auto mem = open_memory(b, 32 << 20);  // halves of 16 MB: 8M elements per call
    ASSERT_NE(mem, nullptr);
    for (int64_t n : {1, 7, 8, 9, 1000, 4097, 65536, 65543, 1 << 20, (3 << 20) + 5})
      for (Algo algo : {Algo::kOneShot, Algo::kTwoShot, Algo::kAuto})
        EXPECT_EQ(check_all_reduce(mem->view(), n, algo), "") << "rank " << b.rank();
    // Larger than one call: auto goes in chunks.
    EXPECT_EQ(check_all_reduce(mem->view(), (20 << 20) + 3, Algo::kAuto), "");
  });
  EXPECT_EQ(e, "");
}

void check_fused(const SymmetricView& view, int rows, int hidden, bool two_shot) {
  const int64_t n = static_cast<int64_t>(rows) * hidden;
  std::vector<uint16_t> delta(n), weight(hidden);
  std::vector<float> residual(n), ref_sum(n);
  for (int64_t i = 0; i < n; ++i) {
    delta[i] = value_of(view.rank, i);
    residual[i] = bf16_to_float(value_of(7, i)) * 3.0f;
    float s = 0.0f;
    for (int r = 0; r < view.world; ++r) s += bf16_to_float(value_of(r, i));
    ref_sum[i] = s;
  }
  for (int i = 0; i < hidden; ++i) weight[i] = float_to_bf16(1.0f + 0.01f * static_cast<float>(i % 17));
  uint16_t* d_delta = device_copy(delta);
  uint16_t* d_weight = device_copy(weight);
  float* d_residual = device_copy(residual);
  uint16_t* d_out = device_copy(std::vector<uint16_t>(n));
  FusedAllReduceNormParams p{view, reinterpret_cast<const bf16*>(d_delta), d_residual,
                             reinterpret_cast<const bf16*>(d_weight), reinterpret_cast<bf16*>(d_out), rows, hidden,
                             1e-6f, two_shot};
  ASSERT_EQ(fused_all_reduce_add_rms_norm(p, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto got_residual = host_copy<float>(d_residual, n);
  const auto got_out = host_copy<uint16_t>(d_out, n);
  for (void* ptr : {static_cast<void*>(d_delta), static_cast<void*>(d_weight), static_cast<void*>(d_residual),
                    static_cast<void*>(d_out)})
    cudaFree(ptr);

  Tensor ref_residual(DType::kF32, {rows, hidden}), sum(DType::kF32, {rows, hidden}), ref_out(DType::kF32, {rows, hidden});
  Tensor w(DType::kBF16, {hidden});
  std::memcpy(ref_residual.data(), residual.data(), n * sizeof(float));
  std::memcpy(sum.data(), ref_sum.data(), n * sizeof(float));
  std::memcpy(w.data(), weight.data(), hidden * sizeof(uint16_t));
  ThreadPool pool(1);
  ops::cpu::add_rms_norm(pool, ref_residual, sum, w, 1e-6f, ref_out);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(got_residual[i], ref_residual.data_as<float>()[i]) << "residual " << i;
    const float ref = ref_out.data_as<float>()[i];
    ASSERT_NEAR(bf16_to_float(got_out[i]), ref, 1e-2f * std::abs(ref) + 1e-3f) << "normed " << i;
  }
}

TEST(CommCuda, FusedAllReduceAddRmsNormEqualsReference) {
  SKIP_WITHOUT_GPU();
  const std::string e = run_ranks(2, [](TcpBootstrap& b) {
    auto mem = open_memory(b, 32 << 20);
    ASSERT_NE(mem, nullptr);
    for (bool two_shot : {false, true})
      for (auto [rows, hidden] : {std::pair{1, 4096}, std::pair{5, 1024}, std::pair{128, 4096}, std::pair{301, 2048}})
        check_fused(mem->view(), rows, hidden, two_shot);
  });
  EXPECT_EQ(e, "");
}

// --- dispatch / combine -------------------------------------------------------

struct Routing {
  int num_experts = 8, k = 2, hidden = 256, max_tokens = 16;
  std::vector<int> tokens;  // [world]
};

std::vector<int32_t> experts_of(const Routing& s, int rank, int t) {
  std::vector<int32_t> ids;
  uint64_t h = static_cast<uint64_t>(rank) * 7919 + static_cast<uint64_t>(t) * 104729 + 17;
  while (static_cast<int>(ids.size()) < s.k) {
    h = h * 6364136223846793005ull + 1442695040888963407ull;
    const auto e = static_cast<int32_t>((h >> 33) % static_cast<uint64_t>(s.num_experts));
    if (std::find(ids.begin(), ids.end(), e) == ids.end()) ids.push_back(e);
  }
  return ids;
}
// Exact in bf16: element 0 tags the rank, element 1 the token.
float x_of(int rank, int t, int i) { return i == 0 ? static_cast<float>(rank) : i == 1 ? static_cast<float>(t) : static_cast<float>(i % 13 - 6); }

// The "expert" of the test: global expert eg scales the row; with f32 rows
// (combine taking the grouped GEMM's f32 output) a part below bf16's
// resolution is added, which combine must round away as it sends the row.
float expert_out(float x, int eg, int i, bool f32_rows) {
  return x * static_cast<float>(eg + 1) +
         (f32_rows ? 0.0009765625f * static_cast<float>(i % 7 + 1) / 3.0f : 0.0f);
}

// f32_rows: the outputs go back from f32 rows in received_groups' order
// (checked too) instead of bf16 rows at the received places.
// An FP8 payload's bytes and scales, tagged like x_of.
uint8_t fp8_byte(int rank, int t, int i) {
  return static_cast<uint8_t>((rank * 37 + t * 11 + i) % 251);
}
float scale_of(int rank, int t, int c) {
  return static_cast<float>(rank * 100 + t) + 0.25f * static_cast<float>(c);
}

// fp8_payload: the rows travel as E4M3 bytes with their scales (checked on
// arrival; the combine half is the same).
void round_trip(const SymmetricView& view, const Routing& s, int parity, bool f32_rows = false,
                bool fp8_payload = false) {
  const int me = view.rank, n = s.tokens[me], epr = s.num_experts / view.world;
  const ExpertLayout layout{view.world, epr, s.max_tokens, s.k, s.hidden, fp8_payload};
  const int scale_cols = layout.scale_cols();
  std::vector<uint16_t> x(static_cast<size_t>(n) * s.hidden);
  std::vector<uint8_t> x_fp8(static_cast<size_t>(n) * s.hidden);
  std::vector<float> x_scales(std::max(1, n * scale_cols));
  for (int t = 0; t < n; ++t) {
    for (int i = 0; i < s.hidden; ++i) x_fp8[static_cast<size_t>(t) * s.hidden + i] = fp8_byte(me, t, i);
    for (int c = 0; c < scale_cols; ++c)
      x_scales[static_cast<size_t>(t) * scale_cols + c] = scale_of(me, t, c);
  }
  std::vector<int32_t> ids;
  std::vector<float> weights;
  for (int t = 0; t < n; ++t) {
    for (int i = 0; i < s.hidden; ++i) x[static_cast<size_t>(t) * s.hidden + i] = float_to_bf16(x_of(me, t, i));
    for (int32_t e : experts_of(s, me, t)) ids.push_back(e);
    for (int j = 0; j < s.k; ++j) weights.push_back(0.25f * static_cast<float>(1 + (t + j) % 3));
  }
  uint16_t* d_x = device_copy(x);
  uint8_t* d_x_fp8 = device_copy(x_fp8);
  float* d_x_scales = device_copy(x_scales);
  int32_t* d_ids = device_copy(ids);
  float* d_w = device_copy(weights);
  if (fp8_payload) {
    ASSERT_EQ(dispatch({view, layout, d_x_fp8, d_ids, n, d_x_scales}, nullptr), cudaSuccess);
  } else {
    ASSERT_EQ(dispatch({view, layout, reinterpret_cast<const bf16*>(d_x), d_ids, n}, nullptr), cudaSuccess);
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  // What arrived, against what every rank routed here.
  const char* base = view.base[me];
  const auto counts = host_copy<int32_t>(base + layout.counts_offset() + 4 * parity * (epr + 1), epr + 1);
  const int received = counts[epr];
  const size_t pool_rows = static_cast<size_t>(layout.pool_rows());
  const auto meta = host_copy<int4>(base + layout.meta_offset(), pool_rows);
  const auto rows = host_copy<uint16_t>(base + layout.recv_offset(), fp8_payload ? 0 : pool_rows * s.hidden);
  const auto rows_fp8 = host_copy<uint8_t>(base + layout.recv_offset(), fp8_payload ? pool_rows * s.hidden : 0);
  const auto row_scales = host_copy<float>(base + layout.scales_offset(), pool_rows * scale_cols);
  std::vector<std::tuple<int, int, int, int>> expected, arrived;  // (expert, rank, token, slot)
  for (int src = 0; src < view.world; ++src)
    for (int t = 0; t < s.tokens[src]; ++t) {
      const auto e = experts_of(s, src, t);
      for (int j = 0; j < s.k; ++j)
        if (e[j] / epr == me) expected.emplace_back(e[j] % epr, src, t, j);
    }
  std::vector<int> per_expert(epr);
  std::vector<uint16_t> y(pool_rows * s.hidden);
  for (int row = 0; row < received; ++row) {
    const int4 m = meta[row];
    ASSERT_GE(m.w, 0);
    ASSERT_LT(m.w, epr);
    ++per_expert[m.w];
    arrived.emplace_back(m.w, m.x, m.y, m.z);
    for (int c = 0; c < scale_cols; ++c)
      ASSERT_EQ(row_scales[int64_t{row} * scale_cols + c], scale_of(m.x, m.y, c)) << "scales from rank " << m.x;
    for (int i = 0; i < s.hidden; ++i) {
      if (fp8_payload) {
        ASSERT_EQ(rows_fp8[int64_t{row} * s.hidden + i], fp8_byte(m.x, m.y, i)) << "row from rank " << m.x;
      }
      const float v = fp8_payload ? x_of(m.x, m.y, i) : bf16_to_float(rows[int64_t{row} * s.hidden + i]);
      ASSERT_EQ(v, x_of(m.x, m.y, i)) << "row from rank " << m.x << " token " << m.y;
      y[int64_t{row} * s.hidden + i] = float_to_bf16(expert_out(v, me * epr + m.w, i, false));
    }
  }
  for (int e = 0; e < epr; ++e) ASSERT_EQ(counts[e], per_expert[e]) << "expert " << e;
  std::sort(expected.begin(), expected.end());
  std::sort(arrived.begin(), arrived.end());
  ASSERT_EQ(arrived, expected) << "rank " << me;

  float* d_out = device_copy(std::vector<float>(std::max<size_t>(1, static_cast<size_t>(n) * s.hidden)));
  void* d_y = nullptr;
  if (!f32_rows) {
    d_y = device_copy(y);
    ASSERT_EQ(combine({view, layout, static_cast<const bf16*>(d_y), d_w, d_out, n}, nullptr), cudaSuccess);
  } else {
    // The received rows as grouped-GEMM groups: offsets are the counts' prefix
    // sums, tiles of 4 rows, and expert e's GEMM rows read each of its pool
    // rows once.
    constexpr int kTile = 4;
    const int64_t max_rows = max_received_rows(layout);
    auto* d_groups = device_copy(std::vector<int32_t>(static_cast<size_t>(2 * (epr + 1) + max_rows), -1));
    ASSERT_EQ(received_groups({view, layout, d_groups, d_groups + epr + 1, d_groups + 2 * (epr + 1), kTile},
                              nullptr),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto groups = host_copy<int32_t>(d_groups, static_cast<size_t>(2 * (epr + 1) + max_rows));
    const int32_t* offsets = groups.data();
    const int32_t* tiles = offsets + epr + 1;
    const int32_t* gather = tiles + epr + 1;
    ASSERT_EQ(offsets[0], 0);
    ASSERT_EQ(tiles[0], 0);
    std::vector<int> seen(static_cast<size_t>(received));
    for (int e = 0; e < epr; ++e) {
      ASSERT_EQ(offsets[e + 1], offsets[e] + counts[e]) << "expert " << e;
      ASSERT_EQ(tiles[e + 1], tiles[e] + (counts[e] + kTile - 1) / kTile) << "expert " << e;
      for (int g = offsets[e]; g < offsets[e + 1]; ++g) {
        ASSERT_GE(gather[g], 0);
        ASSERT_LT(gather[g], received);
        ASSERT_EQ(meta[gather[g]].w, e) << "GEMM row " << g;
        ++seen[gather[g]];
      }
    }
    for (int row = 0; row < received; ++row) ASSERT_EQ(seen[row], 1) << "pool row " << row;
    std::vector<float> y_rows(std::max<size_t>(1, static_cast<size_t>(offsets[epr]) * s.hidden));
    for (int g = 0; g < offsets[epr]; ++g) {
      const int4 m = meta[gather[g]];
      for (int i = 0; i < s.hidden; ++i)
        y_rows[static_cast<size_t>(g) * s.hidden + i] = expert_out(x_of(m.x, m.y, i), me * epr + m.w, i, true);
    }
    d_y = device_copy(y_rows);
    CombineParams p{view, layout, nullptr, d_w, d_out, n};
    p.y_rows = static_cast<const float*>(d_y);
    ASSERT_EQ(combine(p, nullptr), cudaSuccess);
    cudaFree(d_groups);
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto out = host_copy<float>(d_out, static_cast<size_t>(n) * s.hidden);
  for (int t = 0; t < n; ++t) {
    const auto e = experts_of(s, me, t);
    for (int i = 0; i < s.hidden; ++i) {
      float ref = 0.0f;
      for (int j = 0; j < s.k; ++j)
        ref += weights[t * s.k + j] *
               bf16_to_float(float_to_bf16(expert_out(x_of(me, t, i), e[j], i, f32_rows)));
      ASSERT_NEAR(out[static_cast<size_t>(t) * s.hidden + i], ref, 1e-5f * std::abs(ref)) << "token " << t << " element " << i;
    }
  }
  for (void* p : {static_cast<void*>(d_x), static_cast<void*>(d_x_fp8), static_cast<void*>(d_x_scales),
                  static_cast<void*>(d_ids), static_cast<void*>(d_w), static_cast<void*>(d_y),
                  static_cast<void*>(d_out)})
    cudaFree(p);
}

TEST(CommCuda, DispatchThenCombineEqualsReference) {
  SKIP_WITHOUT_GPU();
  const std::string e = run_ranks(2, [](TcpBootstrap& b) {
    Routing s;
    s.tokens = {11, 0};  // rank 1 has no tokens and still takes part
    const ExpertLayout layout{2, s.num_experts / 2, s.max_tokens, s.k, s.hidden};
    auto mem = open_memory(b, layout.total_bytes() - kSignalBytes);
    ASSERT_NE(mem, nullptr);
    round_trip(mem->view(), s, 0);
    s.tokens = {7, 16};
    round_trip(mem->view(), s, 1);  // second dispatch: the other counter parity
    s.tokens = {16, 5};
    round_trip(mem->view(), s, 0, true);  // outputs from the grouped GEMM's f32 rows
    s.tokens = {0, 9};
    round_trip(mem->view(), s, 1, true);
  });
  EXPECT_EQ(e, "");
}

// The same with an FP8 payload (E4M3 rows and their scales per 128 columns).
TEST(CommCuda, DispatchFp8RowsWithTheirScales) {
  SKIP_WITHOUT_GPU();
  const std::string e = run_ranks(2, [](TcpBootstrap& b) {
    Routing s;
    s.hidden = 512;  // 4 scale columns
    s.tokens = {12, 5};
    const ExpertLayout layout{2, s.num_experts / 2, s.max_tokens, s.k, s.hidden, true};
    auto mem = open_memory(b, layout.total_bytes() - kSignalBytes);
    ASSERT_NE(mem, nullptr);
    round_trip(mem->view(), s, 0, true, true);
    s.tokens = {0, 16};
    round_trip(mem->view(), s, 1, false, true);
  });
  EXPECT_EQ(e, "");
}

#ifdef MOE_COMM_HAVE_NCCL
TEST(CommCuda, NcclAgreesWithOurs) {
  if (gpu_count() < 2) GTEST_SKIP() << "NCCL needs a GPU per rank: 2, found " << gpu_count();
  auto version = NcclCommunicator::library_version();
  if (!version) GTEST_SKIP() << version.status().to_string();
  const std::string e = moe::comm::testing::run_gpu_ranks(2, [](TcpBootstrap& b) {
    auto nccl = NcclCommunicator::create(b, b.rank());
    ASSERT_TRUE(nccl.has_value()) << nccl.status().to_string();
    const int64_t n = (1 << 20) + 8;
    std::vector<uint16_t> input(n);
    for (int64_t i = 0; i < n; ++i) input[i] = value_of(b.rank(), i);
    uint16_t* data = device_copy(input);
    ASSERT_TRUE((*nccl)->all_reduce(reinterpret_cast<bf16*>(data), reinterpret_cast<bf16*>(data), n, nullptr).is_ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto out = host_copy<uint16_t>(data, n);
    cudaFree(data);
    for (int64_t i = 0; i < n; ++i)  // two addends: the order cannot matter
      ASSERT_EQ(out[i], float_to_bf16(bf16_to_float(value_of(0, i)) + bf16_to_float(value_of(1, i)))) << i;
  });
  EXPECT_EQ(e, "");
}
#endif

}  // namespace
}  // namespace moe::comm::cuda
