// JSON Schema's numeric bounds (minimum, maximum, exclusiveMinimum,
// exclusiveMaximum) as a regular expression over a number's text, which the
// matcher (structured/matcher.h) steps beside the number's own bytes.
//
// The texts the expression takes are JSON numbers without an exponent:
// -?(0|[1-9][0-9]*)(\.[0-9]+)? (integers: no fraction), at most
// kMaxIntegerDigits digits before the point and kMaxFractionDigits after it,
// never "-0" -- a subset of the numbers in the range (1e3 is not written, 1000
// is). Every state of the expression's automaton can still end, so a bounded
// number is never a dead end. Bounds compare exactly as decimals: a bound is
// read from its JSON text (0.1 is one tenth, not the nearest double), so 0.1
// meets "minimum": 0.1 and 0.10000000000000001 exceeds "maximum": 0.1.
//
// How: the range is split into its negative and non-negative magnitudes;
// each is written as alternatives by the integer part (the bound's own, those
// strictly between, the other bound's), an integer part range digit by digit
// as in the classic construction (same-length ranges: a common prefix, then
// the first digit's three cases), a fraction against a bound by comparing
// digits from the left.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "core/status.h"

namespace moe::structured {

// A decimal read from a JSON number's text, exactly: sign, integer digits (no
// leading zeros; "0" for none) and fraction digits (no trailing zeros).
struct Decimal {
  bool negative = false;
  std::string integer = "0";
  std::string fraction;

  // From JSON number text (-?digits(.digits)?([eE][+-]?digits)?); an error
  // names `what` (the keyword) when the text is not one.
  static Expected<Decimal> parse(std::string_view text, std::string_view what);
  bool is_zero() const { return integer == "0" && fraction.empty(); }
};
// -1, 0, 1 as a < b, a == b, a > b (exactly; -0 == 0).
int compare(const Decimal& a, const Decimal& b);

struct NumberBound {
  Decimal value;
  bool inclusive = true;
};

struct NumberRange {
  std::optional<NumberBound> lower, upper;
};

// The pattern (for RegexMatch::kWhole) of the texts of the numbers (integers
// when `integer`) in `range`; an error when none is in it (or none that has
// at most kMaxIntegerDigits integer digits).
Expected<std::string> number_range_pattern(const NumberRange& range, bool integer);

}  // namespace moe::structured
