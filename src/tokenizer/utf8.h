// UTF-8 helpers shared by the tokenizer, the detokenizer and the template engine.
//
// Invalid input bytes (a defined behaviour, documented in docs/tokenizer.md): every
// maximal ill-formed subsequence is replaced by U+FFFD, the Unicode "substitution of
// maximal subparts" practice that Python's errors="replace", Rust's
// String::from_utf8_lossy and the WHATWG TextDecoder also follow. So bytes that are
// not UTF-8 tokenize exactly as their lossy decoding does in Hugging Face.
//
// Free functions with no state: any thread may call them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace moe::tokenizer {

inline constexpr char32_t kReplacementChar = 0xFFFD;

// Decodes one code point at `text[pos]`. Returns its length in bytes (1..4) and
// sets `cp`; on an ill-formed sequence returns the length of the maximal
// ill-formed subpart (>= 1) and sets `cp` to kReplacementChar. pos < text.size().
size_t decode_utf8(std::string_view text, size_t pos, char32_t& cp);

// Appends the UTF-8 encoding of `cp` (a scalar value) to `out`.
void append_utf8(char32_t cp, std::string& out);

bool is_valid_utf8(std::string_view text);

// `text` with each maximal ill-formed subpart replaced by U+FFFD.
std::string sanitize_utf8(std::string_view text);

// The length of the longest prefix of `text` that ends on a code point boundary
// and leaves out only an incomplete (still completable) sequence at the end.
// Used by streaming to hold back a partial character.
size_t complete_utf8_prefix(std::string_view text);

// NFC normalization (utf8proc). `text` must be valid UTF-8.
std::string nfc(std::string_view text);

// True when every byte is ASCII; ASCII text is already in NFC.
bool is_ascii(std::string_view text);

// Code points of UTF-8 text (its bytes that do not continue a sequence), as
// Python's len() and Jinja's length count characters.
size_t num_code_points(std::string_view text);

}  // namespace moe::tokenizer
