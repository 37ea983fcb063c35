// `moeserve tokenize` and `moeserve detokenize`: the tokenizer for scripts and
// tests, JSON lines in and out.
#pragma once

#include <CLI/CLI.hpp>

namespace moe::apps {
void add_tokenize_commands(CLI::App& app);
}  // namespace moe::apps
