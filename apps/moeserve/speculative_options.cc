#include "apps/moeserve/speculative_options.h"

#include <fmt/format.h>

namespace moe::apps {

void add_speculative_options(CLI::App* cmd, SpeculativeArgs& args) {
  cmd->add_option("--speculative-config", args.config_json,
                  "Speculative decoding as JSON, e.g. '{\"method\":\"mtp\",\"num_speculative_tokens\":2}'");
  cmd->add_option("--speculative-model", args.model_dir,
                  "Directory of the MTP layer's safetensors (tensor names in docs/speculative.md); without it, the "
                  "mtp.* tensors of the --model directory");
}

Expected<engine::SpeculativeConfig> check_speculative(const SpeculativeArgs& args) {
  MOE_ASSIGN_OR_RETURN(auto config, engine::parse_speculative_config(args.config_json));
  if (!config.enabled()) {
    if (!args.model_dir.empty()) return invalid_argument("--speculative-model needs --speculative-config");
    return config;
  }
  return config;
}

std::string MtpSource::describe() const {
  switch (kind) {
    case Kind::kSideCheckpoint: return fmt::format("{} (--speculative-model)", dir);
    case Kind::kModelCheckpoint: return fmt::format("the mtp.* tensors of the model checkpoint {}", dir);
    case Kind::kDummy: break;
  }
  return "random weights (dummy)";
}

Expected<MtpSource> find_mtp_source(const SpeculativeArgs& args, const std::string& model_dir, bool dummy) {
  if (!args.model_dir.empty()) return MtpSource{MtpSource::Kind::kSideCheckpoint, args.model_dir};
  if (dummy) return MtpSource{MtpSource::Kind::kDummy, ""};
  auto in_model = model::has_mtp_tensors(model_dir);
  if (!in_model) return in_model.status().with_context("looking for the MTP layer (mtp.* tensors)");
  if (*in_model) return MtpSource{MtpSource::Kind::kModelCheckpoint, model_dir};
  return invalid_argument("--speculative-config needs --speculative-model DIR, the MTP layer's checkpoint: the model "
                          "directory {} has no mtp.* tensors either (Qwen3-MoE checkpoints have none; "
                          "tools/train_mtp.py makes one)",
                          model_dir);
}

Expected<model::MtpWeights> load_mtp_weights(const MtpSource& source, const model::ModelConfig& config) {
  switch (source.kind) {
    case MtpSource::Kind::kSideCheckpoint: return model::MtpWeights::load(source.dir, config);
    case MtpSource::Kind::kModelCheckpoint:
      return model::MtpWeights::load(source.dir, config, model::MtpCheckpoint::kModel);
    case MtpSource::Kind::kDummy: break;
  }
  return model::MtpWeights::dummy(config, 1, config.num_experts > 0);
}

}  // namespace moe::apps
