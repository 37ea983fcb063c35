// CUDA IPC transport on a machine with GPUs (label "gpu"): device-to-device
// writes between two GPUs of this process, and from this process into a
// region exported by a child process (a real cudaIpcOpenMemHandle), checked
// byte for byte against the host pattern they were made from. Big runs take
// cudaMemcpyAsync, batches of small ones the copy kernel; both are covered.
// Skips, saying why, without two GPUs.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <nlohmann/json.hpp>

#include "tests/transfer/transfer_test_util.h"

extern char** environ;

namespace moe::transfer {
namespace {

using namespace moe::transfer::testing;

int num_gpus() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

#define REQUIRE_TWO_GPUS()                                                                       \
  do {                                                                                           \
    const int n = num_gpus();                                                                    \
    if (n < 2) GTEST_SKIP() << "needs 2 CUDA devices, found " << n << ": CUDA IPC test skipped"; \
  } while (0)

uint8_t pattern(uint64_t i, uint32_t seed) { return static_cast<uint8_t>((i * 2654435761u + seed) >> 11); }

struct DeviceMemory {
  void* ptr = nullptr;
  int device = 0;
  DeviceMemory(int d, size_t n) : device(d) {
    cudaSetDevice(d);
    EXPECT_EQ(cudaMalloc(&ptr, n), cudaSuccess);
  }
  ~DeviceMemory() {
    cudaSetDevice(device);
    cudaFree(ptr);
  }
};

std::vector<uint8_t> download(const void* ptr, size_t n) {
  std::vector<uint8_t> host(n);
  EXPECT_EQ(cudaMemcpy(host.data(), ptr, n, cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

void upload(void* ptr, const std::vector<uint8_t>& host) {
  EXPECT_EQ(cudaMemcpy(ptr, host.data(), host.size(), cudaMemcpyHostToDevice), cudaSuccess);
}

TEST(CudaIpc, PeerWritesBetweenTwoGpusOfOneProcess) {
  REQUIRE_TWO_GPUS();
  auto sender = make_engine();
  auto receiver = make_engine();
  ASSERT_NE(std::find(sender->transports().begin(), sender->transports().end(), TransportKind::kCudaIpc),
            sender->transports().end());
  const size_t n = 64 << 20;
  DeviceMemory src(0, n), dst(1, n);
  std::vector<uint8_t> src_host(n), dst_host(n, 0);
  for (size_t i = 0; i < n; ++i) src_host[i] = pattern(i, 1);
  cudaSetDevice(0);
  upload(src.ptr, src_host);
  cudaSetDevice(1);
  upload(dst.ptr, dst_host);
  auto src_id = sender->register_region(src.ptr, n, MemoryKind::kDevice, 0);
  auto dst_id = receiver->register_region(dst.ptr, n, MemoryKind::kDevice, 1);
  ASSERT_TRUE(src_id && dst_id) << src_id.status().to_string() << dst_id.status().to_string();
  const RegionDescriptor remote = *receiver->describe(*dst_id);
  EXPECT_EQ(remote.transport, TransportKind::kCudaIpc);
  EXPECT_EQ(remote.device, 1);

  ASSERT_TRUE(receiver->arm(1).is_ok());
  // One big write, then a paged one with shuffled destination pages.
  auto big = sender->submit_write(*src_id, 0, remote, 0, n / 2, 1);
  ASSERT_TRUE(big.has_value()) << big.status().to_string();
  std::vector<int32_t> src_pages(32), dst_pages(32);
  std::iota(src_pages.begin(), src_pages.end(), 0);
  std::iota(dst_pages.begin(), dst_pages.end(), 0);
  std::mt19937 rng(3);
  std::shuffle(dst_pages.begin(), dst_pages.end(), rng);
  const uint64_t page = 256 << 10, half = n / 2;
  PagedWrite paged{*src_id, remote, src_pages, dst_pages, half, page, half, page, page - 100};
  auto paged_id = sender->submit_paged(paged, 1);
  ASSERT_TRUE(paged_id.has_value()) << paged_id.status().to_string();
  // KV-like: 512 aligned 4 KB runs to shuffled places past the pages above (the copy kernel).
  std::vector<transfer::Run> small_runs;
  std::vector<int32_t> slots(1024);
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  const uint64_t small_base = half + 32 * page;
  for (int i = 0; i < 512; ++i)
    small_runs.push_back(transfer::Run{small_base + i * 4096ull, small_base + slots[i] * 4096ull, 4096});
  RegionRuns small_group{*src_id, remote, small_runs};
  auto small_id = sender->submit_scattered({&small_group, 1}, 1);
  ASSERT_TRUE(small_id.has_value()) << small_id.status().to_string();
  ASSERT_TRUE(receiver->wait_for(1, 3, kTimeout).is_ok());
  EXPECT_TRUE(sender->wait(*big, kTimeout).is_ok());
  EXPECT_TRUE(sender->wait(*paged_id, kTimeout).is_ok());
  EXPECT_TRUE(sender->wait(*small_id, kTimeout).is_ok());

  std::vector<transfer::Run> runs = {{0, 0, half}};
  for (int i = 0; i < 32; ++i) runs.push_back(transfer::Run{half + src_pages[i] * page, half + dst_pages[i] * page, page - 100});
  runs.insert(runs.end(), small_runs.begin(), small_runs.end());
  const auto want = expected_after(dst_host, src_host, runs);
  cudaSetDevice(1);
  EXPECT_TRUE(download(dst.ptr, n) == want);
}

// Device memory goes out through CUDA IPC only: a write from a device region
// into a host (TCP) region is refused before anything is sent, instead of the
// TCP sender reading device memory with the CPU. Needs one GPU.
TEST(CudaIpc, DeviceMemoryIsNotSentOverTcp) {
  if (num_gpus() < 1) GTEST_SKIP() << "needs a CUDA device";
  auto sender = make_engine();
  auto receiver = make_engine();
  const size_t n = 1 << 20;
  DeviceMemory src(0, n);
  auto src_id = sender->register_region(src.ptr, n, MemoryKind::kDevice, 0);
  ASSERT_TRUE(src_id.has_value()) << src_id.status().to_string();
  Buffer dst = registered(*receiver, std::vector<uint8_t>(n, 7));
  ASSERT_EQ(dst.descriptor.transport, TransportKind::kTcp);
  ASSERT_TRUE(receiver->arm(5).is_ok());
  auto id = sender->submit_write(*src_id, 0, dst.descriptor, 0, n, 5);
  ASSERT_FALSE(id.has_value());
  EXPECT_EQ(id.status().code(), StatusCode::kUnimplemented) << id.status().to_string();
  EXPECT_NE(id.status().message().find("only CUDA IPC"), std::string::npos) << id.status().to_string();
  EXPECT_EQ(receiver->poll_imm(5).num_completed, 0u);
  EXPECT_EQ(sender->stats().num_bytes_sent, 0u);
}

// Child mode: export a region on the last GPU, print its descriptor, wait for
// one batch and check the bytes. transfer::Run only by the parent test below.
TEST(CudaIpcChild, Receiver) {
  const char* size_text = std::getenv("MOE_TRANSFER_IPC_CHILD_BYTES");
  if (size_text == nullptr) GTEST_SKIP() << "runs only as the child of CudaIpc.WriteIntoAnotherProcess";
  const size_t n = std::strtoull(size_text, nullptr, 10);
  const int device = num_gpus() - 1;
  auto receiver = make_engine();
  DeviceMemory dst(device, n);
  upload(dst.ptr, std::vector<uint8_t>(n, 0));
  auto id = receiver->register_region(dst.ptr, n, MemoryKind::kDevice, device);
  ASSERT_TRUE(id.has_value()) << id.status().to_string();
  ASSERT_TRUE(receiver->arm(9).is_ok());
  std::printf("DESCRIPTOR %s\n", receiver->describe(*id)->to_json().dump().c_str());
  std::fflush(stdout);
  ASSERT_TRUE(receiver->wait_for(9, 1, kTimeout).is_ok());
  const auto got = download(dst.ptr, n);
  size_t mismatches = 0;
  for (size_t i = 0; i < n; ++i) mismatches += got[i] != pattern(i, 5);
  EXPECT_EQ(mismatches, 0u);
}

TEST(CudaIpc, WriteIntoAnotherProcess) {
  REQUIRE_TWO_GPUS();
  const size_t n = 32 << 20;
  int out[2];
  ASSERT_EQ(pipe(out), 0);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
  posix_spawn_file_actions_addclose(&actions, out[0]);
  const std::string bytes_env = "MOE_TRANSFER_IPC_CHILD_BYTES=" + std::to_string(n);
  std::vector<std::string> env_strings = {bytes_env};
  for (char** e = environ; *e != nullptr; ++e) env_strings.emplace_back(*e);
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string self = "/proc/self/exe", filter = "--gtest_filter=CudaIpcChild.Receiver";
  char* argv[] = {self.data(), filter.data(), nullptr};
  pid_t child = 0;
  ASSERT_EQ(posix_spawn(&child, "/proc/self/exe", &actions, nullptr, argv, envp.data()), 0);
  posix_spawn_file_actions_destroy(&actions);
  close(out[1]);
  FILE* child_out = fdopen(out[0], "r");
  std::string descriptor_json;
  char line[8192];
  while (std::fgets(line, sizeof(line), child_out) != nullptr) {
    if (std::strncmp(line, "DESCRIPTOR ", 11) == 0) {
      descriptor_json = line + 11;
      break;
    }
  }
  ASSERT_FALSE(descriptor_json.empty()) << "the child printed no descriptor";
  auto remote = RegionDescriptor::from_json(nlohmann::json::parse(descriptor_json));
  ASSERT_TRUE(remote.has_value()) << remote.status().to_string();

  auto sender = make_engine();
  DeviceMemory src(0, n);
  std::vector<uint8_t> src_host(n);
  for (size_t i = 0; i < n; ++i) src_host[i] = pattern(i, 5);
  cudaSetDevice(0);
  upload(src.ptr, src_host);
  auto src_id = sender->register_region(src.ptr, n, MemoryKind::kDevice, 0);
  ASSERT_TRUE(src_id.has_value()) << src_id.status().to_string();
  // First half one big run (cudaMemcpyAsync), second half 4 KB runs in shuffled
  // order (the copy kernel storing through the IPC mapping).
  std::vector<transfer::Run> runs = {{0, 0, n / 2}};
  for (uint64_t offset = n / 2; offset < n; offset += 4096) runs.push_back(transfer::Run{offset, offset, 4096});
  std::mt19937 rng(9);
  std::shuffle(runs.begin() + 1, runs.end(), rng);
  RegionRuns group{*src_id, *remote, runs};
  auto id = sender->submit_scattered({&group, 1}, 9);
  ASSERT_TRUE(id.has_value()) << id.status().to_string();
  EXPECT_TRUE(sender->wait(*id, kTimeout).is_ok());
  std::string rest;
  while (std::fgets(line, sizeof(line), child_out) != nullptr) rest += line;
  fclose(child_out);
  int status = 0;
  waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child output:\n" << rest;
}

}  // namespace
}  // namespace moe::transfer
