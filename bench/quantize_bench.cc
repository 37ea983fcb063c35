// Throughput of `moeserve quantize` (model::quantize_checkpoint) on a
// generated bf16 checkpoint of Qwen3-235B-shaped experts (gate/up [1536, 4096],
// down [4096, 1536]), one run per format. Usage:
//   build/bin/quantize_bench [--experts N] [--threads T] [--dir DIR] [--formats f1,f2,...]
// (defaults: 16 experts = 0.60 GB of bf16, every hardware thread, a fresh
// temporary directory, every format). Before timing, each output's first
// tensor is checked against ops::quantize_matrix of the same rows (the CPU
// reference the converter calls): the same bytes. The input is read once
// before the runs, so the page cache holds it as it would a checkpoint read
// from a fast disk; the times are the whole conversion, writes included.
// Prints a markdown table: input GB/s per format.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "model/quant_weights.h"
#include "model/quantize_checkpoint.h"
#include "model/safetensors.h"
#include "ops/linear.h"

namespace {

namespace fs = std::filesystem;
using moe::DType;
using moe::Tensor;
using moe::TensorView;

constexpr int64_t kHidden = 4096, kIntermediate = 1536;

// Gaussian-ish bf16 weights (sum of two uniforms, std ~0.02), deterministic.
void fill_weights(Tensor& t, uint64_t seed) {
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  auto* out = t.data_as<uint16_t>();
  for (int64_t i = 0; i < t.num_elements(); ++i) {
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    const float u = static_cast<float>(state >> 40) * (1.0f / 16777216.0f);
    const float v = static_cast<float>(state & 0xFFFFFF) * (1.0f / 16777216.0f);
    out[i] = moe::float_to_bf16(0.035f * (u + v - 1.0f));
  }
}

moe::Status write_checkpoint(const fs::path& dir, int num_experts) {
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << R"({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
  "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 1,
  "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "num_experts": )"
                                     << num_experts << R"(, "num_experts_per_tok": 8,
  "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
  "norm_topk_prob": true, "tie_word_embeddings": false, "torch_dtype": "bfloat16"})";
  std::vector<Tensor> owned;
  std::vector<std::pair<std::string, TensorView>> tensors;
  for (int e = 0; e < num_experts; ++e)
    for (const char* proj : {"gate_proj", "up_proj", "down_proj"}) {
      const bool down = std::strcmp(proj, "down_proj") == 0;
      Tensor t(DType::kBF16, {down ? kHidden : kIntermediate, down ? kIntermediate : kHidden});
      fill_weights(t, owned.size());
      tensors.emplace_back(fmt::format("model.layers.0.mlp.experts.{}.{}.weight", e, proj), t.view());
      owned.push_back(std::move(t));
    }
  return moe::model::write_safetensors((dir / "model.safetensors").string(), tensors);
}

// The converter's first expert tensor must be ops::quantize_matrix of the input's.
bool check_output(const fs::path& in, const fs::path& out, moe::ops::QuantFormat format) {
  const std::string name = "model.layers.0.mlp.experts.0.gate_proj.weight";
  auto input = moe::model::SafetensorsCheckpoint::open(in.string());
  auto output = moe::model::SafetensorsCheckpoint::open(out.string());
  if (!input || !output) return false;
  TensorView w = *input->view(name);
  Tensor f32(DType::kF32, w.shape());
  moe::ops::cpu::to_f32(w.dtype(), w.data(), f32.data_as<float>(), w.num_elements());
  moe::model::OwnedQuantized ref = moe::model::allocate_quantized(format, 0, w.dim(0), w.dim(1));
  if (!ref.global_scale.empty()) {  // gate and up share it
    moe::ThreadPool pool(1);
    auto up = input->view("model.layers.0.mlp.experts.0.up_proj.weight");
    ref.global_scale.data_as<float>()[0] = moe::ops::nvfp4_global_scale(
        std::max(moe::model::tensor_max_abs(pool, w), moe::model::tensor_max_abs(pool, *up)));
  }
  moe::ops::quantize_matrix(f32.data_as<float>(), ref.view());
  const moe::model::QuantTensorNames names = moe::model::quant_tensor_names(format, name);
  auto values = output->view(names.values);
  auto scales = output->view(names.scales);
  return values && scales && values->num_bytes() == ref.values.num_bytes() &&
         std::memcmp(values->data(), ref.values.data(), ref.values.num_bytes()) == 0 &&
         std::memcmp(scales->data(), ref.scales.data(), ref.scales.num_bytes()) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("Throughput of moeserve quantize on generated Qwen3-235B-shaped experts");
  int num_experts = 16;
  int num_threads = 0;
  std::string dir_arg;
  std::vector<std::string> formats = {"fp8-block", "mxfp8", "nvfp4", "mxfp4"};
  app.add_option("--experts", num_experts, "Experts in the generated layer (3 bf16 matrices of 12.6 MB each)");
  app.add_option("--threads", num_threads, "Conversion threads (0: one per hardware thread)");
  app.add_option("--dir", dir_arg, "Scratch directory (default: a fresh one under the temporary directory)");
  app.add_option("--formats", formats, "Formats to time")->delimiter(',');
  CLI11_PARSE(app, argc, argv);

  const fs::path dir = dir_arg.empty() ? fs::temp_directory_path() / fmt::format("quantize_bench_{}", getpid())
                                       : fs::path(dir_arg);
  const fs::path in = dir / "bf16";
  if (auto status = write_checkpoint(in, num_experts); !status.is_ok()) {
    std::fprintf(stderr, "%s\n", status.to_string().c_str());
    return 1;
  }
  {  // into the page cache
    std::ifstream file(in / "model.safetensors", std::ios::binary);
    std::vector<char> buffer(1 << 20);
    while (file.read(buffer.data(), buffer.size())) {
    }
  }
  std::printf("| format | input GB | seconds | input GB/s | output = reference |\n|---|---|---|---|---|\n");
  int failures = 0;
  for (const std::string& name : formats) {
    auto format = moe::ops::quant_format_from_name(name);
    if (!format) {
      std::fprintf(stderr, "%s\n", format.status().to_string().c_str());
      return 1;
    }
    moe::model::QuantizeOptions options;
    options.model_dir = in.string();
    options.out_dir = (dir / name).string();
    options.format = *format;
    options.force = true;
    options.num_threads = num_threads;
    const auto start = std::chrono::steady_clock::now();
    auto summary = moe::model::quantize_checkpoint(options, nullptr);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!summary) {
      std::fprintf(stderr, "%s\n", summary.status().to_string().c_str());
      return 1;
    }
    const bool same = check_output(in, dir / name, *format);
    failures += same ? 0 : 1;
    std::printf("| %s | %.2f | %.2f | %.3f | %s |\n", name.c_str(), summary->input_bytes / 1e9, seconds,
                summary->input_bytes / 1e9 / seconds, same ? "yes" : "NO");
    fs::remove_all(dir / name);
  }
  if (dir_arg.empty()) fs::remove_all(dir);
  return failures == 0 ? 0 : 1;
}
