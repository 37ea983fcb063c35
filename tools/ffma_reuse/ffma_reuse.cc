// ffma_reuse: a build step for the FP8 prefill GEMM (src/ops/cuda/grouped_gemm_prefill.cu).
//
//   ffma_reuse [--check] FILE KERNEL_SUBSTRING...
//
// Its consumers promote each K-block's partial sums with runs of 64 FFMAs
// (sum += partial * scale, one scale register for 32 of them). ptxas gives
// every other FFMA of such a run leave to yield, and a yielding FFMA cannot
// pass its scale operand on through the operand reuse cache, so half of them
// read the scale from the register file beside the two accumulator
// registers. ncu puts the promotions at ~2.5 cycles per FFMA, a third of
// their samples in dispatch stalls, and a quarter of the consumers' time
// (H200, 2026-12-04). With every FFMA whose successor reads the same scale
// register given the reuse flag for that operand and no yield -- the
// control bits ptxas itself gives the other half -- the FP8 prefill GEMMs ran
// 2.7-3.0% faster, bytes unchanged (bench/results/
// 2026-12-04_gpu_fp8_prefill_epilogue_warps, call 6).
//
// The file (an object, a static library or an executable) is rewritten in
// place: every CUDA ELF image embedded in it uncompressed (nvcc's fatbins)
// for sm_90 (e_flags bits 8-15 = 90; other architectures encode differently
// and are left alone), every `.text.<kernel>` section whose name contains a
// KERNEL_SUBSTRING, every run of 16 or more consecutive FFMAs in it (opcode
// bits 0-8 = 0x023: register, immediate and constant forms). In a run, a
// register-form FFMA (bits 0-11 = 0x223; destination bits 16-23, sources
// 24-31, 32-39 and the high word's 0-7, none RZ) followed by another that
// reads the same slot-B register (bits 32-39) gets the high word's bit 59
// (reuse slot B) and bit 45 (no yield). Idempotent. --check changes nothing
// and fails unless at least one run was found and every such FFMA already
// carries both bits (a test that the build applied the step).
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>
#include <vector>

namespace {

constexpr uint64_t kReuseB = uint64_t{1} << 59, kNoYield = uint64_t{1} << 45;
constexpr uint16_t kEmCuda = 190;
constexpr int kMinRun = 16;

template <typename T>
T load(const std::vector<unsigned char>& data, size_t at) {
  T v;
  std::memcpy(&v, data.data() + at, sizeof v);
  return v;
}

struct Counts {
  int images = 0, runs = 0, changed = 0;
};

bool is_ffma(uint64_t lo) { return (lo & 0x1ff) == 0x023; }
bool is_register_ffma(uint64_t lo) { return (lo & 0xfff) == 0x223; }
bool no_rz(uint64_t lo, uint64_t hi) {
  return ((lo >> 16) & 0xff) != 255 && ((lo >> 24) & 0xff) != 255 && ((lo >> 32) & 0xff) != 255 && (hi & 0xff) != 255;
}

// One kernel's code: [at, at + size), 16-byte instructions.
void patch_text(std::vector<unsigned char>& data, size_t at, size_t size, bool check, Counts& counts) {
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
        const uint64_t bits = hi(k) | kReuseB | kNoYield;
        if (bits == hi(k)) continue;
        ++counts.changed;
        if (!check) std::memcpy(data.data() + at + 16 * k + 8, &bits, sizeof bits);
      }
    }
    i = j > i ? j : i + 1;
  }
}

// The sm_90 CUDA ELF image at `at` (ELF64, EM_CUDA): its kernels' sections.
void patch_image(std::vector<unsigned char>& data, size_t at, const std::vector<std::string>& kernels, bool check,
                 Counts& counts) {
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
    const std::string_view name(reinterpret_cast<const char*>(data.data() + name_at),
                                strnlen(reinterpret_cast<const char*>(data.data() + name_at), data.size() - name_at));
    if (name.substr(0, 6) != ".text.") continue;
    for (const std::string& k : kernels) {
      if (name.find(k) != std::string_view::npos) {
        patch_text(data, off, size, check, counts);
        break;
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  int first = 1;
  const bool check = argc > 1 && std::string_view(argv[1]) == "--check";
  if (check) ++first;
  if (argc - first < 2) {
    std::fprintf(stderr, "usage: ffma_reuse [--check] FILE KERNEL_SUBSTRING...\n");
    return 2;
  }
  const std::string path = argv[first];
  const std::vector<std::string> kernels(argv + first + 1, argv + argc);
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "ffma_reuse: cannot read %s\n", path.c_str());
    return 1;
  }
  std::vector<unsigned char> data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  Counts counts;
  static constexpr unsigned char kMagic[4] = {0x7f, 'E', 'L', 'F'};
  for (size_t at = 0; at + 0x40 <= data.size(); ++at) {
    if (std::memcmp(data.data() + at, kMagic, 4) != 0 || data[at + 4] != 2) continue;
    if (load<uint16_t>(data, at + 18) != kEmCuda || ((load<uint32_t>(data, at + 0x30) >> 8) & 0xff) != 90) continue;
    patch_image(data, at, kernels, check, counts);
  }
  std::printf("ffma_reuse: %s: %d sm_90 images, %d FFMA runs, %d FFMAs %s\n", path.c_str(), counts.images,
              counts.runs, counts.changed, check ? "still without the reuse flag" : "given the reuse flag");
  if (check) return counts.runs > 0 && counts.changed == 0 ? 0 : 1;
  if (counts.changed > 0) {
    std::ofstream out(path, std::ios::binary | std::ios::in | std::ios::out);
    out.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
    if (!out) {
      std::fprintf(stderr, "ffma_reuse: cannot write %s\n", path.c_str());
      return 1;
    }
  }
  return 0;
}
