#include "apps/moeserve/quantize_command.h"

#include <chrono>
#include <memory>
#include <string>

#include "core/logging.h"
#include "model/quantize_checkpoint.h"

namespace moe::apps {
namespace {

struct QuantizeArgs {
  std::string model;
  std::string out;
  std::string format;
  bool force = false;
  bool experts_only = false;
  double max_shard_gb = 5.0;
  int threads = 0;
};

// "3m05s"
std::string format_duration(double seconds) {
  const auto s = static_cast<int64_t>(seconds + 0.5);
  return s >= 60 ? fmt::format("{}m{:02d}s", s / 60, s % 60) : fmt::format("{}s", s);
}

Status run_quantize(const QuantizeArgs& args) {
  model::QuantizeOptions options;
  options.model_dir = args.model;
  options.out_dir = args.out;
  MOE_ASSIGN_OR_RETURN(options.format, ops::quant_format_from_name(args.format));
  options.force = args.force;
  options.quantize_attention = !args.experts_only;
  if (!(args.max_shard_gb > 0.0)) return invalid_argument("--max-shard-size must be positive");
  options.max_shard_bytes = static_cast<uint64_t>(args.max_shard_gb * 1e9);
  if (args.threads < 0) return invalid_argument("--threads must be 0 (one per hardware thread) or more");
  options.num_threads = args.threads;
  // A line at most every 2 s, and one for the last tensor.
  auto last_report = std::chrono::steady_clock::time_point();
  auto progress = [&](const model::QuantizeProgress& p) {
    const auto now = std::chrono::steady_clock::now();
    if (p.num_tensors_done != p.num_tensors && now - last_report < std::chrono::seconds(2)) return;
    last_report = now;
    const double fraction = p.input_bytes > 0 ? static_cast<double>(p.input_bytes_done) / p.input_bytes : 1.0;
    const double eta_s = fraction > 0 ? p.elapsed_s * (1.0 - fraction) / fraction : 0.0;
    log_info("quantize: {}/{} tensors, {:.2f}/{:.2f} GB read, {:.2f} GB written, {} elapsed, ETA {}",
             p.num_tensors_done, p.num_tensors, p.input_bytes_done / 1e9, p.input_bytes / 1e9,
             p.output_bytes_done / 1e9, format_duration(p.elapsed_s), format_duration(eta_s));
  };
  MOE_ASSIGN_OR_RETURN(model::QuantizeSummary summary, model::quantize_checkpoint(options, progress));
  log_info("quantize: wrote {} ({}: {} of {} tensors quantized, {} shard(s), {:.3f} GB -> {:.3f} GB)", args.out,
           args.format, summary.num_quantized, summary.num_tensors, summary.num_shards, summary.input_bytes / 1e9,
           summary.output_bytes / 1e9);
  return Status::ok();
}

}  // namespace

void add_quantize_command(CLI::App& app) {
  auto args = std::make_shared<QuantizeArgs>();
  CLI::App* cmd = app.add_subcommand("quantize", "Convert a bf16/f32 checkpoint to a quantized format (offline)");
  cmd->add_option("--model", args->model, "Input model directory (bf16, f16 or f32 safetensors)")->required();
  cmd->add_option("--out", args->out, "Output directory (must be empty or absent unless --force)")->required();
  cmd->add_option("--format", args->format, "fp8-block, mxfp8, nvfp4 or mxfp4")
      ->required()
      ->check(CLI::IsMember({"fp8-block", "mxfp8", "nvfp4", "mxfp4"}));
  cmd->add_flag("--force", args->force, "Write into a non-empty --out (its old weights are removed)");
  cmd->add_flag("--experts-only", args->experts_only, "Keep attention projections in bf16 (quantize MLPs only)");
  cmd->add_option("--max-shard-size", args->max_shard_gb, "Output shard size in GB");
  cmd->add_option("--threads", args->threads, "Conversion threads (0: one per hardware thread)");
  cmd->callback([args] {
    Status status = run_quantize(*args);
    if (!status.is_ok()) {
      log_error("{}", status.to_string());
      throw CLI::RuntimeError(1);
    }
  });
}

}  // namespace moe::apps
