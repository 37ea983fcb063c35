// The added tokens of tokenizer.json ("added_tokens"), and how they are found in
// text: leftmost-longest, as Hugging Face's AddedVocabulary does with Aho-Corasick.
//
// Immutable after construction: any thread may call the const methods concurrently.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace moe::tokenizer {

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool special = false;
  bool normalized = false;  // matched in normalized text rather than the raw text
};

// A run of text between added tokens, or one added token (id >= 0).
struct Segment {
  std::string_view text;
  int32_t id = -1;
};

class AddedTokenMatcher {
 public:
  AddedTokenMatcher() = default;
  explicit AddedTokenMatcher(std::vector<AddedToken> tokens);

  bool empty() const { return tokens_.empty(); }
  // Splits `text` into segments; tokens with `special` set are skipped when
  // `match_special` is false.
  void split(std::string_view text, bool match_special, std::vector<Segment>& out) const;

 private:
  std::vector<AddedToken> tokens_;
  // For each first byte, indices into tokens_ sorted by length, longest first.
  std::array<std::vector<uint32_t>, 256> by_first_byte_;
};

struct AddedTokens {
  std::vector<AddedToken> all;
  AddedTokenMatcher raw;         // tokens with normalized = false
  AddedTokenMatcher normalized;  // tokens with normalized = true
};

}  // namespace moe::tokenizer
