// Context-free grammars for structured outputs: vLLM's guided_grammar (and
// structured_outputs.grammar) in the EBNF that xgrammar and llama.cpp's GBNF
// read, compiled to rules over code points that the matcher
// (structured/matcher.h) follows with one stack of positions per reading of
// the output, as llama.cpp's grammar sampler does.
//
// Syntax: rules `name ::= alternatives` (names of letters, digits, '_' and
// '-'); the output is derived from `root`; a rule runs until the next
// `name ::=`, so newlines are whitespace. Alternatives `a | b`; each a
// sequence of items; an item is a string "..." (escapes \n \r \t \" \\ \'
// \xHH \uHHHH \UHHHHHHHH), a character class [...] (ranges a-z, [^...] its
// complement, the same escapes and \] \[ \- \^), `.` (any character), a
// rule's name, or ( alternatives ), each optionally followed by *, +, ? or
// {m}, {m,}, {m,n} (m, n at most kMaxRegexRepeat). `#` starts a comment.
// Refused with an error naming it: a rule used but not defined or defined
// twice, no `root`, left recursion (a rule that may begin with itself: its
// stack would grow without reading), a grammar that derives no string, and
// grammars past the limits below. A repetition of something that may be
// empty (("a"? "b"?)*) repeats its non-empty part, which derives the same
// strings without beginning with itself. Alternatives that derive no string are
// dropped, so that every reading the matcher follows can finish: a
// constrained model never meets a dead end.
//
// Compiled form: every rule's alternatives are runs of symbols in one array,
// each run closed by kEnd; a symbol is a character class or a rule. Position
// 0 holds the start: root, then kEnd. A reading is a stack of positions (the
// symbol each open rule reads next). A rule met last in its run takes its
// caller's place instead of stacking on it, so repetitions (compiled to right
// recursion: x* is R ::= x R | "") take no stack.
//
// Pure data after compilation: any thread may read a Cfg.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "structured/code_points.h"

namespace moe::structured {

inline constexpr size_t kMaxGrammarBytes = 65536;    // a grammar's text
inline constexpr size_t kMaxGrammarSymbols = 100000;  // once repetitions are expanded
inline constexpr int32_t kMaxGrammarDepth = 128;      // a reading's stack (nested rules not in tail position)
inline constexpr int32_t kWayOnBudget = 4096;

class Cfg {
 public:
  enum class SymbolKind : uint8_t { kEnd, kClass, kRule };
  struct Symbol {
    SymbolKind kind = SymbolKind::kEnd;
    int32_t id = -1;  // kClass: the class; kRule: the rule
  };

  static Expected<Cfg> compile(std::string_view text);

  const Symbol& symbol(int32_t pos) const { return symbols_[static_cast<size_t>(pos)]; }
  // The first position of each of `rule`'s alternatives.
  const std::vector<int32_t>& alternatives(int32_t rule) const { return rules_[static_cast<size_t>(rule)]; }
  bool class_has(int32_t cls, uint32_t code_point) const { return ranges_meet(classes_[static_cast<size_t>(cls)], code_point, code_point); }
  // Whether class `cls` holds some code point of [lo, hi].
  bool class_meets(int32_t cls, uint32_t lo, uint32_t hi) const { return ranges_meet(classes_[static_cast<size_t>(cls)], lo, hi); }
  // Whether the rest of a run from `pos` may derive the empty string.
  bool nullable_from(int32_t pos) const { return nullable_from_[static_cast<size_t>(pos)] != 0; }
  // Whether a reading with these positions (bottom first) may read another
  // character or end without its stack passing kMaxGrammarDepth (after
  // kWayOnBudget expansions tried, yes): the matcher refuses a character
  // that leaves no way on, so that the depth limit is never a dead end.
  bool way_on(std::vector<int32_t>& positions) const;
  int32_t num_rules() const { return static_cast<int32_t>(rules_.size()); }
  int32_t num_symbols() const { return static_cast<int32_t>(symbols_.size()); }

 private:
  friend class EbnfParser;
  std::vector<Symbol> symbols_;
  std::vector<std::vector<int32_t>> rules_;
  std::vector<Ranges> classes_;
  std::vector<uint8_t> nullable_from_;

  bool way_on(std::vector<int32_t>& positions, int32_t& budget) const;
};

}  // namespace moe::structured
