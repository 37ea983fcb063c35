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
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>
#include <vector>

#include "tools/ffma_reuse/ffma_reuse.h"

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
  const moe::tools::FfmaReuseCounts counts = moe::tools::rewrite_ffma_runs(data, kernels, check);
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
