// JSON Schema's numeric bounds and tuples, and vLLM's options for the JSON
// written (disable_any_whitespace, disable_additional_properties). Oracles:
// exact fixed-point and decimal-string comparisons written here, nlohmann's
// parser, and a scanner for xgrammar's separators.
#include <algorithm>
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

namespace moe::structured {
namespace {

// A number's text as an exact fixed-point integer in units of 1e-4 (the test's
// texts have at most 4 fraction digits and 6 integer digits), for the oracle below.
int64_t ten_thousandths(const std::string& text) {
  const bool negative = text[0] == '-';
  const std::string body = text.substr(negative ? 1 : 0);
  const size_t dot = body.find('.');
  std::string fraction = dot == std::string::npos ? "" : body.substr(dot + 1);
  fraction.resize(4, '0');
  const int64_t v = std::stoll(body.substr(0, dot)) * 10000 + std::stoll(fraction);
  return negative ? -v : v;
}

// Bounds against exact comparisons: every text of a grid of integers and
// decimals is an output iff its value is in the range (the texts written are
// those without an exponent and never "-0": -0.0 and 1e1 are refused even in range).
TEST(Grammar, NumberBoundsAgreeWithExactComparison) {
  const char* bounds[] = {"-12.5", "-10", "-1", "-0.25", "0", "0.1", "0.5", "1", "2.75", "9.999", "10", "99", "100.5"};
  std::vector<std::string> texts;
  for (const char* sign : {"", "-"}) {
    for (const char* integer : {"0", "1", "2", "9", "10", "11", "12", "13", "99", "100", "101", "1000", "123456"}) {
      for (const char* fraction : {"", ".0", ".00", ".05", ".1", ".10", ".2", ".25", ".2501", ".3", ".4999", ".5",
                                   ".5001", ".75", ".7499", ".9", ".999", ".9989", ".9991", ".9999"})
        texts.push_back(std::string(sign) + integer + fraction);
    }
  }
  std::mt19937 rng(5);
  int schemas = 0;
  for (const char* type : {"integer", "number"}) {
    for (const char* lo : bounds) {
      for (const char* hi : bounds) {
        if (ten_thousandths(lo) > ten_thousandths(hi) || rng() % 3 != 0) continue;
        for (int sides = 0; sides < 3; ++sides) {  // both bounds, the lower alone, the upper alone
          const bool lo_excl = rng() % 2, hi_excl = rng() % 2;
          std::string text = fmt::format(R"({{"type": "{}")", type);
          if (sides != 2) text += fmt::format(R"(, "{}": {})", lo_excl ? "exclusiveMinimum" : "minimum", lo);
          if (sides != 1) text += fmt::format(R"(, "{}": {})", hi_excl ? "exclusiveMaximum" : "maximum", hi);
          text += "}";
          auto g = Grammar::from_json_schema(Json::parse(text));
          const int64_t l = ten_thousandths(lo), h = ten_thousandths(hi);
          auto in_range = [&](int64_t v) {
            return (sides == 2 || (lo_excl ? v > l : v >= l)) && (sides == 1 || (hi_excl ? v < h : v <= h));
          };
          bool any = sides != 0 || l < h || (!lo_excl && !hi_excl);  // numbers: only [l, l) etc. are empty
          if (std::string_view(type) == "integer") {  // e.g. (0.1, 0.5): no integer
            any = false;
            for (int64_t v = -200 * 10000; v <= 200 * 10000 && !any; v += 10000) any = in_range(v);
          }
          if (!any) {
            EXPECT_FALSE(g.has_value()) << text;
            continue;
          }
          ASSERT_TRUE(g.has_value()) << text << ": " << g.status().to_string();
          ++schemas;
          for (const std::string& t : texts) {
            const int64_t v = ten_thousandths(t);
            const bool written = (std::string_view(type) == "number" || t.find('.') == std::string::npos) &&
                                 !(t[0] == '-' && v == 0);
            EXPECT_EQ(matches(**g, t), written && in_range(v)) << text << " " << t;
          }
          for (const char* t : {"1e1", "-0", "01", "1.", ".5", "--1", "+1"}) EXPECT_FALSE(matches(**g, t)) << t;
        }
      }
    }
  }
  EXPECT_GT(schemas, 60);
  // Bounds written with exponents, as decimals, and draft 4's boolean exclusives.
  auto g = schema(R"({"type": "number", "minimum": 1e-3, "exclusiveMaximum": 2.5E1})");
  EXPECT_TRUE(matches(*g, "0.001"));
  EXPECT_FALSE(matches(*g, "0.0009999"));
  EXPECT_TRUE(matches(*g, "24.99999999"));
  EXPECT_FALSE(matches(*g, "25"));
  EXPECT_FALSE(matches(*g, "25.0"));
  g = schema(R"({"type": "integer", "minimum": 0, "exclusiveMinimum": true, "maximum": 3, "exclusiveMaximum": false})");
  EXPECT_FALSE(matches(*g, "0"));
  EXPECT_TRUE(matches(*g, "1"));
  EXPECT_TRUE(matches(*g, "3"));
  // The tighter of minimum and exclusiveMinimum applies; a bound implies a number.
  g = schema(R"({"minimum": 2, "exclusiveMinimum": 2})");
  EXPECT_FALSE(matches(*g, "2"));
  EXPECT_TRUE(matches(*g, "2.5"));
  // Unbounded sides reach the digit limit, not beyond; 0.1 is exactly one tenth.
  g = schema(R"({"type": "integer", "minimum": -5})");
  EXPECT_TRUE(matches(*g, "9999999999999999999"));
  EXPECT_FALSE(matches(*g, "10000000000000000000"));
  g = schema(R"({"type": "number", "minimum": 0, "maximum": 0.1})");
  EXPECT_TRUE(matches(*g, "0.1"));
  EXPECT_TRUE(matches(*g, "0.09999999999999999"));
  EXPECT_FALSE(matches(*g, "0.10000000000000001"));  // the same double as 0.1, but above one tenth
  // Fractions take at most kMaxFractionDigits digits; longer bounds are cut to what such texts meet.
  g = schema(R"({"type": "number", "minimum": 5e-324})");  // the least double: a fraction of 324 digits
  EXPECT_FALSE(matches(*g, "0"));
  EXPECT_FALSE(matches(*g, "0.00000000000000000000"));
  EXPECT_TRUE(matches(*g, "0.00000000000000000001"));
  EXPECT_FALSE(matches(*g, "0.000000000000000000001"));  // 21 digits
  EXPECT_TRUE(matches(*g, "3"));
  g = schema(R"({"type": "number", "minimum": -1.2345678901234567e-5, "maximum": 9.8765432109876543e-6})");
  EXPECT_TRUE(matches(*g, "-0.00001234567890123456"));
  EXPECT_FALSE(matches(*g, "-0.00001234567890123457"));
  EXPECT_TRUE(matches(*g, "0.00000987654321098765"));
  EXPECT_FALSE(matches(*g, "0.00000987654321098766"));
}

// Exact decimal comparison of two JSON number texts without exponents (the
// walks' outputs are longer than any float holds).
int compare_decimal_texts(std::string a, std::string b) {
  auto split = [](std::string t) {
    const bool negative = t[0] == '-';
    if (negative) t.erase(0, 1);
    const size_t dot = t.find('.');
    std::string i = t.substr(0, dot), f = dot == std::string::npos ? "" : t.substr(dot + 1);
    i.erase(0, std::min(i.find_first_not_of('0'), i.size()));
    f.erase(f.find_last_not_of('0') + 1);
    return std::tuple{negative && !(i.empty() && f.empty()), i, f};
  };
  auto [an, ai, af] = split(std::move(a));
  auto [bn, bi, bf] = split(std::move(b));
  if (an != bn) return an ? -1 : 1;
  int c = ai.size() != bi.size() ? (ai.size() < bi.size() ? -1 : 1) : ai.compare(bi);
  if (c == 0) c = af.compare(bf);
  c = c < 0 ? -1 : (c > 0 ? 1 : 0);
  return an ? -c : c;
}

// Byte-level walks through arrays of bounded numbers: never a dead end (the
// digit limits included), and every output's values within their bounds.
TEST(Grammar, BoundedNumbersHaveNoDeadEnds) {
  const std::tuple<const char*, const char*, bool, const char*, bool> cases[] = {
      {"number", "0", true, "", false},                   // exclusiveMinimum 0: 0.000...01 needs its digit
      {"number", "-0.000000000000000001", false, "0.000000000000000001", false},
      {"number", "99.5", true, "100", true},
      {"integer", "-3", false, "1000000", false},
      {"integer", "", false, "-17", true},
      {"number", "123.456", false, "123.4561", false},
  };
  std::mt19937 rng(23);
  for (const auto& [type, lo, lo_excl, hi, hi_excl] : cases) {
    Json item = {{"type", type}};
    if (*lo) item[lo_excl ? "exclusiveMinimum" : "minimum"] = Json::parse(lo);
    if (*hi) item[hi_excl ? "exclusiveMaximum" : "maximum"] = Json::parse(hi);
    SCOPED_TRACE(item.dump());
    auto g = Grammar::from_json_schema(Json{{"type", "array"}, {"items", item}, {"maxItems", 4}});
    ASSERT_TRUE(g.has_value()) << g.status().to_string();
    for (int walk = 0; walk < 60; ++walk) {
      Matcher m(**g);
      const auto walked = byte_walk(m, rng, {.max_steps = 400, .stop_one_in = 8});
      ASSERT_TRUE(walked);
      const std::string& text = *walked;
      if (!m.accepting()) continue;
      EXPECT_TRUE(Json::accept(text)) << text;
      // The values' own texts, as written.
      std::string inner = text.substr(text.find('[') + 1);
      inner.erase(inner.rfind(']'));
      std::stringstream values(inner);
      for (std::string v; std::getline(values, v, ',');) {
        v.erase(std::remove_if(v.begin(), v.end(), [](char ch) { return std::isspace(static_cast<unsigned char>(ch)); }),
                v.end());
        if (v.empty()) continue;
        EXPECT_LE(v.size(), 41u) << v;
        if (std::string_view(type) == "integer") {
          EXPECT_EQ(v.find('.'), std::string::npos) << v;
        }
        const int above = *lo ? compare_decimal_texts(v, lo) : 1, below = *hi ? compare_decimal_texts(v, hi) : -1;
        EXPECT_TRUE(lo_excl ? above > 0 : above >= 0) << v;
        EXPECT_TRUE(hi_excl ? below < 0 : below <= 0) << v;
      }
    }
  }
}

TEST(Grammar, TuplesTakeTheirItemsByPosition) {
  auto g = schema(R"({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string", "maxLength": 2}],
                      "items": false, "minItems": 1})");
  EXPECT_TRUE(matches(*g, R"([1, "ab"])"));
  EXPECT_TRUE(matches(*g, "[7]"));
  EXPECT_FALSE(matches(*g, "[]"));
  EXPECT_FALSE(matches(*g, R"([1, "ab", 2])"));
  EXPECT_FALSE(begins(*g, R"([1, "ab",)"));  // no comma where no item may follow
  EXPECT_FALSE(matches(*g, R"(["ab"])"));
  EXPECT_FALSE(matches(*g, R"([1, "abc"])"));
  // Items after the prefix by `items`; draft 7's array form with additionalItems.
  g = schema(R"({"type": "array", "prefixItems": [{"const": "x"}], "items": {"type": "boolean"}, "maxItems": 3})");
  EXPECT_TRUE(matches(*g, R"(["x", true, false])"));
  EXPECT_FALSE(matches(*g, R"(["x", true, false, true])"));
  EXPECT_FALSE(matches(*g, R"(["x", 1])"));
  g = schema(R"({"items": [{"type": "null"}, {"type": "integer", "minimum": 10}], "additionalItems": {"type": "string"}})");
  EXPECT_TRUE(matches(*g, R"([null, 10, "a", "b"])"));
  EXPECT_FALSE(matches(*g, R"([null, 9])"));
  EXPECT_FALSE(matches(*g, R"([null, 10, 1])"));
  g = schema(R"({"type": "array", "prefixItems": [{"type": "integer"}]})");  // the other items: any value
  EXPECT_TRUE(matches(*g, R"([1, {"a": [null]}, "s"])"));
  g = schema(R"({"type": "array", "items": false})");
  EXPECT_TRUE(matches(*g, "[]"));
  EXPECT_FALSE(matches(*g, "[1]"));
}

// Whether JSON `text` has, outside its strings, exactly one space after each
// ',' and ':' and no other whitespace: xgrammar's separators (", ", ": ").
bool separators_only(const std::string& text) {
  bool in_string = false, escaped = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') in_string = true;
    const bool space = c == ' ' || c == '\n' || c == '\t' || c == '\r';
    const bool after_separator = i > 0 && (text[i - 1] == ',' || text[i - 1] == ':');
    if (space != (after_separator && c == ' ')) return false;  // a space exactly where a separator owes one
  }
  return true;
}

TEST(Grammar, DisableAnyWhitespaceWritesXgrammarsSeparators) {
  const char* text = R"({"type": "object", "properties": {"a": {"type": "integer"},
      "b": {"type": "array", "items": {"anyOf": [{"type": "integer"}, {"type": "object"}]}},
      "c": {"type": "string"}}, "required": ["a", "b"]})";
  auto g = Grammar::from_json_schema(Json::parse(text), JsonOptions{.any_whitespace = false});
  ASSERT_TRUE(g.has_value());
  for (const char* ok : {R"({"a": 1, "b": [1, 2]})", R"({"a": 1, "b": []})", R"({"a": 1, "b": [{}, {"x": [1, "y"]}], "c": "s p"})"})
    EXPECT_TRUE(matches(**g, ok)) << ok;
  for (const char* bad : {R"({"a":1, "b": [1, 2]})", R"({"a": 1,"b": [1, 2]})", R"({ "a": 1, "b": []})",
                          R"({"a": 1, "b": [1,2]})", R"({"a": 1, "b": [1, 2] })", R"( {"a": 1, "b": []})",
                          R"({"a": 1, "b": [ 1]})", "{\"a\": 1,\n\"b\": []}", R"({"a":  1, "b": []})"})
    EXPECT_FALSE(matches(**g, bad)) << bad;
  // Walks: every output parses and has the separators' spaces and no other.
  std::mt19937 rng(41);
  int outputs = 0;
  for (int walk = 0; walk < 60; ++walk) {
    Matcher m(**g);
    const auto walked = byte_walk(m, rng, {.max_steps = 120, .stop_one_in = 1, .favoured = "{}[],:\"ab1 "});
    ASSERT_TRUE(walked);
    if (!m.accepting()) continue;
    ++outputs;
    EXPECT_TRUE(Json::accept(*walked)) << *walked;
    EXPECT_TRUE(separators_only(*walked)) << *walked;
  }
  EXPECT_GT(outputs, 10);
  // The same for any object, and inside a structural tag's values; the option crosses with the source.
  auto any = Grammar::json_object(JsonOptions{.any_whitespace = false});
  EXPECT_TRUE(matches(*any, R"({"k": [1, {"z": null}]})"));
  EXPECT_FALSE(matches(*any, R"({"k":[1]})"));
  auto tag = Grammar::from_structural_tag(Json::parse(R"({"structures": [{"begin": "<a>", "end": "</a>"}],
                                                          "triggers": ["<a"]})"),
                                          JsonOptions{.any_whitespace = false});
  ASSERT_TRUE(tag.has_value());
  EXPECT_TRUE(matches(**tag, R"(x <a>{"k": 1}</a> y)"));
  EXPECT_FALSE(matches(**tag, R"(x <a> {"k": 1}</a> y)"));
  auto back = Grammar::from_source((*g)->source());
  ASSERT_TRUE(back.has_value());
  EXPECT_FALSE((*back)->json_options().any_whitespace);
  EXPECT_FALSE(matches(**back, R"({"a":1, "b": []})"));
}

TEST(Grammar, DisableAdditionalPropertiesClosesBareObjects) {
  const char* text = R"({"type": "object", "properties": {"free": {"type": "object"},
      "open": {"type": "object", "additionalProperties": true}}, "required": ["free", "open"]})";
  auto closed = Grammar::from_json_schema(Json::parse(text), JsonOptions{.additional_properties = false});
  auto open = Grammar::from_json_schema(Json::parse(text));
  ASSERT_TRUE(closed.has_value() && open.has_value());
  EXPECT_TRUE(matches(**closed, R"({"free": {}, "open": {"x": 1}})"));
  EXPECT_FALSE(matches(**closed, R"({"free": {"x": 1}, "open": {}})"));
  EXPECT_TRUE(matches(**open, R"({"free": {"x": 1}, "open": {}})"));
  auto back = Grammar::from_source((*closed)->source());
  ASSERT_TRUE(back.has_value());
  EXPECT_FALSE(matches(**back, R"({"free": {"x": 1}, "open": {}})"));
}

}  // namespace
}  // namespace moe::structured
