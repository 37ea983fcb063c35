#include "tokenizer/unicode_classes.h"

#include <algorithm>
#include <array>
#include <vector>

namespace moe::tokenizer {
namespace {

struct ClassRange {
  char32_t first, last;
  CharClass cls;
};

#include "tokenizer/unicode_classes.inc"

constexpr uint8_t kNfcOpaqueBit = 4;

constexpr char32_t kNumCodePoints = 0x110000;
constexpr int kBlockBits = 8;
constexpr char32_t kBlockSize = 1u << kBlockBits;

// Two-stage table: block index by (cp >> 8), then the entries of that block's 256
// code points (CharClass | kNfcOpaqueBit); identical blocks are stored once.
struct ClassTable {
  std::array<uint16_t, kNumCodePoints / kBlockSize> block_of{};
  std::vector<uint8_t> blocks;

  ClassTable() {
    std::vector<uint8_t> flat(kNumCodePoints, kOther);
    for (const ClassRange& r : kClassRanges) {
      for (char32_t cp = r.first; cp <= r.last; ++cp) flat[cp] = r.cls;
    }
    for (char32_t cp : kNfcOpaque) flat[cp] |= kNfcOpaqueBit;
    for (char32_t b = 0; b < kNumCodePoints / kBlockSize; ++b) {
      const uint8_t* block = &flat[b * kBlockSize];
      size_t found = blocks.size() / kBlockSize;
      for (size_t k = 0; k < blocks.size() / kBlockSize; ++k) {
        if (std::equal(block, block + kBlockSize, &blocks[k * kBlockSize])) {
          found = k;
          break;
        }
      }
      if (found == blocks.size() / kBlockSize) blocks.insert(blocks.end(), block, block + kBlockSize);
      block_of[b] = static_cast<uint16_t>(found);
    }
  }
};

const ClassTable& table() {
  static const ClassTable instance;
  return instance;
}


uint8_t entry(char32_t cp) {
  if (cp >= kNumCodePoints) return kOther;
  const ClassTable& t = table();
  return t.blocks[(static_cast<size_t>(t.block_of[cp >> kBlockBits]) << kBlockBits) | (cp & (kBlockSize - 1))];
}

}  // namespace

CharClass char_class(char32_t cp) { return static_cast<CharClass>(entry(cp) & 3); }

bool is_nfc_opaque(char32_t cp) { return (entry(cp) & kNfcOpaqueBit) != 0; }

}  // namespace moe::tokenizer
