// A small blocking HTTP/1.1 client for the internal control plane of
// disaggregated serving (router <-> instances, decode -> prefill): one
// connection per call, JSON bodies, whole responses or SSE event streams
// (chunked transfer encoding). Plain POSIX sockets with poll() timeouts, so
// another thread can cut a call short with abort().
//
// Threads: an HttpCall is used by one thread, except abort(), which any
// thread may call at any time (also before open() or after the call ended).
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/status.h"

namespace moe::server {

struct HttpUrl {
  std::string host;
  uint16_t port = 0;
  // "http://host:port" (a trailing slash and a path are refused).
  static Expected<HttpUrl> parse(const std::string& url);
  std::string to_string() const;
};

struct HttpClientResponse {
  int status = 0;
  std::string body;
};

class HttpCall {
 public:
  HttpCall() = default;
  ~HttpCall();
  HttpCall(const HttpCall&) = delete;
  HttpCall& operator=(const HttpCall&) = delete;

  // Connects and sends one request (Connection: close). kUnavailable when the
  // peer cannot be reached (refused: the process is gone), kDeadlineExceeded,
  // kAborted after abort().
  Status send(const HttpUrl& url, const std::string& method, const std::string& target,
              const std::string& body, const std::vector<std::pair<std::string, std::string>>& headers,
              double timeout_s);
  // The status line and headers; then either read_body() or next_event().
  Expected<int> read_head(double timeout_s);
  Expected<std::string> read_body(double timeout_s);
  // The next SSE "data:" payload; nullopt at the end of the stream.
  Expected<std::optional<std::string>> next_event(double timeout_s);
  // Shuts the connection: a blocked or later read/send fails with kAborted.
  void abort();
  bool is_aborted() const { return aborted_.load(); }

 private:
  Status fill(double deadline_s);                       // more bytes into buffer_
  Expected<std::string> read_chunk(double deadline_s);  // one chunk of a chunked body ("" at the end)
  Status io_error(const char* what) const;

  std::atomic<int> fd_{-1};
  std::atomic<bool> aborted_{false};
  std::string buffer_;
  bool chunked_ = false;
  int64_t content_length_ = -1;
  bool eof_ = false;
  std::string events_;  // decoded body bytes not yet split into events
  bool body_done_ = false;
};

// One whole request: send, then read the response. Any status is returned as
// a response; only transport failures are errors.
Expected<HttpClientResponse> http_call(const HttpUrl& url, const std::string& method,
                                       const std::string& target, const std::string& body, double timeout_s,
                                       const std::vector<std::pair<std::string, std::string>>& headers = {});

}  // namespace moe::server
