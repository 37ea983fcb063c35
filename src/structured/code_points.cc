#include "structured/code_points.h"

#include <algorithm>

#include "tokenizer/utf8.h"

namespace moe::structured {

Ranges normalized(Ranges r) {
  std::sort(r.begin(), r.end());
  Ranges out;
  for (const auto& [lo, hi] : r) {
    if (!out.empty() && lo <= out.back().second + 1) {
      out.back().second = std::max(out.back().second, hi);
    } else {
      out.emplace_back(lo, hi);
    }
  }
  return out;
}

Ranges complement(const Ranges& set) {
  Ranges out;
  uint32_t next = 0;
  for (const auto& [lo, hi] : normalized(set)) {
    if (lo > next) out.emplace_back(next, lo - 1);
    next = hi + 1;
  }
  if (next <= kMaxCodePoint) out.emplace_back(next, kMaxCodePoint);
  return out;
}

bool ranges_meet(const Ranges& set, uint32_t lo, uint32_t hi) {
  // The first range ending at or after lo.
  auto it = std::lower_bound(set.begin(), set.end(), lo, [](const auto& r, uint32_t v) { return r.second < v; });
  return it != set.end() && it->first <= hi;
}

bool code_points(std::string_view s, std::vector<uint32_t>& out) {
  out.clear();
  if (!tokenizer::is_valid_utf8(s)) return false;
  for (size_t i = 0; i < s.size();) {
    char32_t cp;
    i += tokenizer::decode_utf8(s, i, cp);
    out.push_back(static_cast<uint32_t>(cp));
  }
  return true;
}

}  // namespace moe::structured
