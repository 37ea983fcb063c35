// The prefill instance's control endpoint in disaggregated serving
// (docs/disagg.md): runs a prompt's prefill only (one sampled token), streams
// each layer's KV into the decode instance's reserved pages through the
// TransferEngine as soon as the layer is written (engine/engine.h
// KvExportSink), then commits to the decode instance and answers the router
// with the first token.
//
// Routes: POST /internal/prefill, POST /internal/abort (from a decode
// instance: acknowledged once no write of that reservation can leave here),
// GET /internal/load, GET /health, GET /metrics.
//
// Threads: handle() on HTTP I/O threads; the sink on the engine thread;
// commits and cancels run on the service's worker. Destroy after the HTTP
// server has stopped and before the engine.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "engine/engine.h"
#include "kv/kv_cache.h"
#include "server/disagg_protocol.h"
#include "server/http_server.h"
#include "server/task_worker.h"
#include "transfer/transfer_engine.h"

namespace moe::server {

struct PrefillServiceOptions {
  std::string model_name;
  double commit_timeout_s = 10;
  // Fault injection (tests): acknowledge a decode instance's abort only after
  // this many seconds, i.e. act as a writer that stays alive a while.
  double fault_abort_ack_delay_s = 0;
};

class PrefillService {
 public:
  // Registers every layer's K and V pool of every rank's cache with
  // `transfer`. `rank_caches`: the instance's TP ranks in rank order (one for
  // a single rank), each holding its share of the model's `num_kv_heads` k/v
  // heads (transfer/kv_plan.h local_heads); every rank's heads are sent.
  static Expected<std::unique_ptr<PrefillService>> create(engine::Engine& engine,
                                                          transfer::TransferEngine& transfer,
                                                          std::vector<const kv::KvCache*> rank_caches,
                                                          int num_kv_heads, PrefillServiceOptions options);
  ~PrefillService();

  void handle(HttpRequest request, std::shared_ptr<HttpExchange> exchange);

 private:
  class Exporter;
  struct Job {
    std::shared_ptr<Exporter> exporter;
    std::shared_ptr<HttpExchange> exchange;
    uint64_t engine_id = 0;
    int64_t num_prompt_tokens = 0;
    bool running = true;  // in the engine
  };
  PrefillService(engine::Engine& engine, transfer::TransferEngine& transfer, PrefillServiceOptions options);

  void handle_prefill(const HttpRequest& request, const std::shared_ptr<HttpExchange>& exchange);
  void handle_abort(const HttpRequest& request, const std::shared_ptr<HttpExchange>& exchange);
  bool sends_mtp(const disagg::PrefillRequest& request);
  void on_prefilled(const std::string& key, const engine::EngineOutput& out);
  void commit(const std::string& key, disagg::PrefillResult result);
  void cancel_job(const std::string& key, const char* why);
  void forget_when_sent(const std::string& key);
  std::string metrics_text() const;
  disagg::InstanceLoad load() const;

  engine::Engine& engine_;
  transfer::TransferEngine& transfer_;
  PrefillServiceOptions options_;
  disagg::KvLayout layout_;  // the model's: all k/v heads; a rank's page size and dtype
  int tp_size_ = 1;
  bool kv_on_device_ = false;  // the CUDA runner's pool: sent with CUDA IPC only
  std::string kv_transport_;   // of the registered KV regions, for logs and metrics
  std::vector<std::vector<transfer::RegionId>> k_regions_, v_regions_;  // [rank][layer]
  // Speculative decoding: the engine's MTP layer (all k/v heads, on this
  // rank), sent as one more layer to decode instances that have one.
  std::optional<transfer::RegionId> mtp_k_region_, mtp_v_region_;

  mutable std::mutex mutex_;
  std::map<std::string, Job> jobs_;  // by "<decode endpoint>/<reservation>"
  int64_t pending_prompt_tokens_ = 0;
  std::atomic<int64_t> num_prefills_{0}, num_failed_{0}, num_aborts_{0}, num_rejected_{0}, num_batches_{0},
      num_kv_bytes_sent_{0};
  std::atomic<bool> warned_mtp_mismatch_{false};  // logged once per instance
  TaskWorker worker_;  // declared last: stopped first
};

}  // namespace moe::server
