#include "model/cuda/cuda_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>

#include "core/cuda/device_buffer.h"
#include "core/logging.h"
#include "model/cuda/kv_pool.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/kernels.h"

namespace moe::model {
namespace {

namespace k = moe::ops::cuda;
using bf16 = __nv_bfloat16;

// Host tensors of any float dtype, converted to bf16 and concatenated along dim 0.
Expected<DeviceTensor> upload_bf16(std::initializer_list<TensorView> parts) {
  int64_t rows = 0;
  Shape first = parts.begin()->shape();
  for (const auto& p : parts) rows += p.rank() == 0 ? 1 : p.dim(0);
  std::vector<int64_t> dims(first.dims().begin(), first.dims().end());
  if (!dims.empty()) dims[0] = rows;
  Tensor host(DType::kBF16, Shape(std::span<const int64_t>(dims)));
  int64_t offset = 0;
  for (const auto& p : parts) {
    auto* dst = host.data_as<uint16_t>() + offset;
    if (p.dtype() == DType::kBF16) {
      std::memcpy(dst, p.data(), p.num_bytes());
    } else {
      for (int64_t i = 0; i < p.num_elements(); ++i) dst[i] = float_to_bf16(load_as_float(p.dtype(), p.data(), i));
    }
    offset += p.num_elements();
  }
  return DeviceTensor::upload(host);
}

// A projection the model runs in bf16: the checkpoint's plain tensor, or its
// quantized one dequantized here (kept alive in `keep`).
TensorView plain_or_dequantized(TensorView plain, const ops::QuantizedTensor& quant, std::vector<Tensor>& keep) {
  if (quant.empty()) return plain;
  Tensor out(DType::kF32, quant.values.shape());
  const int64_t rows = quant.rows(), cols = quant.cols();
  const int64_t matrices = quant.rank() == 3 ? quant.values.dim(0) : 1;
  for (int64_t g = 0; g < matrices; ++g)
    ops::dequantize_rows(quant.rank() == 3 ? quant.slice0(g) : quant, 0, rows, out.data_as<float>() + g * rows * cols);
  keep.push_back(std::move(out));
  return keep.back().view();
}

// Dummy FP8 experts [rows, cols] with block scales [scale_shape]: E4M3 values
// from random bf16 quantized by the activation quantizer, and block scales
// that bring them back to about +-magnitude.
Status dummy_fp8_experts(DeviceTensor& values, DeviceTensor& scales, int64_t rows, int64_t cols, Shape scale_shape,
                         float magnitude, uint64_t seed, cudaStream_t stream) {
  MOE_ASSIGN_OR_RETURN(values, DeviceTensor::allocate(DType::kF8E4M3, {rows, cols}));
  {
    MOE_ASSIGN_OR_RETURN(DeviceTensor source, DeviceTensor::allocate(DType::kBF16, {rows, cols}));
    MOE_ASSIGN_OR_RETURN(DeviceTensor row_scales, DeviceTensor::allocate(DType::kF32, {rows, (cols + 127) / 128}));
    MOE_CUDA_RETURN_IF_ERROR(k::fill_random({source.data_as<bf16>(), rows * cols, seed, 0.0f, 1.0f}, stream));
    MOE_CUDA_RETURN_IF_ERROR(k::quantize_fp8_groups({source.data_as<bf16>(), values.data_as<uint8_t>(),
                                                     row_scales.data_as<float>(), static_cast<int>(rows),
                                                     static_cast<int>(cols)}, stream));
    MOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  }
  std::vector<float> host(static_cast<size_t>(scale_shape.num_elements()), magnitude / 448.0f);
  MOE_ASSIGN_OR_RETURN(scales, DeviceTensor::upload(TensorView(host.data(), DType::kF32, scale_shape)));
  return Status::ok();
}

}  // namespace

namespace {
// Tensors of one dtype concatenated along dim 0, bytes as they are.
Expected<DeviceTensor> upload_rows(std::initializer_list<TensorView> parts) {
  int64_t rows = 0;
  for (const auto& p : parts) rows += p.dim(0);
  const TensorView first = *parts.begin();
  Tensor host(first.dtype(), {rows, first.dim(1)});
  size_t offset = 0;
  for (const auto& p : parts) {
    if (p.dtype() != first.dtype() || p.rank() != 2 || p.dim(1) != first.dim(1))
      return invalid_argument("rows of different dtypes or widths cannot be concatenated");
    std::memcpy(static_cast<char*>(host.data()) + offset, p.data(), p.num_bytes());
    offset += p.num_bytes();
  }
  return DeviceTensor::upload(host);
}

// Whether q/k/v/o of a layer can run through the FP8 grouped GEMMs as one
// group: every projection quantized, rows and columns multiples of 128 (so
// fp8-block's 128-row scale blocks of q, k and v concatenate), in the
// experts' format (whose kernels and scale layout they then use).
bool fp8_attention_fits(const LayerWeights& w, ops::QuantFormat experts) {
  for (const ops::QuantizedTensor* q : {&w.q_proj_quant, &w.k_proj_quant, &w.v_proj_quant, &w.o_proj_quant})
    if (q->format != experts || q->rank() != 2 || q->rows() % 128 != 0 || q->cols() % 128 != 0 ||
        (q->format == ops::QuantFormat::kFp8Block && q->scale_row_period != 0))
      return false;
  return true;
}
}  // namespace

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
};

struct CudaQwen3MoeModel::State {
  ModelConfig config;
  CudaModelOptions options;
  cudaStream_t stream = nullptr;
  std::unique_ptr<k::Gemm> gemm;
  DeviceTensor embed, final_norm, lm_head, inv_freq;
  float attention_factor = 1.0f;
  std::vector<LayerBuffers> layers;
  // Activations, sized for options.max_num_tokens.
  DeviceTensor residual, normed, qkv, q, attended, delta, router_logits, expert_ids, expert_weights;
  DeviceTensor expert_offsets, tile_offsets, sorted_token, row_of, act, expert_rows, gate_up, logit_rows, logits, greedy;
  // Step metadata.
  DeviceTensor token_ids, positions, token_seq, page_table, logits_rows;
  DeviceTensor attention_workspace;  // split-KV partials of the tensor-core attention
  DeviceTensor attention_groups;     // prefill token groups
  int first_expert = 0, num_local_experts = 0;  // this rank's experts (all of them without expert parallelism)
  DeviceTensor delta_bf16;                       // a rank's partial sum, for CudaLayerComm
  bool fp8_experts = false;          // MoE experts in FP8 (fp8-block or mxfp8), activations quantized alike
  bool mx_experts = false;           // mxfp8: E8M0 scales per 1 x 32 (x_scales, act_scales hold bytes)
  DeviceTensor x_fp8, x_scales, act_fp8, act_scales;
  // FP8 attention projections: one-group offsets of the grouped GEMMs (set
  // per step) and the qkv projection's f32 output before its bf16 cast.
  DeviceTensor dense_offsets, dense_tile_offsets, qkv_f32;
  bool fp8_attention = false;
  DeviceTensor sample_rows;          // per-row sampling parameters
  // The MTP layer (options.mtp): its norms and fc, its decoder block, and its
  // one-layer KV pool; mtp_h [T, H] f32 takes the host's hidden states, the
  // normed embedding and hidden states meet in mtp_concat [T, 2H] bf16.
  std::unique_ptr<LayerBuffers> mtp_layer;
  DeviceTensor mtp_embed_norm, mtp_hidden_norm, mtp_fc, mtp_final_norm, mtp_h, mtp_g, mtp_concat;
  DeviceBuffer mtp_kv_pool;
  CudaKvPoolLayout mtp_kv_layout;
  // Every layer's K and V pages in one allocation (model/cuda/kv_pool.h), so
  // the disaggregated roles can hand it to the TransferEngine as one region.
  DeviceBuffer kv_pool;
  CudaKvPoolLayout kv_layout;
  // Disaggregated prefill: called once a layer's KV is in the pool (set_layer_hook).
  std::function<void(int)> layer_hook;
  cudaEvent_t kv_written = nullptr;  // recorded after a layer's KV store while a hook is set
  std::map<int64_t, cudaGraphExec_t> graphs;  // decode step per (bucket of tokens << 32 | page-table stride)
  int max_pages_per_seq = 0;               // the page-table stride graphs use
  size_t bytes = 0;
  size_t weights_and_activations_bytes = 0;

  ~State() {
    for (auto& [bucket, exec] : graphs) cudaGraphExecDestroy(exec);
    if (kv_written != nullptr) cudaEventDestroy(kv_written);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
};

CudaQwen3MoeModel::CudaQwen3MoeModel(std::unique_ptr<State> state) : state_(std::move(state)) {}
CudaQwen3MoeModel::~CudaQwen3MoeModel() {
  // Frees on the model's device (a process may hold models on several GPUs),
  // then gives the calling thread its current device back.
  int current = 0;
  const bool saved = cudaGetDevice(&current) == cudaSuccess;
  if (state_) cudaSetDevice(state_->options.device);
  state_.reset();
  if (saved) cudaSetDevice(current);
}
const ModelConfig& CudaQwen3MoeModel::config() const { return state_->config; }
size_t CudaQwen3MoeModel::device_bytes() const { return state_->bytes; }
int32_t CudaQwen3MoeModel::num_pages() const { return state_->options.num_pages; }
int CudaQwen3MoeModel::page_size() const { return state_->options.page_size; }
int CudaQwen3MoeModel::device() const { return state_->options.device; }
void* CudaQwen3MoeModel::kv_pool() const { return state_->kv_pool.data(); }
bool CudaQwen3MoeModel::has_mtp() const { return state_->mtp_layer != nullptr; }
void* CudaQwen3MoeModel::mtp_kv_pool() const { return state_->mtp_kv_pool.data(); }
const CudaKvPoolLayout& CudaQwen3MoeModel::mtp_kv_pool_layout() const { return state_->mtp_kv_layout; }
const CudaKvPoolLayout& CudaQwen3MoeModel::kv_pool_layout() const { return state_->kv_layout; }
ops::PagedKv CudaQwen3MoeModel::kv_layer(int layer) const {
  const LayerBuffers& b = state_->layers.at(static_cast<size_t>(layer));
  return {b.k_pages, b.v_pages};
}
void CudaQwen3MoeModel::set_layer_hook(std::function<void(int)> hook) { state_->layer_hook = std::move(hook); }

Expected<std::unique_ptr<CudaQwen3MoeModel>> CudaQwen3MoeModel::create(const ModelWeights& weights,
                                                                       const CudaModelOptions& options) {
  return create_impl(weights.config(), &weights, 0, options);
}

Expected<std::unique_ptr<CudaQwen3MoeModel>> CudaQwen3MoeModel::create_dummy(const ModelConfig& config, uint64_t seed,
                                                                             const CudaModelOptions& options) {
  return create_impl(config, nullptr, seed, options);
}

namespace {
// This rank's view of the config under a parallel plan: its q and k/v heads
// and dense MLP columns (model/parallel.h); the router still sees every expert.
ModelConfig rank_config(const ModelConfig& full, const ParallelPlan& plan) {
  if (plan.single()) return full;
  const RankShard shard = rank_shard(full, plan);
  ModelConfig c = full;
  c.num_q_heads = shard.num_q_heads;
  c.num_kv_heads = shard.num_kv_heads;
  if (plan.tp_size > 1) c.intermediate_size = shard.num_mlp_columns;
  return c;
}

Status check_cuda_parallel(const ModelConfig& full, const ModelWeights* weights, const CudaModelOptions& options) {
  const ParallelPlan& plan = options.plan;
  if (plan.single()) return Status::ok();
  MOE_RETURN_IF_ERROR(weights ? check_parallel_plan(full, *weights, plan) : check_parallel_layout(full, plan));
  if (plan.dp_attention) return unimplemented("data-parallel attention ranks on the GPU are not implemented yet");
  if (weights && weights->quant_format() != ops::QuantFormat::kNone)
    return unimplemented("{} weights on GPU ranks (--tp/--ep with --device cuda): bf16 only for now",
                         ops::quant_format_name(weights->quant_format()));
  if (!weights && options.dummy_expert_format != ops::QuantFormat::kNone)
    return unimplemented("dummy {} experts on GPU ranks: bf16 only for now",
                         ops::quant_format_name(options.dummy_expert_format));
  if (options.mtp != nullptr) return unimplemented("an MTP layer on GPU ranks (--tp/--ep) is not supported yet");
  const int world = std::max(plan.tp_size, plan.ep_size), rank = plan.tp_size > 1 ? plan.tp_rank : plan.ep_rank;
  if (options.comm == nullptr || options.comm->world_size() != world || options.comm->rank() != rank)
    return invalid_argument("a GPU rank {} of {} needs a layer communicator of that rank and size", rank, world);
  return Status::ok();
}
}  // namespace

Expected<std::unique_ptr<CudaQwen3MoeModel>> CudaQwen3MoeModel::create_impl(const ModelConfig& full,
                                                                            const ModelWeights* weights, uint64_t seed,
                                                                            const CudaModelOptions& options) {
  MOE_RETURN_IF_ERROR(check_cuda_parallel(full, weights, options));
  MOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.device));
  auto s = std::make_unique<State>();
  const ModelConfig c = rank_config(full, options.plan);
  const RankShard shard = rank_shard(full, options.plan);
  s->config = c;
  s->options = options;
  s->first_expert = shard.first_expert;
  s->num_local_experts = shard.num_experts;
  // Ranks whose collectives synchronise with the host cannot be captured.
  if (options.comm != nullptr && !options.comm->graph_capturable()) s->options.use_cuda_graphs = false;
  std::optional<RankWeights> rank_weights;
  if (weights != nullptr && !options.plan.single()) rank_weights.emplace(*weights, options.plan);
  // This rank's layer weights: its heads and MLP columns, its experts' rows.
  auto layer_weights = [&](int l) {
    if (!rank_weights) return weights->layer(l);
    LayerWeights w = rank_weights->layer(l);
    if (w.is_moe && options.plan.ep_size > 1) {
      w.w13 = w.w13.rows(shard.first_expert, shard.first_expert + shard.num_experts);
      w.w2 = w.w2.rows(shard.first_expert, shard.first_expert + shard.num_experts);
    }
    return w;
  };
  if (c.head_dim > 128 || c.num_q_heads / c.num_kv_heads > 16 || c.num_experts > 256)
    return unimplemented("the CUDA backend supports head_dim <= 128, <= 16 q heads per kv head, <= 256 experts");
  MOE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking));
  MOE_ASSIGN_OR_RETURN(auto gemm, k::Gemm::create());
  s->gemm = std::make_unique<k::Gemm>(std::move(gemm));
  auto track = [&](DeviceTensor& t, Expected<DeviceTensor> made) -> Status {
    if (!made) return made.status();
    t = std::move(made).value();
    s->bytes += t.num_bytes();
    return Status::ok();
  };
  // A weight from the checkpoint (`parts` concatenated along dim 0), or random
  // values of `shape` in [center - scale, center + scale] for dummy runs.
  uint64_t stream_id = 0;
  auto weight = [&](DeviceTensor& t, std::initializer_list<TensorView> parts, Shape shape, float center,
                    float scale) -> Status {
    if (weights != nullptr) return track(t, upload_bf16(parts));
    MOE_RETURN_IF_ERROR(track(t, DeviceTensor::allocate(DType::kBF16, shape)));
    return cuda_status(k::fill_random({t.data_as<bf16>(), shape.num_elements(), seed * 1000003 + ++stream_id, center,
                                       scale}, s->stream), "fill_random");
  };
  const int64_t hidden = c.hidden_size, vocab = c.vocab_size;
  const float hidden_scale = 1.0f / std::sqrt(static_cast<float>(hidden));
  const ModelWeights* w0 = weights;
  MOE_RETURN_IF_ERROR(weight(s->embed, {w0 ? w0->embed_tokens() : TensorView()}, {vocab, hidden}, 0.0f, 1.0f));
  MOE_RETURN_IF_ERROR(weight(s->final_norm, {w0 ? w0->final_norm() : TensorView()}, {hidden}, 1.0f, 0.1f));
  MOE_RETURN_IF_ERROR(weight(s->lm_head, {w0 ? w0->lm_head() : TensorView()}, {vocab, hidden}, 0.0f, hidden_scale));
  const ops::RopeTable rope = ops::make_rope_table(c.rope);
  s->attention_factor = rope.attention_factor;
  MOE_RETURN_IF_ERROR(track(s->inv_freq, DeviceTensor::upload(TensorView(const_cast<float*>(rope.inv_freq.data()),
                                                                         DType::kF32, {c.head_dim / 2}))));
  // Experts in FP8: a checkpoint in fp8-block or mxfp8 keeps them so (other
  // formats are dequantized to bf16 here), dummy weights when options ask.
  const ops::QuantFormat expert_format = weights ? weights->quant_format() : options.dummy_expert_format;
  if (!weights && expert_format != ops::QuantFormat::kNone && expert_format != ops::QuantFormat::kFp8Block)
    return unimplemented("dummy {} experts on the GPU: only fp8-block dummy weights are generated on the GPU",
                         ops::quant_format_name(expert_format));
  s->fp8_experts = expert_format == ops::QuantFormat::kFp8Block || expert_format == ops::QuantFormat::kMxfp8;
  s->mx_experts = expert_format == ops::QuantFormat::kMxfp8;
  if (s->fp8_experts && !k::hopper_kernels_available())
    return unimplemented("{} experts need an sm_90 GPU (the FP8 grouped GEMMs are wgmma kernels)",
                         ops::quant_format_name(expert_format));
  if (s->mx_experts && (hidden % 128 != 0 || c.moe_intermediate_size % 128 != 0))
    return unimplemented("mxfp8 experts on the GPU need hidden and moe_intermediate sizes that are multiples of 128");
  auto fp8_experts = [&](LayerBuffers& b, const LayerWeights* w, int64_t experts, int64_t inter, float up_magnitude,
                         float down_magnitude, uint64_t layer_seed) -> Status {
    const int64_t hidden_blocks = (hidden + 127) / 128, inter_blocks = (inter + 127) / 128;
    if (w != nullptr) {
      MOE_ASSIGN_OR_RETURN(b.w13, DeviceTensor::upload(w->w13_quant.values));
      MOE_ASSIGN_OR_RETURN(b.w13_scales, DeviceTensor::upload(w->w13_quant.scales));
      MOE_ASSIGN_OR_RETURN(b.w2, DeviceTensor::upload(w->w2_quant.values));
      MOE_ASSIGN_OR_RETURN(b.w2_scales, DeviceTensor::upload(w->w2_quant.scales));
    } else {
      MOE_RETURN_IF_ERROR(dummy_fp8_experts(b.w13, b.w13_scales, experts * 2 * inter, hidden,
                                            {experts, 2 * inter_blocks, hidden_blocks}, up_magnitude, layer_seed,
                                            s->stream));
      MOE_RETURN_IF_ERROR(dummy_fp8_experts(b.w2, b.w2_scales, experts * hidden, inter,
                                            {experts, hidden_blocks, inter_blocks}, down_magnitude, layer_seed + 1,
                                            s->stream));
    }
    s->bytes += b.w13.num_bytes() + b.w13_scales.num_bytes() + b.w2.num_bytes() + b.w2_scales.num_bytes();
    return Status::ok();
  };
  const int64_t qkv_rows = c.q_size() + 2 * c.kv_size();
  for (int l = 0; l < c.num_layers; ++l) {
    std::optional<LayerWeights> this_layer;
    if (weights) this_layer.emplace(layer_weights(l));
    const LayerWeights* w = this_layer ? &*this_layer : nullptr;
    std::vector<Tensor> dequantized;  // quantized projections the GPU runs in bf16, for this layer's upload
    auto part = [&](TensorView LayerWeights::*member) { return w ? w->*member : TensorView(); };
    auto projection = [&](TensorView LayerWeights::*plain, ops::QuantizedTensor LayerWeights::*quant) {
      return w ? plain_or_dequantized(w->*plain, w->*quant, dequantized) : TensorView();
    };
    LayerBuffers b;
    b.is_moe = c.layer_is_moe(l);
    b.fp8_experts = b.is_moe && s->fp8_experts;
    b.mx_experts = b.is_moe && s->mx_experts;
    // Dummy fp8-block weights: the attention projections in FP8 too (when their shapes allow).
    const bool dummy_fp8_attention = !weights && expert_format == ops::QuantFormat::kFp8Block &&
                                     qkv_rows % 128 == 0 && c.q_size() % 128 == 0 && hidden % 128 == 0;
    b.fp8_attention = (w && s->fp8_experts && fp8_attention_fits(*w, expert_format)) || dummy_fp8_attention;
    b.fake_quant_attention = w && s->fp8_experts && !w->q_proj_quant.empty() && !b.fp8_attention;
    s->fp8_attention |= b.fp8_attention;
    b.fake_quant_mlp = w && s->fp8_experts && !b.is_moe && !w->w13_quant.empty();
    MOE_RETURN_IF_ERROR(weight(b.input_norm, {part(&LayerWeights::input_norm)}, {hidden}, 1.0f, 0.1f));
    MOE_RETURN_IF_ERROR(weight(b.post_attention_norm, {part(&LayerWeights::post_attention_norm)}, {hidden}, 1.0f, 0.1f));
    if (dummy_fp8_attention) {
      MOE_RETURN_IF_ERROR(dummy_fp8_experts(b.qkv_proj, b.qkv_scales, qkv_rows, hidden, {qkv_rows / 128, hidden / 128},
                                            hidden_scale, seed * 1000003 + ++stream_id, s->stream));
      MOE_RETURN_IF_ERROR(dummy_fp8_experts(b.o_proj, b.o_scales, hidden, c.q_size(), {hidden / 128, c.q_size() / 128},
                                            1.0f / std::sqrt(static_cast<float>(c.q_size())),
                                            seed * 1000003 + ++stream_id, s->stream));
      s->bytes += b.qkv_proj.num_bytes() + b.qkv_scales.num_bytes() + b.o_proj.num_bytes() + b.o_scales.num_bytes();
    } else if (b.fp8_attention) {
      MOE_RETURN_IF_ERROR(track(b.qkv_proj, upload_rows({w->q_proj_quant.values, w->k_proj_quant.values,
                                                         w->v_proj_quant.values})));
      MOE_RETURN_IF_ERROR(track(b.qkv_scales, upload_rows({w->q_proj_quant.scales, w->k_proj_quant.scales,
                                                           w->v_proj_quant.scales})));
      MOE_RETURN_IF_ERROR(track(b.o_proj, upload_rows({w->o_proj_quant.values})));
      MOE_RETURN_IF_ERROR(track(b.o_scales, upload_rows({w->o_proj_quant.scales})));
    } else {
      MOE_RETURN_IF_ERROR(weight(b.qkv_proj, {projection(&LayerWeights::q_proj, &LayerWeights::q_proj_quant),
                                              projection(&LayerWeights::k_proj, &LayerWeights::k_proj_quant),
                                              projection(&LayerWeights::v_proj, &LayerWeights::v_proj_quant)},
                                 {qkv_rows, hidden}, 0.0f, hidden_scale));
      MOE_RETURN_IF_ERROR(weight(b.o_proj, {projection(&LayerWeights::o_proj, &LayerWeights::o_proj_quant)},
                                 {hidden, c.q_size()}, 0.0f, 1.0f / std::sqrt(static_cast<float>(c.q_size()))));
    }
    MOE_RETURN_IF_ERROR(weight(b.q_norm, {part(&LayerWeights::q_norm)}, {c.head_dim}, 1.0f, 0.1f));
    MOE_RETURN_IF_ERROR(weight(b.k_norm, {part(&LayerWeights::k_norm)}, {c.head_dim}, 1.0f, 0.1f));
    const int64_t inter = b.is_moe ? c.moe_intermediate_size : c.intermediate_size;
    const float down_scale = 1.0f / std::sqrt(static_cast<float>(inter));
    if (b.is_moe) {
      // The router scores every expert; the weights are this rank's experts'.
      const int64_t experts = s->num_local_experts;
      MOE_RETURN_IF_ERROR(weight(b.router, {part(&LayerWeights::router)}, {c.num_experts, hidden}, 0.0f, hidden_scale));
      if (s->fp8_experts) {
        MOE_RETURN_IF_ERROR(fp8_experts(b, w, experts, inter, hidden_scale, down_scale, seed * 1000003 + ++stream_id));
      } else {
        MOE_RETURN_IF_ERROR(weight(b.w13, {projection(&LayerWeights::w13, &LayerWeights::w13_quant)},
                                   {experts, 2 * inter, hidden}, 0.0f, hidden_scale));
        MOE_RETURN_IF_ERROR(weight(b.w2, {projection(&LayerWeights::w2, &LayerWeights::w2_quant)},
                                   {experts, hidden, inter}, 0.0f, down_scale));
      }
    } else {
      MOE_RETURN_IF_ERROR(weight(b.w13, {projection(&LayerWeights::w13, &LayerWeights::w13_quant)},
                                 {2 * inter, hidden}, 0.0f, hidden_scale));
      MOE_RETURN_IF_ERROR(weight(b.w2, {projection(&LayerWeights::w2, &LayerWeights::w2_quant)}, {hidden, inter},
                                 0.0f, down_scale));
    }
    s->layers.push_back(std::move(b));
  }
  const int64_t T = options.max_num_tokens, H = c.hidden_size, kk = std::max(1, c.num_experts_per_tok);
  const int64_t moe_inter = std::max<int64_t>(c.moe_intermediate_size, 1), inter = std::max<int64_t>(c.intermediate_size, 1);
  const int64_t qkv_width = c.q_size() + 2 * c.kv_size(), E = std::max(1, c.num_experts);
  const int64_t fp8_width = std::max<int64_t>({H, c.q_size(), inter});  // inputs quantized per 1 x 128
  struct Alloc { DeviceTensor* t; DType dtype; Shape shape; };
  const Alloc allocs[] = {
      {&s->residual, DType::kF32, {T, H}},           {&s->normed, DType::kBF16, {T, H}},
      {&s->qkv, DType::kBF16, {T, qkv_width}},        {&s->q, DType::kBF16, {T, c.q_size()}},
      {&s->attended, DType::kBF16, {T, c.q_size()}},  {&s->delta, DType::kF32, {T, H}},
      {&s->router_logits, DType::kF32, {T, E}},       {&s->expert_ids, DType::kI32, {T, kk}},
      {&s->expert_weights, DType::kF32, {T, kk}},     {&s->expert_offsets, DType::kI32, {E + 1}},
      {&s->tile_offsets, DType::kI32, {E + 1}},       {&s->sorted_token, DType::kI32, {T * kk}},
      {&s->row_of, DType::kI32, {T * kk}},            {&s->act, DType::kBF16, {T * kk, std::max(moe_inter, inter)}},
      {&s->expert_rows, DType::kF32, {T * kk, H}},    {&s->gate_up, DType::kBF16, {T, 2 * inter}},
      {&s->logit_rows, DType::kBF16, {T, H}},         {&s->logits, DType::kF32, {T, c.vocab_size}},
      {&s->greedy, DType::kI32, {T}},                 {&s->token_ids, DType::kI32, {T}},
      {&s->positions, DType::kI32, {T}},              {&s->token_seq, DType::kI32, {T}},
      {&s->logits_rows, DType::kI32, {T}},           {&s->attention_workspace, DType::kF32, {16 << 20}},
      {&s->attention_groups, DType::kI32, {T + 1}},
      {&s->x_fp8, DType::kF8E4M3, {T, fp8_width}},  {&s->x_scales, DType::kF32, {T, (fp8_width + 127) / 128}},
      {&s->act_fp8, DType::kF8E4M3, {T * kk, moe_inter}}, {&s->act_scales, DType::kF32, {T * kk, (moe_inter + 127) / 128}},
  };
  for (const auto& a : allocs) MOE_RETURN_IF_ERROR(track(*a.t, DeviceTensor::allocate(a.dtype, a.shape)));
  if (options.comm != nullptr) MOE_RETURN_IF_ERROR(track(s->delta_bf16, DeviceTensor::allocate(DType::kBF16, {T, H})));
  if (s->fp8_attention) {
    MOE_RETURN_IF_ERROR(track(s->dense_offsets, DeviceTensor::allocate(DType::kI32, {2})));
    MOE_RETURN_IF_ERROR(track(s->dense_tile_offsets, DeviceTensor::allocate(DType::kI32, {2})));
    MOE_RETURN_IF_ERROR(track(s->qkv_f32, DeviceTensor::allocate(DType::kF32, {T, qkv_width})));
  }
  MOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s->stream));
  s->weights_and_activations_bytes = s->bytes;
  const int64_t max_model_len = options.max_model_len > 0 ? options.max_model_len : std::max<int64_t>(c.max_position_embeddings, 1);
  s->max_pages_per_seq = static_cast<int>((max_model_len + options.page_size - 1) / options.page_size);
  const bool size_from_memory = s->options.num_pages == 0;
  // Sized from memory: a pool just large enough for a warm-up forward pass of
  // max_num_tokens first, so what that pass allocates (cuBLASLt workspaces,
  // kernel modules loaded on first launch) is counted before the real pool.
  const int warmup_tokens = static_cast<int>(std::min<int64_t>(T, max_model_len));
  const int32_t warmup_pages = (warmup_tokens + options.page_size - 1) / options.page_size;
  auto model = std::unique_ptr<CudaQwen3MoeModel>(new CudaQwen3MoeModel(std::move(s)));
  if (options.mtp != nullptr) MOE_RETURN_IF_ERROR(model->upload_mtp(*options.mtp));
  MOE_RETURN_IF_ERROR(model->allocate_kv_pool(size_from_memory ? warmup_pages : options.num_pages));
  // Ranks finish their uploads at different times: meet before the warm-up's collectives.
  if (options.comm != nullptr) MOE_RETURN_IF_ERROR(options.comm->barrier());
  if (size_from_memory) MOE_RETURN_IF_ERROR(model->size_kv_pool_after_warm_up(warmup_tokens));
  const State& st = *model->state_;
  log_info("CUDA model on device {}: {:.2f} GB of weights and activations{}, KV cache {} pages of {} tokens = {} tokens "
           "({:.2f} GB)", options.device, st.weights_and_activations_bytes / 1e9, st.mtp_layer ? " (MTP layer included)" : "", st.options.num_pages,
           options.page_size, static_cast<int64_t>(st.options.num_pages) * options.page_size,
           static_cast<double>(model->kv_page_bytes()) * st.options.num_pages / 1e9);
  return model;
}

// Bytes of one page in every layer (the MTP layer's too): K and V, bf16.
size_t CudaQwen3MoeModel::kv_page_bytes() const {
  const ModelConfig& c = config();
  const size_t layers = static_cast<size_t>(c.num_layers) + (state_->mtp_layer ? 1 : 0);
  return layers * 2 * c.num_kv_heads * state_->options.page_size * c.head_dim * 2;
}

// The MTP layer's weights (plain tensors of any float dtype, uploaded as bf16)
// and its activation buffers. Its KV pool comes with the target's.
Status CudaQwen3MoeModel::upload_mtp(const MtpWeights& weights) {
  State& s = *state_;
  const ModelConfig& c = config();
  const LayerWeights& w = weights.layer();
  if (w.is_moe && c.num_experts == 0) return invalid_argument("an MoE MTP layer needs a target with experts");
  auto track = [&](DeviceTensor& t, Expected<DeviceTensor> made) -> Status {
    if (!made) return made.status();
    t = std::move(made).value();
    s.bytes += t.num_bytes();
    return Status::ok();
  };
  auto b = std::make_unique<LayerBuffers>();
  b->is_moe = w.is_moe;  // plain (bf16) experts: the MTP layer is never quantized
  MOE_RETURN_IF_ERROR(track(s.mtp_embed_norm, upload_bf16({weights.embed_norm()})));
  MOE_RETURN_IF_ERROR(track(s.mtp_hidden_norm, upload_bf16({weights.hidden_norm()})));
  MOE_RETURN_IF_ERROR(track(s.mtp_fc, upload_bf16({weights.fc()})));
  MOE_RETURN_IF_ERROR(track(s.mtp_final_norm, upload_bf16({weights.final_norm()})));
  MOE_RETURN_IF_ERROR(track(b->input_norm, upload_bf16({w.input_norm})));
  MOE_RETURN_IF_ERROR(track(b->post_attention_norm, upload_bf16({w.post_attention_norm})));
  MOE_RETURN_IF_ERROR(track(b->qkv_proj, upload_bf16({w.q_proj, w.k_proj, w.v_proj})));
  MOE_RETURN_IF_ERROR(track(b->o_proj, upload_bf16({w.o_proj})));
  MOE_RETURN_IF_ERROR(track(b->q_norm, upload_bf16({w.q_norm})));
  MOE_RETURN_IF_ERROR(track(b->k_norm, upload_bf16({w.k_norm})));
  if (w.is_moe) MOE_RETURN_IF_ERROR(track(b->router, upload_bf16({w.router})));
  MOE_RETURN_IF_ERROR(track(b->w13, upload_bf16({w.w13})));
  MOE_RETURN_IF_ERROR(track(b->w2, upload_bf16({w.w2})));
  const int64_t T = s.options.max_num_tokens, H = c.hidden_size;
  MOE_RETURN_IF_ERROR(track(s.mtp_h, DeviceTensor::allocate(DType::kF32, {T, H})));
  MOE_RETURN_IF_ERROR(track(s.mtp_g, DeviceTensor::allocate(DType::kBF16, {T, H})));
  MOE_RETURN_IF_ERROR(track(s.mtp_concat, DeviceTensor::allocate(DType::kBF16, {T, 2 * H})));
  s.mtp_layer = std::move(b);
  s.weights_and_activations_bytes = s.bytes;
  log_info("CUDA model: the MTP layer ({} MLP) runs on the GPU", w.is_moe ? "MoE" : "dense");
  return Status::ok();
}

// (Re)allocates the KV pool: every layer's K and V pages, num_pages + 1 per
// pool, the last being the scratch page that padding tokens of graph replays
// use, in one allocation laid out as model/cuda/kv_pool.h says.
Status CudaQwen3MoeModel::allocate_kv_pool(int32_t num_pages) {
  State& s = *state_;
  const ModelConfig& c = config();
  for (auto& b : s.layers) b.k_pages = b.v_pages = TensorView();
  s.bytes -= s.kv_pool.size();
  s.kv_pool = DeviceBuffer();
  for (auto& [key, exec] : s.graphs) cudaGraphExecDestroy(exec);  // they captured the old pool's addresses
  s.graphs.clear();
  s.kv_layout = {c.num_layers, c.num_kv_heads, c.head_dim, s.options.page_size, num_pages + 1};
  MOE_ASSIGN_OR_RETURN(s.kv_pool, DeviceBuffer::allocate(s.kv_layout.num_bytes()));
  s.bytes += s.kv_pool.size();
  // Finite contents from the start: positions past a sequence's end are
  // masked, but the tensor cores still multiply them by zero.
  MOE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(s.kv_pool.data(), 0, s.kv_pool.size(), s.stream));
  const Shape kv_shape{num_pages + 1, c.num_kv_heads, s.options.page_size, c.head_dim};
  auto* base = s.kv_pool.data_as<uint8_t>();
  for (int l = 0; l < c.num_layers; ++l) {
    LayerBuffers& b = s.layers[l];
    b.k_pages = TensorView(base + s.kv_layout.k_offset(l), DType::kBF16, kv_shape, Device::cuda(s.options.device));
    b.v_pages = TensorView(base + s.kv_layout.v_offset(l), DType::kBF16, kv_shape, Device::cuda(s.options.device));
  }
  if (s.mtp_layer) {  // the MTP layer's pool: one layer, the same pages
    LayerBuffers& m = *s.mtp_layer;
    m.k_pages = m.v_pages = TensorView();
    s.bytes -= s.mtp_kv_pool.size();
    s.mtp_kv_pool = DeviceBuffer();
    s.mtp_kv_layout = {1, c.num_kv_heads, c.head_dim, s.options.page_size, num_pages + 1};
    MOE_ASSIGN_OR_RETURN(s.mtp_kv_pool, DeviceBuffer::allocate(s.mtp_kv_layout.num_bytes()));
    s.bytes += s.mtp_kv_pool.size();
    MOE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(s.mtp_kv_pool.data(), 0, s.mtp_kv_pool.size(), s.stream));
    auto* mtp_base = s.mtp_kv_pool.data_as<uint8_t>();
    m.k_pages = TensorView(mtp_base + s.mtp_kv_layout.k_offset(0), DType::kBF16, kv_shape, Device::cuda(s.options.device));
    m.v_pages = TensorView(mtp_base + s.mtp_kv_layout.v_offset(0), DType::kBF16, kv_shape, Device::cuda(s.options.device));
  }
  s.options.num_pages = num_pages;
  return cuda_status(cudaStreamSynchronize(s.stream), "KV pool allocation");
}

// Runs one prefill of `tokens` tokens through the warm-up pool, then gives
// the pool what --gpu-memory-utilization leaves of the device's memory.
Status CudaQwen3MoeModel::size_kv_pool_after_warm_up(int tokens) {
  State& s = *state_;
  ForwardBatch batch;
  batch.token_ids.assign(tokens, 0);
  for (int t = 0; t < tokens; ++t) batch.positions.push_back(t);
  batch.query_start = {0, tokens};
  batch.max_pages_per_seq = s.options.num_pages;
  for (int32_t page = 0; page < s.options.num_pages; ++page) batch.page_table.push_back(page);
  batch.logits_rows = {tokens - 1};
  MOE_RETURN_IF_ERROR(forward_greedy(batch).status());
  MOE_RETURN_IF_ERROR(allocate_kv_pool(0));  // keep only the scratch page while measuring
  size_t free_bytes = 0, total_bytes = 0;
  MOE_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
  const double budget = s.options.gpu_memory_utilization * static_cast<double>(total_bytes) -
                        static_cast<double>(total_bytes - free_bytes);
  const double pages = budget / static_cast<double>(kv_page_bytes());
  if (pages < 1)
    return resource_exhausted("no GPU memory left for the KV cache: this process holds {:.1f} GB of {:.1f} GB after a "
                              "warm-up pass ({:.1f} GB of weights and activations), --gpu-memory-utilization {} allows "
                              "{:.1f} GB",
                              (total_bytes - free_bytes) / 1e9, total_bytes / 1e9, s.weights_and_activations_bytes / 1e9,
                              s.options.gpu_memory_utilization, s.options.gpu_memory_utilization * total_bytes / 1e9);
  log_info("CUDA warm-up pass of {} tokens: {:.2f} GB in use on the device afterwards", tokens,
           (total_bytes - free_bytes) / 1e9);
  return allocate_kv_pool(static_cast<int32_t>(std::min<double>(pages, INT32_MAX - 1)));
}

// What the kernels of one step need to know; its buffers are already on the device.
struct StepShape {
  int num_tokens = 0, num_rows = 0, num_groups = 0, max_position = 0, stride = 0;
  bool prefill = false;
};

// Uploads the step's metadata. padded_tokens > 0 (a decode step replayed as a
// CUDA graph) pads the batch to that many tokens, one sequence per token, the
// padding reading and writing the scratch KV page, with the page table at the
// fixed stride the graph was captured with.
Expected<StepShape> CudaQwen3MoeModel::upload_step(const ForwardBatch& batch, int padded_tokens) {
  State& s = *state_;
  const int T = batch.num_tokens(), num_seqs = static_cast<int>(batch.query_start.size()) - 1;
  StepShape shape;
  shape.num_tokens = padded_tokens > 0 ? padded_tokens : T;
  shape.num_rows = padded_tokens > 0 ? padded_tokens : static_cast<int>(batch.logits_rows.size());
  shape.stride = padded_tokens > 0 ? graph_stride(batch.max_pages_per_seq) : batch.max_pages_per_seq;
  shape.max_position = padded_tokens > 0 ? shape.stride * s.options.page_size - 1
                                         : (batch.positions.empty() ? 0 : *std::max_element(batch.positions.begin(),
                                                                                               batch.positions.end()));
  std::vector<int32_t> token_ids = batch.token_ids, positions = batch.positions, token_seq(static_cast<size_t>(T));
  for (int seq = 0; seq < num_seqs; ++seq)
    for (int t = batch.query_start[seq]; t < batch.query_start[seq + 1]; ++t) token_seq[t] = seq;
  std::vector<int32_t> page_table = batch.page_table, logits_rows = batch.logits_rows;
  if (padded_tokens > 0) {
    const int32_t scratch = s.options.num_pages;  // the extra page past the scheduler's pool
    token_ids.resize(padded_tokens, 0);
    positions.resize(padded_tokens, 0);
    logits_rows.resize(padded_tokens);
    page_table.assign(static_cast<size_t>(padded_tokens) * shape.stride, scratch);
    for (int t = 0; t < padded_tokens; ++t) {
      logits_rows[t] = t;
      if (t >= T) token_seq.push_back(t);
      for (int p = 0; t < T && p < batch.max_pages_per_seq; ++p) {
        const int32_t page = batch.page_table[static_cast<size_t>(t) * batch.max_pages_per_seq + p];
        if (page >= 0) page_table[static_cast<size_t>(t) * shape.stride + p] = page;
      }
    }
  }
  if (s.page_table.data() == nullptr || s.page_table.num_bytes() < page_table.size() * sizeof(int32_t)) {
    // The captured decode graphs read the old buffer: drop them (each is
    // captured again on its next use). Without this a graph replayed after a
    // larger batch grew the table read freed memory (compute-sanitizer, two
    // requests of different page counts on an engine with a fixed pool).
    for (auto& [key, exec] : s.graphs) cudaGraphExecDestroy(exec);
    s.graphs.clear();
    MOE_ASSIGN_OR_RETURN(s.page_table, DeviceTensor::allocate(DType::kI32, {static_cast<int64_t>(page_table.size())}));
  }
  auto copy_in = [&](const DeviceTensor& dst, const std::vector<int32_t>& src) {
    return cuda_status(cudaMemcpyAsync(dst.data(), src.data(), src.size() * sizeof(int32_t), cudaMemcpyHostToDevice,
                                       s.stream), "metadata upload");
  };
  MOE_RETURN_IF_ERROR(copy_in(s.token_ids, token_ids));
  MOE_RETURN_IF_ERROR(copy_in(s.positions, positions));
  MOE_RETURN_IF_ERROR(copy_in(s.token_seq, token_seq));
  MOE_RETURN_IF_ERROR(copy_in(s.page_table, page_table));
  MOE_RETURN_IF_ERROR(copy_in(s.logits_rows, logits_rows));
  if (s.fp8_attention) {  // the attention projections' grouped GEMMs: one group of every token
    const int tokens = shape.num_tokens, tile = dense_tile_rows(tokens);
    MOE_RETURN_IF_ERROR(copy_in(s.dense_offsets, {0, tokens}));
    MOE_RETURN_IF_ERROR(copy_in(s.dense_tile_offsets, {0, (tokens + tile - 1) / tile}));
  }
  // Prefill (any sequence with several new tokens) shares K/V chunks between a sequence's tokens.
  for (int seq = 0; seq < num_seqs; ++seq) shape.prefill |= batch.query_start[seq + 1] - batch.query_start[seq] > 1;
  if (shape.prefill) {
    const std::vector<int32_t> groups =
        k::prefill_token_groups(batch.query_start, k::prefill_group_tokens(config().num_q_heads, config().num_kv_heads));
    shape.num_groups = static_cast<int>(groups.size()) - 1;
    MOE_RETURN_IF_ERROR(copy_in(s.attention_groups, groups));
  }
  return shape;
}

// Row tiles of the FP8 attention projections' grouped GEMMs (one group):
// the memory-bound 64-row kernel for decode steps (every CUDA-graph bucket,
// <= 512 tokens), the compute-bound 128-row one above; mxfp8 has 64-row tiles only.
int CudaQwen3MoeModel::dense_tile_rows(int num_tokens) const {
  return !state_->mx_experts && num_tokens > 512 ? k::kPrefillGemmTileRows : k::kGroupedGemmTileRows;
}

// The page-table stride of a graph: the batch's, rounded up to a power of two
// (so few graphs cover all context lengths), at most max_pages_per_seq.
int CudaQwen3MoeModel::graph_stride(int max_pages_per_seq) const {
  int stride = 1;
  while (stride < max_pages_per_seq) stride *= 2;
  return std::min(stride, state_->max_pages_per_seq);
}

// Decode steps (one new token per sequence, logits for every token) replay a
// CUDA graph captured once per (bucket of batch sizes, page-table stride).
int CudaQwen3MoeModel::graph_bucket(const ForwardBatch& batch) const {
  const State& s = *state_;
  const int T = batch.num_tokens();
  if (!s.options.use_cuda_graphs || s.layer_hook || T == 0 || batch.max_pages_per_seq > s.max_pages_per_seq) return 0;
  if (static_cast<int>(batch.query_start.size()) != T + 1 || static_cast<int>(batch.logits_rows.size()) != T) return 0;
  for (int t = 0; t < T; ++t)
    if (batch.query_start[t + 1] != t + 1 || batch.logits_rows[t] != t) return 0;
  for (int bucket : {1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512})
    if (bucket >= T && bucket <= s.options.max_num_tokens) return bucket;
  return 0;
}

Status CudaQwen3MoeModel::run(const ForwardBatch& batch) {
  State& s = *state_;
  // The engine thread is not the one that created the model: make its device current.
  MOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(s.options.device));
  const int T = batch.num_tokens();
  if (T > s.options.max_num_tokens)
    return invalid_argument("batch of {} tokens exceeds max_num_tokens {}", T, s.options.max_num_tokens);
  if (static_cast<int>(batch.logits_rows.size()) > T) return invalid_argument("more logits rows than tokens");
  const int bucket = graph_bucket(batch);
  MOE_ASSIGN_OR_RETURN(const StepShape shape, upload_step(batch, bucket));
  if (bucket == 0) return launch_step(shape);
  const int64_t key = static_cast<int64_t>(bucket) << 32 | shape.stride;
  if (auto it = s.graphs.find(key); it != s.graphs.end())
    return cuda_status(cudaGraphLaunch(it->second, s.stream), "cudaGraphLaunch");
  // First time at this size: run it eagerly (warming every lazy initialisation), then capture.
  MOE_RETURN_IF_ERROR(launch_step(shape));
  MOE_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(s.stream, cudaStreamCaptureModeThreadLocal));
  const Status launched = launch_step(shape);
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(s.stream, &graph);
  MOE_RETURN_IF_ERROR(launched);
  MOE_CUDA_RETURN_IF_ERROR(ended);
  cudaGraphExec_t exec = nullptr;
  const cudaError_t instantiated = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  MOE_CUDA_RETURN_IF_ERROR(instantiated);
  s.graphs[key] = exec;
  log_debug("captured the decode step for {} tokens, page-table stride {}, as a CUDA graph", bucket, shape.stride);
  return Status::ok();
}

Status CudaQwen3MoeModel::launch_step(const StepShape& shape) {
  State& s = *state_;
  const ModelConfig& c = config();
  const int T = shape.num_tokens, H = static_cast<int>(c.hidden_size);
#define MOE_LAUNCH(call) MOE_RETURN_IF_ERROR(cuda_status((call), #call))
  MOE_LAUNCH(k::embedding({s.embed.data_as<bf16>(), s.token_ids.data_as<int32_t>(), s.residual.data_as<float>(), T, H,
                           static_cast<int>(c.vocab_size)}, s.stream));
  MOE_LAUNCH(k::add_rms_norm({s.residual.data_as<float>(), nullptr, s.layers[0].input_norm.data_as<bf16>(),
                              s.normed.data_as<bf16>(), T, H, c.rms_norm_eps}, s.stream));
  if (s.layer_hook && s.kv_written == nullptr)
    MOE_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&s.kv_written, cudaEventDisableTiming));
  for (int l = 0; l < c.num_layers; ++l) {
    const bf16* next_norm = l + 1 < c.num_layers ? s.layers[l + 1].input_norm.data_as<bf16>() : s.final_norm.data_as<bf16>();
    MOE_RETURN_IF_ERROR(launch_layer(s.layers[l], shape, next_norm, l));
    if (s.layer_hook) {
      // The rest of this layer is queued behind the KV store, so the GPU keeps
      // working while the hook hands the layer's pages to the transfer engine
      // (whose copies run on streams of their own and see the stored KV).
      MOE_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(s.kv_written));
      s.layer_hook(l);
    }
  }
  const int rows = shape.num_rows;
  MOE_LAUNCH(k::gather_rows({s.normed.data_as<bf16>(), s.logits_rows.data_as<int32_t>(), s.logit_rows.data_as<bf16>(),
                             rows, H}, s.stream));
  MOE_RETURN_IF_ERROR(s.gemm->matmul(s.logit_rows.data_as<bf16>(), s.lm_head.data_as<bf16>(), s.logits.data(),
                                     DType::kF32, rows, static_cast<int>(c.vocab_size), H, s.stream));
#undef MOE_LAUNCH
  return Status::ok();
}

Status CudaQwen3MoeModel::launch_layer(const LayerBuffers& b, const StepShape& shape, const void* next_norm, int layer) {
  State& s = *state_;
  const ModelConfig& c = config();
  const int T = shape.num_tokens, H = static_cast<int>(c.hidden_size);
  const int max_position = shape.max_position, qkv_width = c.q_size() + 2 * c.kv_size();
  const bool prefill = shape.prefill;
#define MOE_LAUNCH(call) MOE_RETURN_IF_ERROR(cuda_status((call), #call))
  // In place: x [T, cols] bf16 -> bf16(e4m3(x / s) * s) per 1 x 128 group (mxfp8: per 1 x 32, E8M0 s).
  auto fake_quantize = [&](DeviceTensor& x, int cols) -> Status {
    if (s.mx_experts) {
      MOE_LAUNCH(k::quantize_mxfp8({x.data_as<bf16>(), s.x_fp8.data_as<uint8_t>(), nullptr, T, cols,
                                    x.data_as<bf16>()}, s.stream));
    } else {
      MOE_LAUNCH(k::quantize_fp8_groups({x.data_as<bf16>(), s.x_fp8.data_as<uint8_t>(), nullptr, T, cols,
                                         x.data_as<bf16>()}, s.stream));
    }
    return Status::ok();
  };
  // FP8 experts: activations quantized per 1 x 128 (mxfp8: per 1 x 32), scaled grouped GEMMs.
  // Prefill-sized batches (experts average >= 64 rows) take the compute-bound
  // kernels with 128-row tiles; decode steps, CUDA graphs and mxfp8 the 64-row ones.
  const int moe_tile_rows = c.num_experts > 0 && !b.mx_experts
                                ? k::moe_tile_rows(int64_t{T} * c.num_experts_per_tok, c.num_experts)
                                : k::kGroupedGemmTileRows;
  const bool prefill_gemm = moe_tile_rows == k::kPrefillGemmTileRows;
  auto fp8_experts_step = [&](int max_tiles) -> Status {
    const int E = s.num_local_experts, topk = c.num_experts_per_tok, inter = static_cast<int>(c.moe_intermediate_size);
    // One expert GEMM: quantize `in` [rows, K], then gate_up (gathered by sorted_token) or down.
    auto gemm = [&](const DeviceTensor& in, DeviceTensor& in_q, DeviceTensor& in_s, int rows, int K,
                    const int32_t* gather, const DeviceTensor& w, const DeviceTensor& w_scales, void* out, int N,
                    bool gate_up) -> Status {
      if (b.mx_experts) {  // 64-row tiles only (moe_tile_rows)
        MOE_LAUNCH(k::quantize_mxfp8({in.data_as<bf16>(), in_q.data_as<uint8_t>(), in_s.data_as<uint8_t>(), rows, K},
                                     s.stream));
        MOE_LAUNCH(k::mxfp8_grouped_gemm({in_q.data_as<uint8_t>(), in_s.data_as<uint8_t>(), gather,
                                          w.data_as<uint8_t>(), w_scales.data_as<uint8_t>(),
                                          s.expert_offsets.data_as<int32_t>(), s.tile_offsets.data_as<int32_t>(), out,
                                          N, K, E, max_tiles, gate_up}, s.stream));
        return Status::ok();
      }
      MOE_LAUNCH(k::quantize_fp8_groups({in.data_as<bf16>(), in_q.data_as<uint8_t>(), in_s.data_as<float>(), rows, K},
                                        s.stream));
      MOE_LAUNCH((prefill_gemm ? k::fp8_grouped_gemm_prefill : k::fp8_grouped_gemm)(
          {in_q.data_as<uint8_t>(), in_s.data_as<float>(), gather, w.data_as<uint8_t>(), w_scales.data_as<float>(),
           s.expert_offsets.data_as<int32_t>(), s.tile_offsets.data_as<int32_t>(), out, N, K, E, max_tiles, gate_up},
          s.stream));
      return Status::ok();
    };
    MOE_RETURN_IF_ERROR(gemm(s.normed, s.x_fp8, s.x_scales, T, H, s.sorted_token.data_as<int32_t>(), b.w13,
                             b.w13_scales, s.act.data(), inter, true));
    return gemm(s.act, s.act_fp8, s.act_scales, T * topk, inter, nullptr, b.w2, b.w2_scales, s.expert_rows.data(), H,
                false);
  };
  // An attention projection in FP8: `in` [T, K] quantized as the experts'
  // inputs are, then the grouped GEMM with one group, f32 rows out.
  auto fp8_projection = [&](const DeviceTensor& in, int K, const DeviceTensor& w, const DeviceTensor& w_scales,
                            void* out, int N) -> Status {
    const int tile = dense_tile_rows(T), tiles = (T + tile - 1) / tile + 1;
    if (s.mx_experts) {
      MOE_LAUNCH(k::quantize_mxfp8({in.data_as<bf16>(), s.x_fp8.data_as<uint8_t>(), s.x_scales.data_as<uint8_t>(), T,
                                    K}, s.stream));
      MOE_LAUNCH(k::mxfp8_grouped_gemm({s.x_fp8.data_as<uint8_t>(), s.x_scales.data_as<uint8_t>(), nullptr,
                                        w.data_as<uint8_t>(), w_scales.data_as<uint8_t>(),
                                        s.dense_offsets.data_as<int32_t>(), s.dense_tile_offsets.data_as<int32_t>(),
                                        out, N, K, 1, tiles, false}, s.stream));
      return Status::ok();
    }
    MOE_LAUNCH(k::quantize_fp8_groups({in.data_as<bf16>(), s.x_fp8.data_as<uint8_t>(), s.x_scales.data_as<float>(), T, K},
                                      s.stream));
    MOE_LAUNCH((tile == k::kPrefillGemmTileRows ? k::fp8_grouped_gemm_prefill : k::fp8_grouped_gemm)(
        {s.x_fp8.data_as<uint8_t>(), s.x_scales.data_as<float>(), nullptr, w.data_as<uint8_t>(),
         w_scales.data_as<float>(), s.dense_offsets.data_as<int32_t>(), s.dense_tile_offsets.data_as<int32_t>(), out, N,
         K, 1, tiles, false},
        s.stream));
    return Status::ok();
  };
  // Attention.
  if (b.fp8_attention) {
    MOE_RETURN_IF_ERROR(fp8_projection(s.normed, H, b.qkv_proj, b.qkv_scales, s.qkv_f32.data(), qkv_width));
    MOE_LAUNCH(k::cast_to_bf16({s.qkv_f32.data_as<float>(), s.qkv.data_as<bf16>(), int64_t{T} * qkv_width}, s.stream));
  } else {
    if (b.fake_quant_attention) MOE_RETURN_IF_ERROR(fake_quantize(s.normed, H));
    MOE_RETURN_IF_ERROR(s.gemm->matmul(s.normed.data_as<bf16>(), b.qkv_proj.data_as<bf16>(), s.qkv.data(),
                                       DType::kBF16, T, qkv_width, H, s.stream));
  }
  MOE_LAUNCH(k::qk_norm_rope_kv({s.qkv.data_as<bf16>(), b.q_norm.data_as<bf16>(), b.k_norm.data_as<bf16>(),
                                 s.inv_freq.data_as<float>(), s.attention_factor, s.positions.data_as<int32_t>(),
                                 s.token_seq.data_as<int32_t>(), s.page_table.data_as<int32_t>(), s.q.data_as<bf16>(),
                                 b.k_pages.data_as<bf16>(), b.v_pages.data_as<bf16>(), T, c.num_q_heads,
                                 c.num_kv_heads, c.head_dim, s.options.page_size, shape.stride,
                                 c.rms_norm_eps}, s.stream));
  if (s.layer_hook && layer >= 0) MOE_CUDA_RETURN_IF_ERROR(cudaEventRecord(s.kv_written, s.stream));
  const k::PagedAttentionParams attention{s.q.data_as<bf16>(), b.k_pages.data_as<bf16>(), b.v_pages.data_as<bf16>(),
                                          s.positions.data_as<int32_t>(), s.token_seq.data_as<int32_t>(),
                                          s.page_table.data_as<int32_t>(), s.attended.data_as<bf16>(), T, c.num_q_heads,
                                          c.num_kv_heads, c.head_dim, s.options.page_size, shape.stride,
                                          1.0f / std::sqrt(static_cast<float>(c.head_dim))};
  if (k::mma_attention_supported(attention) && prefill) {
    MOE_LAUNCH(k::prefill_attention(attention, s.attention_groups.data_as<int32_t>(), shape.num_groups, s.stream));
  } else if (k::mma_attention_supported(attention)) {
    MOE_LAUNCH(k::mma_paged_attention(attention, max_position, s.attention_workspace.data_as<float>(),
                                      s.attention_workspace.num_bytes(), s.stream));
  } else {
    MOE_LAUNCH(k::paged_attention(attention, s.stream));
  }
  if (b.fp8_attention) {
    MOE_RETURN_IF_ERROR(fp8_projection(s.attended, static_cast<int>(c.q_size()), b.o_proj, b.o_scales, s.delta.data(), H));
  } else {
    if (b.fake_quant_attention) MOE_RETURN_IF_ERROR(fake_quantize(s.attended, static_cast<int>(c.q_size())));
    MOE_RETURN_IF_ERROR(s.gemm->matmul(s.attended.data_as<bf16>(), b.o_proj.data_as<bf16>(), s.delta.data(),
                                       DType::kF32, T, H, c.q_size(), s.stream));
  }
  MOE_RETURN_IF_ERROR(layer_boundary(b.post_attention_norm.data_as<bf16>(), T, layer >= 0 && s.options.plan.tp_size > 1));
  // MLP.
  if (b.is_moe) {
    const int E = c.num_experts, topk = c.num_experts_per_tok, inter = static_cast<int>(c.moe_intermediate_size);
    MOE_RETURN_IF_ERROR(s.gemm->matmul(s.normed.data_as<bf16>(), b.router.data_as<bf16>(), s.router_logits.data(),
                                       DType::kF32, T, E, H, s.stream));
    MOE_LAUNCH(k::route_topk({s.router_logits.data_as<float>(), s.expert_ids.data_as<int32_t>(),
                              s.expert_weights.data_as<float>(), T, E, topk, c.norm_topk_prob}, s.stream));
    // This rank's experts only (all of them without expert parallelism): the
    // grouped GEMMs below run E_local experts; the other ranks' pairs get no row.
    const int E_local = s.num_local_experts;
    MOE_LAUNCH(k::moe_permute({s.expert_ids.data_as<int32_t>(), s.expert_offsets.data_as<int32_t>(),
                               s.tile_offsets.data_as<int32_t>(), s.sorted_token.data_as<int32_t>(),
                               s.row_of.data_as<int32_t>(), T, topk, E_local, moe_tile_rows, s.first_expert},
                              s.stream));
    const int max_tiles = (T * topk + moe_tile_rows - 1) / moe_tile_rows + E_local;
    const auto gemm = prefill_gemm ? k::wgmma_grouped_gemm_prefill : k::grouped_gemm;
    if (b.fp8_experts) {
      MOE_RETURN_IF_ERROR(fp8_experts_step(max_tiles));
    } else {
      MOE_LAUNCH(gemm({s.normed.data_as<bf16>(), s.sorted_token.data_as<int32_t>(), b.w13.data_as<bf16>(),
                                  s.expert_offsets.data_as<int32_t>(), s.tile_offsets.data_as<int32_t>(), s.act.data(),
                                  inter, H, E_local, max_tiles, true}, s.stream));
      MOE_LAUNCH(gemm({s.act.data_as<bf16>(), nullptr, b.w2.data_as<bf16>(),
                                  s.expert_offsets.data_as<int32_t>(), s.tile_offsets.data_as<int32_t>(),
                                  s.expert_rows.data(), H, inter, E_local, max_tiles, false}, s.stream));
    }
    MOE_LAUNCH(k::moe_unpermute({s.expert_rows.data_as<float>(), s.row_of.data_as<int32_t>(),
                                 s.expert_weights.data_as<float>(), s.delta.data_as<float>(), T, topk, H}, s.stream));
  } else {
    const int inter = static_cast<int>(c.intermediate_size);
    if (b.fake_quant_mlp) MOE_RETURN_IF_ERROR(fake_quantize(s.normed, H));
    MOE_RETURN_IF_ERROR(s.gemm->matmul(s.normed.data_as<bf16>(), b.w13.data_as<bf16>(), s.gate_up.data(), DType::kBF16,
                                       T, 2 * inter, H, s.stream));
    MOE_LAUNCH(k::silu_mul({s.gate_up.data_as<bf16>(), s.act.data_as<bf16>(), T, inter}, s.stream));
    if (b.fake_quant_mlp) MOE_RETURN_IF_ERROR(fake_quantize(s.act, inter));
    MOE_RETURN_IF_ERROR(s.gemm->matmul(s.act.data_as<bf16>(), b.w2.data_as<bf16>(), s.delta.data(), DType::kF32, T, H,
                                       inter, s.stream));
  }
  // Partial sums to reduce: a MoE layer's under expert parallelism, a dense one's under tensor parallelism.
  const bool reduce = layer >= 0 && (b.is_moe ? s.options.plan.ep_size > 1 : s.options.plan.tp_size > 1);
  MOE_RETURN_IF_ERROR(layer_boundary(static_cast<const bf16*>(next_norm), T, reduce));
#undef MOE_LAUNCH
  return Status::ok();
}

// residual += delta (summed over the ranks when `reduce`), then the next norm into `normed`.
Status CudaQwen3MoeModel::layer_boundary(const void* norm_weight, int num_tokens, bool reduce) {
  State& s = *state_;
  const ModelConfig& c = config();
  const int H = static_cast<int>(c.hidden_size);
  const auto* weight = static_cast<const bf16*>(norm_weight);
  if (!reduce)
    return cuda_status(k::add_rms_norm({s.residual.data_as<float>(), s.delta.data_as<float>(), weight,
                                        s.normed.data_as<bf16>(), num_tokens, H, c.rms_norm_eps}, s.stream),
                       "add_rms_norm");
  MOE_RETURN_IF_ERROR(cuda_status(k::cast_to_bf16({s.delta.data_as<float>(), s.delta_bf16.data_as<bf16>(),
                                                   int64_t{num_tokens} * H}, s.stream), "cast_to_bf16"));
  return s.options.comm->all_reduce_add_rms_norm(s.delta_bf16.data_as<bf16>(), s.residual.data_as<float>(), weight,
                                                 s.normed.data_as<bf16>(), num_tokens, H, c.rms_norm_eps, s.stream);
}

Status CudaQwen3MoeModel::fill_kv_random(uint64_t seed) {
  uint64_t id = 0;
  for (auto& layer : state_->layers)
    for (TensorView* t : {&layer.k_pages, &layer.v_pages})
      MOE_RETURN_IF_ERROR(cuda_status(k::fill_random({t->data_as<bf16>(), t->shape().num_elements(), seed + ++id, 0.0f,
                                                      1.0f}, state_->stream), "fill_random"));
  return cuda_status(cudaStreamSynchronize(state_->stream), "fill_kv_random");
}

Expected<Tensor> CudaQwen3MoeModel::forward(const ForwardBatch& batch) {
  Tensor unused;
  return forward_with_hidden(batch, {}, unused);
}

Expected<Tensor> CudaQwen3MoeModel::forward_with_hidden(const ForwardBatch& batch, std::span<const int32_t> hidden_rows,
                                                        Tensor& hidden) {
  State& s = *state_;
  MOE_RETURN_IF_ERROR(check_batch(batch, hidden_rows));
  MOE_RETURN_IF_ERROR(run(batch));
  const auto rows = static_cast<int64_t>(batch.logits_rows.size());
  Tensor logits(DType::kF32, {rows, config().vocab_size});
  MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(logits.data(), s.logits.data(), logits.num_bytes(), cudaMemcpyDeviceToHost,
                                           s.stream));
  MOE_RETURN_IF_ERROR(sync_and_fetch_hidden(batch.num_tokens(), hidden_rows, hidden));
  return logits;
}

Expected<std::vector<int32_t>> CudaQwen3MoeModel::forward_greedy_with_hidden(const ForwardBatch& batch,
                                                                              std::span<const int32_t> hidden_rows,
                                                                              Tensor& hidden) {
  State& s = *state_;
  MOE_RETURN_IF_ERROR(check_batch(batch, hidden_rows));
  MOE_RETURN_IF_ERROR(run(batch));
  const int rows = static_cast<int>(batch.logits_rows.size());
  MOE_CUDA_RETURN_IF_ERROR(ops::cuda::argmax({s.logits.data_as<float>(), s.greedy.data_as<int32_t>(), rows,
                                              static_cast<int>(config().vocab_size)}, s.stream));
  std::vector<int32_t> ids(static_cast<size_t>(rows));
  MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(ids.data(), s.greedy.data(), ids.size() * sizeof(int32_t),
                                           cudaMemcpyDeviceToHost, s.stream));
  MOE_RETURN_IF_ERROR(sync_and_fetch_hidden(batch.num_tokens(), hidden_rows, hidden));
  return ids;
}

Status CudaQwen3MoeModel::check_batch(const ForwardBatch& batch, std::span<const int32_t> hidden_rows) const {
  const int T = batch.num_tokens();
  if (T > state_->options.max_num_tokens)
    return invalid_argument("batch of {} tokens exceeds max_num_tokens {}", T, state_->options.max_num_tokens);
  if (static_cast<int>(batch.logits_rows.size()) > T) return invalid_argument("more logits rows than tokens");
  for (int32_t row : hidden_rows)
    if (row < 0 || row >= T) return invalid_argument("hidden state row {} of a {}-token batch", row, T);
  return Status::ok();
}

// After a forward pass, `normed` holds every token's final-normed state:
// copies `hidden_rows` of it behind the copies already queued, waits for the
// stream, and widens them to f32.
Status CudaQwen3MoeModel::sync_and_fetch_hidden(int num_tokens, std::span<const int32_t> hidden_rows, Tensor& hidden) {
  State& s = *state_;
  const int64_t H = config().hidden_size;
  std::vector<uint16_t> normed(hidden_rows.empty() ? 0 : static_cast<size_t>(num_tokens) * H);
  if (!normed.empty())
    MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(normed.data(), s.normed.data(), normed.size() * sizeof(uint16_t),
                                             cudaMemcpyDeviceToHost, s.stream));
  MOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s.stream));
  if (hidden_rows.empty()) return Status::ok();
  hidden = Tensor(DType::kF32, {static_cast<int64_t>(hidden_rows.size()), H});
  float* out = hidden.data_as<float>();
  for (size_t i = 0; i < hidden_rows.size(); ++i)
    for (int64_t j = 0; j < H; ++j) out[i * H + j] = bf16_to_float(normed[hidden_rows[i] * H + j]);
  return Status::ok();
}

// The MTP forward of model/mtp.h: e = rms_norm(embed(x)), g = rms_norm(h),
// u = [e ; g] fc^T (f32, the block's residual stream), the decoder block over
// the MTP's KV pages, its last norm being mtp.norm, then lm_head on the output rows.
Expected<MtpOutput> CudaQwen3MoeModel::forward_mtp(const MtpBatch& mb, TensorView hidden) {
  State& s = *state_;
  if (!s.mtp_layer) return invalid_argument("this CUDA model was created without an MTP layer");
  const ModelConfig& c = config();
  const int T = mb.num_tokens(), H = static_cast<int>(c.hidden_size);
  const auto rows = static_cast<int>(mb.output_rows.size());
  if (T > s.options.max_num_tokens)
    return invalid_argument("MTP batch of {} tokens exceeds max_num_tokens {}", T, s.options.max_num_tokens);
  if (hidden.dtype() != DType::kF32 || hidden.rank() != 2 || hidden.dim(0) != T || hidden.dim(1) != H)
    return invalid_argument("MTP hidden states must be [{}, {}] f32", T, H);
  if (rows > T) return invalid_argument("{} MTP output rows for {} tokens", rows, T);
  for (int32_t row : mb.output_rows)
    if (row < 0 || row >= T) return invalid_argument("MTP output row {} of a {}-token batch", row, T);
  MtpOutput out{Tensor(DType::kF32, {rows, c.hidden_size}), Tensor(DType::kF32, {rows, c.vocab_size})};
  if (T == 0) return out;
  MOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(s.options.device));
  ForwardBatch batch;
  batch.token_ids = mb.token_ids;
  batch.positions = mb.positions;
  batch.query_start = mb.query_start;
  batch.page_table = mb.page_table;
  batch.max_pages_per_seq = mb.max_pages_per_seq;
  batch.logits_rows = mb.output_rows;
  MOE_ASSIGN_OR_RETURN(const StepShape shape, upload_step(batch, 0));
#define MOE_LAUNCH(call) MOE_RETURN_IF_ERROR(cuda_status((call), #call))
  const size_t row_bytes = static_cast<size_t>(H) * sizeof(bf16);
  MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(s.mtp_h.data(), hidden.data(), hidden.num_bytes(), cudaMemcpyHostToDevice,
                                           s.stream));
  MOE_LAUNCH(k::embedding({s.embed.data_as<bf16>(), s.token_ids.data_as<int32_t>(), s.residual.data_as<float>(), T, H,
                           static_cast<int>(c.vocab_size)}, s.stream));
  MOE_LAUNCH(k::add_rms_norm({s.residual.data_as<float>(), nullptr, s.mtp_embed_norm.data_as<bf16>(),
                              s.normed.data_as<bf16>(), T, H, c.rms_norm_eps}, s.stream));
  MOE_LAUNCH(k::add_rms_norm({s.mtp_h.data_as<float>(), nullptr, s.mtp_hidden_norm.data_as<bf16>(),
                              s.mtp_g.data_as<bf16>(), T, H, c.rms_norm_eps}, s.stream));
  // [e ; g]: the two halves of each row of mtp_concat.
  MOE_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(s.mtp_concat.data(), 2 * row_bytes, s.normed.data(), row_bytes, row_bytes, T,
                                             cudaMemcpyDeviceToDevice, s.stream));
  MOE_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(s.mtp_concat.data_as<uint8_t>() + row_bytes, 2 * row_bytes, s.mtp_g.data(),
                                             row_bytes, row_bytes, T, cudaMemcpyDeviceToDevice, s.stream));
  MOE_RETURN_IF_ERROR(s.gemm->matmul(s.mtp_concat.data_as<bf16>(), s.mtp_fc.data_as<bf16>(), s.residual.data(),
                                     DType::kF32, T, H, 2 * H, s.stream));
  MOE_LAUNCH(k::add_rms_norm({s.residual.data_as<float>(), nullptr, s.mtp_layer->input_norm.data_as<bf16>(),
                              s.normed.data_as<bf16>(), T, H, c.rms_norm_eps}, s.stream));
  MOE_RETURN_IF_ERROR(launch_layer(*s.mtp_layer, shape, s.mtp_final_norm.data(), -1));
  std::vector<uint16_t> normed(static_cast<size_t>(rows) * H);
  if (rows > 0) {
    MOE_LAUNCH(k::gather_rows({s.normed.data_as<bf16>(), s.logits_rows.data_as<int32_t>(), s.logit_rows.data_as<bf16>(),
                               rows, H}, s.stream));
    MOE_RETURN_IF_ERROR(s.gemm->matmul(s.logit_rows.data_as<bf16>(), s.lm_head.data_as<bf16>(), s.logits.data(),
                                       DType::kF32, rows, static_cast<int>(c.vocab_size), H, s.stream));
    MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(out.logits.data(), s.logits.data(), out.logits.num_bytes(),
                                             cudaMemcpyDeviceToHost, s.stream));
    MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(normed.data(), s.logit_rows.data(), normed.size() * sizeof(uint16_t),
                                             cudaMemcpyDeviceToHost, s.stream));
  }
#undef MOE_LAUNCH
  MOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s.stream));
  float* h = out.hidden.data_as<float>();
  for (size_t i = 0; i < normed.size(); ++i) h[i] = bf16_to_float(normed[i]);
  return out;
}

Expected<std::vector<int32_t>> CudaQwen3MoeModel::forward_sample(const ForwardBatch& batch,
                                                                  std::span<const ops::cuda::SampleRow> rows) {
  if (rows.size() != batch.logits_rows.size())
    return invalid_argument("{} sampling rows for {} logits rows", rows.size(), batch.logits_rows.size());
  State& s = *state_;
  MOE_RETURN_IF_ERROR(run(batch));  // first: it makes the model's device current for the allocation below
  if (s.sample_rows.data() == nullptr || s.sample_rows.num_bytes() < rows.size_bytes()) {
    MOE_ASSIGN_OR_RETURN(s.sample_rows, DeviceTensor::allocate(DType::kU8, {static_cast<int64_t>(rows.size_bytes())}));
  }
  MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(s.sample_rows.data(), rows.data(), rows.size_bytes(), cudaMemcpyHostToDevice,
                                           s.stream));
  MOE_CUDA_RETURN_IF_ERROR(ops::cuda::sample({s.logits.data_as<float>(), s.sample_rows.data_as<ops::cuda::SampleRow>(),
                                              s.greedy.data_as<int32_t>(), static_cast<int>(rows.size()),
                                              static_cast<int>(config().vocab_size)}, s.stream));
  std::vector<int32_t> tokens(rows.size());
  MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(tokens.data(), s.greedy.data(), tokens.size() * sizeof(int32_t),
                                           cudaMemcpyDeviceToHost, s.stream));
  MOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s.stream));
  return tokens;
}

Expected<std::vector<int32_t>> CudaQwen3MoeModel::forward_greedy(const ForwardBatch& batch) {
  Tensor unused;
  return forward_greedy_with_hidden(batch, {}, unused);
}

}  // namespace moe::model
