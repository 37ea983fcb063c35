// The CPU shared-memory communicator: all-reduce against a sum in rank order
// (bit-exact, every size from 1 element to 64 MB, one-shot and two-shot,
// chunked through small buffers), the fused all-reduce + add + RMSNorm against
// all-reduce then ops::cpu::add_rms_norm, broadcast, barriers, ranks as
// threads and as forked processes, timeouts naming the missing rank, a killed
// rank named at once, and the NVLS refusal rule.
#include <gtest/gtest.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>

#include "comm/nvls_policy.h"
#include "comm_test_util.h"
#include "ops/norm.h"

namespace moe::comm {
namespace {

using namespace moe::comm::testing;

// Every element of an all-reduce of n elements, compared bit for bit with
// `reference` (sum_of for each element; computed here when not given).
std::string check_all_reduce(Communicator& comm, size_t n, const std::vector<float>* reference = nullptr) {
  std::vector<float> data(n);
  for (size_t i = 0; i < n; ++i) data[i] = value_of(comm.rank(), i);
  if (Status s = comm.all_reduce_sum(data); !s) return s.to_string();
  for (size_t i = 0; i < n; ++i) {
    const float expected = reference != nullptr ? (*reference)[i] : sum_of(comm.world_size(), i);
    if (std::memcmp(&data[i], &expected, sizeof(float)) != 0)
      return fmt::format("n {}: element {} is {}, expected {}", n, i, data[i], expected);
  }
  return "";
}

// Odd sizes around the chunk (64 KiB buffer = 16384 floats), the part
// alignment and the one-shot/two-shot crossover (256 KiB = 65536 floats).
const std::vector<size_t> kSizes = {1, 2, 3, 5, 15, 16, 17, 63, 1000, 4099, 16383, 16384, 16385, 65535, 65536, 65537,
                                    300001};

TEST(ShmAllReduce, EqualsRankOrderSumAtTwoAndFourRanks) {
  for (int world : {2, 4}) {
    run_threads(world, 64 << 10, [&](Communicator& comm) {
      for (size_t n : kSizes) EXPECT_EQ(check_all_reduce(comm, n), "") << "world " << world;
    });
  }
}

TEST(ShmAllReduce, SixtyFourMegabytes) {
  const size_t n = (64u << 20) / sizeof(float) + 3;  // odd, just over 64 MB
#if defined(NDEBUG) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
  const std::vector<int> worlds = {2, 4};
#else
  const std::vector<int> worlds = {2};  // Debug and sanitizer builds: 4 ranks take ~30 s
#endif
  for (int world : worlds) {
    // 16 MB buffers: the message goes in five chunks, each two-shot.
    std::vector<float> reference(n);
    for (size_t i = 0; i < n; ++i) reference[i] = sum_of(world, i);
    run_threads(world, 16 << 20, [&](Communicator& comm) { EXPECT_EQ(check_all_reduce(comm, n, &reference), ""); });
  }
}

TEST(ShmAllReduce, ForkedProcesses) {
  run_processes(2, 256 << 10, [](Communicator& comm) {
    for (size_t n : {size_t{1}, size_t{17}, size_t{65537}, size_t{(1u << 20) + 5}})
      if (std::string e = check_all_reduce(comm, n); !e.empty()) return e;
    std::vector<uint8_t> bytes(comm.rank() == 1 ? 100000 : 0, 7);
    if (Status s = comm.broadcast_bytes(bytes, 1); !s) return s.to_string();
    if (bytes.size() != 100000 || bytes[99999] != 7) return std::string("broadcast across processes");
    return std::string();
  });
}

TEST(ShmAllReduce, EmptyMessageAndSingleRank) {
  run_threads(3, 64 << 10, [](Communicator& comm) {
    std::vector<float> none;
    EXPECT_TRUE(comm.all_reduce_sum(none).is_ok());
    EXPECT_EQ(check_all_reduce(comm, 5), "");
  });
  auto comm = open_shm_communicator(group(unique_name("s"), 0, 1, 1 << 20, 1000));
  ASSERT_TRUE(comm.has_value()) << comm.status().to_string();
  std::vector<float> data = {1.5f, -2.0f};
  EXPECT_TRUE((*comm)->all_reduce_sum(data).is_ok());
  EXPECT_EQ(data[1], -2.0f);
  EXPECT_TRUE((*comm)->barrier().is_ok());
}

// Fused vs reference on every rank: the reference sums the ranks' deltas in
// rank order and calls ops::cpu::add_rms_norm; results must match exactly
// (same f32 operations in the same order).
void check_fused(Communicator& comm, int64_t rows, int64_t hidden, DType weight_dtype) {
  const int world = comm.world_size();
  const Shape shape{rows, hidden};
  Tensor delta(DType::kF32, shape), residual(DType::kF32, shape), normed(DType::kF32, shape);
  Tensor ref_delta(DType::kF32, shape), ref_residual(DType::kF32, shape), ref_normed(DType::kF32, shape);
  Tensor weight(weight_dtype, {hidden});
  for (int64_t i = 0; i < hidden; ++i) {
    const float w = 1.0f + value_of(99, i);
    if (weight_dtype == DType::kF32) weight.data_as<float>()[i] = w;
    else weight.data_as<uint16_t>()[i] = float_to_bf16(w);
  }
  for (int64_t i = 0; i < rows * hidden; ++i) {
    delta.data_as<float>()[i] = value_of(comm.rank(), i);
    residual.data_as<float>()[i] = ref_residual.data_as<float>()[i] = 10.0f * value_of(77, i);
    ref_delta.data_as<float>()[i] = sum_of(world, i);
  }
  ASSERT_TRUE(comm.all_reduce_add_rms_norm(delta, residual, weight, 1e-6f, normed).is_ok());
  ThreadPool pool(1);
  ops::cpu::add_rms_norm(pool, ref_residual, ref_delta, weight, 1e-6f, ref_normed);
  EXPECT_EQ(std::memcmp(residual.data(), ref_residual.data(), residual.num_bytes()), 0)
      << "residual, rows " << rows << " hidden " << hidden;
  EXPECT_EQ(std::memcmp(normed.data(), ref_normed.data(), normed.num_bytes()), 0)
      << "normed, rows " << rows << " hidden " << hidden;
}

TEST(ShmFused, EqualsAllReduceThenAddRmsNorm) {
  for (int world : {2, 4}) {
    // 256 KiB buffers: 32 rows of 1024 fit twice, so 100 rows go in chunks;
    // 100 x 1024 x 4 bytes is past the crossover (two-shot), 3 x 1024 not.
    run_threads(world, 256 << 10, [&](Communicator& comm) {
      check_fused(comm, 1, 64, DType::kF32);
      check_fused(comm, 3, 1024, DType::kBF16);
      check_fused(comm, 5, 4096, DType::kBF16);  // a decode batch at Qwen3's hidden size
      check_fused(comm, 100, 1024, DType::kF32);
      check_fused(comm, 65, 1024, DType::kBF16);  // 65 rows over 4 ranks: uneven split
      check_fused(comm, 0, 1024, DType::kBF16);
    });
  }
}

TEST(ShmFused, SingleRankIsAddRmsNorm) {
  auto comm = open_shm_communicator(group(unique_name("s"), 0, 1, 1 << 20, 1000));
  ASSERT_TRUE(comm.has_value());
  check_fused(**comm, 7, 256, DType::kBF16);
}

TEST(ShmBroadcast, SizesAndRoots) {
  run_threads(3, 64 << 10, [](Communicator& comm) {
    for (size_t size : {size_t{0}, size_t{1}, size_t{1000}, size_t{65536}, size_t{200003}}) {
      for (int root : {0, 2}) {
        std::vector<uint8_t> data;
        if (comm.rank() == root)
          for (size_t i = 0; i < size; ++i) data.push_back(static_cast<uint8_t>(i * 31 + root));
        else
          data.assign(17, 0xEE);  // replaced, whatever it held
        ASSERT_TRUE(comm.broadcast_bytes(data, root).is_ok());
        ASSERT_EQ(data.size(), size);
        for (size_t i = 0; i < size; ++i) ASSERT_EQ(data[i], static_cast<uint8_t>(i * 31 + root)) << i;
      }
    }
    EXPECT_TRUE(comm.barrier().is_ok());
  });
}

TEST(ShmTimeout, RankThatNeverOpensIsNamed) {
  const std::string name = unique_name("o");
  const auto start = std::chrono::steady_clock::now();
  auto comm = open_shm_communicator(group(name, 0, 3, 64 << 10, 300));
  const auto elapsed = std::chrono::steady_clock::now() - start;
  ASSERT_FALSE(comm.has_value());
  EXPECT_EQ(comm.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(comm.status().message().find("rank 1"), std::string::npos) << comm.status().message();
  EXPECT_LT(elapsed, std::chrono::seconds(5));
  EXPECT_EQ(count_segments(name), 0);
}

TEST(ShmTimeout, RankThatSkipsACollectiveIsNamed) {
  const std::string name = unique_name("c");
  std::atomic<bool> done{false};
  std::vector<std::thread> threads;
  Status failure;
  for (int r = 0; r < 3; ++r)
    threads.emplace_back([&, r] {
      auto comm = open_shm_communicator(group(name, r, 3, 64 << 10, 300));
      ASSERT_TRUE(comm.has_value()) << comm.status().to_string();
      if (r == 2) {  // alive, but never calls the all-reduce
        while (!done) std::this_thread::sleep_for(std::chrono::milliseconds(5));
        return;
      }
      std::vector<float> data(10, 1.0f);
      Status s = (*comm)->all_reduce_sum(data);
      EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.to_string();
      EXPECT_NE(s.message().find("rank(s) 2 "), std::string::npos) << s.message();
      // Out of step from now on: fails at once instead of waiting again.
      EXPECT_EQ((*comm)->barrier().code(), StatusCode::kAborted);
      if (r == 0) failure = s;
    });
  threads[0].join();
  threads[1].join();
  done = true;
  threads[2].join();
  EXPECT_FALSE(failure.is_ok());
  EXPECT_EQ(count_segments(name), 0);
}

// A rank killed while its peers wait in a collective: they fail within
// milliseconds naming it, not at the 30 s deadline. The child is not reaped
// until afterwards, so the waiting rank sees a zombie, as a leader whose
// follower just died does.
TEST(ShmLiveness, RankKilledDuringACollectiveIsNamedAtOnce) {
  const std::string name = unique_name("k");
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto comm = open_shm_communicator(group(name, 1, 2, 64 << 10, 30000));
    if (!comm.has_value()) _exit(2);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the parent is waiting by now
    raise(SIGKILL);
  }
  auto comm = open_shm_communicator(group(name, 0, 2, 64 << 10, 30000));
  ASSERT_TRUE(comm.has_value()) << comm.status().to_string();
  const auto start = std::chrono::steady_clock::now();
  std::vector<float> data(100, 1.0f);
  const Status s = (*comm)->all_reduce_sum(data);
  const auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.to_string();
  EXPECT_NE(s.message().find(fmt::format("rank(s) 1 (pid {}) exited", child)), std::string::npos) << s.message();
  EXPECT_LT(elapsed, std::chrono::seconds(5));
  EXPECT_EQ((*comm)->barrier().code(), StatusCode::kAborted);  // out of step from now on
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  EXPECT_EQ(count_segments(name), 0);
}

// Ranks that are threads of one process share its pid: a slow rank is never
// taken for an exited one.
TEST(ShmLiveness, SlowThreadRankIsWaitedFor) {
  run_threads(2, 64 << 10, [](Communicator& comm) {
    if (comm.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(150));
    std::vector<float> data(10, 1.0f);
    const Status s = comm.all_reduce_sum(data);
    EXPECT_TRUE(s.is_ok()) << s.to_string();
    EXPECT_EQ(data[0], 2.0f);
  });
}

TEST(ShmOpen, MismatchedBufferSizeIsAnError) {
  // The rank that maps the other's segment first reports the mismatch; the
  // other may instead time out waiting for a peer that has given up.
  const std::string name = unique_name("m");
  Status s0, s1;
  std::thread a([&] { s0 = open_shm_communicator(group(name, 0, 2, 64 << 10, 500)).status(); });
  std::thread b([&] { s1 = open_shm_communicator(group(name, 1, 2, 128 << 10, 500)).status(); });
  a.join();
  b.join();
  EXPECT_FALSE(s0.is_ok());
  EXPECT_FALSE(s1.is_ok());
  EXPECT_TRUE(s0.code() == StatusCode::kInvalidArgument || s1.code() == StatusCode::kInvalidArgument)
      << s0.to_string() << " / " << s1.to_string();
  EXPECT_EQ(count_segments(name), 0);
  EXPECT_EQ(open_shm_communicator(group("bad/name", 0, 2, 64 << 10, 100)).status().code(),
            StatusCode::kInvalidArgument);
}

// The NVLS rule: refused when any of the three variables forbids multicast.
TEST(NvlsPolicy, RefusesWhenTheHostForbidsMulticast) {
  const char* names[] = {"NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"};
  std::vector<std::string> saved;
  for (const char* n : names) {
    const char* v = std::getenv(n);
    saved.push_back(v == nullptr ? std::string("\x01") : std::string(v));
    unsetenv(n);
  }
  EXPECT_TRUE(check_nvls_allowed().is_ok());
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  Status s = check_nvls_allowed();
  EXPECT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("NCCL_NVLS_ENABLE"), std::string::npos);
  setenv("NCCL_NVLS_ENABLE", "1", 1);
  EXPECT_TRUE(check_nvls_allowed().is_ok());
  setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1", 1);
  EXPECT_NE(check_nvls_allowed().message().find("TORCH_SYMM_MEM_DISABLE_MULTICAST"), std::string::npos);
  unsetenv("TORCH_SYMM_MEM_DISABLE_MULTICAST");
  setenv("NVSHMEM_DISABLE_NVLS", "1", 1);
  EXPECT_NE(check_nvls_allowed().message().find("NVSHMEM_DISABLE_NVLS"), std::string::npos);
  // The NVLS setup's first step (comm/cuda/nvls.cc): refused here by the
  // environment, and refused anywhere when not asked for.
  EXPECT_FALSE(nvls_preflight(true).is_ok());
  unsetenv("NVSHMEM_DISABLE_NVLS");
  EXPECT_TRUE(nvls_preflight(true).is_ok());
  EXPECT_EQ(nvls_preflight(false).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(*parse_all_reduce_algorithm("auto"), AllReduceAlgorithm::kAuto);
  EXPECT_EQ(*parse_all_reduce_algorithm("nvls"), AllReduceAlgorithm::kNvls);
  EXPECT_FALSE(parse_all_reduce_algorithm("multicast").has_value());
  for (size_t i = 0; i < 3; ++i) {
    if (saved[i] == "\x01") unsetenv(names[i]);
    else setenv(names[i], saved[i].c_str(), 1);
  }
}

}  // namespace
}  // namespace moe::comm
