// `moeserve bench serve`: a load generator for any OpenAI-compatible server
// (/v1/completions, streaming), printing the result block of `vllm bench
// serve` (throughputs; TTFT, TPOT, ITL, E2EL mean/median/p99) and saving JSON.
#pragma once

#include <CLI/CLI.hpp>

namespace moe::apps {
void add_bench_command(CLI::App& app);
}  // namespace moe::apps
