// The router's view of its prefill and decode instances (docs/disagg.md):
// registration, health checks with exponential backoff (GET /internal/load,
// which also reports the load), the choice of instances for a request, and
// the scaling signals of GET /metrics.
//
// Choice: decode = a healthy instance whose batch (running + in flight from
// this router) is under --decode-batch-threshold, lowest KV usage first (the
// smallest batch when all are over); prefill = the healthy instance with the
// fewest pending input tokens (its report plus what this router sent since),
// skipping those a request already failed on.
//
// Threads: every public method may be called from any thread (one mutex);
// the health checks run on the pool's own thread.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/status.h"
#include "server/disagg_protocol.h"

namespace moe::server {

enum class InstanceRole { kPrefill, kDecode };
const char* instance_role_name(InstanceRole role);

struct RouterPoolOptions {
  int decode_batch_threshold = 32;
  double health_interval_s = 0.5;  // between checks of a healthy instance
  double max_backoff_s = 5;        // between checks of a failing one
  double check_timeout_s = 2;
  std::string model_name;
  int max_model_len = 0;  // the router's: an instance below it is never healthy (0: not checked)
};

// OK when an instance with `instance_limit` (its max_model_len) can take every
// request a router admitting `router_limit` tokens sends it.
Status check_max_model_len(int64_t instance_limit, int64_t router_limit);

// A chosen instance; release it with RouterPool::done().
struct InstanceLease {
  std::string url;
  std::string transfer_endpoint;
  InstanceRole role = InstanceRole::kPrefill;
  int64_t tokens = 0;  // prompt tokens charged to it (prefill)
};

class RouterPool {
 public:
  explicit RouterPool(RouterPoolOptions options);
  ~RouterPool();  // stops the health checks

  // Adds an instance (idempotent); it takes requests once a check succeeds.
  Status add(InstanceRole role, const std::string& url);
  // Checks every instance once now (start-up), then every interval on the thread.
  void start();

  std::optional<InstanceLease> pick_decode();
  std::optional<InstanceLease> pick_prefill(int64_t num_prompt_tokens, const std::set<std::string>& exclude);
  void done(const InstanceLease& lease);
  // A request could not reach the instance: unhealthy until a check succeeds.
  void report_failure(const std::string& url, const Status& why);
  // Input tokens received (the input rate of the scaling signals).
  void count_input_tokens(int64_t num_tokens);

  bool has_healthy(InstanceRole role) const;
  std::string metrics_text() const;

 private:
  struct Instance {
    InstanceRole role = InstanceRole::kPrefill;
    std::string url;
    bool healthy = false;
    int num_failures = 0;
    double next_check_s = 0;
    std::string last_error;  // of the failing checks, logged when it changes
    disagg::InstanceLoad load;
    int in_flight = 0;             // requests this router has on it now
    int64_t in_flight_tokens = 0;  // prefill: prompt tokens sent, not answered yet
    // prefill capacity: input tokens per second of busy time, smoothed
    double capacity_tps = 0;
    int64_t last_prompt_tokens = -1;
    double last_busy_s = 0;
  };
  void loop();
  void check(const std::string& url);
  double input_tokens_per_second_locked(double now) const;

  RouterPoolOptions options_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::map<std::string, Instance> instances_;  // by url
  int64_t input_tokens_total_ = 0;
  std::deque<std::pair<double, int64_t>> input_samples_;  // (time, input_tokens_total) for the rate
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace moe::server
