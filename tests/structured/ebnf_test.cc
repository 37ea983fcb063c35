// guided_grammar: the EBNF compiler (structured/cfg.h) and the matcher's
// readings of a grammar. Oracles: std::regex (ECMAScript) for grammars that
// are regular, written beside each, and hand-written recursive-descent
// checkers for the two that are not (balanced brackets, arithmetic), over
// every short string of a small alphabet; byte-level random walks that must
// never reach a dead end; token masks against trying every token.
#include <filesystem>
#include <functional>
#include <random>
#include <regex>
#include <string>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "structured/cfg.h"
#include "structured/grammar.h"
#include "structured/matcher.h"
#include "structured/token_filter.h"
#include "tokenizer/tokenizer.h"
#include "tests/structured/byte_walk.h"

namespace moe::structured {
namespace {

std::shared_ptr<const Grammar> ebnf(const char* text) {
  auto g = Grammar::from_ebnf(text);
  EXPECT_TRUE(g.has_value()) << text << ": " << g.status().to_string();
  return g.has_value() ? *g : nullptr;
}

bool matches(const Grammar& g, std::string_view text) {
  Matcher m(g);
  return m.advance(text) && m.accepting();
}
bool begins(const Grammar& g, std::string_view text) {
  Matcher m(g);
  return m.advance(text);
}

// Every string over `alphabet`'s bytes up to `max_length` of them: a whole
// output of the grammar exactly where `oracle` says so.
void expect_agrees(const Grammar& g, const std::string& alphabet, size_t max_length,
                   const std::function<bool(const std::string&)>& oracle) {
  std::vector<std::string> level{""};
  for (size_t length = 0; length <= max_length; ++length) {
    std::vector<std::string> next;
    for (const std::string& s : level) {
      ASSERT_EQ(matches(g, s), oracle(s)) << "'" << s << "'";
      if (length == max_length) continue;
      for (const char c : alphabet) next.push_back(s + c);
    }
    level = std::move(next);
  }
}

TEST(Ebnf, RegularGrammarsAgreeWithStdRegex) {
  const std::tuple<const char*, const char*, const char*> cases[] = {
      {R"(root ::= ("a" | "bc")* "d"?)", "(a|bc)*d?", "abcd"},
      {R"(root ::= [a-c]{2,4} ("-" [0-9]+)?)", "[a-c]{2,4}(-[0-9]+)?", "ac-09"},
      {"root ::= item (\",\" item)*\nitem ::= \"x\" | \"y\" \"z\"?", "(x|yz?)(,(x|yz?))*", "xyz,"},
      {"root ::= ws \"a\" ws   # spaces around an a\nws ::= [ ]*", " *a *", "a b"},
      {R"(root ::= "<" . . ">")", "<..>", "<>a"},
      {R"(root ::= [^a]+ "a"{0,2})", "[^a]+a{0,2}", "abc"},
      {"root ::= x{3} | y{2,}\nx ::= \"a\"\ny ::= \"b\"", "a{3}|b{2,}", "ab"},
      {R"(root ::= ("ab" | "a") ("bc" | "c"))", "(ab|a)(bc|c)", "abc"},  // ambiguous: two readings of "abc"
      {"root ::= \"\\x41\\u00e9\\t\" [\\]\\-]", "A\u00e9\t[\\]\\-]", "A\u00e9\t]-"},
      // Repetitions of what may be empty: the repetition of its non-empty part.
      {R"(root ::= ("a"? "b"?)* "c")", "(a?b?)*c", "abc"},
      {"root ::= (opt | \"b\")+ \"c\"?\nopt ::= \"a\"*", "(a*|b)+c?", "abc"},
      {R"(root ::= ""* "a" ("")*)", "a", "ab"},
      {"root ::= (x y)*\nx ::= \"a\" | \"\"\ny ::= x x \"b\"?", "((a|)(a|)(a|)b?)*", "ab"},
  };
  for (const auto& [grammar, pattern, alphabet] : cases) {
    SCOPED_TRACE(grammar);
    auto g = ebnf(grammar);
    ASSERT_TRUE(g);
    const std::regex re(pattern);
    expect_agrees(*g, alphabet, 6, [&](const std::string& s) { return std::regex_match(s, re); });
  }
}

// Balanced brackets of two kinds.
bool balanced(const std::string& s) {
  std::string open;
  for (const char c : s) {
    if (c == '(' || c == '[') {
      open += c;
    } else if (open.empty() || open.back() != (c == ')' ? '(' : '[')) {
      return false;
    } else {
      open.pop_back();
    }
  }
  return open.empty();
}

// expr := term ("+" term)*, term := factor ("*" factor)*, factor := digit | "(" expr ")".
bool arithmetic(const std::string& s) {
  size_t i = 0;
  std::function<bool()> expr, term, factor;
  factor = [&]() {
    if (i < s.size() && s[i] >= '0' && s[i] <= '9') return ++i, true;
    if (i < s.size() && s[i] == '(') {
      ++i;
      if (!expr() || i >= s.size() || s[i] != ')') return false;
      return ++i, true;
    }
    return false;
  };
  term = [&]() {
    if (!factor()) return false;
    while (i < s.size() && s[i] == '*')
      if (++i, !factor()) return false;
    return true;
  };
  expr = [&]() {
    if (!term()) return false;
    while (i < s.size() && s[i] == '+')
      if (++i, !term()) return false;
    return true;
  };
  return expr() && i == s.size();
}

TEST(Ebnf, RecursiveGrammarsAgreeWithCheckers) {
  auto brackets = ebnf("root ::= (\"(\" root \")\" | \"[\" root \"]\")*");
  ASSERT_TRUE(brackets);
  expect_agrees(*brackets, "()[]", 8, balanced);
  auto calc = ebnf(R"G(
    root   ::= expr
    expr   ::= term ("+" term)*
    term   ::= factor ("*" factor)*
    factor ::= [0-9] | "(" expr ")"
  )G");
  ASSERT_TRUE(calc);
  expect_agrees(*calc, "1+*()", 7, arithmetic);
}

// 150 alternatives of 1000 characters each: 150,000 symbols.
std::string many_alternatives() {
  std::string text = "root ::= \"a\"{1000}";
  for (int i = 0; i < 150; ++i) text += " | \"b\"{1000}";
  return text;
}

TEST(Ebnf, ErrorsNameTheProblem) {
  const std::pair<std::string, const char*> cases[] = {
      {"root ::= item", "'item' is used but not defined"},
      {"root ::= \"a\"\nroot ::= \"b\"", "defined twice"},
      {"start ::= \"a\"", "no 'root' rule"},
      {"root ::= expr\nexpr ::= expr \"+\" \"1\" | \"1\"", "left recursion: the rule 'expr'"},
      {"root ::= pre root \"x\" | \"y\"\npre ::= \"z\"?", "left recursion"},
      {"root ::= (\"a\"? root)* \"b\"", "left recursion"},  // still begins with itself, once not empty
      {"root ::= [^\\x00-\\U0010FFFF]", "root derives no string"},
      {"root ::= \"a\" root", "root derives no string"},
      {"root \"a\"", "'::='"},
      {"root ::= \"abc", "closing '\"'"},
      {"root ::= [abc", "closing ']'"},
      {"root ::= (\"a\" | \"b\"", "')'"},
      {"root ::= \"\\q\"", "a known escape"},
      {"root ::= \"a\"{1001}", "repeat count above 1000"},
      {"root ::= \"a\"{3,2}", "below its minimum"},
      {"root ::= [z-a]", "a range whose end is not below its start"},
      {"root ::= @", "a string, a class"},
      {std::string("root ::= \"\xff\""), "UTF-8"},
      {"root ::= \"" + std::string(70000, 'a') + "\"", "longer than 65536 bytes"},
      {many_alternatives(), "symbols once repetitions are expanded"},
  };
  for (const auto& [text, message] : cases) {
    auto g = Grammar::from_ebnf(text);
    ASSERT_FALSE(g.has_value()) << text;
    EXPECT_NE(g.status().message().find(message), std::string::npos)
        << text.substr(0, 80) << " -> " << g.status().message();
  }
  // Alternatives that derive no string are dropped; the rest serve.
  auto g = ebnf("root ::= \"a\" (dead | \"b\")\ndead ::= \"c\" dead");
  ASSERT_TRUE(g);
  EXPECT_TRUE(matches(*g, "ab"));
  EXPECT_FALSE(begins(*g, "ac"));  // would be a dead end
}

// Byte-level random walks (each byte drawn among those the matcher takes)
// never reach a state that takes no byte and cannot end.
TEST(Ebnf, NoDeadEnds) {
  const char* grammars[] = {
      "root ::= [\\u00e9-\\u00ea\\U0001F600] | \"\\u4e00\" [0-9]{2}",  // UTF-8 of 2, 3 and 4 bytes
      "root ::= (\"(\" root \")\")* \"x\"?",
      "root ::= (\"ab\" | \"a\" \"c\"?)* \"!\"",
      "root ::= [^a-z]{1,3} \".\"",
      "root ::= (\"x\"? (\"y\" | \"\")*)* \"z\"",
      "root ::= obj\nobj ::= \"{\" (pair (\",\" pair)*)? \"}\"\npair ::= \"\\\"\" [a-z]+ \"\\\":\" (obj | [0-9]+)",
  };
  std::mt19937 rng(5);
  for (const char* text : grammars) {
    SCOPED_TRACE(text);
    auto g = ebnf(text);
    ASSERT_TRUE(g);
    for (int walk = 0; walk < 30; ++walk) {
      Matcher m(*g);
      ASSERT_TRUE(byte_walk(m, rng, {.max_steps = 48, .stop_one_in = 3}));
    }
  }
}

TEST(Ebnf, NestingBeyondTheStackLimitIsRefusedNotCrashed) {
  auto g = ebnf("root ::= \"(\" root \")\" | \"x\"");
  ASSERT_TRUE(g);
  const int deep = kMaxGrammarDepth - 2;
  EXPECT_TRUE(matches(*g, std::string(deep, '(') + "x" + std::string(deep, ')')));
  EXPECT_FALSE(begins(*g, std::string(kMaxGrammarDepth + 10, '(')));
  // The deepest '(' taken still leaves a way to finish: no dead end.
  int most = 0;
  while (begins(*g, std::string(most + 1, '('))) ++most;
  EXPECT_GT(most, kMaxGrammarDepth / 2);
  EXPECT_TRUE(matches(*g, std::string(most, '(') + "x" + std::string(most, ')')));
  // A grammar that must nest past the limit before its first character is refused.
  std::string chain = "root ::= r0\n";
  for (int i = 0; i < kMaxGrammarDepth + 5; ++i) chain += fmt::format("r{} ::= r{} \"x\"\n", i, i + 1);
  chain += fmt::format("r{} ::= \"y\"\n", kMaxGrammarDepth + 5);
  auto too_deep = Grammar::from_ebnf(chain);
  ASSERT_FALSE(too_deep.has_value());
  EXPECT_NE(too_deep.status().message().find("nest deeper"), std::string::npos) << too_deep.status().message();
  // Repetitions take no stack.
  auto many = ebnf("root ::= (\"a\" | \"b\")* \".\"");
  ASSERT_TRUE(many);
  EXPECT_TRUE(matches(*many, std::string(5000, 'a') + "."));
}

TEST(Ebnf, SourceRoundTrips) {
  auto g = ebnf("root ::= \"yes\" | \"no\"");
  ASSERT_TRUE(g);
  auto again = Grammar::from_source(g->source());
  ASSERT_TRUE(again.has_value()) << again.status().to_string();
  EXPECT_TRUE(matches(**again, "no"));
  EXPECT_FALSE(matches(**again, "n"));
}

// Token-level walks on the demo vocabulary: every mask equals trying every
// token, and every finished output satisfies the grammar's oracle.
TEST(Ebnf, TokenWalksOnTheDemoVocabulary) {
  const std::string dir = std::string(MOE_SOURCE_DIR) + "/models/moeserve-demo";
  auto tok = tokenizer::Tokenizer::load(dir);
  ASSERT_TRUE(tok.has_value()) << tok.status().to_string();
  auto vocab = TokenVocabulary::from_tokenizer(*tok, 4096);
  constexpr int32_t kEos = 2;
  const std::pair<const char*, std::function<bool(const std::string&)>> cases[] = {
      {R"G(root ::= "SELECT " cols " FROM " ("users" | "orders") (" WHERE " [a-z]+ " = " [0-9]{1,4})? ";"
          cols ::= "*" | [a-z]+ (", " [a-z]+)*)G",
       [](const std::string& s) {
         return std::regex_match(s, std::regex("SELECT (\\*|[a-z]+(, [a-z]+)*) FROM (users|orders)( WHERE [a-z]+ = [0-9]{1,4})?;"));
       }},
      {"root ::= expr\nexpr ::= term (\"+\" term)*\nterm ::= factor (\"*\" factor)*\nfactor ::= [0-9] | \"(\" expr \")\"",
       arithmetic},
  };
  std::mt19937 rng(3);
  for (const auto& [text, oracle] : cases) {
    SCOPED_TRACE(text);
    auto g = ebnf(text);
    ASSERT_TRUE(g);
    TokenConstraint start(g, vocab, {kEos});
    int finished = 0;
    for (int walk = 0; walk < 6; ++walk) {
      TokenConstraint c = start;
      Matcher shadow(*g);
      std::string out;
      std::vector<uint32_t> mask;
      bool ended = false;
      for (int step = 0; step < 200 && !ended; ++step) {
        c.allowed_tokens(mask);
        if (walk < 2) {
          for (int32_t id = 0; id < vocab->size(); ++id) {
            if (id == kEos) continue;
            Matcher copy = shadow;
            const bool takes = !vocab->bytes(id).empty() && copy.advance(vocab->bytes(id));
            ASSERT_EQ(mask_has(mask, id), takes) << "token " << id << " after '" << out << "'";
          }
        }
        std::vector<int32_t> allowed;
        for (int32_t id = 0; id < vocab->size(); ++id)
          if (mask_has(mask, id)) allowed.push_back(id);
        ASSERT_FALSE(allowed.empty()) << out;
        // Toward the end, prefer tokens that leave a run of letters or digits
        // and open fewer brackets, then finishing.
        if (step > 20 && rng() % 8 != 0) {
          std::vector<int32_t> leaving;
          for (const int32_t id : allowed) {
            const std::string& bytes = vocab->bytes(id);
            if (id == kEos || (bytes.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789") != std::string::npos &&
                               (bytes.find('(') == std::string::npos || rng() % 2 == 0)))
              leaving.push_back(id);
          }
          if (!leaving.empty()) allowed = std::move(leaving);
        }
        int32_t token = allowed[std::uniform_int_distribution<size_t>(0, allowed.size() - 1)(rng)];
        if (step > 60 && mask_has(mask, kEos)) token = kEos;
        ASSERT_TRUE(c.accept(token));
        if (token == kEos) {
          ended = true;
          break;
        }
        out += vocab->bytes(token);
        ASSERT_TRUE(shadow.advance(vocab->bytes(token)));
      }
      if (ended) {
        EXPECT_TRUE(oracle(out)) << out;
        ++finished;
      }
    }
    EXPECT_GE(finished, 3);
  }
}

}  // namespace
}  // namespace moe::structured
