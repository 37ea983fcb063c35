#include "tokenizer/pretokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "tokenizer/unicode_classes.h"
#include "tokenizer/utf8.h"

namespace moe::tokenizer {
namespace {

// Unicode White_Space (PropList.txt), which is what Oniguruma's \s matches.
constexpr std::string_view kWhiteSpaceMembers =
    "\\x{9}-\\x{D}\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}"
    "\\x{202F}\\x{205F}\\x{3000}";

std::string pcre2_error_text(int code) {
  PCRE2_UCHAR buffer[256];
  pcre2_get_error_message(code, buffer, sizeof(buffer));
  return reinterpret_cast<const char*>(buffer);
}

// The text decoded once: code points, their classes, and byte offsets
// (offset[i] is where code point i starts; offset[n] == text.size()).
struct DecodedText {
  std::vector<char32_t> cp;
  std::vector<CharClass> cls;
  std::vector<uint32_t> offset;

  explicit DecodedText(std::string_view text) {
    cp.reserve(text.size());
    cls.reserve(text.size());
    offset.reserve(text.size() + 1);
    size_t pos = 0;
    while (pos < text.size()) {
      char32_t c;
      const auto b = static_cast<unsigned char>(text[pos]);
      const size_t len = b < 0x80 ? (c = b, 1) : decode_utf8(text, pos, c);
      cp.push_back(c);
      cls.push_back(char_class(c));
      offset.push_back(static_cast<uint32_t>(pos));
      pos += len;
    }
    offset.push_back(static_cast<uint32_t>(text.size()));
  }
  size_t size() const { return cp.size(); }
  bool is_newline(size_t i) const { return cp[i] == '\r' || cp[i] == '\n'; }
};

// Lower-cases the letters of the contractions the way Oniguruma's case folding
// matches them: ASCII case, and U+017F (long s) for 's'.
char32_t fold_contraction_char(char32_t c) {
  if (c >= 'A' && c <= 'Z') return c + ('a' - 'A');
  if (c == 0x17F) return 's';
  return c;
}

// The end (exclusive) of the match of kQwenPattern at code point i, trying the
// alternatives in the pattern's order with its backtracking made explicit:
//   1 (?i:'s|'t|'re|'ve|'m|'ll|'d)   2 [^\r\n\p{L}\p{N}]?\p{L}+   3 \p{N}
//   4  ?[^\s\p{L}\p{N}]+[\r\n]*      5 \s*[\r\n]+   6 \s+(?!\S)   7 \s+
// Every character is in one class, so some alternative always matches.
size_t match_qwen_at(const DecodedText& t, size_t i) {
  const size_t n = t.size();
  if (t.cp[i] == '\'' && i + 1 < n) {  // 1
    const char32_t c1 = fold_contraction_char(t.cp[i + 1]);
    if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return i + 2;
    if (i + 2 < n) {
      const char32_t c2 = fold_contraction_char(t.cp[i + 2]);
      if ((c1 == 'r' || c1 == 'v') && c2 == 'e') return i + 3;
      if (c1 == 'l' && c2 == 'l') return i + 3;
    }
  }
  auto letters_from = [&](size_t j) {
    while (j < n && t.cls[j] == kLetter) ++j;
    return j;
  };
  const CharClass c = t.cls[i];
  if (c == kLetter) return letters_from(i);  // 2, without the optional prefix
  if (c != kNumber && !t.is_newline(i) && i + 1 < n && t.cls[i + 1] == kLetter) return letters_from(i + 1);  // 2
  if (c == kNumber) return i + 1;  // 3
  size_t j = i;
  if (t.cp[i] == ' ' && i + 1 < n && t.cls[i + 1] == kOther) j = i + 1;  // 4
  if (t.cls[j] == kOther) {
    while (j < n && t.cls[j] == kOther) ++j;
    while (j < n && t.is_newline(j)) ++j;
    return j;
  }
  // c == kSpace. 5: \s* backs off to the last newline of the whitespace run.
  size_t run_end = i;
  while (run_end < n && t.cls[run_end] == kSpace) ++run_end;
  for (size_t k = run_end; k > i; --k) {
    if (t.is_newline(k - 1)) return k;
  }
  if (run_end == n) return run_end;              // 6: nothing follows
  if (run_end - i >= 2) return run_end - 1;      // 6: leave one space for the next word
  return run_end;                                // 7
}

void split_qwen(std::string_view text, std::vector<std::string_view>& pieces) {
  const DecodedText t(text);
  size_t i = 0;
  while (i < t.size()) {
    const size_t end = match_qwen_at(t, i);
    pieces.push_back(text.substr(t.offset[i], t.offset[end] - t.offset[i]));
    i = end;
  }
}

}  // namespace

struct Pretokenizer::Code {
  pcre2_code* code = nullptr;
  ~Code() { pcre2_code_free(code); }
};

std::string rewrite_whitespace_classes(const std::string& pattern) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char next = pattern[i + 1];
      ++i;
      if (next == 's') {
        out += in_class ? std::string(kWhiteSpaceMembers) : "[" + std::string(kWhiteSpaceMembers) + "]";
      } else if (next == 'S' && !in_class) {
        out += "[^" + std::string(kWhiteSpaceMembers) + "]";
      } else {
        out += c;
        out += next;
      }
      continue;
    }
    if (c == '[' && !in_class) {
      in_class = true;
      out += c;
      // A ']' right after '[' or '[^' is a literal member, not the end.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out += pattern[++i];
      continue;
    }
    if (c == ']' && in_class) in_class = false;
    out += c;
  }
  return out;
}

Expected<Pretokenizer> Pretokenizer::create(const std::string& pattern, Engine engine) {
  if (engine == Engine::kAuto && pattern == kQwenPattern) return Pretokenizer(nullptr);
  const std::string rewritten = rewrite_whitespace_classes(pattern);
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(rewritten.data()), rewritten.size(),
                                   PCRE2_UTF | PCRE2_UCP, &error_code, &error_offset, nullptr);
  if (code == nullptr) {
    return invalid_argument("pretokenizer regex '{}': {} at offset {}", pattern,
                            pcre2_error_text(error_code), error_offset);
  }
  auto holder = std::make_shared<Code>();
  holder->code = code;
  // JIT is an optimization: the interpreter gives the same matches if it fails.
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  return Pretokenizer(std::move(holder));
}

void Pretokenizer::split(std::string_view text, std::vector<std::string_view>& pieces) const {
  if (code_ == nullptr) {
    split_qwen(text, pieces);
  } else {
    split_pcre2(text, pieces);
  }
}

void Pretokenizer::split_pcre2(std::string_view text, std::vector<std::string_view>& pieces) const {
  pcre2_match_data* match = pcre2_match_data_create_from_pattern(code_->code, nullptr);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t pos = 0;
  size_t gap_start = 0;
  while (pos < text.size()) {
    const int rc = pcre2_match(code_->code, subject, text.size(), pos, PCRE2_NO_UTF_CHECK, match, nullptr);
    if (rc < 0) break;  // no further match (or a resource limit): the rest is one gap
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match);
    const size_t start = ovector[0];
    const size_t end = ovector[1];
    if (start > gap_start) pieces.push_back(text.substr(gap_start, start - gap_start));
    if (end > start) {
      pieces.push_back(text.substr(start, end - start));
      pos = end;
    } else {
      // Empty match: step over one code point so the scan always advances.
      pos = start + 1;
      while (pos < text.size() && (static_cast<unsigned char>(text[pos]) & 0xC0) == 0x80) ++pos;
      continue;
    }
    gap_start = end;
  }
  if (gap_start < text.size()) pieces.push_back(text.substr(gap_start));
  pcre2_match_data_free(match);
}

}  // namespace moe::tokenizer
