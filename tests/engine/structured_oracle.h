// The tokens a structured request should get, checked against the byte
// matcher (not the token filter's trie walk the engine masks with). Shared by
// the CPU and GPU engine tests.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "engine/engine.h"
#include "structured/matcher.h"
#include "structured/token_filter.h"

namespace moe::engine::testing_oracle {

// The schema the engine tests constrain the demo model with (CPU and GPU).
inline constexpr const char* kVerdictSchema = R"({
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer"},
                   "note": {"type": "string", "maxLength": 6}},
    "required": ["answer", "score", "note"]})";

// One request's output tokens, each with its logprobs over the whole
// vocabulary (as the model produced them, before any mask). Before
// `after_token` (>= 0: the grammar applies after it) a greedy token is the
// row's argmax; then it is the best token the grammar allows there (its
// bytes advance the matcher; `eos` where the output may end); every token
// must be allowed, sampled or not. Returns the matcher after the output and
// the grammar's text.
std::pair<structured::Matcher, std::string> expect_allowed_tokens(const structured::Grammar& grammar,
                                                                  const structured::TokenVocabulary& vocabulary,
                                                                  int32_t eos, int32_t after_token, bool greedy,
                                                                  const std::vector<int32_t>& tokens,
                                                                  const std::vector<TokenLogprobs>& logprobs) {
  structured::Matcher m(grammar);
  std::string text;
  bool awaiting = after_token >= 0;
  EXPECT_EQ(logprobs.size(), tokens.size());
  for (size_t t = 0; t < tokens.size() && t < logprobs.size(); ++t) {
    const int32_t token = tokens[t];
    if (awaiting) {  // free: the argmax
      if (greedy) {
        EXPECT_EQ(token, logprobs[t].top[0].first) << "token " << t;
      }
      awaiting = token != after_token;
      continue;
    }
    if (greedy) {
      int32_t best = -1;
      float best_logprob = -std::numeric_limits<float>::infinity();
      std::vector<std::pair<int32_t, float>> by_id = logprobs[t].top;
      std::sort(by_id.begin(), by_id.end());
      for (const auto& [id, logprob] : by_id) {
        structured::Matcher copy = m;
        const bool allowed =
            id == eos ? m.accepting() : !vocabulary.bytes(id).empty() && copy.advance(vocabulary.bytes(id));
        if (allowed && logprob > best_logprob) best = id, best_logprob = logprob;
      }
      EXPECT_EQ(token, best) << "token " << t << " after '" << text << "'";
      if (token != best) break;
    }
    if (token == eos) {
      EXPECT_TRUE(m.accepting()) << "eos after '" << text << "'";
      break;
    }
    if (!m.advance(vocabulary.bytes(token))) {
      ADD_FAILURE() << "token " << t << " (" << token << ") after '" << text << "' is not allowed";
      break;
    }
    text += vocabulary.bytes(token);
  }
  return {m, text};
}

}  // namespace moe::engine::testing_oracle
