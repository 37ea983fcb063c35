// CUDA kernels of the Qwen3-MoE forward pass. Launchers take raw device
// pointers, a params struct (the layout as shape comments) and a stream, and
// return cudaError_t (the launch's error; kernels never synchronise).
//
// Dtypes on the GPU: bf16 weights and GEMM inputs, f32 residual stream and
// GEMM outputs that feed it, fp32 accumulation everywhere. Each kernel has the
// CPU op of the same name in src/ops/*.h as its reference.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <span>
#include <vector>

#include "ops/logit_adjust.h"

namespace moe::ops::cuda {

using bf16 = __nv_bfloat16;

// out[t, :] = float(table[ids[t], :]).
struct EmbeddingParams {
  const bf16* table;   // [vocab, hidden]
  const int32_t* ids;  // [num_tokens]
  float* out;          // [num_tokens, hidden]
  int num_tokens, hidden, vocab;
};
cudaError_t embedding(const EmbeddingParams& p, cudaStream_t stream);

// residual += delta (when delta is set); out = bf16(rms_norm(residual) * weight).
struct AddRmsNormParams {
  float* residual;     // [num_tokens, hidden]
  const float* delta;  // [num_tokens, hidden] or nullptr
  const bf16* weight;  // [hidden]
  bf16* out;           // [num_tokens, hidden]
  int num_tokens, hidden;
  float eps;
  // Optional (add_rms_norm_fuses(hidden)): `out` quantized as well, the
  // bytes and scales quantize_fp8_groups makes of it (QuantizeFp8Params).
  uint8_t* out_fp8 = nullptr;  // [num_tokens, hidden] E4M3
  float* out_scales = nullptr;
  bool scales_by_group = false;
  // Optional (add_rms_norm_fuses(hidden)), instead of `delta`: the MoE
  // output, delta[t] = sum over j of expert_weights[t, j] * expert_rows[row_of[t, j]]
  // as moe_unpermute sums it (bf16 rows; row -1: no term).
  const bf16* expert_rows = nullptr;  // [*, hidden]
  const int32_t* row_of = nullptr;    // [num_tokens, k]
  const float* expert_weights = nullptr;
  int k = 0;
};
cudaError_t add_rms_norm(const AddRmsNormParams& p, cudaStream_t stream);
// Whether add_rms_norm takes the optional fields above (the one-pass kernel:
// hidden a multiple of 128, at most 8192).
bool add_rms_norm_fuses(int hidden);

// Per head of the fused qkv projection: q and k RMS-normed (q_norm, k_norm)
// and rotated (RoPE, rotate-half), q written to q_out, k and v stored in the
// sequence's KV page at the token's position.
struct QkNormRopeKvParams {
  const bf16* qkv;           // [num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim]
  const bf16* q_norm;        // [head_dim]
  const bf16* k_norm;        // [head_dim]
  const float* inv_freq;     // [head_dim / 2]
  float attention_factor;    // multiplies cos and sin (YaRN), else 1
  const int32_t* positions;  // [num_tokens]
  const int32_t* token_seq;  // [num_tokens] sequence index of each token
  const int32_t* page_table; // [num_seqs, max_pages_per_seq]
  bf16* q_out;               // [num_tokens, num_q_heads, head_dim]
  bf16* k_pages;             // [num_pages, num_kv_heads, page_size, head_dim]
  bf16* v_pages;             // same
  int num_tokens, num_q_heads, num_kv_heads, head_dim, page_size, max_pages_per_seq;
  float eps;
};
cudaError_t qk_norm_rope_kv(const QkNormRopeKvParams& p, cudaStream_t stream);

// Causal GQA attention of each new token over its sequence's positions 0..p
// in the paged cache (prefill, chunked prefill and decode alike).
struct PagedAttentionParams {
  const bf16* q;              // [num_tokens, num_q_heads, head_dim]
  const bf16* k_pages;        // [num_pages, num_kv_heads, page_size, head_dim]
  const bf16* v_pages;        // same
  const int32_t* positions;   // [num_tokens]
  const int32_t* token_seq;   // [num_tokens]
  const int32_t* page_table;  // [num_seqs, max_pages_per_seq]
  bf16* out;                  // [num_tokens, num_q_heads * head_dim]
  int num_tokens, num_q_heads, num_kv_heads, head_dim, page_size, max_pages_per_seq;
  float scale;
  // mma_paged_attention: K/V chunks each warp has in shared memory (2 to 4;
  // 0: 3, see attention_mma.cu), and the number of splits of the positions
  // (0: chosen from the grid; at most what the workspace holds).
  int decode_stages = 0;
  int decode_splits = 0;
  // Optional (mma_paged_attention, and prefill_attention where
  // prefill_attention_quantizes()): the output in E4M3 instead of bf16 `out`,
  // each (token, head) one 1 x 128 group: the bytes and scales
  // quantize_fp8_groups makes of the bf16 rows, scales [num_tokens,
  // num_q_heads] or (scales_by_group) [num_q_heads, num_tokens]. The other
  // kernels refuse it.
  uint8_t* out_fp8 = nullptr;
  float* out_scales = nullptr;
  bool scales_by_group = false;
  // The pages k_pages / v_pages hold. mma_paged_attention's decode kernel
  // needs it to copy whole K/V chunks with tensor copies on sm_90 (page_size
  // a multiple of 16); 0: it copies them with cp.async.
  int num_pages = 0;
};
// head_dim <= 128 and num_q_heads / num_kv_heads <= 16.
cudaError_t paged_attention(const PagedAttentionParams& p, cudaStream_t stream);

// The tensor-core version of paged_attention for head_dim 128 and up to 16 q
// heads per kv head (attention_mma.cu), splitting long contexts over blocks.
// max_position: the largest position in the batch (sizes the split grid);
// workspace: f32 scratch of mma_attention_workspace_bytes(...) (may be null:
// then no splitting).
bool mma_attention_supported(const PagedAttentionParams& p);
size_t mma_attention_workspace_bytes(int num_tokens, int num_q_heads, int max_position);
cudaError_t mma_paged_attention(const PagedAttentionParams& p, int max_position, float* workspace,
                                size_t workspace_bytes, cudaStream_t stream);

// Prefill on the tensor cores: groups of consecutive tokens of one sequence
// share each K/V block. group_start [num_groups + 1] comes from
// prefill_token_groups(query_start, prefill_group_tokens(...)) (host),
// uploaded by the caller. prefill_attention runs the wgmma kernel on sm_90
// (attention_wgmma.cu: 128 query rows per block) and the mma.sync kernel
// elsewhere (attention_mma.cu: 8 tokens per block); both need
// mma_attention_supported(p).
int prefill_group_tokens(int num_q_heads, int num_kv_heads);
std::vector<int32_t> prefill_token_groups(std::span<const int32_t> query_start, int group_tokens);
cudaError_t prefill_attention(const PagedAttentionParams& p, const int32_t* group_start, int num_groups,
                              cudaStream_t stream);
// Whether prefill_attention can write its output in FP8 (out_fp8): the wgmma kernel's.
bool prefill_attention_quantizes();
// The two kernels, for tests and benchmarks; each with its own group size.
inline constexpr int kMmaPrefillGroupTokens = 8;
cudaError_t mma_prefill_attention(const PagedAttentionParams& p, const int32_t* group_start, int num_groups,
                                  cudaStream_t stream);
int wgmma_prefill_group_tokens(int num_q_heads, int num_kv_heads);
// cudaErrorNotSupported unless hopper_kernels_available().
cudaError_t wgmma_prefill_attention(const PagedAttentionParams& p, const int32_t* group_start, int num_groups,
                                    cudaStream_t stream);
// True on an sm_90 device (the wgmma kernels were compiled for sm_90a).
bool hopper_kernels_available();
// The current device's SMs (the persistent kernels' grid size).
int multiprocessor_count();

// Router: softmax over experts, top-k (ties: lower expert first), optional renormalisation.
struct RouteTopkParams {
  const float* logits;  // [num_tokens, num_experts]
  int32_t* expert_ids;  // [num_tokens, k]
  float* weights;       // [num_tokens, k]
  int num_tokens, num_experts, k;
  bool renormalize;
};
// num_experts <= 256, k <= num_experts.
cudaError_t route_topk(const RouteTopkParams& p, cudaStream_t stream);

// Groups the (token, slot) pairs by expert without any host synchronisation:
// expert e owns rows [expert_offsets[e], expert_offsets[e+1]) of the permuted
// order, sorted_token[row] is the token of a row, row_of[t * k + j] the row of
// pair (t, j), and tile_offsets[e] counts the grouped GEMM's row tiles before e.
// Expert parallelism: only experts [first_expert, first_expert + num_experts)
// of the (global) expert_ids are this rank's, local expert e being global
// first_expert + e; pairs routed elsewhere get no row and row_of -1.
struct MoePermuteParams {
  const int32_t* expert_ids;  // [num_tokens, k] global ids
  int32_t* expert_offsets;    // [num_experts + 1]
  int32_t* tile_offsets;      // [num_experts + 1]
  int32_t* sorted_token;      // [num_tokens * k]
  int32_t* row_of;            // [num_tokens * k]
  int num_tokens, k, num_experts, tile_rows;
  int first_expert = 0;
  // Optional workspace [moe_permute_blocks(num_tokens * k), num_experts]:
  // prefill sizes then take several blocks (else one).
  int32_t* block_counts = nullptr;
};
cudaError_t moe_permute(const MoePermuteParams& p, cudaStream_t stream);
int moe_permute_blocks(int pairs);

// Grouped GEMM over experts. For permuted row r of expert e:
//   gate_up: act[r, n] = bf16(silu(x[tok] . w[e, n]) * (x[tok] . w[e, inter + n])),
//            tok = sorted_token[r], w = w13 [num_experts, 2 * inter, hidden]
//   down:    out[r, n] = a[r] . w[e, n], w = w2 [num_experts, hidden, inter], out f32
//            (bf16 with bf16_out)
struct GroupedGemmParams {
  const bf16* a;               // gate_up: x [num_tokens, K]; down: act [num_rows, K]
  const int32_t* sorted_token; // gate_up only: row -> token of x
  const bf16* w;               // [num_experts, N_total, K]
  const int32_t* expert_offsets;
  const int32_t* tile_offsets;
  void* out;                   // gate_up: bf16 [num_rows, N]; down: f32 [num_rows, N]
  int N, K, num_experts, max_tiles;
  bool gate_up;
  // The *_prefill kernels: rows of `a` (read by TMA, which zero-fills past
  // them), given in permuted order for gate_up too (sorted_token null).
  int a_rows = 0;
  // down: `out` holds bf16 rows, each the f32 result rounded once (what the
  // MoE layer sums; half the bytes of f32 to write and to read back).
  bool bf16_out = false;
};
inline constexpr int kGroupedGemmTileRows = 64;
// K must be a multiple of 8. grouped_gemm runs the wgmma kernel on sm_90
// (grouped_gemm_wgmma.cu: TMA weight streaming, a persistent grid) and the
// WMMA kernel elsewhere (moe.cu); both are exposed for tests and benchmarks,
// the wgmma one returning cudaErrorNotSupported unless hopper_kernels_available().
cudaError_t grouped_gemm(const GroupedGemmParams& p, cudaStream_t stream);
cudaError_t mma_grouped_gemm(const GroupedGemmParams& p, cudaStream_t stream);
cudaError_t wgmma_grouped_gemm(const GroupedGemmParams& p, cudaStream_t stream);

// FP8 block scaling (fp8-block, ops/quant.h): E4M3 activations with one f32
// scale per row and 128 columns: out[r, c] = e4m3(in[r, c] / s), s =
// max(amax of the group, 1e-10) / 448.
struct QuantizeFp8Params {
  const bf16* in;   // [rows, cols]
  uint8_t* out;     // [rows, cols] E4M3
  float* scales;    // [rows, ceil(cols / 128)] or nullptr
  int rows, cols;
  bf16* dequantized = nullptr;  // optional [rows, cols]: bf16(out * scale), may be `in` (in place)
  // Optional, on the device: only the first min(rows, *live_rows) rows are
  // quantized (rows a grouped GEMM wrote, counted on the device).
  const int32_t* live_rows = nullptr;
  // Scales laid out [ceil(cols / 128), rows] instead (a group's rows
  // contiguous: cuBLASLt's 1 x 128 block scaling, Gemm::matmul_fp8_block).
  bool scales_by_group = false;
};
cudaError_t quantize_fp8_groups(const QuantizeFp8Params& p, cudaStream_t stream);

// The grouped GEMM of GroupedGemmParams with E4M3 weights (one f32 scale per
// 128 x 128 block; gate_up's gate and up halves have their own block rows,
// ceil(N / 128) each) and E4M3 activations (a_scales from
// quantize_fp8_groups): sm_90 only (grouped_gemm_fp8.cu), K a multiple of 16.
struct Fp8GroupedGemmParams {
  const uint8_t* a;              // gate_up: x [num_tokens, K]; down: act [num_rows, K]
  const float* a_scales;         // [.., ceil(K / 128)]
  const int32_t* sorted_token;   // gate_up only
  const uint8_t* w;              // [num_experts, N_total, K]
  const float* w_scales;         // [num_experts, N_total blocks, ceil(K / 128)]
  const int32_t* expert_offsets;
  const int32_t* tile_offsets;
  void* out;                     // gate_up: bf16 [num_rows, N]; down: f32 [num_rows, N]
  int N, K, num_experts, max_tiles;
  bool gate_up;
  // Down only: each tile's K-steps split over this many items that add their
  // shares into `out` (atomically), which the caller must have zeroed. For
  // GEMMs with too few tiles to fill the GPU (a dense projection at decode
  // sizes); fp8_gemm_k_splits picks it. Not used by the *_prefill kernels.
  int k_splits = 1;
  // Rows of `a`: the *_prefill kernels, as in GroupedGemmParams; given to
  // fp8_grouped_gemm (fp8-block) with contiguous rows (down, a dense
  // projection), they come by tensor copies (0: cp.async).
  int a_rows = 0;
  bool bf16_out = false;  // as in GroupedGemmParams (k_splits must be 1)
  // gate_up only (N a multiple of 16): `out` gets the rows
  // in E4M3 [num_rows, N] and this their scales [num_rows, ceil(N / 128)],
  // the bytes quantize_fp8_groups makes of the bf16 rows (the down GEMM's input).
  float* out_scales = nullptr;
  // The *_prefill kernel only: permuted row r's activation scales are row
  // a_scale_rows[r] of a_scales (gate_up's rows gathered, their scales read
  // where the quantizer left them: pass sorted_token); null: row r.
  const int32_t* a_scale_rows = nullptr;
  // fp8_grouped_gemm's down only (k_splits 1): the kernel before it in the
  // stream writes nothing this GEMM reads but `a` and `a_scales`, and started
  // after the routing was written (gate_up, launched normally). The GEMM is
  // then launched as that kernel's programmatic dependent: its blocks start
  // on the SMs the kernel's blocks leave and ask for their first weight tiles
  // before waiting for the kernel to finish.
  bool early_weights = false;
};
cudaError_t fp8_grouped_gemm(const Fp8GroupedGemmParams& p, cudaStream_t stream);
// The k_splits for a down GEMM of N columns, K deep and `row_tiles` row
// tiles: the fewest within 10% of the best waves-of-items x K-steps-per-item.
int fp8_gemm_k_splits(int N, int K, int row_tiles);

// MXFP8 (OCP MX v1.0, ops/quant.h): E4M3 values and one E8M0 scale byte
// (2^(code - 127)) per row and 32 columns, the OCP rule choosing the scale.
struct QuantizeMxfp8Params {
  const bf16* in;   // [rows, cols]
  uint8_t* out;     // [rows, cols] E4M3
  uint8_t* scales;  // [rows, ceil(cols / 32)] E8M0, or nullptr
  int rows, cols;
  bf16* dequantized = nullptr;  // optional [rows, cols]: bf16(out * scale), may be `in` (in place)
};
cudaError_t quantize_mxfp8(const QuantizeMxfp8Params& p, cudaStream_t stream);

// The grouped GEMM of Fp8GroupedGemmParams with MXFP8 weights and
// activations. Hopper has no block-scaled MMA: each 32-wide K slice is its
// own MMA, promoted with its scales (grouped_gemm_fp8.cu). 64-row tiles,
// sm_90 only, K a multiple of 128.
struct Mxfp8GroupedGemmParams {
  const uint8_t* a;              // gate_up: x [num_tokens, K]; down: act [num_rows, K]
  const uint8_t* a_scales;       // [.., K / 32] E8M0
  const int32_t* sorted_token;   // gate_up only
  const uint8_t* w;              // [num_experts, N_total, K]
  const uint8_t* w_scales;       // [num_experts, N_total, K / 32] E8M0
  const int32_t* expert_offsets;
  const int32_t* tile_offsets;
  void* out;
  int N, K, num_experts, max_tiles;
  bool gate_up;
  int k_splits = 1;  // as Fp8GroupedGemmParams::k_splits (the Hopper kernel only)
  bool bf16_out = false;  // as in GroupedGemmParams (k_splits must be 1)
};
cudaError_t mxfp8_grouped_gemm(const Mxfp8GroupedGemmParams& p, cudaStream_t stream);
// The same GEMM on Blackwell (grouped_gemm_sm100.cu): tcgen05 block-scaled
// MMAs (kind::mxf8f6f4, the E8M0 scales applied by the tensor core), the same
// params and tile_offsets (kGroupedGemmTileRows), K a multiple of 128.
// COMPILED ONLY, NEVER RUN: no Blackwell GPU has executed it, and the model
// does not call it. cudaErrorNotSupported unless sm100_kernels_available().
cudaError_t mxfp8_grouped_gemm_sm100(const Mxfp8GroupedGemmParams& p, cudaStream_t stream);
// True on a compute capability 10.0 device (B200, GB200): the tcgen05 kernels
// are compiled for sm_100a, whose code runs on 10.0 only.
bool sm100_kernels_available();

// The same two GEMMs for prefill-sized batches (grouped_gemm_prefill.cu:
// compute-bound, 128-row tiles, two consumer warpgroups, 2-CTA clusters
// sharing the activation rows): tile_offsets must come from moe_permute with
// tile_rows = kPrefillGemmTileRows, and max_tiles count such tiles. `a` holds
// the permuted rows themselves, for gate_up too (gather_rows first;
// sorted_token must be null), and a_rows says how many there are
// (cudaErrorInvalidValue otherwise). sm_90 only (cudaErrorNotSupported
// elsewhere).
inline constexpr int kPrefillGemmTileRows = 128;
cudaError_t wgmma_grouped_gemm_prefill(const GroupedGemmParams& p, cudaStream_t stream);
cudaError_t fp8_grouped_gemm_prefill(const Fp8GroupedGemmParams& p, cudaStream_t stream);
// The row tile the model's MoE layer uses for `rows` permuted rows over
// `num_experts` experts: kPrefillGemmTileRows (with the *_prefill kernels)
// once experts average at least 64 rows on an sm_90 device, else
// kGroupedGemmTileRows.
int moe_tile_rows(int64_t rows, int num_experts);

// out[t] = sum_j weights[t, j] * rows[row_of[t * k + j]] (f32), over the
// pairs with a row (row_of >= 0: the rank's own experts under expert parallelism).
struct MoeUnpermuteParams {
  const void* rows;      // [num_tokens * k, hidden], f32 (bf16 with bf16_rows)
  const int32_t* row_of; // [num_tokens * k]
  const float* weights;  // [num_tokens, k]
  float* out;            // [num_tokens, hidden]
  int num_tokens, k, hidden;
  bool bf16_rows = false;  // rows from a down GEMM with bf16_out
};
cudaError_t moe_unpermute(const MoeUnpermuteParams& p, cudaStream_t stream);

// act[t, i] = bf16(silu(gate_up[t, i]) * gate_up[t, inter + i]).
struct SiluMulParams {
  const bf16* gate_up;  // [num_tokens, 2 * inter]
  bf16* act;            // [num_tokens, inter]
  int num_tokens, inter;
};
cudaError_t silu_mul(const SiluMulParams& p, cudaStream_t stream);

// out[i] = bf16(in[i]) (round to nearest even).
struct CastToBf16Params {
  const float* in;  // [n]
  bf16* out;        // [n]
  int64_t n;
};
cudaError_t cast_to_bf16(const CastToBf16Params& p, cudaStream_t stream);

// dst[r, :] = f32(src[index[r], :]) for rows of `cols` bf16 values (exact):
// the MTP layer's input hidden states, taken from the target's rows on the device.
struct WidenRowsParams {
  const bf16* src;       // [*, cols]
  const int32_t* index;  // [rows]
  float* dst;            // [rows, cols]
  int rows, cols;
};
cudaError_t widen_rows(const WidenRowsParams& p, cudaStream_t stream);

// ids[r] = argmax of logits[r, :] (lowest index on ties).
struct ArgmaxParams {
  const float* logits;  // [num_rows, vocab]
  int32_t* ids;         // [num_rows]
  int num_rows, vocab;
};
cudaError_t argmax(const ArgmaxParams& p, cudaStream_t stream);

// Sampling on the GPU (sampling.cu): per row the filters of engine/sampler.h
// and the draw for (seed, step); temperature 0 is the argmax. A row with a
// draft (>= 0) verifies it (engine/sampler.h StepSampling): accepted[r] = 1
// and tokens[r] = draft with the probability the row gives the draft (the
// uniform for (accept_seed, step)); else a draw for (seed, step) from the
// row's distribution without the draft. Greedy rows accept a draft equal to
// their argmax.
struct SampleRow {
  float temperature;
  int top_k;      // <= 0: off
  float top_p;    // 1: off
  float min_p;    // 0: off
  uint64_t seed;
  uint64_t step;
  uint64_t accept_seed = 0;
  int32_t draft = -1;
};
struct SampleParams {
  const float* logits;    // [num_rows, vocab]
  const SampleRow* rows;  // [num_rows]
  int32_t* tokens;        // [num_rows]
  uint8_t* accepted;      // [num_rows]; may be null when no row has a draft
  int num_rows, vocab;
};
cudaError_t sample(const SampleParams& p, cudaStream_t stream);

// logits[e.row, e.token] = adjusted_logit(that, e) for each entry
// (ops/logit_adjust.h; at most one entry per (row, token)).
struct AdjustLogitsParams {
  float* logits;  // [rows, vocab]
  const LogitAdjustment* entries;
  int num_entries, vocab;
};
cudaError_t adjust_logits(const AdjustLogitsParams& p, cudaStream_t stream);

// Token masks (structured outputs): logits[rows[i], t] = -inf for every
// token t whose bit (t % 32 of word t / 32) is clear in mask i, words
// [i * ceil(vocab / 32), ...) of `words` (engine/sampler.h StepSampling).
// One thread per (mask, token); a row's mask is 1/32 of its logits' bytes,
// where the sparse entries of adjust_logits took 20 bytes per banned token.
struct MaskLogitsParams {
  float* logits;  // [rows, vocab]
  const int32_t* rows;     // [num_masks]: distinct rows
  const uint32_t* words;   // [num_masks, ceil(vocab / 32)]
  int num_masks, vocab;
};
cudaError_t mask_logits(const MaskLogitsParams& p, cudaStream_t stream);

// dst[r] = src[index[r]] for rows of row_bytes (a multiple of 4) and r <
// min(rows, *live_rows) (live_rows optional, on the device): the rows that
// need logits, and the permuted copy of the tokens' rows the prefill grouped
// GEMMs read.
struct GatherRowsParams {
  const void* src;
  void* dst;
  const int32_t* index;  // [rows]
  int64_t rows, row_bytes;
  const int32_t* live_rows = nullptr;
};
cudaError_t gather_rows(const GatherRowsParams& p, cudaStream_t stream);

// Dummy weights: out[i] = bf16(center + scale * u), u uniform in [-1, 1) from
// a counter-based hash of (seed, i), so a run is reproducible.
struct FillRandomParams {
  bf16* out;
  int64_t n;
  uint64_t seed;
  float center, scale;
};
cudaError_t fill_random(const FillRandomParams& p, cudaStream_t stream);

}  // namespace moe::ops::cuda
