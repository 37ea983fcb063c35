// Regular expressions for structured outputs: JSON Schema's `pattern` (and
// the string formats served through it), compiled to a deterministic
// automaton over Unicode code points that the matcher (structured/matcher.h)
// steps once per character of a string's value (after its JSON escapes are
// decoded).
//
// The syntax served is ECMA-262's (what JSON Schema names), without the
// features that are not regular or need look-around: literals and escapes
// (\t \n \r \f \v \0 \xHH \uHHHH, \ before any other punctuation), `.`
// (any code point but a line terminator), classes [a-z], [^...] with \d \w
// \s \D \W \S inside and out, groups ( ), (?: ) and (?<name> ), `|`, and the
// quantifiers * + ? {n} {n,} {n,m} (lazy forms too: the same strings).
// Refused with an error naming the construct: backreferences, look-ahead
// and look-behind, \b \B, and ^ / $ anywhere but at the pattern's ends. As
// in JSON Schema, a pattern is not anchored: without ^ (or $), anything may
// come before (after) what it matches; kWhole matches the whole text.
//
// The automaton keeps only states from which an accepting one can be
// reached, so a step either fails at once or leaves a way to finish: a
// constrained model is never led into a dead end (with a string's
// minLength / maxLength too, through viable()).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace moe::structured {

inline constexpr int32_t kMaxRegexStates = 4096;    // of the automaton
inline constexpr int32_t kMaxRegexRepeat = 1000;     // n and m of {n,m}

// kSearch: JSON Schema's `pattern` (a match anywhere, unless anchored);
// kWhole: the whole text matches (vLLM's guided_regex).
enum class RegexMatch : uint8_t { kSearch, kWhole };

class Regex {
 public:
  // The error names what is not served or is malformed, and where.
  static Expected<Regex> compile(std::string_view pattern, RegexMatch match = RegexMatch::kSearch);

  int32_t start() const { return 0; }
  // The state after `code_point`, or -1 when no match can go on.
  int32_t step(int32_t state, uint32_t code_point) const;
  bool accepting(int32_t state) const { return accepting_[static_cast<size_t>(state)] != 0; }
  // Whether a match can still end within a string's length bounds from
  // `state`, `used` code points into it: it needs at least min_left(state)
  // more and may take at most max_left(state) more (INT32_MAX: any number);
  // max_length -1: unbounded. (Necessary, not sufficient: lengths a pattern
  // allows need not be contiguous, e.g. (aa)* with an odd maxLength.)
  bool viable(int32_t state, int32_t used, int32_t min_length, int32_t max_length) const;
  // Whether some code point in [lo, hi] may follow in `state`, leading to a
  // state viable with `used` code points (the one to come included): the
  // matcher asks before a character's last byte, so that no prefix is a dead end.
  bool allows(int32_t state, uint32_t lo, uint32_t hi, int32_t used = 0, int32_t min_length = 0,
              int32_t max_length = -1) const;
  int32_t num_states() const { return static_cast<int32_t>(accepting_.size()); }
  // The most code points any state needs to reach an accepting one.
  int32_t most_min_left() const { return most_min_left_; }

  // Whether the whole of `text` (UTF-8) matches: a test helper and the
  // definition the matcher follows.
  bool matches(std::string_view text) const;

 private:
  std::vector<uint32_t> bounds_;  // code point intervals [bounds_[i], bounds_[i + 1]), ascending from 0
  // The interval of each ASCII code point: the steps most text takes, without the search.
  std::array<int32_t, 128> ascii_interval_{};
  std::vector<int32_t> next_;     // [state, interval]: the next state or -1
  std::vector<uint8_t> accepting_;
  std::vector<int32_t> min_left_, max_left_;  // per state: the fewest and most code points to an accepting state
  int32_t most_min_left_ = 0;
};

// A JSON Schema string `format` as a pattern: date, time, date-time,
// duration, uuid, email, ipv4, ipv6, hostname, uri (RFC 3339's forms with
// upper-case T and Z; an email of dot-separated atoms; each a subset of its
// RFC: regex.cc says which). Empty for a format not served.
std::string_view format_pattern(std::string_view format);

}  // namespace moe::structured
