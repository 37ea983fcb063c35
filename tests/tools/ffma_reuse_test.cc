// tools/ffma_reuse's rewrite on CUDA ELF images built here: which FFMAs of a
// run get the slot-B reuse and no-yield bits, and what is left alone (short
// runs, RZ operands, a changing scale register, other kernels, other
// architectures). The build checks the real library (CTest ffma_reuse_applied).
#include "tools/ffma_reuse/ffma_reuse.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace moe::tools {
namespace {

constexpr uint64_t kBits = kFfmaReuseB | kFfmaNoYield;

struct Instruction {
  uint64_t lo, hi;
};

// FFMA Rd, Ra, Rb, Rc (register form), control bits as ptxas leaves half of them: may yield, no reuse.
Instruction ffma(int d, int a, int b, int c) {
  return {0x7223 | uint64_t(d) << 16 | uint64_t(a) << 24 | uint64_t(b) << 32, 0x000fc20000000000 | uint64_t(c)};
}
Instruction nop() { return {0x7918, 0x000fc00000000000}; }

void put(std::vector<unsigned char>& out, size_t at, const void* p, size_t n) {
  if (out.size() < at + n) out.resize(at + n);
  std::memcpy(out.data() + at, p, n);
}

// A minimal ELF64 EM_CUDA image for `sm` with one .text section per kernel,
// after `prefix` bytes of something else (as inside a host object).
std::vector<unsigned char> image(int sm, const std::vector<std::pair<std::string, std::vector<Instruction>>>& kernels,
                                 size_t prefix = 40) {
  std::vector<unsigned char> out(prefix, 0xab);
  const size_t base = prefix;
  std::string names(1, '\0');
  std::vector<uint32_t> name_offsets;
  name_offsets.push_back(static_cast<uint32_t>(names.size()));
  names += ".shstrtab";
  names += '\0';
  for (const auto& [name, code] : kernels) {
    name_offsets.push_back(static_cast<uint32_t>(names.size()));
    names += ".text." + name;
    names += '\0';
  }
  // Header 64 bytes, then names, then the code (16-aligned), then the section headers.
  put(out, base + 64, names.data(), names.size());
  size_t at = (64 + names.size() + 15) / 16 * 16;
  std::vector<std::pair<uint64_t, uint64_t>> sections = {{0, 0}, {64, names.size()}};
  for (const auto& [name, code] : kernels) {
    for (size_t i = 0; i < code.size(); ++i) put(out, base + at + 16 * i, &code[i], 16);
    sections.push_back({at, 16 * code.size()});
    at += 16 * code.size();
  }
  const uint64_t shoff = at;
  for (size_t i = 0; i < sections.size(); ++i) {
    unsigned char header[64] = {};
    const uint32_t name = i == 0 ? 0 : name_offsets[i - 1];
    std::memcpy(header, &name, 4);
    std::memcpy(header + 0x18, &sections[i].first, 8);
    std::memcpy(header + 0x20, &sections[i].second, 8);
    put(out, base + shoff + 64 * i, header, 64);
  }
  unsigned char elf[64] = {0x7f, 'E', 'L', 'F', 2, 1, 1};
  const uint16_t machine = 190, shentsize = 64, shnum = static_cast<uint16_t>(sections.size()), shstrndx = 1;
  const uint32_t flags = uint32_t(sm) << 8 | 0x4;
  std::memcpy(elf + 18, &machine, 2);
  std::memcpy(elf + 0x28, &shoff, 8);
  std::memcpy(elf + 0x30, &flags, 4);
  std::memcpy(elf + 0x3a, &shentsize, 2);
  std::memcpy(elf + 0x3c, &shnum, 2);
  std::memcpy(elf + 0x3e, &shstrndx, 2);
  put(out, base, elf, 64);
  return out;
}

uint64_t hi_of(const std::vector<unsigned char>& data, const Instruction& original) {
  for (size_t at = 0; at + 16 <= data.size(); ++at)
    if (std::memcmp(data.data() + at, &original.lo, 8) == 0) {
      uint64_t hi;
      std::memcpy(&hi, data.data() + at + 8, 8);
      return hi;
    }
  ADD_FAILURE() << "instruction not found";
  return 0;
}

// A promotion run: sum[i] += part[i] * scale, the scale register changing
// halfway; `first` makes each run's instructions distinct (hi_of finds them).
std::vector<Instruction> promotion_run(int length, int scale0, int scale1, int first = 0) {
  std::vector<Instruction> run = {nop()};
  for (int i = 0; i < length; ++i)
    run.push_back(ffma(100 + first + i, first + i, i < length / 2 ? scale0 : scale1, 100 + first + i));
  run.push_back(nop());
  return run;
}

TEST(FfmaReuse, GivesTheScaleOperandReuseWhereTheNextFfmaReadsIt) {
  const std::vector<Instruction> run = promotion_run(20, 200, 201);
  std::vector<unsigned char> data = image(90, {{"prefill_fp8", run}});
  const FfmaReuseCounts counts = rewrite_ffma_runs(data, {"prefill_fp8"}, false);
  EXPECT_EQ(counts.images, 1);
  EXPECT_EQ(counts.runs, 1);
  EXPECT_EQ(counts.changed, 18);  // not the last reader of R200 (the next reads R201), nor the run's last
  for (int i = 1; i <= 20; ++i) {
    const bool expect = i != 10 && i != 20;
    EXPECT_EQ((hi_of(data, run[i]) & kBits) == kBits, expect) << "FFMA " << i;
    EXPECT_EQ(hi_of(data, run[i]) & ~kBits, run[i].hi & ~kBits) << "other bits of FFMA " << i;
  }
  EXPECT_EQ(rewrite_ffma_runs(data, {"prefill_fp8"}, true).changed, 0);  // checking: done
  const std::vector<unsigned char> once = data;
  EXPECT_EQ(rewrite_ffma_runs(data, {"prefill_fp8"}, false).changed, 0);  // idempotent
  EXPECT_EQ(data, once);
}

TEST(FfmaReuse, LeavesShortRunsOtherKernelsAndOtherArchitecturesAlone) {
  std::vector<Instruction> with_rz = promotion_run(20, 200, 200, 60);
  with_rz[5] = ffma(164, 64, 200, 255);  // FFMA R164, R64, R200, RZ
  std::vector<unsigned char> data = image(90, {{"prefill_fp8", promotion_run(15, 200, 200, 0)},
                                               {"decode_fp8", promotion_run(20, 200, 200, 20)},
                                               {"prefill_fp8_rz", with_rz}});
  const std::vector<unsigned char> sm100 = image(100, {{"prefill_fp8", promotion_run(20, 200, 200, 90)}}, 24);
  data.insert(data.end(), sm100.begin(), sm100.end());
  const std::vector<unsigned char> original = data;
  const FfmaReuseCounts counts = rewrite_ffma_runs(data, {"prefill_fp8"}, false);
  EXPECT_EQ(counts.images, 1);  // the sm_100 image is not one
  EXPECT_EQ(counts.runs, 1);    // the 15-FFMA run is too short; decode_fp8 is not asked for
  EXPECT_EQ(counts.changed, 17);  // 19 pairs less the two around the RZ one
  EXPECT_EQ((hi_of(data, with_rz[4]) & kBits) == kBits, false);
  EXPECT_EQ((hi_of(data, with_rz[5]) & kBits) == kBits, false);
  EXPECT_EQ((hi_of(data, with_rz[6]) & kBits) == kBits, true);
  // Everything outside prefill_fp8_rz is as it was.
  size_t differing = 0;
  for (size_t i = 0; i < data.size(); ++i) differing += data[i] != original[i];
  EXPECT_EQ(differing, 34u);  // two bytes of each rewritten high word (bit 45 in byte 5, bit 59 in byte 7)
}

}  // namespace
}  // namespace moe::tools
