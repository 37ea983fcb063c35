// `moeserve serve`: the OpenAI-compatible server on one process (colocated
// prefill and decode). With no --model it serves the bundled demo model.
#pragma once

#include <CLI/CLI.hpp>

namespace moe::apps {
void add_serve_command(CLI::App& app);
// The bundled demo model's directory (models/moeserve-demo in the source tree,
// or next to the installed binary).
std::string default_model_dir();
}  // namespace moe::apps
