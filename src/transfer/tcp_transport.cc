// TCP transport: see tcp_transport.h. Sockets are blocking and each has its
// own thread, which keeps the code straight-line; shutdown(2) is what wakes a
// thread blocked in a system call.
#include "transfer/tcp_transport.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <random>

#include "core/check.h"
#include "core/logging.h"

namespace moe::transfer {
namespace {

constexpr size_t kMaxJobsPerWrite = 64;
constexpr uint64_t kMaxBytesPerWrite = 8 << 20;
constexpr size_t kMaxInboundConnections = 512;
constexpr size_t kReadBufferBytes = 256 << 10;
constexpr size_t kDirectReadBytes = 64 << 10;  // payloads at least this big skip the read buffer

std::string errno_text(int error) { return std::strerror(error); }

void set_socket_options(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// Splits "host:port"; the host may be a name or an IPv4/IPv6 literal ("[::1]:80").
Expected<std::pair<std::string, std::string>> split_endpoint(const std::string& endpoint) {
  const size_t colon = endpoint.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == endpoint.size())
    return invalid_argument("endpoint '{}' is not host:port", endpoint);
  std::string host = endpoint.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return std::make_pair(host, endpoint.substr(colon + 1));
}

Expected<int> connect_to(const std::string& endpoint, std::chrono::milliseconds timeout) {
  MOE_ASSIGN_OR_RETURN(auto host_port, split_endpoint(endpoint));
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (int rc = getaddrinfo(host_port.first.c_str(), host_port.second.c_str(), &hints, &found); rc != 0)
    return unavailable("peer {}: cannot resolve: {}", endpoint, gai_strerror(rc));
  std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> guard(found, freeaddrinfo);
  int fd = socket(found->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return unavailable("peer {}: socket: {}", endpoint, errno_text(errno));
  int rc = ::connect(fd, found->ai_addr, found->ai_addrlen);
  if (rc != 0 && errno == EINPROGRESS) {
    pollfd p{fd, POLLOUT, 0};
    rc = poll(&p, 1, static_cast<int>(timeout.count()));
    if (rc == 0) {
      close(fd);
      return unavailable("peer {}: connect timed out after {} ms", endpoint, timeout.count());
    }
    int error = 0;
    socklen_t length = sizeof(error);
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length);
    rc = error == 0 ? 0 : -1;
    errno = error;
  }
  if (rc != 0) {
    const int error = errno;
    close(fd);
    return unavailable("peer {}: connect: {}", endpoint, errno_text(error));
  }
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  set_socket_options(fd);
  return fd;
}

// Writes every byte of iov (modifies it); false with errno on failure.
bool write_all(int fd, std::vector<iovec>& iov) {
  size_t first = 0;
  while (first < iov.size()) {
    msghdr message{};
    message.msg_iov = iov.data() + first;
    message.msg_iovlen = std::min<size_t>(iov.size() - first, IOV_MAX);
    const ssize_t n = sendmsg(fd, &message, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    size_t left = static_cast<size_t>(n);
    while (first < iov.size() && left >= iov[first].iov_len) left -= iov[first++].iov_len;
    if (left > 0) {
      iov[first].iov_base = static_cast<uint8_t*>(iov[first].iov_base) + left;
      iov[first].iov_len -= left;
    }
  }
  return true;
}

bool printable_endpoint(const std::string& text) {
  return !text.empty() && std::all_of(text.begin(), text.end(), [](char c) { return c > 0x20 && c < 0x7f; });
}

}  // namespace

// ------------------------------------------------------------ inbound connections

class TcpTransport::InConnection final : public Fenceable {
 public:
  InConnection(TcpTransport& transport, int fd) : transport_(transport), fd_(fd), buffer_(kReadBufferBytes) {}
  ~InConnection() override {
    if (thread_.joinable()) thread_.join();
    if (fd_ >= 0) close(fd_);
  }
  void start() { thread_ = std::thread([this] { run(); }); }
  bool done() const { return done_.load(); }
  void abort_connection() override {
    aborted_.store(true);
    ::shutdown(fd_, SHUT_RDWR);
  }

 private:
  // Reads exactly n bytes into dst (nullptr: discard). False on EOF or error.
  bool read_exact(uint8_t* dst, size_t n) {
    while (n > 0) {
      if (begin_ < end_) {
        const size_t take = std::min(n, end_ - begin_);
        if (dst != nullptr) std::memcpy(dst, buffer_.data() + begin_, take), dst += take;
        begin_ += take;
        n -= take;
        continue;
      }
      if (dst != nullptr && n >= kDirectReadBytes) {
        const ssize_t got = recv(fd_, dst, n, 0);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) return fail_read(got);
        dst += got;
        n -= static_cast<size_t>(got);
        continue;
      }
      const ssize_t got = recv(fd_, buffer_.data(), buffer_.size(), 0);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) return fail_read(got);
      begin_ = 0;
      end_ = static_cast<size_t>(got);
    }
    return true;
  }
  bool fail_read(ssize_t got) {
    read_error_ = got == 0 ? "connection closed by the peer" : errno_text(errno);
    return false;
  }

  void run() {
    ended(serve());
    done_.store(true);
  }

  // Returns how the connection ended: ok for an orderly goodbye.
  Status serve() {
    std::array<uint8_t, wire::kHeaderBytes> raw;
    if (!read_exact(raw.data(), raw.size())) return unavailable("before hello: {}", read_error_);
    wire::FrameHeader header = wire::decode(raw.data());
    std::string reason = wire::validate_header(header);
    if (reason.empty() && header.type != static_cast<uint16_t>(wire::FrameType::kHello)) reason = "first frame is not hello";
    if (!reason.empty()) return bad_frame(reason);
    std::string endpoint(header.length, '\0');
    if (!read_exact(reinterpret_cast<uint8_t*>(endpoint.data()), endpoint.size()))
      return unavailable("in hello: {}", read_error_);
    if (!printable_endpoint(endpoint)) return bad_frame("hello endpoint is not printable");
    peer_ = endpoint;
    nonce_ = header.offset;
    for (;;) {
      if (!read_exact(raw.data(), raw.size())) return unavailable("{}", read_error_);
      header = wire::decode(raw.data());
      if (reason = wire::validate_header(header); !reason.empty()) return bad_frame(reason);
      switch (static_cast<wire::FrameType>(header.type)) {
        case wire::FrameType::kGoodbye:
          return Status::ok();
        case wire::FrameType::kHello:
          return bad_frame("second hello");
        case wire::FrameType::kQpConnect: {
          QpInfo remote;
          if (!read_exact(remote.data(), remote.size())) return unavailable("{}", read_error_);
          QpAcceptor acceptor;
          {
            std::lock_guard lock(transport_.in_mutex_);
            acceptor = transport_.qp_acceptor_;
          }
          if (!acceptor) return bad_frame("queue-pair set-up, but ibverbs is off here");
          auto local = acceptor(peer_, remote);
          if (!local) return bad_frame(local.status().message());
          std::array<uint8_t, wire::kHeaderBytes> reply;
          wire::encode(header, reply.data());
          std::vector<iovec> iov = {{reply.data(), reply.size()}, {local->data(), local->size()}};
          if (!write_all(fd_, iov)) return unavailable("answering queue-pair set-up: {}", errno_text(errno));
          break;
        }
        case wire::FrameType::kNotify:
          if (!transport_.receiver_.notify_frame(header, nonce_)) return bad_frame("batch limits exceeded");
          break;
        case wire::FrameType::kWrite: {
          Receiver::StoreTicket ticket = transport_.receiver_.begin_store(header, this);
          if (ticket.kind == Receiver::StoreTicket::Kind::kReject) return bad_frame(ticket.reject_reason);
          if (ticket.kind == Receiver::StoreTicket::Kind::kDrop) {
            transport_.receiver_.count_dropped_frame();
            if (!read_exact(nullptr, header.length)) return unavailable("{}", read_error_);
            break;
          }
          const bool ok = read_exact(ticket.dst, header.length);
          if (!transport_.receiver_.end_store(header, nonce_, this, ok)) return bad_frame("batch limits exceeded");
          if (!ok) return unavailable("{}", read_error_);
          break;
        }
      }
    }
  }

  Status bad_frame(const std::string& reason) {
    transport_.counters_.num_bad_frames.fetch_add(1);
    log_warn("transfer: bad frame from {}: {}; closing the connection", peer_.empty() ? "unknown peer" : peer_, reason);
    return data_loss("bad frame: {}", reason);
  }

  void ended(const Status& how) {
    ::shutdown(fd_, SHUT_RDWR);
    if (how.is_ok() || transport_.stopping_.load()) return;
    transport_.counters_.num_connections_lost.fetch_add(1);
    if (aborted_.load()) return;  // we tore it down ourselves (disarm fence)
    if (peer_.empty()) return;    // never said who it was
    const Status why = unavailable("peer {} lost: {}", peer_, how.message());
    if (transport_.on_peer_lost_) transport_.on_peer_lost_(peer_, why);  // before waiters wake
    transport_.receiver_.peer_lost(peer_, nonce_, why);
  }

  TcpTransport& transport_;
  int fd_;
  std::thread thread_;
  std::atomic<bool> done_{false};
  std::atomic<bool> aborted_{false};
  std::vector<uint8_t> buffer_;
  size_t begin_ = 0, end_ = 0;
  std::string read_error_;
  std::string peer_;
  uint64_t nonce_ = 0;
};

// ------------------------------------------------------------------ set-up

TcpTransport::TcpTransport(const EngineOptions& options, Receiver& receiver, BatchTracker& tracker,
                           TransportCounters& counters, PeerLostFn on_peer_lost)
    : options_(options), receiver_(receiver), tracker_(tracker), counters_(counters),
      on_peer_lost_(std::move(on_peer_lost)) {
  std::random_device device;
  nonce_ = (static_cast<uint64_t>(device()) << 32) ^ device() ^ static_cast<uint64_t>(getpid());
}

Expected<std::unique_ptr<TcpTransport>> TcpTransport::create(const EngineOptions& options, Receiver& receiver,
                                                             BatchTracker& tracker, TransportCounters& counters,
                                                             PeerLostFn on_peer_lost) {
  if (options.num_connections_per_peer < 1 || options.num_connections_per_peer > 16)
    return invalid_argument("num_connections_per_peer must be 1..16, not {}", options.num_connections_per_peer);
  if (options.max_frame_bytes == 0 || options.max_frame_bytes > wire::kMaxPayloadBytes)
    return invalid_argument("max_frame_bytes must be 1..{}", wire::kMaxPayloadBytes);
  std::unique_ptr<TcpTransport> transport(new TcpTransport(options, receiver, tracker, counters, std::move(on_peer_lost)));
  MOE_RETURN_IF_ERROR(transport->listen());
  transport->accept_thread_ = std::thread([t = transport.get()] { t->accept_loop(); });
  return transport;
}

Status TcpTransport::listen() {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(options_.listen_port);
  if (int rc = getaddrinfo(options_.listen_host.c_str(), port.c_str(), &hints, &found); rc != 0)
    return invalid_argument("listen host '{}': {}", options_.listen_host, gai_strerror(rc));
  std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> guard(found, freeaddrinfo);
  listen_fd_ = socket(found->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listen_fd_ < 0) return unavailable("socket: {}", errno_text(errno));
  int one = 1;
  setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(listen_fd_, found->ai_addr, found->ai_addrlen) != 0 || ::listen(listen_fd_, 128) != 0)
    return unavailable("cannot listen on {}:{}: {}", options_.listen_host, port, errno_text(errno));
  sockaddr_storage bound{};
  socklen_t length = sizeof(bound);
  getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&bound), &length);
  char text[INET6_ADDRSTRLEN] = {};
  uint16_t bound_port = 0;
  if (bound.ss_family == AF_INET6) {
    auto* address = reinterpret_cast<sockaddr_in6*>(&bound);
    inet_ntop(AF_INET6, &address->sin6_addr, text, sizeof(text));
    bound_port = ntohs(address->sin6_port);
    endpoint_ = fmt::format("[{}]:{}", text, bound_port);
  } else {
    auto* address = reinterpret_cast<sockaddr_in*>(&bound);
    inet_ntop(AF_INET, &address->sin_addr, text, sizeof(text));
    bound_port = ntohs(address->sin_port);
    endpoint_ = fmt::format("{}:{}", text, bound_port);
  }
  return Status::ok();
}

void TcpTransport::accept_loop() {
  for (;;) {
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (stopping_.load()) {
      if (fd >= 0) close(fd);
      return;
    }
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED || errno == EMFILE || errno == ENFILE) continue;
      log_warn("transfer: accept on {} failed: {}", endpoint_, errno_text(errno));
      return;
    }
    set_socket_options(fd);
    std::lock_guard lock(in_mutex_);
    inbound_.remove_if([](const std::unique_ptr<InConnection>& c) { return c->done(); });
    if (inbound_.size() >= kMaxInboundConnections) {
      log_warn("transfer: {} inbound connections already; refusing one more", inbound_.size());
      close(fd);
      continue;
    }
    inbound_.push_back(std::make_unique<InConnection>(*this, fd));
    inbound_.back()->start();
  }
}

TcpTransport::~TcpTransport() { shutdown(); }

void TcpTransport::shutdown() {
  if (stopping_.exchange(true)) return;
  std::vector<std::shared_ptr<Peer>> peers;
  {
    std::lock_guard lock(out_mutex_);
    for (auto& [name, peer] : peers_) {
      peers.push_back(peer);
      // A connection in the middle of a write may block on a peer that does not
      // read: cut it. Idle ones say goodbye and exit.
      for (auto& connection : peer->connections) {
        if (!connection->sending.empty() || !connection->queue.empty()) ::shutdown(connection->fd, SHUT_RDWR);
      }
    }
    for (auto& peer : retired_peers_) peers.push_back(peer);
    peers_.clear();
    retired_peers_.clear();
  }
  out_cv_.notify_all();
  for (auto& peer : peers) {
    for (auto& connection : peer->connections) {
      if (connection->thread.joinable()) connection->thread.join();
      close(connection->fd);
    }
  }
  if (listen_fd_ >= 0) {
    ::shutdown(listen_fd_, SHUT_RDWR);
    if (accept_thread_.joinable()) accept_thread_.join();
    close(listen_fd_);
    listen_fd_ = -1;
  }
  std::list<std::unique_ptr<InConnection>> inbound;
  {
    std::lock_guard lock(in_mutex_);
    inbound.swap(inbound_);
  }
  for (auto& connection : inbound) connection->abort_connection();
  inbound.clear();  // joins
}

Status TcpTransport::export_region(const LocalRegion& region, RegionDescriptor& /*descriptor*/) {
  if (region.memory != MemoryKind::kHost) return invalid_argument("the TCP transport takes host memory only");
  return Status::ok();
}

// ------------------------------------------------------------------ sending

Expected<std::shared_ptr<TcpTransport::Peer>> TcpTransport::connected_peer(const std::string& endpoint) {
  {
    std::lock_guard lock(out_mutex_);
    if (stopping_.load()) return aborted("transfer engine {} is shutting down", endpoint_);
    auto it = peers_.find(endpoint);
    if (it != peers_.end() && it->second->failure.is_ok()) return it->second;
  }
  std::lock_guard connect_lock(connect_mutex_);
  {
    std::lock_guard lock(out_mutex_);
    auto it = peers_.find(endpoint);
    if (it != peers_.end() && it->second->failure.is_ok()) return it->second;
  }
  return connect_peer(endpoint);
}

Expected<std::shared_ptr<TcpTransport::Peer>> TcpTransport::connect_peer(const std::string& endpoint) {
  auto peer = std::make_shared<Peer>();
  peer->endpoint = endpoint;
  std::array<uint8_t, wire::kHeaderBytes> hello_header;
  wire::FrameHeader hello;
  hello.type = static_cast<uint16_t>(wire::FrameType::kHello);
  hello.offset = nonce_;
  hello.length = endpoint_.size();
  wire::encode(hello, hello_header.data());
  for (int i = 0; i < options_.num_connections_per_peer; ++i) {
    auto fd = connect_to(endpoint, options_.connect_timeout);
    std::vector<iovec> iov;
    if (fd) {
      iov = {{hello_header.data(), hello_header.size()}, {const_cast<char*>(endpoint_.data()), endpoint_.size()}};
      if (!write_all(*fd, iov)) {
        close(*fd);
        fd = unavailable("peer {}: sending hello: {}", endpoint, errno_text(errno));
      }
    }
    if (!fd) {
      for (auto& connection : peer->connections) close(connection->fd);
      return fd.status();
    }
    auto connection = std::make_unique<OutConnection>();
    connection->peer = peer.get();
    connection->fd = *fd;
    peer->connections.push_back(std::move(connection));
  }
  std::lock_guard lock(out_mutex_);
  if (stopping_.load()) {
    for (auto& connection : peer->connections) close(connection->fd);
    return aborted("transfer engine {} is shutting down", endpoint_);
  }
  for (auto& connection : peer->connections) {
    connection->thread = std::thread([this, c = connection.get()] { send_loop(c); });
  }
  // Lost peers whose threads have all returned: join them and close their sockets.
  std::erase_if(retired_peers_, [](const std::shared_ptr<Peer>& retired) {
    for (auto& connection : retired->connections) {
      if (!connection->exited.load()) return false;
    }
    for (auto& connection : retired->connections) {
      connection->thread.join();
      close(connection->fd);
    }
    return true;
  });
  if (auto it = peers_.find(endpoint); it != peers_.end()) retired_peers_.push_back(it->second);
  peers_[endpoint] = peer;
  return peer;
}

Status TcpTransport::submit(OutBatch batch) {
  const std::string& peer = batch.dsts.front().endpoint;
  if (batch.frames.empty()) return send_notify(peer, batch.state, 1);
  std::vector<Job> jobs;
  jobs.reserve(batch.frames.size());
  for (const OutFrame& frame : batch.frames) {
    Job job;
    job.header.type = static_cast<uint16_t>(wire::FrameType::kWrite);
    job.header.imm = batch.state->imm;
    job.header.batch_num_frames = static_cast<uint32_t>(batch.frames.size());
    job.header.batch_id = batch.state->id;
    job.header.region_id = batch.dsts[frame.dst_index].region_id;
    job.header.offset = frame.dst_offset;
    job.header.length = frame.length_bytes;
    job.payload = frame.src;
    job.batch = batch.state;
    jobs.push_back(job);
  }
  return enqueue(peer, std::move(jobs));
}

Status TcpTransport::send_notify(const std::string& peer, const std::shared_ptr<BatchState>& batch,
                                 uint32_t batch_num_frames) {
  Job job;
  job.header.type = static_cast<uint16_t>(wire::FrameType::kNotify);
  job.header.imm = batch->imm;
  job.header.batch_num_frames = batch_num_frames;
  job.header.batch_id = batch->id;
  job.batch = batch;
  return enqueue(peer, {job});
}

Expected<TcpTransport::QpInfo> TcpTransport::exchange_qp_info(const std::string& peer, const QpInfo& local) {
  MOE_ASSIGN_OR_RETURN(int fd, connect_to(peer, options_.connect_timeout));
  wire::FrameHeader hello, request, goodbye;
  hello.type = static_cast<uint16_t>(wire::FrameType::kHello);
  hello.offset = nonce_;
  hello.length = endpoint_.size();
  request.type = static_cast<uint16_t>(wire::FrameType::kQpConnect);
  request.length = local.size();
  goodbye.type = static_cast<uint16_t>(wire::FrameType::kGoodbye);
  std::array<uint8_t, wire::kHeaderBytes> raw_hello, raw_request, raw_goodbye;
  wire::encode(hello, raw_hello.data());
  wire::encode(request, raw_request.data());
  wire::encode(goodbye, raw_goodbye.data());
  std::vector<iovec> iov = {{raw_hello.data(), raw_hello.size()},
                            {const_cast<char*>(endpoint_.data()), endpoint_.size()},
                            {raw_request.data(), raw_request.size()},
                            {const_cast<uint8_t*>(local.data()), local.size()}};
  std::array<uint8_t, wire::kHeaderBytes + wire::kQpInfoBytes> reply;
  bool ok = write_all(fd, iov);
  for (size_t got = 0; ok && got < reply.size();) {
    const ssize_t n = recv(fd, reply.data() + got, reply.size() - got, 0);
    if (n < 0 && errno == EINTR) continue;
    ok = n > 0;
    if (ok) got += static_cast<size_t>(n);
  }
  if (ok) {
    std::vector<iovec> bye = {{raw_goodbye.data(), raw_goodbye.size()}};
    write_all(fd, bye);
  }
  close(fd);
  if (!ok) return unavailable("peer {}: queue-pair set-up failed", peer);
  const wire::FrameHeader answer = wire::decode(reply.data());
  if (!wire::validate_header(answer).empty() || answer.type != static_cast<uint16_t>(wire::FrameType::kQpConnect))
    return unavailable("peer {}: bad answer to queue-pair set-up", peer);
  QpInfo remote;
  std::memcpy(remote.data(), reply.data() + wire::kHeaderBytes, remote.size());
  return remote;
}

Status TcpTransport::send_notifies(const std::string& peer, const std::vector<std::shared_ptr<BatchState>>& batches) {
  std::vector<Job> jobs;
  jobs.reserve(batches.size());
  for (const auto& batch : batches) {
    Job job;
    job.header.type = static_cast<uint16_t>(wire::FrameType::kNotify);
    job.header.imm = batch->imm;
    job.header.batch_num_frames = 1;
    job.header.batch_id = batch->id;
    job.batch = batch;
    jobs.push_back(std::move(job));
  }
  return enqueue(peer, std::move(jobs));
}

Status TcpTransport::enqueue(const std::string& peer_endpoint, std::vector<Job> jobs) {
  MOE_ASSIGN_OR_RETURN(std::shared_ptr<Peer> peer, connected_peer(peer_endpoint));
  {
    std::lock_guard lock(out_mutex_);
    if (!peer->failure.is_ok()) return peer->failure;
    if (stopping_.load()) return aborted("transfer engine {} is shutting down", endpoint_);
    const size_t n = peer->connections.size();
    for (Job& job : jobs) peer->connections[peer->next_connection++ % n]->queue.push_back(std::move(job));
  }
  out_cv_.notify_all();
  return Status::ok();
}

bool TcpTransport::in_flight_locked(const Peer& peer, const std::shared_ptr<BatchState>& batch,
                                    const OutConnection* except) const {
  for (const auto& connection : peer.connections)
    if (connection.get() != except &&
        std::find(connection->sending.begin(), connection->sending.end(), batch) != connection->sending.end())
      return true;
  return false;
}

void TcpTransport::fail_peer_locked(Peer& peer, const Status& why, std::vector<std::shared_ptr<BatchState>>& to_fail) {
  if (!peer.failure.is_ok()) return;
  peer.failure = why;
  // A batch in a write in progress (`sending`, this thread's too) ends when
  // the last such write has let go of its memory: its send thread fails it
  // (send_loop), the shutdown below making a blocked write return. Failed
  // earlier, a caller could free a batch's source while another connection
  // still wrote it (AddressSanitizer, transfer_fault_test).
  for (auto& connection : peer.connections) {
    for (Job& job : connection->queue)
      if (!in_flight_locked(peer, job.batch, nullptr)) to_fail.push_back(job.batch);
    connection->queue.clear();
    ::shutdown(connection->fd, SHUT_RDWR);
  }
  if (auto it = peers_.find(peer.endpoint); it != peers_.end() && it->second.get() == &peer) {
    retired_peers_.push_back(it->second);
    peers_.erase(it);
  }
}

void TcpTransport::send_loop(OutConnection* connection) {
  Peer* peer = connection->peer;
  std::vector<Job> jobs;
  bool say_goodbye = false;
  for (;;) {
    jobs.clear();
    {
      std::unique_lock lock(out_mutex_);
      out_cv_.wait(lock, [&] { return stopping_.load() || !connection->queue.empty() || !peer->failure.is_ok(); });
      if (!peer->failure.is_ok()) break;
      if (stopping_.load()) {
        say_goodbye = connection->queue.empty();
        break;
      }
      uint64_t num_bytes = 0;
      while (!connection->queue.empty() && jobs.size() < kMaxJobsPerWrite && num_bytes < kMaxBytesPerWrite) {
        Job job = std::move(connection->queue.front());
        connection->queue.pop_front();
        if (job.batch->finished.load()) continue;  // cancelled or failed meanwhile
        num_bytes += job.header.length;
        connection->sending.push_back(job.batch);
        jobs.push_back(std::move(job));
      }
    }
    WriteResult result = jobs.empty() ? WriteResult{} : write_jobs(connection, jobs);
    for (size_t i = 0; i < result.num_sent; ++i) {
      counters_.num_bytes_sent.fetch_add(jobs[i].header.length);
      tracker_.frame_sent(jobs[i].batch);
    }
    if (result.stalled && result.status.is_ok()) result.status = stall(connection, jobs, result);
    std::vector<std::shared_ptr<BatchState>> to_fail;
    Status failure;
    {
      std::lock_guard lock(out_mutex_);
      if (!result.status.is_ok()) fail_peer_locked(*peer, result.status, to_fail);
      if (!peer->failure.is_ok()) {  // lost here or on another connection: this write's batches end now
        for (auto& batch : connection->sending)
          if (!in_flight_locked(*peer, batch, connection)) to_fail.push_back(batch);
        failure = peer->failure;
      }
      connection->sending.clear();
    }
    out_cv_.notify_all();
    for (auto& batch : to_fail) tracker_.finish(batch, failure);
    if (!result.status.is_ok()) {
      if (!stopping_.load() && !result.stalled) {
        counters_.num_connections_lost.fetch_add(1);
        if (on_peer_lost_) on_peer_lost_(peer->endpoint, result.status);
      }
      break;
    }
  }
  if (say_goodbye) {
    std::array<uint8_t, wire::kHeaderBytes> raw;
    wire::FrameHeader goodbye;
    goodbye.type = static_cast<uint16_t>(wire::FrameType::kGoodbye);
    wire::encode(goodbye, raw.data());
    std::vector<iovec> iov = {{raw.data(), raw.size()}};
    write_all(connection->fd, iov);
  }
  ::shutdown(connection->fd, SHUT_RDWR);
  connection->exited.store(true);
}

TcpTransport::WriteResult TcpTransport::write_jobs(OutConnection* connection, std::vector<Job>& jobs) {
  std::vector<std::array<uint8_t, wire::kHeaderBytes>> headers(jobs.size());
  uint64_t payload_bytes = 0;
  for (const Job& job : jobs) payload_bytes += job.header.length;
  // Fault injection: take what is left of the byte budget, then stall.
  uint64_t allowed = payload_bytes;
  if (options_.stall_after_bytes > 0) {
    uint64_t sent = num_payload_bytes_sent_.load();
    do {
      const uint64_t budget = sent >= options_.stall_after_bytes ? 0 : options_.stall_after_bytes - sent;
      allowed = std::min(payload_bytes, budget);
    } while (!num_payload_bytes_sent_.compare_exchange_weak(sent, sent + allowed));
  }
  WriteResult result;
  result.stalled = allowed < payload_bytes;
  std::vector<iovec> iov;
  iov.reserve(2 * jobs.size());
  uint64_t left = allowed;
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (result.stalled && left == 0) break;  // the budget ended on a frame boundary
    wire::encode(jobs[i].header, headers[i].data());
    iov.push_back({headers[i].data(), headers[i].size()});
    const uint64_t take = std::min<uint64_t>(left, jobs[i].header.length);
    if (take > 0) iov.push_back({const_cast<uint8_t*>(jobs[i].payload), take});
    left -= take;
    if (take < jobs[i].header.length) {
      result.partial = i;  // header and part of the payload on the wire
      break;
    }
    result.num_sent = i + 1;
  }
  if (!write_all(connection->fd, iov)) {
    result.num_sent = 0;
    result.stalled = false;
    result.status = unavailable("peer {} lost: {}", connection->peer->endpoint, errno_text(errno));
  }
  return result;
}

Status TcpTransport::stall(OutConnection* connection, std::vector<Job>& jobs, const WriteResult& result) {
  // Jobs after the stall point never touched the wire: back to the queue, where
  // cancel() can take them. The connection then holds still until the engine
  // stops, the peer fails, or the batch of a half-sent frame is cancelled (the
  // stream is mid-frame then, so the connection has to close).
  std::unique_lock lock(out_mutex_);
  const size_t first_unsent = result.partial ? *result.partial + 1 : result.num_sent;
  for (size_t i = jobs.size(); i-- > first_unsent;) connection->queue.push_front(jobs[i]);
  jobs.resize(first_unsent);
  connection->sending.clear();
  std::shared_ptr<BatchState> partial_batch;
  if (result.partial) {
    partial_batch = jobs[*result.partial].batch;
    connection->sending.push_back(partial_batch);
  }
  out_cv_.notify_all();
  out_cv_.wait(lock, [&] {
    return stopping_.load() || !connection->peer->failure.is_ok() || (partial_batch && partial_batch->finished.load());
  });
  return aborted("sender to {} stalled by stall_after_bytes={} (fault injection) and was stopped",
                 connection->peer->endpoint, options_.stall_after_bytes);
}

void TcpTransport::cancel(const std::vector<std::shared_ptr<BatchState>>& batches) {
  std::unique_lock lock(out_mutex_);
  for (auto& [name, peer] : peers_) {
    for (auto& connection : peer->connections) {
      std::erase_if(connection->queue, [](const Job& job) { return job.batch->finished.load(); });
    }
  }
  out_cv_.notify_all();
  auto in_flight = [&] {
    auto busy = [&](const std::shared_ptr<Peer>& peer) {
      for (auto& connection : peer->connections) {
        for (auto& batch : connection->sending) {
          if (std::find(batches.begin(), batches.end(), batch) != batches.end()) return true;
        }
      }
      return false;
    };
    for (auto& [name, peer] : peers_) {
      if (busy(peer)) return true;
    }
    return std::any_of(retired_peers_.begin(), retired_peers_.end(), busy);
  };
  out_cv_.wait(lock, [&] { return !in_flight(); });
}

}  // namespace moe::transfer
