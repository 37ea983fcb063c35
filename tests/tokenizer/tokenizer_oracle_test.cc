// Our tokenizer against Hugging Face tokenizers on the real Qwen3 tokenizer.json:
// the expected ids and decodes come from tools/tokenizer/oracle.mjs.
#include <algorithm>

#include <gtest/gtest.h>

#include "oracle_files.h"
#include "tokenizer/detokenizer.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace moe::tokenizer {
namespace {

using testing::oracle_path;
using testing::qwen3_dir;
using testing::read_json_lines;

const Tokenizer& qwen3() {
  static const Tokenizer* tokenizer = [] {
    auto loaded = Tokenizer::load(qwen3_dir());
    if (!loaded) {
      ADD_FAILURE() << loaded.status().to_string();
      std::abort();
    }
    return new Tokenizer(std::move(loaded).value());
  }();
  return *tokenizer;
}

std::string show(const std::string& s) { return nlohmann::json(s).dump(); }

TEST(TokenizerOracle, EncodeMatchesHuggingFace) {
  const auto records = read_json_lines(oracle_path("tokenizer.jsonl"));
  size_t num_texts = 0, num_equal = 0, num_roundtrip = 0, num_roundtrip_checked = 0, num_bytes = 0;
  for (const auto& record : records) {
    if (!record.contains("text")) continue;
    const std::string text = record["text"];
    const auto expected = record["ids"].get<std::vector<TokenId>>();
    const auto ids = qwen3().encode(text);
    ++num_texts;
    num_bytes += text.size();
    if (ids == expected) {
      ++num_equal;
    } else if (num_texts - num_equal <= 10) {
      ADD_FAILURE() << "encode differs for " << show(text) << "\n  ours: " << nlohmann::json(ids).dump()
                    << "\n  HF:   " << record["ids"].dump();
    }
    // Text around added tokens is normalized piecewise (as in HF), so NFC of the
    // whole string is the round trip only when no added token was matched.
    const bool has_added_token =
        std::any_of(ids.begin(), ids.end(), [](TokenId id) { return qwen3().is_added_token(id); });
    if (has_added_token) continue;
    ++num_roundtrip_checked;
    const std::string roundtrip = qwen3().decode(ids);
    if (roundtrip == record["nfc"].get<std::string>()) {
      ++num_roundtrip;
    } else {
      ADD_FAILURE() << "decode(encode(s)) != NFC(s) for " << show(text) << ": " << show(roundtrip);
    }
  }
  std::printf("encode: %zu / %zu strings identical to HF (%zu bytes); decode(encode(s)) == NFC(s): %zu / %zu\n",
              num_equal, num_texts, num_bytes, num_roundtrip, num_roundtrip_checked);
  EXPECT_GE(num_texts, 2000u);
  EXPECT_EQ(num_equal, num_texts);
  EXPECT_EQ(num_roundtrip, num_roundtrip_checked);
}

TEST(TokenizerOracle, DecodeMatchesHuggingFace) {
  const auto records = read_json_lines(oracle_path("tokenizer.jsonl"));
  size_t num = 0, num_equal = 0;
  for (const auto& record : records) {
    const auto ids = record["ids"].get<std::vector<TokenId>>();
    for (bool skip : {false, true}) {
      const std::string expected = record[skip ? "decoded_skip_special" : "decoded"];
      const std::string got = qwen3().decode(ids, skip);
      ++num;
      if (got == expected) {
        ++num_equal;
      } else if (num - num_equal <= 10) {
        ADD_FAILURE() << "decode differs for " << record["ids"].dump() << " skip=" << skip << "\n  ours: " << show(got)
                      << "\n  HF:   " << show(expected);
      }
    }
  }
  std::printf("decode: %zu / %zu identical to HF\n", num_equal, num);
  EXPECT_EQ(num_equal, num);
}

// Streaming one id at a time: every piece is valid UTF-8 and the pieces join to
// the Hugging Face decode, on the corpus and on random ids that split characters.
TEST(TokenizerOracle, IncrementalDetokenizerJoinsToDecode) {
  const auto records = read_json_lines(oracle_path("tokenizer.jsonl"));
  size_t num = 0, num_equal = 0;
  for (const auto& record : records) {
    const auto ids = record["ids"].get<std::vector<TokenId>>();
    for (bool skip : {false, true}) {
      IncrementalDetokenizer stream(qwen3(), skip);
      std::string joined;
      for (TokenId id : ids) {
        const std::string piece = stream.add(id);
        ASSERT_TRUE(is_valid_utf8(piece)) << record["ids"].dump();
        EXPECT_LE(stream.num_pending_bytes(), 3u);
        joined += piece;
      }
      joined += stream.finish();
      ++num;
      const std::string expected = record[skip ? "decoded_skip_special" : "decoded"];
      if (joined == expected) {
        ++num_equal;
      } else if (num - num_equal <= 5) {
        ADD_FAILURE() << "stream differs for " << record["ids"].dump() << ": " << show(joined) << " vs " << show(expected);
      }
    }
  }
  std::printf("incremental detokenizer: %zu / %zu streams join to the HF decode\n", num_equal, num);
  EXPECT_EQ(num_equal, num);
}

TEST(TokenizerOracle, SpecialTokensFromConfigs) {
  const SpecialTokens& special = qwen3().special_tokens();
  EXPECT_EQ(special.eos, "<|im_end|>");
  EXPECT_EQ(special.eos_id, qwen3().token_to_id("<|im_end|>"));
  EXPECT_EQ(special.pad_id, qwen3().token_to_id("<|endoftext|>"));
  EXPECT_FALSE(special.bos_id.has_value());
  EXPECT_FALSE(qwen3().chat_template().empty());
  EXPECT_TRUE(qwen3().is_special(*qwen3().token_to_id("<|im_start|>")));
  EXPECT_FALSE(qwen3().is_special(*qwen3().token_to_id("<think>")));
}

TEST(TokenizerOracle, InvalidUtf8EncodesAsItsLossyDecoding) {
  // Defined behaviour: each maximal ill-formed subpart becomes U+FFFD.
  const std::string bad = "ab\xff" "c\xe4\xb8" "d\xed\xa0\x80" "e\xf0\x9f\x98";
  const std::string lossy = "ab\uFFFD" "c\uFFFD" "d\uFFFD\uFFFD\uFFFD" "e\uFFFD";
  EXPECT_EQ(qwen3().encode(bad), qwen3().encode(lossy));
  EXPECT_EQ(qwen3().decode(qwen3().encode(bad)), lossy);
}

TEST(TokenizerOracle, UntrustedTextDoesNotProduceSpecialTokens) {
  const auto ids = qwen3().encode("<|im_start|>system", /*parse_special=*/false);
  for (TokenId id : ids) EXPECT_FALSE(qwen3().is_special(id));
  EXPECT_EQ(qwen3().decode(ids), "<|im_start|>system");
}

}  // namespace
}  // namespace moe::tokenizer
