// Bootstrap: rank/world from MPI, torchrun-style variables and flags; the TCP
// rendezvous on 127.0.0.1 with threads and forked processes (all-gather of
// blobs, broadcast, an agreed shm name that opens a communicator); timeouts
// and peers that close early are errors, never hangs.
#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <map>
#include <thread>

#include "comm/bootstrap.h"
#include "comm/fd_exchange.h"
#include "comm/cpu/shm_communicator.h"

namespace moe::comm {
namespace {

EnvLookup env_of(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](const char* name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

TEST(ResolveLaunch, OpenMpiVariablesComeFirst) {
  auto c = resolve_launch({}, env_of({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "8"},
                                      {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                                      {"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_ADDR", "10.0.0.1"}}));
  ASSERT_TRUE(c.has_value()) << c.status().to_string();
  EXPECT_EQ(c->rank, 3);
  EXPECT_EQ(c->world_size, 8);
  EXPECT_EQ(c->local_rank, 1);
  EXPECT_EQ(c->local_world_size, 2);
  EXPECT_EQ(c->master_addr, "10.0.0.1");
  EXPECT_EQ(c->master_port, 29500);
  EXPECT_EQ(c->source, "mpi (Open MPI)");
}

TEST(ResolveLaunch, PmiAndTorchrunVariables) {
  auto pmi = resolve_launch({}, env_of({{"PMI_RANK", "5"}, {"PMI_SIZE", "6"}, {"MPI_LOCALRANKID", "1"}}));
  ASSERT_TRUE(pmi.has_value()) << pmi.status().to_string();
  EXPECT_EQ(pmi->rank, 5);
  EXPECT_EQ(pmi->local_rank, 1);
  auto torch = resolve_launch({}, env_of({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"},
                                          {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_PORT", "1234"}}));
  ASSERT_TRUE(torch.has_value()) << torch.status().to_string();
  EXPECT_EQ(torch->rank, 1);
  EXPECT_EQ(torch->world_size, 2);
  EXPECT_EQ(torch->master_port, 1234);
  EXPECT_EQ(torch->source, "torchrun env");
}

TEST(ResolveLaunch, FlagsAndErrors) {
  LaunchFlags flags;
  flags.nnodes = 2;
  flags.node_rank = 1;
  flags.nproc_per_node = 4;
  flags.local_rank = 2;
  flags.master_addr = "node0";
  flags.master_port = 4000;
  auto c = resolve_launch(flags, env_of({{"MASTER_ADDR", "ignored"}, {"MASTER_PORT", "1"}}));
  ASSERT_TRUE(c.has_value()) << c.status().to_string();
  EXPECT_EQ(c->rank, 6);
  EXPECT_EQ(c->world_size, 8);
  EXPECT_EQ(c->master_addr, "node0");
  EXPECT_EQ(c->master_port, 4000);
  auto single = resolve_launch({}, env_of({}));
  ASSERT_TRUE(single.has_value());
  EXPECT_EQ(single->world_size, 1);

  EXPECT_FALSE(resolve_launch({}, env_of({{"RANK", "2"}, {"WORLD_SIZE", "2"}})).has_value());
  EXPECT_FALSE(resolve_launch({}, env_of({{"RANK", "x"}, {"WORLD_SIZE", "2"}})).has_value());
  EXPECT_FALSE(resolve_launch({}, env_of({{"MASTER_PORT", "70000"}})).has_value());
  flags.node_rank = 2;
  EXPECT_FALSE(resolve_launch(flags, env_of({})).has_value());
}

// Runs body(bootstrap) on `world` threads against a rank 0 on a free port.
void run_group(int world, const std::function<void(TcpBootstrap&)>& body, int timeout_ms = 10000) {
  auto listener = BootstrapListener::bind("127.0.0.1", 0);
  ASSERT_TRUE(listener.has_value()) << listener.status().to_string();
  const int port = listener->port();
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      auto b = r == 0 ? TcpBootstrap::accept(std::move(listener).value(), world, timeout_ms)
                      : TcpBootstrap::connect("127.0.0.1", port, r, world, timeout_ms);
      ASSERT_TRUE(b.has_value()) << b.status().to_string();
      body(**b);
    });
  for (auto& t : threads) t.join();
}

std::vector<uint8_t> blob_of(int rank, size_t size) {
  std::vector<uint8_t> blob(size);
  for (size_t i = 0; i < size; ++i) blob[i] = static_cast<uint8_t>(rank * 37 + i);
  return blob;
}

TEST(TcpBootstrap, AllGatherAndBroadcastAcrossThreads) {
  run_group(4, [](TcpBootstrap& b) {
    for (size_t size : {size_t{0}, size_t{1}, size_t{100}, size_t{300000}}) {
      // Sizes differ per rank: rank r sends size + r bytes.
      auto all = b.all_gather(blob_of(b.rank(), size + b.rank()));
      ASSERT_TRUE(all.has_value()) << all.status().to_string();
      ASSERT_EQ(all->size(), 4u);
      for (int r = 0; r < 4; ++r) EXPECT_EQ((*all)[r], blob_of(r, size + r));
    }
    auto root = b.broadcast_from_root(blob_of(b.rank(), 50));
    ASSERT_TRUE(root.has_value());
    EXPECT_EQ(*root, blob_of(0, 50));
    EXPECT_TRUE(b.barrier().is_ok());
  });
}

// The intended use: the bootstrap agrees on a group name, then the ranks open
// a shared-memory communicator with it.
TEST(TcpBootstrap, AgreedNameOpensAShmGroupAcrossProcesses) {
  auto listener = BootstrapListener::bind("127.0.0.1", 0);
  ASSERT_TRUE(listener.has_value());
  const int port = listener->port();
  std::vector<pid_t> children;
  for (int r = 0; r < 3; ++r) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid != 0) {
      children.push_back(pid);
      continue;
    }
    auto b = r == 0 ? TcpBootstrap::accept(std::move(listener).value(), 3, 10000)
                    : TcpBootstrap::connect("127.0.0.1", port, r, 3, 10000);
    if (!b) _exit(2);
    auto name = (*b)->agree_on_name("bt");
    if (!name) _exit(3);
    ShmGroupOptions options;
    options.name = *name;
    options.rank = r;
    options.world_size = 3;
    options.buffer_bytes = 64 << 10;
    options.timeout_ms = 10000;
    auto comm = open_shm_communicator(options);
    if (!comm) _exit(4);
    std::vector<float> data = {static_cast<float>(r + 1)};
    if (!(*comm)->all_reduce_sum(data).is_ok() || data[0] != 6.0f) _exit(5);
    _exit(0);
  }
  for (pid_t pid : children) {
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "exit " << WEXITSTATUS(status);
  }
}

TEST(TcpBootstrap, MissingRankTimesOutByName) {
  auto listener = BootstrapListener::bind("127.0.0.1", 0);
  ASSERT_TRUE(listener.has_value());
  const int port = listener->port();
  std::thread one([&] { ASSERT_TRUE(TcpBootstrap::connect("127.0.0.1", port, 1, 3, 2000).has_value()); });
  auto b = TcpBootstrap::accept(std::move(listener).value(), 3, 300);
  one.join();
  ASSERT_FALSE(b.has_value());
  EXPECT_EQ(b.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(b.status().message().find("rank(s) 2 "), std::string::npos) << b.status().message();
}

TEST(TcpBootstrap, NoRankZeroTimesOut) {
  auto listener = BootstrapListener::bind("127.0.0.1", 0);
  ASSERT_TRUE(listener.has_value());
  const int port = listener->port();
  listener = BootstrapListener::bind("127.0.0.1", 0);  // closes the first: nobody listens on `port`
  auto b = TcpBootstrap::connect("127.0.0.1", port, 1, 2, 200);
  ASSERT_FALSE(b.has_value());
  EXPECT_EQ(b.status().code(), StatusCode::kDeadlineExceeded);
}

TEST(TcpBootstrap, PeerClosingEarlyIsAnError) {
  auto listener = BootstrapListener::bind("127.0.0.1", 0);
  ASSERT_TRUE(listener.has_value());
  const int port = listener->port();
  std::thread one([&] {
    auto b = TcpBootstrap::connect("127.0.0.1", port, 1, 2, 5000);
    ASSERT_TRUE(b.has_value());
    // Leaves without taking part in the all-gather: its socket closes.
  });
  auto b = TcpBootstrap::accept(std::move(listener).value(), 2, 5000);
  one.join();
  ASSERT_TRUE(b.has_value()) << b.status().to_string();
  auto all = (*b)->all_gather(blob_of(0, 10));
  ASSERT_FALSE(all.has_value());
  EXPECT_EQ(all.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(all.status().message().find("rank 1"), std::string::npos) << all.status().message();
}

TEST(TcpBootstrap, SilentPeerTimesOutAndStrayConnectionsAreIgnored) {
  auto listener = BootstrapListener::bind("127.0.0.1", 0);
  ASSERT_TRUE(listener.has_value());
  const int port = listener->port();
  std::atomic<bool> done{false};
  std::thread one([&] {
    // A stray connection that says nothing useful comes first.
    const int stray = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(stray, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    ASSERT_EQ(write(stray, "GET / HTTP/1.0\r\n\r\n", 18), 18);
    close(stray);
    auto b = TcpBootstrap::connect("127.0.0.1", port, 1, 2, 5000);
    ASSERT_TRUE(b.has_value());
    while (!done) std::this_thread::sleep_for(std::chrono::milliseconds(5));  // connected, but silent
  });
  auto b = TcpBootstrap::accept(std::move(listener).value(), 2, 300);
  ASSERT_TRUE(b.has_value()) << b.status().to_string();
  auto all = (*b)->all_gather(blob_of(0, 10));
  done = true;
  one.join();
  ASSERT_FALSE(all.has_value());
  EXPECT_EQ(all.status().code(), StatusCode::kDeadlineExceeded) << all.status().to_string();
}

// Each rank passes a memfd holding its rank; every rank reads every peer's.
std::string check_fd_exchange(const std::string& group, int rank, int world) {
  const int own = memfd_create("moe_fd_test", MFD_CLOEXEC);
  const int32_t value = 1000 + rank;
  if (own < 0 || pwrite(own, &value, sizeof value, 0) != sizeof value) return "memfd";
  auto fds = exchange_fds(group, rank, world, own, 5000);
  close(own);
  if (!fds) return fds.status().to_string();
  std::string error;
  for (int r = 0; r < world; ++r) {
    if (r == rank) {
      if ((*fds)[r] != -1) error = "own slot is not -1";
      continue;
    }
    int32_t got = 0;
    if (pread((*fds)[r], &got, sizeof got, 0) != sizeof got || got != 1000 + r)
      error = fmt::format("fd of rank {} holds {}", r, got);
    close((*fds)[r]);
  }
  return error;
}

TEST(FdExchange, ThreadsAndProcesses) {
  const std::string group = fmt::format("fdt{}", getpid());
  std::vector<std::thread> threads;
  for (int r = 0; r < 4; ++r) threads.emplace_back([&, r] { EXPECT_EQ(check_fd_exchange(group, r, 4), ""); });
  for (auto& t : threads) t.join();

  const std::string group2 = fmt::format("fdp{}", getpid());
  std::vector<pid_t> children;
  for (int r = 0; r < 3; ++r) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) _exit(check_fd_exchange(group2, r, 3).empty() ? 0 : 1);
    children.push_back(pid);
  }
  for (pid_t pid : children) {
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
}

TEST(FdExchange, MissingRankTimesOut) {
  const int own = memfd_create("moe_fd_test", MFD_CLOEXEC);
  auto fds = exchange_fds(fmt::format("fdm{}", getpid()), 0, 2, own, 200);
  close(own);
  ASSERT_FALSE(fds.has_value());
  EXPECT_EQ(fds.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(fds.status().message().find("rank 1"), std::string::npos) << fds.status().message();
}

}  // namespace
}  // namespace moe::comm
