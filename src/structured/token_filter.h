// From bytes to tokens: which tokens of the vocabulary a structured output
// may take next.
//
// TokenVocabulary holds every token's bytes in a trie; allowed_tokens() walks
// it with the matcher, trying each byte once per prefix shared by tokens and
// leaving a subtree as soon as the matcher fails, so a step costs the trie
// nodes the grammar lets through, not the vocabulary's size. Inside a string
// most of the vocabulary goes through, so the "plain" tokens (printable
// characters only: no quote, backslash, control byte or part of a UTF-8
// sequence) are taken as a set wherever every thread reads a string with room
// for them or a pattern's string (Matcher::plain_runs), and only the others
// are walked: 5-7 ms a step on Qwen3's 151k tokens inside a string before,
// measured in docs/server.md ("Structured outputs") since. In a string with a
// pattern the set depends on the automaton's state: the plain tokens it takes
// from a state are found by a walk of the trie with the automaton alone
// (add_pattern_tokens) and kept per state by the request (TokenSetCache),
// since its output revisits a pattern's few states token after token. A
// guided_grammar output (structured/cfg.h) has every token walked, once per
// reading (thread) of the output, and each reading's set is kept by the
// request the same way; so has a structural tag's free text (keyed by its
// trigger scanner's state: the same token after token).
// TokenConstraint is one sequence's state: the matcher after its output so
// far, advanced token by token.
//
// Threads: a TokenVocabulary is immutable once built (any thread); a
// TokenConstraint belongs to one thread at a time (the engine loop); a
// TokenSetCache may be shared by copies of a constraint on any threads.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "structured/grammar.h"
#include "structured/matcher.h"
#include "tokenizer/tokenizer.h"

namespace moe::structured {

class TokenSetCache;

class TokenVocabulary {
 public:
  // token_bytes[id]: the bytes token `id` decodes to; empty for tokens a
  // constrained output never takes (special tokens, ids the tokenizer lacks).
  explicit TokenVocabulary(std::vector<std::string> token_bytes);
  // The model's `vocab_size` ids, spelt by `tokenizer`. Added tokens that are
  // not special (Qwen3's <tool_call>, <think>, ...) are text like the others:
  // the output's text holds them, so a grammar may take them (a structural
  // tag's begin, say). Special tokens (skipped in the text: eos, <|im_start|>
  // ...) and ids past the tokenizer stay empty.
  static std::shared_ptr<const TokenVocabulary> from_tokenizer(const tokenizer::Tokenizer& tokenizer,
                                                               int64_t vocab_size);
  int32_t size() const { return static_cast<int32_t>(token_bytes_.size()); }
  const std::string& bytes(int32_t id) const { return token_bytes_[static_cast<size_t>(id)]; }

  // mask[id / 32] bit id % 32 set for every token `matcher` accepts whole
  // (mask: (size() + 31) / 32 words, cleared first). `cache`, optional: the
  // plain tokens of the patterns' states and the recurring threads' tokens,
  // kept from call to call.
  void allowed_tokens(const Matcher& matcher, std::vector<uint32_t>& mask, TokenSetCache* cache = nullptr) const;
  // Sets the bits of the plain tokens whose characters `regex` takes, one
  // step each, from `state` (every step to a live state).
  void add_pattern_tokens(const Regex& regex, int32_t state, std::vector<uint32_t>& mask) const;

 private:
  struct TrieNode {
    uint8_t byte = 0;
    int32_t first_child = 0, num_children = 0;
    int32_t first_token = 0, num_tokens = 0;  // tokens ending here, in tokens_
  };
  void build(int32_t node, std::span<const int32_t> ids, size_t depth);
  void walk(int32_t node, size_t depth, std::vector<Matcher>& level, std::vector<uint32_t>& mask) const;
  // A UTF-8 sequence begun on the path: continuations left, the next one's range, the bits so far.
  struct PendingUtf8 {
    int32_t left = 0;
    uint8_t lo = 0, hi = 0;
    uint32_t bits = 0;
  };
  void walk_pattern(const Regex& regex, int32_t node, int32_t state, PendingUtf8 pending,
                    std::vector<uint32_t>& mask) const;

  std::vector<std::string> token_bytes_;
  std::vector<TrieNode> nodes_;  // node 0: the root of every token; rest_root_: of the tokens not plain
  std::vector<int32_t> tokens_;
  int32_t rest_root_ = 0;
  std::vector<uint32_t> plain_mask_;                      // the plain tokens, as a mask
  std::vector<std::pair<int32_t, int32_t>> plain_tokens_;  // (id, code points), fewest code points first
  int32_t longest_plain_ = 0;                              // the most code points of a plain token
};

// Token sets one request's masks reuse, the kCapacity most recently used
// (~19 KB each at Qwen3's vocabulary): the plain tokens of a pattern's
// automaton state (as TokenVocabulary::add_pattern_tokens finds them), and
// every token one thread takes where threads recur (Matcher::threads_recur;
// keyed by its frames: a repetition's reading, or free text, is the same
// token after token).
//
// The recurring threads' sets depend on the grammar's structure alone (their
// keys are frames: node indices and counters), so the requests of one
// grammar source may share them: a cache made with `shared_readings` keeps
// its readings there (a larger cache, any number of requests on any threads)
// and only its pattern states itself (those are keyed by the automaton's
// address, which is one grammar object's).
class TokenSetCache {
 public:
  static constexpr size_t kCapacity = 8;
  static constexpr size_t kSharedCapacity = 32;  // a cache of readings shared by requests
  explicit TokenSetCache(std::shared_ptr<TokenSetCache> shared_readings = nullptr, size_t capacity = kCapacity)
      : shared_readings_(std::move(shared_readings)), capacity_(capacity) {}
  // Sets the bits of `p`'s plain tokens in `mask`, finding them on a miss.
  void add_pattern(const TokenVocabulary& vocabulary, const Matcher::PatternState& p, std::vector<uint32_t>& mask);
  // Sets the bits of every token thread `thread` of `matcher` (one whose
  // states recur) takes, finding them on a miss.
  void add_reading(const TokenVocabulary& vocabulary, const Matcher& matcher, size_t thread,
                   std::vector<uint32_t>& mask);
  // Whether its readings are shared by requests (the start of the grammar,
  // where every request begins, is then worth keeping too).
  bool shares_readings() const { return shared_readings_ != nullptr; }
  size_t misses() const {
    const std::lock_guard lock(mutex_);
    return misses_;
  }

 private:
  struct Entry {
    Matcher::PatternState pattern;        // a pattern state's plain tokens, or
    std::vector<Matcher::Frame> reading;  // (not empty) a recurring thread's tokens
    std::vector<uint32_t> tokens;
    uint64_t last_used = 0;
  };
  // ORs the tokens of the entry `is_key` picks into `mask`; on a miss a new
  // entry (or the least recently used) gets `key` and `fill`'s tokens.
  template <class IsKey, class Fill>
  void add(IsKey&& is_key, Entry key, Fill&& fill, std::vector<uint32_t>& mask);

  const std::shared_ptr<TokenSetCache> shared_readings_;
  const size_t capacity_;
  mutable std::mutex mutex_;
  std::vector<Entry> entries_;
  uint64_t clock_ = 0;
  size_t misses_ = 0;
};

class TokenConstraint {
 public:
  // `end_ids`: the tokens that end the output (eos, the request's stop
  // tokens), allowed where the output may end.
  // `shared_readings`: the recurring threads' token sets of every request of
  // this grammar's source (TokenSetCache), or null: the constraint's own.
  TokenConstraint(std::shared_ptr<const Grammar> grammar, std::shared_ptr<const TokenVocabulary> vocabulary,
                  std::vector<int32_t> end_ids, std::shared_ptr<TokenSetCache> shared_readings = nullptr);

  // The tokens allowed next as a bitmask over the vocabulary (as
  // TokenVocabulary::allowed_tokens). Never empty: where no token can go on
  // and the output is not whole (a grammar the vocabulary cannot spell, or a
  // matcher limit reached), the end tokens, which accept() then refuses, so
  // that the request ends with an error rather than a cut output.
  void allowed_tokens(std::vector<uint32_t>& mask) const;
  // Takes `token`; false (and unchanged) when it is not allowed. An end token
  // is allowed where the output is whole, and changes nothing.
  bool accept(int32_t token);
  bool accepting() const { return matcher_.accepting(); }

 private:
  std::shared_ptr<const Grammar> grammar_;
  std::shared_ptr<const TokenVocabulary> vocabulary_;
  std::vector<int32_t> end_ids_;
  Matcher matcher_;
  std::shared_ptr<TokenSetCache> cache_;  // shared by the constraint's copies
};

inline bool mask_has(std::span<const uint32_t> mask, int32_t id) {
  return (mask[static_cast<size_t>(id) / 32] >> (id % 32)) & 1u;
}

}  // namespace moe::structured
