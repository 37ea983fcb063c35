// moeserve: the command-line entry point. Each subcommand lives in its own
// file and registers itself here.
#include <CLI/CLI.hpp>

#include "apps/moeserve/bench_command.h"
#include "apps/moeserve/generate_command.h"
#include "apps/moeserve/quantize_command.h"
#include "apps/moeserve/serve_command.h"
#include "apps/moeserve/tokenize_command.h"

int main(int argc, char** argv) {
  CLI::App app{"moeserve: an inference server for Mixture-of-Experts models (Qwen3-MoE)"};
  app.require_subcommand(1);
  // --help shows each option's default ("=8000"); options whose 0 or empty
  // value means "decided at run time" clear theirs and say it in their text.
  app.option_defaults()->always_capture_default();
  moe::apps::add_generate_command(app);
  moe::apps::add_serve_command(app);
  moe::apps::add_disagg_commands(app);
  moe::apps::add_bench_command(app);
  moe::apps::add_tokenize_commands(app);
  moe::apps::add_quantize_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::RuntimeError& e) {
    return e.get_exit_code();  // the command failed and logged why
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);  // prints help or the usage error
    return code == 0 ? 0 : 2;
  }
  return 0;
}
