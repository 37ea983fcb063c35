// The quantized formats (ops/quant.h) against their definitions.
//
// Oracles: the scale rules written out independently here (amax / 448; the
// OCP MX exponent found by a search over powers of two instead of frexp; the
// nvfp4 two-level rule), and "nearest element" checked by brute force over
// every code of the element format. Error bounds follow from the formats:
// an element in the normal range is off by at most half an ulp, 2^-(m+1)
// relative (m mantissa bits: 3 for E4M3, 1 for E2M1); a subnormal one by half
// the subnormal step (2^-10 for E4M3, 0.25 for E2M1), times the block scale.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include <fmt/format.h>

#include "core/dtype.h"
#include "ops/linear.h"
#include "ops/quant.h"

namespace moe::ops {
namespace {

constexpr QuantFormat kAllFormats[] = {QuantFormat::kFp8Block, QuantFormat::kMxfp8, QuantFormat::kNvfp4,
                                       QuantFormat::kMxfp4};

// Storage for one matrix, allocated from the format's shapes.
struct Quantized {
  Tensor values, scales, global;
  QuantizedTensor view;
  Quantized(QuantFormat format, int64_t rows, int64_t cols, int64_t period = 0) {
    const QuantFormatSpec& spec = quant_format_spec(format);
    values = Tensor(spec.element, {rows, cols});
    scales = Tensor(spec.scale, quant_scale_shape(format, rows, cols, period));
    if (spec.has_global_scale) global = Tensor(DType::kF32, {1});
    view = {format, values.view(), scales.view(), global.view(), format == QuantFormat::kFp8Block ? period : 0};
  }
};

std::vector<float> random_matrix(int64_t rows, int64_t cols, uint32_t seed, float stddev = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, stddev);
  std::vector<float> m(static_cast<size_t>(rows * cols));
  for (float& v : m) v = normal(rng);
  return m;
}

Quantized quantize(QuantFormat format, const std::vector<float>& src, int64_t rows, int64_t cols,
                   int64_t period = 0) {
  Quantized q(format, rows, cols, period);
  if (!q.global.empty()) q.global.data_as<float>()[0] = nvfp4_global_scale(max_abs(src.data(), rows * cols));
  quantize_matrix(src.data(), q.view);
  return q;
}

std::vector<float> dequantize(const QuantizedTensor& q) {
  std::vector<float> out(static_cast<size_t>(q.rows() * q.cols()));
  dequantize_rows(q, 0, q.rows(), out.data());
  return out;
}

float element_value(DType element, int code) {
  return element == DType::kF8E4M3 ? e4m3_to_float(static_cast<uint8_t>(code))
                                   : e2m1_to_float(static_cast<uint8_t>(code));
}

// The distance from x to the nearest finite value of the element format.
double nearest_distance(DType element, double x) {
  double best = INFINITY;
  for (int code = 0; code < (element == DType::kF8E4M3 ? 256 : 16); ++code) {
    const float v = element_value(element, code);
    if (std::isfinite(v)) best = std::min(best, std::fabs(v - x));
  }
  return best;
}

// 2^e with e the largest integer such that 2^e <= x (x > 0): a linear search.
int floor_log2_by_search(float x) {
  int e = -150;
  while (std::ldexp(1.0, e + 1) <= x) ++e;
  return e;
}

// The block scale (times the global one) that covers element (r, c).
double block_scale(const QuantizedTensor& q, int64_t r, int64_t c) {
  const QuantFormatSpec& spec = quant_format_spec(q.format);
  const int64_t scale_cols = q.scales.dim(1);
  if (q.format == QuantFormat::kFp8Block) {
    const int64_t period = q.scale_row_period > 0 ? q.scale_row_period : q.rows();
    const int64_t block_row = (r / period) * ((period + 127) / 128) + (r % period) / 128;
    return q.scales.data_as<float>()[block_row * scale_cols + c / 128];
  }
  const uint8_t code = q.scales.data_as<uint8_t>()[r * scale_cols + c / spec.block_cols];
  if (spec.scale == DType::kE8M0) return std::ldexp(1.0, code - 127);
  return static_cast<double>(e4m3_to_float(code)) * q.global_scale.data_as<float>()[0];
}

// Every element is the nearest element-format value to v / S (or the saturated
// maximum beyond it), and within the format's error bound.
void expect_nearest_elements(const QuantizedTensor& q, const std::vector<float>& src) {
  const QuantFormatSpec& spec = quant_format_spec(q.format);
  const std::vector<float> deq = dequantize(q);
  const double half_subnormal = spec.element == DType::kF8E4M3 ? std::ldexp(1.0, -10) : 0.25;
  const double relative_half_ulp = spec.element == DType::kF8E4M3 ? 1.0 / 16 : 1.0 / 4;
  const double min_normal = spec.element == DType::kF8E4M3 ? std::ldexp(1.0, -6) : 1.0;
  for (int64_t r = 0; r < q.rows(); ++r)
    for (int64_t c = 0; c < q.cols(); ++c) {
      const size_t i = static_cast<size_t>(r * q.cols() + c);
      const double scale = block_scale(q, r, c);
      const double x = src[i] / scale, element = deq[i] / scale;
      if (std::fabs(x) >= spec.element_max) {
        ASSERT_NEAR(std::fabs(element), spec.element_max, 1e-6 * spec.element_max)
            << "saturates at (" << r << ", " << c << ")";
        continue;
      }
      // Nearest: no element value is closer (1e-6 slack for the f32 division).
      ASSERT_LE(std::fabs(element - x), nearest_distance(spec.element, x) + 1e-6 * std::fabs(x) + 1e-30)
          << quant_format_name(q.format) << " at (" << r << ", " << c << ") x=" << x << " got " << element;
      const double bound = std::fabs(x) >= min_normal ? relative_half_ulp * std::fabs(x) : half_subnormal;
      ASSERT_LE(std::fabs(element - x), bound * (1 + 1e-6)) << "error bound at (" << r << ", " << c << ")";
    }
}

TEST(QuantFormat, NamesRoundTrip) {
  for (QuantFormat f : kAllFormats) EXPECT_EQ(*quant_format_from_name(quant_format_name(f)), f);
  EXPECT_FALSE(quant_format_from_name("fp8").has_value());
}

TEST(QuantFormat, ElementsAreNearestAndWithinHalfUlp) {
  // 130 x 200: partial blocks along both N (fp8-block) and K (every format).
  for (QuantFormat f : kAllFormats) {
    const auto src = random_matrix(130, 200, 7, 0.02f);
    Quantized q = quantize(f, src, 130, 200);
    SCOPED_TRACE(std::string(quant_format_name(f)));
    expect_nearest_elements(q.view, src);
  }
}

TEST(QuantFormat, Fp8BlockScaleIsBlockAmaxOver448) {
  const int64_t rows = 130, cols = 200;
  const auto src = random_matrix(rows, cols, 3);
  Quantized q = quantize(QuantFormat::kFp8Block, src, rows, cols);
  ASSERT_EQ(q.scales.shape(), (Shape{2, 2}));
  for (int64_t br = 0; br < 2; ++br)
    for (int64_t bc = 0; bc < 2; ++bc) {
      float amax = 0;
      for (int64_t r = br * 128; r < std::min<int64_t>(rows, br * 128 + 128); ++r)
        for (int64_t c = bc * 128; c < std::min<int64_t>(cols, bc * 128 + 128); ++c)
          amax = std::max(amax, std::fabs(src[r * cols + c]));
      EXPECT_EQ(q.scales.data_as<float>()[br * 2 + bc], amax / 448.0f) << br << "," << bc;
    }
}

TEST(QuantFormat, MxScaleFollowsTheOcpRule) {
  for (QuantFormat f : {QuantFormat::kMxfp8, QuantFormat::kMxfp4}) {
    const int emax = f == QuantFormat::kMxfp8 ? 8 : 2;
    const int64_t rows = 9, cols = 70;  // 3 blocks per row, the last one of 6
    auto src = random_matrix(rows, cols, 11);
    for (int64_t c = 0; c < cols; ++c) src[2 * cols + c] *= 1e-30f;  // tiny scales
    for (int64_t c = 0; c < cols; ++c) src[3 * cols + c] *= 1e20f;   // huge ones
    Quantized q = quantize(f, src, rows, cols);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b < 3; ++b) {
        float amax = 0;
        for (int64_t c = b * 32; c < std::min<int64_t>(cols, b * 32 + 32); ++c)
          amax = std::max(amax, std::fabs(src[r * cols + c]));
        const int expected = std::clamp(floor_log2_by_search(amax) - emax, -127, 127) + 127;
        EXPECT_EQ(q.scales.data_as<uint8_t>()[r * 3 + b], expected) << quant_format_name(f) << " row " << r;
      }
    expect_nearest_elements(q.view, src);
  }
}

TEST(QuantFormat, HandMadeBlocksGiveKnownScalesAndExactValues) {
  // MXFP8: amax 3 -> floor(log2 3) - 8 = -7 -> code 120; every value below is
  // a multiple of 2^-7 * 2^-6 that E4M3 holds, so the round trip is exact.
  std::vector<float> block(32, 0.0f);
  block[0] = 3.0f, block[1] = -1.5f, block[2] = 0.25f, block[3] = std::ldexp(1.0f, -13);
  Quantized mx8 = quantize(QuantFormat::kMxfp8, block, 1, 32);
  EXPECT_EQ(mx8.scales.data_as<uint8_t>()[0], 120);
  EXPECT_EQ(dequantize(mx8.view), block);
  // MXFP4: amax 0.75 -> floor(log2 0.75) - 2 = -3 -> code 124, 0.75 = 6 * 2^-3.
  std::vector<float> fp4(32, 0.0f);
  fp4[0] = 0.75f, fp4[5] = -0.5f, fp4[6] = 0.0625f, fp4[31] = 0.375f;
  Quantized mx4 = quantize(QuantFormat::kMxfp4, fp4, 1, 32);
  EXPECT_EQ(mx4.scales.data_as<uint8_t>()[0], 124);
  EXPECT_EQ(dequantize(mx4.view), fp4);
  // OCP saturation: amax 7 -> X = 1 (floor rule), 7 clamps to 6.
  fp4[0] = 7.0f;
  Quantized sat = quantize(QuantFormat::kMxfp4, fp4, 1, 32);
  EXPECT_EQ(sat.scales.data_as<uint8_t>()[0], 127);
  EXPECT_EQ(dequantize(sat.view)[0], 6.0f);
  // fp8-block: amax 448 * 2^-4 -> scale 2^-4 exactly; E4M3 values times it are exact.
  std::vector<float> fp8(128 * 128, 0.0f);
  fp8[0] = 28.0f, fp8[129] = -0.5f, fp8[1000] = std::ldexp(1.0f, -13);
  Quantized blk = quantize(QuantFormat::kFp8Block, fp8, 128, 128);
  EXPECT_EQ(blk.scales.data_as<float>()[0], 1.0f / 16);
  EXPECT_EQ(dequantize(blk.view), fp8);
  // NVFP4: g = 6 / 2688; the block's scale is e4m3(1 / g) = 448, so 6 comes back.
  std::vector<float> nv(16, 0.0f);
  nv[0] = 6.0f, nv[1] = 3.0f, nv[2] = -0.5f;
  Quantized n4 = quantize(QuantFormat::kNvfp4, nv, 1, 16);
  EXPECT_EQ(n4.global.data_as<float>()[0], 6.0f / 2688.0f);
  EXPECT_EQ(e4m3_to_float(n4.scales.data_as<uint8_t>()[0]), 448.0f);
  const auto back = dequantize(n4.view);
  for (int i = 0; i < 16; ++i) EXPECT_NEAR(back[i], nv[i], 1e-6f) << i;
}

TEST(QuantFormat, Nvfp4BlockScalesUseTheGlobalScale) {
  const auto src = random_matrix(6, 64, 5, 0.03f);
  Quantized q = quantize(QuantFormat::kNvfp4, src, 6, 64);
  const float g = q.global.data_as<float>()[0];
  EXPECT_EQ(g, max_abs(src.data(), 6 * 64) / (448.0f * 6.0f));
  for (int64_t r = 0; r < 6; ++r)
    for (int64_t b = 0; b < 4; ++b) {
      const float amax = max_abs(src.data() + r * 64 + b * 16, 16);
      EXPECT_EQ(q.scales.data_as<uint8_t>()[r * 4 + b], float_to_e4m3(amax / 6.0f / g));
    }
  expect_nearest_elements(q.view, src);
}

TEST(QuantFormat, ZeroBlocksStayZero) {
  const std::vector<float> zeros(130 * 64, 0.0f);
  for (QuantFormat f : kAllFormats) {
    Quantized q = quantize(f, zeros, 130, 64);
    EXPECT_EQ(dequantize(q.view), zeros) << quant_format_name(f);
  }
  Quantized blk = quantize(QuantFormat::kFp8Block, zeros, 130, 64);
  EXPECT_EQ(blk.scales.data_as<float>()[0], 1.0f);
}

TEST(QuantFormat, OddShapesPolicy) {
  // fp4 packs pairs along K: an odd K is refused.
  EXPECT_EQ(check_quantizable(QuantFormat::kNvfp4, 4, 33).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(check_quantizable(QuantFormat::kMxfp4, 4, 33).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(check_quantizable(QuantFormat::kMxfp4, 4, 34).is_ok());
  // Partial blocks are stored with ceil-sized scales and zero-padded semantics.
  EXPECT_EQ(quant_scale_shape(QuantFormat::kFp8Block, 130, 33), (Shape{2, 1}));
  EXPECT_EQ(quant_scale_shape(QuantFormat::kMxfp8, 3, 33), (Shape{3, 2}));
  EXPECT_EQ(quant_scale_shape(QuantFormat::kNvfp4, 3, 34), (Shape{3, 3}));
  for (QuantFormat f : {QuantFormat::kFp8Block, QuantFormat::kMxfp8}) {
    const auto src = random_matrix(5, 33, 2);
    Quantized q = quantize(f, src, 5, 33);
    expect_nearest_elements(q.view, src);
    // The partial block's scale is the one of the same values zero-padded.
    std::vector<float> padded(5 * 160, 0.0f);
    for (int r = 0; r < 5; ++r) std::copy_n(&src[r * 33], 33, &padded[r * 160]);
    Quantized p = quantize(f, padded, 5, 160);
    const int64_t last = q.scales.dim(1) - 1;
    EXPECT_EQ(std::memcmp(q.scales.view().slice0(0).data_as<uint8_t>() + last * dtype_bytes(q.scales.dtype(), 1),
                          p.scales.view().slice0(0).data_as<uint8_t>() + last * dtype_bytes(p.scales.dtype(), 1),
                          dtype_bytes(q.scales.dtype(), 1)),
              0)
        << quant_format_name(f);
  }
}

TEST(QuantFormat, FusedHalvesKeepTheirOwnFp8Blocks) {
  // w13 with inter = 48: quantizing the fused [96, K] with period 48 equals
  // quantizing gate and up alone.
  const int64_t inter = 48, cols = 160;
  const auto fused = random_matrix(2 * inter, cols, 9);
  Quantized q = quantize(QuantFormat::kFp8Block, fused, 2 * inter, cols, inter);
  ASSERT_EQ(q.scales.shape(), (Shape{2, 2}));
  for (int half = 0; half < 2; ++half) {
    std::vector<float> part(fused.begin() + half * inter * cols, fused.begin() + (half + 1) * inter * cols);
    Quantized alone = quantize(QuantFormat::kFp8Block, part, inter, cols);
    EXPECT_EQ(std::memcmp(alone.values.data(), q.values.data_as<uint8_t>() + half * inter * cols, inter * cols), 0);
    EXPECT_EQ(alone.scales.data_as<float>()[0], q.scales.data_as<float>()[half * 2]);
    EXPECT_EQ(alone.scales.data_as<float>()[1], q.scales.data_as<float>()[half * 2 + 1]);
  }
}

// quantize_rows over row ranges, last range first, writes what quantize_matrix
// does: the threads of the converter quantize such ranges of one matrix.
TEST(QuantFormat, RowRangesInAnyOrderEqualTheWholeMatrix) {
  struct Case {
    int64_t rows, cols, period;
    std::vector<int64_t> range_starts;  // ascending; the last range ends at rows
  };
  // fp8-block ranges are whole block rows: 128-row blocks, restarting at each period.
  const Case cases[] = {{300, 200, 0, {0, 128, 256}}, {300, 200, 150, {0, 150, 278}}, {7, 34, 0, {0}}};
  for (QuantFormat f : kAllFormats) {
    for (const Case& c : cases) {
      SCOPED_TRACE(fmt::format("{} [{}, {}] period {}", quant_format_name(f), c.rows, c.cols, c.period));
      const int64_t period = f == QuantFormat::kFp8Block ? c.period : 0;
      auto src = random_matrix(c.rows, c.cols, 21);
      src[5 * c.cols + 3] = 40.0f;  // one block with a larger amax
      Quantized whole = quantize(f, src, c.rows, c.cols, period);
      Quantized parts(f, c.rows, c.cols, period);
      if (!parts.global.empty()) parts.global.data_as<float>()[0] = whole.global.data_as<float>()[0];
      for (size_t i = c.range_starts.size(); i-- > 0;) {
        const int64_t first = c.range_starts[i];
        const int64_t end = i + 1 < c.range_starts.size() ? c.range_starts[i + 1] : c.rows;
        quantize_rows(src.data() + first * c.cols, first, end - first, parts.view);
      }
      ASSERT_EQ(whole.values.num_bytes(), parts.values.num_bytes());
      EXPECT_EQ(std::memcmp(whole.values.data(), parts.values.data(), whole.values.num_bytes()), 0);
      EXPECT_EQ(std::memcmp(whole.scales.data(), parts.scales.data(), whole.scales.num_bytes()), 0);
    }
  }
}

TEST(QuantFormat, MaxAbsPropagatesNaN) {
  std::vector<float> x = {1.0f, -3.0f, 2.0f};
  EXPECT_EQ(max_abs(x.data(), 3), 3.0f);
  EXPECT_EQ(max_abs(x.data(), 0), 0.0f);
  for (size_t at = 0; at < x.size(); ++at) {
    std::vector<float> y = x;
    y[at] = std::nanf("");
    EXPECT_TRUE(std::isnan(max_abs(y.data(), 3))) << at;
  }
}

TEST(QuantFormat, StackSliceIsTheMatrix) {
  for (QuantFormat f : kAllFormats) {
    const QuantFormatSpec& spec = quant_format_spec(f);
    const int64_t groups = 3, rows = 8, cols = 48;
    const Shape s = quant_scale_shape(f, rows, cols);
    Tensor values(spec.element, {groups, rows, cols}), scales(spec.scale, {groups, s[0], s[1]}), global;
    if (spec.has_global_scale) global = Tensor(DType::kF32, {groups});
    QuantizedTensor stack{f, values.view(), scales.view(), global.view(), 0};
    check_quantized(stack);
    std::vector<std::vector<float>> mats;
    for (int g = 0; g < groups; ++g) {
      mats.push_back(random_matrix(rows, cols, 100 + g));
      QuantizedTensor m = stack.slice0(g);
      if (spec.has_global_scale) m.global_scale.data_as<float>()[0] = nvfp4_global_scale(max_abs(mats[g].data(), rows * cols));
      quantize_matrix(mats[g].data(), m);
    }
    for (int g = 0; g < groups; ++g)
      EXPECT_EQ(dequantize(stack.slice0(g)), dequantize(quantize(f, mats[g], rows, cols).view)) << g;
  }
}

TEST(QuantFormat, Fp8ActivationsAreQuantizedPer128Group) {
  const int64_t tokens = 3, cols = 300;  // groups of 128, 128, 44
  auto x = random_matrix(tokens, cols, 4);
  x[5] = 40.0f;  // one large value makes its group's scale coarse, not the others'
  auto fake = x;
  fake_quantize_activations(QuantFormat::kFp8Block, fake.data(), tokens, cols);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t g = 0; g * 128 < cols; ++g) {
      const int64_t c0 = g * 128, n = std::min<int64_t>(128, cols - c0);
      const double scale = std::max(max_abs(&x[t * cols + c0], n), 1e-10f) / 448.0f;
      for (int64_t c = c0; c < c0 + n; ++c) {
        const double xs = x[t * cols + c] / scale, fs = fake[t * cols + c] / scale;
        ASSERT_LE(std::fabs(fs - xs), nearest_distance(DType::kF8E4M3, xs) + 1e-6 * std::fabs(xs) + 1e-30) << c;
      }
    }
  // Weight-only formats leave activations alone.
  auto same = x;
  fake_quantize_activations(QuantFormat::kNvfp4, same.data(), tokens, cols);
  EXPECT_EQ(same, x);
}

TEST(QuantFormat, QuantizedLinearIsTheDequantizedProduct) {
  ThreadPool pool(2);
  const int64_t tokens = 5, in = 200, out = 37;
  const auto x = random_matrix(tokens, in, 21);
  const auto w = random_matrix(out, in, 22, 0.05f);
  for (QuantFormat f : kAllFormats) {
    Quantized q = quantize(f, w, out, in);
    const auto wd = dequantize(q.view);
    auto xq = x;
    fake_quantize_activations(f, xq.data(), tokens, in);
    Tensor y(DType::kF32, {tokens, out});
    cpu::quantized_linear(pool, TensorView(const_cast<float*>(x.data()), DType::kF32, {tokens, in}), q.view, y);
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t n = 0; n < out; ++n) {
        double ref = 0, norm = 0;
        for (int64_t k = 0; k < in; ++k) {
          ref += static_cast<double>(xq[t * in + k]) * wd[n * in + k];
          norm += std::fabs(static_cast<double>(xq[t * in + k]) * wd[n * in + k]);
        }
        EXPECT_NEAR(y.data_as<float>()[t * out + n], ref, 1e-5 * norm) << quant_format_name(f);
      }
  }
}

}  // namespace
}  // namespace moe::ops
