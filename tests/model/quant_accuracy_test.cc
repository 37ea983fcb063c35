// The accuracy cost of each quantized format on the golden models, against
// transformers' outputs from the bf16 weights (bench/quant_accuracy.h defines
// the metrics; bench/quant_accuracy prints the table).
//
// Bounds. One quantized projection (weights, and activations for the fp8
// formats) moves its output by a relative rms error of ~4% for fp8-block and
// mxfp8 (at most 4.5%) and ~10-11% for nvfp4 and mxfp4 (at most 12.8%), as
// bench/quant_accuracy measures on moe_basic's own weights (E4M3 keeps 3
// mantissa bits, E2M1 one). A token's logits pass
// through 7 quantized projections per layer (q, k, v, o, gate, up, down), 2 to
// 4 layers here; independent errors add in quadrature, so the logits' relative
// L2 error should be about sqrt(14..28) times the per-op error: ~0.15-0.2 for
// fp8, ~0.4-0.6 for fp4. Measured maxima over the models
// (bench/results/2026-11-30_quant_accuracy.md): 0.20 (fp8-block), 0.14
// (mxfp8), 0.36 (nvfp4), 0.43 (mxfp4). The bounds (0.3 for fp8, 0.7 for fp4)
// sit ~1.5x above the largest measurement, and fp8's is ~2.3x tighter than
// fp4's, as the per-op errors are. A broken layout (swapped gate/up halves, a
// wrong scale block, a misread nibble) gives relative errors of order 1.
// Greedy agreement is teacher-forced (bench/quant_accuracy.h). The golden
// prompts were chosen with top-1/top-2 margins of only >= 1e-3 (so that
// float32 noise cannot flip them), so quantization noise flips many: measured
// minima 75% (fp8) and 47% (fp4); bounds 60% and 35%.
//
// Run time: the test uses the first five golden prompts (1 to 33 tokens, 24
// to 56 with the continuation) and checks the unquantized harness on one
// model only, so that it stays fast under ASan; bench/quant_accuracy prints
// the full table over all six prompts.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>

#include "bench/quant_accuracy.h"

namespace moe::bench {
namespace {

using ops::QuantFormat;

struct Bound {
  QuantFormat format;
  double max_relative_l2;
  double min_agreement;
};

TEST(QuantAccuracy, GoldenModelsStayWithinTheFormatBounds) {
  namespace fs = std::filesystem;
  const fs::path work = fs::temp_directory_path() / ("moe_quant_accuracy_test_" + std::to_string(::getpid()));
  const std::string golden_root = std::string(MOE_SOURCE_DIR) + "/tests/data/golden";
  ThreadPool pool(2);
  const Bound bounds[] = {
      {QuantFormat::kNone, 1e-4, 1.0},  // the harness itself: the golden tolerance
      {QuantFormat::kFp8Block, 0.3, 0.60},
      {QuantFormat::kMxfp8, 0.3, 0.60},
      {QuantFormat::kNvfp4, 0.7, 0.35},
      {QuantFormat::kMxfp4, 0.7, 0.35},
  };
  for (const auto& name : golden_model_names())
    for (const Bound& bound : bounds) {
      if (bound.format == QuantFormat::kNone && name != "moe_basic") continue;
      auto r = measure_quant_accuracy(golden_root, name, bound.format, work.string(), pool, /*max_prompts=*/5);
      ASSERT_TRUE(r.has_value()) << name << ": " << r.status().to_string();
      std::printf("| %s | %s | %.3g | %.3g | %d/%d |\n", name.c_str(), r->format.c_str(), r->max_abs_logit_error,
                  r->max_relative_l2, r->num_agree, r->num_positions);
      EXPECT_LT(r->max_relative_l2, bound.max_relative_l2) << name << " " << r->format;
      EXPECT_GE(r->agreement(), bound.min_agreement) << name << " " << r->format;
    }
  fs::remove_all(work);
}

}  // namespace
}  // namespace moe::bench
