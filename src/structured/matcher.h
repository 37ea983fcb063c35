// A byte-level matcher for a Grammar (structured/grammar.h): which bytes may
// follow the output so far.
//
// The state is a set of threads, each a stack of frames (a pushdown
// automaton): a thread forks where the grammar leaves a choice (anyOf, a
// declared or an additional key) and dies on a byte its stack cannot take,
// so the matcher follows every reading of the output at once, as an Earley
// parser would, without backtracking. A matcher with no thread has failed.
// Whitespace between JSON tokens is none, one space, or a newline and at
// most kMaxIndent spaces or tabs (compact and pretty-printed JSON both fit;
// llama.cpp's JSON grammars draw the same line): with any whitespace allowed,
// a model can fill its whole output with blank lines, and small ones do.
// Before the whole output's value, kMaxLeadingWhitespace bytes of any
// whitespace (a reasoning model writes "\n\n" after </think>). With the
// grammar's JsonOptions::any_whitespace off, one space after each ',' and
// ':' and none elsewhere. Other bounds
// that keep a state small: kMaxNesting open objects and arrays,
// kMaxThreads threads (beyond which the last are dropped: a reading the
// output may still take is never invented, only rarely lost).
//
// A Matcher is a value: copy it to try bytes (the token filter does, for
// every token). One thread at a time per object.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "structured/grammar.h"
#include "structured/regex.h"

namespace moe::structured {

inline constexpr int kMaxIndent = 20;
inline constexpr int kMaxLeadingWhitespace = 8;
inline constexpr int kMaxNesting = 48;
inline constexpr int kMaxThreads = 64;

class Matcher {
 public:
  // `grammar` must outlive the matcher.
  explicit Matcher(const Grammar& grammar);

  // `out` = this matcher after `byte`; false (out failed) when no thread takes it.
  bool advance_into(uint8_t byte, Matcher& out) const;
  // In place; all bytes or none (false: unchanged).
  bool advance(std::string_view bytes);
  // Whether the output may end here (a whole value, or a whole choice).
  bool accepting() const;
  bool failed() const { return ends_.empty(); }
  // Where the threads stand for a run of plain characters (printable, no
  // quote or backslash, whole UTF-8 sequences; structured/token_filter.h):
  // threads between characters of a string without a pattern take any run
  // that fits `room`, the most code points the roomiest may still read
  // (INT32_MAX: unbounded; -1: no thread is there); threads between
  // characters of a string with a pattern (its minLength reached), or of raw
  // text, take the runs their automaton takes from its state, one step each,
  // as long as the run fits the pattern's own `room` (INT32_MAX without a
  // maxLength; beyond it the length bounds may bind): `patterns` lists those
  // states, each once, with the least room they were met with. With
  // `every_thread`, every thread is one of these, so a run none of them takes
  // is not accepted.
  struct PatternState {
    const Regex* regex = nullptr;
    int32_t state = -1;
    bool operator==(const PatternState&) const = default;
  };
  struct PatternRun {
    PatternState at;
    int32_t room = INT32_MAX;
  };
  struct PlainRuns {
    int32_t room = -1;
    std::vector<PatternRun> patterns;
    bool every_thread = false;
  };
  PlainRuns plain_runs() const;
  size_t num_threads() const { return ends_.size(); }
  // Whether every thread reads raw text whose states recur: a guided_grammar
  // reading (structured/cfg.h), or a structural tag's free text, begin or
  // end (not a structure's JSON value). What a thread takes depends on its
  // own frames alone, so the request's cache (TokenSetCache) keeps each one's tokens.
  bool threads_recur() const;
  // Whether nothing has been read: every request of the grammar starts here.
  bool at_start() const;

  // One parse position: what is being read (kind), where in it (phase), and
  // its counters (their meaning per kind in matcher.cc).
  struct Frame {
    uint8_t kind = 0, phase = 0, ws = 0, flags = 0;
    int32_t node = -1;
    int32_t a = 0, b = 0, c = 0;
    int32_t d = -1;  // an extra key: its place in the object's keys trie (-1: no declared key's)
    int32_t re = -1;   // a string with a pattern: its automaton's state
    uint32_t cp = 0;   // a string with a pattern: the code point being read (UTF-8, a surrogate pair's high half)
    bool operator==(const Frame&) const = default;
  };
  // Thread i's frames (bottom first), and a matcher of that thread alone.
  std::span<const Frame> thread(size_t i) const {
    const size_t begin = i == 0 ? 0 : ends_[i - 1];
    return {frames_.data() + begin, ends_[i] - begin};
  }
  Matcher only_thread(size_t i) const;

 private:
  enum class Step : uint8_t;
  void feed(uint8_t byte, size_t start, Matcher& out) const;
  Step handle(uint8_t byte, size_t start, Matcher& out) const;
  void fork(uint8_t byte, size_t start, Matcher& out, const std::vector<Frame>& tops, bool pair) const;
  void commit(size_t start, Matcher& out) const;
  bool thread_accepting(size_t begin, size_t end) const;

  const Grammar* grammar_;
  std::vector<Frame> frames_;   // the threads' stacks back to back, bottom first
  std::vector<uint32_t> ends_;  // thread i is frames_[ends_[i - 1], ends_[i]) (ends_[-1] = 0)
};

}  // namespace moe::structured
