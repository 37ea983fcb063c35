// The insides of CudaQwen3MoeModel (cuda_model.h), shared by its source
// files: cuda_model.cc (creation: weights, buffers, the KV pools),
// cuda_model_step.cc (running a step: metadata upload, CUDA graphs, the layer
// kernels, the forward variants) and cuda_model_mtp.cc (the MTP passes). Not
// for other users.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "core/cuda/device_buffer.h"
#include "model/cuda/cuda_model.h"
#include "model/cuda/kv_pool.h"
#include "ops/cuda/gemm.h"

namespace moe::model {

struct CudaQwen3MoeModel::LayerBuffers {
  DeviceTensor input_norm, post_attention_norm, qkv_proj, o_proj, q_norm, k_norm, router, w13, w2;
  DeviceTensor w13_scales, w2_scales;  // FP8 experts: 128 x 128 block scales (ops/quant.h, fp8-block)
  TensorView k_pages, v_pages;  // views into State::kv_pool (the MTP layer's: into State::mtp_kv_pool)
  bool is_moe = false;
  bool fp8_experts = false, mx_experts = false;  // MoE experts in FP8 (State::fp8_experts), mxfp8 scales
  // fp8-block projections run dequantized in bf16 take inputs quantized and
  // dequantized per 1 x 128 first, as the CPU reference computes them.
  bool fake_quant_attention = false, fake_quant_mlp = false;
  // Quantized attention projections run in FP8 (fp8-block or mxfp8, as the
  // experts): qkv_proj and o_proj hold E4M3 rows, these their scales.
  bool fp8_attention = false;
  DeviceTensor qkv_scales, o_scales;
  // This layer's heads and dense MLP columns: a target layer's are the rank's
  // share (rank_config), the MTP layer's the whole model's (it runs whole on
  // the rank that drafts).
  int num_q_heads = 0, num_kv_heads = 0, mlp_columns = 0;
};

// Decode steps and MTP passes replay CUDA graphs of at most this many tokens
// (logits rows included) after padding.
inline constexpr int kMaxGraphTokens = 512;

struct CudaQwen3MoeModel::State {
  ModelConfig config;
  CudaModelOptions options;
  cudaStream_t stream = nullptr;
  std::unique_ptr<ops::cuda::Gemm> gemm;
  DeviceTensor embed, final_norm, lm_head, inv_freq;
  float attention_factor = 1.0f;
  std::vector<LayerBuffers> layers;
  // Activations, sized for options.max_num_tokens.
  DeviceTensor residual, normed, qkv, q, attended, delta, router_logits, expert_ids, expert_weights;
  DeviceTensor expert_offsets, tile_offsets, sorted_token, row_of, act, expert_rows, gate_up, logit_rows, logits, greedy;
  int64_t max_logits_rows = 0;  // logits' rows (options.max_logits_rows, resolved)
  DeviceTensor permute_counts;  // moe_permute's per-block expert counts at prefill sizes
  // Step metadata.
  DeviceTensor token_ids, positions, token_seq, page_table, logits_rows;
  DeviceTensor attention_workspace;  // split-KV partials of the tensor-core attention
  DeviceTensor attention_groups;     // prefill token groups
  int first_expert = 0, num_local_experts = 0;  // this rank's experts (all of them without expert parallelism)
  DeviceTensor delta_bf16;                       // a rank's partial sum, for CudaLayerComm
  bool fp8_experts = false;          // MoE experts in FP8 (fp8-block or mxfp8), activations quantized alike
  bool mx_experts = false;           // mxfp8: E8M0 scales per 1 x 32 (x_scales, act_scales hold bytes)
  DeviceTensor x_fp8, x_scales, act_fp8, act_scales;
  // What x_fp8 / x_scales hold: `source` (normed or attended) in E4M3,
  // written by the kernel that wrote it (take_x_fp8).
  struct Fp8Copy {
    const void* source = nullptr;
    Fp8Layout layout = Fp8Layout::kNone;
  };
  Fp8Copy x_fp8_holds;
  // FP8 attention projections: one-group offsets of the grouped GEMMs (set
  // per step) and the qkv projection's f32 output before its bf16 cast.
  DeviceTensor dense_offsets, dense_tile_offsets, qkv_f32;
  bool fp8_attention = false;
  // fp8-block projections through cuBLASLt's block-scaled GEMM where it has
  // an algorithm (else the grouped GEMM); MOE_FP8_DENSE_GEMM=grouped turns it
  // off, for measurements.
  bool cublas_fp8_projections = true;
  DeviceTensor sample_rows;          // per-row sampling parameters
  DeviceTensor sample_accepted;      // [T] u8: a draft row's verdict
  DeviceTensor logit_adjustments;    // the step's ops::LogitAdjustment entries (grown as needed)
  DeviceTensor mask_rows, mask_words;  // the step's token masks (grown as needed)
  // The MTP layer (options.mtp): its norms and fc, its decoder block, and its
  // one-layer KV pool; mtp_h [T, H] f32 takes the host's hidden states, the
  // normed embedding and hidden states meet in mtp_concat [T, 2H] bf16.
  std::unique_ptr<LayerBuffers> mtp_layer;
  DeviceTensor mtp_embed_norm, mtp_hidden_norm, mtp_fc, mtp_final_norm, mtp_h, mtp_g, mtp_concat;
  // The target's final-normed rows of its last forward (target_tokens of
  // them), kept for the MTP's first pass (MtpBatch::target_rows), and an MTP
  // pass's row indices (target_rows or previous_rows).
  DeviceTensor target_hidden, target_rows;
  int target_tokens = 0;
  // Output rows of the last MTP pass still in logit_rows (normed) and greedy
  // (its drafts), for a chained pass (MtpBatch::previous_rows); 0 once a
  // target forward has reused those buffers. chain_greedy collects the
  // drafts of forward_mtp_chain's passes.
  int mtp_rows = 0;
  DeviceTensor chain_greedy;
  DeviceBuffer mtp_kv_pool;
  CudaKvPoolLayout mtp_kv_layout;
  // Every layer's K and V pages in one allocation (model/cuda/kv_pool.h), so
  // the disaggregated roles can hand it to the TransferEngine as one region.
  DeviceBuffer kv_pool;
  CudaKvPoolLayout kv_layout;
  // Disaggregated prefill: called once a layer's KV is in the pool (set_layer_hook).
  std::function<void(int)> layer_hook;
  cudaEvent_t kv_written = nullptr;  // recorded after a layer's KV store while a hook is set
  std::map<int64_t, cudaGraphExec_t>
      graphs;  // decode step per (sequences << 40 | tokens per sequence << 32 | stride)
  int max_pages_per_seq = 0;               // the page-table stride graphs use
  size_t bytes = 0;
  size_t weights_and_activations_bytes = 0;

  ~State() {
    for (auto& [bucket, exec] : graphs) cudaGraphExecDestroy(exec);
    if (kv_written != nullptr) cudaEventDestroy(kv_written);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
};

// What the kernels of one step need to know; its buffers are already on the device.
struct StepShape {
  int num_tokens = 0, num_rows = 0, num_groups = 0, max_position = 0, stride = 0;
  bool prefill = false;
};

}  // namespace moe::model
