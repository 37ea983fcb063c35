// A small asynchronous HTTP/1.1 server on Boost.Beast/Asio for the API.
//
// Each connection reads one request at a time (keep-alive, no pipelining),
// hands it to the handler with an HttpExchange to answer through, and watches
// the socket while the answer is pending so a client that goes away is noticed
// at once (the exchange's on_close callbacks run; the API cancels the request).
// Limits: header and body sizes (431 / 413), a read timeout covering an idle
// connection and a request's headers and body (slowloris), a write timeout,
// a number of open connections (503).
// Beast and Asio report errors through error codes here; any exception from a
// handler is caught at this boundary and answered with a 500.
//
// Threads: HttpServer's methods are called by one owner thread. The handler
// runs on the server's I/O threads. HttpExchange's methods may be called from
// any thread (they post to the connection's strand).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"

namespace moe::server {

struct HttpRequest {
  std::string method;  // "GET", "POST", ...
  std::string target;  // path and query
  std::string path;    // target without the query
  std::map<std::string, std::string> headers;  // lower-case names
  std::string body;
  std::string header(const std::string& lower_name) const {
    auto it = headers.find(lower_name);
    return it == headers.end() ? std::string() : it->second;
  }
};

using HeaderList = std::vector<std::pair<std::string, std::string>>;

struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  HeaderList headers;
};

class HttpExchange {
 public:
  virtual ~HttpExchange() = default;
  // One complete response.
  virtual void respond(HttpResponse response) = 0;
  // A streamed response (chunked transfer encoding): the head, then events
  // written as "data: <data>\n\n", then the end.
  virtual void start_events(int status, HeaderList headers) = 0;
  virtual void send_event(std::string data) = 0;
  // An event with a name ("event: <name>" before its data, as the Responses
  // API's streams have); where the exchange keeps no names, its data alone.
  virtual void send_named_event(std::string name, std::string data) {
    (void)name;
    send_event(std::move(data));
  }
  virtual void end_events() = 0;
  // `fn` runs (on an I/O thread) if the client disconnects before the response
  // ends; at once if it already has.
  virtual void on_close(std::function<void()> fn) = 0;
};

using HttpHandler = std::function<void(HttpRequest, std::shared_ptr<HttpExchange>)>;

struct HttpServerOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 8000;  // 0: any free port (see port())
  int num_threads = 2;
  size_t max_body_bytes = size_t{1} << 20;
  size_t max_header_bytes = size_t{16} << 10;
  double read_timeout_s = 15;   // idle connection, or headers + body of one request
  double write_timeout_s = 60;  // one write to a client that does not read
  size_t max_connections = 1024;  // more are answered 503 and closed
};

class HttpServer {
 public:
  HttpServer();
  ~HttpServer();  // stops
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds and starts the I/O threads.
  Status start(const HttpServerOptions& options, HttpHandler handler);
  uint16_t port() const;
  // Closes the listener: no new connection is accepted; the open ones go on.
  void close_listener();
  // Closes the listener, waits up to drain_s for the responses in flight to be
  // written (their requests ended, e.g. failed by a stopping engine), then
  // closes every connection and joins the I/O threads.
  void stop(double drain_s = 0.0);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The JSON error body of the OpenAI API.
std::string error_json(const std::string& message, const std::string& type, const std::string& param = {},
                       const std::string& code = {});

}  // namespace moe::server
