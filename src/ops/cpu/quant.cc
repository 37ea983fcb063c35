#include "ops/quant.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <vector>

#include "ops/linear.h"

namespace moe::ops {
namespace {

constexpr QuantFormatSpec kSpecs[] = {
    {DType::kF32, DType::kF32, 1, 1, false, 0.0f, 0},                     // kNone
    {DType::kF8E4M3, DType::kF32, 128, 128, false, kE4M3Max, 8},         // kFp8Block
    {DType::kF8E4M3, DType::kE8M0, 1, 32, false, kE4M3Max, 8},           // kMxfp8
    {DType::kF4E2M1, DType::kF8E4M3, 1, 16, true, kE2M1Max, 2},          // kNvfp4
    {DType::kF4E2M1, DType::kE8M0, 1, 32, false, kE2M1Max, 2},           // kMxfp4
};
constexpr std::string_view kNames[] = {"none", "fp8-block", "mxfp8", "nvfp4", "mxfp4"};

// Decode tables, built once (read-only afterwards).
const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) t[c] = e4m3_to_float(static_cast<uint8_t>(c));
    return t;
  }();
  return table;
}
const std::array<float, 16>& e2m1_table() {
  static const std::array<float, 16> table = [] {
    std::array<float, 16> t{};
    for (int c = 0; c < 16; ++c) t[c] = e2m1_to_float(static_cast<uint8_t>(c));
    return t;
  }();
  return table;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The OCP MX shared scale of a block whose largest magnitude is amax:
// E8M0 code of 2^(floor(log2 amax) - emax), clamped to [2^-127, 2^127];
// code 0 for an all-zero block, 255 (NaN) for a non-finite amax.
uint8_t mx_scale_code(float amax, int element_emax) {
  if (!std::isfinite(amax)) return 255;
  if (amax == 0.0f) return 0;
  int exponent = 0;
  std::frexp(amax, &exponent);  // amax = m * 2^exponent, m in [0.5, 1)
  const int shared = std::clamp(exponent - 1 - element_emax, -127, 127);
  return static_cast<uint8_t>(shared + 127);
}

uint8_t encode_element(DType element, float v) {
  return element == DType::kF8E4M3 ? float_to_e4m3(v, Overflow::kSaturate) : float_to_e2m1(v);
}

void store_element(DType element, void* values, int64_t i, uint8_t code) {
  if (element == DType::kF8E4M3) {
    static_cast<uint8_t*>(values)[i] = code;
  } else {
    e2m1_set(static_cast<uint8_t*>(values), i, code);
  }
}

// fp8-block: the first row and the row count of each block row.
struct BlockRow {
  int64_t first_row, num_rows;
};
std::vector<BlockRow> fp8_block_rows(int64_t rows, int64_t period) {
  std::vector<BlockRow> out;
  for (int64_t seg = 0; seg < rows; seg += period)
    for (int64_t r = seg; r < seg + period; r += 128) out.push_back({r, std::min<int64_t>(128, seg + period - r)});
  return out;
}

int64_t period_of(const QuantizedTensor& w) { return w.scale_row_period > 0 ? w.scale_row_period : w.rows(); }

// Rows [row_begin, row_begin + num_rows) from src (those rows): whole block rows.
void quantize_fp8_block(const float* src, int64_t row_begin, int64_t num_rows, const QuantizedTensor& out) {
  const int64_t cols = out.cols(), num_block_cols = ceil_div(cols, 128);
  auto* values = out.values.data_as<uint8_t>();
  auto* scales = out.scales.data_as<float>();
  const auto block_rows = fp8_block_rows(out.rows(), period_of(out));
  int64_t covered = 0;
  for (size_t br = 0; br < block_rows.size(); ++br) {
    const auto [r0, nr] = block_rows[br];
    if (r0 < row_begin || r0 >= row_begin + num_rows) continue;
    covered += nr;
    const float* block_src = src + (r0 - row_begin) * cols;
    for (int64_t bc = 0; bc < num_block_cols; ++bc) {
      const int64_t c0 = bc * 128, nc = std::min<int64_t>(128, cols - c0);
      float amax = 0.0f;
      for (int64_t r = 0; r < nr; ++r) amax = std::max(amax, max_abs(block_src + r * cols + c0, nc));
      const float scale = amax > 0.0f ? amax / kE4M3Max : 1.0f;
      scales[static_cast<int64_t>(br) * num_block_cols + bc] = scale;
      for (int64_t r = 0; r < nr; ++r) {
        const float* from = block_src + r * cols + c0;
        uint8_t* to = values + (r0 + r) * cols + c0;
        for (int64_t c = 0; c < nc; ++c) to[c] = float_to_e4m3(from[c] / scale);
      }
    }
  }
  CHECK(covered == num_rows, "fp8-block rows [{}, +{}) are not whole 128-row blocks", row_begin, num_rows);
}

// mxfp8, nvfp4, mxfp4: 1 x block_cols blocks, one scale per block.
// Rows [row_begin, row_begin + num_rows) from src (those rows).
void quantize_row_blocks(const float* src, int64_t row_begin, int64_t num_rows, const QuantizedTensor& out) {
  const QuantFormatSpec& spec = quant_format_spec(out.format);
  const int64_t cols = out.cols(), bk = spec.block_cols, num_blocks = ceil_div(cols, bk);
  auto* scales = out.scales.data_as<uint8_t>();
  const float global = spec.has_global_scale ? out.global_scale.data_as<float>()[0] : 1.0f;
  for (int64_t r = row_begin; r < row_begin + num_rows; ++r) {
    for (int64_t b = 0; b < num_blocks; ++b) {
      const int64_t c0 = b * bk, nc = std::min(bk, cols - c0);
      const float* block = src + (r - row_begin) * cols + c0;
      const float amax = max_abs(block, nc);
      uint8_t scale_code;
      float nv_scale = 0.0f;    // nvfp4: s * g, the divisor (0: a block of zeros)
      float mx_inverse = 0.0f;  // mx: 1 / X = 2^-e, e in [-127, 127], exact in float
      if (spec.has_global_scale) {
        scale_code = float_to_e4m3(amax / spec.element_max / global);
        nv_scale = e4m3_to_float(scale_code) * global;
      } else {
        scale_code = mx_scale_code(amax, spec.element_emax);
        mx_inverse = std::ldexp(1.0f, 127 - static_cast<int>(scale_code));
      }
      scales[r * num_blocks + b] = scale_code;
      for (int64_t c = 0; c < nc; ++c) {
        // mx: times a power of two, the exact division by X (rounded as
        // ldexp would where it lands among float subnormals); nvfp4 divides
        // once by s * g.
        float scaled;
        if (spec.has_global_scale) {
          scaled = nv_scale > 0.0f ? block[c] / nv_scale : 0.0f;
        } else {
          scaled = scale_code == 255 ? NAN : block[c] * mx_inverse;
        }
        store_element(spec.element, out.values.data(), r * cols + c0 + c, encode_element(spec.element, scaled));
      }
    }
  }
}

// Quantizes then dequantizes n floats in place as one MX block with E4M3 elements.
void fake_quantize_mx_e4m3(float* x, int64_t n) {
  const uint8_t code = mx_scale_code(max_abs(x, n), 8);
  const int shared = static_cast<int>(code) - 127;
  for (int64_t i = 0; i < n; ++i) {
    const float element = e4m3_table()[float_to_e4m3(std::ldexp(x[i], -shared))];
    x[i] = code == 255 ? NAN : std::ldexp(element, shared);
  }
}

}  // namespace

const QuantFormatSpec& quant_format_spec(QuantFormat format) { return kSpecs[static_cast<int>(format)]; }

std::string_view quant_format_name(QuantFormat format) { return kNames[static_cast<int>(format)]; }

Expected<QuantFormat> quant_format_from_name(std::string_view name) {
  for (int i = 0; i < 5; ++i)
    if (kNames[i] == name) return static_cast<QuantFormat>(i);
  return invalid_argument("unknown quantization format '{}' (none, fp8-block, mxfp8, nvfp4, mxfp4)", name);
}

Status check_quantizable(QuantFormat format, int64_t rows, int64_t cols) {
  if (rows <= 0 || cols <= 0) return invalid_argument("cannot quantize an empty [{}, {}] matrix", rows, cols);
  if (quant_format_spec(format).element == DType::kF4E2M1 && cols % 2 != 0)
    return invalid_argument("{} packs two elements per byte along K: K = {} must be even", quant_format_name(format),
                            cols);
  return Status::ok();
}

Shape quant_scale_shape(QuantFormat format, int64_t rows, int64_t cols, int64_t row_period) {
  const QuantFormatSpec& spec = quant_format_spec(format);
  CHECK(format != QuantFormat::kNone, "quant_scale_shape of an unquantized format");
  const int64_t num_block_cols = ceil_div(cols, spec.block_cols);
  if (format != QuantFormat::kFp8Block) return {rows, num_block_cols};
  const int64_t period = row_period > 0 ? row_period : rows;
  CHECK(rows % period == 0, "{} rows are not whole periods of {}", rows, period);
  return {(rows / period) * ceil_div(period, 128), num_block_cols};
}

QuantizedTensor QuantizedTensor::slice_stack(int64_t begin, int64_t end) const {
  CHECK(rank() == 3 && 0 <= begin && begin <= end && end <= values.dim(0), "matrices [{}, {}) of a stack {}", begin,
        end, values.shape().to_string());
  QuantizedTensor out = *this;
  const int64_t n = rows(), k = cols();
  char* base = static_cast<char*>(values.data()) + dtype_bytes(values.dtype(), n * k) * static_cast<size_t>(begin);
  out.values = TensorView(base, values.dtype(), {end - begin, n, k}, values.device());
  out.scales = scales.rows(begin, end);
  if (!global_scale.empty()) out.global_scale = global_scale.rows(begin, end);
  return out;
}

QuantizedTensor QuantizedTensor::slice0(int64_t g) const {
  CHECK(rank() == 3 && g >= 0 && g < values.dim(0), "slice0({}) of a stack {}", g, values.shape().to_string());
  QuantizedTensor out = *this;
  const int64_t n = rows(), k = cols();
  char* base = static_cast<char*>(values.data()) + dtype_bytes(values.dtype(), n * k) * static_cast<size_t>(g);
  out.values = TensorView(base, values.dtype(), {n, k}, values.device());
  out.scales = scales.slice0(g);
  if (!global_scale.empty())
    out.global_scale = TensorView(global_scale.data_as<float>() + g, DType::kF32, {1}, global_scale.device());
  return out;
}

void check_quantized(const QuantizedTensor& w) {
  CHECK(w.format != QuantFormat::kNone, "check_quantized: no format");
  const QuantFormatSpec& spec = quant_format_spec(w.format);
  CHECK(w.rank() == 2 || w.rank() == 3, "quantized values {}", w.values.shape().to_string());
  CHECK(w.values.dtype() == spec.element && w.scales.dtype() == spec.scale, "{}: values {} scales {}",
        quant_format_name(w.format), dtype_name(w.values.dtype()), dtype_name(w.scales.dtype()));
  CHECK(check_quantizable(w.format, w.rows(), w.cols()).is_ok(), "{} [{}, {}]", quant_format_name(w.format), w.rows(),
        w.cols());
  const Shape per_matrix = quant_scale_shape(w.format, w.rows(), w.cols(), w.scale_row_period);
  const Shape expected = w.rank() == 2 ? per_matrix : Shape{w.values.dim(0), per_matrix[0], per_matrix[1]};
  CHECK(w.scales.shape() == expected, "{} scales {} for values {}, expected {}", quant_format_name(w.format),
        w.scales.shape().to_string(), w.values.shape().to_string(), expected.to_string());
  if (spec.has_global_scale) {
    const int64_t groups = w.rank() == 2 ? 1 : w.values.dim(0);
    CHECK(w.global_scale.dtype() == DType::kF32 && w.global_scale.shape() == Shape{groups}, "global scale {}",
          w.global_scale.shape().to_string());
  } else {
    CHECK(w.global_scale.empty(), "{} has no global scale", quant_format_name(w.format));
  }
}

float nvfp4_global_scale(float amax) { return amax > 0.0f ? amax / (kE4M3Max * kE2M1Max) : 1.0f; }

float max_abs(const float* x, int64_t n) {
  // No early return at a NaN, so that the loop vectorizes.
  float m = 0.0f;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    nan |= a != a;
    m = a > m ? a : m;
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : m;
}

void quantize_rows(const float* src, int64_t row_begin, int64_t num_rows, const QuantizedTensor& out) {
  check_quantized(out);
  CHECK(out.rank() == 2, "quantize_rows wants one matrix");
  CHECK(row_begin >= 0 && num_rows >= 0 && row_begin + num_rows <= out.rows(), "quantize_rows [{}, +{}) of {}",
        row_begin, num_rows, out.values.shape().to_string());
  if (out.format == QuantFormat::kFp8Block) {
    quantize_fp8_block(src, row_begin, num_rows, out);
  } else {
    quantize_row_blocks(src, row_begin, num_rows, out);
  }
}

void quantize_matrix(const float* src, const QuantizedTensor& out) { quantize_rows(src, 0, out.rows(), out); }

void dequantize_rows(const QuantizedTensor& w, int64_t row_begin, int64_t num_rows, float* dst) {
  CHECK(w.rank() == 2 && row_begin >= 0 && num_rows >= 0 && row_begin + num_rows <= w.rows(),
        "dequantize_rows [{}, +{}) of {}", row_begin, num_rows, w.values.shape().to_string());
  const QuantFormatSpec& spec = quant_format_spec(w.format);
  const int64_t cols = w.cols(), bk = spec.block_cols, num_blocks = ceil_div(cols, bk);
  const auto& e4m3 = e4m3_table();
  const auto& e2m1 = e2m1_table();
  const auto* values = w.values.data_as<uint8_t>();
  const float global = spec.has_global_scale ? w.global_scale.data_as<float>()[0] : 1.0f;
  const int64_t period = period_of(w), blocks_per_period = ceil_div(period, 128);
  for (int64_t i = 0; i < num_rows; ++i) {
    const int64_t r = row_begin + i;
    float* out = dst + i * cols;
    for (int64_t b = 0; b < num_blocks; ++b) {
      float scale;
      if (w.format == QuantFormat::kFp8Block) {
        const int64_t block_row = (r / period) * blocks_per_period + (r % period) / 128;
        scale = w.scales.data_as<float>()[block_row * num_blocks + b];
      } else {
        const uint8_t code = w.scales.data_as<uint8_t>()[r * num_blocks + b];
        scale = (spec.scale == DType::kE8M0 ? e8m0_to_float(code) : e4m3[code]) * global;
      }
      const int64_t c_end = std::min(cols, (b + 1) * bk);
      if (spec.element == DType::kF8E4M3) {
        for (int64_t c = b * bk; c < c_end; ++c) out[c] = e4m3[values[r * cols + c]] * scale;
      } else {
        for (int64_t c = b * bk; c < c_end; ++c) out[c] = e2m1[e2m1_get(values, r * cols + c)] * scale;
      }
    }
  }
}

void fake_quantize_activations(QuantFormat weight_format, float* x, int64_t num_tokens, int64_t cols) {
  if (weight_format == QuantFormat::kFp8Block) {
    for (int64_t t = 0; t < num_tokens; ++t)
      for (int64_t c0 = 0; c0 < cols; c0 += 128) {
        float* group = x + t * cols + c0;
        const int64_t n = std::min<int64_t>(128, cols - c0);
        const float scale = std::max(max_abs(group, n), 1e-10f) / kE4M3Max;
        for (int64_t i = 0; i < n; ++i) group[i] = e4m3_table()[float_to_e4m3(group[i] / scale)] * scale;
      }
  } else if (weight_format == QuantFormat::kMxfp8) {
    for (int64_t t = 0; t < num_tokens; ++t)
      for (int64_t c0 = 0; c0 < cols; c0 += 32) fake_quantize_mx_e4m3(x + t * cols + c0, std::min<int64_t>(32, cols - c0));
  }
}

void cpu::quantized_linear(ThreadPool& pool, TensorView x, const QuantizedTensor& w, TensorView out) {
  check_quantized(w);
  CHECK(x.rank() == 2 && out.rank() == 2 && w.rank() == 2, "quantized_linear wants rank-2 x, w, out");
  const int64_t num_tokens = x.dim(0), in_features = x.dim(1), out_features = w.rows();
  CHECK(w.cols() == in_features, "quantized_linear: x {} vs w {}", x.shape().to_string(), w.values.shape().to_string());
  CHECK(out.dim(0) == num_tokens && out.dim(1) == out_features && x.dtype() == DType::kF32 &&
            out.dtype() == DType::kF32,
        "quantized_linear: out {}", out.shape().to_string());
  Tensor xq = Tensor::copy_of(x);
  fake_quantize_activations(w.format, xq.data_as<float>(), num_tokens, in_features);
  linear_rows(
      pool, xq.data_as<float>(), num_tokens, in_features, out_features,
      [&](int64_t first, int64_t count, float* dst) { dequantize_rows(w, first, count, dst); }, out.data_as<float>());
}

}  // namespace moe::ops
