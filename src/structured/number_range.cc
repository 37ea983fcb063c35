#include "structured/number_range.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <vector>

#include "structured/grammar.h"

namespace moe::structured {
namespace {

// A piece of a pattern, or nullopt for a set with no text in it.
using Re = std::optional<std::string>;

Re either(const std::vector<Re>& parts) {
  std::string out;
  int n = 0;
  for (const Re& p : parts) {
    if (!p) continue;
    out += (n++ ? "|" : "") + *p;
  }
  if (n == 0) return std::nullopt;
  return n == 1 ? out : "(?:" + out + ")";
}

std::string digit_class(int lo, int hi) {
  return lo == hi ? std::string(1, static_cast<char>('0' + lo)) : fmt::format("[{}-{}]", lo, hi);
}

bool all_of(std::string_view s, char c) {
  return std::all_of(s.begin(), s.end(), [c](char x) { return x == c; });
}

std::string plus_one(std::string s) {
  for (size_t i = s.size(); i-- > 0;) {
    if (s[i] != '9') {
      ++s[i];
      return s;
    }
    s[i] = '0';
  }
  return "1" + s;
}

std::string minus_one(std::string s) {  // s > 0
  for (size_t i = s.size(); i-- > 0;) {
    if (s[i] != '0') {
      --s[i];
      break;
    }
    s[i] = '9';
  }
  const size_t first = s.find_first_not_of('0');
  return first == std::string::npos ? "0" : s.substr(first);
}

int compare_magnitudes(const Decimal& a, const Decimal& b) {
  if (a.integer.size() != b.integer.size()) return a.integer.size() < b.integer.size() ? -1 : 1;
  if (int c = a.integer.compare(b.integer); c != 0) return c < 0 ? -1 : 1;
  const int c = a.fraction.compare(b.fraction);  // no trailing zeros: as strings
  return c < 0 ? -1 : (c > 0 ? 1 : 0);
}

// Same-length digit strings in [x, y] (x <= y), leading zeros allowed.
std::string same_length(std::string_view x, std::string_view y) {
  if (x.empty()) return "";
  if (x == y) return std::string(x);
  if (x[0] == y[0]) return x[0] + same_length(x.substr(1), y.substr(1));
  const size_t rest = x.size() - 1;
  const bool low_full = all_of(x.substr(1), '0'), high_full = all_of(y.substr(1), '9');
  const int lo = x[0] - '0' + !low_full, hi = y[0] - '0' - !high_full;
  const std::string any = rest ? fmt::format("[0-9]{{{}}}", rest) : "";
  return *either({low_full ? Re() : Re(x[0] + same_length(x.substr(1), std::string(rest, '9'))),
                  lo <= hi ? Re(digit_class(lo, hi) + any) : Re(),
                  high_full ? Re() : Re(y[0] + same_length(std::string(rest, '0'), y.substr(1)))});
}

// Integer texts (0|[1-9][0-9]*, at most kMaxIntegerDigits digits) in [lo, hi]
// (hi nullopt: unbounded).
Re integers(const std::string& lo, std::optional<std::string> hi) {
  const auto max_digits = static_cast<size_t>(kMaxIntegerDigits);
  if (lo.size() > max_digits) return std::nullopt;
  if (hi && hi->size() > max_digits) hi.reset();
  if (hi && compare_magnitudes(Decimal{.integer = lo}, Decimal{.integer = *hi}) > 0) return std::nullopt;
  std::vector<Re> parts;
  const size_t last = hi ? hi->size() : max_digits;
  for (size_t n = lo.size(); n <= last; ++n) {
    if (!hi && n > lo.size()) {  // every longer integer
      parts.push_back(fmt::format("[1-9][0-9]{{{},{}}}", n - 1, last - 1));
      break;
    }
    std::string x = lo;
    if (n > lo.size()) {  // the least integer of n digits
      x.assign(n, '0');
      x[0] = '1';
    }
    const std::string y = hi && n == hi->size() ? *hi : std::string(n, '9');
    parts.push_back(same_length(x, y));
  }
  return either(parts);
}

// The digits after a number's point, against a bound's fraction: none
// (`none`: the number has no point), or one or more as `some` takes.
struct Tail {
  bool none = false;
  Re some;
};

// `head`, then the tail's digits.
Re then(std::string head, const Tail& t) {
  if (!t.some) return t.none ? Re(head) : std::nullopt;
  return head + (t.none ? "(?:" + *t.some + ")?" : *t.some);
}
// The point and its digits, as the tail allows (possibly nothing).
Re point(const Tail& t) {
  if (!t.some) return t.none ? Re("") : std::nullopt;
  return t.none ? "(?:\\." + *t.some + ")?" : "\\." + *t.some;
}

// Up to n digits (n >= 0).
std::string up_to(int n) {
  return n > 0 ? fmt::format("[0-9]{{0,{}}}", n) : "";
}

// 1 to n digits, any of them.
Tail any_digits(int n) {
  return {true, n > 0 ? Re(fmt::format("[0-9]{{1,{}}}", n)) : Re()};
}

// 1 to n digits, not all zeros: the zeros before the first other digit, then up to the rest.
Re not_all_zeros(int n) {
  std::vector<Re> parts;
  for (int zeros = 0; zeros < n; ++zeros)
    parts.push_back(std::string(static_cast<size_t>(zeros), '0') + "[1-9]" + up_to(n - 1 - zeros));
  return either(parts);
}

// The tails below take at most `left` digits (a bound's own are no more).
// 0.s >= 0.a (> when not inclusive).
Tail at_least(std::string_view a, bool inclusive, int left) {
  if (a.empty()) return inclusive ? any_digits(left) : Tail{false, not_all_zeros(left)};
  const int d = a[0] - '0';
  return {false, either({d < 9 ? Re(digit_class(d + 1, 9) + up_to(left - 1)) : Re(),
                         then(std::string(1, a[0]), at_least(a.substr(1), inclusive, left - 1))})};
}

// 0.s <= 0.b (< when not inclusive).
Tail at_most(std::string_view b, bool inclusive, int left) {
  if (b.empty()) return inclusive ? Tail{true, left > 0 ? Re(fmt::format("0{{1,{}}}", left)) : Re()} : Tail{};
  const int d = b[0] - '0';
  return {true, either({d > 0 ? Re(digit_class(0, d - 1) + up_to(left - 1)) : Re(),
                        then(std::string(1, b[0]), at_most(b.substr(1), inclusive, left - 1))})};
}

// 0.a <= 0.s <= 0.b, where 0.a <= 0.b.
Tail between(std::string_view a, bool a_inclusive, std::string_view b, bool b_inclusive, int left) {
  if (b.empty())
    return at_most(b, a_inclusive && b_inclusive, left);  // a is empty too: zeros, if both take 0
  const int a0 = a.empty() ? 0 : a[0] - '0', b0 = b[0] - '0';
  const std::string_view a_rest = a.empty() ? a : a.substr(1), b_rest = b.substr(1);
  const bool none = a.empty() && a_inclusive;  // no digits: zero
  if (a0 == b0)
    return {none, then(std::string(1, b[0]), between(a_rest, a_inclusive, b_rest, b_inclusive, left - 1))};
  return {none,
          either({then(std::string(1, static_cast<char>('0' + a0)), at_least(a_rest, a_inclusive, left - 1)),
                  a0 + 1 <= b0 - 1 ? Re(digit_class(a0 + 1, b0 - 1) + up_to(left - 1)) : Re(),
                  then(std::string(1, b[0]), at_most(b_rest, b_inclusive, left - 1))})};
}

struct Magnitude {
  Decimal value;  // not negative
  bool inclusive = true;
};

// A bound with more fraction digits than a text may have, as the bound that
// takes the same texts: x >= l (or > l) is x > l cut to kMaxFractionDigits,
// x <= h (or < h) is x <= h cut.
Magnitude cut(Magnitude m, bool lower) {
  if (m.value.fraction.size() <= static_cast<size_t>(kMaxFractionDigits)) return m;
  m.value.fraction.resize(static_cast<size_t>(kMaxFractionDigits));
  m.value.fraction.erase(m.value.fraction.find_last_not_of('0') + 1);
  m.inclusive = !lower;
  return m;
}

// The texts of the non-negative numbers (integers) between lo and hi (none: unbounded).
Re magnitudes(Magnitude lo, std::optional<Magnitude> hi, bool integer) {
  lo = cut(std::move(lo), true);
  if (hi) hi = cut(std::move(*hi), false);
  if (hi) {
    const int c = compare_magnitudes(lo.value, hi->value);
    if (c > 0 || (c == 0 && !(lo.inclusive && hi->inclusive))) return std::nullopt;
  }
  if (integer) {
    const std::string first =
        lo.value.fraction.empty() && lo.inclusive ? lo.value.integer : plus_one(lo.value.integer);
    std::optional<std::string> last;
    if (hi) {
      if (!hi->value.fraction.empty() || hi->inclusive) {
        last = hi->value.integer;
      } else if (hi->value.integer == "0") {
        return std::nullopt;
      } else {
        last = minus_one(hi->value.integer);
      }
    }
    return integers(first, last);
  }
  const std::string& low = lo.value.integer;
  if (low.size() > static_cast<size_t>(kMaxIntegerDigits)) return std::nullopt;
  const bool high_written = hi && hi->value.integer.size() <= static_cast<size_t>(kMaxIntegerDigits);
  if (high_written && hi->value.integer == low) {  // one integer part: the fractions between the bounds'
    const Re p = point(
        between(lo.value.fraction, lo.inclusive, hi->value.fraction, hi->inclusive, kMaxFractionDigits));
    return p ? Re(low + *p) : Re();
  }
  const Re low_point = point(at_least(lo.value.fraction, lo.inclusive, kMaxFractionDigits));
  Re inner;
  if (!high_written) {
    inner = integers(plus_one(low), std::nullopt);
  } else if (compare_magnitudes(Decimal{.integer = plus_one(low)}, Decimal{.integer = hi->value.integer}) <
             0) {
    inner = integers(plus_one(low), minus_one(hi->value.integer));
  }
  Re high;
  if (high_written) {
    const Re p = point(at_most(hi->value.fraction, hi->inclusive, kMaxFractionDigits));
    if (p) high = hi->value.integer + *p;
  }
  return either({low_point ? Re(low + *low_point) : Re(),
                 inner ? Re(*inner + *point(any_digits(kMaxFractionDigits))) : Re(), high});
}

}  // namespace

Expected<Decimal> Decimal::parse(std::string_view text, std::string_view what) {
  const auto bad = [&] { return invalid_argument("JSON schema '{}' must be a number", what); };
  size_t i = 0;
  Decimal d;
  if (i < text.size() && text[i] == '-') d.negative = true, ++i;
  std::string digits;
  long point = 0;  // digits before the point
  const size_t int_start = i;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) digits += text[i++];
  if (i == int_start) return bad();
  point = static_cast<long>(digits.size());
  if (i < text.size() && text[i] == '.') {
    const size_t frac_start = ++i;
    while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) digits += text[i++];
    if (i == frac_start) return bad();
  }
  if (i < text.size() && (text[i] == 'e' || text[i] == 'E')) {
    ++i;
    bool minus = false;
    if (i < text.size() && (text[i] == '+' || text[i] == '-')) minus = text[i++] == '-';
    const size_t exp_start = i;
    long exponent = 0;
    while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) {
      exponent = std::min<long>(exponent * 10 + (text[i++] - '0'), 100000);  // doubles' reach 324
    }
    if (i == exp_start) return bad();
    point += minus ? -exponent : exponent;
  }
  if (i != text.size()) return bad();
  // Leading and trailing zeros out of the significant digits.
  const size_t first = digits.find_first_not_of('0');
  if (first == std::string::npos) return Decimal{};  // zero (and -0)
  point -= static_cast<long>(first);
  digits.erase(0, first);
  digits.erase(digits.find_last_not_of('0') + 1);
  const auto n = static_cast<long>(digits.size());
  if (point <= 0) {
    d.fraction = std::string(static_cast<size_t>(-point), '0') + digits;
  } else if (point >= n) {
    d.integer = digits + std::string(static_cast<size_t>(point - n), '0');
  } else {
    d.integer = digits.substr(0, static_cast<size_t>(point));
    d.fraction = digits.substr(static_cast<size_t>(point));
  }
  return d;
}

int compare(const Decimal& a, const Decimal& b) {
  const bool a_neg = a.negative && !a.is_zero(), b_neg = b.negative && !b.is_zero();
  if (a_neg != b_neg) return a_neg ? -1 : 1;
  const int c = compare_magnitudes(a, b);
  return a_neg ? -c : c;
}

Expected<std::string> number_range_pattern(const NumberRange& range, bool integer) {
  const auto& [lower, upper] = range;
  auto magnitude = [](const NumberBound& b) {
    Decimal v = b.value;
    v.negative = false;
    return Magnitude{std::move(v), b.inclusive};
  };
  const auto negative = [](const std::optional<NumberBound>& b) {
    return b && b->value.negative && !b->value.is_zero();
  };
  Re non_negative, negatives;
  // Numbers >= 0: from the lower bound or zero, to the upper bound.
  if (!negative(upper) && !(upper && upper->value.is_zero() && !upper->inclusive)) {
    const Magnitude lo = lower && !negative(lower) ? magnitude(*lower) : Magnitude{};
    non_negative = magnitudes(lo, upper ? std::optional(magnitude(*upper)) : std::nullopt, integer);
  }
  // Numbers < 0, as "-" and their magnitude: above zero (or the upper bound's), up to the lower bound's.
  if (!lower || negative(lower)) {
    const Magnitude lo = negative(upper) ? magnitude(*upper) : Magnitude{.inclusive = false};
    const Re m = magnitudes(lo, lower ? std::optional(magnitude(*lower)) : std::nullopt, integer);
    if (m) negatives = "-" + *m;
  }
  const Re pattern = either({negatives, non_negative});
  if (!pattern)
    return invalid_argument(
        "the JSON schema's bounds (minimum, maximum, exclusiveMinimum, exclusiveMaximum) leave "
        "no {} with at most {} integer digits",
        integer ? "integer" : "number", kMaxIntegerDigits);
  return *pattern;
}

}  // namespace moe::structured
