// Each CUDA op against the CPU reference op on fresh random inputs, at small
// shapes and at Qwen3-235B's. Outputs are allocated with guard elements after
// them, filled with a sentinel that must survive, and checked for NaN.
// Tolerances: inputs are rounded to bf16 on both sides, so differences come
// from f32 summation order (1e-5) and from the bf16 rounding of outputs
// (2^-8 relative, ~4e-3); where the GPU rounds an intermediate to bf16 that
// the CPU keeps in f32 (MoE activations), 2e-2.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>

#include "core/cuda/device_buffer.h"
#include "ops/attention.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/kernels.h"
#include "ops/moe.h"
#include "ops/norm.h"
#include "ops/quant.h"
#include "ops/rope.h"

namespace moe::ops {
namespace {

namespace k = moe::ops::cuda;
using bf16 = __nv_bfloat16;
constexpr int kGuard = 64;
constexpr uint8_t kSentinel = 0xA5;

bool have_gpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

// Random values already on the bf16 grid, in f32 and bf16 copies.
struct Host {
  Tensor f32, bf16;
};
Host random_bf16(Shape shape, std::mt19937& rng, float scale = 1.0f) {
  Host h{Tensor(DType::kF32, shape), Tensor(DType::kBF16, shape)};
  std::uniform_real_distribution<float> u(-scale, scale);
  for (int64_t i = 0; i < h.f32.num_elements(); ++i) {
    const uint16_t b = float_to_bf16(u(rng));
    h.bf16.data_as<uint16_t>()[i] = b;
    h.f32.data_as<float>()[i] = bf16_to_float(b);
  }
  return h;
}

// A device output with guard bytes after it.
struct Output {
  DeviceBuffer buffer;
  size_t bytes = 0;
  static Output make(size_t bytes) {
    Output o;
    o.bytes = bytes;
    o.buffer = std::move(DeviceBuffer::allocate(bytes + kGuard).value());
    cudaMemset(o.buffer.data(), kSentinel, bytes + kGuard);
    return o;
  }
  template <typename T>
  T* get() const {
    return buffer.data_as<T>();
  }
  std::vector<uint8_t> download() const {
    std::vector<uint8_t> host(bytes + kGuard);
    EXPECT_EQ(cudaMemcpy(host.data(), buffer.data(), host.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    for (int i = 0; i < kGuard; ++i) EXPECT_EQ(host[bytes + i], kSentinel) << "guard byte " << i << " overwritten";
    host.resize(bytes);
    return host;
  }
};

DeviceTensor upload(const Tensor& t) { return std::move(DeviceTensor::upload(t.view()).value()); }
template <typename T>
DeviceTensor upload_vector(const std::vector<T>& v, DType dtype) {
  return upload(Tensor::copy_of(TensorView(const_cast<T*>(v.data()), dtype, {static_cast<int64_t>(v.size())})));
}

// max |a - b| / max |b| over all elements; NaN fails.
double scaled_error(const std::vector<float>& got, const float* ref, size_t n) {
  double max_diff = 0, max_ref = 1e-30;
  for (size_t i = 0; i < n; ++i) {
    EXPECT_FALSE(std::isnan(got[i])) << "NaN at " << i;
    max_diff = std::max(max_diff, std::fabs(double(got[i]) - ref[i]));
    max_ref = std::max(max_ref, std::fabs(double(ref[i])));
  }
  return max_diff / max_ref;
}

std::vector<float> as_floats(const std::vector<uint8_t>& bytes, DType dtype) {
  const size_t n = bytes.size() / (dtype == DType::kBF16 ? 2 : 4);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = load_as_float(dtype, bytes.data(), static_cast<int64_t>(i));
  return out;
}

// A down GEMM run with bf16_out must write its f32 rows rounded once (to
// nearest even), bit for bit; then the un-permute of those rows (bf16_rows)
// must match the reference as the f32 one does. `rerun` writes the bf16 rows
// into `bf16_rows` (as many rows as `f32_rows` holds).
template <typename Rerun>
void expect_bf16_rows(const std::vector<uint8_t>& f32_rows, const Output& bf16_rows, Rerun rerun,
                      const k::MoeUnpermuteParams& unpermute, const float* ref, double tolerance) {
  ASSERT_EQ(rerun(), cudaSuccess);
  const Output out =
      Output::make(static_cast<size_t>(unpermute.num_tokens) * unpermute.hidden * sizeof(float));
  k::MoeUnpermuteParams p = unpermute;
  p.rows = bf16_rows.get<void>(), p.bf16_rows = true, p.out = out.get<float>();
  ASSERT_EQ(k::moe_unpermute(p, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint8_t> got = bf16_rows.download();
  const size_t count = f32_rows.size() / 4;
  ASSERT_EQ(got.size(), count * 2);
  size_t mismatches = 0, first = count;
  for (size_t i = 0; i < count; ++i) {
    float f;
    uint16_t b;
    std::memcpy(&f, f32_rows.data() + 4 * i, 4);
    std::memcpy(&b, got.data() + 2 * i, 2);
    if (float_to_bf16(f) != b && ++mismatches == 1) first = i;
  }
  EXPECT_EQ(mismatches, 0u) << "bf16 rows differ from the rounded f32 rows, first at element " << first;
  EXPECT_LT(scaled_error(as_floats(out.download(), DType::kF32), ref,
                         static_cast<size_t>(unpermute.num_tokens) * unpermute.hidden),
            tolerance);
}

class CudaOps : public testing::Test {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  }
  std::mt19937 rng_{2026};
  ThreadPool pool_;
};

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
      // Splits: none (no workspace), chosen, and forced to 3.
      for (int split : {0, 1, 2})
        for (int stages : {2, 3, 4}) {
          Output mma_out = Output::make(static_cast<size_t>(c.new_tokens) * c.q_heads * c.dim * sizeof(bf16));
          k::PagedAttentionParams pm = params;
          pm.out = mma_out.get<bf16>();
          pm.decode_stages = stages;
          pm.decode_splits = split == 2 ? 3 : 0;
          ASSERT_EQ(k::mma_paged_attention(pm, max_position, split ? workspace->data_as<float>() : nullptr,
                                           split ? bytes : 0, nullptr), cudaSuccess);
          EXPECT_LT(scaled_error(as_floats(mma_out.download(), DType::kBF16), out.data_as<float>(), out.num_elements()),
                    2e-2)
              << "tensor-core attention (split " << split << ", " << stages << " stages), " << c.q_heads
              << " heads, prefix " << c.prefix;
        }
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
      }
    }
  }
}

// Pins the prefill grouped GEMMs' cluster size (MOE_PREFILL_GEMM_CLUSTER: 1
// or 2) for one scope; nullptr leaves the default.
struct PrefillCluster {
  explicit PrefillCluster(const char* ctas) : set(ctas != nullptr) {
    if (set) setenv("MOE_PREFILL_GEMM_CLUSTER", ctas, 1);
  }
  ~PrefillCluster() {
    if (set) unsetenv("MOE_PREFILL_GEMM_CLUSTER");
  }
  PrefillCluster(const PrefillCluster&) = delete;
  PrefillCluster& operator=(const PrefillCluster&) = delete;
  bool set;
};

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
      // column-tile count leaves the pair's second CTA idle on the last item).
      for (const char* ctas : {"1", "2"})
        gemms.push_back({"wgmma prefill", k::wgmma_grouped_gemm_prefill, k::kPrefillGemmTileRows, ctas});
    }
    for (const auto& [name, gemm, tile_rows, cluster] : gemms) {
      const PrefillCluster pin(cluster);
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
      const k::MoeUnpermuteParams unpermute{rows.get<float>(),
                                            row_of.get<int32_t>(),
                                            d_weights.get<float>(),
                                            out.get<float>(),
                                            c.tokens,
                                            c.topk,
                                            c.hidden};
      ASSERT_EQ(k::moe_unpermute(unpermute, nullptr), cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << name;
      act.download();
      const std::vector<uint8_t> f32_rows = rows.download();
      EXPECT_LT(scaled_error(as_floats(out.download(), DType::kF32), ref.data_as<float>(), ref.num_elements()), 2e-2)
          << name << ": " << c.tokens << " tokens, " << c.experts << " experts, hidden " << c.hidden;
      SCOPED_TRACE(std::string(name) + ", bf16 rows");
      const Output rows_bf16 = Output::make(static_cast<size_t>(pairs) * c.hidden * sizeof(bf16));
      expect_bf16_rows(
          f32_rows, rows_bf16,
          [&] {
            return gemm(
                {act.get<bf16>(), nullptr, d_w2.data_as<bf16>(), offsets.get<int32_t>(), tiles.get<int32_t>(),
                 rows_bf16.get<void>(), c.hidden, c.inter, c.experts, max_tiles, false, pairs, true},
                nullptr);
          },
          unpermute, ref.data_as<float>(), 2e-2);
    }
  }
}

// FP8 block scaling: quantized x and act (quantize_fp8_groups), E4M3 experts
// with 128 x 128 weight scales, against the CPU's quantized MoE (which
// quantizes the activations the same way). Qwen3-235B's expert shapes with 8
// experts: quantizing all 128 on the host takes minutes.
TEST_F(CudaOps, Fp8GroupedGemmMatchesTheCpuQuantizedMoe) {
  if (!k::hopper_kernels_available()) GTEST_SKIP() << "the FP8 grouped GEMM needs an sm_90 device";
  struct Case { int tokens, hidden, inter, experts, topk; };
  for (const Case& c : {Case{16, 4096, 1536, 8, 4}, Case{300, 256, 128, 16, 4}, Case{37, 384, 192, 6, 2},
                        Case{640, 512, 384, 8, 4}}) {
    Host x = random_bf16({c.tokens, c.hidden}, rng_);
    Host logits = random_bf16({c.tokens, c.experts}, rng_, 3.0f);
    // Quantized expert weights (fp8-block; w13's gate and up halves have their own block rows).
    auto quantized = [&](int64_t rows, int64_t cols, int64_t period, float scale) {
      struct Q { Tensor values, scales; QuantizedTensor view; };
      Q q;
      const Shape per = quant_scale_shape(QuantFormat::kFp8Block, rows, cols, period);
      q.values = Tensor(DType::kF8E4M3, {int64_t{c.experts}, rows, cols});
      q.scales = Tensor(DType::kF32, {int64_t{c.experts}, per[0], per[1]});
      q.view = QuantizedTensor{QuantFormat::kFp8Block, q.values.view(), q.scales.view(), TensorView(), period};
      for (int e = 0; e < c.experts; ++e) {
        Host w = random_bf16({rows, cols}, rng_, scale);
        quantize_matrix(w.f32.data_as<float>(), q.view.slice0(e));
      }
      return q;
    };
    auto q13 = quantized(2 * c.inter, c.hidden, c.inter, 1.0f / std::sqrt(static_cast<float>(c.hidden)));
    auto q2 = quantized(c.hidden, c.inter, 0, 1.0f / std::sqrt(static_cast<float>(c.inter)));
    Tensor ids(DType::kI32, {c.tokens, c.topk}), weights(DType::kF32, {c.tokens, c.topk}), ref(DType::kF32, {c.tokens, c.hidden});
    cpu::route_topk(pool_, logits.f32, c.topk, true, ids, weights);
    cpu::moe_experts(pool_, x.f32, ids, weights, q13.view, q2.view, ref);

    const int pairs = c.tokens * c.topk;
    DeviceTensor d_x = upload(x.bf16), d_ids = upload(ids), d_weights = upload(weights);
    DeviceTensor d_w13 = upload(q13.values), d_s13 = upload(q13.scales), d_w2 = upload(q2.values), d_s2 = upload(q2.scales);
    const int hidden_groups = (c.hidden + 127) / 128, inter_groups = (c.inter + 127) / 128;
    Output x_q = Output::make(static_cast<size_t>(c.tokens) * c.hidden), x_s = Output::make(c.tokens * hidden_groups * 4);
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
      const PrefillCluster pin(cluster);
      SCOPED_TRACE(std::string("cluster ") + (cluster != nullptr ? cluster : "default"));
      Output offsets = Output::make((c.experts + 1) * 4), tiles = Output::make((c.experts + 1) * 4);
      Output sorted = Output::make(pairs * 4), row_of = Output::make(pairs * 4);
      Output act = Output::make(static_cast<size_t>(pairs) * c.inter * sizeof(bf16));
      Output act_q = Output::make(static_cast<size_t>(pairs) * c.inter), act_s = Output::make(pairs * inter_groups * 4);
      Output rows = Output::make(static_cast<size_t>(pairs) * c.hidden * sizeof(float));
      Output out = Output::make(static_cast<size_t>(c.tokens) * c.hidden * sizeof(float));
      const int max_tiles = (pairs + tile_rows - 1) / tile_rows + c.experts;
      ASSERT_EQ(k::quantize_fp8_groups({d_x.data_as<bf16>(), x_q.get<uint8_t>(), x_s.get<float>(), c.tokens, c.hidden},
                                       nullptr), cudaSuccess);
      ASSERT_EQ(k::moe_permute({d_ids.data_as<int32_t>(), offsets.get<int32_t>(), tiles.get<int32_t>(), sorted.get<int32_t>(),
                                row_of.get<int32_t>(), c.tokens, c.topk, c.experts, tile_rows}, nullptr),
                cudaSuccess);
      // The prefill kernel reads gate_up's rows and scales permuted (gather_rows).
      const bool gathered = tile_rows == k::kPrefillGemmTileRows;
      Output xg_q = Output::make(static_cast<size_t>(pairs) * c.hidden),
             xg_s = Output::make(pairs * hidden_groups * 4);
      if (gathered) {
        ASSERT_EQ(k::gather_rows({x_q.get<void>(), xg_q.get<void>(), sorted.get<int32_t>(), pairs, c.hidden},
                                 nullptr),
                  cudaSuccess);
        ASSERT_EQ(k::gather_rows(
                      {x_s.get<void>(), xg_s.get<void>(), sorted.get<int32_t>(), pairs, hidden_groups * 4},
                      nullptr),
                  cudaSuccess);
      }
      ASSERT_EQ(gemm({gathered ? xg_q.get<uint8_t>() : x_q.get<uint8_t>(),
                      gathered ? xg_s.get<float>() : x_s.get<float>(),
                      gathered ? nullptr : sorted.get<int32_t>(), d_w13.data_as<uint8_t>(),
                      d_s13.data_as<float>(), offsets.get<int32_t>(), tiles.get<int32_t>(), act.get<void>(),
                      c.inter, c.hidden, c.experts, max_tiles, true, 1, pairs},
                     nullptr),
                cudaSuccess);
      ASSERT_EQ(k::quantize_fp8_groups({act.get<bf16>(), act_q.get<uint8_t>(), act_s.get<float>(), pairs, c.inter}, nullptr),
                cudaSuccess);
      ASSERT_EQ(gemm({act_q.get<uint8_t>(), act_s.get<float>(), nullptr, d_w2.data_as<uint8_t>(),
                      d_s2.data_as<float>(), offsets.get<int32_t>(), tiles.get<int32_t>(), rows.get<void>(),
                      c.hidden, c.inter, c.experts, max_tiles, false, 1, pairs},
                     nullptr),
                cudaSuccess);
      const k::MoeUnpermuteParams unpermute{rows.get<float>(),
                                            row_of.get<int32_t>(),
                                            d_weights.data_as<float>(),
                                            out.get<float>(),
                                            c.tokens,
                                            c.topk,
                                            c.hidden};
      ASSERT_EQ(k::moe_unpermute(unpermute, nullptr), cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << name;
      x_q.download();
      act_q.download();
      EXPECT_LT(scaled_error(as_floats(out.download(), DType::kF32), ref.data_as<float>(), ref.num_elements()), 3e-2)
          << name << ": " << c.tokens << " tokens, " << c.experts << " experts, hidden " << c.hidden << ", inter " << c.inter;
      SCOPED_TRACE(std::string(name) + ", bf16 rows");
      const Output rows_bf16 = Output::make(static_cast<size_t>(pairs) * c.hidden * sizeof(bf16));
      expect_bf16_rows(
          rows.download(), rows_bf16,
          [&] {
            return gemm(
                {act_q.get<uint8_t>(), act_s.get<float>(), nullptr, d_w2.data_as<uint8_t>(),
                 d_s2.data_as<float>(), offsets.get<int32_t>(), tiles.get<int32_t>(), rows_bf16.get<void>(),
                 c.hidden, c.inter, c.experts, max_tiles, false, 1, pairs, true},
                nullptr);
          },
          unpermute, ref.data_as<float>(), 3e-2);
    }
  }
}

// A dense projection through the FP8 grouped GEMMs as one group (the CUDA
// model's FP8 attention projections): at decode sizes the few tiles are split
// along K (k_splits from fp8_gemm_k_splits, adding into a zeroed output),
// which must give what one item per tile gives and what the CPU's quantized
// linear gives, for fp8-block and MXFP8 weights.
TEST_F(CudaOps, Fp8DenseProjectionSplitAlongKMatchesTheCpu) {
  if (!k::hopper_kernels_available()) GTEST_SKIP() << "the FP8 grouped GEMM needs an sm_90 device";
  struct Case { int tokens, N, K; };
  for (const QuantFormat format : {QuantFormat::kFp8Block, QuantFormat::kMxfp8}) {
    const bool mx = format == QuantFormat::kMxfp8;
    // N 1000 ends in a part chunk of 16-byte atomics, N 998 takes scalar ones;
    // 256 x 9216 (qkv at batch 256) has more tiles than an H200 has SMs.
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
        ASSERT_EQ(k::quantize_mxfp8({d_x.data_as<bf16>(), x_q.get<uint8_t>(), x_s.get<uint8_t>(), c.tokens, c.K}, nullptr),
                  cudaSuccess);
      } else {
        ASSERT_EQ(k::quantize_fp8_groups({d_x.data_as<bf16>(), x_q.get<uint8_t>(), x_s.get<float>(), c.tokens, c.K},
                                         nullptr), cudaSuccess);
      }
      std::vector<std::vector<float>> outs;
      for (const int k_splits : {1, splits}) {
        Output out = Output::make(static_cast<size_t>(c.tokens) * c.N * sizeof(float));
        ASSERT_EQ(cudaMemset(out.get<void>(), 0, static_cast<size_t>(c.tokens) * c.N * sizeof(float)), cudaSuccess);
        const cudaError_t launched =
            mx ? k::mxfp8_grouped_gemm({x_q.get<uint8_t>(), x_s.get<uint8_t>(), nullptr, d_w.data_as<uint8_t>(),
                                        d_s.data_as<uint8_t>(), offsets.data_as<int32_t>(), tiles.data_as<int32_t>(),
                                        out.get<void>(), c.N, c.K, 1, row_tiles + 1, false, k_splits}, nullptr)
               : k::fp8_grouped_gemm({x_q.get<uint8_t>(), x_s.get<float>(), nullptr, d_w.data_as<uint8_t>(),
                                      d_s.data_as<float>(), offsets.data_as<int32_t>(), tiles.data_as<int32_t>(),
                                      out.get<void>(), c.N, c.K, 1, row_tiles + 1, false, k_splits}, nullptr);
        ASSERT_EQ(launched, cudaSuccess);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        outs.push_back(as_floats(out.download(), DType::kF32));
        EXPECT_LT(scaled_error(outs.back(), ref.data_as<float>(), ref.num_elements()), 2e-2)
            << quant_format_name(format) << ", " << c.tokens << " x " << c.N << " x " << c.K << ", k_splits " << k_splits;
      }
      EXPECT_LT(scaled_error(outs[1], outs[0].data(), static_cast<int64_t>(outs[0].size())), 1e-5)
          << "split along K (" << splits << ") against one item per tile";
      // Split shares add up in f32: bf16 rows with k_splits > 1 are refused.
      Output bf16_out = Output::make(static_cast<size_t>(c.tokens) * c.N * sizeof(bf16));
      EXPECT_EQ(mx ? k::mxfp8_grouped_gemm(
                         {x_q.get<uint8_t>(), x_s.get<uint8_t>(), nullptr, d_w.data_as<uint8_t>(),
                          d_s.data_as<uint8_t>(), offsets.data_as<int32_t>(), tiles.data_as<int32_t>(),
                          bf16_out.get<void>(), c.N, c.K, 1, row_tiles + 1, false, splits, true},
                         nullptr)
                   : k::fp8_grouped_gemm(
                         {x_q.get<uint8_t>(), x_s.get<float>(), nullptr, d_w.data_as<uint8_t>(),
                          d_s.data_as<float>(), offsets.data_as<int32_t>(), tiles.data_as<int32_t>(),
                          bf16_out.get<void>(), c.N, c.K, 1, row_tiles + 1, false, splits, 0, true},
                         nullptr),
                cudaErrorInvalidValue);
      if (row_tiles == 1)
        EXPECT_GT(splits, 1) << c.N << " x " << c.K << " has too few tiles to fill the GPU unsplit";
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
      if (c.tokens % 8 == 0) EXPECT_TRUE(offered) << "cuBLASLt offers no fp8-block algorithm";
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

TEST_F(CudaOps, QuantizeMxfp8MatchesTheCpuQuantizer) {
  const int rows = 37, cols = 328;  // 10 full groups and one of 8
  Host x = random_bf16({rows, cols}, rng_, 3.0f);
  for (int c = 32; c < 64; ++c) x.f32.data_as<float>()[c] = 0.0f, x.bf16.data_as<uint16_t>()[c] = 0;  // an all-zero group
  for (int c = 0; c < cols; ++c) {  // a row of tiny values: scales far below 1
    x.f32.data_as<float>()[cols + c] = bf16_to_float(float_to_bf16(1e-30f * (1 + c % 5)));
    x.bf16.data_as<uint16_t>()[cols + c] = float_to_bf16(x.f32.data_as<float>()[cols + c]);
  }
  const int groups = (cols + 31) / 32;
  Tensor values(DType::kF8E4M3, {rows, cols}), scales(DType::kE8M0, {rows, groups});
  quantize_matrix(x.f32.data_as<float>(), QuantizedTensor{QuantFormat::kMxfp8, values.view(), scales.view(), TensorView(), 0});
  DeviceTensor d_x = upload(x.bf16);
  Output out = Output::make(static_cast<size_t>(rows) * cols), out_scales = Output::make(static_cast<size_t>(rows) * groups);
  ASSERT_EQ(k::quantize_mxfp8({d_x.data_as<bf16>(), out.get<uint8_t>(), out_scales.get<uint8_t>(), rows, cols}, nullptr),
            cudaSuccess);
  const std::vector<uint8_t> got = out.download(), got_scales = out_scales.download();
  EXPECT_EQ(std::memcmp(got_scales.data(), scales.data(), got_scales.size()), 0) << "E8M0 scales";
  EXPECT_EQ(std::memcmp(got.data(), values.data(), got.size()), 0) << "E4M3 values";
}

// MXFP8 experts (weights and activations per 1 x 32, E8M0 scales) through one
// MXFP8 grouped GEMM kernel against the CPU's quantized MoE.
using Mxfp8Gemm = cudaError_t (*)(const k::Mxfp8GroupedGemmParams&, cudaStream_t);
void expect_mxfp8_moe_matches_cpu(Mxfp8Gemm gemm, const char* name, std::mt19937& rng, ThreadPool& pool) {
  struct Case { int tokens, hidden, inter, experts, topk; };
  for (const Case& c : {Case{16, 4096, 1536, 8, 4}, Case{300, 256, 128, 16, 4}, Case{37, 384, 640, 6, 2}}) {
    Host x = random_bf16({c.tokens, c.hidden}, rng);
    Host logits = random_bf16({c.tokens, c.experts}, rng, 3.0f);
    auto quantized = [&](int64_t rows, int64_t cols, float scale) {
      struct Q { Tensor values, scales; QuantizedTensor view; };
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
    Tensor ids(DType::kI32, {c.tokens, c.topk}), weights(DType::kF32, {c.tokens, c.topk}), ref(DType::kF32, {c.tokens, c.hidden});
    cpu::route_topk(pool, logits.f32, c.topk, true, ids, weights);
    cpu::moe_experts(pool, x.f32, ids, weights, q13.view, q2.view, ref);

    const int pairs = c.tokens * c.topk;
    DeviceTensor d_x = upload(x.bf16), d_ids = upload(ids), d_weights = upload(weights);
    DeviceTensor d_w13 = upload(q13.values), d_s13 = upload(q13.scales), d_w2 = upload(q2.values), d_s2 = upload(q2.scales);
    Output x_q = Output::make(static_cast<size_t>(c.tokens) * c.hidden), x_s = Output::make(c.tokens * c.hidden / 32);
    Output offsets = Output::make((c.experts + 1) * 4), tiles = Output::make((c.experts + 1) * 4);
    Output sorted = Output::make(pairs * 4), row_of = Output::make(pairs * 4);
    Output act = Output::make(static_cast<size_t>(pairs) * c.inter * sizeof(bf16));
    Output act_q = Output::make(static_cast<size_t>(pairs) * c.inter), act_s = Output::make(pairs * c.inter / 32);
    Output rows = Output::make(static_cast<size_t>(pairs) * c.hidden * sizeof(float));
    Output out = Output::make(static_cast<size_t>(c.tokens) * c.hidden * sizeof(float));
    const int max_tiles = (pairs + k::kGroupedGemmTileRows - 1) / k::kGroupedGemmTileRows + c.experts;
    ASSERT_EQ(k::quantize_mxfp8({d_x.data_as<bf16>(), x_q.get<uint8_t>(), x_s.get<uint8_t>(), c.tokens, c.hidden}, nullptr),
              cudaSuccess);
    ASSERT_EQ(k::moe_permute({d_ids.data_as<int32_t>(), offsets.get<int32_t>(), tiles.get<int32_t>(), sorted.get<int32_t>(),
                              row_of.get<int32_t>(), c.tokens, c.topk, c.experts, k::kGroupedGemmTileRows}, nullptr),
              cudaSuccess);
    ASSERT_EQ(gemm({x_q.get<uint8_t>(), x_s.get<uint8_t>(), sorted.get<int32_t>(), d_w13.data_as<uint8_t>(),
                    d_s13.data_as<uint8_t>(), offsets.get<int32_t>(), tiles.get<int32_t>(), act.get<void>(), c.inter,
                    c.hidden, c.experts, max_tiles, true}, nullptr), cudaSuccess) << name;
    ASSERT_EQ(k::quantize_mxfp8({act.get<bf16>(), act_q.get<uint8_t>(), act_s.get<uint8_t>(), pairs, c.inter}, nullptr),
              cudaSuccess);
    ASSERT_EQ(gemm({act_q.get<uint8_t>(), act_s.get<uint8_t>(), nullptr, d_w2.data_as<uint8_t>(),
                    d_s2.data_as<uint8_t>(), offsets.get<int32_t>(), tiles.get<int32_t>(), rows.get<void>(), c.hidden,
                    c.inter, c.experts, max_tiles, false}, nullptr), cudaSuccess) << name;
    const k::MoeUnpermuteParams unpermute{rows.get<float>(),
                                          row_of.get<int32_t>(),
                                          d_weights.data_as<float>(),
                                          out.get<float>(),
                                          c.tokens,
                                          c.topk,
                                          c.hidden};
    ASSERT_EQ(k::moe_unpermute(unpermute, nullptr), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << name;
    x_q.download();
    act_q.download();
    EXPECT_LT(scaled_error(as_floats(out.download(), DType::kF32), ref.data_as<float>(), ref.num_elements()), 3e-2)
        << name << ": " << c.tokens << " tokens, " << c.experts << " experts, hidden " << c.hidden << ", inter " << c.inter;
    SCOPED_TRACE(std::string(name) + ", bf16 rows");
    const Output rows_bf16 = Output::make(static_cast<size_t>(pairs) * c.hidden * sizeof(bf16));
    expect_bf16_rows(
        rows.download(), rows_bf16,
        [&] {
          return gemm({act_q.get<uint8_t>(), act_s.get<uint8_t>(), nullptr, d_w2.data_as<uint8_t>(),
                       d_s2.data_as<uint8_t>(), offsets.get<int32_t>(), tiles.get<int32_t>(),
                       rows_bf16.get<void>(), c.hidden, c.inter, c.experts, max_tiles, false, 1, true},
                      nullptr);
        },
        unpermute, ref.data_as<float>(), 3e-2);
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
