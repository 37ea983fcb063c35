// The serving engine: one loop thread that owns the scheduler and the model
// runner, fed by a thread-safe request queue, answering each request through
// its own output callback.
//
// Every submitted request ends with exactly one final output (finish set:
// stop / length / abort, with `error` set when it failed: deadline, engine
// failure, shutdown). Before that, one output per generated token.
//
// Threads: submit(), cancel(), metrics(), healthy() and the accessors may be
// called from any thread. Output callbacks run on the engine thread and must
// not block (post the work elsewhere).
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/status.h"
#include "engine/metrics.h"
#include "engine/model_runner.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"

namespace moe::engine {

struct EngineRequest {
  std::vector<int32_t> prompt;
  int max_tokens = 16;
  SamplingParams sampling;
  bool ignore_eos = false;
  std::vector<int32_t> stop_token_ids;  // in addition to the model's eos ids
  int num_logprobs = -1;                // -1: none; k >= 0: the sampled token's logprob and the top k
  double timeout_s = 0;                 // 0: no deadline
};

struct TokenLogprobs {
  int32_t token = -1;
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;  // most probable first
};

struct EngineOutput {
  uint64_t id = 0;
  int32_t token = -1;  // the new token; -1 in a final output that adds none
  std::optional<TokenLogprobs> logprobs;
  FinishReason finish = FinishReason::kNone;
  Status error;  // not ok: the request failed (finish is kAbort)
  int num_prompt_tokens = 0;
  int num_output_tokens = 0;
  int num_cached_tokens = 0;  // prompt tokens found in the prefix cache
};
using OutputCallback = std::function<void(const EngineOutput&)>;

struct EngineOptions {
  SchedulerOptions scheduler;
  std::vector<int32_t> eos_token_ids;
  int max_waiting = 1024;  // submit() refuses more queued requests (kResourceExhausted)
#ifdef NDEBUG
  bool check_invariants = false;
#else
  bool check_invariants = true;  // the scheduler's page bookkeeping after every step
#endif
};

class Engine {
 public:
  Engine(std::unique_ptr<ModelRunner> runner, EngineOptions options);
  ~Engine();  // stops the loop; requests still in flight end with kUnavailable
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Validates and queues a request; the id names it for cancel().
  Expected<uint64_t> submit(EngineRequest request, OutputCallback on_output);
  // Ends the request with finish kAbort as soon as the loop sees it, freeing
  // its pages; a no-op for an unknown or finished id.
  void cancel(uint64_t id);

  EngineMetrics metrics() const;
  bool healthy() const { return !dead_.load(); }
  const EngineOptions& options() const { return options_; }
  int64_t vocab_size() const { return vocab_size_; }
  // Stops the loop and fails what is left (idempotent; the destructor calls it).
  void shutdown();

 private:
  struct Active {
    EngineRequest request;
    OutputCallback on_output;
    uint64_t seed = 0;
    double arrival_s = 0, first_scheduled_s = -1, first_token_s = -1;
    int num_output_tokens = 0;
  };
  void loop();
  void drain_queues();
  void step();
  void sample(const StepPlan& plan, const Tensor& logits, std::vector<int32_t>& tokens,
              std::vector<std::optional<TokenLogprobs>>& logprobs);
  void finish(uint64_t id, EngineOutput out);
  void fail_all(const Status& status);
  void update_gauges();
  void log_throughput(double now);

  std::unique_ptr<ModelRunner> runner_;
  EngineOptions options_;
  int64_t vocab_size_;
  Scheduler scheduler_;  // engine thread only
  std::unordered_map<uint64_t, Active> active_;  // engine thread only
  std::mt19937_64 seed_source_;                  // engine thread only
  double last_log_s_ = 0;                        // engine thread only (log_throughput)
  int64_t logged_prompt_tokens_ = 0, logged_generation_tokens_ = 0;

  mutable std::mutex mutex_;  // guards the queues, stop_, next_id_, metrics_, num_queued_
  std::condition_variable wake_;
  std::vector<std::pair<uint64_t, Active>> incoming_;
  std::vector<uint64_t> cancels_;
  uint64_t next_id_ = 1;
  int num_queued_ = 0;  // incoming + waiting in the scheduler
  bool stop_ = false;
  EngineMetrics metrics_;
  std::atomic<bool> dead_{false};
  std::thread thread_;
};

// Seconds on a monotonic clock (the engine's and its deadlines' time base).
double monotonic_seconds();

}  // namespace moe::engine
