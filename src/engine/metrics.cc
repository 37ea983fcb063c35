#include "engine/metrics.h"

#include <algorithm>

namespace moe::engine {

void Histogram::observe(double value) {
  const auto bucket = std::lower_bound(bounds.begin(), bounds.end(), value) - bounds.begin();
  ++counts[static_cast<size_t>(bucket)];
  sum += value;
  ++count;
}

EngineMetrics::EngineMetrics()
    // vLLM's bucket bounds.
    : time_to_first_token_seconds({0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0}),
      time_per_output_token_seconds({0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                                     7.5, 10.0, 20.0, 40.0, 80.0}),
      e2e_request_latency_seconds({0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0}),
      request_queue_time_seconds({0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                                  120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0}),
      spec_decode_acceptance_length({1, 2, 3, 4, 5, 6, 7, 8, 9}) {}

}  // namespace moe::engine
