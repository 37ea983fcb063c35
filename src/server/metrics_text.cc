#include "server/metrics_text.h"

#include <fmt/format.h>

#include "engine/scheduler.h"

namespace moe::server {
namespace {

std::string escape_label(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

void scalar(std::string& out, const char* name, const char* type, const char* help, const std::string& labels,
            double value) {
  out += fmt::format("# HELP moeserve:{} {}\n# TYPE moeserve:{} {}\nmoeserve:{}{{{}}} {}\n", name, help, name, type,
                     name, labels, value);
}

void histogram(std::string& out, const char* name, const char* help, const std::string& labels,
               const engine::Histogram& h) {
  out += fmt::format("# HELP moeserve:{} {}\n# TYPE moeserve:{} histogram\n", name, help, name);
  uint64_t cumulative = 0;
  for (size_t i = 0; i < h.bounds.size(); ++i) {
    cumulative += h.counts[i];
    out += fmt::format("moeserve:{}_bucket{{{},le=\"{}\"}} {}\n", name, labels, h.bounds[i], cumulative);
  }
  cumulative += h.counts.back();
  out += fmt::format("moeserve:{}_bucket{{{},le=\"+Inf\"}} {}\n", name, labels, cumulative);
  out += fmt::format("moeserve:{}_sum{{{}}} {}\nmoeserve:{}_count{{{}}} {}\n", name, labels, h.sum, name, labels, h.count);
}

}  // namespace

std::string render_metrics(const engine::EngineMetrics& m, const std::string& model_name) {
  const std::string labels = fmt::format("model_name=\"{}\"", escape_label(model_name));
  std::string out;
  scalar(out, "num_requests_running", "gauge", "Requests in the running batch.", labels, m.num_requests_running);
  scalar(out, "num_requests_waiting", "gauge", "Requests waiting to be scheduled.", labels, m.num_requests_waiting);
  scalar(out, "kv_cache_usage_perc", "gauge", "Fraction of KV cache pages in use (1 = 100%).", labels,
         m.kv_cache_usage_perc);
  scalar(out, "prompt_tokens_total", "counter", "Prefill tokens processed (recomputes included).", labels,
         static_cast<double>(m.prompt_tokens_total));
  scalar(out, "generation_tokens_total", "counter", "Tokens generated.", labels,
         static_cast<double>(m.generation_tokens_total));
  scalar(out, "num_preemptions_total", "counter", "Sequences preempted (recompute).", labels,
         static_cast<double>(m.num_preemptions_total));
  scalar(out, "prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.", labels,
         static_cast<double>(m.prefix_cache_queries_total));
  scalar(out, "prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.", labels,
         static_cast<double>(m.prefix_cache_hits_total));
  out += "# HELP moeserve:request_success_total Finished requests by finish reason.\n"
         "# TYPE moeserve:request_success_total counter\n";
  for (auto reason : {engine::FinishReason::kStop, engine::FinishReason::kLength, engine::FinishReason::kAbort})
    out += fmt::format("moeserve:request_success_total{{{},finished_reason=\"{}\"}} {}\n", labels,
                       engine::finish_reason_name(reason), m.request_success_total[static_cast<int>(reason)]);
  histogram(out, "time_to_first_token_seconds", "Time to first token.", labels, m.time_to_first_token_seconds);
  histogram(out, "time_per_output_token_seconds", "Mean time per output token after the first, per request.", labels,
            m.time_per_output_token_seconds);
  histogram(out, "e2e_request_latency_seconds", "End-to-end request latency.", labels, m.e2e_request_latency_seconds);
  histogram(out, "request_queue_time_seconds", "Time from arrival to first scheduling.", labels,
            m.request_queue_time_seconds);
  // Speculative decoding (docs/speculative.md); zero when it is off.
  scalar(out, "spec_decode_num_drafts_total", "counter", "Verifications of a sequence's draft tokens.", labels,
         static_cast<double>(m.spec_decode_num_drafts_total));
  scalar(out, "spec_decode_num_draft_tokens_total", "counter", "Draft tokens verified.", labels,
         static_cast<double>(m.spec_decode_num_draft_tokens_total));
  scalar(out, "spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.", labels,
         static_cast<double>(m.spec_decode_num_accepted_tokens_total));
  histogram(out, "spec_decode_acceptance_length", "Tokens emitted per verification (accepted drafts + 1).", labels,
            m.spec_decode_acceptance_length);
  return out;
}

}  // namespace moe::server
