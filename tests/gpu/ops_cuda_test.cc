// Each CUDA op against the CPU reference op on fresh random inputs, at small
// shapes and at Qwen3-235B's. Outputs are allocated with guard elements after
// them, filled with a sentinel that must survive, and checked for NaN
// (helpers and tolerances: cuda_op_test_util.h). The FP8 and MXFP8 GEMMs and
// quantizers are in fp8_cuda_test.cc (the same binary).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "core/cuda/device_buffer.h"
#include "ops/attention.h"
#include "ops/cuda/kernels.h"
#include "ops/moe.h"
#include "ops/norm.h"
#include "ops/quant.h"
#include "ops/rope.h"
#include "tests/gpu/cuda_op_test_util.h"

namespace moe::ops {
namespace {

using namespace cuda_test;  // the shared helpers and the CudaOps fixture

TEST_F(CudaOps, AddRmsNorm) {
  // Vectorised rows (hidden % 4 == 0, up to 8192) and the scalar kernel (4098, 12288).
  for (auto [tokens, hidden] :
       {std::pair{3, 64}, std::pair{37, 4096}, std::pair{5, 4098}, std::pair{2, 12288}}) {
    Host residual = random_bf16({tokens, hidden}, rng_, 2.0f), delta = random_bf16({tokens, hidden}, rng_);
    Host weight = random_bf16({hidden}, rng_);
    DeviceTensor d_residual = upload(residual.f32), d_delta = upload(delta.f32), d_weight = upload(weight.bf16);
    Output out = Output::make(tokens * hidden * sizeof(bf16));
    ASSERT_EQ(k::add_rms_norm({d_residual.data_as<float>(), d_delta.data_as<float>(), d_weight.data_as<bf16>(),
                               out.get<bf16>(), tokens, hidden, 1e-6f}, nullptr), cudaSuccess);
    Tensor ref(DType::kF32, {tokens, hidden});
    cpu::add_rms_norm(pool_, residual.f32, delta.f32, weight.bf16, 1e-6f, ref);
    EXPECT_LT(scaled_error(as_floats(out.download(), DType::kBF16), ref.data_as<float>(), ref.num_elements()), 8e-3);
    Tensor new_residual = download(d_residual.view()).value();
    EXPECT_LT(scaled_error(std::vector<float>(new_residual.data_as<float>(), new_residual.data_as<float>() + ref.num_elements()),
                           residual.f32.data_as<float>(), ref.num_elements()), 1e-6);
  }
}

// The RMSNorm summing the MoE's bf16 expert rows itself: the same residual
// and rows, bit for bit, as moe_unpermute into delta followed by add_rms_norm
// (itself checked against the CPU above and in the MoE tests).
TEST_F(CudaOps, AddRmsNormSumsTheExpertRows) {
  for (const auto& [tokens, hidden, topk] : {std::tuple{37, 4096, 8}, std::tuple{5, 256, 3}, std::tuple{300, 1024, 8}}) {
    SCOPED_TRACE(std::to_string(tokens) + " tokens x " + std::to_string(hidden) + ", top-" + std::to_string(topk));
    const int pairs = tokens * topk;
    Host residual = random_bf16({tokens, hidden}, rng_, 2.0f), rows = random_bf16({pairs, hidden}, rng_);
    Host weight = random_bf16({hidden}, rng_), weights = random_bf16({tokens, topk}, rng_);
    // A shuffled row per pair; every fifth pair another rank's (-1).
    std::vector<int32_t> row_of(static_cast<size_t>(pairs));
    for (int i = 0; i < pairs; ++i) row_of[i] = i;
    std::shuffle(row_of.begin(), row_of.end(), rng_);
    for (int i = 0; i < pairs; i += 5) row_of[i] = -1;
    DeviceTensor d_rows = upload(rows.bf16), d_weights = upload(weights.f32), d_weight = upload(weight.bf16);
    DeviceTensor d_row_of = upload_vector(row_of, DType::kI32);
    const size_t bytes = static_cast<size_t>(tokens) * hidden;
    // Two kernels: delta, then the add and the norm.
    DeviceTensor residual_a = upload(residual.f32), residual_b = upload(residual.f32);
    Output delta = Output::make(bytes * 4), out_a = Output::make(bytes * 2), out_b = Output::make(bytes * 2);
    ASSERT_EQ(k::moe_unpermute({d_rows.data(), d_row_of.data_as<int32_t>(), d_weights.data_as<float>(),
                                delta.get<float>(), tokens, topk, hidden, true},
                               nullptr),
              cudaSuccess);
    ASSERT_EQ(k::add_rms_norm({residual_a.data_as<float>(), delta.get<float>(), d_weight.data_as<bf16>(),
                               out_a.get<bf16>(), tokens, hidden, 1e-6f},
                              nullptr),
              cudaSuccess);
    // One.
    k::AddRmsNormParams fused{residual_b.data_as<float>(), nullptr, d_weight.data_as<bf16>(), out_b.get<bf16>(),
                              tokens, hidden, 1e-6f};
    fused.expert_rows = d_rows.data_as<bf16>(), fused.row_of = d_row_of.data_as<int32_t>();
    fused.expert_weights = d_weights.data_as<float>(), fused.k = topk;
    ASSERT_TRUE(k::add_rms_norm_fuses(hidden));
    ASSERT_EQ(k::add_rms_norm(fused, nullptr), cudaSuccess);
    Tensor res_a = download(residual_a.view()).value(), res_b = download(residual_b.view()).value();
    EXPECT_EQ(std::memcmp(res_a.data(), res_b.data(), res_a.num_bytes()), 0) << "residual";
    const std::vector<uint8_t> a = out_a.download(), b = out_b.download();
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size()), 0) << "normed rows";
  }
}

TEST_F(CudaOps, QkNormRopeKvAndPagedAttention) {
  struct Case { int q_heads, kv_heads, dim, page_size, prefix, new_tokens; };
  for (const Case& c :
       {Case{4, 2, 32, 4, 5, 7}, Case{64, 4, 128, 16, 1000, 1}, Case{64, 4, 128, 16, 40, 33},
        Case{4, 1, 16, 1, 0, 9}, Case{32, 4, 128, 4, 3000, 3}, Case{8, 2, 128, 16, 7, 1},
        Case{64, 4, 128, 16, 0, 300}, Case{16, 4, 128, 16, 130, 150}, Case{8, 8, 128, 16, 0, 260},
        Case{24, 2, 128, 8, 61, 70}, Case{64, 4, 128, 32, 700, 2}}) {
    const int seq_len = c.prefix + c.new_tokens, pages = (seq_len + c.page_size - 1) / c.page_size;
    const int qkv_width = (c.q_heads + 2 * c.kv_heads) * c.dim;
    // The prefix K/V go straight into the pages; the new tokens come through qkv.
    Host k_pages = random_bf16({pages, c.kv_heads, c.page_size, c.dim}, rng_);
    Host v_pages = random_bf16({pages, c.kv_heads, c.page_size, c.dim}, rng_);
    Host qkv = random_bf16({c.new_tokens, qkv_width}, rng_, 2.0f);
    Host q_norm = random_bf16({c.dim}, rng_), k_norm = random_bf16({c.dim}, rng_);
    std::vector<int32_t> positions, token_seq(c.new_tokens, 0), page_table(pages);
    for (int i = 0; i < c.new_tokens; ++i) positions.push_back(c.prefix + i);
    for (int p = 0; p < pages; ++p) page_table[p] = pages - 1 - p;
    RopeSpec spec;
    spec.head_dim = c.dim;
    spec.theta = 1e6;
    const RopeTable rope = make_rope_table(spec);

    DeviceTensor d_k = upload(k_pages.bf16), d_v = upload(v_pages.bf16), d_qkv = upload(qkv.bf16);
    DeviceTensor d_qn = upload(q_norm.bf16), d_kn = upload(k_norm.bf16), d_freq = upload_vector(rope.inv_freq, DType::kF32);
    DeviceTensor d_pos = upload_vector(positions, DType::kI32), d_seq = upload_vector(token_seq, DType::kI32);
    DeviceTensor d_pages = upload_vector(page_table, DType::kI32);
    Output q_out = Output::make(static_cast<size_t>(c.new_tokens) * c.q_heads * c.dim * sizeof(bf16));
    ASSERT_EQ(k::qk_norm_rope_kv({d_qkv.data_as<bf16>(), d_qn.data_as<bf16>(), d_kn.data_as<bf16>(), d_freq.data_as<float>(),
                                  1.0f, d_pos.data_as<int32_t>(), d_seq.data_as<int32_t>(), d_pages.data_as<int32_t>(),
                                  q_out.get<bf16>(), d_k.data_as<bf16>(), d_v.data_as<bf16>(), c.new_tokens, c.q_heads,
                                  c.kv_heads, c.dim, c.page_size, pages, 1e-6f}, nullptr), cudaSuccess);
    Output attn = Output::make(static_cast<size_t>(c.new_tokens) * c.q_heads * c.dim * sizeof(bf16));
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.dim));
    ASSERT_EQ(k::paged_attention({q_out.get<bf16>(), d_k.data_as<bf16>(), d_v.data_as<bf16>(), d_pos.data_as<int32_t>(),
                                  d_seq.data_as<int32_t>(), d_pages.data_as<int32_t>(), attn.get<bf16>(), c.new_tokens,
                                  c.q_heads, c.kv_heads, c.dim, c.page_size, pages, scale}, nullptr), cudaSuccess);

    // CPU: split qkv, norm, rope, write kv (bf16 pages), attention.
    Tensor q(DType::kF32, {c.new_tokens, c.q_heads, c.dim}), kk(DType::kF32, {c.new_tokens, c.kv_heads, c.dim}),
        vv(DType::kF32, {c.new_tokens, c.kv_heads, c.dim});
    for (int t = 0; t < c.new_tokens; ++t) {
      const float* row = qkv.f32.data_as<float>() + t * qkv_width;
      std::memcpy(q.data_as<float>() + t * c.q_heads * c.dim, row, c.q_heads * c.dim * 4);
      std::memcpy(kk.data_as<float>() + t * c.kv_heads * c.dim, row + c.q_heads * c.dim, c.kv_heads * c.dim * 4);
      std::memcpy(vv.data_as<float>() + t * c.kv_heads * c.dim, row + (c.q_heads + c.kv_heads) * c.dim, c.kv_heads * c.dim * 4);
    }
    auto heads = [&](Tensor& t) { return t.view().reshaped({t.num_elements() / c.dim, c.dim}); };
    cpu::rms_norm(pool_, heads(q), q_norm.bf16, 1e-6f, heads(q));
    cpu::rms_norm(pool_, heads(kk), k_norm.bf16, 1e-6f, heads(kk));
    cpu::apply_rope(pool_, q, positions, rope);
    cpu::apply_rope(pool_, kk, positions, rope);
    const std::vector<int32_t> query_start = {0, c.new_tokens};
    AttentionBatch batch{query_start, positions, page_table, pages};
    PagedKv kv{k_pages.bf16, v_pages.bf16};
    cpu::write_kv(pool_, kk, vv, batch, kv);
    EXPECT_LT(scaled_error(as_floats(q_out.download(), DType::kBF16), q.data_as<float>(), q.num_elements()), 8e-3)
        << "q of case " << c.q_heads << "/" << c.dim;
    Tensor k_after = download(d_k.view()).value();
    EXPECT_LT(scaled_error(as_floats(std::vector<uint8_t>(static_cast<uint8_t*>(k_after.data()),
                                                          static_cast<uint8_t*>(k_after.data()) + k_after.num_bytes()), DType::kBF16),
                           std::vector<float>(as_floats(std::vector<uint8_t>(static_cast<uint8_t*>(k_pages.bf16.data()),
                                                                              static_cast<uint8_t*>(k_pages.bf16.data()) + k_pages.bf16.num_bytes()), DType::kBF16)).data(),
                           k_after.num_elements()), 8e-3);
    // Attention from the GPU's own q (bf16), so only attention is compared.
    std::vector<float> q_gpu = as_floats(q_out.download(), DType::kBF16);
    Tensor out(DType::kF32, {c.new_tokens, c.q_heads * c.dim});
    cpu::paged_attention(pool_, TensorView(q_gpu.data(), DType::kF32, {c.new_tokens, c.q_heads, c.dim}), batch, kv, scale, out);
    EXPECT_LT(scaled_error(as_floats(attn.download(), DType::kBF16), out.data_as<float>(), out.num_elements()), 1e-2)
        << "attention, case " << c.q_heads << " heads, dim " << c.dim << ", prefix " << c.prefix;
    // The tensor-core kernel, with and without split-KV workspace.
    const k::PagedAttentionParams params{q_out.get<bf16>(), d_k.data_as<bf16>(), d_v.data_as<bf16>(), d_pos.data_as<int32_t>(),
                                         d_seq.data_as<int32_t>(), d_pages.data_as<int32_t>(), attn.get<bf16>(), c.new_tokens,
                                         c.q_heads, c.kv_heads, c.dim, c.page_size, pages, scale};
    if (k::mma_attention_supported(params)) {
      const int max_position = c.prefix + c.new_tokens - 1;
      const size_t bytes = k::mma_attention_workspace_bytes(c.new_tokens, c.q_heads, max_position);
      auto workspace = DeviceBuffer::allocate(bytes);
      ASSERT_TRUE(workspace.has_value());
      // The rows of the last page past the last position hold NaN here
      // (bf16 0x7fc0), as never-written memory may: the tensor copies bring
      // them in, and the kernel must keep them out of the output (P is 0
      // there, 0 x NaN is not). Put back after these kernels.
      const int last = c.prefix + c.new_tokens - 1, last_page = page_table[last / c.page_size];
      const int tail = pages * c.page_size - 1 - last;
      auto tail_offset = [&](int h) {  // elements
        return ((static_cast<size_t>(last_page) * c.kv_heads + h) * c.page_size + last % c.page_size + 1) * c.dim;
      };
      const std::vector<uint16_t> nans(static_cast<size_t>(tail) * c.dim, 0x7fc0);
      for (int h = 0; h < c.kv_heads && tail > 0; ++h)
        for (const DeviceTensor* d : {&d_k, &d_v})
          ASSERT_EQ(cudaMemcpy(d->data_as<bf16>() + tail_offset(h), nans.data(), nans.size() * 2, cudaMemcpyHostToDevice),
                    cudaSuccess);
      // Splits: none (no workspace), chosen, and forced to 3; K/V chunks by
      // cp.async, and (the pool's size given, pages of 16 or 32 on sm_90) by
      // tensor copies.
      for (int split : {0, 1, 2})
        for (int stages : {2, 3, 4}) {
          for (int num_pages : {0, pages}) {
            Output mma_out = Output::make(static_cast<size_t>(c.new_tokens) * c.q_heads * c.dim * sizeof(bf16));
            k::PagedAttentionParams pm = params;
            pm.out = mma_out.get<bf16>();
            pm.num_pages = num_pages;
            pm.decode_stages = stages;
            pm.decode_splits = split == 2 ? 3 : 0;
            ASSERT_EQ(k::mma_paged_attention(pm, max_position, split ? workspace->data_as<float>() : nullptr,
                                             split ? bytes : 0, nullptr), cudaSuccess);
            const std::vector<uint8_t> bf16_rows = mma_out.download();
            EXPECT_LT(scaled_error(as_floats(bf16_rows, DType::kBF16), out.data_as<float>(), out.num_elements()),
                      2e-2)
                << "tensor-core attention (split " << split << ", " << stages << " stages, "
                << (num_pages > 0 ? "tensor copies" : "cp.async") << "), " << c.q_heads << " heads, prefix " << c.prefix;
            if (stages != 3) continue;
            // Its output in FP8 (the o projection's input), merged in the
            // kernel or by the split combine: the CPU quantizer's bytes of the
            // bf16 rows just checked, a (token, head) per group.
            const std::vector<float> rows = as_floats(bf16_rows, DType::kBF16);
            for (const bool by_group : {false, true}) {
              const int heads = c.new_tokens * c.q_heads;
              Output fp8 = Output::make(static_cast<size_t>(heads) * c.dim), scales = Output::make(heads * sizeof(float));
              pm.out = nullptr, pm.out_fp8 = fp8.get<uint8_t>(), pm.out_scales = scales.get<float>();
              pm.scales_by_group = by_group;
              ASSERT_EQ(k::mma_paged_attention(pm, max_position, split ? workspace->data_as<float>() : nullptr,
                                               split ? bytes : 0, nullptr),
                        cudaSuccess);
              const Fp8Groups ref = cpu_fp8_groups(rows.data(), c.new_tokens, c.q_heads * c.dim, by_group);
              const std::vector<uint8_t> got = fp8.download(), got_scales = scales.download();
              EXPECT_EQ(std::memcmp(got.data(), ref.values.data(), got.size()), 0)
                  << "E4M3 decode attention output, split " << split << ", prefix " << c.prefix
                  << (by_group ? ", by group" : "");
              EXPECT_EQ(std::memcmp(got_scales.data(), ref.scales.data(), got_scales.size()), 0) << "scales";
            }
          }
        }
      for (int h = 0; h < c.kv_heads && tail > 0; ++h)
        for (const auto& [d, host] : {std::pair{&d_k, &k_pages}, std::pair{&d_v, &v_pages}})
          ASSERT_EQ(cudaMemcpy(d->data_as<bf16>() + tail_offset(h), host->bf16.data_as<bf16>() + tail_offset(h),
                               nans.size() * 2, cudaMemcpyHostToDevice),
                    cudaSuccess);
      // The prefill kernels (token groups sharing K/V blocks): mma.sync everywhere, wgmma on sm_90.
      struct PrefillKernel {
        const char* name;
        int group_tokens;
        cudaError_t (*launch)(const k::PagedAttentionParams&, const int32_t*, int, cudaStream_t);
      };
      std::vector<PrefillKernel> kernels = {{"mma.sync", k::kMmaPrefillGroupTokens, k::mma_prefill_attention}};
      if (k::hopper_kernels_available())
        kernels.push_back({"wgmma", k::wgmma_prefill_group_tokens(c.q_heads, c.kv_heads), k::wgmma_prefill_attention});
      for (const PrefillKernel& kernel : kernels) {
        const std::vector<int32_t> groups = k::prefill_token_groups(query_start, kernel.group_tokens);
        DeviceTensor d_groups = upload_vector(groups, DType::kI32);
        Output prefill_out = Output::make(static_cast<size_t>(c.new_tokens) * c.q_heads * c.dim * sizeof(bf16));
        k::PagedAttentionParams pp = params;
        pp.out = prefill_out.get<bf16>();
        ASSERT_EQ(kernel.launch(pp, d_groups.data_as<int32_t>(), static_cast<int>(groups.size()) - 1, nullptr), cudaSuccess);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << kernel.name;
        EXPECT_LT(scaled_error(as_floats(prefill_out.download(), DType::kBF16), out.data_as<float>(), out.num_elements()),
                  2e-2)
            << kernel.name << " prefill attention, " << c.q_heads << "/" << c.kv_heads << " heads, prefix " << c.prefix
            << ", " << c.new_tokens << " new tokens";
        // Its output in FP8 (the o projection's input): the CPU quantizer's
        // bytes of the bf16 rows above, a (token, head) per group; the
        // mma.sync prefill kernel refuses it.
        const std::vector<float> rows = as_floats(prefill_out.download(), DType::kBF16);
        for (const bool by_group : {false, true}) {
          const int heads = c.new_tokens * c.q_heads;
          Output fp8 = Output::make(static_cast<size_t>(heads) * c.dim), scales = Output::make(heads * sizeof(float));
          pp.out = nullptr, pp.out_fp8 = fp8.get<uint8_t>(), pp.out_scales = scales.get<float>();
          pp.scales_by_group = by_group;
          const cudaError_t status =
              kernel.launch(pp, d_groups.data_as<int32_t>(), static_cast<int>(groups.size()) - 1, nullptr);
          if (kernel.launch != k::wgmma_prefill_attention) {
            EXPECT_EQ(status, cudaErrorInvalidValue) << kernel.name;
            break;
          }
          ASSERT_EQ(status, cudaSuccess);
          const Fp8Groups ref = cpu_fp8_groups(rows.data(), c.new_tokens, c.q_heads * c.dim, by_group);
          const std::vector<uint8_t> got = fp8.download(), got_scales = scales.download();
          EXPECT_EQ(std::memcmp(got.data(), ref.values.data(), got.size()), 0)
              << "E4M3 attention output, " << c.q_heads << " heads, prefix " << c.prefix << (by_group ? ", by group" : "");
          EXPECT_EQ(std::memcmp(got_scales.data(), ref.scales.data(), got_scales.size()), 0) << "scales";
        }
      }
    }
  }
}

TEST_F(CudaOps, RoutingPermutationAndGroupedGemm) {
  struct Case { int tokens, hidden, inter, experts, topk; bool renormalize; };
  for (const Case& c : {Case{13, 64, 32, 8, 2, true}, Case{5, 64, 48, 6, 3, false}, Case{16, 4096, 1536, 128, 8, true},
                        Case{300, 256, 64, 16, 4, true}, Case{70, 328, 200, 12, 3, true},
                        Case{700, 520, 392, 8, 4, true}}) {
    Host x = random_bf16({c.tokens, c.hidden}, rng_);
    Host logits = random_bf16({c.tokens, c.experts}, rng_, 3.0f);
    const float w_scale = 1.0f / std::sqrt(static_cast<float>(c.hidden));
    Host w13 = random_bf16({c.experts, 2 * c.inter, c.hidden}, rng_, w_scale);
    Host w2 = random_bf16({c.experts, c.hidden, c.inter}, rng_, 1.0f / std::sqrt(static_cast<float>(c.inter)));
    // CPU reference.
    Tensor ids(DType::kI32, {c.tokens, c.topk}), weights(DType::kF32, {c.tokens, c.topk}), ref(DType::kF32, {c.tokens, c.hidden});
    cpu::route_topk(pool_, logits.f32, c.topk, c.renormalize, ids, weights);
    cpu::moe_experts(pool_, x.f32, ids, weights, w13.bf16, w2.bf16, ref);
    // GPU.
    DeviceTensor d_x = upload(x.bf16), d_logits = upload(logits.f32), d_w13 = upload(w13.bf16), d_w2 = upload(w2.bf16);
    const int pairs = c.tokens * c.topk;
    Output d_ids = Output::make(pairs * 4), d_weights = Output::make(pairs * 4);
    ASSERT_EQ(k::route_topk({d_logits.data_as<float>(), d_ids.get<int32_t>(), d_weights.get<float>(), c.tokens, c.experts,
                             c.topk, c.renormalize}, nullptr), cudaSuccess);
    std::vector<uint8_t> got_ids = d_ids.download();
    EXPECT_EQ(std::memcmp(got_ids.data(), ids.data(), pairs * 4), 0) << "expert ids, " << c.experts << " experts";
    EXPECT_LT(scaled_error(as_floats(d_weights.download(), DType::kF32), weights.data_as<float>(), pairs), 1e-5);
    // Every grouped GEMM kernel: WMMA everywhere; on sm_90 the wgmma + TMA one
    // and the prefill one (128-row tiles, so its own permutation).
    using Gemm = cudaError_t (*)(const k::GroupedGemmParams&, cudaStream_t);
    struct Kernel {
      const char* name;
      Gemm gemm;
      int tile_rows;
      const char* cluster = nullptr;
    };
    std::vector<Kernel> gemms = {{"WMMA", k::mma_grouped_gemm, k::kGroupedGemmTileRows}};
    if (k::hopper_kernels_available()) {
      gemms.push_back({"wgmma", k::wgmma_grouped_gemm, k::kGroupedGemmTileRows});
      // The prefill kernel alone and as a CTA pair sharing its rows (an odd
      // column-tile count leaves the pair's second CTA idle on the last item;
      // experts whose last row tile has at most 64 rows run it split).
      for (const char* ctas : {"1", "2"})
        gemms.push_back({"wgmma prefill", k::wgmma_grouped_gemm_prefill, k::kPrefillGemmTileRows, ctas});
    }
    for (const auto& [name, gemm, tile_rows, cluster] : gemms) {
      const ScopedEnv pin("MOE_PREFILL_GEMM_CLUSTER", cluster);
      SCOPED_TRACE(std::string("cluster ") + (cluster != nullptr ? cluster : "default"));
      Output offsets = Output::make((c.experts + 1) * 4), tiles = Output::make((c.experts + 1) * 4);
      Output sorted = Output::make(pairs * 4), row_of = Output::make(pairs * 4);
      ASSERT_EQ(k::moe_permute({d_ids.get<int32_t>(), offsets.get<int32_t>(), tiles.get<int32_t>(), sorted.get<int32_t>(),
                                row_of.get<int32_t>(), c.tokens, c.topk, c.experts, tile_rows}, nullptr),
                cudaSuccess);
      const int max_tiles = (pairs + tile_rows - 1) / tile_rows + c.experts;
      Output act = Output::make(static_cast<size_t>(pairs) * c.inter * sizeof(bf16));
      Output rows = Output::make(static_cast<size_t>(pairs) * c.hidden * sizeof(float));
      Output out = Output::make(static_cast<size_t>(c.tokens) * c.hidden * sizeof(float));
      // The prefill kernel reads gate_up's rows permuted (gather_rows), the others through sorted_token.
      const bool gathered = tile_rows == k::kPrefillGemmTileRows;
      Output x_rows = Output::make(static_cast<size_t>(pairs) * c.hidden * sizeof(bf16));
      if (gathered) {
        ASSERT_EQ(k::gather_rows(
                      {d_x.data(), x_rows.get<void>(), sorted.get<int32_t>(), pairs, int64_t{c.hidden} * 2},
                      nullptr),
                  cudaSuccess);
      }
      ASSERT_EQ(
          gemm({gathered ? x_rows.get<bf16>() : d_x.data_as<bf16>(),
                gathered ? nullptr : sorted.get<int32_t>(), d_w13.data_as<bf16>(), offsets.get<int32_t>(),
                tiles.get<int32_t>(), act.get<void>(), c.inter, c.hidden, c.experts, max_tiles, true, pairs},
               nullptr),
          cudaSuccess)
          << name;
      ASSERT_EQ(
          gemm({act.get<bf16>(), nullptr, d_w2.data_as<bf16>(), offsets.get<int32_t>(), tiles.get<int32_t>(),
                rows.get<void>(), c.hidden, c.inter, c.experts, max_tiles, false, pairs},
               nullptr),
          cudaSuccess)
          << name;
      act.download();
      SCOPED_TRACE(moe_case(name, c.tokens, c.experts, c.hidden));
      expect_unpermuted(rows, out, row_of.get<int32_t>(), d_weights.get<float>(), c.tokens, c.topk, c.hidden,
                        ref.data_as<float>(), 2e-2, [&](void* bf16_rows) {
                          return gemm({act.get<bf16>(), nullptr, d_w2.data_as<bf16>(), offsets.get<int32_t>(),
                                       tiles.get<int32_t>(), bf16_rows, c.hidden, c.inter, c.experts,
                                       max_tiles, false, pairs, true},
                                      nullptr);
                        });
    }
  }
}
// moe_permute against the permutation's definition, on the one-block path
// (decode sizes) and the multi-block one (with its workspace), with and
// without expert parallelism: offsets are the prefix sums of the host's
// counts, every local pair gets one row of its expert holding its token.
TEST_F(CudaOps, MoePermuteGroupsPairsByExpert) {
  struct Case {
    int tokens, topk, experts, first_expert, local_experts, tile_rows;
  };
  for (const Case& c : {Case{64, 8, 128, 0, 128, 64}, Case{4096, 8, 128, 0, 128, 128}, Case{3001, 8, 128, 32, 32, 128},
                        Case{700, 6, 20, 0, 20, 64}, Case{40000, 8, 128, 0, 128, 128}}) {
    const int pairs = c.tokens * c.topk, blocks = k::moe_permute_blocks(pairs);
    SCOPED_TRACE(std::to_string(c.tokens) + " tokens x " + std::to_string(c.topk) + ", " + std::to_string(blocks) +
                 " blocks, experts " + std::to_string(c.first_expert) + "+" + std::to_string(c.local_experts));
    // Distinct experts per token, skewed towards the low ids (uneven counts).
    std::vector<int32_t> ids(static_cast<size_t>(pairs));
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    for (int t = 0; t < c.tokens; ++t)
      for (int j = 0; j < c.topk; ++j) {
        int e;
        do e = static_cast<int>(c.experts * u(rng_) * u(rng_));
        while (std::find(ids.begin() + int64_t{t} * c.topk, ids.begin() + int64_t{t} * c.topk + j, e) !=
               ids.begin() + int64_t{t} * c.topk + j);
        ids[int64_t{t} * c.topk + j] = e;
      }
    std::vector<int32_t> counts(c.local_experts, 0);
    for (int32_t e : ids)
      if (e >= c.first_expert && e < c.first_expert + c.local_experts) ++counts[e - c.first_expert];
    Tensor ids_t(DType::kI32, {pairs});
    std::memcpy(ids_t.data(), ids.data(), ids.size() * 4);
    DeviceTensor d_ids = upload(ids_t);
    Output offsets = Output::make((c.local_experts + 1) * 4), tiles = Output::make((c.local_experts + 1) * 4);
    Output sorted = Output::make(pairs * 4), row_of = Output::make(pairs * 4);
    Output workspace = Output::make(static_cast<size_t>(blocks) * c.local_experts * 4);
    ASSERT_EQ(k::moe_permute({d_ids.data_as<int32_t>(), offsets.get<int32_t>(), tiles.get<int32_t>(),
                              sorted.get<int32_t>(), row_of.get<int32_t>(), c.tokens, c.topk, c.local_experts,
                              c.tile_rows, c.first_expert, workspace.get<int32_t>()},
                             nullptr),
              cudaSuccess);
    auto ints = [](const Output& o) {
      const std::vector<uint8_t> bytes = o.download();
      std::vector<int32_t> v(bytes.size() / 4);
      std::memcpy(v.data(), bytes.data(), bytes.size());
      return v;
    };
    const std::vector<int32_t> got_offsets = ints(offsets), got_tiles = ints(tiles), got_sorted = ints(sorted),
                               got_row_of = ints(row_of);
    int32_t rows = 0, tile_count = 0;
    for (int e = 0; e <= c.local_experts; ++e) {
      ASSERT_EQ(got_offsets[e], rows) << "expert_offsets[" << e << "]";
      ASSERT_EQ(got_tiles[e], tile_count) << "tile_offsets[" << e << "]";
      if (e < c.local_experts) rows += counts[e], tile_count += (counts[e] + c.tile_rows - 1) / c.tile_rows;
    }
    std::vector<int> hits(static_cast<size_t>(rows), 0);
    for (int i = 0; i < pairs; ++i) {
      const int e = ids[i] - c.first_expert;
      if (e < 0 || e >= c.local_experts) {
        ASSERT_EQ(got_row_of[i], -1) << "pair " << i << " (another rank's expert)";
        continue;
      }
      const int row = got_row_of[i];
      ASSERT_TRUE(row >= got_offsets[e] && row < got_offsets[e + 1]) << "pair " << i << " row " << row;
      ASSERT_EQ(got_sorted[row], i / c.topk) << "row " << row;
      ++hits[row];
    }
    EXPECT_EQ(std::count(hits.begin(), hits.end(), 1), rows) << "every row taken once";
  }
}

TEST_F(CudaOps, ArgmaxTakesTheLowestIndexOnTies) {
  // A vocabulary of a multiple of 4 (float4 loads) and an odd one (scalar).
  for (const int vocab : {151936, 1001}) {
    const int rows = 4;
    std::vector<float> logits(static_cast<size_t>(rows) * vocab);
    std::uniform_real_distribution<float> u(-5, 5);
    for (auto& v : logits) v = u(rng_);
    logits[0 * vocab + 77] = 9, logits[0 * vocab + vocab - 3] = 9;
    logits[1 * vocab + vocab - 1] = 10;
    logits[2 * vocab + 0] = 11;
    logits[3 * vocab + 503] = 12, logits[3 * vocab + 501] = 12;  // a tie inside one group of 4
    DeviceTensor d = upload_vector(logits, DType::kF32);
    Output ids = Output::make(rows * 4);
    ASSERT_EQ(k::argmax({d.data_as<float>(), ids.get<int32_t>(), rows, vocab}, nullptr), cudaSuccess);
    auto got = ids.download();
    const int32_t* g = reinterpret_cast<const int32_t*>(got.data());
    EXPECT_EQ(g[0], 77) << "vocab " << vocab;
    EXPECT_EQ(g[1], vocab - 1) << "vocab " << vocab;
    EXPECT_EQ(g[2], 0) << "vocab " << vocab;
    EXPECT_EQ(g[3], 501) << "vocab " << vocab;
  }
}

}  // namespace
}  // namespace moe::ops
