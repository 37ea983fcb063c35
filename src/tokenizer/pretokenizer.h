// The `Split` pretokenizer of tokenizer.json (behavior "Isolated"): the regex's
// matches and the gaps between them become the pieces that BPE encodes one by one.
//
// The regex runs on PCRE2 with JIT, in UTF + UCP mode. Hugging Face runs it on
// Oniguruma, whose `\s` is the Unicode White_Space property; PCRE2's `\s` also
// matches U+180E, so `\s` / `\S` are rewritten to the White_Space set before
// compiling (see rewrite_whitespace_classes).
//
// Qwen2/Qwen3's pattern (kQwenPattern) has a hand-written matcher instead, with
// the character tables of Hugging Face's regex engine (unicode_classes.h): PCRE2
// 10.42 knows Unicode 14 while Hugging Face uses Unicode 16, which changes how
// newer letters split. The unit test checks the two engines agree on text whose
// characters both Unicode versions classify the same way.
//
// Immutable after create(): any thread may call split() concurrently (each call
// uses its own match data).
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace moe::tokenizer {

// The Split regex of Qwen2 and Qwen3's tokenizer.json.
inline constexpr std::string_view kQwenPattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

class Pretokenizer {
 public:
  enum class Engine { kAuto, kPcre2 };

  // `pattern` is the Split pattern's "Regex" string from tokenizer.json. kAuto
  // uses the hand-written matcher for kQwenPattern and PCRE2 otherwise.
  static Expected<Pretokenizer> create(const std::string& pattern, Engine engine = Engine::kAuto);

  // Appends the pieces of `text` (valid UTF-8) to `pieces`, views into `text`,
  // in order; together they cover `text` exactly.
  void split(std::string_view text, std::vector<std::string_view>& pieces) const;

 private:
  struct Code;
  explicit Pretokenizer(std::shared_ptr<const Code> code) : code_(std::move(code)) {}
  void split_pcre2(std::string_view text, std::vector<std::string_view>& pieces) const;
  std::shared_ptr<const Code> code_;  // null: the hand-written kQwenPattern matcher
};

// `\s` and `\S` of `pattern` replaced by explicit Unicode White_Space classes.
std::string rewrite_whitespace_classes(const std::string& pattern);

}  // namespace moe::tokenizer
