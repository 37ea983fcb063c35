#include "apps/moeserve/load_options.h"

#include <filesystem>
#include <fstream>
#include <sstream>

namespace moe::apps {

void add_load_options(CLI::App* cmd, LoadArgs& args) {
  cmd->add_option("--load-format", args.load_format, "auto, safetensors or dummy (random weights)")
      ->check(CLI::IsMember({"auto", "safetensors", "dummy"}));
  cmd->add_option("--num-layers", args.num_layers, "With dummy weights: use only the first N layers (0: all)");
  cmd->add_option("--quantization", args.quantization,
                  "With dummy weights: auto (the config's quantization_config), none, fp8-block, mxfp8, nvfp4 or mxfp4")
      ->check(CLI::IsMember({"auto", "none", "fp8-block", "mxfp8", "nvfp4", "mxfp4"}));
}

Expected<model::ModelConfig> load_config(const std::string& model) {
  if (std::filesystem::is_regular_file(model)) {
    std::ifstream in(model);
    std::stringstream text;
    text << in.rdbuf();
    auto config = model::parse_model_config(text.str());
    if (!config) return config.status().with_context(model);
    return config;
  }
  return model::load_model_config(model);
}

Expected<ResolvedModel> resolve_model(const std::string& model, const LoadArgs& args) {
  ResolvedModel out;
  MOE_ASSIGN_OR_RETURN(out.config, load_config(model));
  out.dummy = args.load_format == "dummy";
  if (!out.dummy && args.load_format != "auto" && args.load_format != "safetensors")
    return invalid_argument("--load-format must be auto, safetensors or dummy, got '{}'", args.load_format);
  if (args.num_layers > 0) {
    if (!out.dummy) return invalid_argument("--num-layers only applies with --load-format dummy");
    if (args.num_layers > out.config.num_layers)
      return invalid_argument("--num-layers {} exceeds the model's {} layers", args.num_layers, out.config.num_layers);
    out.config.num_layers = args.num_layers;
  }
  const bool auto_format = args.quantization == "auto";
  if (!out.dummy && !auto_format)
    return invalid_argument("--quantization only applies with --load-format dummy (a checkpoint's format is in its "
                            "config.json)");
  MOE_ASSIGN_OR_RETURN(out.dummy_format, auto_format ? Expected<ops::QuantFormat>(out.config.quantization.format)
                                                     : ops::quant_format_from_name(args.quantization));
  return out;
}

}  // namespace moe::apps
