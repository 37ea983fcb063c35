// Engine metrics: counters, gauges and histograms named after vLLM's
// (rendered with a "moeserve:" prefix by server/metrics_text.h).
//
// Histogram is not thread-safe by itself; EngineMetrics is updated by the
// engine thread and copied under the engine's lock for readers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moe::engine {

struct Histogram {
  std::vector<double> bounds;     // upper bounds, ascending; +Inf is implicit
  std::vector<uint64_t> counts;   // per bucket (not cumulative), bounds.size() + 1
  double sum = 0;
  uint64_t count = 0;

  explicit Histogram(std::vector<double> upper_bounds = {})
      : bounds(std::move(upper_bounds)), counts(bounds.size() + 1) {}
  void observe(double value);
};

struct EngineMetrics {
  // Gauges.
  int num_requests_running = 0;
  int num_requests_waiting = 0;
  double kv_cache_usage_perc = 0;  // 0..1, as vLLM
  // Counters.
  int64_t prompt_tokens_total = 0;
  int64_t generation_tokens_total = 0;
  int64_t num_preemptions_total = 0;
  int64_t prefix_cache_queries_total = 0;  // tokens looked up
  int64_t prefix_cache_hits_total = 0;     // tokens found
  int64_t request_success_total[4] = {};   // by FinishReason: none(unused), stop, length, abort
  int64_t num_steps_total = 0;
  double busy_seconds_total = 0;  // time in forward passes (capacity = prompt tokens / busy time)
  // Histograms, seconds.
  Histogram time_to_first_token_seconds;
  Histogram time_per_output_token_seconds;
  Histogram e2e_request_latency_seconds;
  Histogram request_queue_time_seconds;
  // Speculative decoding (vLLM's spec_decode_* counters): verifications of a
  // sequence's drafts, draft tokens verified and accepted, and the tokens each
  // verification emitted (accepted drafts + 1, from 1 to k + 1).
  int64_t spec_decode_num_drafts_total = 0;
  int64_t spec_decode_num_draft_tokens_total = 0;
  int64_t spec_decode_num_accepted_tokens_total = 0;
  Histogram spec_decode_acceptance_length;

  EngineMetrics();
};

}  // namespace moe::engine
