// The disaggregated router's generation backend (docs/disagg.md, DESIGN
// section 2): behind the same OpenAI API as `serve` (server/openai_api.h), each
// engine-level request becomes
//   reserve on a decode instance  (POST /internal/decode, an SSE stream whose
//                                  first event is the reservation)
//   prefill with that target      (POST /internal/prefill -> first token,
//                                  delivered at once)
//   the decode instance's tokens  (the rest of the SSE stream)
// A failed prefill (instance gone, error) aborts the reservation explicitly
// and is retried on another prefill instance (bounded); a lost decode
// instance ends the request with an error; every request ends by its
// deadline; cancel() (client gone, stop string) closes both connections,
// which cancels the work on both instances.
//
// Threads: GenerationBackend's methods from any thread. Each request runs on
// its own worker thread (joined by the reaper); its outputs are delivered
// there, one at a time.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "server/generation_backend.h"
#include "server/http_server.h"
#include "server/router_pool.h"

namespace moe::server {

struct RouterOptions {
  RouterPoolOptions pool;
  int64_t vocab_size = 0;
  int max_model_len = 4096;
  int max_prefill_retries = 2;   // prefill attempts after the first, each on another instance
  double lease_s = 0;            // of each reservation on the decode instance (0: the instance's own)
  double connect_timeout_s = 5;  // sending a request to an instance
  std::string api_key;           // guards POST /internal/register too
};

class Router final : public GenerationBackend {
 public:
  explicit Router(RouterOptions options);
  ~Router() override;  // shutdown()
  // Cancels what runs (each request's final output: finish kAbort) and joins
  // the workers; later submissions are refused. Idempotent.
  void shutdown();

  Status add_instance(InstanceRole role, const std::string& url) { return pool_.add(role, url); }
  void start() { pool_.start(); }
  // POST /internal/register {"role": "prefill"|"decode", "url": ...}: true when
  // `request` was that route (answered); false for any other route.
  bool handle_internal(const HttpRequest& request, const std::shared_ptr<HttpExchange>& exchange);

  Expected<uint64_t> submit(engine::EngineRequest request, engine::OutputCallback on_output,
                            const std::string& request_id) override;
  // `finish` is not passed on: the decode instance counts a stream the router
  // closes, a stop string's cut included, as aborted.
  void cancel(uint64_t id, engine::FinishReason finish) override;
  int64_t vocab_size() const override { return options_.vocab_size; }
  bool healthy() const override;
  std::string metrics_text(const std::string& model_name) const override;

 private:
  class Job;
  void reap();

  RouterOptions options_;
  RouterPool pool_;
  std::mutex mutex_;
  std::map<uint64_t, std::shared_ptr<Job>> jobs_;
  std::vector<std::thread> finished_;  // workers that ended, to join
  uint64_t next_id_ = 1;
  bool stopping_ = false;
  std::atomic<int64_t> num_requests_{0}, num_retries_{0}, num_failed_{0}, num_decode_lost_{0},
      num_deadline_{0};
};

}  // namespace moe::server
