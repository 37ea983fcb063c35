// The decode instance's control endpoint in disaggregated serving
// (docs/disagg.md): reservations of KV pages for prompts that a prefill
// instance writes through the TransferEngine, activation on commit once every
// write has landed, token streams to the router, and the page reuse rule of
// DESIGN section 2 (engine/reservation.h).
//
// Routes: POST /internal/decode (SSE: "reserved", then tokens), POST
// /internal/commit, POST /internal/abort, GET /internal/load, GET /health,
// GET /metrics.
//
// Threads: handle() on HTTP I/O threads; engine callbacks on the engine
// thread; TransferEngine callbacks on its I/O threads. They only post to the
// service's worker thread, which owns the reservation table's transitions
// (under mutex_); blocking calls to prefill instances run on a second worker.
// Destroy after the HTTP server has stopped and before the engine.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "engine/engine.h"
#include "engine/reservation.h"
#include "kv/kv_cache.h"
#include "server/disagg_protocol.h"
#include "server/http_server.h"
#include "server/task_worker.h"
#include "transfer/transfer_engine.h"

namespace moe::server {

struct DecodeServiceOptions {
  std::string self_url;  // this instance's control endpoint, as the prefill instances reach it
  std::string model_name;
  double default_lease_s = 60;
  double writer_ack_timeout_s = 5;  // one abort notice to a prefill instance
};

class DecodeService {
 public:
  // Registers every layer's K and V pool of `cache` with `transfer`.
  static Expected<std::unique_ptr<DecodeService>> create(engine::Engine& engine,
                                                         transfer::TransferEngine& transfer,
                                                         const kv::KvCache& cache,
                                                         DecodeServiceOptions options);
  ~DecodeService();

  void handle(HttpRequest request, std::shared_ptr<HttpExchange> exchange);
  // The control endpoint's URL once its port is known (before it is announced).
  void set_self_url(std::string url) {
    std::lock_guard lock(mutex_);
    options_.self_url = std::move(url);
  }

 private:
  struct Stream {  // one /internal/decode request
    disagg::DecodeRequest request;
    std::shared_ptr<HttpExchange> exchange;
    uint64_t engine_id = 0;  // once activated
    bool ended = false;      // the SSE stream is closed
  };
  DecodeService(engine::Engine& engine, transfer::TransferEngine& transfer, DecodeServiceOptions options);

  void handle_decode(const HttpRequest& request, const std::shared_ptr<HttpExchange>& exchange);
  HttpResponse handle_commit(const HttpRequest& request);
  HttpResponse handle_abort(const HttpRequest& request);
  void on_reserved(disagg::DecodeRequest request, std::shared_ptr<HttpExchange> exchange,
                   Expected<std::vector<int32_t>> pages);
  void check_landed(uint32_t id);
  void activate(uint32_t id);
  void start_abort(uint32_t id, const std::string& reason);
  void notify_writer(uint32_t id, std::string writer_url, int attempt);
  void release(uint32_t id, const char* why);
  void on_writer_lost(const std::string& endpoint);
  void on_stream_closed(uint32_t id);
  void tick();
  void end_stream(uint32_t id, const disagg::TokenEvent& last);  // mutex_ held
  std::string metrics_text() const;
  disagg::InstanceLoad load() const;

  engine::Engine& engine_;
  transfer::TransferEngine& transfer_;
  DecodeServiceOptions options_;
  disagg::KvLayout layout_;  // num_mtp_layers 1: the engine speculates (its MTP layer's regions come last)
  std::vector<transfer::RegionId> k_regions_, v_regions_;
  std::vector<transfer::RegionDescriptor> k_descs_, v_descs_;

  mutable std::mutex mutex_;
  engine::ReservationTable table_;
  std::map<uint32_t, Stream> streams_;  // by reservation id (imm), until the stream ends
  std::atomic<int64_t> num_commits_{0}, num_activated_{0}, num_aborts_{0}, num_lease_expired_{0},
      num_writer_lost_{0}, num_released_{0}, num_rejected_{0}, num_commits_without_mtp_{0};
  TaskWorker notifier_;  // blocking abort notices to prefill instances
  TaskWorker worker_;    // reservation transitions; declared last: stopped first
};

}  // namespace moe::server
