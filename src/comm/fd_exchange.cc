#include "comm/fd_exchange.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <chrono>
#include <cstring>
#include <thread>
#include <utility>

namespace moe::comm {
namespace {

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The abstract socket address of `rank` ("\0moe_fd_<group>_<rank>").
Expected<std::pair<sockaddr_un, socklen_t>> address_of(const std::string& group, int rank) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string name = fmt::format("moe_fd_{}_{}", group, rank);
  if (name.size() + 1 > sizeof(addr.sun_path)) return invalid_argument("fd exchange: group name '{}' is too long", group);
  std::memcpy(addr.sun_path + 1, name.data(), name.size());
  return std::pair{addr, static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size())};
}

Status send_fd(int socket_fd, int rank, int fd) {
  int32_t payload = rank;
  iovec iov{&payload, sizeof payload};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  if (sendmsg(socket_fd, &msg, MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof payload))
    return unavailable("sendmsg: {}", std::strerror(errno));
  return Status::ok();
}

// Receives (rank, fd) from an accepted connection; fd -1 when none came.
Status recv_fd(int socket_fd, int64_t deadline_ms, int& rank, int& fd) {
  pollfd p{socket_fd, POLLIN, 0};
  if (poll(&p, 1, static_cast<int>(std::max<int64_t>(0, deadline_ms - now_ms()))) <= 0)
    return deadline_exceeded("no descriptor arrived");
  int32_t payload = -1;
  iovec iov{&payload, sizeof payload};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  const ssize_t n = recvmsg(socket_fd, &msg, MSG_CMSG_CLOEXEC);
  fd = -1;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c))
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) std::memcpy(&fd, CMSG_DATA(c), sizeof(int));
  if (n != static_cast<ssize_t>(sizeof payload) || fd < 0) {
    if (fd >= 0) close(fd);
    fd = -1;
    return data_loss("a malformed descriptor message");
  }
  rank = payload;
  return Status::ok();
}

class FdCloser {
 public:
  explicit FdCloser(std::vector<int>& fds) : fds_(fds) {}
  ~FdCloser() {
    if (armed_)
      for (int& fd : fds_)
        if (fd >= 0) close(std::exchange(fd, -1));
  }
  void disarm() { armed_ = false; }

 private:
  std::vector<int>& fds_;
  bool armed_ = true;
};

}  // namespace

Expected<std::vector<int>> exchange_fds(const std::string& group, int rank, int world_size, int fd, int timeout_ms) {
  if (rank < 0 || rank >= world_size) return invalid_argument("fd exchange: rank {} of {}", rank, world_size);
  std::vector<int> fds(world_size, -1);
  if (world_size == 1) return fds;
  const int64_t deadline = now_ms() + timeout_ms;
  MOE_ASSIGN_OR_RETURN(auto self, address_of(group, rank));
  std::vector<int> sockets;  // closed on every path
  FdCloser close_sockets(sockets), close_fds(fds);
  const int listener = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listener < 0) return unavailable("fd exchange: socket: {}", std::strerror(errno));
  sockets.push_back(listener);
  if (bind(listener, reinterpret_cast<sockaddr*>(&self.first), self.second) != 0 || listen(listener, world_size) != 0)
    return unavailable("fd exchange '{}': rank {} cannot listen: {}", group, rank, std::strerror(errno));

  // Send ours to every peer (a connect completes in the peer's backlog, so
  // nobody waits for an accept), then take the peers' from our backlog.
  for (int peer = 0; peer < world_size; ++peer) {
    if (peer == rank) continue;
    MOE_ASSIGN_OR_RETURN(auto addr, address_of(group, peer));
    int s = -1;
    while (s < 0) {
      s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (s >= 0 && connect(s, reinterpret_cast<sockaddr*>(&addr.first), addr.second) == 0) break;
      if (s >= 0) close(s);
      s = -1;
      if (now_ms() > deadline)
        return deadline_exceeded("fd exchange '{}': rank {} did not open its socket within {} ms (this is rank {})",
                                 group, peer, timeout_ms, rank);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    sockets.push_back(s);
    MOE_RETURN_IF_ERROR(send_fd(s, rank, fd).with_context(fmt::format("fd exchange: to rank {}", peer)));
  }
  for (int received = 0; received < world_size - 1;) {
    pollfd p{listener, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(std::max<int64_t>(0, deadline - now_ms()))) <= 0) {
      std::string missing;
      for (int r = 0; r < world_size; ++r)
        if (r != rank && fds[r] < 0) missing += fmt::format("{}{}", missing.empty() ? "" : ", ", r);
      return deadline_exceeded("fd exchange '{}': rank(s) {} sent nothing within {} ms (this is rank {})", group,
                               missing, timeout_ms, rank);
    }
    const int s = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    if (s < 0) continue;
    sockets.push_back(s);
    ucred cred{};
    socklen_t len = sizeof cred;
    if (getsockopt(s, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.uid != getuid()) continue;
    int peer = -1, got = -1;
    if (!recv_fd(s, deadline, peer, got).is_ok()) continue;
    if (peer < 0 || peer >= world_size || peer == rank || fds[peer] >= 0) {
      close(got);
      return invalid_argument("fd exchange '{}': a peer claims rank {} (this is rank {})", group, peer, rank);
    }
    fds[peer] = got;
    ++received;
  }
  close_fds.disarm();
  return fds;
}

}  // namespace moe::comm
