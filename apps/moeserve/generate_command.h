// `moeserve generate`: offline generation from token ids, no server.
#pragma once

#include <CLI/CLI.hpp>

namespace moe::apps {
void add_generate_command(CLI::App& app);
}  // namespace moe::apps
