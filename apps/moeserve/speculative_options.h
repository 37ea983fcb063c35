// The speculative-decoding flags shared by `generate`, `serve` and the
// disaggregated instances (docs/speculative.md): --speculative-config (vLLM's
// JSON spelling) and --speculative-model (the MTP side checkpoint).
// Called from the CLI's main thread only.
#pragma once

#include <optional>
#include <string>

#include <CLI/CLI.hpp>

#include "apps/moeserve/device_options.h"
#include "core/status.h"
#include "engine/speculative.h"
#include "model/config.h"
#include "model/mtp.h"

namespace moe::apps {

struct SpeculativeArgs {
  std::string config_json;  // empty: off
  std::string model_dir;    // the MTP checkpoint directory
};

void add_speculative_options(CLI::App* cmd, SpeculativeArgs& args);

// The parsed config (method "mtp", 1..8 tokens; off when no flag), refused
// where speculation does not run yet (the prefill and decode roles on CUDA).
// With --device cuda the MTP layer runs on the CPU from the target's
// hidden states (docs/speculative.md).
Expected<engine::SpeculativeConfig> check_speculative(const SpeculativeArgs& args, const DeviceArgs& device,
                                                      bool disaggregated_role);

// The MTP weights: --speculative-model DIR, or random ones with dummy target
// weights (an MoE MLP when the target has experts).
Expected<model::MtpWeights> load_mtp_weights(const SpeculativeArgs& args, const model::ModelConfig& config,
                                             bool dummy);

}  // namespace moe::apps
