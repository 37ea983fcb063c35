#include "structured/regex.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <map>
#include <string_view>
#include <utility>

#include <fmt/format.h>

#include "structured/code_points.h"

namespace moe::structured {
namespace {

constexpr size_t kMaxNfaStates = 50000;
constexpr size_t kMaxTableEntries = size_t{1} << 22;
constexpr size_t kMaxWork = size_t{1} << 21;  // NFA states in the subset construction's sets, summed

const Ranges& digits() {
  static const Ranges r = {{'0', '9'}};
  return r;
}
const Ranges& word_chars() {
  static const Ranges r = {{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}};
  return r;
}
const Ranges& spaces() {  // ECMA-262's WhiteSpace and LineTerminator
  static const Ranges r = normalized({{'\t', '\r'}, {' ', ' '}, {0xA0, 0xA0}, {0x1680, 0x1680}, {0x2000, 0x200A},
                                      {0x2028, 0x2029}, {0x202F, 0x202F}, {0x205F, 0x205F}, {0x3000, 0x3000},
                                      {0xFEFF, 0xFEFF}});
  return r;
}
const Ranges& any_but_line_terminators() {
  static const Ranges r = complement({{'\n', '\n'}, {'\r', '\r'}, {0x2028, 0x2029}});
  return r;
}
const Ranges& anything() {
  static const Ranges r = {{0, kMaxCodePoint}};
  return r;
}

// The parsed pattern: a tree of sets, sequences, alternatives and repeats.
struct Ast {
  enum Kind : uint8_t { kSet, kConcat, kAlt, kRepeat } kind = kConcat;
  Ranges set;                 // kSet
  std::vector<int> children;  // kConcat, kAlt; kRepeat: one
  int min = 0, max = -1;      // kRepeat (-1: unbounded)
};

class Parser {
 public:
  Parser(std::string_view pattern, RegexMatch match) : valid_(code_points(pattern, p_)), match_(match) {}

  // The whole pattern: top-level alternatives, each anchored or not at either end.
  Expected<int> parse() {
    if (!valid_) return invalid_argument("regular expression: not valid UTF-8");
    std::vector<int> branches;
    while (true) {
      const bool anchored_start = peek('^') ? (++i_, true) : false;
      MOE_ASSIGN_OR_RETURN(int seq, sequence(true));
      const bool anchored_end = peek('$') ? (++i_, true) : false;
      std::vector<int> parts;
      const bool search = match_ == RegexMatch::kSearch;
      if (search && !anchored_start) parts.push_back(any_run());
      parts.push_back(seq);
      if (search && !anchored_end) parts.push_back(any_run());
      branches.push_back(add({.kind = Ast::kConcat, .children = parts}));
      if (i_ == p_.size()) break;
      ++i_;  // '|' (sequence() stops only there, at a final '$' or at the end)
    }
    return branches.size() == 1 ? branches[0] : add({.kind = Ast::kAlt, .children = branches});
  }

  const std::vector<Ast>& nodes() const { return nodes_; }

 private:
  bool peek(uint32_t c) const { return i_ < p_.size() && p_[i_] == c; }
  int add(Ast a) {
    nodes_.push_back(std::move(a));
    return static_cast<int>(nodes_.size()) - 1;
  }
  int any_run() {
    const int any = add({.kind = Ast::kSet, .set = anything()});
    return add({.kind = Ast::kRepeat, .children = {any}, .min = 0, .max = -1});
  }
  Status error(std::string_view what) const {
    return invalid_argument("regular expression: {} (at character {})", what, i_);
  }

  Expected<int> alternation() {
    std::vector<int> branches;
    while (true) {
      MOE_ASSIGN_OR_RETURN(int seq, sequence(false));
      branches.push_back(seq);
      if (!peek('|')) break;
      ++i_;
    }
    return branches.size() == 1 ? branches[0] : add({.kind = Ast::kAlt, .children = branches});
  }

  // Atoms with their quantifiers, up to '|', ')' or the end (top level: a
  // final '$' ends it too).
  Expected<int> sequence(bool top) {
    std::vector<int> items;
    while (i_ < p_.size() && !peek('|') && !peek(')')) {
      if (top && peek('$') && (i_ + 1 == p_.size() || p_[i_ + 1] == '|')) break;
      if (peek('$') || peek('^')) return error("'^' and '$' are served only at the pattern's ends");
      MOE_ASSIGN_OR_RETURN(int a, atom());
      MOE_ASSIGN_OR_RETURN(a, quantified(a));
      items.push_back(a);
    }
    if (peek(')') && top) return error("unmatched ')'");
    return add({.kind = Ast::kConcat, .children = items});
  }

  // {n}, {n,}, {n,m} at i_ (read past it), or false where '{' is a literal.
  bool braces(int& min, int& max) {
    size_t j = i_ + 1;
    auto number = [&](int& out) {
      const size_t begin = j;
      int64_t v = 0;
      while (j < p_.size() && p_[j] >= '0' && p_[j] <= '9') v = std::min<int64_t>(v * 10 + (p_[j++] - '0'), 1 << 30);
      out = static_cast<int>(v);
      return j > begin;
    };
    if (!number(min)) return false;
    max = min;
    if (j < p_.size() && p_[j] == ',') {
      ++j;
      if (!number(max)) max = -1;
    }
    if (j >= p_.size() || p_[j] != '}') return false;
    i_ = j + 1;
    return true;
  }

  Expected<int> quantified(int a) {
    while (i_ < p_.size()) {
      int min = 0, max = -1;
      if (peek('*')) {
        ++i_;
      } else if (peek('+')) {
        min = 1, ++i_;
      } else if (peek('?')) {
        max = 1, ++i_;
      } else if (!(peek('{') && braces(min, max))) {
        break;
      }
      if (max >= 0 && max < min) return error("a {n,m} with m below n");
      if (min > kMaxRegexRepeat || max > kMaxRegexRepeat)
        return error(fmt::format("a repeat count above {}", kMaxRegexRepeat));
      if (peek('?')) ++i_;  // lazy: the same strings
      a = add({.kind = Ast::kRepeat, .children = {a}, .min = min, .max = max});
      if (peek('*') || peek('+') || peek('?') || peek('{')) return error("nothing to repeat");
    }
    return a;
  }

  Expected<int> atom() {
    const uint32_t c = p_[i_];
    if (c == '*' || c == '+' || c == '?') return error("nothing to repeat");
    if (c == '(') {
      if (++depth_ > kMaxGroupDepth) return error("groups nested too deep");
      ++i_;
      if (peek('?')) {
        ++i_;
        if (peek(':')) {
          ++i_;
        } else if (peek('<') && i_ + 1 < p_.size() && p_[i_ + 1] != '=' && p_[i_ + 1] != '!') {
          while (i_ < p_.size() && !peek('>')) ++i_;  // a named group: the name is not needed
          if (!peek('>')) return error("unterminated group name");
          ++i_;
        } else {
          return error("look-ahead and look-behind are not served");
        }
      }
      MOE_ASSIGN_OR_RETURN(int inner, alternation());
      if (!peek(')')) return error("unterminated group");
      ++i_;
      --depth_;
      return inner;
    }
    if (c == '[') return char_class();
    if (c == '.') return ++i_, add({.kind = Ast::kSet, .set = any_but_line_terminators()});
    if (c == '\\') {
      MOE_ASSIGN_OR_RETURN(Ranges set, escape(false));
      return add({.kind = Ast::kSet, .set = std::move(set)});
    }
    ++i_;
    return add({.kind = Ast::kSet, .set = {{c, c}}});
  }

  // Four hex digits at i_, read past them.
  Expected<uint32_t> hex(int count) {
    uint32_t v = 0;
    for (int k = 0; k < count; ++k, ++i_) {
      if (i_ >= p_.size()) return error("a short hex escape");
      const uint32_t d = p_[i_];
      const int digit = d >= '0' && d <= '9'   ? static_cast<int>(d - '0')
                        : d >= 'a' && d <= 'f' ? static_cast<int>(d - 'a' + 10)
                        : d >= 'A' && d <= 'F' ? static_cast<int>(d - 'A' + 10)
                                               : -1;
      if (digit < 0) return error("a bad hex escape");
      v = v * 16 + static_cast<uint32_t>(digit);
    }
    return v;
  }

  // The escape at i_ ('\\'), read past it, as a set; in a class, \b is a backspace.
  Expected<Ranges> escape(bool in_class) {
    ++i_;
    if (i_ >= p_.size()) return error("a '\\' at the end");
    const uint32_t c = p_[i_++];
    switch (c) {
      case 'd': return digits();
      case 'D': return complement(digits());
      case 'w': return word_chars();
      case 'W': return complement(word_chars());
      case 's': return spaces();
      case 'S': return complement(spaces());
      case 't': return Ranges{{'\t', '\t'}};
      case 'n': return Ranges{{'\n', '\n'}};
      case 'r': return Ranges{{'\r', '\r'}};
      case 'f': return Ranges{{'\f', '\f'}};
      case 'v': return Ranges{{'\v', '\v'}};
      case 'x': {
        MOE_ASSIGN_OR_RETURN(uint32_t v, hex(2));
        return Ranges{{v, v}};
      }
      case 'u': {
        MOE_ASSIGN_OR_RETURN(uint32_t v, hex(4));
        if (v >= 0xD800 && v <= 0xDBFF && i_ + 1 < p_.size() && p_[i_] == '\\' && p_[i_ + 1] == 'u') {
          const size_t at = i_;
          i_ += 2;
          MOE_ASSIGN_OR_RETURN(uint32_t low, hex(4));
          if (low >= 0xDC00 && low <= 0xDFFF) {
            v = 0x10000 + ((v - 0xD800) << 10) + (low - 0xDC00);
          } else {
            i_ = at;
          }
        }
        return Ranges{{v, v}};
      }
      case '0':
        if (i_ < p_.size() && p_[i_] >= '0' && p_[i_] <= '9') return error("octal escapes are not served");
        return Ranges{{0, 0}};
      case 'b':
        if (in_class) return Ranges{{'\b', '\b'}};
        return error("word boundaries (\\b, \\B) are not served");
      default:
        break;
    }
    if (c >= '1' && c <= '9') return error("backreferences are not served");
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'))
      return error(fmt::format("the escape '\\{}' is not served", static_cast<char>(c)));
    return Ranges{{c, c}};  // \. \\ \/ \- \$ ...: the character itself
  }

  Expected<int> char_class() {
    ++i_;
    const bool negated = peek('^') ? (++i_, true) : false;
    Ranges set;
    // One class atom: a code point (single) or a set (\d ...).
    auto class_atom = [&](Ranges& out, bool& single) -> Status {
      if (peek('\\')) {
        const uint32_t e = i_ + 1 < p_.size() ? p_[i_ + 1] : 0;  // \d and friends are sets, even of one range
        MOE_ASSIGN_OR_RETURN(out, escape(true));
        single = out.size() == 1 && out[0].first == out[0].second &&
                 std::u32string_view(U"dDwWsS").find(static_cast<char32_t>(e)) == std::u32string_view::npos;
        return Status::ok();
      }
      out = {{p_[i_], p_[i_]}};
      ++i_;
      single = true;
      return Status::ok();
    };
    while (true) {
      if (i_ >= p_.size()) return error("unterminated character class");
      if (peek(']')) break;
      Ranges first;
      bool first_single = false;
      MOE_RETURN_IF_ERROR(class_atom(first, first_single));
      if (peek('-') && i_ + 1 < p_.size() && p_[i_ + 1] != ']') {
        ++i_;
        Ranges last;
        bool last_single = false;
        MOE_RETURN_IF_ERROR(class_atom(last, last_single));
        if (!first_single || !last_single) return error("a class range between sets");
        if (last[0].first < first[0].first) return error("a class range out of order");
        set.emplace_back(first[0].first, last[0].first);
        continue;
      }
      set.insert(set.end(), first.begin(), first.end());
    }
    ++i_;  // ']'
    set = normalized(set);
    return add({.kind = Ast::kSet, .set = negated ? complement(set) : set});
  }

  static constexpr int kMaxGroupDepth = 64;
  std::vector<uint32_t> p_;
  bool valid_;
  int depth_ = 0;
  RegexMatch match_;
  size_t i_ = 0;
  std::vector<Ast> nodes_;
};

// Thompson's construction: states with epsilon edges and code point range edges.
class Nfa {
 public:
  struct State {
    std::vector<int> eps;
    std::vector<std::pair<int, int>> edges;  // (range index into ranges_, target)
  };

  explicit Nfa(const std::vector<Ast>& ast) : ast_(ast) {}

  // The fragment of node `n`: (start, end) states.
  Expected<std::pair<int, int>> emit(int n) {
    const Ast& a = ast_[static_cast<size_t>(n)];
    const int s = state(), e = state();
    if (states_.size() > kMaxNfaStates) return invalid_argument("regular expression: too large");
    switch (a.kind) {
      case Ast::kSet:  // without surrogates: text holds them only in pairs, as one code point
        for (auto [lo, hi] : a.set) {
          for (const auto& [from, to] : {std::pair{lo, std::min(hi, 0xD7FFu)}, std::pair{std::max(lo, 0xE000u), hi}}) {
            if (from > to) continue;
            ranges_.emplace_back(from, to);
            states_[static_cast<size_t>(s)].edges.emplace_back(static_cast<int>(ranges_.size()) - 1, e);
          }
        }
        break;
      case Ast::kConcat: {
        int at = s;
        for (int child : a.children) {
          MOE_ASSIGN_OR_RETURN(auto f, emit(child));
          link(at, f.first);
          at = f.second;
        }
        link(at, e);
        break;
      }
      case Ast::kAlt:
        for (int child : a.children) {
          MOE_ASSIGN_OR_RETURN(auto f, emit(child));
          link(s, f.first);
          link(f.second, e);
        }
        break;
      case Ast::kRepeat: {
        int at = s;
        for (int k = 0; k < a.min; ++k) {
          MOE_ASSIGN_OR_RETURN(auto f, emit(a.children[0]));
          link(at, f.first);
          at = f.second;
        }
        if (a.max < 0) {  // then any number more: a loop
          MOE_ASSIGN_OR_RETURN(auto f, emit(a.children[0]));
          link(at, f.first);
          link(f.second, at);
          link(at, e);
        } else {
          for (int k = a.min; k < a.max; ++k) {  // optional copies, each may end the repeat
            link(at, e);
            MOE_ASSIGN_OR_RETURN(auto f, emit(a.children[0]));
            link(at, f.first);
            at = f.second;
          }
          link(at, e);
        }
        break;
      }
    }
    return std::pair{s, e};
  }

  const std::vector<State>& states() const { return states_; }
  const Ranges& ranges() const { return ranges_; }

 private:
  int state() {
    states_.emplace_back();
    return static_cast<int>(states_.size()) - 1;
  }
  void link(int from, int to) { states_[static_cast<size_t>(from)].eps.push_back(to); }

  const std::vector<Ast>& ast_;
  std::vector<State> states_;
  Ranges ranges_;
};

}  // namespace

Expected<Regex> Regex::compile(std::string_view pattern, RegexMatch match) {
  Parser parser(pattern, match);
  MOE_ASSIGN_OR_RETURN(const int root, parser.parse());
  Nfa nfa(parser.nodes());
  MOE_ASSIGN_OR_RETURN(const auto fragment, nfa.emit(root));
  const auto& states = nfa.states();
  // The code point intervals no range edge splits.
  std::vector<uint32_t> bounds = {0, kMaxCodePoint + 1};
  for (const auto& [lo, hi] : nfa.ranges()) bounds.push_back(lo), bounds.push_back(hi + 1);
  std::sort(bounds.begin(), bounds.end());
  bounds.erase(std::unique(bounds.begin(), bounds.end()), bounds.end());
  const size_t intervals = bounds.size() - 1;
  auto interval_of = [&](uint32_t cp) {
    return static_cast<size_t>(std::upper_bound(bounds.begin(), bounds.end(), cp) - bounds.begin()) - 1;
  };
  // The work of the construction is bounded (the states' sets read, summed),
  // so that a hostile pattern costs at most ~0.1 s to refuse.
  size_t work = 0;
  std::vector<uint32_t> seen(states.size(), 0);
  uint32_t stamp = 0;
  auto closure = [&](std::vector<int> set) {
    ++stamp;
    for (int s : set) seen[static_cast<size_t>(s)] = stamp;
    for (size_t k = 0; k < set.size(); ++k)
      for (int t : states[static_cast<size_t>(set[k])].eps)
        if (std::exchange(seen[static_cast<size_t>(t)], stamp) != stamp) set.push_back(t);
    std::sort(set.begin(), set.end());
    work += set.size();
    return set;
  };
  // Subset construction.
  std::map<std::vector<int>, int32_t> ids;
  std::vector<std::vector<int>> sets = {closure({fragment.first})};
  ids.emplace(sets[0], 0);
  std::vector<int32_t> next;
  for (size_t d = 0; d < sets.size(); ++d) {
    std::vector<std::vector<int>> by_interval(intervals);
    for (int s : sets[d]) {
      for (const auto& [range, target] : states[static_cast<size_t>(s)].edges) {
        const auto& [lo, hi] = nfa.ranges()[static_cast<size_t>(range)];
        for (size_t k = interval_of(lo); k < intervals && bounds[k] <= hi; ++k) by_interval[k].push_back(target);
      }
    }
    for (size_t k = 0; k < intervals; ++k) {
      if (by_interval[k].empty()) {
        next.push_back(-1);
        continue;
      }
      std::vector<int> set = closure(std::move(by_interval[k]));
      if (work > kMaxWork)
        return invalid_argument("regular expression: too complex (its automaton takes too long to build)");
      auto [it, added] = ids.emplace(set, static_cast<int32_t>(sets.size()));
      if (added) {
        if (static_cast<int32_t>(sets.size()) >= kMaxRegexStates || (sets.size() + 1) * intervals > kMaxTableEntries)
          return invalid_argument("regular expression: too complex (more than {} automaton states)", kMaxRegexStates);
        sets.push_back(std::move(set));
      }
      next.push_back(it->second);
    }
  }
  // Keep the states from which an accepting one is reachable.
  const size_t n = sets.size();
  std::vector<uint8_t> live(n, 0);
  for (size_t d = 0; d < n; ++d) live[d] = std::binary_search(sets[d].begin(), sets[d].end(), fragment.second);
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t d = 0; d < n; ++d) {
      if (live[d]) continue;
      for (size_t k = 0; k < intervals && !live[d]; ++k) {
        const int32_t t = next[d * intervals + k];
        if (t >= 0 && live[static_cast<size_t>(t)]) live[d] = 1, changed = true;
      }
    }
  }
  if (!live[0]) return invalid_argument("regular expression: it matches no string");
  std::vector<int32_t> renumber(n, -1);
  Regex r;
  for (size_t d = 0; d < n; ++d)
    if (live[d]) renumber[d] = static_cast<int32_t>(r.accepting_.size()), r.accepting_.push_back(0);
  r.bounds_.assign(bounds.begin(), bounds.end() - 1);
  for (uint32_t c = 0; c < r.ascii_interval_.size(); ++c)
    r.ascii_interval_[c] = static_cast<int32_t>(std::upper_bound(r.bounds_.begin(), r.bounds_.end(), c) - r.bounds_.begin()) - 1;
  r.next_.assign(r.accepting_.size() * intervals, -1);
  for (size_t d = 0; d < n; ++d) {
    if (!live[d]) continue;
    const auto to = static_cast<size_t>(renumber[d]);
    r.accepting_[to] = std::binary_search(sets[d].begin(), sets[d].end(), fragment.second);
    for (size_t k = 0; k < intervals; ++k) {
      const int32_t t = next[d * intervals + k];
      r.next_[to * intervals + k] = t >= 0 ? renumber[static_cast<size_t>(t)] : -1;
    }
  }
  // The fewest code points to an accepting state (breadth first, backwards)
  // and the most (unbounded from any state that reaches a cycle: every state
  // left reaches an accepting one).
  const size_t m = r.accepting_.size();
  std::vector<std::vector<int32_t>> into(m), out(m);
  for (size_t d = 0; d < m; ++d) {
    for (size_t k = 0; k < intervals; ++k) {
      const int32_t t = r.next_[d * intervals + k];
      if (t < 0) continue;
      if (out[d].empty() || out[d].back() != t) out[d].push_back(t);
      if (into[static_cast<size_t>(t)].empty() || into[static_cast<size_t>(t)].back() != static_cast<int32_t>(d))
        into[static_cast<size_t>(t)].push_back(static_cast<int32_t>(d));
    }
  }
  r.min_left_.assign(m, INT32_MAX);
  std::vector<int32_t> queue;
  for (size_t d = 0; d < m; ++d)
    if (r.accepting_[d]) r.min_left_[d] = 0, queue.push_back(static_cast<int32_t>(d));
  for (size_t q = 0; q < queue.size(); ++q)
    for (int32_t from : into[static_cast<size_t>(queue[q])])
      if (r.min_left_[static_cast<size_t>(from)] == INT32_MAX)
        r.min_left_[static_cast<size_t>(from)] = r.min_left_[static_cast<size_t>(queue[q])] + 1, queue.push_back(from);
  r.most_min_left_ = *std::max_element(r.min_left_.begin(), r.min_left_.end());  // (every state is live)
  // Longest paths by depth-first search; a state met again on the path is a cycle.
  r.max_left_.assign(m, -1);
  std::vector<uint8_t> on_path(m, 0);
  std::vector<std::pair<int32_t, size_t>> stack;
  for (size_t root = 0; root < m; ++root) {
    if (r.max_left_[root] >= 0) continue;
    stack.emplace_back(static_cast<int32_t>(root), 0);
    on_path[root] = 1;
    while (!stack.empty()) {
      auto& [d, i] = stack.back();
      const auto du = static_cast<size_t>(d);
      if (i < out[du].size()) {
        const int32_t t = out[du][i++];
        const auto tu = static_cast<size_t>(t);
        if (on_path[tu]) {
          r.max_left_[du] = INT32_MAX;
        } else if (r.max_left_[tu] < 0) {
          on_path[tu] = 1;
          stack.emplace_back(t, 0);
        }
        continue;
      }
      int32_t most = r.accepting_[du] ? 0 : -1;
      for (int32_t t : out[du]) {
        const int32_t left = r.max_left_[static_cast<size_t>(t)];
        most = left == INT32_MAX || most == INT32_MAX ? INT32_MAX : std::max(most, left + 1);
      }
      if (r.max_left_[du] != INT32_MAX) r.max_left_[du] = most;
      on_path[du] = 0;
      stack.pop_back();
    }
  }
  return r;
}

bool Regex::viable(int32_t state, int32_t used, int32_t min_length, int32_t max_length) const {
  if (state < 0) return false;
  const auto s = static_cast<size_t>(state);
  if (max_length >= 0 && static_cast<int64_t>(used) + min_left_[s] > max_length) return false;
  return max_left_[s] == INT32_MAX || static_cast<int64_t>(used) + max_left_[s] >= min_length;
}

int32_t Regex::step(int32_t state, uint32_t code_point) const {
  if (state < 0 || code_point > kMaxCodePoint) return -1;
  const auto k = code_point < ascii_interval_.size()
                     ? static_cast<size_t>(ascii_interval_[code_point])
                     : static_cast<size_t>(std::upper_bound(bounds_.begin(), bounds_.end(), code_point) - bounds_.begin()) - 1;
  return next_[static_cast<size_t>(state) * bounds_.size() + k];
}

bool Regex::allows(int32_t state, uint32_t lo, uint32_t hi, int32_t used, int32_t min_length,
                   int32_t max_length) const {
  if (state < 0 || lo > hi || lo > kMaxCodePoint) return false;
  const size_t intervals = bounds_.size();
  auto k = static_cast<size_t>(std::upper_bound(bounds_.begin(), bounds_.end(), lo) - bounds_.begin()) - 1;
  for (; k < intervals && bounds_[k] <= hi; ++k)
    if (viable(next_[static_cast<size_t>(state) * intervals + k], used, min_length, max_length)) return true;
  return false;
}

bool Regex::matches(std::string_view text) const {
  std::vector<uint32_t> cps;
  if (!code_points(text, cps)) return false;
  int32_t state = start();
  for (uint32_t cp : cps)
    if ((state = step(state, cp)) < 0) return false;
  return accepting(state);
}

std::string_view format_pattern(std::string_view format) {
  // RFC 3339 (upper-case T and Z); the day is 01-31 whatever the month.
#define MOE_DATE "[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
#define MOE_TIME "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,9})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
#define MOE_LABEL "[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
#define MOE_ATOM "[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"
  // RFC 4291's text forms without an embedded IPv4 address: eight groups, or fewer around one "::".
#define MOE_H16 "[0-9a-fA-F]{1,4}"
#define MOE_IPV6                                                                                               \
  "((" MOE_H16 ":){7}" MOE_H16 "|(" MOE_H16 ":){1,7}:|(" MOE_H16 ":){1,6}:" MOE_H16 "|(" MOE_H16 ":){1,5}(:" \
  MOE_H16 "){1,2}|(" MOE_H16 ":){1,4}(:" MOE_H16 "){1,3}|(" MOE_H16 ":){1,3}(:" MOE_H16 "){1,4}|(" MOE_H16  \
  ":){1,2}(:" MOE_H16 "){1,5}|" MOE_H16 ":(:" MOE_H16 "){1,6}|:((:" MOE_H16 "){1,7}|:))"
  // RFC 3986: scheme://host[:port][/path][?query][#fragment], or scheme:path (no user info, no IP literal).
#define MOE_PCT "%[0-9A-Fa-f]{2}"
#define MOE_PCHAR "([A-Za-z0-9._~!$&'()*+,;=:@-]|" MOE_PCT ")"
#define MOE_TAIL "(\\?([A-Za-z0-9._~!$&'()*+,;=:@/?-]|" MOE_PCT ")*)?(#([A-Za-z0-9._~!$&'()*+,;=:@/?-]|" MOE_PCT ")*)?"
#define MOE_URI                                                                                                   \
  "[A-Za-z][A-Za-z0-9+.-]*:(//([A-Za-z0-9._~!$&'()*+,;=-]|" MOE_PCT ")+(:[0-9]{1,5})?(/" MOE_PCHAR "*)*|" MOE_PCHAR \
  "+(/" MOE_PCHAR "*)*)" MOE_TAIL
  // RFC 3339 appendix A (ISO 8601 durations, whole numbers): PnYnMnDTnHnMnS with at least one part, or PnW.
#define MOE_DURATION_DATE "([0-9]+Y([0-9]+M)?([0-9]+D)?|[0-9]+M([0-9]+D)?|[0-9]+D)"
#define MOE_DURATION_TIME "T([0-9]+H([0-9]+M)?([0-9]+S)?|[0-9]+M([0-9]+S)?|[0-9]+S)"
  static const std::pair<std::string_view, std::string_view> kFormats[] = {
      {"date", "^" MOE_DATE "$"},
      {"time", "^" MOE_TIME "$"},
      {"date-time", "^" MOE_DATE "T" MOE_TIME "$"},
      {"uuid", "^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"},
      {"email", "^" MOE_ATOM "(\\." MOE_ATOM ")*@" MOE_LABEL "(\\." MOE_LABEL ")+$"},
      {"ipv4", "^((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\\.){3}(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])$"},
      {"hostname", "^" MOE_LABEL "(\\." MOE_LABEL ")*$"},
      {"ipv6", "^" MOE_IPV6 "$"},
      {"uri", "^" MOE_URI "$"},
      {"duration", "^P(" MOE_DURATION_DATE "(" MOE_DURATION_TIME ")?|" MOE_DURATION_TIME "|[0-9]+W)$"},
  };
#undef MOE_DATE
#undef MOE_TIME
#undef MOE_LABEL
#undef MOE_ATOM
#undef MOE_H16
#undef MOE_IPV6
#undef MOE_PCT
#undef MOE_PCHAR
#undef MOE_TAIL
#undef MOE_URI
#undef MOE_DURATION_DATE
#undef MOE_DURATION_TIME
  for (const auto& [name, pattern] : kFormats)
    if (name == format) return pattern;
  return {};
}

}  // namespace moe::structured
