// Sets of Unicode code points and UTF-8 text as code points: what the
// regular expressions (structured/regex.h) and the context-free grammars
// (structured/cfg.h) read.
#pragma once

#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

namespace moe::structured {

inline constexpr uint32_t kMaxCodePoint = 0x10FFFF;

// A set of code points as sorted, disjoint, inclusive ranges.
using Ranges = std::vector<std::pair<uint32_t, uint32_t>>;

// `r` sorted, overlapping and adjacent ranges merged.
Ranges normalized(Ranges r);
// The code points not in `set`.
Ranges complement(const Ranges& set);
// Whether the normalized `set` holds some code point of [lo, hi].
bool ranges_meet(const Ranges& set, uint32_t lo, uint32_t hi);

// UTF-8 to code points; false where `s` is not valid UTF-8.
bool code_points(std::string_view s, std::vector<uint32_t>& out);

}  // namespace moe::structured
