// Prometheus text exposition (format 0.0.4) of the engine metrics, with vLLM's
// metric names under a "moeserve:" prefix and a model_name label.
// A pure function: any thread.
#pragma once

#include <string>

#include "engine/metrics.h"

namespace moe::server {

std::string render_metrics(const engine::EngineMetrics& metrics, const std::string& model_name);

}  // namespace moe::server
