// Qwen3-MoE on one GPU: the same forward pass as model/qwen3_moe.h, with
// weights, KV pages and activations in device memory and every op a CUDA
// kernel (ops/cuda) or a cuBLASLt GEMM.
//
// Per layer: fused qkv GEMM -> q/k norm + RoPE + KV store -> paged attention
// -> o_proj GEMM (f32 out) -> residual add + RMSNorm -> router GEMM -> top-k
// -> permute -> grouped gate/up GEMM with SiLU-multiply -> grouped down GEMM
// -> weighted un-permute (or the dense MLP) -> residual add + RMSNorm.
// The residual stream is f32; GEMM inputs are bf16.
//
// Not thread-safe: one thread drives a model (it owns a stream and buffers).
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "model/cuda/expert_exchange.h"
#include "model/cuda/kv_pool.h"
#include "model/cuda/layer_comm.h"
#include "model/mtp.h"
#include "model/parallel.h"
#include "model/qwen3_moe.h"
#include "model/weights.h"
#include "ops/cuda/kernels.h"
#include "ops/quant.h"

namespace moe::model {

struct CudaModelOptions {
  int device = 0;              // CUDA ordinal; made current on every thread that calls into the model
  int page_size = 16;
  int32_t num_pages = 0;       // KV pages per layer; 0: kv_cache_bytes, else sized from gpu_memory_utilization
  double kv_cache_bytes = 0;   // with num_pages 0: a KV pool of this many bytes (all layers); 0: from memory
  double gpu_memory_utilization = 0.9;  // share of the GPU's memory this process may hold in all
  int max_num_tokens = 256;    // tokens per forward (activation buffers)
  int max_num_seqs = 64;
  // Logits rows a forward (or MTP pass) may ask for, which sizes the f32
  // logits buffer (a row per token of a step otherwise: 5 GB at 8192 tokens
  // of Qwen3's vocabulary); 0: max_num_tokens. Never below what a CUDA graph
  // replay pads to (kMaxGraphTokens).
  int max_logits_rows = 0;
  // Longest sequence (page-table stride of graph replays); 0: max_position_embeddings.
  // Given (serve), the KV pool must hold one such sequence or create() refuses.
  int64_t max_model_len = 0;
  bool use_cuda_graphs = true; // decode steps replay captured graphs (vLLM's --enforce-eager turns this off)
  // Dummy weights only: the experts' format, kNone (bf16) or kFp8Block. Loaded
  // weights keep fp8-block experts in FP8 and run other quantized projections
  // dequantized to bf16.
  ops::QuantFormat dummy_expert_format = ops::QuantFormat::kNone;
  // Speculative decoding: the MTP layer (model/mtp.h) to run on the GPU too
  // (forward_mtp), with its own one-layer KV pool of the same page count;
  // counted before the KV pool is sized. Read only during create().
  const MtpWeights* mtp = nullptr;
  // Tensor / expert parallelism (model/parallel.h: TP attention, EP MoE on
  // replicated input): this rank's plan (plan.comm is not used here) and the
  // collective of its layer boundaries, which must outlive the model. bf16
  // weights only. The model then holds this rank's heads, MLP columns and
  // experts, and config() is this rank's view.
  ParallelPlan plan;
  CudaLayerComm* comm = nullptr;
  // Data-parallel attention ranks (plan.dp_attention, decode instances): the
  // whole attention and dense layers, this rank's block of experts, and the
  // exchange that carries tokens to their experts' ranks and back (instead
  // of `comm`), which must outlive the model. bf16 experts only.
  CudaExpertExchange* experts = nullptr;
};

struct StepShape;

class CudaQwen3MoeModel {
 public:
  static Expected<std::unique_ptr<CudaQwen3MoeModel>> create(const ModelWeights& weights,
                                                             const CudaModelOptions& options);
  // Random weights generated on the GPU (--load-format dummy), so full-size
  // shapes never pass through host memory.
  static Expected<std::unique_ptr<CudaQwen3MoeModel>> create_dummy(const ModelConfig& config, uint64_t seed,
                                                                   const CudaModelOptions& options);
  ~CudaQwen3MoeModel();

  const ModelConfig& config() const;
  // Runs the batch (its KV written into this model's pages) and returns the
  // logits of batch.logits_rows [rows, vocab] f32 on the host.
  Expected<Tensor> forward(const ForwardBatch& batch);
  // The same forward, with the first rows.size() logits rows sampled on the
  // GPU (ops/cuda/kernels.h: sample; a row with a draft verifies it), after
  // the adjustments (adjust_logits) and the token masks (mask_logits: row
  // mask_rows[i] keeps the tokens set in mask i of mask_words, ceil(vocab /
  // 32) words each, as engine/sampler.h StepSampling); only the tokens, the verdicts and the
  // fetch_rows (as the model produced them) come to the host. hidden_rows as
  // forward_with_hidden.
  struct DeviceSampling {
    std::span<const ops::cuda::SampleRow> rows;
    std::span<const ops::LogitAdjustment> adjustments;
    std::span<const int32_t> fetch_rows;
    std::span<const int32_t> mask_rows;
    std::span<const uint32_t> mask_words;
  };
  struct DeviceSamples {
    std::vector<int32_t> tokens;
    std::vector<uint8_t> accepted;
    Tensor fetched;  // [fetch_rows, vocab] f32
  };
  Expected<DeviceSamples> forward_sample(const ForwardBatch& batch, const DeviceSampling& sampling,
                                         std::span<const int32_t> hidden_rows, Tensor& hidden);
  // The same forward, also returning the last hidden state of `hidden_rows`
  // (row indices into the batch's tokens) in `hidden` [rows, hidden] f32:
  // after the final norm, what lm_head reads (bf16 on the GPU, widened), the
  // MTP draft layer's input (model/mtp.h).
  Expected<Tensor> forward_with_hidden(const ForwardBatch& batch, std::span<const int32_t> hidden_rows,
                                       Tensor& hidden);
  // One MTP forward (model/mtp.h, MtpModel::forward) on the GPU, over the MTP
  // layer's own KV pages (same page ids as the target's): hidden [num_tokens,
  // hidden] f32 on the host, the target's (or the previous MTP step's) output;
  // or, with batch.target_rows, rows of the target's last forward, read where
  // they were kept on the device (hidden ignored); or, with
  // batch.previous_rows, output rows of the last MTP pass (its normed output
  // and greedy token, kept on the device). Its normed output comes back
  // bf16-rounded. Needs options.mtp.
  Expected<MtpOutput> forward_mtp(const MtpBatch& batch, TensorView hidden);
  // MTP passes in a row, each reading the one before (batch.previous_rows; the
  // first, the last forward_mtp's output), queued back to back with one wait
  // at the end: each pass's greedy tokens.
  Expected<std::vector<std::vector<int32_t>>> forward_mtp_chain(std::span<const MtpBatch> passes);
  bool has_mtp() const;
  // The MTP layer's KV pool: one layer laid out as kv_pool_layout() lays out
  // each layer, num_pages() + 1 pages.
  void* mtp_kv_pool() const;
  const CudaKvPoolLayout& mtp_kv_pool_layout() const;
  // The same forward, with the greedy token of each logits row chosen on the
  // GPU (the followers of GPU ranks, benchmarks).
  Expected<std::vector<int32_t>> forward_greedy(const ForwardBatch& batch);
  // What every forward refuses (sizes against max_num_tokens, rows within
  // the batch), for a caller that must know before it commits to the step
  // (a GPU rank leader, before it sends the plan to its followers).
  Status check_batch(const ForwardBatch& batch, std::span<const int32_t> hidden_rows = {}) const;
  // A data-parallel rank (options.experts) with no batch while a peer has
  // one: every MoE layer's exchange with zero tokens of its own, so the
  // peers' tokens still reach this rank's experts and come back.
  Status exchange_idle();
  // Random KV contents, for benchmarks that time decode at a long context
  // without running the prefill first.
  Status fill_kv_random(uint64_t seed);
  int32_t num_pages() const;
  int page_size() const;
  int device() const;
  // The KV pool: one device allocation (kv_pool_layout() says where each
  // layer's pages are; its num_pages is num_pages() + 1, the scratch page of
  // graph replays last), and one layer's K/V pages as device views. A pool is
  // allocated once the model is created; the pointers stay valid until it is
  // destroyed.
  void* kv_pool() const;
  const CudaKvPoolLayout& kv_pool_layout() const;
  ops::PagedKv kv_layer(int layer) const;
  // Disaggregated prefill (engine/model_runner.h set_layer_hook): with a hook
  // set, the forward passes call hook(layer) on the calling thread once that
  // layer's KV of the whole batch is stored in the pool (its KV-store kernel
  // has completed; the kernels after it keep running), and run eagerly (no
  // CUDA graphs). Empty: no hook.
  void set_layer_hook(std::function<void(int)> hook);
  // Bytes of device memory held (weights, KV, activations).
  size_t device_bytes() const;
  // Bytes of one KV page id over all layers (the MTP layer's included).
  size_t kv_page_bytes() const;

 private:
  struct State;
  struct Placing;  // what create_impl is putting on the GPU, for an out-of-memory error
  explicit CudaQwen3MoeModel(std::unique_ptr<State> state);
  static Expected<std::unique_ptr<CudaQwen3MoeModel>> create_impl(const ModelConfig& config, const ModelWeights* weights,
                                                                  uint64_t seed, const CudaModelOptions& options,
                                                                  Placing& placing);
  static Expected<std::unique_ptr<CudaQwen3MoeModel>> create_explained(const ModelConfig& config,
                                                                       const ModelWeights* weights, uint64_t seed,
                                                                       const CudaModelOptions& options);
  Status allocate_kv_pool(int32_t num_pages);
  Status size_kv_pool_after_warm_up(int tokens);
  Status run(const ForwardBatch& batch);
  Status finish_step();
  // `rows` logits rows of a `num_tokens`-token forward fit the tokens and the logits buffer.
  Status check_logits_rows(int rows, int num_tokens) const;
  // A CUDA-graph step: `seqs` sequences (the batch's, padded to a bucket) of
  // `query` new tokens each, and `rows` output rows (the batch's logits rows
  // padded to a bucket; 0: every token's). seqs == 0: the step runs eagerly.
  struct GraphShape {
    int seqs = 0, query = 1, rows = 0;
  };
  // heads: the layer whose heads size prefill attention's token groups (null: the target's).
  struct LayerBuffers;
  Expected<StepShape> upload_step(const ForwardBatch& batch, GraphShape graph,
                                  const LayerBuffers* heads = nullptr);
  Status launch_step(const StepShape& shape);
  // An FP8 GEMM input's layout (E4M3 in 1 x 128 groups): its scales per row
  // ([T, K / 128]) or per group ([K / 128, T], cuBLASLt's block scaling);
  // kNone: not quantized.
  enum class Fp8Layout { kNone, kRows, kGroups };
  // One decoder layer over state's `residual` (in) / `normed` (the input
  // norm's output in; next_norm's output out, quantized as next_fp8 says);
  // `layer` < 0: not a target layer.
  Status launch_layer(const LayerBuffers& b, const StepShape& shape, const void* next_norm, int layer,
                      Fp8Layout next_fp8 = Fp8Layout::kNone);
  Status upload_mtp(const MtpWeights& weights);
  // residual += delta (summed over the ranks when `reduce`; moe_delta: the
  // MoE's weighted sum of its bf16 expert_rows, not reduced), then the norm
  // into `normed` and, where the kernel can, into x_fp8 as `fp8` says.
  Status layer_boundary(const void* norm_weight, int num_tokens, bool reduce, Fp8Layout fp8 = Fp8Layout::kNone,
                        bool moe_delta = false);
  // residual += delta (none: nullptr; moe_delta: the expert rows' weighted
  // sum), then the norm into `normed` and, where the kernel can, into x_fp8 as `fp8` says.
  Status add_rms_norm(const void* norm_weight, const float* delta, int num_tokens, Fp8Layout fp8, bool moe_delta);
  Status exchange_experts(const LayerBuffers& b, int num_tokens, const void* next_norm, Fp8Layout next_fp8);
  // Whether an FP8 projection of that shape goes through cuBLASLt's block-scaled GEMM.
  bool cublas_fp8_projection(int num_tokens, int n, int k, DType out) const;
  // The layout b's qkv projection reads its FP8 input in (kNone: bf16, or mxfp8).
  Fp8Layout qkv_input_fp8(const LayerBuffers& b, int num_tokens) const;
  // Whether state's x_fp8 / x_scales hold `source` (written by the kernel
  // that wrote source) in `layout`; either way they no longer count as holding it.
  bool take_x_fp8(const void* source, Fp8Layout layout);
  // The layout the o projection reads its FP8 input in (kNone: bf16, or mxfp8).
  Fp8Layout o_input_fp8(const LayerBuffers& b, int num_tokens) const;
  Status sync_and_fetch_hidden(int num_tokens, std::span<const int32_t> hidden_rows, Tensor& hidden);
  // Queues one MTP pass up to its greedy tokens (state_->greedy) and normed
  // output rows (state_->logit_rows); forward_mtp and forward_mtp_chain wait.
  Status queue_mtp(const MtpBatch& batch, TensorView hidden);
  enum class MtpInput { kHost, kTargetRows, kPreviousRows };  // where an MTP pass's h comes from
  Status launch_mtp(const StepShape& shape, MtpInput input);
  // any_rows: the batch's logits rows may be any of its tokens (GraphShape::rows).
  GraphShape graph_bucket(const ForwardBatch& batch, bool any_rows = false) const;
  Status replay_or_capture(GraphShape graph, int stride, bool mtp, const std::function<Status()>& launch);
  int dense_tile_rows(int num_tokens) const;
  int graph_stride(int max_pages_per_seq) const;
  std::unique_ptr<State> state_;
};

}  // namespace moe::model
