// The FP8 (fp8-block) and MXFP8 grouped GEMMs, their activation quantizers
// and the fp8-block dense GEMM through cuBLASLt, against the CPU's quantized
// reference (helpers and tolerances: cuda_op_test_util.h; part of
// ops_cuda_test).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ops/cuda/gemm.h"
#include "ops/cuda/kernels.h"
#include "ops/moe.h"
#include "ops/quant.h"
#include "tests/gpu/cuda_op_test_util.h"

namespace moe::ops {
namespace {

using namespace cuda_test;  // the shared helpers and the CudaOps fixture

// FP8 block scaling: quantized x and act (quantize_fp8_groups), E4M3 experts
// with 128 x 128 weight scales, against the CPU's quantized MoE (which
// quantizes the activations the same way). Qwen3-235B's expert shapes with 8
// experts: quantizing all 128 on the host takes minutes.
TEST_F(CudaOps, Fp8GroupedGemmMatchesTheCpuQuantizedMoe) {
  if (!k::hopper_kernels_available()) GTEST_SKIP() << "the FP8 grouped GEMM needs an sm_90 device";
  struct Case {
    int tokens, hidden, inter, experts, topk;
  };
  // (160 x 4 rows over 8 experts at Qwen3-235B's K: the prefill kernels'
  // unrolled K loops over experts of one and two row tiles, the last partly
  // filled, some with at most 64 rows. 200 x 2 rows over 4 experts with
  // hidden 640 and moe_intermediate 528: partial column tiles in both GEMMs,
  // and K past a multiple of 128 with at least a ring of stages.)
  for (const Case& c : {Case{16, 4096, 1536, 8, 4}, Case{160, 4096, 1536, 8, 4}, Case{300, 256, 128, 16, 4},
                        Case{37, 384, 192, 6, 2}, Case{640, 512, 384, 8, 4}, Case{200, 640, 528, 4, 2}}) {
    Host x = random_bf16({c.tokens, c.hidden}, rng_);
    Host logits = random_bf16({c.tokens, c.experts}, rng_, 3.0f);
    // Quantized expert weights (fp8-block; w13's gate and up halves have their own block rows).
    auto quantized = [&](int64_t rows, int64_t cols, int64_t period, float scale) {
      struct Q {
        Tensor values, scales;
        QuantizedTensor view;
      };
      Q q;
      const Shape per = quant_scale_shape(QuantFormat::kFp8Block, rows, cols, period);
      q.values = Tensor(DType::kF8E4M3, {int64_t{c.experts}, rows, cols});
      q.scales = Tensor(DType::kF32, {int64_t{c.experts}, per[0], per[1]});
      q.view =
          QuantizedTensor{QuantFormat::kFp8Block, q.values.view(), q.scales.view(), TensorView(), period};
      for (int e = 0; e < c.experts; ++e) {
        Host w = random_bf16({rows, cols}, rng_, scale);
        quantize_matrix(w.f32.data_as<float>(), q.view.slice0(e));
      }
      return q;
    };
    auto q13 = quantized(2 * c.inter, c.hidden, c.inter, 1.0f / std::sqrt(static_cast<float>(c.hidden)));
    auto q2 = quantized(c.hidden, c.inter, 0, 1.0f / std::sqrt(static_cast<float>(c.inter)));
    Tensor ids(DType::kI32, {c.tokens, c.topk}), weights(DType::kF32, {c.tokens, c.topk}),
        ref(DType::kF32, {c.tokens, c.hidden});
    cpu::route_topk(pool_, logits.f32, c.topk, true, ids, weights);
    cpu::moe_experts(pool_, x.f32, ids, weights, q13.view, q2.view, ref);

    const int pairs = c.tokens * c.topk;
    DeviceTensor d_x = upload(x.bf16), d_ids = upload(ids), d_weights = upload(weights);
    DeviceTensor d_w13 = upload(q13.values), d_s13 = upload(q13.scales), d_w2 = upload(q2.values),
                 d_s2 = upload(q2.scales);
    const int hidden_groups = (c.hidden + 127) / 128, inter_groups = (c.inter + 127) / 128;
    Output x_q = Output::make(static_cast<size_t>(c.tokens) * c.hidden),
           x_s = Output::make(c.tokens * hidden_groups * 4);
    using Gemm = cudaError_t (*)(const k::Fp8GroupedGemmParams&, cudaStream_t);
    struct Kernel {
      const char* name;
      Gemm gemm;
      int tile_rows;
      const char* cluster;
    };
    for (const auto& [name, gemm, tile_rows, cluster] :
         {Kernel{"fp8", k::fp8_grouped_gemm, k::kGroupedGemmTileRows, nullptr},
          Kernel{"fp8 prefill", k::fp8_grouped_gemm_prefill, k::kPrefillGemmTileRows, "1"},
          Kernel{"fp8 prefill", k::fp8_grouped_gemm_prefill, k::kPrefillGemmTileRows, "2"}}) {
      const ScopedEnv pin("MOE_PREFILL_GEMM_CLUSTER", cluster);
      SCOPED_TRACE(std::string("cluster ") + (cluster != nullptr ? cluster : "default"));
      Output offsets = Output::make((c.experts + 1) * 4), tiles = Output::make((c.experts + 1) * 4);
      Output sorted = Output::make(pairs * 4), row_of = Output::make(pairs * 4);
      Output act = Output::make(static_cast<size_t>(pairs) * c.inter * sizeof(bf16));
      Output act_q = Output::make(static_cast<size_t>(pairs) * c.inter),
             act_s = Output::make(pairs * inter_groups * 4);
      Output rows = Output::make(static_cast<size_t>(pairs) * c.hidden * sizeof(float));
      Output out = Output::make(static_cast<size_t>(c.tokens) * c.hidden * sizeof(float));
      const int max_tiles = (pairs + tile_rows - 1) / tile_rows + c.experts;
      ASSERT_EQ(k::quantize_fp8_groups(
                    {d_x.data_as<bf16>(), x_q.get<uint8_t>(), x_s.get<float>(), c.tokens, c.hidden}, nullptr),
                cudaSuccess);
      ASSERT_EQ(k::moe_permute(
                    {d_ids.data_as<int32_t>(), offsets.get<int32_t>(), tiles.get<int32_t>(),
                     sorted.get<int32_t>(), row_of.get<int32_t>(), c.tokens, c.topk, c.experts, tile_rows},
                    nullptr),
                cudaSuccess);
      // The prefill kernel reads gate_up's rows permuted (gather_rows) and
      // their scales where the quantizer left them (a_scale_rows, as the model runs it).
      const bool gathered = tile_rows == k::kPrefillGemmTileRows;
      Output xg_q = Output::make(static_cast<size_t>(pairs) * c.hidden);
      if (gathered) {
        ASSERT_EQ(k::gather_rows({x_q.get<void>(), xg_q.get<void>(), sorted.get<int32_t>(), pairs, c.hidden},
                                 nullptr),
                  cudaSuccess);
      }
      k::Fp8GroupedGemmParams gate_up{gathered ? xg_q.get<uint8_t>() : x_q.get<uint8_t>(), x_s.get<float>(),
                                      gathered ? nullptr : sorted.get<int32_t>(), d_w13.data_as<uint8_t>(),
                                      d_s13.data_as<float>(), offsets.get<int32_t>(), tiles.get<int32_t>(),
                                      act.get<void>(), c.inter, c.hidden, c.experts, max_tiles, true, 1, pairs};
      gate_up.a_scale_rows = gathered ? sorted.get<int32_t>() : nullptr;
      ASSERT_EQ(gemm(gate_up, nullptr), cudaSuccess);
      ASSERT_EQ(k::quantize_fp8_groups(
                    {act.get<bf16>(), act_q.get<uint8_t>(), act_s.get<float>(), pairs, c.inter}, nullptr),
                cudaSuccess);
      // gate_up quantizing its own rows (out_scales, as the model runs it)
      // gives quantize_fp8_groups' bytes and scales exactly.
      {
        k::Fp8GroupedGemmParams fused = gate_up;
        Output fused_q = Output::make(static_cast<size_t>(pairs) * c.inter),
               fused_s = Output::make(pairs * inter_groups * 4);
        fused.out = fused_q.get<void>(), fused.out_scales = fused_s.get<float>();
        ASSERT_EQ(gemm(fused, nullptr), cudaSuccess);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        auto first_difference = [](const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
          const auto [i, j] = std::mismatch(a.begin(), a.end(), b.begin(), b.end());
          return i == a.end() && j == b.end() ? int64_t{-1} : static_cast<int64_t>(i - a.begin());
        };
        EXPECT_EQ(first_difference(fused_q.download(), act_q.download()), -1) << "E4M3 rows, byte index";
        EXPECT_EQ(first_difference(fused_s.download(), act_s.download()), -1) << "scales, byte index";
      }
      ASSERT_EQ(gemm({act_q.get<uint8_t>(), act_s.get<float>(), nullptr, d_w2.data_as<uint8_t>(),
                      d_s2.data_as<float>(), offsets.get<int32_t>(), tiles.get<int32_t>(), rows.get<void>(),
                      c.hidden, c.inter, c.experts, max_tiles, false, 1, pairs},
                     nullptr),
                cudaSuccess);
      x_q.download();
      act_q.download();
      SCOPED_TRACE(moe_case(name, c.tokens, c.experts, c.hidden, c.inter));
      expect_unpermuted(rows, out, row_of.get<int32_t>(), d_weights.data_as<float>(), c.tokens, c.topk,
                        c.hidden, ref.data_as<float>(), 3e-2, [&](void* bf16_rows) {
                          return gemm(
                              {act_q.get<uint8_t>(), act_s.get<float>(), nullptr, d_w2.data_as<uint8_t>(),
                               d_s2.data_as<float>(), offsets.get<int32_t>(), tiles.get<int32_t>(), bf16_rows,
                               c.hidden, c.inter, c.experts, max_tiles, false, 1, pairs, true},
                              nullptr);
                        });
      if (gathered) {
        // The prefill down GEMM's bf16 rows go out through shared memory;
        // with MOE_PREFILL_STAGED_OUT=0 from registers: the same bytes.
        const size_t row_bytes = static_cast<size_t>(pairs) * c.hidden * sizeof(bf16);
        Output staged = Output::make(row_bytes), from_registers = Output::make(row_bytes);
        k::Fp8GroupedGemmParams down{act_q.get<uint8_t>(), act_s.get<float>(), nullptr, d_w2.data_as<uint8_t>(),
                                     d_s2.data_as<float>(), offsets.get<int32_t>(), tiles.get<int32_t>(),
                                     staged.get<void>(), c.hidden, c.inter, c.experts, max_tiles, false, 1, pairs,
                                     true};
        ASSERT_EQ(gemm(down, nullptr), cudaSuccess);
        down.out = from_registers.get<void>();
        {
          const ScopedEnv from_registers_path("MOE_PREFILL_STAGED_OUT", "0");
          ASSERT_EQ(gemm(down, nullptr), cudaSuccess);
        }
        EXPECT_TRUE(staged.download() == from_registers.download()) << "bf16 rows from registers differ";
        continue;
      }
      // Down launched as gate_up's programmatic dependent (early_weights, as
      // the model runs it) gives the bytes of a plain launch after it: its
      // weight copies start before gate_up ends, its activation rows after.
      // gate_up's output starts poisoned (0x7f: E4M3 NaN) in every round, so
      // rows read too early would show.
      k::Fp8GroupedGemmParams down{act_q.get<uint8_t>(), act_s.get<float>(), nullptr, d_w2.data_as<uint8_t>(),
                                   d_s2.data_as<float>(), offsets.get<int32_t>(), tiles.get<int32_t>(), nullptr,
                                   c.hidden, c.inter, c.experts, max_tiles, false, 1, pairs, true};
      const size_t row_bytes = static_cast<size_t>(pairs) * c.hidden * sizeof(bf16);
      Output plain = Output::make(row_bytes), early = Output::make(row_bytes);
      k::Fp8GroupedGemmParams fused = gate_up;
      fused.out = act_q.get<void>(), fused.out_scales = act_s.get<float>();
      down.out = plain.get<void>();
      ASSERT_EQ(gemm(fused, nullptr), cudaSuccess);
      ASSERT_EQ(gemm(down, nullptr), cudaSuccess);
      const std::vector<uint8_t> expected = plain.download();
      down.out = early.get<void>(), down.early_weights = true;
      for (int round = 0; round < 3; ++round) {
        ASSERT_EQ(cudaMemset(act_q.get<void>(), 0x7f, static_cast<size_t>(pairs) * c.inter), cudaSuccess);
        ASSERT_EQ(cudaMemset(early.get<void>(), 0, row_bytes), cudaSuccess);
        ASSERT_EQ(gemm(fused, nullptr), cudaSuccess);
        ASSERT_EQ(gemm(down, nullptr), cudaSuccess);
        EXPECT_TRUE(early.download() == expected) << "round " << round;
      }
      k::Fp8GroupedGemmParams split = down;
      split.k_splits = 2, split.bf16_out = false;
      EXPECT_EQ(gemm(split, nullptr), cudaErrorInvalidValue) << "early_weights with k_splits";
    }
  }
}

// Host threads launching one grouped GEMM kernel with different expert
// counts (hence shared-memory sizes), as EP ranks that are threads of one
// process do: every launch must start. When each launch set the kernel's
// shared-memory limit to its own size, one thread could lower it between the
// other's set and launch (cudaErrorLaunchOutOfResources, seen twice in
// parallel_cuda_test). The GEMMs here have no rows, so each launch is short
// and the race window comes often.
TEST_F(CudaOps, GroupedGemmsLaunchFromThreadsWithDifferentExpertCounts) {
  if (!k::hopper_kernels_available()) GTEST_SKIP() << "the grouped GEMMs need an sm_90 device";
  constexpr int kLaunches = 1500, N = 256, K = 256;
  const int counts[2] = {1, 128};
  Output w = Output::make(static_cast<size_t>(counts[1]) * 2 * N * K * 2);  // bf16 gate_up, the largest
  Output scales = Output::make(static_cast<size_t>(counts[1]) * 2 * (N / 128) * (K / 128) * 4);
  Output zeros = Output::make((counts[1] + 1) * 4), act = Output::make(64 * K * 2), out = Output::make(64 * N * 4);
  ASSERT_EQ(cudaMemset(zeros.get<void>(), 0, (counts[1] + 1) * 4), cudaSuccess);  // no rows for any expert
  auto launches = [&](int experts, cudaError_t* first_error) {
    cudaStream_t stream = nullptr;
    if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) return;
    *first_error = cudaSuccess;
    for (int i = 0; i < kLaunches && *first_error == cudaSuccess; ++i) {
      k::Fp8GroupedGemmParams fp8{act.get<uint8_t>(), act.get<float>(), nullptr, w.get<uint8_t>(),
                                  scales.get<float>(), zeros.get<int32_t>(), zeros.get<int32_t>(), out.get<void>(),
                                  N, K, experts, 1 + experts, false, 1, 64};
      const k::GroupedGemmParams plain{act.get<bf16>(), nullptr, w.get<bf16>(), zeros.get<int32_t>(),
                                      zeros.get<int32_t>(), out.get<void>(), N, K, experts, 1 + experts, false};
      cudaError_t error = i % 3 == 0   ? k::fp8_grouped_gemm(fp8, stream)
                          : i % 3 == 1 ? k::fp8_grouped_gemm_prefill(fp8, stream)
                                       : k::wgmma_grouped_gemm(plain, stream);
      if (error == cudaSuccess) error = cudaGetLastError();
      *first_error = error;
    }
    if (*first_error == cudaSuccess) *first_error = cudaStreamSynchronize(stream);
    cudaStreamDestroy(stream);
  };
  cudaError_t errors[2] = {cudaErrorUnknown, cudaErrorUnknown};
  std::thread other(launches, counts[0], &errors[0]);
  launches(counts[1], &errors[1]);
  other.join();
  for (int t = 0; t < 2; ++t)
    EXPECT_EQ(errors[t], cudaSuccess) << counts[t] << " experts: " << cudaGetErrorString(errors[t]);
}

// A dense projection through the FP8 grouped GEMMs as one group (the CUDA
// model's FP8 attention projections): at decode sizes the few tiles are split
// along K (k_splits from fp8_gemm_k_splits, adding into a zeroed output),
// which must give what one item per tile gives and what the CPU's quantized
// linear gives, for fp8-block and MXFP8 weights.
TEST_F(CudaOps, Fp8DenseProjectionSplitAlongKMatchesTheCpu) {
  if (!k::hopper_kernels_available()) GTEST_SKIP() << "the FP8 grouped GEMM needs an sm_90 device";
  struct Case {
    int tokens, N, K;
  };
  for (const QuantFormat format : {QuantFormat::kFp8Block, QuantFormat::kMxfp8}) {
    const bool mx = format == QuantFormat::kMxfp8;
    // N 1000 ends in a part chunk of 16-byte atomics, N 998 takes scalar ones;
    // 256 x 9216 (qkv at batch 256) fills more than half of an H200's SMs unsplit.
    for (const Case& c : {Case{64, 2048, 4096}, Case{37, 1024, 8192}, Case{8, 4096, 1024},
                          Case{20, 1000, 2048}, Case{9, 998, 1024}, Case{256, 9216, 4096}}) {
      Host x = random_bf16({c.tokens, c.K}, rng_);
      Host w = random_bf16({c.N, c.K}, rng_, 1.0f / std::sqrt(static_cast<float>(c.K)));
      const Shape scale_shape = quant_scale_shape(format, c.N, c.K);
      Tensor values(DType::kF8E4M3, {c.N, c.K}), scales(mx ? DType::kE8M0 : DType::kF32, scale_shape);
      const QuantizedTensor q{format, values.view(), scales.view(), TensorView(), 0};
      quantize_matrix(w.f32.data_as<float>(), q);
      Tensor ref(DType::kF32, {c.tokens, c.N});
      cpu::quantized_linear(pool_, x.f32.view(), q, ref.view());

      const int tile = k::kGroupedGemmTileRows, row_tiles = (c.tokens + tile - 1) / tile;
      const int splits = k::fp8_gemm_k_splits(c.N, c.K, row_tiles);
      DeviceTensor d_x = upload(x.bf16), d_w = upload(values), d_s = upload(scales);
      DeviceTensor offsets = upload_vector(std::vector<int32_t>{0, c.tokens}, DType::kI32);
      DeviceTensor tiles = upload_vector(std::vector<int32_t>{0, row_tiles}, DType::kI32);
      const int scale_bytes = mx ? c.tokens * c.K / 32 : c.tokens * (c.K / 128) * 4;
      Output x_q = Output::make(static_cast<size_t>(c.tokens) * c.K), x_s = Output::make(scale_bytes);
      if (mx) {
        ASSERT_EQ(k::quantize_mxfp8(
                      {d_x.data_as<bf16>(), x_q.get<uint8_t>(), x_s.get<uint8_t>(), c.tokens, c.K}, nullptr),
                  cudaSuccess);
      } else {
        ASSERT_EQ(k::quantize_fp8_groups(
                      {d_x.data_as<bf16>(), x_q.get<uint8_t>(), x_s.get<float>(), c.tokens, c.K}, nullptr),
                  cudaSuccess);
      }
      std::vector<std::vector<float>> outs;
      for (const int k_splits : {1, splits}) {
        Output out = Output::make(static_cast<size_t>(c.tokens) * c.N * sizeof(float));
        ASSERT_EQ(cudaMemset(out.get<void>(), 0, static_cast<size_t>(c.tokens) * c.N * sizeof(float)),
                  cudaSuccess);
        const cudaError_t launched =
            mx ? k::mxfp8_grouped_gemm(
                     {x_q.get<uint8_t>(), x_s.get<uint8_t>(), nullptr, d_w.data_as<uint8_t>(),
                      d_s.data_as<uint8_t>(), offsets.data_as<int32_t>(), tiles.data_as<int32_t>(),
                      out.get<void>(), c.N, c.K, 1, row_tiles + 1, false, k_splits},
                     nullptr)
               : k::fp8_grouped_gemm(
                     {x_q.get<uint8_t>(), x_s.get<float>(), nullptr, d_w.data_as<uint8_t>(),
                      d_s.data_as<float>(), offsets.data_as<int32_t>(), tiles.data_as<int32_t>(),
                      out.get<void>(), c.N, c.K, 1, row_tiles + 1, false, k_splits},
                     nullptr);
        ASSERT_EQ(launched, cudaSuccess);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        outs.push_back(as_floats(out.download(), DType::kF32));
        EXPECT_LT(scaled_error(outs.back(), ref.data_as<float>(), ref.num_elements()), 2e-2)
            << quant_format_name(format) << ", " << c.tokens << " x " << c.N << " x " << c.K << ", k_splits "
            << k_splits;
      }
      EXPECT_LT(scaled_error(outs[1], outs[0].data(), static_cast<int64_t>(outs[0].size())), 1e-5)
          << "split along K (" << splits << ") against one item per tile";
      // Split shares add up in f32: bf16 rows with k_splits > 1 are refused.
      const int refused_splits = std::max(splits, 2);
      Output bf16_out = Output::make(static_cast<size_t>(c.tokens) * c.N * sizeof(bf16));
      EXPECT_EQ(mx ? k::mxfp8_grouped_gemm(
                         {x_q.get<uint8_t>(), x_s.get<uint8_t>(), nullptr, d_w.data_as<uint8_t>(),
                          d_s.data_as<uint8_t>(), offsets.data_as<int32_t>(), tiles.data_as<int32_t>(),
                          bf16_out.get<void>(), c.N, c.K, 1, row_tiles + 1, false, refused_splits, true},
                         nullptr)
                   : k::fp8_grouped_gemm(
                         {x_q.get<uint8_t>(), x_s.get<float>(), nullptr, d_w.data_as<uint8_t>(),
                          d_s.data_as<float>(), offsets.data_as<int32_t>(), tiles.data_as<int32_t>(),
                          bf16_out.get<void>(), c.N, c.K, 1, row_tiles + 1, false, refused_splits, 0, true},
                         nullptr),
                cudaErrorInvalidValue);
      if (row_tiles == 1) {
        EXPECT_GT(splits, 1) << c.N << " x " << c.K << " has too few tiles to fill the GPU unsplit";
      }
    }
  }
}

// fp8-block projections through cuBLASLt's block-scaled GEMM
// (Gemm::matmul_fp8_block): the activation scales laid out by group are the
// row layout's transpose bit for bit, and the GEMM gives the CPU's quantized
// linear in bf16 and f32. On Hopper with cuBLASLt >= 12.9 it must offer an
// algorithm for token counts that are multiples of 8 (the decode graphs'
// buckets, Qwen3-235B's qkv and o_proj); other counts are checked where it
// offers one.
TEST_F(CudaOps, Fp8BlockCublasLtMatchesTheCpu) {
  if (!k::hopper_kernels_available()) GTEST_SKIP() << "the block-scaled FP8 GEMM needs an sm_90 device";
  auto created = k::Gemm::create();
  ASSERT_TRUE(created.has_value()) << created.status().message();
  k::Gemm& gemm = *created;
  struct Case {
    int tokens, N, K;
  };
  for (const Case& c : {Case{64, 9216, 4096}, Case{256, 4096, 8192}, Case{8, 1024, 512},
                        Case{600, 1536, 2048}, Case{37, 1024, 4096}, Case{1, 2048, 1024}}) {
    SCOPED_TRACE(std::to_string(c.tokens) + " x " + std::to_string(c.N) + " x " + std::to_string(c.K));
    Host x = random_bf16({c.tokens, c.K}, rng_);
    Host w = random_bf16({c.N, c.K}, rng_, 1.0f / std::sqrt(static_cast<float>(c.K)));
    Tensor values(DType::kF8E4M3, {c.N, c.K}),
        scales(DType::kF32, quant_scale_shape(QuantFormat::kFp8Block, c.N, c.K));
    const QuantizedTensor q{QuantFormat::kFp8Block, values.view(), scales.view(), TensorView(), 0};
    quantize_matrix(w.f32.data_as<float>(), q);
    Tensor ref(DType::kF32, {c.tokens, c.N});
    cpu::quantized_linear(pool_, x.f32.view(), q, ref.view());
    DeviceTensor d_x = upload(x.bf16), d_w = upload(values), d_s = upload(scales);
    const int groups = c.K / 128;
    Output x_q = Output::make(static_cast<size_t>(c.tokens) * c.K),
           by_row = Output::make(c.tokens * groups * 4);
    Output x_q2 = Output::make(static_cast<size_t>(c.tokens) * c.K),
           by_group = Output::make(c.tokens * groups * 4);
    ASSERT_EQ(k::quantize_fp8_groups(
                  {d_x.data_as<bf16>(), x_q.get<uint8_t>(), by_row.get<float>(), c.tokens, c.K}, nullptr),
              cudaSuccess);
    ASSERT_EQ(k::quantize_fp8_groups({d_x.data_as<bf16>(), x_q2.get<uint8_t>(), by_group.get<float>(),
                                      c.tokens, c.K, nullptr, nullptr, true},
                                     nullptr),
              cudaSuccess);
    ASSERT_EQ(x_q.download(), x_q2.download());
    const std::vector<float> rows = as_floats(by_row.download(), DType::kF32);
    const std::vector<float> cols = as_floats(by_group.download(), DType::kF32);
    for (int t = 0; t < c.tokens; ++t)
      for (int g = 0; g < groups; ++g)
        ASSERT_EQ(rows[t * groups + g], cols[g * c.tokens + t]) << "token " << t << ", group " << g;
    for (const DType dtype : {DType::kBF16, DType::kF32}) {
      const bool offered = gemm.has_fp8_block(c.tokens, c.N, c.K, dtype);
      if (c.tokens % 8 == 0) {
        EXPECT_TRUE(offered) << "cuBLASLt offers no fp8-block algorithm";
      }
      if (!offered) {
        std::printf("[ info ] cuBLASLt: no fp8-block algorithm for %d x %d x %d\n", c.tokens, c.N, c.K);
        continue;
      }
      const size_t bytes = static_cast<size_t>(c.tokens) * c.N * (dtype == DType::kBF16 ? 2 : 4);
      Output out = Output::make(bytes);
      const Status status =
          gemm.matmul_fp8_block(x_q2.get<uint8_t>(), by_group.get<float>(), d_w.data_as<uint8_t>(),
                                d_s.data_as<float>(), out.get<void>(), dtype, c.tokens, c.N, c.K, nullptr);
      ASSERT_TRUE(status.is_ok()) << status.message();
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_LT(scaled_error(as_floats(out.download(), dtype), ref.data_as<float>(), ref.num_elements()),
                2e-2)
          << (dtype == DType::kBF16 ? "bf16" : "f32") << " output";
    }
  }
}

// The MXFP8 activation quantizer writes the bytes the CPU quantizer writes
// for the same matrix (E4M3 values, E8M0 scales per 1 x 32, the OCP rule),
// zero groups and a partial last group included.
// fp8-block activations with the row count on the device (live_rows, as a
// data-parallel rank quantizes what its exchange brought): the live rows equal
// the host-counted run bit for bit, the rows past the count stay untouched.
TEST_F(CudaOps, QuantizeFp8GroupsStopsAtTheDeviceRowCount) {
  const int rows = 300, cols = 1536, live = 137, groups = cols / 128;
  Host x = random_bf16({rows, cols}, rng_, 3.0f);
  DeviceTensor d_x = upload(x.bf16);
  DeviceTensor d_live = upload_vector(std::vector<int32_t>{live}, DType::kI32);
  Output all = Output::make(static_cast<size_t>(rows) * cols), all_scales = Output::make(rows * groups * 4);
  Output some = Output::make(static_cast<size_t>(rows) * cols), some_scales = Output::make(rows * groups * 4);
  ASSERT_EQ(k::quantize_fp8_groups(
                {d_x.data_as<bf16>(), all.get<uint8_t>(), all_scales.get<float>(), rows, cols}, nullptr),
            cudaSuccess);
  k::QuantizeFp8Params p{d_x.data_as<bf16>(), some.get<uint8_t>(), some_scales.get<float>(), rows, cols};
  p.live_rows = d_live.data_as<int32_t>();
  ASSERT_EQ(k::quantize_fp8_groups(p, nullptr), cudaSuccess);
  const auto want = all.download(), got = some.download();
  const auto want_scales = all_scales.download(), got_scales = some_scales.download();
  const size_t live_bytes = static_cast<size_t>(live) * cols,
               live_scale_bytes = static_cast<size_t>(live) * groups * 4;
  EXPECT_EQ(std::memcmp(got.data(), want.data(), live_bytes), 0) << "the live rows";
  EXPECT_EQ(std::memcmp(got_scales.data(), want_scales.data(), live_scale_bytes), 0) << "their scales";
  EXPECT_TRUE(std::all_of(got.begin() + static_cast<int64_t>(live_bytes), got.end(), [](uint8_t b) {
    return b == kSentinel;
  })) << "rows past the count written";
  EXPECT_TRUE(std::all_of(got_scales.begin() + static_cast<int64_t>(live_scale_bytes), got_scales.end(),
                          [](uint8_t b) { return b == kSentinel; }))
      << "scales past the count written";
}

// fp8-block activations (1 x 128 groups) against the CPU quantizer run on
// each row as a one-row matrix (its 128 x 128 blocks are then 1 x 128), bit
// for bit: whole groups (the kernel's 8-byte loads), a partial last group
// (cols % 4 == 0) and odd widths (one column at a time).
// Decode sizes (one group per half-warp) and prefill sizes (two per round).
TEST_F(CudaOps, QuantizeFp8GroupsMatchesTheCpuQuantizer) {
  for (const auto& [rows, cols] : {std::pair{37, 1536}, std::pair{37, 328}, std::pair{37, 330}, std::pair{2100, 1024}}) {
    Host x = random_bf16({rows, cols}, rng_, 3.0f);
    const Fp8Groups ref = cpu_fp8_groups(x.f32.data_as<float>(), rows, cols);
    DeviceTensor d_x = upload(x.bf16);
    Output out = Output::make(ref.values.size()), out_scales = Output::make(ref.scales.size() * sizeof(float));
    ASSERT_EQ(k::quantize_fp8_groups({d_x.data_as<bf16>(), out.get<uint8_t>(), out_scales.get<float>(), rows, cols},
                                     nullptr),
              cudaSuccess);
    const std::vector<uint8_t> got = out.download(), got_scales = out_scales.download();
    EXPECT_EQ(std::memcmp(got_scales.data(), ref.scales.data(), got_scales.size()), 0)
        << "scales, " << rows << " x " << cols;
    EXPECT_EQ(std::memcmp(got.data(), ref.values.data(), got.size()), 0) << "E4M3 values, " << rows << " x " << cols;
  }
}

// add_rms_norm writing its rows in FP8 too: the bytes and scales the CPU
// quantizer makes of the bf16 rows it wrote, in both scale layouts.
TEST_F(CudaOps, AddRmsNormQuantizesItsRows) {
  for (const auto& [tokens, hidden] : {std::pair{37, 4096}, std::pair{3, 256}, std::pair{130, 1536}}) {
    Host residual = random_bf16({tokens, hidden}, rng_, 2.0f), delta = random_bf16({tokens, hidden}, rng_);
    Host weight = random_bf16({hidden}, rng_);
    const int groups = hidden / 128;
    for (const bool by_group : {false, true}) {
      SCOPED_TRACE(std::to_string(tokens) + " x " + std::to_string(hidden) + (by_group ? ", scales by group" : ""));
      DeviceTensor d_residual = upload(residual.f32), d_delta = upload(delta.f32), d_weight = upload(weight.bf16);
      Output out = Output::make(static_cast<size_t>(tokens) * hidden * sizeof(bf16)),
             out_fp8 = Output::make(static_cast<size_t>(tokens) * hidden),
             out_scales = Output::make(static_cast<size_t>(tokens) * groups * sizeof(float));
      k::AddRmsNormParams p{d_residual.data_as<float>(), d_delta.data_as<float>(), d_weight.data_as<bf16>(),
                            out.get<bf16>(), tokens, hidden, 1e-6f};
      p.out_fp8 = out_fp8.get<uint8_t>(), p.out_scales = out_scales.get<float>(), p.scales_by_group = by_group;
      ASSERT_TRUE(k::add_rms_norm_fuses(hidden));
      ASSERT_EQ(k::add_rms_norm(p, nullptr), cudaSuccess);
      const std::vector<float> rows = as_floats(out.download(), DType::kBF16);
      const Fp8Groups ref = cpu_fp8_groups(rows.data(), tokens, hidden, by_group);
      const std::vector<uint8_t> got = out_fp8.download(), got_scales = out_scales.download();
      EXPECT_EQ(std::memcmp(got_scales.data(), ref.scales.data(), got_scales.size()), 0) << "scales";
      EXPECT_EQ(std::memcmp(got.data(), ref.values.data(), got.size()), 0) << "E4M3 values";
    }
  }
  // Rows that are not whole groups: refused, nothing written.
  EXPECT_FALSE(k::add_rms_norm_fuses(4098));
  Output residual = Output::make(4098 * sizeof(float)), fp8 = Output::make(4098);
  k::AddRmsNormParams p{residual.get<float>(), nullptr, nullptr, nullptr, 1, 4098, 1e-6f};
  p.out_fp8 = fp8.get<uint8_t>();
  EXPECT_EQ(k::add_rms_norm(p, nullptr), cudaErrorInvalidValue);
}

TEST_F(CudaOps, QuantizeMxfp8MatchesTheCpuQuantizer) {
  const int rows = 37, cols = 328;  // 10 full groups and one of 8
  Host x = random_bf16({rows, cols}, rng_, 3.0f);
  for (int c = 32; c < 64; ++c)
    x.f32.data_as<float>()[c] = 0.0f, x.bf16.data_as<uint16_t>()[c] = 0;  // an all-zero group
  for (int c = 0; c < cols; ++c) {  // a row of tiny values: scales far below 1
    x.f32.data_as<float>()[cols + c] = bf16_to_float(float_to_bf16(1e-30f * (1 + c % 5)));
    x.bf16.data_as<uint16_t>()[cols + c] = float_to_bf16(x.f32.data_as<float>()[cols + c]);
  }
  const int groups = (cols + 31) / 32;
  Tensor values(DType::kF8E4M3, {rows, cols}), scales(DType::kE8M0, {rows, groups});
  quantize_matrix(x.f32.data_as<float>(),
                  QuantizedTensor{QuantFormat::kMxfp8, values.view(), scales.view(), TensorView(), 0});
  DeviceTensor d_x = upload(x.bf16);
  Output out = Output::make(static_cast<size_t>(rows) * cols),
         out_scales = Output::make(static_cast<size_t>(rows) * groups);
  ASSERT_EQ(k::quantize_mxfp8(
                {d_x.data_as<bf16>(), out.get<uint8_t>(), out_scales.get<uint8_t>(), rows, cols}, nullptr),
            cudaSuccess);
  const std::vector<uint8_t> got = out.download(), got_scales = out_scales.download();
  EXPECT_EQ(std::memcmp(got_scales.data(), scales.data(), got_scales.size()), 0) << "E8M0 scales";
  EXPECT_EQ(std::memcmp(got.data(), values.data(), got.size()), 0) << "E4M3 values";
}

// MXFP8 experts (weights and activations per 1 x 32, E8M0 scales) through one
// MXFP8 grouped GEMM kernel against the CPU's quantized MoE.
using Mxfp8Gemm = cudaError_t (*)(const k::Mxfp8GroupedGemmParams&, cudaStream_t);
void expect_mxfp8_moe_matches_cpu(Mxfp8Gemm gemm, const char* name, std::mt19937& rng, ThreadPool& pool) {
  struct Case {
    int tokens, hidden, inter, experts, topk;
  };
  for (const Case& c : {Case{16, 4096, 1536, 8, 4}, Case{300, 256, 128, 16, 4}, Case{37, 384, 640, 6, 2}}) {
    Host x = random_bf16({c.tokens, c.hidden}, rng);
    Host logits = random_bf16({c.tokens, c.experts}, rng, 3.0f);
    auto quantized = [&](int64_t rows, int64_t cols, float scale) {
      struct Q {
        Tensor values, scales;
        QuantizedTensor view;
      };
      Q q;
      q.values = Tensor(DType::kF8E4M3, {int64_t{c.experts}, rows, cols});
      q.scales = Tensor(DType::kE8M0, {int64_t{c.experts}, rows, cols / 32});
      q.view = QuantizedTensor{QuantFormat::kMxfp8, q.values.view(), q.scales.view(), TensorView(), 0};
      for (int e = 0; e < c.experts; ++e) {
        Host w = random_bf16({rows, cols}, rng, scale);
        quantize_matrix(w.f32.data_as<float>(), q.view.slice0(e));
      }
      return q;
    };
    auto q13 = quantized(2 * c.inter, c.hidden, 1.0f / std::sqrt(static_cast<float>(c.hidden)));
    auto q2 = quantized(c.hidden, c.inter, 1.0f / std::sqrt(static_cast<float>(c.inter)));
    Tensor ids(DType::kI32, {c.tokens, c.topk}), weights(DType::kF32, {c.tokens, c.topk}),
        ref(DType::kF32, {c.tokens, c.hidden});
    cpu::route_topk(pool, logits.f32, c.topk, true, ids, weights);
    cpu::moe_experts(pool, x.f32, ids, weights, q13.view, q2.view, ref);

    const int pairs = c.tokens * c.topk;
    DeviceTensor d_x = upload(x.bf16), d_ids = upload(ids), d_weights = upload(weights);
    DeviceTensor d_w13 = upload(q13.values), d_s13 = upload(q13.scales), d_w2 = upload(q2.values),
                 d_s2 = upload(q2.scales);
    Output x_q = Output::make(static_cast<size_t>(c.tokens) * c.hidden),
           x_s = Output::make(c.tokens * c.hidden / 32);
    Output offsets = Output::make((c.experts + 1) * 4), tiles = Output::make((c.experts + 1) * 4);
    Output sorted = Output::make(pairs * 4), row_of = Output::make(pairs * 4);
    Output act = Output::make(static_cast<size_t>(pairs) * c.inter * sizeof(bf16));
    Output act_q = Output::make(static_cast<size_t>(pairs) * c.inter),
           act_s = Output::make(pairs * c.inter / 32);
    Output rows = Output::make(static_cast<size_t>(pairs) * c.hidden * sizeof(float));
    Output out = Output::make(static_cast<size_t>(c.tokens) * c.hidden * sizeof(float));
    const int max_tiles = (pairs + k::kGroupedGemmTileRows - 1) / k::kGroupedGemmTileRows + c.experts;
    ASSERT_EQ(k::quantize_mxfp8(
                  {d_x.data_as<bf16>(), x_q.get<uint8_t>(), x_s.get<uint8_t>(), c.tokens, c.hidden}, nullptr),
              cudaSuccess);
    ASSERT_EQ(k::moe_permute({d_ids.data_as<int32_t>(), offsets.get<int32_t>(), tiles.get<int32_t>(),
                              sorted.get<int32_t>(), row_of.get<int32_t>(), c.tokens, c.topk, c.experts,
                              k::kGroupedGemmTileRows},
                             nullptr),
              cudaSuccess);
    ASSERT_EQ(gemm({x_q.get<uint8_t>(), x_s.get<uint8_t>(), sorted.get<int32_t>(), d_w13.data_as<uint8_t>(),
                    d_s13.data_as<uint8_t>(), offsets.get<int32_t>(), tiles.get<int32_t>(), act.get<void>(),
                    c.inter, c.hidden, c.experts, max_tiles, true},
                   nullptr),
              cudaSuccess)
        << name;
    ASSERT_EQ(k::quantize_mxfp8({act.get<bf16>(), act_q.get<uint8_t>(), act_s.get<uint8_t>(), pairs, c.inter},
                                nullptr),
              cudaSuccess);
    ASSERT_EQ(gemm({act_q.get<uint8_t>(), act_s.get<uint8_t>(), nullptr, d_w2.data_as<uint8_t>(),
                    d_s2.data_as<uint8_t>(), offsets.get<int32_t>(), tiles.get<int32_t>(), rows.get<void>(),
                    c.hidden, c.inter, c.experts, max_tiles, false},
                   nullptr),
              cudaSuccess)
        << name;
    x_q.download();
    act_q.download();
    SCOPED_TRACE(moe_case(name, c.tokens, c.experts, c.hidden, c.inter));
    expect_unpermuted(rows, out, row_of.get<int32_t>(), d_weights.data_as<float>(), c.tokens, c.topk,
                      c.hidden, ref.data_as<float>(), 3e-2, [&](void* bf16_rows) {
                        return gemm(
                            {act_q.get<uint8_t>(), act_s.get<uint8_t>(), nullptr, d_w2.data_as<uint8_t>(),
                             d_s2.data_as<uint8_t>(), offsets.get<int32_t>(), tiles.get<int32_t>(), bf16_rows,
                             c.hidden, c.inter, c.experts, max_tiles, false, 1, true},
                            nullptr);
                      });
  }
}

// Hopper has no MXFP8 MMA; the kernel promotes every 32-wide slice itself.
TEST_F(CudaOps, Mxfp8GroupedGemmMatchesTheCpuQuantizedMoe) {
  if (!k::hopper_kernels_available()) GTEST_SKIP() << "the MXFP8 grouped GEMM needs an sm_90 device";
  expect_mxfp8_moe_matches_cpu(k::mxfp8_grouped_gemm, "mxfp8 wgmma", rng_, pool_);
}

// Blackwell's block-scaled tcgen05 MMA (grouped_gemm_sm100.cu). Compiled, never
// run: no compute capability 10.0 device has executed this test yet.
TEST_F(CudaOps, Mxfp8GroupedGemmSm100MatchesTheCpuQuantizedMoe) {
  if (!k::sm100_kernels_available())
    GTEST_SKIP() << "the tcgen05 MXFP8 grouped GEMM needs a compute capability 10.0 device (sm_100a code)";
  expect_mxfp8_moe_matches_cpu(k::mxfp8_grouped_gemm_sm100, "mxfp8 tcgen05", rng_, pool_);
}

}  // namespace
}  // namespace moe::ops
