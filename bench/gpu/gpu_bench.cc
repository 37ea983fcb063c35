// GPU benchmarks at Qwen3-235B-A22B shapes: each kernel is validated by its
// GPU test (tests/gpu) and timed here with CUDA events (warm-up, median of
// repeats), next to its floor: bytes / the copy bandwidth measured in the same
// run, or FLOPs / the bf16 tensor-core rate. Prints a table; writes JSON
// lines to --json. Peers (PyTorch) run from peer_bench.py in the same call.
//
// Inputs are random (never zeros); weights and KV are far larger than the
// 60 MB L2, so no rotation is needed for them.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "bench/gpu/bench_util.h"
#include "bench/gpu/l2_bench.h"
#include "bench/gpu/model_bench.h"
#include "core/cuda/device_buffer.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/kernels.h"

namespace moe {
namespace {

namespace k = ops::cuda;
using bf16 = __nv_bfloat16;
using namespace bench;  // NOLINT: the helpers are this file's vocabulary

// MoE experts of one layer at decode sizes: permute, gate/up grouped GEMM with
// SiLU-multiply, down grouped GEMM, weighted un-permute. Floor: every expert's
// weights read once.
void bench_grouped_gemm(double copy_gbs) {
  const int E = 128, H = 4096, I = 1536, topk = 8;
  DeviceTensor w13 = random_bf16({E, 2 * I, H}, 11, 0.02f), w2 = random_bf16({E, H, I}, 12, 0.02f);
  const double weight_bytes = 2.0 * E * 3.0 * H * I;
  for (int per_expert : {1, 2, 4, 8, 16, 32, 64}) {
    const int T = per_expert * E / topk;
    std::vector<int32_t> ids(static_cast<size_t>(T) * topk);
    for (int i = 0; i < T * topk; ++i) ids[i] = i % E;  // every expert gets per_expert tokens
    DeviceTensor d_ids = device_ints(ids), x = random_bf16({T, H}, 13);
    DeviceTensor weights = alloc(DType::kF32, {T, topk}), offsets = alloc(DType::kI32, {E + 1}), tiles = alloc(DType::kI32, {E + 1});
    DeviceTensor sorted = alloc(DType::kI32, {T * topk}), row_of = alloc(DType::kI32, {T * topk});
    DeviceTensor act = alloc(DType::kBF16, {T * topk, I}), rows = alloc(DType::kF32, {T * topk, H}), out = alloc(DType::kF32, {T, H});
    check(cudaMemset(weights.data(), 0, weights.num_bytes()), "memset");
    const int max_tiles = (T * topk + k::kGroupedGemmTileRows - 1) / k::kGroupedGemmTileRows + E;
    using Gemm = cudaError_t (*)(const k::GroupedGemmParams&, cudaStream_t);
    // gate/up + SiLU, then down: the two grouped GEMMs (what torch._grouped_mm
    // does), down writing bf16 rows as the model's does (f32: for comparison).
    auto gemms = [&](Gemm gemm, cudaStream_t stream, bool bf16_rows = true) {
      gemm({x.data_as<bf16>(), sorted.data_as<int32_t>(), w13.data_as<bf16>(), offsets.data_as<int32_t>(),
            tiles.data_as<int32_t>(), act.data(), I, H, E, max_tiles, true},
           stream);
      gemm({act.data_as<bf16>(), nullptr, w2.data_as<bf16>(), offsets.data_as<int32_t>(),
            tiles.data_as<int32_t>(), rows.data(), H, I, E, max_tiles, false, 0, bf16_rows},
           stream);
    };
    auto layer = [&](Gemm gemm, cudaStream_t stream) {
      k::moe_permute(
          {d_ids.data_as<int32_t>(), offsets.data_as<int32_t>(), tiles.data_as<int32_t>(),
           sorted.data_as<int32_t>(), row_of.data_as<int32_t>(), T, topk, E, k::kGroupedGemmTileRows},
          stream);
      gemms(gemm, stream);
      k::moe_unpermute({rows.data(), row_of.data_as<int32_t>(), weights.data_as<float>(),
                        out.data_as<float>(), T, topk, H, true},
                       stream);
    };
    const double mma_ms = time_ms([&] { layer(k::mma_grouped_gemm, nullptr); });
    check(cudaGetLastError(), "grouped gemm (WMMA)");
    const bool hopper = k::hopper_kernels_available();
    const Gemm best = hopper ? k::wgmma_grouped_gemm : k::mma_grouped_gemm;
    const double ms = hopper ? time_ms([&] { layer(best, nullptr); }) : mma_ms;
    const double graph_ms = time_graph_ms([&](cudaStream_t stream) { layer(best, stream); }, 4);
    const double gemms_ms = time_graph_ms([&](cudaStream_t stream) { gemms(best, stream); }, 4);
    const double f32_ms = time_graph_ms([&](cudaStream_t stream) { gemms(best, stream, false); }, 4);
    check(cudaGetLastError(), "grouped gemm (wgmma)");
    const double floor_ms = weight_bytes / (copy_gbs * 1e6);
    char shape[96], extra[224];
    std::snprintf(shape, sizeof shape, "E%d H4096 I1536, %d tok/expert", E, per_expert);
    std::snprintf(extra, sizeof extra,
                  "%.0f GB/s of weights, %s (graph: layer %.3f ms, %.1f%%; GEMMs alone %.3f ms, %.1f%%, "
                  "f32 rows %.3f ms; WMMA kernel: %.3f ms)",
                  weight_bytes / (ms * 1e6), hopper ? "wgmma" : "WMMA", graph_ms, 100.0 * floor_ms / graph_ms,
                  gemms_ms, 100.0 * floor_ms / gemms_ms, f32_ms, mma_ms);
    report("moe_experts_decode", shape, ms, floor_ms, extra);
  }
}

// The same MoE layer with FP8 experts (sm_90): block-scaled (activations
// quantized per 1 x 128 on the GPU, E4M3 weights with 128 x 128 scales), then
// MXFP8 (E8M0 scales per 1 x 32 on both). Floor: the FP8 weight bytes (plus
// their scales) read once.
// only_per_expert (0: all): one tokens-per-expert count, e.g. for a profiler.
void bench_fp8_grouped_gemm(double copy_gbs, int only_per_expert) {
  if (!k::hopper_kernels_available()) return;
  const int E = 128, H = 4096, I = 1536, topk = 8;
  DeviceTensor w13 = fp8_weights(int64_t{E} * 2 * I, H, 14), w2 = fp8_weights(int64_t{E} * H, I, 15);
  DeviceTensor s13 = block_scales(E, 2 * I / 128, H / 128), s2 = block_scales(E, H / 128, I / 128);
  // MXFP8: the same E4M3 weights with E8M0 scales per 1 x 32 (codes near 2^-7).
  auto mx_scales = [&](int64_t rows, int64_t cols, uint8_t first) {
    std::vector<uint8_t> host(static_cast<size_t>(rows * cols / 32));
    for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<uint8_t>(first + i % 5);
    auto t = DeviceTensor::upload(TensorView(host.data(), DType::kE8M0, {rows, cols / 32}));
    check(t.status());
    return std::move(t).value();
  };
  DeviceTensor mx13 = mx_scales(int64_t{E} * 2 * I, H, 118), mx2 = mx_scales(int64_t{E} * H, I, 119);
  for (const bool mx : {false, true}) {
    const double weight_bytes =
        1.0 * E * 3.0 * H * I + (mx ? mx13.num_bytes() + mx2.num_bytes() : s13.num_bytes() + s2.num_bytes());
    const int group = mx ? 32 : 128;
    for (int per_expert : {1, 8, 64}) {
      if (only_per_expert != 0 && per_expert != only_per_expert) continue;
      const int T = per_expert * E / topk, pairs = T * topk;
      std::vector<int32_t> ids(static_cast<size_t>(pairs));
      for (int i = 0; i < pairs; ++i) ids[i] = i % E;
      DeviceTensor d_ids = device_ints(ids), x = random_bf16({T, H}, 16);
      DeviceTensor weights = alloc(DType::kF32, {T, topk}), offsets = alloc(DType::kI32, {E + 1}), tiles = alloc(DType::kI32, {E + 1});
      DeviceTensor sorted = alloc(DType::kI32, {pairs}), row_of = alloc(DType::kI32, {pairs});
      DeviceTensor x_q = alloc(DType::kF8E4M3, {T, H}), x_s = alloc(DType::kF32, {T, H / group});
      DeviceTensor act = alloc(DType::kBF16, {pairs, I}), act_q = alloc(DType::kF8E4M3, {pairs, I});
      DeviceTensor act_s = alloc(DType::kF32, {pairs, I / group});
      DeviceTensor rows = alloc(DType::kF32, {pairs, H}), out = alloc(DType::kF32, {T, H});
      check(cudaMemset(weights.data(), 0, weights.num_bytes()), "memset");
      const int max_tiles = (pairs + k::kGroupedGemmTileRows - 1) / k::kGroupedGemmTileRows + E;
      // One expert GEMM over activations already quantized into (in_q, in_s) ...
      // (down: bf16 rows, as the model's, unless bf16_rows is false).
      auto gemm = [&](const DeviceTensor& in_q, const DeviceTensor& in_s, const int32_t* gather,
                      const DeviceTensor& w, const DeviceTensor& block, const DeviceTensor& mx_s, void* dst,
                      int N, int K, bool gate_up, cudaStream_t stream, bool bf16_rows = true) {
        if (mx) {
          k::mxfp8_grouped_gemm(
              {in_q.data_as<uint8_t>(), in_s.data_as<uint8_t>(), gather, w.data_as<uint8_t>(),
               mx_s.data_as<uint8_t>(), offsets.data_as<int32_t>(), tiles.data_as<int32_t>(), dst, N, K, E,
               max_tiles, gate_up, 1, !gate_up && bf16_rows},
              stream);
        } else {
          k::Fp8GroupedGemmParams p{in_q.data_as<uint8_t>(), in_s.data_as<float>(), gather, w.data_as<uint8_t>(),
                                    block.data_as<float>(), offsets.data_as<int32_t>(), tiles.data_as<int32_t>(),
                                    dst, N, K, E, max_tiles, gate_up, 1, static_cast<int>(in_q.shape()[0]),
                                    !gate_up && bf16_rows};
          p.early_weights = !gate_up;  // right after gate_up, as the model's
          k::fp8_grouped_gemm(p, stream);
        }
      };
      // ... and the quantizer that fills them.
      auto quantize = [&](const DeviceTensor& in, DeviceTensor& in_q, DeviceTensor& in_s, int rows_in, int K,
                          cudaStream_t stream) {
        if (mx) {
          k::quantize_mxfp8(
              {in.data_as<bf16>(), in_q.data_as<uint8_t>(), in_s.data_as<uint8_t>(), rows_in, K}, stream);
        } else {
          k::quantize_fp8_groups(
              {in.data_as<bf16>(), in_q.data_as<uint8_t>(), in_s.data_as<float>(), rows_in, K}, stream);
        }
      };
      // gate_up: fp8-block's quantizes its own rows into act_q / act_s (as the model's).
      auto gate_up = [&](cudaStream_t stream) {
        if (mx) {
          gemm(x_q, x_s, sorted.data_as<int32_t>(), w13, s13, mx13, act.data(), I, H, true, stream);
          return;
        }
        k::Fp8GroupedGemmParams p{x_q.data_as<uint8_t>(), x_s.data_as<float>(), sorted.data_as<int32_t>(),
                                  w13.data_as<uint8_t>(), s13.data_as<float>(), offsets.data_as<int32_t>(),
                                  tiles.data_as<int32_t>(), act_q.data(), I, H, E, max_tiles, true, 1, T};
        p.out_scales = act_s.data_as<float>();
        k::fp8_grouped_gemm(p, stream);
      };
      auto down = [&](cudaStream_t stream, bool bf16_rows = true) {
        gemm(act_q, act_s, nullptr, w2, s2, mx2, rows.data(), H, I, false, stream, bf16_rows);
      };
      auto layer = [&](cudaStream_t stream) {
        k::moe_permute(
            {d_ids.data_as<int32_t>(), offsets.data_as<int32_t>(), tiles.data_as<int32_t>(),
             sorted.data_as<int32_t>(), row_of.data_as<int32_t>(), T, topk, E, k::kGroupedGemmTileRows},
            stream);
        quantize(x, x_q, x_s, T, H, stream);
        gate_up(stream);
        if (mx) quantize(act, act_q, act_s, pairs, I, stream);
        down(stream);
        k::moe_unpermute({rows.data(), row_of.data_as<int32_t>(), weights.data_as<float>(),
                          out.data_as<float>(), T, topk, H, true},
                         stream);
      };
      const double ms = time_ms([&] { layer(nullptr); });
      const double graph_ms = time_graph_ms(layer, 4);
      // The two grouped GEMMs alone (activations already quantized), in a graph.
      const double gemms_ms = time_graph_ms(
          [&](cudaStream_t stream) {
            gate_up(stream);
            down(stream);
          },
          4);
      const double f32_ms = time_graph_ms(
          [&](cudaStream_t stream) {
            gate_up(stream);
            down(stream, false);
          },
          4);
      check(cudaGetLastError(), mx ? "mxfp8 grouped gemm" : "fp8 grouped gemm");
      const double floor_ms = weight_bytes / (copy_gbs * 1e6);
      char shape[96], extra[192];
      std::snprintf(shape, sizeof shape, "E%d H4096 I1536, %d tok/expert", E, per_expert);
      std::snprintf(
          extra, sizeof extra,
          "%.0f GB/s of FP8 weights + scales (graph: layer %.3f ms, %.1f%%; GEMMs alone %.3f ms, %.1f%%, f32 "
          "rows %.3f ms)",
          weight_bytes / (ms * 1e6), graph_ms, 100.0 * floor_ms / graph_ms, gemms_ms,
          100.0 * floor_ms / gemms_ms, f32_ms);
      report(mx ? "moe_experts_decode_mxfp8" : "moe_experts_decode_fp8", shape, ms, weight_bytes / (copy_gbs * 1e6), extra);
      if (!mx && per_expert == 64) {  // issue 8's 90% of the copy bandwidth, both timed alike
        CopyProbe copy(size_t{1} << 30);
        const auto m =
            interleaved("FP8 expert GEMMs at 64 tok/expert against a 1 GB copy", {{"gate_up + down",
                                                                                   [&] {
                                                                                     gate_up(nullptr);
                                                                                     down(nullptr);
                                                                                   }},
                                                                                  {"copy", [&] { copy(); }}});
        std::printf("  -> %.0f GB/s of weights against a copy at %.0f GB/s: %.1f%%\n",
                    weight_bytes / (m[0] * 1e6), copy.gbs(m[1]),
                    100.0 * weight_bytes / (m[0] * 1e6) / copy.gbs(m[1]));
      }
    }
  }
}

// The MoE expert GEMMs at prefill size: 6000 tokens x top-8 over 128 experts,
// 375 rows each (gate/up then down; the permutation is made once, outside the
// timing). Compute-bound: floor = FLOPs at 790 TFLOP/s (bf16 dense, measured
// on H200 here) or 1580 (FP8, twice that). Both row tilings run: the decode
// kernels' 64 rows and the prefill kernels' 128. Down writes bf16 rows, as
// the model's does.

void bench_prefill_grouped_gemm() {
  if (!k::hopper_kernels_available()) return;
  // MOE_BENCH_PREFILL_ROWS: rows per expert other than 375 (a multiple of 8);
  // MOE_BENCH_PREFILL_EXPERTS: experts other than 128 (1: a dense GEMM).
  const char* rows_env = std::getenv("MOE_BENCH_PREFILL_ROWS");
  const char* experts_env = std::getenv("MOE_BENCH_PREFILL_EXPERTS");
  const int E = experts_env != nullptr ? std::atoi(experts_env) : 128, H = 4096, I = 1536, topk = 8,
            per_expert = rows_env != nullptr ? std::atoi(rows_env) : 375;
  const int T = per_expert * E / topk, pairs = T * topk;
  const double flops = 2.0 * pairs * 3.0 * H * I;
  // The L2 traffic of the 128-row kernels: every item reads its A rows and weight rows over K.
  const double l2_gbs = l2_read_bandwidth_gbs();
  std::printf("L2 read bandwidth: %.0f GB/s\n", l2_gbs);
  if (json_out) std::fprintf(json_out, "{\"bench\":\"l2_read\",\"gbs\":%.1f}\n", l2_gbs);
  // MOE_BENCH_PREFILL_ROUTING=random: each token's top-k experts drawn at
  // random (distinct, seeded), so the counts spread as a model's do and the
  // experts' last row tiles are partly filled; otherwise every expert gets
  // exactly per_expert rows.
  const char* routing_env = std::getenv("MOE_BENCH_PREFILL_ROUTING");
  const bool random_routing = routing_env != nullptr && std::string_view(routing_env) == "random";
  std::vector<int32_t> ids(static_cast<size_t>(pairs));
  if (random_routing) {
    std::mt19937 rng(41);
    std::vector<int32_t> experts(static_cast<size_t>(E));
    std::iota(experts.begin(), experts.end(), 0);
    for (int t = 0; t < T; ++t) {
      for (int j = 0; j < topk; ++j) {  // a partial Fisher-Yates shuffle: the token's first topk
        std::swap(experts[j], experts[j + std::uniform_int_distribution<int>(0, E - 1 - j)(rng)]);
        ids[static_cast<size_t>(t) * topk + j] = experts[j];
      }
    }
  } else {
    for (int i = 0; i < pairs; ++i) ids[i] = i % E;
  }
  DeviceTensor d_ids = device_ints(ids), x = random_bf16({T, H}, 31);
  DeviceTensor offsets = alloc(DType::kI32, {E + 1}), tiles = alloc(DType::kI32, {E + 1});
  DeviceTensor sorted = alloc(DType::kI32, {pairs}), row_of = alloc(DType::kI32, {pairs});
  DeviceTensor act = random_bf16({pairs, I}, 32), rows = alloc(DType::kF32, {pairs, H});
  auto permute = [&](int tile_rows) {
    check(k::moe_permute({d_ids.data_as<int32_t>(), offsets.data_as<int32_t>(), tiles.data_as<int32_t>(),
                          sorted.data_as<int32_t>(), row_of.data_as<int32_t>(), T, topk, E, tile_rows}, nullptr),
          "permute");
    return (pairs + tile_rows - 1) / tile_rows + E;
  };
  char shape[96];
  std::snprintf(shape, sizeof shape, "E%d H4096 I1536, %d tok/expert%s", E, per_expert,
                random_routing ? " on average (random routing)" : "");
  auto describe = [&](double ms, double f32_ms, double gather_ms, double decode_ms) {
    char extra[224];
    std::snprintf(extra, sizeof extra,
                  "%.1f TFLOP/s, 128-row tiles (f32 rows: %.3f ms; gather of gate_up's rows first: %.3f ms; "
                  "64-row decode "
                  "kernel: %.3f ms, %.1f TFLOP/s)",
                  flops / (ms * 1e9), f32_ms, gather_ms, decode_ms, flops / (decode_ms * 1e9));
    return std::string(extra);
  };
  {
    DeviceTensor w13 = random_bf16({E, 2 * I, H}, 33, 0.02f), w2 = random_bf16({E, H, I}, 34, 0.02f);
    // The prefill kernel reads gate_up's rows permuted: gathered once here, timed on its own.
    DeviceTensor x_rows = alloc(DType::kBF16, {pairs, H});
    double gather_ms = 0.0;
    using Gemm = cudaError_t (*)(const k::GroupedGemmParams&, cudaStream_t);
    // The two GEMMs over rows permuted for tile_rows (permute() first).
    auto run_gemms = [&](Gemm gemm, int tile_rows, bool bf16_rows) {
      const int max_tiles = (pairs + tile_rows - 1) / tile_rows + E;
      const bool gathered = tile_rows == k::kPrefillGemmTileRows;
      gemm({gathered ? x_rows.data_as<bf16>() : x.data_as<bf16>(),
            gathered ? nullptr : sorted.data_as<int32_t>(), w13.data_as<bf16>(), offsets.data_as<int32_t>(),
            tiles.data_as<int32_t>(), act.data(), I, H, E, max_tiles, true, pairs},
           nullptr);
      gemm({act.data_as<bf16>(), nullptr, w2.data_as<bf16>(), offsets.data_as<int32_t>(),
            tiles.data_as<int32_t>(), rows.data(), H, I, E, max_tiles, false, pairs, bf16_rows},
           nullptr);
    };
    auto time_gemms = [&](Gemm gemm, int tile_rows, bool bf16_rows = true) {
      permute(tile_rows);
      const k::GatherRowsParams gather{x.data(), x_rows.data(), sorted.data_as<int32_t>(), pairs,
                                       int64_t{H} * 2};
      if (tile_rows == k::kPrefillGemmTileRows) gather_ms = time_ms([&] { k::gather_rows(gather, nullptr); });
      const double ms = time_ms([&] { run_gemms(gemm, tile_rows, bf16_rows); });
      check(cudaGetLastError(), "grouped gemm");
      return ms;
    };
    const double decode_ms = time_gemms(k::wgmma_grouped_gemm, k::kGroupedGemmTileRows);
    const double ms = time_gemms(k::wgmma_grouped_gemm_prefill, k::kPrefillGemmTileRows);
    const double f32_ms = time_gemms(k::wgmma_grouped_gemm_prefill, k::kPrefillGemmTileRows, false);
    report("moe_gemms_prefill", shape, ms, flops / 790e9, describe(ms, f32_ms, gather_ms, decode_ms));

    // Peer (issue 8's): cuBLASLt's dense bf16 GEMM on the same FLOPs, expert
    // 0's weights standing for all: [pairs, H] x [2I, H]^T, then [pairs, I] x
    // [H, I]^T, both to bf16.
    auto dense = k::Gemm::create();
    check(dense.status());
    DeviceTensor gate_up_out = alloc(DType::kBF16, {pairs, 2 * I});
    auto peer = [&] {
      check(dense->matmul(x_rows.data_as<bf16>(), w13.data_as<bf16>(), gate_up_out.data(), DType::kBF16,
                          pairs, 2 * I, H, nullptr));
      check(dense->matmul(act.data_as<bf16>(), w2.data_as<bf16>(), rows.data(), DType::kBF16, pairs, H, I,
                          nullptr));
    };
    const double peer_ms = time_ms(peer);
    char extra[128];
    std::snprintf(extra, sizeof extra, "%.1f TFLOP/s; ours / cuBLASLt = %.2fx", flops / (peer_ms * 1e9),
                  peer_ms / ms);
    report("cublaslt_bf16", shape, peer_ms, flops / 790e9, extra);
    permute(k::kPrefillGemmTileRows);
    auto ours = [&](const char* unroll) {
      return [&, unroll] {
        setenv("MOE_PREFILL_GEMM_UNROLL", unroll, 1);
        run_gemms(k::wgmma_grouped_gemm_prefill, k::kPrefillGemmTileRows, true);
      };
    };
    interleaved(
        "bf16 prefill GEMMs",
        {{"ours", ours("1")}, {"ours, K loop not unrolled", ours("0")}, {"cuBLASLt dense bf16", peer}});
    unsetenv("MOE_PREFILL_GEMM_UNROLL");
  }
  {
    DeviceTensor w13 = fp8_weights(int64_t{E} * 2 * I, H, 35), w2 = fp8_weights(int64_t{E} * H, I, 36);
    DeviceTensor s13 = block_scales(E, 2 * I / 128, H / 128), s2 = block_scales(E, H / 128, I / 128);
    DeviceTensor x_q = alloc(DType::kF8E4M3, {T, H}), x_s = alloc(DType::kF32, {T, H / 128});
    DeviceTensor act_q = alloc(DType::kF8E4M3, {pairs, I}), act_s = alloc(DType::kF32, {pairs, I / 128});
    check(k::quantize_fp8_groups({x.data_as<bf16>(), x_q.data_as<uint8_t>(), x_s.data_as<float>(), T, H}, nullptr), "q");
    check(k::quantize_fp8_groups({act.data_as<bf16>(), act_q.data_as<uint8_t>(), act_s.data_as<float>(), pairs, I},
                                 nullptr), "q");
    DeviceTensor xg_q = alloc(DType::kF8E4M3, {pairs, H});
    double gather_ms = 0.0;
    using Gemm = cudaError_t (*)(const k::Fp8GroupedGemmParams&, cudaStream_t);
    auto run_gemms = [&](Gemm gemm, int tile_rows, bool bf16_rows) {  // permute() first
      const int max_tiles = (pairs + tile_rows - 1) / tile_rows + E;
      const bool gathered = tile_rows == k::kPrefillGemmTileRows;
      // The prefill kernel: gate_up's rows gathered, their scales read by token (as the model runs it).
      k::Fp8GroupedGemmParams gate_up{gathered ? xg_q.data_as<uint8_t>() : x_q.data_as<uint8_t>(),
                                      x_s.data_as<float>(), gathered ? nullptr : sorted.data_as<int32_t>(),
                                      w13.data_as<uint8_t>(), s13.data_as<float>(), offsets.data_as<int32_t>(),
                                      tiles.data_as<int32_t>(), act.data(), I, H, E, max_tiles, true, 1, pairs};
      gate_up.a_scale_rows = gathered ? sorted.data_as<int32_t>() : nullptr;
      gemm(gate_up, nullptr);
      gemm({act_q.data_as<uint8_t>(), act_s.data_as<float>(), nullptr, w2.data_as<uint8_t>(),
            s2.data_as<float>(), offsets.data_as<int32_t>(), tiles.data_as<int32_t>(), rows.data(), H, I, E,
            max_tiles, false, 1, pairs, bf16_rows},
           nullptr);
    };
    auto time_gemms = [&](Gemm gemm, int tile_rows, bool bf16_rows = true) {
      permute(tile_rows);
      if (tile_rows == k::kPrefillGemmTileRows) {
        gather_ms = time_ms(
            [&] { k::gather_rows({x_q.data(), xg_q.data(), sorted.data_as<int32_t>(), pairs, H}, nullptr); });
      }
      const double ms = time_ms([&] { run_gemms(gemm, tile_rows, bf16_rows); });
      check(cudaGetLastError(), "fp8 grouped gemm");
      return ms;
    };
    const double decode_ms = time_gemms(k::fp8_grouped_gemm, k::kGroupedGemmTileRows);
    const double ms = time_gemms(k::fp8_grouped_gemm_prefill, k::kPrefillGemmTileRows);
    const double f32_ms = time_gemms(k::fp8_grouped_gemm_prefill, k::kPrefillGemmTileRows, false);
    report("moe_gemms_prefill_fp8", shape, ms, flops / 1580e9, describe(ms, f32_ms, gather_ms, decode_ms));

    // Peer: cuBLASLt's block-scaled FP8 GEMM (the same 1 x 128 activation and
    // 128 x 128 weight scales) on the same FLOPs as two dense GEMMs, expert
    // 0's weights standing for all: [pairs, H] x [2I, H]^T to bf16, then
    // [pairs, I] x [H, I]^T to bf16.
    auto gemm = k::Gemm::create();
    check(gemm.status());
    if (gemm->has_fp8_block(pairs, 2 * I, H, DType::kBF16) &&
        gemm->has_fp8_block(pairs, H, I, DType::kBF16)) {
      DeviceTensor x_wide = random_bf16({pairs, H}, 37), xw_q = alloc(DType::kF8E4M3, {pairs, H});
      DeviceTensor xw_s = alloc(DType::kF32, {H / 128, pairs}),
                   act_s_by_group = alloc(DType::kF32, {I / 128, pairs});
      DeviceTensor gate_up_out = alloc(DType::kBF16, {pairs, 2 * I}),
                   down_out = alloc(DType::kBF16, {pairs, H});
      k::QuantizeFp8Params qx{x_wide.data_as<bf16>(), xw_q.data_as<uint8_t>(), xw_s.data_as<float>(), pairs,
                              H};
      qx.scales_by_group = true;
      k::QuantizeFp8Params qa{act.data_as<bf16>(), act_q.data_as<uint8_t>(), act_s_by_group.data_as<float>(),
                              pairs, I};
      qa.scales_by_group = true;
      check(k::quantize_fp8_groups(qx, nullptr), "q");
      check(k::quantize_fp8_groups(qa, nullptr), "q");
      auto peer = [&] {
        check(gemm->matmul_fp8_block(xw_q.data_as<uint8_t>(), xw_s.data_as<float>(), w13.data_as<uint8_t>(),
                                     s13.data_as<float>(), gate_up_out.data(), DType::kBF16, pairs, 2 * I, H,
                                     nullptr));
        check(gemm->matmul_fp8_block(act_q.data_as<uint8_t>(), act_s_by_group.data_as<float>(),
                                     w2.data_as<uint8_t>(), s2.data_as<float>(), down_out.data(),
                                     DType::kBF16, pairs, H, I, nullptr));
      };
      const double peer_ms = time_ms(peer);
      char extra[128];
      std::snprintf(extra, sizeof extra, "%.1f TFLOP/s; ours / cuBLASLt = %.2fx", flops / (peer_ms * 1e9),
                    peer_ms / ms);
      report("cublaslt_fp8_block", shape, peer_ms, flops / 1580e9, extra);
      permute(k::kPrefillGemmTileRows);
      auto ours = [&](const char* unroll, const char* staged) {
        return [&, unroll, staged] {
          setenv("MOE_PREFILL_GEMM_UNROLL", unroll, 1);
          setenv("MOE_PREFILL_STAGED_OUT", staged, 1);
          run_gemms(k::fp8_grouped_gemm_prefill, k::kPrefillGemmTileRows, true);
        };
      };
      interleaved("FP8 prefill GEMMs", {{"ours", ours("1", "1")},
                                        {"ours, K loop not unrolled", ours("0", "1")},
                                        {"ours, down's rows stored from registers", ours("1", "0")},
                                        {"cuBLASLt block-scaled FP8", peer}});
      unsetenv("MOE_PREFILL_GEMM_UNROLL");
      unsetenv("MOE_PREFILL_STAGED_OUT");
    }
  }
}

// Decode attention: one new token per sequence over `context` cached tokens.
// only_batch / only_context (0: all) pick one shape, e.g. for a profiler.
void bench_decode_attention(double copy_gbs, int only_batch, int only_context) {
  // MOE_BENCH_ATTENTION_PAGE: the KV page size in tokens (default 16, as `--page-size`).
  const char* page_env = std::getenv("MOE_BENCH_ATTENTION_PAGE");
  const int Hq = 64, Hkv = 4, D = 128, page = page_env != nullptr ? std::atoi(page_env) : 16;
  if (page < 1 || 1024 % page != 0) {
    std::fprintf(stderr, "MOE_BENCH_ATTENTION_PAGE must divide 1024\n");
    return;
  }
  std::printf("decode attention: pages of %d tokens\n", page);
  for (auto [batch, context] :
       {std::pair{64, 1024}, std::pair{128, 1024}, std::pair{256, 1024}, std::pair{64, 8192},
        std::pair{256, 2048}, std::pair{256, 8192}, std::pair{64, 32768}, std::pair{64, 64}}) {
    if (context == 64 && only_batch != 64) continue;  // the fixed cost (64 positions), on request only
    if ((only_batch != 0 && batch != only_batch) || (only_context != 0 && context != only_context)) continue;
    const int pages_per_seq = context / page, num_pages = batch * pages_per_seq;
    DeviceTensor kp = random_bf16({num_pages, Hkv, page, D}, 21), vp = random_bf16({num_pages, Hkv, page, D}, 22);
    DeviceTensor q = random_bf16({batch, Hq, D}, 23);
    std::vector<int32_t> positions(batch, context - 1), seq(batch), table(static_cast<size_t>(num_pages));
    for (int b = 0; b < batch; ++b) seq[b] = b;
    for (int i = 0; i < num_pages; ++i) table[i] = (i * 7919) % num_pages;  // scattered pages
    DeviceTensor d_pos = device_ints(positions), d_seq = device_ints(seq), d_table = device_ints(table);
    auto out = DeviceTensor::allocate(DType::kBF16, {batch, Hq * D});
    check(out.status());
    k::PagedAttentionParams params{q.data_as<bf16>(), kp.data_as<bf16>(), vp.data_as<bf16>(), d_pos.data_as<int32_t>(),
                                   d_seq.data_as<int32_t>(), d_table.data_as<int32_t>(), out->data_as<bf16>(), batch,
                                   Hq, Hkv, D, page, pages_per_seq, 1.0f / std::sqrt(float(D))};
    params.num_pages = num_pages;  // as the model passes it
    const size_t ws_bytes = k::mma_attention_workspace_bytes(batch, Hq, context - 1);
    auto ws = DeviceBuffer::allocate(ws_bytes);
    check(ws.status());
    // The default (stages 0) and each pipeline depth, splits chosen by the launcher.
    double stage_ms[5] = {};
    // A warm-up, so the first depth timed does not pay for the clocks ramping up.
    time_ms([&] { k::mma_paged_attention(params, context - 1, ws->data_as<float>(), ws_bytes, nullptr); });
    for (int stages : {0, 2, 3, 4}) {
      k::PagedAttentionParams ps = params;
      ps.decode_stages = stages;
      stage_ms[stages] =
          time_ms([&] { k::mma_paged_attention(ps, context - 1, ws->data_as<float>(), ws_bytes, nullptr); });
    }
    const double ms = stage_ms[0];
    const double graph_ms = time_graph_ms([&](cudaStream_t stream) {
      k::mma_paged_attention(params, context - 1, ws->data_as<float>(), ws_bytes, stream);
    });
    check(cudaGetLastError(), "decode attention");
    if (only_batch != 0) {  // one shape: also sweep the split count (default stages)
      for (int splits = 1; splits <= 8; ++splits) {
        k::PagedAttentionParams ps = params;
        ps.decode_splits = splits;
        std::printf("  splits %d: %.4f ms\n", splits, time_ms([&] {
                      k::mma_paged_attention(ps, context - 1, ws->data_as<float>(), ws_bytes, nullptr);
                    }));
      }
    }
    const double kv_bytes = 2.0 * batch * context * Hkv * D * 2;
    char shape[96], extra[160];
    std::snprintf(shape, sizeof shape, "batch %d, context %d", batch, context);
    std::snprintf(extra, sizeof extra,
                  "%.0f GB/s of KV (in a graph: %.4f ms; 2/3/4 stages: %.4f / %.4f / %.4f ms)",
                  kv_bytes / (ms * 1e6), graph_ms, stage_ms[2], stage_ms[3], stage_ms[4]);
    report("decode_attention", shape, ms, kv_bytes / (copy_gbs * 1e6), extra);
    if (context == 1024 && batch <= 128) {  // issue 6's 80% of the copy bandwidth, both timed alike
      CopyProbe copy(size_t{1} << 30);
      constexpr int kCalls = 25;  // back to back, as time_ms runs them (about a millisecond)
      const auto m = interleaved("decode attention against a 1 GB copy",
                                 {{shape,
                                   [&] {
                                     for (int i = 0; i < kCalls; ++i)
                                       k::mma_paged_attention(params, context - 1, ws->data_as<float>(),
                                                              ws_bytes, nullptr);
                                   }},
                                  {"copy", [&] { copy(); }}});
      std::printf("  -> %.4f ms per call, %.0f GB/s of KV against a copy at %.0f GB/s: %.1f%%\n",
                  m[0] / kCalls, kv_bytes / (m[0] / kCalls * 1e6), copy.gbs(m[1]),
                  100.0 * kv_bytes / (m[0] / kCalls * 1e6) / copy.gbs(m[1]));
    }
  }
}

// Causal prefill attention of one 6k-token prompt. Floor: FLOPs at 780 TFLOP/s (bf16 dense, measured on H200 here).
void bench_prefill_attention() {
  const int Hq = 64, Hkv = 4, D = 128, page = 16, T = 6144, pages = T / page;
  DeviceTensor kp = random_bf16({pages, Hkv, page, D}, 31), vp = random_bf16({pages, Hkv, page, D}, 32);
  DeviceTensor q = random_bf16({T, Hq, D}, 33);
  std::vector<int32_t> positions(T), seq(T, 0), table(pages);
  for (int i = 0; i < T; ++i) positions[i] = i;
  for (int i = 0; i < pages; ++i) table[i] = i;
  DeviceTensor d_pos = device_ints(positions), d_seq = device_ints(seq), d_table = device_ints(table);
  auto out = DeviceTensor::allocate(DType::kBF16, {T, Hq * D});
  check(out.status());
  const k::PagedAttentionParams params{q.data_as<bf16>(), kp.data_as<bf16>(), vp.data_as<bf16>(), d_pos.data_as<int32_t>(),
                                       d_seq.data_as<int32_t>(), d_table.data_as<int32_t>(), out->data_as<bf16>(), T, Hq, Hkv,
                                       D, page, pages, 1.0f / std::sqrt(float(D))};
  const std::vector<int32_t> query_start = {0, T};
  const double flops = 4.0 * Hq * D * (double(T) * (T + 1) / 2);
  const std::vector<int32_t> mma_groups = k::prefill_token_groups(query_start, k::kMmaPrefillGroupTokens);
  DeviceTensor d_mma_groups = device_ints(mma_groups);
  const double mma_ms = time_ms([&] {
    k::mma_prefill_attention(params, d_mma_groups.data_as<int32_t>(), static_cast<int>(mma_groups.size()) - 1, nullptr);
  });
  check(cudaGetLastError(), "mma prefill attention");
  char extra[128];
  if (k::hopper_kernels_available()) {
    const std::vector<int32_t> groups = k::prefill_token_groups(query_start, k::wgmma_prefill_group_tokens(Hq, Hkv));
    DeviceTensor d_groups = device_ints(groups);
    const double ms = time_ms([&] {
      k::wgmma_prefill_attention(params, d_groups.data_as<int32_t>(), static_cast<int>(groups.size()) - 1, nullptr);
    });
    check(cudaGetLastError(), "wgmma prefill attention");
    std::snprintf(extra, sizeof extra, "%.1f TFLOP/s wgmma (mma.sync kernel: %.2f ms, %.1f TFLOP/s)",
                  flops / (ms * 1e9), mma_ms, flops / (mma_ms * 1e9));
    report("prefill_attention", "6144 tokens, 64/4 heads, d128", ms, flops / 780e9, extra);
  } else {
    std::snprintf(extra, sizeof extra, "%.1f TFLOP/s mma.sync (no sm_90 device: wgmma kernel not run)",
                  flops / (mma_ms * 1e9));
    report("prefill_attention", "6144 tokens, 64/4 heads, d128", mma_ms, flops / 780e9, extra);
  }
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) {
  std::string json_path, config_path = "tests/data/configs/qwen3-235b-a22b.config.json";
  int layers = 4;
  int attention_batch = 0, attention_context = 0;  // --attention-shape BATCH,CONTEXT: one decode shape
  int moe_tokens = 0;                              // --moe-tokens N: one FP8 tokens-per-expert count
  int model_batch = 0;                             // --model-batch N: one decode-step batch size
  std::string only;  // sections to run (comma-separated): moe, moe_fp8, moe_prefill, decode_attention,
                     // prefill_attention, model, model_fp8, verify, sampling
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--json" && i + 1 < argc) json_path = argv[++i];
    else if (a == "--config" && i + 1 < argc) config_path = argv[++i];
    else if (a == "--layers" && i + 1 < argc) layers = std::atoi(argv[++i]);
    else if (a == "--only" && i + 1 < argc) only = argv[++i];
    else if (a == "--moe-tokens" && i + 1 < argc)
      moe_tokens = std::atoi(argv[++i]);
    else if (a == "--model-batch" && i + 1 < argc)
      model_batch = std::atoi(argv[++i]);
    else if (a == "--attention-shape" && i + 1 < argc)
      std::sscanf(argv[++i], "%d,%d", &attention_batch, &attention_context);
  }
  if (!json_path.empty()) moe::json_out = std::fopen(json_path.c_str(), "w");
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("device: %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
  const double copy_gbs = moe::copy_bandwidth_gbs();
  // --only a,b,c: those sections.
  auto wanted = [&](const char* name) {
    if (only.empty()) return true;
    for (size_t start = 0; start <= only.size();) {
      const size_t end = std::min(only.find(',', start), only.size());
      if (only.compare(start, end - start, name) == 0) return true;
      start = end + 1;
    }
    return false;
  };
  if (wanted("moe")) moe::bench_grouped_gemm(copy_gbs);
  if (wanted("moe") || wanted("moe_fp8")) moe::bench_fp8_grouped_gemm(copy_gbs, moe_tokens);
  if (wanted("moe") || wanted("moe_prefill")) moe::bench_prefill_grouped_gemm();
  if (wanted("decode_attention")) moe::bench_decode_attention(copy_gbs, attention_batch, attention_context);
  if (wanted("prefill_attention")) moe::bench_prefill_attention();
  if (wanted("model"))
    moe::bench::bench_model(config_path, layers, copy_gbs, moe::ops::QuantFormat::kNone, model_batch);
  if ((wanted("model") || wanted("model_fp8")) && moe::ops::cuda::hopper_kernels_available())
    moe::bench::bench_model(config_path, layers, copy_gbs, moe::ops::QuantFormat::kFp8Block, model_batch);
  if (wanted("verify")) moe::bench::bench_verify(config_path, layers);
  if (wanted("sampling")) moe::bench::bench_sampling(config_path, layers);
  if (moe::json_out) std::fclose(moe::json_out);
  return 0;
}
