#include "apps/moeserve/speculative_options.h"

namespace moe::apps {

void add_speculative_options(CLI::App* cmd, SpeculativeArgs& args) {
  cmd->add_option("--speculative-config", args.config_json,
                  "Speculative decoding as JSON, e.g. '{\"method\":\"mtp\",\"num_speculative_tokens\":2}'");
  cmd->add_option("--speculative-model", args.model_dir,
                  "Directory of the MTP layer's safetensors (tensor names in docs/speculative.md)");
}

Expected<engine::SpeculativeConfig> check_speculative(const SpeculativeArgs& args, const DeviceArgs& device,
                                                      bool disaggregated_role) {
  MOE_ASSIGN_OR_RETURN(auto config, engine::parse_speculative_config(args.config_json));
  if (!config.enabled()) {
    if (!args.model_dir.empty()) return invalid_argument("--speculative-model needs --speculative-config");
    return config;
  }
  if (device.cuda() && disaggregated_role)
    return unimplemented("speculative decoding on --device cuda runs in `serve` and `generate` only for now, not in "
                         "the prefill and decode roles; use --device cpu or drop --speculative-config");
  return config;
}

Expected<model::MtpWeights> load_mtp_weights(const SpeculativeArgs& args, const model::ModelConfig& config,
                                             bool dummy) {
  if (!args.model_dir.empty()) return model::MtpWeights::load(args.model_dir, config);
  if (dummy) return model::MtpWeights::dummy(config, 1, config.num_experts > 0);
  return invalid_argument("--speculative-config needs --speculative-model DIR: the MTP layer's checkpoint "
                          "(Qwen3-MoE checkpoints have none; tools/train_mtp.py makes one)");
}

}  // namespace moe::apps
