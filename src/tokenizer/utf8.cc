#include "tokenizer/utf8.h"

#include <cstdlib>

#include <utf8proc.h>

#include "tokenizer/unicode_classes.h"

namespace moe::tokenizer {
namespace {

// Bounds of the second byte of a sequence, by lead byte (Unicode Table 3-7).
bool second_byte_ok(unsigned char lead, unsigned char b) {
  if (lead == 0xE0) return b >= 0xA0 && b <= 0xBF;
  if (lead == 0xED) return b >= 0x80 && b <= 0x9F;
  if (lead == 0xF0) return b >= 0x90 && b <= 0xBF;
  if (lead == 0xF4) return b >= 0x80 && b <= 0x8F;
  return b >= 0x80 && b <= 0xBF;
}

int sequence_length(unsigned char lead) {
  if (lead < 0x80) return 1;
  if (lead >= 0xC2 && lead <= 0xDF) return 2;
  if (lead >= 0xE0 && lead <= 0xEF) return 3;
  if (lead >= 0xF0 && lead <= 0xF4) return 4;
  return 0;  // continuation byte or never-valid lead (C0, C1, F5..FF)
}

}  // namespace

size_t decode_utf8(std::string_view text, size_t pos, char32_t& cp) {
  const auto lead = static_cast<unsigned char>(text[pos]);
  const int len = sequence_length(lead);
  if (len == 1) {
    cp = lead;
    return 1;
  }
  cp = kReplacementChar;
  if (len == 0) return 1;
  char32_t value = lead & (0xFF >> (len + 1));
  for (int i = 1; i < len; ++i) {
    if (pos + i >= text.size()) return i;
    const auto b = static_cast<unsigned char>(text[pos + i]);
    const bool ok = i == 1 ? second_byte_ok(lead, b) : (b >= 0x80 && b <= 0xBF);
    if (!ok) return i;
    value = (value << 6) | (b & 0x3F);
  }
  cp = value;
  return len;
}

void append_utf8(char32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

size_t num_code_points(std::string_view text) {
  size_t n = 0;
  for (char c : text) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  return n;
}

bool is_ascii(std::string_view text) {
  for (char c : text) {
    if (static_cast<unsigned char>(c) >= 0x80) return false;
  }
  return true;
}

bool is_valid_utf8(std::string_view text) {
  size_t pos = 0;
  while (pos < text.size()) {
    const auto lead = static_cast<unsigned char>(text[pos]);
    if (lead < 0x80) {
      ++pos;
      continue;
    }
    char32_t cp;
    const size_t len = decode_utf8(text, pos, cp);
    if (static_cast<int>(len) != sequence_length(lead)) return false;
    pos += len;
  }
  return true;
}

std::string sanitize_utf8(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  size_t pos = 0;
  while (pos < text.size()) {
    char32_t cp;
    const size_t len = decode_utf8(text, pos, cp);
    if (cp == kReplacementChar) {
      append_utf8(cp, out);
    } else {
      out.append(text.substr(pos, len));
    }
    pos += len;
  }
  return out;
}

size_t complete_utf8_prefix(std::string_view text) {
  // Look back at most 3 bytes for the lead byte of an unfinished sequence.
  const size_t n = text.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const auto b = static_cast<unsigned char>(text[n - back]);
    if ((b & 0xC0) == 0x80) continue;  // continuation byte: keep looking
    const int len = sequence_length(b);
    if (len <= 1) return n;  // ASCII or an invalid lead: nothing to wait for
    if (static_cast<size_t>(len) <= back) return n;  // the sequence is complete
    // Incomplete: hold it back only if what is there could still become valid.
    char32_t cp;
    const size_t got = decode_utf8(text, n - back, cp);
    return got == back ? n - back : n;
  }
  return n;
}

namespace {

std::string utf8proc_nfc(std::string_view text) {
  utf8proc_uint8_t* result = nullptr;
  const utf8proc_ssize_t len =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                   static_cast<utf8proc_ssize_t>(text.size()), &result,
                   static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  if (len < 0) {  // only on invalid UTF-8, which callers sanitize first
    std::free(result);
    return std::string(text);
  }
  std::string out(reinterpret_cast<const char*>(result), static_cast<size_t>(len));
  std::free(result);
  return out;
}

}  // namespace

// Hugging Face's NFC sees the opaque code points as unassigned: starters with no
// decomposition or composition, so nothing reorders or composes across them. NFC
// of the runs between them, with them copied through, is exactly that.
std::string nfc(std::string_view text) {
  if (is_ascii(text)) return std::string(text);
  std::string out;
  size_t run_start = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    char32_t cp;
    const size_t len = decode_utf8(text, pos, cp);
    if (cp >= 0x300 && is_nfc_opaque(cp)) {
      out += utf8proc_nfc(text.substr(run_start, pos - run_start));
      out.append(text.substr(pos, len));
      run_start = pos + len;
    }
    pos += len;
  }
  if (run_start == 0) return utf8proc_nfc(text);
  out += utf8proc_nfc(text.substr(run_start));
  return out;
}

}  // namespace moe::tokenizer
