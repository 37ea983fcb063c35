// Timeline of the decode attention kernel (ops/cuda/attention_mma.cu): every
// warp stamps %globaltimer and clock64 at entry, after griddepcontrol.wait,
// when its first chunk is in shared memory, at the end of its loop and at the
// block's exit (the kernel's MOE_TRACE points, compiled in here with
// MOE_ATTENTION_TRACE); printed as percentiles over the warps, with per-SM
// loop ends and the spread within blocks. Built with the GPU targets
// (bench/CMakeLists.txt); run on the GPU machine:
//   attention_trace BATCH CONTEXT [SPLITS]
// The kernel's file is compiled into this program; the few functions it
// needs from the rest of the library come from bench/gpu/standalone_kernel.h.
#include <algorithm>
#include <cstdio>
#include <random>
#include <vector>

#include "bench/gpu/standalone_kernel.h"
#include "ops/cuda/attention_mma.cu"
using namespace moe::ops::cuda;
int main(int argc, char** argv) {
  const int batch = argc > 1 ? atoi(argv[1]) : 64, context = argc > 2 ? atoi(argv[2]) : 1024,
            splits = argc > 3 ? atoi(argv[3]) : 0;
  const int Hq = 64, Hkv = 4, D = 128, page = 16;
  const int pps = context / page, num_pages = batch * pps;
  size_t kv_elems = size_t(num_pages) * Hkv * page * D;
  bf16 *k, *v, *q, *out;
  int *pos, *seq, *table;
  CK(cudaMalloc(&k, kv_elems * 2));
  CK(cudaMalloc(&v, kv_elems * 2));
  CK(cudaMalloc(&q, size_t(batch) * Hq * D * 2));
  CK(cudaMalloc(&out, size_t(batch) * Hq * D * 2));
  std::vector<uint16_t> h(kv_elems);
  std::mt19937 rng(1);
  for (auto& x : h) x = 0x3c00 + (rng() & 0xff);  // small bf16 values
  CK(cudaMemcpy(k, h.data(), kv_elems * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(v, h.data(), kv_elems * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(q, h.data(), size_t(batch) * Hq * D * 2, cudaMemcpyHostToDevice));
  std::vector<int> hp(batch, context - 1), hs(batch), ht(num_pages);
  for (int b = 0; b < batch; ++b) hs[b] = b;
  for (int i = 0; i < num_pages; ++i) ht[i] = (i * 7919) % num_pages;
  CK(cudaMalloc(&pos, batch * 4));
  CK(cudaMalloc(&seq, batch * 4));
  CK(cudaMalloc(&table, num_pages * 4));
  CK(cudaMemcpy(pos, hp.data(), batch * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(seq, hs.data(), batch * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(table, ht.data(), num_pages * 4, cudaMemcpyHostToDevice));
  PagedAttentionParams p{q, k, v, pos, seq, table, out, batch, Hq, Hkv, D, page, pps, 0.088f};
  p.decode_splits = splits;
  p.num_pages = num_pages;  // the tensor-copy kernel, as the model runs it
  float* ws;
  size_t wsb = mma_attention_workspace_bytes(batch, Hq, context - 1);
  CK(cudaMalloc(&ws, wsb));
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  for (int i = 0; i < 50; ++i) CK(mma_paged_attention(p, context - 1, ws, wsb, nullptr));
  // back-to-back loop of 20
  std::vector<float> loop_ms, single_ms;
  for (int rep = 0; rep < 11; ++rep) {
    cudaEventRecord(e0);
    for (int i = 0; i < 20; ++i) mma_paged_attention(p, context - 1, ws, wsb, nullptr);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms;
    cudaEventElapsedTime(&ms, e0, e1);
    loop_ms.push_back(ms / 20);
    cudaEventRecord(e0);
    mma_paged_attention(p, context - 1, ws, wsb, nullptr);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    cudaEventElapsedTime(&ms, e0, e1);
    single_ms.push_back(ms);
  }
  std::sort(loop_ms.begin(), loop_ms.end());
  std::sort(single_ms.begin(), single_ms.end());
  const double bytes = 2.0 * batch * context * Hkv * D * 2;
  printf("splits %d, batch %d x %d: back-to-back %.4f ms (%.0f GB/s), single launch %.4f ms\n", splits, batch,
         context, loop_ms[5], bytes / loop_ms[5] / 1e6, single_ms[5]);
  // traced: a launch right after another (as in the loop)
  std::vector<unsigned long long> tr(size_t{1} << 19);
  for (int pass = 0; pass < 3; ++pass) {
    CK(mma_paged_attention(p, context - 1, ws, wsb, nullptr));
    CK(mma_paged_attention(p, context - 1, ws, wsb, nullptr));
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpyFromSymbol(tr.data(), g_attention_trace, tr.size() * 8));
    const int warps = batch * Hkv * 4 * std::max(splits, 1);
    unsigned long long g0 = ~0ull, gend = 0;
    std::vector<double> entry, first, loopend, exit_, waitd, merge, clock_ghz;
    for (int w = 0; w < warps; ++w) {
      g0 = std::min(g0, tr[w * 8 + 0]);
      gend = std::max(gend, tr[w * 8 + 5]);
    }
    for (int w = 0; w < warps; ++w) {
      const unsigned long long* r = &tr[w * 8];
      double ghz = double(r[4] - r[1]) / double(r[5] - r[0]);  // cycles per ns
      clock_ghz.push_back(ghz);
      auto at = [&](unsigned long long clk) {
        return (double(r[0] - g0) + double(clk - r[1]) / ghz) / 1000.0;
      };  // us
      entry.push_back(double(r[0] - g0) / 1000.0);
      waitd.push_back(at(r[7]));
      first.push_back(at(r[2]));
      loopend.push_back(at(r[3]));
      exit_.push_back(double(r[5] - g0) / 1000.0);
      merge.push_back(at(r[4]) - at(r[3]));
    }
    auto pct = [](std::vector<double> x, const char* name) {
      std::sort(x.begin(), x.end());
      size_t n = x.size();
      printf("  %-22s min %7.2f  p10 %7.2f  p50 %7.2f  p90 %7.2f  max %7.2f us\n", name, x[0], x[n / 10],
             x[n / 2], x[n * 9 / 10], x[n - 1]);
    };
    printf(" pass %d: grid span (first entry -> last exit, globaltimer) %.2f us\n", pass,
           (gend - g0) / 1000.0);
    pct(clock_ghz, "clock GHz");
    pct(entry, "entry");
    pct(waitd, "after griddep wait");
    pct(first, "first chunk ready");
    pct(loopend, "loop end");
    pct(merge, "merge+store (block)");
    pct(exit_, "exit");
    std::vector<double> ramp;
    for (int w = 0; w < warps; ++w) ramp.push_back(first[w] - entry[w]);
    pct(ramp, "entry->first chunk");
    std::vector<double> stream_;
    for (int w = 0; w < warps; ++w) stream_.push_back(loopend[w] - first[w]);
    pct(stream_, "first->loop end");
    if (pass == 0) {  // per SM: blocks, mean loop end of its warps
      std::vector<int> blocks(200, 0);
      std::vector<double> sum(200, 0), mx(200, 0);
      std::vector<int> nw(200, 0);
      for (int w = 0; w < warps; ++w) {
        int sm = int(tr[w * 8 + 6]);
        if (w % 4 == 0) blocks[sm]++;
        sum[sm] += loopend[w];
        nw[sm]++;
        mx[sm] = std::max(mx[sm], loopend[w]);
      }
      printf("  per SM (sm:blocks:mean loop end:max):");
      for (int sm = 0; sm < 200; ++sm)
        if (nw[sm]) printf(" %d:%d:%.1f:%.1f", sm, blocks[sm], sum[sm] / nw[sm], mx[sm]);
      printf("\n");
      // intra-block spread of loop end
      std::vector<double> spread;
      for (int b = 0; b < warps / 4; ++b) {
        double lo = 1e9, hi = 0;
        for (int w = 0; w < 4; ++w) {
          lo = std::min(lo, loopend[b * 4 + w]);
          hi = std::max(hi, loopend[b * 4 + w]);
        }
        spread.push_back(hi - lo);
      }
      pct(spread, "block warp spread");
    }
  }
  return 0;
}
