// Where a command's weights come from, shared by `generate` and the engine
// commands (serve, prefill, decode): --load-format (a checkpoint, or dummy
// random weights at the config's full shapes), --num-layers and
// --quantization (dummy weights only), and --model as a model directory or,
// with dummy weights, a config.json file.
// Called from the CLI's main thread only.
#pragma once

#include <string>

#include <CLI/CLI.hpp>

#include "core/status.h"
#include "model/config.h"
#include "ops/quant.h"

namespace moe::apps {

struct LoadArgs {
  std::string load_format = "auto";   // auto, safetensors or dummy
  int num_layers = 0;                 // dummy only: the first N layers
  std::string quantization = "auto";  // dummy only; auto: the config's format
};

void add_load_options(CLI::App* cmd, LoadArgs& args);

struct ResolvedModel {
  model::ModelConfig config;  // with num_layers cut for dummy weights
  bool dummy = false;
  ops::QuantFormat dummy_format = ops::QuantFormat::kNone;  // the dummy experts' (and projections') format
};

// Reads the config and checks the flags against each other (an error names the flag).
Expected<ResolvedModel> resolve_model(const std::string& model, const LoadArgs& args);
// --model's config alone: a model directory's config.json, or the file itself
// (what dummy weights are drawn from; the router takes either).
Expected<model::ModelConfig> load_config(const std::string& model);

}  // namespace moe::apps
