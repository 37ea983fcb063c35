#include "structured/cfg.h"

#include <algorithm>
#include <map>
#include <utility>

#include <fmt/format.h>

#include "structured/regex.h"
#include "tokenizer/utf8.h"

namespace moe::structured {

using Symbol = Cfg::Symbol;
using SymbolKind = Cfg::SymbolKind;

// Reads the EBNF text into rules of alternatives of symbol sequences, then
// lays them out (Cfg's compiled form) and checks them.
class EbnfParser {
 public:
  explicit EbnfParser(std::string_view text) : text_(text) {}

  Expected<Cfg> parse() {
    if (text_.size() > kMaxGrammarBytes) return invalid_argument("a grammar is longer than {} bytes", kMaxGrammarBytes);
    if (!tokenizer::is_valid_utf8(text_)) return invalid_argument("a grammar must be UTF-8 text");
    for (skip_space(); pos_ < text_.size(); skip_space()) {
      const std::string name = read_name();
      if (name.empty()) return error("a rule name");
      skip_space();
      if (text_.substr(pos_, 3) != "::=") return error("'::=' after the rule name '" + name + "'");
      pos_ += 3;
      const int32_t rule = rule_id(name);
      if (defined_[static_cast<size_t>(rule)]) return invalid_argument("grammar: the rule '{}' is defined twice", name);
      defined_[static_cast<size_t>(rule)] = 1;
      auto alternatives = read_alternatives(false);
      if (!alternatives) return alternatives.status();
      rules_[static_cast<size_t>(rule)] = std::move(*alternatives);
    }
    for (size_t r = 0; r < names_.size(); ++r)
      if (!defined_[r]) return invalid_argument("grammar: the rule '{}' is used but not defined", names_[r]);
    const auto root = ids_.find("root");
    if (root == ids_.end()) return invalid_argument("grammar: no 'root' rule (the output is derived from root)");
    return lay_out(root->second);
  }

 private:
  using Sequence = std::vector<Symbol>;

  Status error(const std::string& expected) const {
    const size_t line = static_cast<size_t>(std::count(text_.begin(), text_.begin() + static_cast<ptrdiff_t>(pos_), '\n')) + 1;
    if (pos_ >= text_.size()) return invalid_argument("grammar: expected {} at the end (line {})", expected, line);
    return invalid_argument("grammar: expected {} at line {}, near '{}'", expected, line, text_.substr(pos_, 16));
  }

  void skip_space() {
    while (pos_ < text_.size()) {
      const char c = text_[pos_];
      if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
        ++pos_;
      } else if (c == '#') {
        while (pos_ < text_.size() && text_[pos_] != '\n') ++pos_;
      } else {
        break;
      }
    }
  }

  static bool name_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
  }
  std::string read_name() {
    const size_t begin = pos_;
    while (pos_ < text_.size() && name_char(text_[pos_])) ++pos_;
    return std::string(text_.substr(begin, pos_ - begin));
  }
  // Whether `name ::=` begins here: the next rule.
  bool at_rule_start() {
    const size_t saved = pos_;
    const bool start = !read_name().empty() && (skip_space(), text_.substr(pos_, 3) == "::=");
    pos_ = saved;
    return start;
  }

  int32_t rule_id(const std::string& name) {
    const auto [it, added] = ids_.emplace(name, static_cast<int32_t>(names_.size()));
    if (added) {
      names_.push_back(name);
      defined_.push_back(0);
      rules_.emplace_back();
    }
    return it->second;
  }
  int32_t anonymous_rule(std::vector<Sequence> alternatives, std::string what) {
    const auto id = static_cast<int32_t>(names_.size());
    names_.push_back(std::move(what));
    defined_.push_back(1);
    rules_.push_back(std::move(alternatives));
    return id;
  }
  int32_t class_id(Ranges set) {
    set = normalized(std::move(set));
    const auto [it, added] = class_ids_.emplace(set, static_cast<int32_t>(classes_.size()));
    if (added) classes_.push_back(std::move(set));
    return it->second;
  }

  Expected<std::vector<Sequence>> read_alternatives(bool nested) {
    if (++depth_ > 64) return invalid_argument("grammar: groups nest deeper than 64");
    std::vector<Sequence> alternatives;
    for (;;) {
      auto sequence = read_sequence();
      if (!sequence) return sequence.status();
      alternatives.push_back(std::move(*sequence));
      skip_space();
      if (pos_ < text_.size() && text_[pos_] == '|') {
        ++pos_;
        continue;
      }
      break;
    }
    if (nested) {
      if (pos_ >= text_.size() || text_[pos_] != ')') return error("')'");
      ++pos_;
    }
    --depth_;
    return alternatives;
  }

  Expected<Sequence> read_sequence() {
    Sequence sequence;
    for (;;) {
      skip_space();
      if (pos_ >= text_.size() || text_[pos_] == '|' || text_[pos_] == ')' || at_rule_start()) return sequence;
      auto item = read_item();
      if (!item) return item.status();
      sequence.insert(sequence.end(), item->begin(), item->end());
      if ((symbols_ += item->size()) > kMaxGrammarSymbols)
        return invalid_argument("grammar: more than {} symbols once repetitions are expanded", kMaxGrammarSymbols);
    }
  }

  // An item with its repetitions.
  Expected<Sequence> read_item() {
    const size_t begin = pos_;
    auto unit = read_primary();
    if (!unit) return unit.status();
    for (;;) {
      if (pos_ >= text_.size()) return unit;
      const char op = text_[pos_];
      if (op != '*' && op != '+' && op != '?' && op != '{') return unit;
      ++pos_;
      int min = 0, max = -1;
      if (op == '+') min = 1;
      if (op == '?') max = 1;
      if (op == '{') {
        auto read_count = [&](int& n) {
          skip_space();
          const size_t digits = pos_;
          n = 0;
          while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9')
            n = std::min(n * 10 + (text_[pos_++] - '0'), 1 << 20);
          skip_space();
          return pos_ > digits;
        };
        if (!read_count(min)) return error("a count after '{'");
        max = min;
        if (pos_ < text_.size() && text_[pos_] == ',') {
          ++pos_;
          if (!read_count(max)) max = -1;
        }
        if (pos_ >= text_.size() || text_[pos_] != '}') return error("'}'");
        ++pos_;
        if (min > kMaxRegexRepeat || max > kMaxRegexRepeat)
          return invalid_argument("grammar: a repeat count above {}", kMaxRegexRepeat);
        if (max >= 0 && max < min) return invalid_argument("grammar: a repeat {{{},{}}} whose maximum is below its minimum", min, max);
      }
      unit = repeat(std::move(*unit), min, max, text_.substr(begin, pos_ - begin));
    }
  }

  // `unit` min to max times (max -1: any number).
  Sequence repeat(Sequence unit, int min, int max, std::string_view what) {
    const std::string name = fmt::format("{}", what.substr(0, 40));
    Symbol one = unit.size() == 1 ? unit[0] : Symbol{SymbolKind::kRule, anonymous_rule({unit}, name)};
    Sequence out(static_cast<size_t>(min), one);
    if (max < 0) {  // R ::= one R | ""
      const auto r = static_cast<int32_t>(names_.size());
      anonymous_rule({{one, Symbol{SymbolKind::kRule, r}}, {}}, name);
      out.push_back({SymbolKind::kRule, r});
      stars_.push_back(r);
    } else if (max > min) {  // O_1 ::= one O_2 | "", ..., O_k ::= one | ""
      Symbol next{};
      for (int k = max - min; k >= 1; --k) {
        Sequence taken{one};
        if (next.kind == SymbolKind::kRule) taken.push_back(next);
        next = {SymbolKind::kRule, anonymous_rule({taken, {}}, name)};
      }
      out.push_back(next);
    }
    symbols_ += out.size() + 2 * static_cast<size_t>(std::max(0, max - min));
    return out;
  }

  Expected<Sequence> read_primary() {
    const char c = text_[pos_];
    if (c == '"') {
      ++pos_;
      Sequence literal;
      for (;;) {
        if (pos_ >= text_.size()) return error("the string's closing '\"'");
        if (text_[pos_] == '"') break;
        auto cp = read_char();
        if (!cp) return cp.status();
        literal.push_back({SymbolKind::kClass, class_id({{*cp, *cp}})});
      }
      ++pos_;
      return literal;
    }
    if (c == '[') {
      ++pos_;
      const bool negated = pos_ < text_.size() && text_[pos_] == '^';
      if (negated) ++pos_;
      Ranges set;
      for (;;) {
        if (pos_ >= text_.size()) return error("the class's closing ']'");
        if (text_[pos_] == ']') break;
        auto lo = read_char();
        if (!lo) return lo.status();
        uint32_t hi = *lo;
        if (pos_ + 1 < text_.size() && text_[pos_] == '-' && text_[pos_ + 1] != ']') {
          ++pos_;
          auto end = read_char();
          if (!end) return end.status();
          if (*end < *lo) return error("a range whose end is not below its start");
          hi = *end;
        }
        set.emplace_back(*lo, hi);
      }
      ++pos_;
      if (negated) set = complement(set);
      return Sequence{{SymbolKind::kClass, class_id(std::move(set))}};
    }
    if (c == '.') {
      ++pos_;
      return Sequence{{SymbolKind::kClass, class_id({{0, kMaxCodePoint}})}};
    }
    if (c == '(') {
      ++pos_;
      const size_t begin = pos_ - 1;
      auto alternatives = read_alternatives(true);
      if (!alternatives) return alternatives.status();
      if (alternatives->size() == 1) return std::move((*alternatives)[0]);
      return Sequence{{SymbolKind::kRule, anonymous_rule(std::move(*alternatives),
                                                          std::string(text_.substr(begin, std::min<size_t>(pos_ - begin, 40))))}};
    }
    if (name_char(c)) return Sequence{{SymbolKind::kRule, rule_id(read_name())}};
    return error("a string, a class, '.', a rule's name or '('");
  }

  // One character of a string or a class, escapes decoded.
  Expected<uint32_t> read_char() {
    if (text_[pos_] != '\\') {
      char32_t cp;
      pos_ += tokenizer::decode_utf8(text_, pos_, cp);
      return static_cast<uint32_t>(cp);
    }
    if (++pos_ >= text_.size()) return error("an escaped character");
    const char e = text_[pos_++];
    switch (e) {
      case 'n': return uint32_t{'\n'};
      case 'r': return uint32_t{'\r'};
      case 't': return uint32_t{'\t'};
      case '\\': case '"': case '\'': case ']': case '[': case '-': case '^': case '/': return static_cast<uint32_t>(e);
      case 'x': case 'u': case 'U': {
        const int digits = e == 'x' ? 2 : e == 'u' ? 4 : 8;
        uint32_t v = 0;
        for (int i = 0; i < digits; ++i, ++pos_) {
          const char h = pos_ < text_.size() ? text_[pos_] : '\0';
          const int d = h >= '0' && h <= '9' ? h - '0' : (h | 0x20) >= 'a' && (h | 0x20) <= 'f' ? (h | 0x20) - 'a' + 10 : -1;
          if (d < 0) return error(fmt::format("{} hex digits after '\\{}'", digits, e));
          v = v * 16 + static_cast<uint32_t>(d);
        }
        if (v > kMaxCodePoint || (v >= 0xD800 && v <= 0xDFFF)) return error("a Unicode scalar value");
        return v;
      }
      default:
        --pos_;
        return error("a known escape (\\n \\r \\t \\\\ \\\" \\' \\] \\[ \\- \\^ \\xHH \\uHHHH \\UHHHHHHHH)");
    }
  }

  // Nullable rules (those that may derive the empty string), to a fixed point.
  std::vector<uint8_t> nullable_rules() const {
    std::vector<uint8_t> nullable(rules_.size(), 0);
    for (bool changed = true; changed;) {
      changed = false;
      for (size_t r = 0; r < rules_.size(); ++r) {
        if (nullable[r]) continue;
        for (const Sequence& alt : rules_[r]) {
          if (std::all_of(alt.begin(), alt.end(), [&](const Symbol& s) {
                return s.kind == SymbolKind::kRule && nullable[static_cast<size_t>(s.id)];
              })) {
            nullable[r] = 1, changed = true;
            break;
          }
        }
      }
    }
    return nullable;
  }

  // A repetition of something that may be empty, R ::= one R | "", would
  // begin with itself; R ::= one' R | "" derives the same strings, where
  // one' derives what `one` does but the empty string. one' of a rule that
  // may be empty is a new rule: each alternative s1 ... sn becomes
  // s1' s2 ... sn | s2' s3 ... sn | ... up to the first si that cannot be
  // empty (which is its own si'). Built with a work list, not recursion.
  Status repeat_non_empty() {
    std::vector<uint8_t> nullable = nullable_rules();
    std::map<int32_t, int32_t> made;  // rule -> its non-empty rule
    std::vector<int32_t> work;
    auto non_empty = [&](const Symbol& s) -> Symbol {
      if (s.kind != SymbolKind::kRule || !nullable[static_cast<size_t>(s.id)]) return s;
      auto [it, added] = made.emplace(s.id, static_cast<int32_t>(names_.size()));
      if (added) {
        anonymous_rule({}, names_[static_cast<size_t>(s.id)] + " (once not empty)");
        nullable.push_back(0);
        work.push_back(s.id);
      }
      return {SymbolKind::kRule, it->second};
    };
    for (const int32_t r : stars_) {
      Sequence& loop = rules_[static_cast<size_t>(r)][0];
      loop[0] = non_empty(loop[0]);
    }
    while (!work.empty()) {
      const int32_t from = work.back();
      work.pop_back();
      std::vector<Sequence> alternatives;
      for (const Sequence& alt : std::vector<Sequence>(rules_[static_cast<size_t>(from)])) {
        for (size_t i = 0; i < alt.size(); ++i) {
          Sequence taken{non_empty(alt[i])};
          taken.insert(taken.end(), alt.begin() + static_cast<ptrdiff_t>(i) + 1, alt.end());
          if ((symbols_ += taken.size()) > kMaxGrammarSymbols)
            return invalid_argument("grammar: more than {} symbols once repetitions of what may be empty are "
                                    "expanded", kMaxGrammarSymbols);
          alternatives.push_back(std::move(taken));
          if (alt[i].kind != SymbolKind::kRule || !nullable[static_cast<size_t>(alt[i].id)]) break;
        }
      }
      rules_[static_cast<size_t>(made[from])] = std::move(alternatives);
    }
    return Status::ok();
  }

  // Drops alternatives that derive no string, checks for left recursion, and
  // lays the rules out in Cfg's form.
  Expected<Cfg> lay_out(int32_t root) {
    MOE_RETURN_IF_ERROR(repeat_non_empty());
    const size_t n = rules_.size();
    auto symbol_ok = [&](const Symbol& s, const std::vector<uint8_t>& rule_ok) {
      return s.kind == SymbolKind::kClass ? !classes_[static_cast<size_t>(s.id)].empty()
                                          : rule_ok[static_cast<size_t>(s.id)] != 0;
    };
    // Productive rules (some alternative of productive symbols), to a fixed point.
    std::vector<uint8_t> productive(n, 0);
    for (bool changed = true; changed;) {
      changed = false;
      for (size_t r = 0; r < n; ++r) {
        if (productive[r]) continue;
        for (const Sequence& alt : rules_[r]) {
          if (std::all_of(alt.begin(), alt.end(), [&](const Symbol& s) { return symbol_ok(s, productive); })) {
            productive[r] = 1, changed = true;
            break;
          }
        }
      }
    }
    if (!productive[static_cast<size_t>(root)]) return invalid_argument("grammar: root derives no string");
    for (auto& alternatives : rules_)
      std::erase_if(alternatives, [&](const Sequence& alt) {
        return !std::all_of(alt.begin(), alt.end(), [&](const Symbol& s) { return symbol_ok(s, productive); });
      });
    const std::vector<uint8_t> nullable = nullable_rules();
    // Left recursion: a cycle among "may begin with" edges (a rule after
    // nullable ones in an alternative may begin it too), by depth-first search.
    std::vector<std::vector<int32_t>> begins(n);
    for (size_t r = 0; r < n; ++r)
      for (const Sequence& alt : rules_[r])
        for (const Symbol& s : alt) {
          if (s.kind != SymbolKind::kRule) break;
          begins[r].push_back(s.id);
          if (!nullable[static_cast<size_t>(s.id)]) break;
        }
    std::vector<uint8_t> color(n, 0);  // 0 unseen, 1 on the path, 2 done
    for (size_t first = 0; first < n; ++first) {
      if (color[first]) continue;
      std::vector<std::pair<int32_t, size_t>> stack{{static_cast<int32_t>(first), 0}};
      color[first] = 1;
      while (!stack.empty()) {
        auto& [r, edge] = stack.back();
        const auto& next = begins[static_cast<size_t>(r)];
        if (edge == next.size()) {
          color[static_cast<size_t>(r)] = 2;
          stack.pop_back();
          continue;
        }
        const int32_t to = next[edge++];
        if (color[static_cast<size_t>(to)] == 1)
          return invalid_argument("grammar: left recursion: the rule '{}' may begin with itself", names_[static_cast<size_t>(to)]);
        if (color[static_cast<size_t>(to)] == 0) {
          color[static_cast<size_t>(to)] = 1;
          stack.emplace_back(to, 0);
        }
      }
    }
    Cfg cfg;
    cfg.symbols_ = {{SymbolKind::kRule, root}, {SymbolKind::kEnd, -1}};
    cfg.rules_.resize(n);
    for (size_t r = 0; r < n; ++r)
      for (const Sequence& alt : rules_[r]) {
        cfg.rules_[r].push_back(static_cast<int32_t>(cfg.symbols_.size()));
        cfg.symbols_.insert(cfg.symbols_.end(), alt.begin(), alt.end());
        cfg.symbols_.push_back({SymbolKind::kEnd, -1});
      }
    cfg.classes_ = std::move(classes_);
    cfg.nullable_from_.assign(cfg.symbols_.size(), 0);
    for (size_t p = cfg.symbols_.size(); p-- > 0;) {
      const Symbol& s = cfg.symbols_[p];
      cfg.nullable_from_[p] = s.kind == SymbolKind::kEnd ||
                              (s.kind == SymbolKind::kRule && nullable[static_cast<size_t>(s.id)] && cfg.nullable_from_[p + 1]);
    }
    return cfg;
  }

  std::string_view text_;
  size_t pos_ = 0;
  int depth_ = 0;
  size_t symbols_ = 0;
  std::map<std::string, int32_t> ids_;
  std::vector<std::string> names_;  // anonymous rules: their text, for errors
  std::vector<uint8_t> defined_;
  std::vector<std::vector<Sequence>> rules_;
  std::vector<int32_t> stars_;  // the rules R ::= one R | "" of unbounded repetitions
  std::vector<Ranges> classes_;
  std::map<Ranges, int32_t> class_ids_;
};

Expected<Cfg> Cfg::compile(std::string_view text) {
  auto cfg = EbnfParser(text).parse();
  if (!cfg) return cfg;
  std::vector<int32_t> start{0};
  if (!cfg->way_on(start))
    return invalid_argument("grammar: its rules nest deeper than {} before the first character", kMaxGrammarDepth);
  return cfg;
}

bool Cfg::way_on(std::vector<int32_t>& positions) const {
  int32_t budget = kWayOnBudget;
  return way_on(positions, budget);
}

// Depth first over the expansions of the top position: a character class or
// an empty stack ends the search; a rule is tried alternative by alternative.
// `positions` is as it came on return.
bool Cfg::way_on(std::vector<int32_t>& positions, int32_t& budget) const {
  if (positions.empty() || --budget < 0) return true;
  const int32_t p = positions.back();
  const Symbol& s = symbol(p);
  if (s.kind == SymbolKind::kClass) return true;
  if (s.kind == SymbolKind::kEnd) {  // the rule is whole: its caller goes on
    positions.pop_back();
    const bool on = way_on(positions, budget);
    positions.push_back(p);
    return on;
  }
  const bool tail = symbol(p + 1).kind == SymbolKind::kEnd;
  if (!tail && static_cast<int32_t>(positions.size()) >= kMaxGrammarDepth) return false;
  bool on = false;
  for (const int32_t alt : alternatives(s.id)) {
    if (tail) {
      positions.back() = alt;
    } else {
      positions.back() = p + 1;
      positions.push_back(alt);
    }
    on = way_on(positions, budget);
    if (!tail) positions.pop_back();
    positions.back() = p;
    if (on) break;
  }
  return on;
}

}  // namespace moe::structured
