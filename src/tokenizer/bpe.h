// Byte-level BPE model (the "model" of a Hugging Face tokenizer.json of type BPE,
// as GPT-2, Qwen2 and Qwen3 use it): each byte of a pretokenized piece starts as the
// token of its byte-level character, then adjacent pairs merge by rank, lowest
// first and leftmost first among equal ranks, until no pair has a merge.
//
// Immutable after create(): any thread may call its const methods concurrently.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/status.h"

namespace moe::tokenizer {

using TokenId = int32_t;

// GPT-2's reversible byte <-> printable character map: printable Latin-1 bytes map
// to themselves, the other 68 bytes to U+0100.. in order.
const std::array<char32_t, 256>& byte_to_char_table();

// Returns -1 for a character that no byte maps to.
int char_to_byte(char32_t c);

class BpeModel {
 public:
  // `model` is tokenizer.json's "model" object.
  static Expected<BpeModel> create(const nlohmann::json& model);

  // Appends the ids of `piece` (raw bytes of one pretokenized piece) to `ids`.
  void encode_piece(std::string_view piece, std::vector<TokenId>& ids) const;

  // -1 when absent. `token` is in byte-level form ("Ġhello").
  TokenId token_to_id(std::string_view token) const;
  size_t vocab_size() const { return id_to_token_.size(); }
  // The byte-level form of `id`, or empty when `id` is not in the vocabulary.
  const std::string& id_to_token(TokenId id) const;

 private:
  struct MergeEntry {
    uint64_t pair = 0;  // (left << 32) | right; kEmptyPair when the slot is free
    int32_t rank = 0;
    TokenId merged = 0;
  };
  static constexpr uint64_t kEmptyPair = ~uint64_t{0};

  // Rank and result of merging (left, right), or false when the pair never merges.
  bool find_merge(TokenId left, TokenId right, int32_t& rank, TokenId& merged) const;
  void insert_merge(TokenId left, TokenId right, int32_t rank, TokenId merged);
  void merge_small(std::vector<TokenId>& symbols) const;
  void merge_large(std::vector<TokenId>& symbols) const;

  std::unordered_map<std::string, TokenId> vocab_;
  std::vector<std::string> id_to_token_;
  std::array<TokenId, 256> byte_token_{};
  std::vector<MergeEntry> merge_table_;  // open addressing, power-of-two size
  uint64_t merge_mask_ = 0;

  friend class BpeModelTestPeer;
};

}  // namespace moe::tokenizer
