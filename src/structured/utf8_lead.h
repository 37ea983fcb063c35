// A UTF-8 sequence read one byte at a time, as the matcher (a string's
// characters) and the token filter (runs of plain characters) read it.
#pragma once

#include <cstdint>

namespace moe::structured {

// A UTF-8 sequence's lead byte: how many continuation bytes follow, the
// range of the first one (no overlong forms, no surrogates, nothing past
// U+10FFFF), the lead's bits of the code point, and the code points the
// sequence may spell.
struct Utf8Lead {
  int32_t continuations = 0;
  uint8_t lo = 0, hi = 0;
  uint32_t bits = 0, first = 0, last = 0;
};

// False for a byte that does not begin a multi-byte sequence (ASCII, a
// continuation byte, C0, C1, F5-FF).
inline bool utf8_lead(uint8_t byte, Utf8Lead& lead) {
  if (byte >= 0xC2 && byte <= 0xDF) {
    const uint32_t bits = byte & 0x1F;
    lead = {1, 0x80, 0xBF, bits, bits << 6, (bits << 6) | 0x3F};
  } else if (byte == 0xE0) {
    lead = {2, 0xA0, 0xBF, 0, 0x800, 0xFFF};
  } else if (byte == 0xED) {
    lead = {2, 0x80, 0x9F, 0xD, 0xD000, 0xD7FF};
  } else if (byte >= 0xE1 && byte <= 0xEF) {
    const uint32_t bits = byte & 0x0F;
    lead = {2, 0x80, 0xBF, bits, bits << 12, (bits << 12) | 0xFFF};
  } else if (byte == 0xF0) {
    lead = {3, 0x90, 0xBF, 0, 0x10000, 0x3FFFF};
  } else if (byte >= 0xF1 && byte <= 0xF3) {
    const uint32_t bits = byte & 0x07;
    lead = {3, 0x80, 0xBF, bits, bits << 18, (bits << 18) | 0x3FFFF};
  } else if (byte == 0xF4) {
    lead = {3, 0x80, 0x8F, 4, 0x100000, 0x10FFFF};
  } else {
    return false;
  }
  return true;
}

}  // namespace moe::structured
