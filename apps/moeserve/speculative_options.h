// The speculative-decoding flags shared by `generate`, `serve` and the
// disaggregated instances (docs/speculative.md): --speculative-config (vLLM's
// JSON spelling) and --speculative-model (the MTP side checkpoint; without it
// the MTP layer is read from the mtp.* tensors of the model directory).
// Called from the CLI's main thread only.
#pragma once

#include <optional>
#include <string>

#include <CLI/CLI.hpp>

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

// The parsed config (method "mtp", 1..8 tokens; off when no flag);
// --speculative-model without a config is refused. The MTP layer runs where
// the target does (docs/speculative.md).
Expected<engine::SpeculativeConfig> check_speculative(const SpeculativeArgs& args);

// Where the MTP layer comes from.
struct MtpSource {
  enum class Kind { kSideCheckpoint, kModelCheckpoint, kDummy };
  Kind kind = Kind::kDummy;
  std::string dir;  // the checkpoint directory (empty for kDummy)
  std::string describe() const;  // for the start-up log
};

// --speculative-model DIR when given; else random weights when the target's
// are dummy (`dummy`); else the mtp.* tensors of `model_dir` (the target's
// own checkpoint, as Qwen3.5 ships it); else an error saying that neither has
// an MTP layer. Reads only the checkpoint headers of `model_dir`.
Expected<MtpSource> find_mtp_source(const SpeculativeArgs& args, const std::string& model_dir, bool dummy);

// The MTP weights from `source` (random ones: an MoE MLP when the target has experts).
Expected<model::MtpWeights> load_mtp_weights(const MtpSource& source, const model::ModelConfig& config);

}  // namespace moe::apps
