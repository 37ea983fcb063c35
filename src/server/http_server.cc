#include "server/http_server.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <future>
#include <thread>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <nlohmann/json.hpp>

#include "core/logging.h"

namespace moe::server {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

std::string error_json(const std::string& message, const std::string& type, const std::string& param,
                       const std::string& code) {
  nlohmann::json j;
  j["error"] = {{"message", message},
                {"type", type},
                {"param", param.empty() ? nlohmann::json(nullptr) : nlohmann::json(param)},
                {"code", code.empty() ? nlohmann::json(nullptr) : nlohmann::json(code)}};
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);  // messages may quote user bytes
}

namespace {

std::chrono::milliseconds to_ms(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

std::string status_line(int status) {
  const auto reason = http::obsolete_reason(static_cast<http::status>(status));
  return fmt::format("HTTP/1.1 {} {}\r\n", status, std::string_view(reason.data(), reason.size()));
}

class Session : public std::enable_shared_from_this<Session>, public HttpExchange {
 public:
  Session(tcp::socket socket, const HttpServerOptions& options, const HttpHandler& handler,
          std::atomic<int>& num_in_request)
      : stream_(std::move(socket)), options_(options), handler_(handler), num_in_request_(num_in_request) {}

  void run() {
    net::dispatch(stream_.get_executor(), [self = shared_from_this()] { self->read_request(); });
  }

  void close_now() {
    net::post(stream_.get_executor(), [self = shared_from_this()] { self->close(); });
  }

  void respond(HttpResponse response) override {
    net::post(stream_.get_executor(), [self = shared_from_this(), response = std::move(response)]() mutable {
      self->write_response(std::move(response));
    });
  }
  void start_events(int status, HeaderList headers) override {
    net::post(stream_.get_executor(), [self = shared_from_this(), status, headers = std::move(headers)] {
      std::string head = status_line(status) + "Content-Type: text/event-stream\r\nCache-Control: no-cache\r\n" +
                         "Transfer-Encoding: chunked\r\n";
      for (const auto& [k, v] : headers) head += k + ": " + v + "\r\n";
      if (!self->keep_alive_) head += "Connection: close\r\n";
      self->queue(head + "\r\n", false);
    });
  }
  void send_event(std::string data) override { send_named_event({}, std::move(data)); }
  void send_named_event(std::string name, std::string data) override {
    net::post(stream_.get_executor(), [self = shared_from_this(), name = std::move(name), data = std::move(data)] {
      const std::string event = (name.empty() ? "" : "event: " + name + "\n") + "data: " + data + "\n\n";
      self->queue(fmt::format("{:x}\r\n{}\r\n", event.size(), event), false);
    });
  }
  void end_events() override {
    net::post(stream_.get_executor(), [self = shared_from_this()] { self->queue("0\r\n\r\n", true); });
  }
  void on_close(std::function<void()> fn) override {
    net::post(stream_.get_executor(), [self = shared_from_this(), fn = std::move(fn)]() mutable {
      if (self->peer_gone_) fn();
      else self->on_close_.push_back(std::move(fn));
    });
  }

 private:
  void read_request() {
    if (closed_) return;
    parser_.emplace();
    parser_->header_limit(static_cast<uint32_t>(options_.max_header_bytes));
    parser_->body_limit(options_.max_body_bytes);
    stream_.expires_after(to_ms(options_.read_timeout_s));
    http::async_read_header(stream_, buffer_, *parser_,
                            [self = shared_from_this()](beast::error_code ec, size_t) { self->on_header(ec); });
  }

  // curl sends "Expect: 100-continue" with bodies over 1 KB and waits a second
  // for the interim answer before sending the body.
  void on_header(beast::error_code ec) {
    if (ec) return on_read(ec);
    const auto expect = parser_->get()[http::field::expect];
    if (beast::iequals(expect, "100-continue") && !parser_->is_done()) {
      static const std::string kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
      net::async_write(stream_, net::buffer(kContinue), [self = shared_from_this()](beast::error_code ec, size_t) {
        if (ec) return self->close();
        self->read_body();
      });
      return;
    }
    read_body();
  }

  void read_body() {
    http::async_read(stream_, buffer_, *parser_,
                     [self = shared_from_this()](beast::error_code ec, size_t) { self->on_read(ec); });
  }

  void on_read(beast::error_code ec) {
    if (ec == http::error::body_limit) return reject(413, "the request body is over the limit", "request_too_large");
    if (ec == http::error::header_limit) return reject(431, "the request headers are over the limit", "");
    const bool parse_error = ec && ec.category() == http::make_error_code(http::error::bad_target).category() &&
                             ec != http::error::end_of_stream && ec != http::error::partial_message;
    if (parse_error) return reject(400, "malformed HTTP request: " + ec.message(), "");
    if (ec) return close();  // end of stream, timeout, reset
    auto& msg = parser_->get();
    HttpRequest request;
    // HEAD is GET without the body (RFC 9110): the handler sees a GET, the
    // reply keeps its headers (Content-Length included) and drops the body.
    head_ = msg.method() == http::verb::head;
    request.method = head_ ? std::string("GET") : std::string(msg.method_string());
    request.target = std::string(msg.target());
    request.path = request.target.substr(0, request.target.find('?'));
    for (const auto& field : msg) {
      std::string name(field.name_string());
      std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
      request.headers[name] = std::string(field.value());
    }
    request.body = std::move(msg.body());
    keep_alive_ = msg.keep_alive();
    stream_.expires_never();
    set_in_request(true);
    start_probe();
    try {
      handler_(std::move(request), shared_from_this());
    } catch (const std::exception& e) {
      log_error("http: handler failed: {}", e.what());
      write_response({500, "application/json", error_json("internal error", "internal_error")});
    }
  }

  void reject(int status, const std::string& message, const std::string& code) {
    keep_alive_ = false;
    head_ = false;
    set_in_request(true);
    write_response({status, "application/json", error_json(message, "invalid_request_error", "", code)});
  }

  // Watches for the client going away while its response is pending.
  void start_probe() {
    if (probe_pending_ || closed_) return;
    probe_pending_ = true;
    stream_.socket().async_read_some(net::buffer(probe_), [self = shared_from_this()](beast::error_code ec, size_t n) {
      self->on_probe(ec, n);
    });
  }

  void on_probe(beast::error_code ec, size_t n) {
    probe_pending_ = false;
    if (lingering_) {
      lingering_ = false;
      return linger_close();
    }
    if (!ec && n > 0) {  // the client sent more (a next request): keep it for the parser
      auto space = buffer_.prepare(n);
      net::buffer_copy(space, net::buffer(probe_, n));
      buffer_.commit(n);
    } else if (ec && ec != net::error::operation_aborted) {
      peer_gone();
      return;
    }
    if (want_read_) {
      want_read_ = false;
      read_request();
    }
  }

  void peer_gone() {
    if (peer_gone_) return;
    peer_gone_ = true;
    auto callbacks = std::move(on_close_);
    on_close_.clear();
    if (in_request_)
      for (auto& fn : callbacks) fn();
    close();
  }

  void write_response(HttpResponse r) {
    std::string head = status_line(r.status) + "Content-Type: " + r.content_type + "\r\n" +
                       fmt::format("Content-Length: {}\r\n", r.body.size());
    for (const auto& [k, v] : r.headers) head += k + ": " + v + "\r\n";
    if (!keep_alive_) head += "Connection: close\r\n";
    queue(head + "\r\n" + (head_ ? std::string() : r.body), true);
  }

  void queue(std::string bytes, bool last) {
    if (closed_ || !in_request_) return;
    out_.push_back({std::move(bytes), last});
    if (!writing_) write_next();
  }

  void write_next() {
    if (out_.empty() || closed_) {
      writing_ = false;
      return;
    }
    writing_ = true;
    stream_.expires_after(to_ms(options_.write_timeout_s));
    net::async_write(stream_, net::buffer(out_.front().bytes),
                     [self = shared_from_this()](beast::error_code ec, size_t) { self->on_write(ec); });
  }

  void on_write(beast::error_code ec) {
    if (ec) return peer_gone();
    const bool last = out_.front().last;
    out_.pop_front();
    stream_.expires_never();
    if (!last) return write_next();
    set_in_request(false);
    on_close_.clear();
    out_.clear();
    writing_ = false;
    if (!keep_alive_) return linger_close();
    if (probe_pending_) {  // stop watching, then read the next request
      want_read_ = true;
      beast::error_code ignored;
      stream_.socket().cancel(ignored);
    } else {
      read_request();
    }
  }

  // Closes after the response: our side first, then whatever the client still
  // sends (a rejected body) is read and dropped for a moment, so closing with
  // unread data does not reset the connection before the client reads the answer.
  void linger_close() {
    if (closed_) return;
    beast::error_code ignored;
    if (probe_pending_) {  // one read at a time: stop the probe first
      lingering_ = true;
      stream_.socket().cancel(ignored);
      return;
    }
    stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
    stream_.expires_after(std::chrono::seconds(2));
    drain();
  }

  void drain() {
    stream_.async_read_some(net::buffer(probe_), [self = shared_from_this()](beast::error_code ec, size_t) {
      if (ec) return self->close();
      self->drain();
    });
  }

  // A request is in flight from its read to its response's last byte written
  // (HttpServer::stop waits for those to end).
  void set_in_request(bool in_request) {
    if (in_request == in_request_) return;
    in_request_ = in_request;
    num_in_request_.fetch_add(in_request ? 1 : -1);
  }

  void close() {
    if (closed_) return;
    closed_ = true;
    set_in_request(false);
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.close();
  }

  struct Pending {
    std::string bytes;
    bool last = false;
  };
  beast::tcp_stream stream_;
  const HttpServerOptions& options_;
  const HttpHandler& handler_;
  std::atomic<int>& num_in_request_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  std::deque<Pending> out_;
  std::vector<std::function<void()>> on_close_;
  char probe_[512];
  bool writing_ = false, keep_alive_ = true, in_request_ = false, closed_ = false, head_ = false;
  bool probe_pending_ = false, want_read_ = false, peer_gone_ = false, lingering_ = false;
};

// Over --max-connections: one small 503 written without waiting (it fits in
// the socket buffer), then the connection is closed.
void refuse(tcp::socket socket) {
  static const std::string body = error_json("too many connections", "service_unavailable");
  static const std::string reply = fmt::format(
      "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
      "Connection: close\r\nContent-Length: {}\r\n\r\n{}",
      body.size(), body);
  beast::error_code ignored;
  socket.non_blocking(true, ignored);
  socket.write_some(net::buffer(reply), ignored);
  socket.shutdown(tcp::socket::shutdown_send, ignored);
  socket.close(ignored);
}

}  // namespace

struct HttpServer::Impl {
  HttpServerOptions options;
  HttpHandler handler;
  net::io_context ioc;
  // Keeps the I/O threads running until stop(), also when no connection and
  // no listener is left (close_listener() then stop() post work to them).
  std::optional<net::executor_work_guard<net::io_context::executor_type>> work;
  std::optional<tcp::acceptor> acceptor;
  std::vector<std::thread> threads;
  std::mutex mutex;  // guards sessions
  std::vector<std::weak_ptr<Session>> sessions;
  std::atomic<int> num_in_request{0};  // sessions between a request and its response's end

  void accept() {
    acceptor->async_accept(net::make_strand(ioc), [this](beast::error_code ec, tcp::socket socket) {
      if (ec == net::error::operation_aborted) return;
      if (!ec) {
        beast::error_code ignored;
        socket.set_option(tcp::no_delay(true), ignored);
        std::shared_ptr<Session> session;
        {
          std::lock_guard lock(mutex);
          std::erase_if(sessions, [](const auto& w) { return w.expired(); });
          if (sessions.size() < options.max_connections) {
            session = std::make_shared<Session>(std::move(socket), options, handler, num_in_request);
            sessions.push_back(session);
          }
        }
        if (session) session->run();
        else refuse(std::move(socket));
      }
      accept();
    });
  }
};

HttpServer::HttpServer() : impl_(std::make_unique<Impl>()) {}
HttpServer::~HttpServer() { stop(); }

Status HttpServer::start(const HttpServerOptions& options, HttpHandler handler) {
  impl_->options = options;
  impl_->handler = std::move(handler);
  beast::error_code ec;
  const auto address = net::ip::make_address(options.host, ec);
  if (ec) return invalid_argument("--host {}: not an IP address ({})", options.host, ec.message());
  tcp::endpoint endpoint(address, options.port);
  auto& acceptor = impl_->acceptor.emplace(impl_->ioc);
  acceptor.open(endpoint.protocol(), ec);
  if (!ec) acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) acceptor.bind(endpoint, ec);
  if (!ec) acceptor.listen(net::socket_base::max_listen_connections, ec);
  if (ec) return unavailable("cannot listen on {}:{}: {}", options.host, options.port, ec.message());
  impl_->accept();
  impl_->work.emplace(impl_->ioc.get_executor());
  for (int i = 0; i < std::max(1, options.num_threads); ++i)
    impl_->threads.emplace_back([this] {
      try {
        impl_->ioc.run();
      } catch (const std::exception& e) {
        log_error("http: I/O thread stopped: {}", e.what());
      }
    });
  return Status::ok();
}

uint16_t HttpServer::port() const {
  beast::error_code ec;
  return impl_->acceptor ? impl_->acceptor->local_endpoint(ec).port() : 0;
}

void HttpServer::close_listener() {
  if (impl_->threads.empty()) return;
  std::promise<void> closed;
  net::post(impl_->ioc, [this, &closed] {
    beast::error_code ignored;
    impl_->acceptor->close(ignored);
    closed.set_value();
  });
  closed.get_future().wait();
}

void HttpServer::stop(double drain_s) {
  if (impl_->threads.empty()) return;
  close_listener();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(drain_s);
  while (impl_->num_in_request.load() > 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  net::post(impl_->ioc, [this] {
    std::lock_guard lock(impl_->mutex);
    for (auto& w : impl_->sessions)
      if (auto s = w.lock()) s->close_now();
  });
  // Let the closes run, then stop.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  impl_->work.reset();
  impl_->ioc.stop();
  for (auto& t : impl_->threads) t.join();
  impl_->threads.clear();
}

}  // namespace moe::server
