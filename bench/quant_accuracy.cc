// Prints the accuracy table of the quantized formats on the golden models
// (bench/quant_accuracy.h says what is measured). Usage:
//   build/bin/quant_accuracy [WORK_DIR]     (default: a fresh temporary directory)
// The output is the markdown tables of bench/results/*_quant_accuracy.md:
// first the error one quantized projection makes (relative rms error of the
// weights, and of y = x W^T for gaussian x, activations quantized as the
// format's kernel does), over every projection of moe_basic; then the
// end-to-end table.
#include <cstdio>
#include <filesystem>
#include <random>

#include "bench/quant_accuracy.h"
#include "model/safetensors.h"
#include "ops/linear.h"

namespace {

using moe::DType;
using moe::Tensor;
using moe::TensorView;

// Relative rms error of the weights and of a projection's output.
struct ProjectionError {
  double weight = 0, output = 0;
};

ProjectionError projection_error(moe::ops::QuantFormat format, TensorView w, moe::ThreadPool& pool) {
  const int64_t n = w.dim(0), k = w.dim(1);
  Tensor plain(DType::kF32, {n, k}), deq(DType::kF32, {n, k});
  moe::ops::cpu::to_f32(w.dtype(), w.data(), plain.data_as<float>(), n * k);
  auto q = moe::model::quantize_tensor(pool, format, w);
  moe::ops::dequantize_rows(q->view(), 0, n, deq.data_as<float>());
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  constexpr int64_t kTokens = 16;
  Tensor x(DType::kF32, {kTokens, k}), y(DType::kF32, {kTokens, n}), yq(DType::kF32, {kTokens, n});
  for (int64_t i = 0; i < kTokens * k; ++i) x.data_as<float>()[i] = normal(rng);
  moe::ops::cpu::linear(pool, x, plain, y);
  moe::ops::cpu::quantized_linear(pool, x, q->view(), yq);
  auto relative = [](const float* a, const float* b, int64_t count) {
    double e = 0, r = 0;
    for (int64_t i = 0; i < count; ++i) e += (a[i] - b[i]) * static_cast<double>(a[i] - b[i]), r += b[i] * static_cast<double>(b[i]);
    return std::sqrt(e / r);
  };
  return {relative(deq.data_as<float>(), plain.data_as<float>(), n * k),
          relative(yq.data_as<float>(), y.data_as<float>(), kTokens * n)};
}

void print_projection_errors(const std::string& model_dir, moe::ThreadPool& pool) {
  auto checkpoint = moe::model::SafetensorsCheckpoint::open(model_dir);
  if (!checkpoint) return;
  std::printf("| format | weight rel. rms error (max) | output rel. rms error (mean / max) | projections |\n");
  std::printf("|---|---|---|---|\n");
  for (auto format : {moe::ops::QuantFormat::kFp8Block, moe::ops::QuantFormat::kMxfp8, moe::ops::QuantFormat::kNvfp4,
                      moe::ops::QuantFormat::kMxfp4}) {
    double max_weight = 0, max_output = 0, sum_output = 0;
    int count = 0;
    for (const auto& name : checkpoint->tensor_names()) {
      if (!moe::model::is_quantized_projection(name, true)) continue;
      const ProjectionError e = projection_error(format, *checkpoint->view(name), pool);
      max_weight = std::max(max_weight, e.weight), max_output = std::max(max_output, e.output);
      sum_output += e.output, count += 1;
    }
    std::printf("| %s | %.4f | %.4f / %.4f | %d |\n", std::string(moe::ops::quant_format_name(format)).c_str(),
                max_weight, sum_output / count, max_output, count);
  }
  std::printf("\n");
}

}  // namespace

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  using moe::ops::QuantFormat;
  const fs::path work = argc > 1 ? fs::path(argv[1]) : fs::temp_directory_path() / "moe_quant_accuracy";
  const std::string golden_root = std::string(MOE_SOURCE_DIR) + "/tests/data/golden";
  moe::ThreadPool pool;
  print_projection_errors(golden_root + "/moe_basic", pool);
  std::printf("| model | format | max abs logit error | max rel. L2 | max abs golden logit | greedy agreement |\n");
  std::printf("|---|---|---|---|---|---|\n");
  int status = 0;
  for (const auto& name : moe::bench::golden_model_names())
    for (QuantFormat format :
         {QuantFormat::kNone, QuantFormat::kFp8Block, QuantFormat::kMxfp8, QuantFormat::kNvfp4, QuantFormat::kMxfp4}) {
      auto r = moe::bench::measure_quant_accuracy(golden_root, name, format, work.string(), pool);
      if (!r) {
        std::fprintf(stderr, "%s %s: %s\n", name.c_str(), std::string(moe::ops::quant_format_name(format)).c_str(),
                     r.status().to_string().c_str());
        status = 1;
        continue;
      }
      std::printf("| %s | %s | %.3g | %.3g | %.3g | %d/%d (%.1f%%) |\n", r->model.c_str(), r->format.c_str(),
                  r->max_abs_logit_error, r->max_relative_l2, r->max_abs_golden_logit, r->num_agree, r->num_positions,
                  100.0 * r->agreement());
    }
  fs::remove_all(work);
  return status;
}
