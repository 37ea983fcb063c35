#include "server/http_client.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>

#include "engine/engine.h"

namespace moe::server {

namespace {

constexpr size_t kMaxHeadBytes = 64 << 10;
constexpr size_t kMaxBodyBytes = 64 << 20;

double now_s() {
  return engine::monotonic_seconds();
}

int remaining_ms(double deadline_s) {
  const double left = deadline_s - now_s();
  return left <= 0 ? 0 : static_cast<int>(std::min(left * 1000 + 1, 1e9));
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace

Expected<HttpUrl> HttpUrl::parse(const std::string& url) {
  constexpr std::string_view kScheme = "http://";
  if (!url.starts_with(kScheme)) return invalid_argument("'{}' is not an http:// URL", url);
  const std::string rest = url.substr(kScheme.size());
  const size_t colon = rest.rfind(':');
  if (colon == std::string::npos || colon == 0) return invalid_argument("'{}' has no port", url);
  HttpUrl out;
  out.host = rest.substr(0, colon);
  const std::string port = rest.substr(colon + 1);
  int value = 0;
  auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
  if (ec != std::errc() || end != port.data() + port.size() || value < 1 || value > 65535)
    return invalid_argument("'{}' has no valid port", url);
  out.port = static_cast<uint16_t>(value);
  return out;
}

std::string HttpUrl::to_string() const {
  return "http://" + host + ":" + std::to_string(port);
}

HttpCall::~HttpCall() {
  const int fd = fd_.exchange(-1);
  if (fd >= 0) ::close(fd);
}

void HttpCall::abort() {
  aborted_ = true;
  const int fd = fd_.load();
  if (fd >= 0) ::shutdown(fd, SHUT_RDWR);  // wakes a blocked poll(); the owner closes
}

Status HttpCall::io_error(const char* what) const {
  if (aborted_) return moe::aborted("the call was aborted");
  return unavailable("{}: {}", what, std::strerror(errno));
}

Status HttpCall::send(const HttpUrl& url, const std::string& method, const std::string& target,
                      const std::string& body,
                      const std::vector<std::pair<std::string, std::string>>& headers, double timeout_s) {
  const double deadline = now_s() + timeout_s;
  if (aborted_) return moe::aborted("the call was aborted");
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(url.host.c_str(), std::to_string(url.port).c_str(), &hints, &found) != 0 || !found)
    return unavailable("cannot resolve {}", url.host);
  const int fd = ::socket(found->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    freeaddrinfo(found);
    return io_error("socket");
  }
  fd_ = fd;
  if (aborted_) ::shutdown(fd, SHUT_RDWR);
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  int rc = ::connect(fd, found->ai_addr, found->ai_addrlen);
  freeaddrinfo(found);
  if (rc != 0 && errno != EINPROGRESS)
    return unavailable("connect to {}: {}", url.to_string(), std::strerror(errno));
  std::string request = method + " " + target + " HTTP/1.1\r\nHost: " + url.host + ":" +
                        std::to_string(url.port) +
                        "\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: " +
                        std::to_string(body.size()) + "\r\n";
  for (const auto& [k, v] : headers) request += k + ": " + v + "\r\n";
  request += "\r\n" + body;
  size_t sent = 0;
  while (sent < request.size()) {
    pollfd p{fd, POLLOUT, 0};
    const int ready = ::poll(&p, 1, remaining_ms(deadline));
    if (aborted_) return moe::aborted("the call was aborted");
    if (ready == 0) return deadline_exceeded("sending to {} timed out", url.to_string());
    if (ready < 0) return io_error("poll");
    int err = 0;
    socklen_t len = sizeof err;
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) return unavailable("connect to {}: {}", url.to_string(), std::strerror(err));
    const ssize_t n = ::send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (n <= 0) return unavailable("send to {}: {}", url.to_string(), std::strerror(errno));
    sent += static_cast<size_t>(n);
  }
  return Status::ok();
}

Status HttpCall::fill(double deadline_s) {
  const int fd = fd_.load();
  if (fd < 0) return internal_error("read before send");
  while (true) {
    if (aborted_) return moe::aborted("the call was aborted");
    pollfd p{fd, POLLIN, 0};
    const int ready = ::poll(&p, 1, remaining_ms(deadline_s));
    if (aborted_) return moe::aborted("the call was aborted");
    if (ready == 0) return deadline_exceeded("no answer from the peer in time");
    if (ready < 0) {
      if (errno == EINTR) continue;
      return io_error("poll");
    }
    char chunk[16384];
    const ssize_t n = ::recv(fd, chunk, sizeof chunk, 0);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (n < 0) return io_error("recv");
    if (n == 0) {
      eof_ = true;
      return unavailable("the peer closed the connection");
    }
    buffer_.append(chunk, static_cast<size_t>(n));
    if (buffer_.size() > kMaxBodyBytes)
      return out_of_range("the peer's answer is over {} bytes", kMaxBodyBytes);
    return Status::ok();
  }
}

Expected<int> HttpCall::read_head(double timeout_s) {
  const double deadline = now_s() + timeout_s;
  size_t end = 0;
  while ((end = buffer_.find("\r\n\r\n")) == std::string::npos) {
    if (buffer_.size() > kMaxHeadBytes)
      return out_of_range("the response head is over {} bytes", kMaxHeadBytes);
    MOE_RETURN_IF_ERROR(fill(deadline));
  }
  const std::string head = buffer_.substr(0, end);
  buffer_.erase(0, end + 4);
  if (!head.starts_with("HTTP/1.1 ") && !head.starts_with("HTTP/1.0 "))
    return unavailable("not an HTTP response");
  int status = 0;
  std::from_chars(head.data() + 9, head.data() + std::min<size_t>(head.size(), 12), status);
  if (status < 100 || status > 599) return unavailable("bad HTTP status line");
  size_t pos = head.find("\r\n");
  while (pos != std::string::npos && pos < head.size()) {
    const size_t next = head.find("\r\n", pos + 2);
    const std::string line = head.substr(pos + 2, (next == std::string::npos ? head.size() : next) - pos - 2);
    const size_t colon = line.find(':');
    if (colon != std::string::npos) {
      const std::string name = lower(line.substr(0, colon));
      std::string value = line.substr(colon + 1);
      value.erase(0, value.find_first_not_of(' '));
      if (name == "transfer-encoding" && lower(value).find("chunked") != std::string::npos) chunked_ = true;
      if (name == "content-length") content_length_ = std::strtoll(value.c_str(), nullptr, 10);
    }
    pos = next;
  }
  return status;
}

Expected<std::string> HttpCall::read_chunk(double deadline_s) {
  size_t line_end = 0;
  while ((line_end = buffer_.find("\r\n")) == std::string::npos) MOE_RETURN_IF_ERROR(fill(deadline_s));
  const uint64_t size = std::strtoull(buffer_.substr(0, line_end).c_str(), nullptr, 16);
  if (size > kMaxBodyBytes) return out_of_range("a chunk of {} bytes", size);
  while (buffer_.size() < line_end + 2 + size + 2) MOE_RETURN_IF_ERROR(fill(deadline_s));
  std::string data = buffer_.substr(line_end + 2, size);
  buffer_.erase(0, line_end + 2 + size + 2);
  if (size == 0) body_done_ = true;
  return data;
}

Expected<std::string> HttpCall::read_body(double timeout_s) {
  const double deadline = now_s() + timeout_s;
  if (chunked_) {
    std::string body;
    while (!body_done_) {
      MOE_ASSIGN_OR_RETURN(std::string chunk, read_chunk(deadline));
      body += chunk;
    }
    return body;
  }
  if (content_length_ < 0) {  // until EOF
    while (!eof_) {
      Status s = fill(deadline);
      if (!s.is_ok() && !eof_) return s;
    }
    return std::move(buffer_);
  }
  while (static_cast<int64_t>(buffer_.size()) < content_length_) MOE_RETURN_IF_ERROR(fill(deadline));
  return buffer_.substr(0, static_cast<size_t>(content_length_));
}

Expected<std::optional<std::string>> HttpCall::next_event(double timeout_s) {
  const double deadline = now_s() + timeout_s;
  while (true) {
    const size_t end = events_.find("\n\n");
    if (end != std::string::npos) {
      std::string event = events_.substr(0, end);
      events_.erase(0, end + 2);
      if (!event.starts_with("data: ")) continue;  // comments, other fields
      return std::optional<std::string>(event.substr(6));
    }
    if (body_done_ || !chunked_) return std::optional<std::string>();
    MOE_ASSIGN_OR_RETURN(std::string chunk, read_chunk(deadline));
    events_ += chunk;
    if (events_.size() > kMaxBodyBytes) return out_of_range("an event over {} bytes", kMaxBodyBytes);
  }
}

Expected<HttpClientResponse> http_call(const HttpUrl& url, const std::string& method,
                                       const std::string& target, const std::string& body, double timeout_s,
                                       const std::vector<std::pair<std::string, std::string>>& headers) {
  const double deadline = now_s() + timeout_s;
  HttpCall call;
  MOE_RETURN_IF_ERROR(call.send(url, method, target, body, headers, timeout_s));
  HttpClientResponse out;
  MOE_ASSIGN_OR_RETURN(out.status, call.read_head(std::max(0.0, deadline - now_s())));
  MOE_ASSIGN_OR_RETURN(out.body, call.read_body(std::max(0.0, deadline - now_s())));
  return out;
}

}  // namespace moe::server
