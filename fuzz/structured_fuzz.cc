// libFuzzer target: structured outputs never crash, hang or lie. The input is
// a JSON schema, a NUL byte, then output bytes. A schema that compiles is
// matched against the bytes one at a time; a prefix the matcher calls whole
// must parse as JSON (nlohmann's parser is the oracle), and at the last
// state the token filter's mask over the demo model's 4,096 tokens must equal
// trying every token's bytes. An input that starts with byte 1 holds a
// regular expression instead (guided_regex): a prefix the matcher calls
// whole must match it (Regex::matches), and a state that is not whole must
// take some byte (no dead end); one that starts with byte 2 an EBNF grammar
// (guided_grammar): no dead end; one that starts with byte 3 a structural tag
// (its JSON, as from_structural_tag reads it): no dead end. Every mask is also
// made with a request's cache of pattern states' plain tokens and recurring
// threads' tokens, twice, and must be the same.
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "structured/grammar.h"
#include "structured/matcher.h"
#include "structured/regex.h"
#include "structured/token_filter.h"
#include "tokenizer/tokenizer.h"

namespace {

std::shared_ptr<const moe::structured::TokenVocabulary> g_vocab;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  auto tok = moe::tokenizer::Tokenizer::load(MOE_SOURCE_DIR "/models/moeserve-demo");
  if (!tok) {
    std::fprintf(stderr, "structured_fuzz: %s\n", tok.status().to_string().c_str());
    std::exit(1);
  }
  g_vocab = moe::structured::TokenVocabulary::from_tokenizer(*tok, 4096);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using moe::structured::Grammar;
  using moe::structured::Matcher;
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t split = input.find('\0');
  if (split == std::string_view::npos) return 0;
  const bool regex_mode = size > 0 && data[0] == 1;
  const bool grammar_mode = size > 0 && data[0] == 2;
  const bool tag_mode = size > 0 && data[0] == 3;
  std::optional<moe::structured::Regex> regex;
  moe::Expected<std::shared_ptr<const Grammar>> grammar = moe::invalid_argument("none");
  if (regex_mode) {
    const std::string_view pattern = input.substr(1, split - 1);
    grammar = Grammar::from_regex(pattern);
    if (!grammar) return 0;
    auto compiled = moe::structured::Regex::compile(pattern, moe::structured::RegexMatch::kWhole);
    if (!compiled) std::abort();  // from_regex compiled it
    regex.emplace(std::move(*compiled));
  } else if (grammar_mode) {
    grammar = Grammar::from_ebnf(input.substr(1, split - 1));
    if (!grammar) return 0;
  } else if (tag_mode) {
    const auto spec = nlohmann::ordered_json::parse(input.substr(1, split - 1), nullptr, /*allow_exceptions=*/false);
    if (spec.is_discarded()) return 0;
    grammar = Grammar::from_structural_tag(spec);
    if (!grammar) return 0;
  } else {
    const auto schema = nlohmann::ordered_json::parse(input.substr(0, split), nullptr, /*allow_exceptions=*/false);
    if (schema.is_discarded()) return 0;
    grammar = Grammar::from_json_schema(schema);
    if (!grammar) return 0;
  }
  Matcher m(**grammar);
  const std::string_view output = input.substr(split + 1);
  size_t taken = 0;
  for (; taken < output.size(); ++taken) {
    Matcher next = m;
    if (!next.advance(output.substr(taken, 1))) break;
    m = std::move(next);
    if (m.accepting() && regex_mode) {
      if (!regex->matches(output.substr(0, taken + 1))) {
        std::fprintf(stderr, "accepted but no match: %.*s\n", static_cast<int>(taken + 1), output.data());
        std::abort();
      }
    } else if (m.accepting() && !grammar_mode && !tag_mode) {
      const auto parsed = nlohmann::json::parse(output.substr(0, taken + 1), nullptr, false);
      if (parsed.is_discarded()) {
        std::fprintf(stderr, "accepted but not JSON: %.*s\n", static_cast<int>(taken + 1), output.data());
        std::abort();
      }
    }
  }
  if ((regex_mode || grammar_mode || tag_mode) && !m.accepting()) {
    bool any = false;
    for (int b = 0; b < 256 && !any; ++b) {
      Matcher next = m;
      const char c = static_cast<char>(b);
      any = next.advance(std::string_view(&c, 1));
    }
    if (!any) {
      std::fprintf(stderr, "a dead end after %zu bytes\n", taken);
      std::abort();
    }
  }
  std::vector<uint32_t> mask, cached;
  g_vocab->allowed_tokens(m, mask);
  moe::structured::TokenSetCache cache;  // a request's: filled by the first mask, used by the second
  for (int round = 0; round < 2; ++round) {
    g_vocab->allowed_tokens(m, cached, &cache);
    if (cached != mask) {
      std::fprintf(stderr, "the cached mask differs after %zu bytes (round %d)\n", taken, round);
      std::abort();
    }
  }
  for (int32_t id = 0; id < g_vocab->size(); ++id) {
    Matcher copy = m;
    const bool takes = !g_vocab->bytes(id).empty() && copy.advance(g_vocab->bytes(id));
    if (takes != moe::structured::mask_has(mask, id)) {
      std::fprintf(stderr, "mask disagrees on token %d after %zu bytes\n", id, taken);
      std::abort();
    }
  }
  return 0;
}
