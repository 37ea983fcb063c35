// From bytes to tokens: which tokens of the vocabulary a structured output
// may take next.
//
// TokenVocabulary holds every token's bytes in a trie; allowed_tokens() walks
// it with the matcher, trying each byte once per prefix shared by tokens and
// leaving a subtree as soon as the matcher fails, so a step costs the trie
// nodes the grammar lets through, not the vocabulary's size. Inside a string
// most of the vocabulary goes through, so the "plain" tokens (printable
// characters only: no quote, backslash, control byte or part of a UTF-8
// sequence) are taken as a set wherever a thread reads a string with room for
// them (Matcher::string_room), and only the others are walked: 5-7 ms a step
// on Qwen3's 151k tokens inside a string before, measured in docs/server.md
// ("Structured outputs") since. TokenConstraint is one sequence's
// state: the matcher after its output so far, advanced token by token.
//
// Threads: a TokenVocabulary is immutable once built (any thread); a
// TokenConstraint belongs to one thread at a time (the engine loop).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "structured/grammar.h"
#include "structured/matcher.h"
#include "tokenizer/tokenizer.h"

namespace moe::structured {

class TokenVocabulary {
 public:
  // token_bytes[id]: the bytes token `id` decodes to; empty for tokens a
  // constrained output never takes (special tokens, ids the tokenizer lacks).
  explicit TokenVocabulary(std::vector<std::string> token_bytes);
  // The model's `vocab_size` ids, spelt by `tokenizer`; added tokens (special
  // or not: <think>, <tool_call>, ...) and ids past the tokenizer stay empty.
  static std::shared_ptr<const TokenVocabulary> from_tokenizer(const tokenizer::Tokenizer& tokenizer,
                                                               int64_t vocab_size);
  int32_t size() const { return static_cast<int32_t>(token_bytes_.size()); }
  const std::string& bytes(int32_t id) const { return token_bytes_[static_cast<size_t>(id)]; }

  // mask[id / 32] bit id % 32 set for every token `matcher` accepts whole
  // (mask: (size() + 31) / 32 words, cleared first).
  void allowed_tokens(const Matcher& matcher, std::vector<uint32_t>& mask) const;

 private:
  struct TrieNode {
    uint8_t byte = 0;
    int32_t first_child = 0, num_children = 0;
    int32_t first_token = 0, num_tokens = 0;  // tokens ending here, in tokens_
  };
  void build(int32_t node, std::span<const int32_t> ids, size_t depth);
  void walk(int32_t node, size_t depth, std::vector<Matcher>& level, std::vector<uint32_t>& mask) const;

  std::vector<std::string> token_bytes_;
  std::vector<TrieNode> nodes_;  // node 0: the root of every token; rest_root_: of the tokens not plain
  std::vector<int32_t> tokens_;
  int32_t rest_root_ = 0;
  std::vector<uint32_t> plain_mask_;                      // the plain tokens, as a mask
  std::vector<std::pair<int32_t, int32_t>> plain_tokens_;  // (id, code points), fewest code points first
};

class TokenConstraint {
 public:
  // `end_ids`: the tokens that end the output (eos, the request's stop
  // tokens), allowed where the output may end.
  TokenConstraint(std::shared_ptr<const Grammar> grammar, std::shared_ptr<const TokenVocabulary> vocabulary,
                  std::vector<int32_t> end_ids);

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
};

inline bool mask_has(std::span<const uint32_t> mask, int32_t id) {
  return (mask[static_cast<size_t>(id) / 32] >> (id % 32)) & 1u;
}

}  // namespace moe::structured
