// Launch resolution and the TCP rendezvous: see bootstrap.h.
#include "comm/bootstrap.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>

namespace moe::comm {
namespace {

constexpr uint64_t kHelloMagic = 0x6d6f655f626f6f74ull;  // "moe_boot"

struct Hello {
  uint64_t magic;
  uint32_t rank;
  uint32_t world_size;
};

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int remaining_ms(int64_t deadline_ns) {
  const int64_t left = (deadline_ns - now_ns()) / 1'000'000;
  return left <= 0 ? 0 : static_cast<int>(std::min<int64_t>(left, 1 << 30));
}

std::string errno_text() { return std::strerror(errno); }

// Waits until fd is ready for `events`; false on timeout.
Expected<bool> wait_fd(int fd, short events, int64_t deadline_ns) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int n = poll(&p, 1, remaining_ms(deadline_ns));
    if (n > 0) return true;
    if (n == 0) return false;
    if (errno != EINTR) return internal_error("poll: {}", errno_text());
  }
}

Status send_all(int fd, const void* data, size_t n, int64_t deadline_ns) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    MOE_ASSIGN_OR_RETURN(bool ready, wait_fd(fd, POLLOUT, deadline_ns));
    if (!ready) return deadline_exceeded("timed out sending");
    const ssize_t sent = send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (sent < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return unavailable("send: {}", errno_text());
    }
    p += sent;
    n -= static_cast<size_t>(sent);
  }
  return Status::ok();
}

Status recv_all(int fd, void* data, size_t n, int64_t deadline_ns) {
  auto* p = static_cast<uint8_t*>(data);
  while (n > 0) {
    MOE_ASSIGN_OR_RETURN(bool ready, wait_fd(fd, POLLIN, deadline_ns));
    if (!ready) return deadline_exceeded("timed out waiting for data");
    const ssize_t got = recv(fd, p, n, MSG_DONTWAIT);
    if (got == 0) return unavailable("the connection was closed");
    if (got < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return unavailable("recv: {}", errno_text());
    }
    p += got;
    n -= static_cast<size_t>(got);
  }
  return Status::ok();
}

Status send_blob(int fd, std::span<const uint8_t> blob, int64_t deadline_ns) {
  const uint64_t size = blob.size();
  MOE_RETURN_IF_ERROR(send_all(fd, &size, sizeof size, deadline_ns));
  return send_all(fd, blob.data(), blob.size(), deadline_ns);
}

Expected<std::vector<uint8_t>> recv_blob(int fd, int64_t deadline_ns) {
  uint64_t size = 0;
  MOE_RETURN_IF_ERROR(recv_all(fd, &size, sizeof size, deadline_ns));
  if (size > kMaxBlobBytes) return data_loss("a blob of {} bytes is over the {}-byte limit", size, kMaxBlobBytes);
  std::vector<uint8_t> blob(size);
  MOE_RETURN_IF_ERROR(recv_all(fd, blob.data(), blob.size(), deadline_ns));
  return blob;
}

void set_no_delay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

Expected<addrinfo*> resolve(const std::string& addr, int port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* result = nullptr;
  const std::string service = std::to_string(port);
  if (const int error = getaddrinfo(addr.c_str(), service.c_str(), &hints, &result); error != 0)
    return unavailable("cannot resolve '{}': {}", addr, gai_strerror(error));
  return result;
}

// One non-blocking connect attempt to any address of `addr`; -1 if refused.
Expected<int> try_connect(const std::string& addr, int port, int64_t deadline_ns) {
  MOE_ASSIGN_OR_RETURN(addrinfo * list, resolve(addr, port, false));
  int connected = -1;
  for (addrinfo* ai = list; ai != nullptr && connected < 0; ai = ai->ai_next) {
    const int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
    if (fd < 0) continue;
    int rc = ::connect(fd, ai->ai_addr, ai->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      auto ready = wait_fd(fd, POLLOUT, deadline_ns);
      int error = 0;
      socklen_t len = sizeof error;
      if (ready.has_value() && *ready && getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len) == 0 && error == 0) rc = 0;
    }
    if (rc == 0) connected = fd;
    else close(fd);
  }
  freeaddrinfo(list);
  return connected;
}

Expected<int> parse_int(const char* what, const std::string& text) {
  int value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size())
    return invalid_argument("{}='{}' is not an integer", what, text);
  return value;
}

// The first of `names` that is set, parsed; nullopt when none is.
Expected<std::optional<int>> env_int(const EnvLookup& env, std::initializer_list<const char*> names) {
  for (const char* name : names)
    if (auto text = env(name)) {
      MOE_ASSIGN_OR_RETURN(int value, parse_int(name, *text));
      return std::optional<int>(value);
    }
  return std::optional<int>();
}

}  // namespace

std::optional<std::string> process_env(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

Expected<LaunchConfig> resolve_launch(const LaunchFlags& flags, const EnvLookup& env) {
  LaunchConfig c;
  struct Source {
    const char* name;
    std::initializer_list<const char*> rank, size, local_rank, local_size;
  };
  const Source sources[] = {
      {"mpi (Open MPI)", {"OMPI_COMM_WORLD_RANK"}, {"OMPI_COMM_WORLD_SIZE"}, {"OMPI_COMM_WORLD_LOCAL_RANK"},
       {"OMPI_COMM_WORLD_LOCAL_SIZE"}},
      {"mpi (PMI)", {"PMI_RANK"}, {"PMI_SIZE"}, {"MPI_LOCALRANKID", "PMI_LOCAL_RANK"},
       {"MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"}},
      {"torchrun env", {"RANK"}, {"WORLD_SIZE"}, {"LOCAL_RANK"}, {"LOCAL_WORLD_SIZE"}},
  };
  bool found = false;
  for (const Source& s : sources) {
    MOE_ASSIGN_OR_RETURN(auto rank, env_int(env, s.rank));
    MOE_ASSIGN_OR_RETURN(auto size, env_int(env, s.size));
    if (!rank.has_value() || !size.has_value()) continue;
    MOE_ASSIGN_OR_RETURN(auto local_rank, env_int(env, s.local_rank));
    MOE_ASSIGN_OR_RETURN(auto local_size, env_int(env, s.local_size));
    c.rank = *rank;
    c.world_size = *size;
    c.local_rank = local_rank.value_or(0);
    c.local_world_size = local_size.value_or(local_rank.has_value() ? *size : 1);
    c.source = s.name;
    found = true;
    break;
  }
  if (!found && (flags.nnodes >= 0 || flags.node_rank >= 0 || flags.nproc_per_node >= 0 || flags.local_rank >= 0)) {
    const int nnodes = flags.nnodes >= 0 ? flags.nnodes : 1, node_rank = std::max(flags.node_rank, 0);
    const int nproc = flags.nproc_per_node >= 0 ? flags.nproc_per_node : 1, local = std::max(flags.local_rank, 0);
    if (nnodes < 1 || nproc < 1) return invalid_argument("--nnodes {} and processes per node {} must be >= 1", nnodes, nproc);
    if (node_rank >= nnodes) return invalid_argument("--node-rank {} is not below --nnodes {}", node_rank, nnodes);
    c.world_size = nnodes * nproc;
    c.local_world_size = nproc;
    c.local_rank = local;
    c.rank = node_rank * nproc + local;
    c.source = "flags";
    found = true;
  }
  if (!found) c.source = "single process";
  if (c.world_size < 1 || c.rank < 0 || c.rank >= c.world_size)
    return invalid_argument("{}: rank {} is not in [0, world size {})", c.source, c.rank, c.world_size);
  if (c.local_world_size < 1 || c.local_rank < 0 || c.local_rank >= c.local_world_size)
    return invalid_argument("{}: local rank {} is not in [0, {})", c.source, c.local_rank, c.local_world_size);

  if (!flags.master_addr.empty()) c.master_addr = flags.master_addr;
  else if (auto addr = env("MASTER_ADDR")) c.master_addr = *addr;
  if (flags.master_port >= 0) {
    c.master_port = flags.master_port;
  } else {
    MOE_ASSIGN_OR_RETURN(auto port, env_int(env, {"MASTER_PORT"}));
    if (port.has_value()) c.master_port = *port;
  }
  if (c.master_port < 1 || c.master_port > 65535)
    return invalid_argument("master port {} is not in [1, 65535]", c.master_port);
  return c;
}

// --- BootstrapListener ------------------------------------------------------

Expected<BootstrapListener> BootstrapListener::bind(const std::string& addr, int port) {
  MOE_ASSIGN_OR_RETURN(addrinfo * list, resolve(addr, port, true));
  BootstrapListener listener;
  std::string error = "no address";
  for (addrinfo* ai = list; ai != nullptr && listener.fd_ < 0; ai = ai->ai_next) {
    const int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, 128) == 0) {
      listener.fd_ = fd;
    } else {
      error = errno_text();
      close(fd);
    }
  }
  freeaddrinfo(list);
  if (listener.fd_ < 0) return unavailable("bootstrap: cannot listen on {}:{}: {}", addr, port, error);
  sockaddr_storage bound{};
  socklen_t len = sizeof bound;
  getsockname(listener.fd_, reinterpret_cast<sockaddr*>(&bound), &len);
  listener.port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                                     : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  return listener;
}

BootstrapListener::BootstrapListener(BootstrapListener&& other) noexcept : fd_(other.fd_), port_(other.port_) {
  other.fd_ = -1;
}

BootstrapListener& BootstrapListener::operator=(BootstrapListener&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    port_ = other.port_;
  }
  return *this;
}

BootstrapListener::~BootstrapListener() {
  if (fd_ >= 0) close(fd_);
}

// --- TcpBootstrap -----------------------------------------------------------

int64_t TcpBootstrap::deadline_ns() const { return now_ns() + static_cast<int64_t>(timeout_ms_) * 1'000'000; }

TcpBootstrap::~TcpBootstrap() {
  for (int fd : peer_fds_)
    if (fd >= 0) close(fd);
}

Expected<std::unique_ptr<TcpBootstrap>> TcpBootstrap::accept(BootstrapListener listener, int world_size,
                                                             int timeout_ms) {
  if (world_size < 1) return invalid_argument("bootstrap: world size {}", world_size);
  std::unique_ptr<TcpBootstrap> b(new TcpBootstrap(0, world_size, timeout_ms));
  b->peer_fds_.assign(world_size, -1);
  const int64_t deadline = b->deadline_ns();
  int missing = world_size - 1;
  while (missing > 0) {
    MOE_ASSIGN_OR_RETURN(bool ready, wait_fd(listener.fd_, POLLIN, deadline));
    if (!ready) {
      std::string ranks;
      for (int r = 1; r < world_size; ++r)
        if (b->peer_fds_[r] < 0) ranks += fmt::format("{}{}", ranks.empty() ? "" : ", ", r);
      return deadline_exceeded("bootstrap: rank(s) {} did not connect to rank 0 on port {} within {} ms", ranks,
                               listener.port_, timeout_ms);
    }
    const int fd = accept4(listener.fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    set_no_delay(fd);
    // A connection that does not say hello properly is dropped, not fatal:
    // anything may knock on a port.
    Hello hello{};
    if (!recv_all(fd, &hello, sizeof hello, std::min(deadline, now_ns() + 2'000'000'000)).is_ok() ||
        hello.magic != kHelloMagic) {
      close(fd);
      continue;
    }
    const int r = static_cast<int>(hello.rank);
    Status bad;
    if (static_cast<int>(hello.world_size) != world_size)
      bad = invalid_argument("bootstrap: rank {} says the world has {} ranks, rank 0 says {}", r, hello.world_size,
                             world_size);
    else if (r < 1 || r >= world_size) bad = invalid_argument("bootstrap: a peer claims rank {} of {}", r, world_size);
    else if (b->peer_fds_[r] >= 0) bad = invalid_argument("bootstrap: two processes claim rank {}", r);
    if (!bad.is_ok()) {
      close(fd);
      return bad;
    }
    b->peer_fds_[r] = fd;
    --missing;
    MOE_RETURN_IF_ERROR(send_all(fd, &kHelloMagic, sizeof kHelloMagic, deadline).with_context(fmt::format("rank {}", r)));
  }
  return b;
}

Expected<std::unique_ptr<TcpBootstrap>> TcpBootstrap::connect(const std::string& addr, int port, int rank,
                                                              int world_size, int timeout_ms) {
  if (rank < 1 || rank >= world_size) return invalid_argument("bootstrap: connect as rank {} of {}", rank, world_size);
  std::unique_ptr<TcpBootstrap> b(new TcpBootstrap(rank, world_size, timeout_ms));
  const int64_t deadline = b->deadline_ns();
  int fd = -1;
  while (fd < 0) {  // rank 0 may not listen yet
    MOE_ASSIGN_OR_RETURN(fd, try_connect(addr, port, deadline));
    if (fd >= 0) break;
    if (now_ns() > deadline)
      return deadline_exceeded("bootstrap: rank {} could not reach rank 0 at {}:{} within {} ms", rank, addr, port,
                               timeout_ms);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  b->peer_fds_ = {fd};
  set_no_delay(fd);
  const Hello hello{kHelloMagic, static_cast<uint32_t>(rank), static_cast<uint32_t>(world_size)};
  uint64_t ack = 0;
  Status s = send_all(fd, &hello, sizeof hello, deadline);
  if (s.is_ok()) s = recv_all(fd, &ack, sizeof ack, deadline);
  if (s.is_ok() && ack != kHelloMagic) s = data_loss("bad handshake reply");
  if (!s.is_ok()) return Status(s.code(), fmt::format("bootstrap: rank {} joining via {}:{}: {}", rank, addr, port, s.message()));
  return b;
}

Expected<std::unique_ptr<TcpBootstrap>> TcpBootstrap::open(const LaunchConfig& launch, int timeout_ms) {
  if (launch.rank != 0)
    return connect(launch.master_addr, launch.master_port, launch.rank, launch.world_size, timeout_ms);
  MOE_ASSIGN_OR_RETURN(auto listener, BootstrapListener::bind(launch.master_addr, launch.master_port));
  return accept(std::move(listener), launch.world_size, timeout_ms);
}

Expected<std::vector<std::vector<uint8_t>>> TcpBootstrap::all_gather(std::span<const uint8_t> blob) {
  if (blob.size() > kMaxBlobBytes) return invalid_argument("bootstrap: a {}-byte blob is over the limit", blob.size());
  const int64_t deadline = deadline_ns();
  std::vector<std::vector<uint8_t>> all(world_size_);
  if (rank_ != 0) {
    const int fd = peer_fds_[0];
    auto fail = [&](const Status& s) {
      return Status(s.code(), fmt::format("bootstrap all_gather, rank {} with rank 0: {}", rank_, s.message()));
    };
    if (Status s = send_blob(fd, blob, deadline); !s) return fail(s);
    for (int r = 0; r < world_size_; ++r) {
      auto got = recv_blob(fd, deadline);
      if (!got) return fail(got.status());
      all[r] = std::move(got).value();
    }
    return all;
  }
  all[0].assign(blob.begin(), blob.end());
  for (int r = 1; r < world_size_; ++r) {
    auto got = recv_blob(peer_fds_[r], deadline);
    if (!got) return Status(got.status().code(), fmt::format("bootstrap all_gather: rank {}: {}", r, got.status().message()));
    all[r] = std::move(got).value();
  }
  for (int r = 1; r < world_size_; ++r)
    for (const auto& part : all)
      if (Status s = send_blob(peer_fds_[r], part, deadline); !s)
        return Status(s.code(), fmt::format("bootstrap all_gather: rank {}: {}", r, s.message()));
  return all;
}

Expected<std::vector<uint8_t>> TcpBootstrap::broadcast_from_root(std::span<const uint8_t> blob) {
  const int64_t deadline = deadline_ns();
  if (rank_ != 0) {
    auto got = recv_blob(peer_fds_[0], deadline);
    if (!got) return Status(got.status().code(), fmt::format("bootstrap broadcast, rank {}: {}", rank_, got.status().message()));
    return got;
  }
  if (blob.size() > kMaxBlobBytes) return invalid_argument("bootstrap: a {}-byte blob is over the limit", blob.size());
  for (int r = 1; r < world_size_; ++r)
    if (Status s = send_blob(peer_fds_[r], blob, deadline); !s)
      return Status(s.code(), fmt::format("bootstrap broadcast: rank {}: {}", r, s.message()));
  return std::vector<uint8_t>(blob.begin(), blob.end());
}

Status TcpBootstrap::barrier() { return all_gather({}).status(); }

Expected<std::string> TcpBootstrap::agree_on_name(const std::string& prefix) {
  std::string name;
  if (rank_ == 0) {
    std::random_device device;
    name = fmt::format("{}{:08x}{:08x}", prefix, device(), device());
  }
  MOE_ASSIGN_OR_RETURN(auto bytes, broadcast_from_root({reinterpret_cast<const uint8_t*>(name.data()), name.size()}));
  return std::string(bytes.begin(), bytes.end());
}

}  // namespace moe::comm
