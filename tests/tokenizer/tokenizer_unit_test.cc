// Unit tests of the tokenizer's parts that need no oracle: UTF-8 handling, the
// whitespace rewrite of the pretokenizer regex, and the two BPE merge loops.
#include <cstring>
#include <random>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "oracle_files.h"
#include "tokenizer/bpe.h"
#include "tokenizer/pretokenizer.h"
#include "tokenizer/utf8.h"

namespace moe::tokenizer {

class BpeModelTestPeer {
 public:
  static std::vector<TokenId> small(const BpeModel& bpe, std::vector<TokenId> s) {
    bpe.merge_small(s);
    return s;
  }
  static std::vector<TokenId> large(const BpeModel& bpe, std::vector<TokenId> s) {
    bpe.merge_large(s);
    return s;
  }
};

namespace {

TEST(Utf8, SanitizeReplacesMaximalSubparts) {
  EXPECT_EQ(sanitize_utf8("a\x80" "b"), "a\uFFFD" "b");
  EXPECT_EQ(sanitize_utf8("\xe4\xb8"), "\uFFFD");           // truncated 3-byte sequence: one U+FFFD
  EXPECT_EQ(sanitize_utf8("\xed\xa0\x80"), "\uFFFD\uFFFD\uFFFD");  // a surrogate: three
  EXPECT_EQ(sanitize_utf8("\xc0\xaf"), "\uFFFD\uFFFD");     // overlong
  EXPECT_EQ(sanitize_utf8("\xf4\x90\x80\x80"), "\uFFFD\uFFFD\uFFFD\uFFFD");  // above U+10FFFF
  EXPECT_TRUE(is_valid_utf8("héllo 👋 \uFFFD"));
  EXPECT_FALSE(is_valid_utf8("\xff"));
}

TEST(Utf8, CompletePrefixHoldsBackOnlyCompletableTails) {
  const std::string wave = "👋";  // F0 9F 91 8B
  EXPECT_EQ(complete_utf8_prefix("ab" + wave.substr(0, 1)), 2u);
  EXPECT_EQ(complete_utf8_prefix("ab" + wave.substr(0, 3)), 2u);
  EXPECT_EQ(complete_utf8_prefix("ab" + wave), 6u);
  EXPECT_EQ(complete_utf8_prefix("ab\xff"), 3u);       // never valid: nothing to wait for
  EXPECT_EQ(complete_utf8_prefix("ab\xe0\x80"), 4u);   // E0 80 can never complete
  EXPECT_EQ(complete_utf8_prefix(""), 0u);
}

TEST(Utf8, NfcComposes) {
  EXPECT_EQ(nfc("e\u0301"), "\u00e9");
  EXPECT_EQ(nfc("\u212b"), "\u00c5");
  EXPECT_EQ(nfc("plain"), "plain");
}

TEST(Pretokenizer, WhitespaceClassesRewritten) {
  const std::string rewritten = rewrite_whitespace_classes(R"([^\s\p{L}]?\s+(?!\S)|\\s)");
  EXPECT_EQ(rewritten.find("\\s"), rewritten.find("\\\\s") + 1);  // only the escaped literal remains
  EXPECT_EQ(rewritten.find("\\S"), std::string::npos);
  auto pre = Pretokenizer::create(R"(\s+|\S+)");
  ASSERT_TRUE(pre.has_value());
  std::vector<std::string_view> pieces;
  pre->split("a\u180e b", pieces);  // U+180E is not White_Space (Oniguruma agrees)
  ASSERT_EQ(pieces.size(), 3u);
  EXPECT_EQ(pieces[0], "a\u180e");
}

// The hand-written Qwen matcher and PCRE2 running the same pattern agree on text
// made of characters that Unicode 14 (PCRE2) and 16 (the tables) classify alike.
TEST(Pretokenizer, QwenMatcherEqualsPcre2) {
  auto fast = Pretokenizer::create(std::string(kQwenPattern));
  auto pcre2 = Pretokenizer::create(std::string(kQwenPattern), Pretokenizer::Engine::kPcre2);
  ASSERT_TRUE(fast.has_value() && pcre2.has_value());
  const std::vector<std::string> alphabet = {
      "a", "Z", "s", "S", "t", "T", "r", "E", "v", "l", "L", "m", "d", "D", "'", "'", "'", "\u017f", "0", "7",
      "\u00bd", "\u0663", " ", " ", " ", "\t", "\n", "\r", "\u00a0", "\u3000", "\u2028", "\u0085", "\u000b",
      ".", ",", "!", "-", "(", "\u00e9", "\u03a9", "\u0436", "\u4e2d", "\u0627", "\u0915", "\u093f", "\u0301",
      "\U0001F600", "\u200d", "\u2019", "#", "\u00ba"};
  std::mt19937 rng(3);
  for (int trial = 0; trial < 20000; ++trial) {
    std::string text;
    const int len = 1 + rng() % 24;
    for (int i = 0; i < len; ++i) text += alphabet[rng() % alphabet.size()];
    std::vector<std::string_view> a, b;
    fast->split(text, a);
    pcre2->split(text, b);
    ASSERT_EQ(a, b) << nlohmann::json(text).dump();
  }
}

TEST(Pretokenizer, BadPatternIsAnError) {
  auto pre = Pretokenizer::create("(unclosed");
  ASSERT_FALSE(pre.has_value());
  EXPECT_NE(pre.status().message().find("unclosed"), std::string::npos);
}

// A toy vocabulary over 'a' and 'b' whose merges make ties and cascades likely.
BpeModel toy_bpe() {
  nlohmann::json vocab = nlohmann::json::object();
  const auto& byte_chars = byte_to_char_table();
  for (int b = 0; b < 256; ++b) {
    std::string s;
    append_utf8(byte_chars[b], s);
    vocab[s] = b;
  }
  nlohmann::json merges = nlohmann::json::array();
  int next = 256;
  for (const char* m : {"a b", "b a", "a a", "ab ab", "ba a", "aa aa", "b b", "ab a", "aaaa aaaa", "bb bb"}) {
    std::string left(m, std::strchr(m, ' ')), right(std::strchr(m, ' ') + 1);
    vocab[left + right] = next++;
    merges.push_back(m);
  }
  auto bpe = BpeModel::create({{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}});
  EXPECT_TRUE(bpe.has_value()) << bpe.status().to_string();
  return std::move(bpe).value();
}

TEST(Bpe, HeapMergeEqualsQuadraticMerge) {
  const BpeModel bpe = toy_bpe();
  std::mt19937 rng(1);
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<TokenId> symbols(1 + rng() % 80);
    for (auto& s : symbols) s = rng() % 3 == 0 ? 'b' : 'a';
    ASSERT_EQ(BpeModelTestPeer::small(bpe, symbols), BpeModelTestPeer::large(bpe, symbols)) << trial;
  }
}

TEST(Bpe, RejectsMergeOutsideVocab) {
  nlohmann::json vocab = nlohmann::json::object();
  auto bpe = BpeModel::create({{"type", "BPE"}, {"vocab", vocab}, {"merges", nlohmann::json::array()}});
  EXPECT_FALSE(bpe.has_value());
}

}  // namespace
}  // namespace moe::tokenizer
