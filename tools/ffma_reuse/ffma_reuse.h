// The rewrite of tools/ffma_reuse (ffma_reuse.cc says what and why), for the
// tool and its test (tests/tools/ffma_reuse_test.cc).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace moe::tools {

inline constexpr uint64_t kFfmaReuseB = uint64_t{1} << 59, kFfmaNoYield = uint64_t{1} << 45;

struct FfmaReuseCounts {
  int images = 0;   // sm_90 CUDA ELF images found
  int runs = 0;     // runs of 16 or more FFMAs in the named kernels
  int changed = 0;  // FFMAs given the bits (checking: still lacking them)
};

namespace ffma_reuse_detail {

inline constexpr uint16_t kEmCuda = 190;
inline constexpr int kMinRun = 16;

template <typename T>
T load(const std::vector<unsigned char>& data, size_t at) {
  T v;
  std::memcpy(&v, data.data() + at, sizeof v);
  return v;
}

inline bool is_ffma(uint64_t lo) { return (lo & 0x1ff) == 0x023; }
inline bool is_register_ffma(uint64_t lo) { return (lo & 0xfff) == 0x223; }
inline bool no_rz(uint64_t lo, uint64_t hi) {
  return ((lo >> 16) & 0xff) != 255 && ((lo >> 24) & 0xff) != 255 && ((lo >> 32) & 0xff) != 255 && (hi & 0xff) != 255;
}

// One kernel's code: [at, at + size), 16-byte instructions.
inline void patch_text(std::vector<unsigned char>& data, size_t at, size_t size, bool check, FfmaReuseCounts& counts) {
  const size_t n = size / 16;
  auto lo = [&](size_t i) { return load<uint64_t>(data, at + 16 * i); };
  auto hi = [&](size_t i) { return load<uint64_t>(data, at + 16 * i + 8); };
  for (size_t i = 0; i < n;) {
    size_t j = i;
    while (j < n && is_ffma(lo(j))) ++j;
    if (j - i >= kMinRun) {
      ++counts.runs;
      for (size_t k = i; k + 1 < j; ++k) {
        if (!is_register_ffma(lo(k)) || !is_register_ffma(lo(k + 1))) continue;
        if (!no_rz(lo(k), hi(k)) || !no_rz(lo(k + 1), hi(k + 1))) continue;
        if (((lo(k) >> 32) & 0xff) != ((lo(k + 1) >> 32) & 0xff)) continue;
        const uint64_t bits = hi(k) | kFfmaReuseB | kFfmaNoYield;
        if (bits == hi(k)) continue;
        ++counts.changed;
        if (!check) std::memcpy(data.data() + at + 16 * k + 8, &bits, sizeof bits);
      }
    }
    i = j > i ? j : i + 1;
  }
}

// The sm_90 CUDA ELF image at `at` (ELF64, EM_CUDA): its named kernels' sections.
inline void patch_image(std::vector<unsigned char>& data, size_t at, const std::vector<std::string>& kernels,
                        bool check, FfmaReuseCounts& counts) {
  const auto shoff = load<uint64_t>(data, at + 0x28);
  const auto shentsize = load<uint16_t>(data, at + 0x3a), shnum = load<uint16_t>(data, at + 0x3c),
             shstrndx = load<uint16_t>(data, at + 0x3e);
  auto header = [&](size_t i) { return at + shoff + i * shentsize; };
  if (shentsize < 64 || shstrndx >= shnum || header(shnum) > data.size()) return;
  const size_t strtab = at + load<uint64_t>(data, header(shstrndx) + 0x18);
  ++counts.images;
  for (size_t i = 0; i < shnum; ++i) {
    const size_t name_at = strtab + load<uint32_t>(data, header(i));
    const size_t off = at + load<uint64_t>(data, header(i) + 0x18), size = load<uint64_t>(data, header(i) + 0x20);
    if (name_at >= data.size() || off + size > data.size()) continue;
    const char* name_ptr = reinterpret_cast<const char*>(data.data() + name_at);
    const std::string_view name(name_ptr, strnlen(name_ptr, data.size() - name_at));
    if (name.substr(0, 6) != ".text.") continue;
    for (const std::string& k : kernels) {
      if (name.find(k) != std::string_view::npos) {
        patch_text(data, off, size, check, counts);
        break;
      }
    }
  }
}

}  // namespace ffma_reuse_detail

// Rewrites `data` in memory (with `check`, only counts what it would rewrite):
// every sm_90 CUDA ELF image embedded in it, the `.text.` sections whose
// names contain one of `kernels`.
inline FfmaReuseCounts rewrite_ffma_runs(std::vector<unsigned char>& data, const std::vector<std::string>& kernels,
                                         bool check) {
  using ffma_reuse_detail::load;
  FfmaReuseCounts counts;
  static constexpr unsigned char kMagic[4] = {0x7f, 'E', 'L', 'F'};
  for (size_t at = 0; at + 0x40 <= data.size(); ++at) {
    if (std::memcmp(data.data() + at, kMagic, 4) != 0 || data[at + 4] != 2) continue;
    if (load<uint16_t>(data, at + 18) != ffma_reuse_detail::kEmCuda ||
        ((load<uint32_t>(data, at + 0x30) >> 8) & 0xff) != 90)
      continue;
    ffma_reuse_detail::patch_image(data, at, kernels, check, counts);
  }
  return counts;
}

}  // namespace moe::tools
