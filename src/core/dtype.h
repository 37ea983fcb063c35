// Element types and their conversions to and from float.
//
// Every conversion to a narrow type rounds to nearest, ties to even, as the
// hardware converters do. NaN stays NaN where the format has one. Overflow is
// chosen by the caller: kSaturate clamps to the largest finite value (what
// quantization wants, and CUDA's __NV_SATFINITE); kNonFinite gives Inf where the
// format has it, else NaN (PyTorch's .to(float8_*) behaviour).
// Pure functions: any thread may call them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "core/status.h"

namespace moe {

enum class DType : uint8_t {
  kF32,
  kF64,
  kF16,
  kBF16,
  kF8E4M3,  // e4m3fn: bias 7, no Inf, NaN = S.1111.111, max 448
  kF8E5M2,  // IEEE-like: bias 15, Inf and NaN, max 57344
  kE8M0,    // unsigned power of two 2^(code-127), code 255 = NaN (MX block scales)
  kF4E2M1,  // two per byte, element 2i in the low nibble; max 6, no Inf/NaN
  kI8,
  kU8,
  kI16,
  kI32,
  kI64,
  kBool,
};

// Bits per element (4 for kF4E2M1).
int dtype_bits(DType dtype);
// Bytes for `num_elements` elements; packed types round up to whole bytes.
size_t dtype_bytes(DType dtype, int64_t num_elements);
// Our short name: "f32", "bf16", "f8e4m3", ...
std::string_view dtype_name(DType dtype);
Expected<DType> dtype_from_name(std::string_view name);
// Names used in safetensors headers: "F32", "BF16", "F8_E4M3", "F8_E8M0", "F4", ...
std::string_view safetensors_dtype_name(DType dtype);
Expected<DType> dtype_from_safetensors_name(std::string_view name);
bool dtype_is_float(DType dtype);

enum class Overflow { kSaturate, kNonFinite };

// --- 16-bit floats --------------------------------------------------------
inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

inline float bf16_to_float(uint16_t bits) { return bits_to_float(static_cast<uint32_t>(bits) << 16); }

// Round to nearest even on the 16 dropped bits; NaN stays a (quiet) NaN.
inline uint16_t float_to_bf16(float f) {
  uint32_t bits = float_to_bits(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

float f16_to_float(uint16_t bits);
uint16_t float_to_f16(float f);  // overflow gives Inf, as IEEE does

// --- 8-bit floats and scales ----------------------------------------------
float e4m3_to_float(uint8_t code);
uint8_t float_to_e4m3(float f, Overflow overflow = Overflow::kSaturate);
float e5m2_to_float(uint8_t code);
uint8_t float_to_e5m2(float f, Overflow overflow = Overflow::kSaturate);

inline constexpr float kE4M3Max = 448.0f;
inline constexpr float kE5M2Max = 57344.0f;
inline constexpr float kE2M1Max = 6.0f;

// E8M0 holds 2^(code - 127) for code 0..254; code 255 is NaN. No zero, no sign.
float e8m0_to_float(uint8_t code);
// The smallest power of two >= f (what an MX scale needs so that amax / scale
// fits the element format). f <= 2^-127 gives code 0; f > 2^127 or NaN gives 255.
uint8_t float_to_e8m0_ceil(float f);

// --- 4-bit floats ----------------------------------------------------------
// One E2M1 value in the low 4 bits: sign bit 3, exponent bits 2..1, mantissa bit 0.
float e2m1_to_float(uint8_t nibble);
uint8_t float_to_e2m1(float f);  // saturates to +-6; NaN gives +6 (no NaN in the format)
// Packed access: element i of a kF4E2M1 buffer.
inline uint8_t e2m1_get(const uint8_t* packed, int64_t i) {
  return (i & 1) ? (packed[i >> 1] >> 4) : (packed[i >> 1] & 0xf);
}
inline void e2m1_set(uint8_t* packed, int64_t i, uint8_t nibble) {
  uint8_t& byte = packed[i >> 1];
  byte = (i & 1) ? static_cast<uint8_t>((byte & 0x0f) | (nibble << 4))
                 : static_cast<uint8_t>((byte & 0xf0) | (nibble & 0x0f));
}

// Reads element i of a float-typed buffer as float (any float dtype, including
// the packed fp4). Not for hot loops: ops specialise per dtype.
float load_as_float(DType dtype, const void* data, int64_t i);
void store_from_float(DType dtype, void* data, int64_t i, float value);

// Tag types so templates can name element types.
struct bf16_t {
  uint16_t bits;
};

}  // namespace moe
