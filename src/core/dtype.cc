#include "core/dtype.h"

#include <array>
#include <cmath>
#include <limits>

#include "core/check.h"

namespace moe {
namespace {

// A small binary float format: sign, `exponent_bits`, `mantissa_bits`, `bias`.
// has_inf: the top exponent is Inf/NaN (IEEE style); otherwise the top exponent
// holds normal numbers and `nan_code` (if any) marks NaN.
struct MiniFloat {
  int exponent_bits;
  int mantissa_bits;
  int bias;
  bool has_inf;
  int nan_magnitude;  // code without sign that means NaN, or -1 when none
};

constexpr MiniFloat kF16Format{5, 10, 15, true, 0x7e00};
constexpr MiniFloat kE4M3Format{4, 3, 7, false, 0x7f};
constexpr MiniFloat kE5M2Format{5, 2, 15, true, 0x7e};
constexpr MiniFloat kE2M1Format{2, 1, 1, false, -1};

double decode_minifloat(const MiniFloat& fmt, uint32_t code) {
  const int total_bits = 1 + fmt.exponent_bits + fmt.mantissa_bits;
  const uint32_t sign = (code >> (total_bits - 1)) & 1u;
  const uint32_t magnitude = code & ((1u << (total_bits - 1)) - 1u);
  const uint32_t exponent = magnitude >> fmt.mantissa_bits;
  const uint32_t mantissa = magnitude & ((1u << fmt.mantissa_bits) - 1u);
  const uint32_t max_exponent = (1u << fmt.exponent_bits) - 1u;
  double value;
  if (fmt.has_inf && exponent == max_exponent) {
    value = mantissa == 0 ? std::numeric_limits<double>::infinity()
                          : std::numeric_limits<double>::quiet_NaN();
  } else if (!fmt.has_inf && fmt.nan_magnitude >= 0 &&
             magnitude == static_cast<uint32_t>(fmt.nan_magnitude)) {
    value = std::numeric_limits<double>::quiet_NaN();
  } else if (exponent == 0) {  // zero and subnormals
    value = std::ldexp(static_cast<double>(mantissa), 1 - fmt.bias - fmt.mantissa_bits);
  } else {
    value = std::ldexp(static_cast<double>(mantissa + (1u << fmt.mantissa_bits)),
                       static_cast<int>(exponent) - fmt.bias - fmt.mantissa_bits);
  }
  return sign ? -value : value;
}

// The largest finite magnitude code: below Inf (IEEE style), below the NaN
// code, or all ones when the format has neither.
constexpr uint32_t max_finite_magnitude(const MiniFloat& fmt) {
  if (fmt.has_inf) return (((1u << fmt.exponent_bits) - 1u) << fmt.mantissa_bits) - 1u;
  if (fmt.nan_magnitude >= 0) return static_cast<uint32_t>(fmt.nan_magnitude) - 1u;
  return (1u << (fmt.exponent_bits + fmt.mantissa_bits)) - 1u;
}

// Rounds |f| to the format's grid (nearest, ties to even), then packs the bits,
// in integer arithmetic on f's bits (the quantizers call it per element).
// Where |f| is at least the format's smallest normal, the float's mantissa is
// rounded from 23 bits to M in place: adding half a unit of the kept LSB, less
// one unless that LSB is odd, carries into the exponent when the mantissa
// rounds up to the next binade; moving the exponent from bias 127 to the
// format's is then one subtraction. Below it the grid is the multiples of the
// smallest subnormal, 2^(1 - bias - M): |f| times 2^(bias - 1 + M) is exact in
// float and nearbyint rounds it, ties to even (the default rounding mode).
template <const MiniFloat& kFmt>
uint32_t encode_minifloat(float f, Overflow overflow) {
  constexpr int kShift = 23 - kFmt.mantissa_bits;
  constexpr uint32_t kSignBit = 1u << (kFmt.exponent_bits + kFmt.mantissa_bits);
  constexpr uint32_t kInfMagnitude = ((1u << kFmt.exponent_bits) - 1u) << kFmt.mantissa_bits;
  constexpr uint32_t kMaxFinite = max_finite_magnitude(kFmt);
  constexpr uint32_t kMinNormalBits = static_cast<uint32_t>(127 + 1 - kFmt.bias) << 23;  // 2^(1 - bias)
  constexpr uint32_t kRebias = static_cast<uint32_t>(127 - kFmt.bias) << kFmt.mantissa_bits;
  constexpr float kSubnormalsPerUnit = static_cast<float>(1u << (kFmt.bias - 1 + kFmt.mantissa_bits));
  const uint32_t bits = float_to_bits(f);
  const uint32_t sign = (bits >> 31) != 0 ? kSignBit : 0u;
  const uint32_t a = bits & 0x7fffffffu;
  if (a > 0x7f800000u) {  // NaN
    if (kFmt.has_inf) return sign | kInfMagnitude | (1u << (kFmt.mantissa_bits - 1));
    if (kFmt.nan_magnitude >= 0) return sign | static_cast<uint32_t>(kFmt.nan_magnitude);
    return kMaxFinite;  // no NaN in the format: +max whatever the sign (dtype.h, CUDA's fp4 conversion)
  }
  uint32_t magnitude;
  if (a < kMinNormalBits) {
    magnitude = static_cast<uint32_t>(std::nearbyint(bits_to_float(a) * kSubnormalsPerUnit));
  } else {
    const uint32_t rounded = a + ((1u << (kShift - 1)) - 1u) + ((a >> kShift) & 1u);
    magnitude = (rounded >> kShift) - kRebias;  // Inf lands past kMaxFinite too
  }
  if (magnitude > kMaxFinite) {
    if (overflow == Overflow::kNonFinite) {
      if (kFmt.has_inf) return sign | kInfMagnitude;
      if (kFmt.nan_magnitude >= 0) return sign | static_cast<uint32_t>(kFmt.nan_magnitude);
    }
    magnitude = kMaxFinite;
  }
  return sign | magnitude;
}

template <int N>
std::array<float, N> make_table(const MiniFloat& fmt) {
  std::array<float, N> table{};
  for (int code = 0; code < N; ++code) table[code] = static_cast<float>(decode_minifloat(fmt, code));
  return table;
}

const std::array<float, 256>& e4m3_table() {
  static const auto table = make_table<256>(kE4M3Format);
  return table;
}
const std::array<float, 256>& e5m2_table() {
  static const auto table = make_table<256>(kE5M2Format);
  return table;
}

struct DTypeInfo {
  DType dtype;
  int bits;
  std::string_view name;
  std::string_view safetensors_name;
  bool is_float;
};

constexpr DTypeInfo kDTypes[] = {
    {DType::kF32, 32, "f32", "F32", true},        {DType::kF64, 64, "f64", "F64", true},
    {DType::kF16, 16, "f16", "F16", true},        {DType::kBF16, 16, "bf16", "BF16", true},
    {DType::kF8E4M3, 8, "f8e4m3", "F8_E4M3", true}, {DType::kF8E5M2, 8, "f8e5m2", "F8_E5M2", true},
    {DType::kE8M0, 8, "e8m0", "F8_E8M0", true},   {DType::kF4E2M1, 4, "f4e2m1", "F4", true},
    {DType::kI8, 8, "i8", "I8", false},           {DType::kU8, 8, "u8", "U8", false},
    {DType::kI16, 16, "i16", "I16", false},       {DType::kI32, 32, "i32", "I32", false},
    {DType::kI64, 64, "i64", "I64", false},       {DType::kBool, 8, "bool", "BOOL", false},
};

const DTypeInfo& info(DType dtype) {
  for (const auto& entry : kDTypes)
    if (entry.dtype == dtype) return entry;
  CHECK(false, "unknown dtype {}", static_cast<int>(dtype));
  __builtin_unreachable();
}

}  // namespace

int dtype_bits(DType dtype) { return info(dtype).bits; }
size_t dtype_bytes(DType dtype, int64_t num_elements) {
  return (static_cast<size_t>(num_elements) * static_cast<size_t>(dtype_bits(dtype)) + 7) / 8;
}
std::string_view dtype_name(DType dtype) { return info(dtype).name; }
std::string_view safetensors_dtype_name(DType dtype) { return info(dtype).safetensors_name; }
bool dtype_is_float(DType dtype) { return info(dtype).is_float; }

Expected<DType> dtype_from_name(std::string_view name) {
  for (const auto& entry : kDTypes)
    if (entry.name == name) return entry.dtype;
  return invalid_argument("unknown dtype '{}'", name);
}

Expected<DType> dtype_from_safetensors_name(std::string_view name) {
  for (const auto& entry : kDTypes)
    if (entry.safetensors_name == name) return entry.dtype;
  if (name == "F8_E4M3FN") return DType::kF8E4M3;
  if (name == "F4_E2M1") return DType::kF4E2M1;
  return invalid_argument("unsupported safetensors dtype '{}'", name);
}

float f16_to_float(uint16_t bits) { return static_cast<float>(decode_minifloat(kF16Format, bits)); }
uint16_t float_to_f16(float f) {
  return static_cast<uint16_t>(encode_minifloat<kF16Format>(f, Overflow::kNonFinite));
}

float e4m3_to_float(uint8_t code) { return e4m3_table()[code]; }
uint8_t float_to_e4m3(float f, Overflow overflow) {
  return static_cast<uint8_t>(encode_minifloat<kE4M3Format>(f, overflow));
}
float e5m2_to_float(uint8_t code) { return e5m2_table()[code]; }
uint8_t float_to_e5m2(float f, Overflow overflow) {
  return static_cast<uint8_t>(encode_minifloat<kE5M2Format>(f, overflow));
}

float e8m0_to_float(uint8_t code) {
  if (code == 255) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, static_cast<int>(code) - 127);
}

uint8_t float_to_e8m0_ceil(float f) {
  // +Inf is tested here, not left to frexp, whose exponent for Inf is unspecified.
  if (std::isnan(f) || f > 0x1p127f) return 255;
  if (!(f > 0x1p-127f)) return 0;
  int exponent;
  const float mantissa = std::frexp(f, &exponent);  // f = mantissa * 2^exponent, mantissa in [0.5, 1)
  const int e = (mantissa == 0.5f) ? exponent - 1 : exponent;  // ceil(log2 f), in [-126, 127]
  return static_cast<uint8_t>(e + 127);
}

float e2m1_to_float(uint8_t nibble) {
  return static_cast<float>(decode_minifloat(kE2M1Format, nibble & 0xfu));
}
uint8_t float_to_e2m1(float f) {
  return static_cast<uint8_t>(encode_minifloat<kE2M1Format>(f, Overflow::kSaturate));
}

float load_as_float(DType dtype, const void* data, int64_t i) {
  const auto* bytes = static_cast<const uint8_t*>(data);
  switch (dtype) {
    case DType::kF32: return static_cast<const float*>(data)[i];
    case DType::kF64: return static_cast<float>(static_cast<const double*>(data)[i]);
    case DType::kF16: return f16_to_float(static_cast<const uint16_t*>(data)[i]);
    case DType::kBF16: return bf16_to_float(static_cast<const uint16_t*>(data)[i]);
    case DType::kF8E4M3: return e4m3_to_float(bytes[i]);
    case DType::kF8E5M2: return e5m2_to_float(bytes[i]);
    case DType::kE8M0: return e8m0_to_float(bytes[i]);
    case DType::kF4E2M1: return e2m1_to_float(e2m1_get(bytes, i));
    default: CHECK(false, "load_as_float on non-float dtype {}", dtype_name(dtype));
  }
  __builtin_unreachable();
}

void store_from_float(DType dtype, void* data, int64_t i, float value) {
  auto* bytes = static_cast<uint8_t*>(data);
  switch (dtype) {
    case DType::kF32: static_cast<float*>(data)[i] = value; return;
    case DType::kF64: static_cast<double*>(data)[i] = value; return;
    case DType::kF16: static_cast<uint16_t*>(data)[i] = float_to_f16(value); return;
    case DType::kBF16: static_cast<uint16_t*>(data)[i] = float_to_bf16(value); return;
    case DType::kF8E4M3: bytes[i] = float_to_e4m3(value); return;
    case DType::kF8E5M2: bytes[i] = float_to_e5m2(value); return;
    case DType::kE8M0: bytes[i] = float_to_e8m0_ceil(value); return;
    case DType::kF4E2M1: e2m1_set(bytes, i, float_to_e2m1(value)); return;
    default: CHECK(false, "store_from_float on non-float dtype {}", dtype_name(dtype));
  }
}

}  // namespace moe
