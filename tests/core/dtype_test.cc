// Element-type conversions checked against oracles written here from the
// format definitions: OCP Microscaling Formats (MX) v1.0 for e4m3, e5m2, e8m0
// and e2m1, IEEE 754 binary16 for f16, and bf16 as the top half of an IEEE
// binary32. The oracles share no code with dtype.cc: decoding evaluates
// sign * 2^(e - bias) * (1 + m / 2^M) with each format's special codes spelled
// out, and encoding looks the input up in the sorted list of every
// representable value, takes the nearer neighbour and breaks a tie towards the
// code whose mantissa LSB is 0, instead of rounding arithmetically. The only
// numbers typed in are the formats' published anchors (max 448, 57344, 65504,
// 6; smallest subnormals), which test the oracle itself.
//
// The test of float_to_bf16 over all 2^32 float bit patterns is disabled here
// and run by the ctest entry dtype_bf16_all_floats_test (label "slow").

#include "core/dtype.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

namespace moe {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int kMaxReported = 10;  // mismatches printed per test; the rest are counted

std::string describe(float x) { return fmt::format("{:a} (bits 0x{:08x})", x, float_to_bits(x)); }

// --- Format definitions --------------------------------------------------------

enum class Specials {
  kIeee,   // the top exponent holds Inf (m == 0) and NaN (m != 0)
  kFnNaN,  // no Inf; only the all-ones magnitude S.1111.111 is NaN (e4m3fn)
  kNone,   // every code is a finite number (e2m1)
};

struct Format {
  const char* name;
  int exponent_bits;
  int mantissa_bits;
  int bias;
  Specials specials;

  int width() const { return 1 + exponent_bits + mantissa_bits; }
  uint32_t num_codes() const { return 1u << width(); }
  uint32_t sign_bit() const { return 1u << (width() - 1); }
};

constexpr Format kE4M3{"e4m3", 4, 3, 7, Specials::kFnNaN};
constexpr Format kE5M2{"e5m2", 5, 2, 15, Specials::kIeee};
constexpr Format kE2M1{"e2m1", 2, 1, 1, Specials::kNone};
constexpr Format kF16{"f16", 5, 10, 15, Specials::kIeee};
constexpr Format kBF16{"bf16", 8, 7, 127, Specials::kIeee};

// The value a code stands for, from the definition.
double reference_value(const Format& fmt, uint32_t code) {
  const bool negative = (code & fmt.sign_bit()) != 0;
  const uint32_t e = (code >> fmt.mantissa_bits) & ((1u << fmt.exponent_bits) - 1u);
  const uint32_t m = code & ((1u << fmt.mantissa_bits) - 1u);
  const uint32_t e_max = (1u << fmt.exponent_bits) - 1u;
  const uint32_t m_max = (1u << fmt.mantissa_bits) - 1u;
  const double fraction = m / std::exp2(fmt.mantissa_bits);
  double magnitude;
  if (fmt.specials == Specials::kIeee && e == e_max) {
    magnitude = m == 0 ? std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  } else if (fmt.specials == Specials::kFnNaN && e == e_max && m == m_max) {
    magnitude = std::numeric_limits<double>::quiet_NaN();
  } else if (e == 0) {
    magnitude = std::exp2(1 - fmt.bias) * fraction;  // zero and subnormals: 0.m * 2^(1 - bias)
  } else {
    magnitude = std::exp2(static_cast<int>(e) - fmt.bias) * (1.0 + fraction);
  }
  return negative ? -magnitude : magnitude;
}

// An expected code that means "any code that decodes to NaN".
constexpr uint32_t kAnyNaN = 0xffffffffu;

// Round to nearest, ties to even, by search: the non-negative finite values of
// the format, sorted, extended by the value the next code would have if the
// exponent were unbounded (the IEEE rule for when a result overflows).
class ReferenceEncoder {
 public:
  struct Point {
    double value;
    uint32_t code;
  };

  explicit ReferenceEncoder(const Format& fmt) : fmt_(fmt) {
    for (uint32_t code = 0; code < fmt.sign_bit(); ++code) {
      const double v = reference_value(fmt, code);
      if (std::isfinite(v)) grid_.push_back({v, code});
    }
    std::sort(grid_.begin(), grid_.end(), [](const Point& a, const Point& b) { return a.value < b.value; });
    const Point& max = grid_.back();
    overflow_value_ = max.value + (max.value - grid_[grid_.size() - 2].value);
    overflow_is_even_ = (max.code & 1u) != 0;  // the code after max flips its LSB
  }

  const std::vector<Point>& grid() const { return grid_; }
  double overflow_value() const { return overflow_value_; }
  uint32_t max_code() const { return grid_.back().code; }

  uint32_t expected(float x, Overflow overflow) const {
    if (std::isnan(x)) return fmt_.specials == Specials::kNone ? max_code() : kAnyNaN;
    const uint32_t sign = std::signbit(x) ? fmt_.sign_bit() : 0u;
    const double a = std::fabs(static_cast<double>(x));
    auto it = std::lower_bound(grid_.begin(), grid_.end(), a,
                               [](const Point& p, double v) { return p.value < v; });
    if (it != grid_.end() && it->value == a) return sign | it->code;
    const Point& lo = *(it - 1);  // a > 0 == grid_[0].value
    const bool hi_is_overflow = it == grid_.end();
    const double hi_value = hi_is_overflow ? overflow_value_ : it->value;
    const bool hi_is_even = hi_is_overflow ? overflow_is_even_ : (it->code & 1u) == 0;
    const double mid = (lo.value + hi_value) / 2;  // exact: both have few significant bits
    const bool take_hi = a > mid || (a == mid && hi_is_even);
    if (!take_hi) return sign | lo.code;
    if (!hi_is_overflow) return sign | it->code;
    if (overflow == Overflow::kSaturate || fmt_.specials == Specials::kNone) return sign | max_code();
    if (fmt_.specials == Specials::kIeee)
      return sign | (((1u << fmt_.exponent_bits) - 1u) << fmt_.mantissa_bits);  // Inf
    return kAnyNaN;
  }

 private:
  Format fmt_;
  std::vector<Point> grid_;
  double overflow_value_;
  bool overflow_is_even_;
};

// --- The functions under test, behind one interface -------------------------------

struct Codec {
  Format fmt;
  float (*decode)(uint32_t code);
  uint32_t (*encode)(float x, Overflow overflow);
  std::vector<Overflow> modes;  // the overflow modes its encoder follows
};

std::vector<Codec> all_codecs() {
  const std::vector<Overflow> both = {Overflow::kSaturate, Overflow::kNonFinite};
  return {
      {kE4M3, [](uint32_t c) { return e4m3_to_float(static_cast<uint8_t>(c)); },
       [](float x, Overflow o) -> uint32_t { return float_to_e4m3(x, o); }, both},
      {kE5M2, [](uint32_t c) { return e5m2_to_float(static_cast<uint8_t>(c)); },
       [](float x, Overflow o) -> uint32_t { return float_to_e5m2(x, o); }, both},
      // e2m1 always saturates; f16 and bf16 always overflow to Inf (dtype.h).
      {kE2M1, [](uint32_t c) { return e2m1_to_float(static_cast<uint8_t>(c)); },
       [](float x, Overflow) -> uint32_t { return float_to_e2m1(x); }, {Overflow::kSaturate}},
      {kF16, [](uint32_t c) { return f16_to_float(static_cast<uint16_t>(c)); },
       [](float x, Overflow) -> uint32_t { return float_to_f16(x); }, {Overflow::kNonFinite}},
      {kBF16, [](uint32_t c) { return bf16_to_float(static_cast<uint16_t>(c)); },
       [](float x, Overflow) -> uint32_t { return float_to_bf16(x); }, {Overflow::kNonFinite}},
  };
}

const char* mode_name(Overflow o) { return o == Overflow::kSaturate ? "kSaturate" : "kNonFinite"; }

// Encodes x, compares with the oracle, reports the first kMaxReported mismatches.
void check_encode(const Codec& codec, const ReferenceEncoder& ref, float x, Overflow mode, int* failures) {
  const uint32_t got = codec.encode(x, mode);
  const uint32_t want = ref.expected(x, mode);
  const bool ok = got < codec.fmt.num_codes() &&
                  (want == kAnyNaN ? std::isnan(reference_value(codec.fmt, got)) : got == want);
  if (ok) return;
  if (++*failures <= kMaxReported) {
    ADD_FAILURE() << codec.fmt.name << " " << mode_name(mode) << ": encode(" << describe(x) << ") = 0x"
                  << std::hex << got << ", want " << (want == kAnyNaN ? std::string("a NaN") : fmt::format("0x{:x}", want));
  }
}

// Every representable value, every midpoint between neighbours (the ties) and
// one float ulp either side of each, the region past max, float subnormals,
// zeros, infinities and NaNs with several payloads; both signs of each.
std::vector<float> boundary_inputs(const ReferenceEncoder& ref) {
  std::vector<float> xs;
  auto push_around = [&](double v) {
    if (v > std::numeric_limits<float>::max()) return;  // bf16's 2^128 past its max
    const auto f = static_cast<float>(v);
    EXPECT_EQ(static_cast<double>(f), v) << "boundary value not exact in float";
    xs.push_back(f);
    xs.push_back(std::nextafter(f, kInf));
    xs.push_back(std::nextafter(f, 0.0f));
  };
  const auto& grid = ref.grid();
  for (size_t i = 0; i < grid.size(); ++i) {
    push_around(grid[i].value);
    const double next = i + 1 < grid.size() ? grid[i + 1].value : ref.overflow_value();
    push_around((grid[i].value + next) / 2);
  }
  push_around(ref.overflow_value());
  push_around(2 * ref.overflow_value());
  for (float f : {std::numeric_limits<float>::max(), kInf, std::numeric_limits<float>::denorm_min(),
                  3 * std::numeric_limits<float>::denorm_min(), std::ldexp(1.0f, -127),
                  std::numeric_limits<float>::min(), std::nextafter(std::numeric_limits<float>::min(), 0.0f)})
    xs.push_back(f);
  for (uint32_t nan_bits : {0x7fc00000u, 0x7f800001u, 0x7fa00000u, 0x7fffffffu, 0x7fc00001u})
    xs.push_back(bits_to_float(nan_bits));
  const size_t num_positive = xs.size();
  for (size_t i = 0; i < num_positive; ++i) xs.push_back(-xs[i]);
  return xs;
}

// Floats whose exponent is uniform from a few binades below the format's
// smallest subnormal to a few above its overflow point, random mantissa and
// sign; every eighth one a fully random bit pattern.
std::vector<float> random_inputs(const Format& fmt, int count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int lowest = std::max(1 - fmt.bias - fmt.mantissa_bits - 4, -126);
  const int highest = std::min((1 << fmt.exponent_bits) - fmt.bias + 4, 127);
  std::uniform_int_distribution<int> exponent(lowest, highest);
  std::vector<float> xs(count);
  for (int i = 0; i < count; ++i) {
    const uint64_t r = rng();
    uint32_t bits = static_cast<uint32_t>(r);
    if (i % 8 != 0) {
      bits = (static_cast<uint32_t>(r >> 32) & 0x80000000u) |
             (static_cast<uint32_t>(exponent(rng) + 127) << 23) | (bits & 0x7fffffu);
    }
    xs[i] = bits_to_float(bits);
  }
  return xs;
}

// --- The oracle against the formats' published anchors ---------------------------

TEST(DtypeOracle, MatchesPublishedAnchors) {
  EXPECT_EQ(reference_value(kE4M3, 0x7e), 448.0);
  EXPECT_EQ(reference_value(kE4M3, 0x78), 256.0);  // e4m3fn: the top exponent holds numbers
  EXPECT_EQ(reference_value(kE4M3, 0x08), std::exp2(-6));
  EXPECT_EQ(reference_value(kE4M3, 0x01), std::exp2(-9));
  EXPECT_TRUE(std::isnan(reference_value(kE4M3, 0x7f)));
  EXPECT_TRUE(std::isnan(reference_value(kE4M3, 0xff)));
  EXPECT_EQ(reference_value(kE5M2, 0x7b), 57344.0);
  EXPECT_EQ(reference_value(kE5M2, 0x7c), std::numeric_limits<double>::infinity());
  EXPECT_TRUE(std::isnan(reference_value(kE5M2, 0x7d)));
  EXPECT_EQ(reference_value(kE5M2, 0x04), std::exp2(-14));
  EXPECT_EQ(reference_value(kE5M2, 0x01), std::exp2(-16));
  EXPECT_EQ(reference_value(kF16, 0x7bff), 65504.0);
  EXPECT_EQ(reference_value(kF16, 0x3c00), 1.0);
  EXPECT_EQ(reference_value(kF16, 0x0001), std::exp2(-24));
  EXPECT_EQ(reference_value(kBF16, 0x3f80), 1.0);
  EXPECT_EQ(reference_value(kBF16, 0x0001), std::exp2(-133));
  EXPECT_EQ(reference_value(kBF16, 0xff80), -std::numeric_limits<double>::infinity());
  // OCP MX v1.0, table of E2M1 values.
  const double e2m1_values[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  for (uint32_t code = 0; code < 16; ++code) {
    const double want = (code & 8) ? -e2m1_values[code & 7] : e2m1_values[code & 7];
    EXPECT_EQ(reference_value(kE2M1, code), want) << code;
  }
  EXPECT_EQ(ReferenceEncoder(kE4M3).overflow_value(), 480.0);
  EXPECT_EQ(ReferenceEncoder(kE5M2).overflow_value(), 65536.0);
  EXPECT_EQ(ReferenceEncoder(kF16).overflow_value(), 65536.0);
  EXPECT_EQ(ReferenceEncoder(kBF16).overflow_value(), std::exp2(128));
  EXPECT_EQ(kE4M3Max, 448.0f);
  EXPECT_EQ(kE5M2Max, 57344.0f);
  EXPECT_EQ(kE2M1Max, 6.0f);
}

// --- Decoding ----------------------------------------------------------------------

TEST(DtypeDecode, EveryCodeOfEveryFormat) {
  for (const Codec& codec : all_codecs()) {
    int failures = 0;
    for (uint32_t code = 0; code < codec.fmt.num_codes(); ++code) {
      const double want = reference_value(codec.fmt, code);
      const float got = codec.decode(code);
      const bool ok = std::isnan(want) ? std::isnan(got)
                                       : static_cast<double>(got) == want && std::signbit(got) == std::signbit(want);
      if (!ok && ++failures <= kMaxReported)
        ADD_FAILURE() << codec.fmt.name << " decode(0x" << std::hex << code << ") = " << describe(got)
                      << ", want " << want;
    }
    EXPECT_EQ(failures, 0) << codec.fmt.name;
  }
}

TEST(DtypeDecode, E2M1IgnoresTheHighNibble) {
  for (uint32_t code = 0; code < 256; ++code) {
    const float low = e2m1_to_float(static_cast<uint8_t>(code & 0xf));
    EXPECT_EQ(float_to_bits(e2m1_to_float(static_cast<uint8_t>(code))), float_to_bits(low)) << code;
  }
}

// --- Encoding ----------------------------------------------------------------------

TEST(DtypeEncode, BoundaryValuesAndTies) {
  for (const Codec& codec : all_codecs()) {
    const ReferenceEncoder ref(codec.fmt);
    const std::vector<float> xs = boundary_inputs(ref);
    for (Overflow mode : codec.modes) {
      int failures = 0;
      for (float x : xs) check_encode(codec, ref, x, mode, &failures);
      EXPECT_EQ(failures, 0) << codec.fmt.name << " " << mode_name(mode) << " over " << xs.size() << " inputs";
    }
  }
}

TEST(DtypeEncode, RandomFloatsOverAWideExponentRange) {
  uint64_t seed = 1234;
  for (const Codec& codec : all_codecs()) {
    const ReferenceEncoder ref(codec.fmt);
    const std::vector<float> xs = random_inputs(codec.fmt, 1 << 20, seed++);
    for (Overflow mode : codec.modes) {
      int failures = 0;
      for (float x : xs) check_encode(codec, ref, x, mode, &failures);
      EXPECT_EQ(failures, 0) << codec.fmt.name << " " << mode_name(mode);
    }
  }
}

// Spot checks that read as the contract in dtype.h, on top of the oracle.
TEST(DtypeEncode, OverflowModes) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(float_to_e4m3(1e6f, Overflow::kSaturate), 0x7e);
  EXPECT_EQ(float_to_e4m3(-kInf, Overflow::kSaturate), 0xfe);
  EXPECT_EQ(float_to_e4m3(464.0f, Overflow::kNonFinite), 0x7e);  // the tie goes to 448 (even)
  EXPECT_TRUE(std::isnan(e4m3_to_float(float_to_e4m3(464.5f, Overflow::kNonFinite))));
  EXPECT_TRUE(std::isnan(e4m3_to_float(float_to_e4m3(kInf, Overflow::kNonFinite))));
  EXPECT_TRUE(std::isnan(e4m3_to_float(float_to_e4m3(nan, Overflow::kSaturate))));
  EXPECT_EQ(float_to_e5m2(kInf, Overflow::kSaturate), 0x7b);
  EXPECT_EQ(float_to_e5m2(-kInf, Overflow::kNonFinite), 0xfc);
  EXPECT_EQ(float_to_e5m2(61440.0f, Overflow::kNonFinite), 0x7c);  // the tie goes to 2^16 (even): Inf
  EXPECT_EQ(float_to_e5m2(61440.0f, Overflow::kSaturate), 0x7b);
  EXPECT_TRUE(std::isnan(e5m2_to_float(float_to_e5m2(-nan, Overflow::kSaturate))));
  EXPECT_EQ(float_to_f16(65520.0f), 0x7c00);  // the tie goes to 2^16 (even): Inf
  EXPECT_EQ(float_to_f16(std::nextafter(65520.0f, 0.0f)), 0x7bff);
  EXPECT_EQ(float_to_e2m1(kInf), 0x7);
  EXPECT_EQ(float_to_e2m1(-100.0f), 0xf);
  EXPECT_EQ(float_to_e2m1(nan), 0x7);   // no NaN in e2m1: +6 whatever the NaN's sign
  EXPECT_EQ(float_to_e2m1(-nan), 0x7);
  EXPECT_EQ(float_to_e2m1(-0.0f), 0x8);
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7f80);
}

TEST(DtypeEncode, NaNStaysAQuietNaN) {
  for (uint32_t bits : {0x7fc00000u, 0x7f800001u, 0x7fbfffffu, 0xffc00000u, 0xff800001u, 0x7fffffffu}) {
    const float nan = bits_to_float(bits);
    const uint16_t f16 = float_to_f16(nan);
    EXPECT_EQ(f16 & 0x7c00, 0x7c00) << std::hex << bits;
    EXPECT_NE(f16 & 0x0200, 0) << "f16 quiet bit, input 0x" << std::hex << bits;
    const uint16_t bf16 = float_to_bf16(nan);
    EXPECT_EQ(bf16 & 0x7f80, 0x7f80) << std::hex << bits;
    EXPECT_NE(bf16 & 0x0040, 0) << "bf16 quiet bit, input 0x" << std::hex << bits;
    EXPECT_TRUE(std::isnan(e5m2_to_float(float_to_e5m2(nan, Overflow::kNonFinite))));
    EXPECT_TRUE(std::isnan(e4m3_to_float(float_to_e4m3(nan, Overflow::kNonFinite))));
  }
}

TEST(DtypeRoundTrip, EncodeOfDecodeGivesEveryCodeBack) {
  for (const Codec& codec : all_codecs()) {
    const ReferenceEncoder ref(codec.fmt);
    for (Overflow mode : codec.modes) {
      int failures = 0;
      for (uint32_t code = 0; code < codec.fmt.num_codes(); ++code) {
        const double v = reference_value(codec.fmt, code);
        if (std::isnan(v)) continue;
        uint32_t want = code;
        if (std::isinf(v) && mode == Overflow::kSaturate) want = (code & codec.fmt.sign_bit()) | ref.max_code();
        const uint32_t got = codec.encode(codec.decode(code), mode);
        if (got != want && ++failures <= kMaxReported)
          ADD_FAILURE() << codec.fmt.name << " " << mode_name(mode) << ": 0x" << std::hex << code << " -> 0x" << got;
      }
      EXPECT_EQ(failures, 0) << codec.fmt.name << " " << mode_name(mode);
    }
  }
}

// --- bf16: every float bit pattern ----------------------------------------------

// The rounding boundary of float_to_bf16 for floats whose top half is `high`
// (finite): halfway between the bf16 value `high`, their truncation, and the
// next bf16 away from zero (2^128 past the largest: overflow to Inf). Computed
// in double, a different route than the implementation's integer bias.
double bf16_midpoint(uint32_t high) {
  const double lo = std::fabs(static_cast<double>(bits_to_float(high << 16)));
  const double hi = (high & 0x7fffu) == 0x7f7fu ? 0x1p128 : std::fabs(static_cast<double>(bits_to_float((high + 1) << 16)));
  return (lo + hi) / 2;
}

// Nearer of the two neighbours, a tie to the even code. For finite high halves.
uint16_t bf16_by_midpoint(uint32_t high, double mid, float x) {
  const double a = std::fabs(static_cast<double>(x));
  const auto lo = static_cast<uint16_t>(high), hi = static_cast<uint16_t>(high + 1);
  return a < mid ? lo : a > mid ? hi : (lo & 1) ? hi : lo;
}

// float_to_bf16 of the float with these bits from the definition; -1 for a NaN
// input, whose result is checked separately (it must be a quiet NaN).
int reference_bf16(uint32_t bits) {
  if ((bits & 0x7fffffffu) > 0x7f800000u) return -1;
  if ((bits & 0x7fffffffu) == 0x7f800000u) return static_cast<int>(bits >> 16);  // +-Inf stays
  return bf16_by_midpoint(bits >> 16, bf16_midpoint(bits >> 16), bits_to_float(bits));
}

bool bf16_matches_reference(uint32_t bits) {
  const uint16_t got = float_to_bf16(bits_to_float(bits));
  const int want = reference_bf16(bits);
  if (want >= 0) return got == want;
  return (got & 0x7f80) == 0x7f80 && (got & 0x0040) != 0;  // a quiet NaN
}

// Checks every float whose top half is in [first_high, last_high]; returns the
// number of mismatches. The midpoint is computed once per top half.
uint64_t count_bf16_mismatches(uint32_t first_high, uint32_t last_high, uint32_t* first_bad) {
  uint64_t bad = 0;
  for (uint32_t high = first_high; high <= last_high; ++high) {
    uint64_t bad_here = 0;
    if ((high & 0x7f80u) == 0x7f80u) {  // Inf and NaN: the slow path
      for (uint32_t low = 0; low < 0x10000; ++low) bad_here += !bf16_matches_reference(high << 16 | low);
    } else {
      const double mid = bf16_midpoint(high);
      for (uint32_t low = 0; low < 0x10000; ++low) {
        const float x = bits_to_float(high << 16 | low);
        bad_here += float_to_bf16(x) != bf16_by_midpoint(high, mid, x);
      }
    }
    if (bad_here != 0 && bad == 0) *first_bad = high << 16;
    bad += bad_here;
  }
  return bad;
}

// Every bf16 value with the low halves that decide rounding (exact, just
// below, at, just above the tie, the top) and a few random ones; then random
// bit patterns. Part of the cpu run; the full sweep is the slow test below.
TEST(Bf16Sampled, TiesAndNeighboursOfEveryValue) {
  std::mt19937_64 rng(99);
  std::vector<uint32_t> lows = {0x0000, 0x0001, 0x7fff, 0x8000, 0x8001, 0xffff};
  for (int i = 0; i < 4; ++i) lows.push_back(static_cast<uint32_t>(rng() & 0xffff));
  int failures = 0;
  auto check = [&](uint32_t bits) {
    if (!bf16_matches_reference(bits) && ++failures <= kMaxReported)
      ADD_FAILURE() << "float_to_bf16(" << describe(bits_to_float(bits)) << ") = 0x" << std::hex
                    << float_to_bf16(bits_to_float(bits)) << ", want 0x" << reference_bf16(bits);
  };
  for (uint32_t high = 0; high < 0x10000; ++high)
    for (uint32_t low : lows) check(high << 16 | low);
  for (int i = 0; i < (1 << 21); ++i) check(static_cast<uint32_t>(rng()));
  EXPECT_EQ(failures, 0);
}

TEST(Bf16AllFloats, DISABLED_EveryBitPattern) {
  const unsigned num_threads = std::max(1u, std::min(4u, std::thread::hardware_concurrency()));
  std::vector<uint64_t> bad(num_threads, 0);
  std::vector<uint32_t> first_bad(num_threads, 0);
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < num_threads; ++t) {
    threads.emplace_back([&, t] {
      const uint32_t first = 0x10000u * t / num_threads, last = 0x10000u * (t + 1) / num_threads - 1;
      bad[t] = count_bf16_mismatches(first, last, &first_bad[t]);
    });
  }
  for (auto& thread : threads) thread.join();
  for (unsigned t = 0; t < num_threads; ++t)
    EXPECT_EQ(bad[t], 0u) << "first mismatch among floats from bits 0x" << std::hex << first_bad[t];
}

// --- e8m0 --------------------------------------------------------------------

// The code float_to_e8m0_ceil should give, by scanning: the smallest code whose
// value 2^(code - 127) is >= f; 255 (NaN) when none is. This is the header's
// contract as one rule: f <= 2^-127 (zero, negatives, -Inf) gives 0; f > 2^127,
// +Inf and NaN give 255.
uint8_t reference_e8m0_ceil(float f) {
  for (int code = 0; code < 255; ++code)
    if (std::exp2(code - 127) >= static_cast<double>(f)) return static_cast<uint8_t>(code);
  return 255;
}

TEST(E8M0, DecodesEveryCode) {
  for (int code = 0; code < 255; ++code)
    EXPECT_EQ(static_cast<double>(e8m0_to_float(static_cast<uint8_t>(code))), std::exp2(code - 127)) << code;
  EXPECT_TRUE(std::isnan(e8m0_to_float(255)));
}

TEST(E8M0, PowersOfTwoMapExactlyAndAnythingAboveGoesUp) {
  for (int k = -127; k <= 127; ++k) {
    const float p = std::ldexp(1.0f, k);
    EXPECT_EQ(float_to_e8m0_ceil(p), k + 127) << "2^" << k;
    EXPECT_EQ(float_to_e8m0_ceil(std::nextafter(p, kInf)), k == 127 ? 255 : k + 128) << "just above 2^" << k;
    EXPECT_EQ(float_to_e8m0_ceil(std::nextafter(p, 0.0f)), k == -127 ? 0 : k + 127) << "just below 2^" << k;
    if (k < 127) {
      EXPECT_EQ(float_to_e8m0_ceil(p * 1.5f), k + 128) << "1.5 * 2^" << k;
    }
  }
}

TEST(E8M0, SpecialInputs) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(float_to_e8m0_ceil(0.0f), 0);
  EXPECT_EQ(float_to_e8m0_ceil(-0.0f), 0);
  EXPECT_EQ(float_to_e8m0_ceil(-1.0f), 0);
  EXPECT_EQ(float_to_e8m0_ceil(-kInf), 0);
  EXPECT_EQ(float_to_e8m0_ceil(std::numeric_limits<float>::denorm_min()), 0);
  EXPECT_EQ(float_to_e8m0_ceil(std::ldexp(1.0f, -128)), 0);
  EXPECT_EQ(float_to_e8m0_ceil(std::ldexp(1.5f, -127)), 1);  // a float subnormal above 2^-127
  EXPECT_EQ(float_to_e8m0_ceil(std::numeric_limits<float>::max()), 255);
  EXPECT_EQ(float_to_e8m0_ceil(kInf), 255);
  EXPECT_EQ(float_to_e8m0_ceil(nan), 255);
  EXPECT_EQ(float_to_e8m0_ceil(-nan), 255);
}

TEST(E8M0, RandomFloatsAgainstTheScan) {
  std::mt19937_64 rng(7);
  int failures = 0;
  for (int i = 0; i < (1 << 18); ++i) {
    const float f = bits_to_float(static_cast<uint32_t>(rng()));
    const uint8_t got = float_to_e8m0_ceil(f), want = reference_e8m0_ceil(f);
    if (got != want && ++failures <= kMaxReported)
      ADD_FAILURE() << "float_to_e8m0_ceil(" << describe(f) << ") = " << int{got} << ", want " << int{want};
  }
  EXPECT_EQ(failures, 0);
}

// --- Packed fp4 --------------------------------------------------------------------

TEST(PackedE2M1, ElementTwoIIsTheLowNibble) {
  uint8_t packed[2] = {0, 0};
  e2m1_set(packed, 0, 0x3);
  e2m1_set(packed, 1, 0xa);
  e2m1_set(packed, 3, 0x5);
  EXPECT_EQ(packed[0], 0xa3);
  EXPECT_EQ(packed[1], 0x50);
  EXPECT_EQ(e2m1_get(packed, 0), 0x3);
  EXPECT_EQ(e2m1_get(packed, 1), 0xa);
  EXPECT_EQ(e2m1_get(packed, 2), 0x0);
  EXPECT_EQ(e2m1_get(packed, 3), 0x5);
}

TEST(PackedE2M1, SetTouchesOnlyItsNibble) {
  constexpr int kNumElements = 14;
  std::mt19937 rng(5);
  for (int i = 0; i < kNumElements; ++i) {
    for (uint8_t nibble = 0; nibble < 16; ++nibble) {
      uint8_t packed[kNumElements / 2];
      for (auto& byte : packed) byte = static_cast<uint8_t>(rng());
      uint8_t before[kNumElements];
      for (int j = 0; j < kNumElements; ++j) before[j] = e2m1_get(packed, j);
      // Bits above the nibble are ignored.
      e2m1_set(packed, i, static_cast<uint8_t>(nibble | 0xb0));
      for (int j = 0; j < kNumElements; ++j)
        EXPECT_EQ(e2m1_get(packed, j), j == i ? nibble : before[j]) << "set " << i << " read " << j;
    }
  }
}

// --- Untyped access ------------------------------------------------------------------

TEST(LoadStore, EveryFloatDtypeGoesThroughItsConversion) {
  const float values[] = {0.0f, -0.0f, 1.0f, -2.5f, 0.3f, 300.0f, -1e-5f, 7e4f, 6.0f, 1e-40f};
  for (DType dtype : {DType::kF32, DType::kF64, DType::kF16, DType::kBF16, DType::kF8E4M3, DType::kF8E5M2,
                      DType::kE8M0, DType::kF4E2M1}) {
    alignas(8) uint8_t buffer[64] = {};
    constexpr int kCount = 5;
    for (float v : values) {
      for (int i = 0; i < kCount; ++i) store_from_float(dtype, buffer, i, v + static_cast<float>(i));
      for (int i = 0; i < kCount; ++i) {
        const float x = v + static_cast<float>(i);
        float want = x;
        switch (dtype) {
          case DType::kF16: want = f16_to_float(float_to_f16(x)); break;
          case DType::kBF16: want = bf16_to_float(float_to_bf16(x)); break;
          case DType::kF8E4M3: want = e4m3_to_float(float_to_e4m3(x)); break;
          case DType::kF8E5M2: want = e5m2_to_float(float_to_e5m2(x)); break;
          case DType::kE8M0: want = e8m0_to_float(float_to_e8m0_ceil(x)); break;
          case DType::kF4E2M1: want = e2m1_to_float(float_to_e2m1(x)); break;
          default: break;
        }
        EXPECT_EQ(float_to_bits(load_as_float(dtype, buffer, i)), float_to_bits(want))
            << dtype_name(dtype) << " element " << i << " of " << describe(x);
      }
      const size_t used = dtype_bytes(dtype, kCount);
      for (size_t b = used; b < sizeof buffer; ++b) EXPECT_EQ(buffer[b], 0) << dtype_name(dtype) << " wrote byte " << b;
    }
  }
}

TEST(LoadStoreDeathTest, NonFloatDtypesAreABug) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  int32_t buffer[2] = {};
  EXPECT_DEATH(load_as_float(DType::kI32, buffer, 0), "CHECK failed.*non-float dtype i32");
  EXPECT_DEATH(store_from_float(DType::kBool, buffer, 0, 1.0f), "CHECK failed.*non-float dtype bool");
}

// --- Names and sizes ---------------------------------------------------------------

TEST(DtypeInfo, BitsBytesAndNames) {
  struct Row {
    DType dtype;
    int bits;
    const char* name;
    const char* safetensors;
    bool is_float;
  };
  // Sizes from the formats; names from dtype.h's comments and the safetensors spec.
  const Row rows[] = {
      {DType::kF32, 32, "f32", "F32", true},         {DType::kF64, 64, "f64", "F64", true},
      {DType::kF16, 16, "f16", "F16", true},         {DType::kBF16, 16, "bf16", "BF16", true},
      {DType::kF8E4M3, 8, "f8e4m3", "F8_E4M3", true}, {DType::kF8E5M2, 8, "f8e5m2", "F8_E5M2", true},
      {DType::kE8M0, 8, "e8m0", "F8_E8M0", true},     {DType::kF4E2M1, 4, "f4e2m1", "F4", true},
      {DType::kI8, 8, "i8", "I8", false},            {DType::kU8, 8, "u8", "U8", false},
      {DType::kI16, 16, "i16", "I16", false},        {DType::kI32, 32, "i32", "I32", false},
      {DType::kI64, 64, "i64", "I64", false},        {DType::kBool, 8, "bool", "BOOL", false},
  };
  for (const Row& row : rows) {
    EXPECT_EQ(dtype_bits(row.dtype), row.bits) << row.name;
    EXPECT_EQ(dtype_name(row.dtype), row.name);
    EXPECT_EQ(safetensors_dtype_name(row.dtype), row.safetensors);
    EXPECT_EQ(dtype_is_float(row.dtype), row.is_float) << row.name;
    auto by_name = dtype_from_name(row.name);
    ASSERT_TRUE(by_name.has_value()) << row.name;
    EXPECT_EQ(*by_name, row.dtype);
    auto by_safetensors = dtype_from_safetensors_name(row.safetensors);
    ASSERT_TRUE(by_safetensors.has_value()) << row.safetensors;
    EXPECT_EQ(*by_safetensors, row.dtype);
    for (int64_t n : {0, 1, 2, 3, 1000, 1001})
      EXPECT_EQ(dtype_bytes(row.dtype, n), static_cast<size_t>((n * row.bits + 7) / 8)) << row.name << " " << n;
  }
  EXPECT_EQ(dtype_bytes(DType::kF4E2M1, 3), 2u);  // packed: rounds up to whole bytes
  EXPECT_EQ(*dtype_from_safetensors_name("F8_E4M3FN"), DType::kF8E4M3);
  EXPECT_EQ(*dtype_from_safetensors_name("F4_E2M1"), DType::kF4E2M1);
  EXPECT_EQ(dtype_from_name("fp32").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(dtype_from_safetensors_name("F8_E3M4").status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moe
