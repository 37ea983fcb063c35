// The character classes of the pretokenizer regex (\p{L}, \p{N}, \s) with the
// Unicode tables of Hugging Face tokenizers' regex engine (Unicode 16.0), generated
// into unicode_classes.inc by tools/tokenizer/gen_unicode_classes.mjs.
//
// Free functions over an immutable table: any thread may call them.
#pragma once

#include <cstdint>

namespace moe::tokenizer {

enum CharClass : uint8_t { kOther = 0, kLetter = 1, kNumber = 2, kSpace = 3 };

// The class of a Unicode scalar value (kOther above U+10FFFF).
CharClass char_class(char32_t cp);

// True for the code points Hugging Face's NFC (an older Unicode version) treats as
// unassigned although utf8proc knows them: NFC must leave them inert (utf8.h).
bool is_nfc_opaque(char32_t cp);

}  // namespace moe::tokenizer
