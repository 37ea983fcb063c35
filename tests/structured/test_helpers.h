// Helpers shared by the structured-output tests: grammars from their JSON,
// whole-output and prefix checks, the demo model's vocabulary, and the token
// filter's mask against trying every token.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "structured/grammar.h"
#include "structured/matcher.h"
#include "structured/token_filter.h"
#include "tokenizer/tokenizer.h"

namespace moe::structured {

using Json = nlohmann::ordered_json;

inline const std::string kDemo = std::string(MOE_SOURCE_DIR) + "/models/moeserve-demo";

inline std::shared_ptr<const Grammar> schema(const char* text) {
  auto g = Grammar::from_json_schema(Json::parse(text));
  EXPECT_TRUE(g.has_value()) << g.status().to_string();
  return g.has_value() ? *g : Grammar::json_object();
}

inline std::shared_ptr<const Grammar> structural_tag(const char* text) {
  auto g = Grammar::from_structural_tag(Json::parse(text));
  EXPECT_TRUE(g.has_value()) << g.status().to_string();
  return g.has_value() ? *g : Grammar::json_object();
}

// Whether `text` is a whole output of `g`.
inline bool matches(const Grammar& g, std::string_view text) {
  Matcher m(g);
  return m.advance(text) && m.accepting();
}
// Whether `text` can begin an output of `g`.
inline bool begins(const Grammar& g, std::string_view text) {
  Matcher m(g);
  return m.advance(text);
}

inline std::shared_ptr<const TokenVocabulary> load_vocabulary(const std::string& dir, int64_t vocab_size) {
  auto tok = tokenizer::Tokenizer::load(dir);
  EXPECT_TRUE(tok.has_value()) << tok.status().to_string();
  if (!tok.has_value()) return nullptr;
  return TokenVocabulary::from_tokenizer(*tok, vocab_size);
}

// Every token the trie walk allows, and no other, advances a copy of the matcher.
inline void expect_walk_equals_brute_force(const TokenVocabulary& vocab, const Matcher& m) {
  std::vector<uint32_t> mask;
  vocab.allowed_tokens(m, mask);
  for (int32_t id = 0; id < vocab.size(); ++id) {
    Matcher copy = m;
    const bool takes = !vocab.bytes(id).empty() && copy.advance(vocab.bytes(id));
    ASSERT_EQ(mask_has(mask, id), takes) << "token " << id << " '" << vocab.bytes(id) << "'";
  }
}

}  // namespace moe::structured
