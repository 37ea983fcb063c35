#include "model/cuda/cuda_model.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "core/cuda/device_buffer.h"
#include "core/logging.h"
#include "model/cuda/cuda_model_state.h"
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
  return create_explained(weights.config(), &weights, 0, options);
}

Expected<std::unique_ptr<CudaQwen3MoeModel>> CudaQwen3MoeModel::create_dummy(const ModelConfig& config, uint64_t seed,
                                                                             const CudaModelOptions& options) {
  return create_explained(config, nullptr, seed, options);
}

// What creation was placing on the GPU when it ran out of memory, how much it
// had placed before, and which flag gives it room.
struct CudaQwen3MoeModel::Placing {
  std::string what = "the model";
  size_t placed_bytes = 0;
  std::string advice;
  void set(std::string w, size_t placed, std::string a) {
    what = std::move(w);
    placed_bytes = placed;
    advice = std::move(a);
  }
};

namespace {
std::string weights_advice(bool fp8_experts) {
  return fmt::format("the weights do not fit on this GPU: {}split them over GPUs (--ep, --tp), or, with dummy weights, "
                     "serve fewer layers (--num-layers)",
                     fp8_experts ? "" : "quantize the experts (--quantization fp8-block), ");
}
}  // namespace

// create_impl, with an out-of-memory error turned into what was being placed
// and the flag to change (the bare cudaMalloc error names neither).
Expected<std::unique_ptr<CudaQwen3MoeModel>> CudaQwen3MoeModel::create_explained(const ModelConfig& config,
                                                                                 const ModelWeights* weights,
                                                                                 uint64_t seed,
                                                                                 const CudaModelOptions& options) {
  Placing placing;
  auto made = create_impl(config, weights, seed, options, placing);
  if (made || made.status().code() != StatusCode::kResourceExhausted ||
      made.status().message().find("out of memory") == std::string::npos)
    return made;
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) total_bytes = 0;
  return resource_exhausted("out of GPU memory placing {} ({:.1f} GB placed before it, on a GPU of {:.1f} GB): {} ({})",
                            placing.what, placing.placed_bytes / 1e9, total_bytes / 1e9, placing.advice,
                            made.status().message());
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
  MOE_RETURN_IF_ERROR(weights ? check_parallel_plan(full, *weights, plan)
                              : check_parallel_layout(full, plan));
  if (plan.dp_attention) {
    if (options.experts == nullptr || options.experts->world_size() != plan.ep_size ||
        options.experts->rank() != plan.ep_rank)
      return invalid_argument(
          "a data-parallel GPU rank {} of {} needs an expert exchange of that rank and size", plan.ep_rank,
          plan.ep_size);
    return Status::ok();
  }
  const int world = std::max(plan.tp_size, plan.ep_size), rank = plan.tp_size > 1 ? plan.tp_rank : plan.ep_rank;
  if (options.comm == nullptr || options.comm->world_size() != world || options.comm->rank() != rank)
    return invalid_argument("a GPU rank {} of {} needs a layer communicator of that rank and size", rank, world);
  return Status::ok();
}
}  // namespace

Expected<std::unique_ptr<CudaQwen3MoeModel>> CudaQwen3MoeModel::create_impl(const ModelConfig& full,
                                                                            const ModelWeights* weights, uint64_t seed,
                                                                            const CudaModelOptions& options,
                                                                            Placing& placing) {
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
  if ((options.comm != nullptr && !options.comm->graph_capturable()) ||
      (options.experts != nullptr && !options.experts->graph_capturable()))
    s->options.use_cuda_graphs = false;
  std::optional<RankWeights> rank_weights;
  if (weights != nullptr && !options.plan.single()) rank_weights.emplace(*weights, options.plan);
  // This rank's layer weights: its heads and MLP columns, its experts' rows.
  auto layer_weights = [&](int l) {
    if (!rank_weights) return weights->layer(l);
    LayerWeights w = rank_weights->layer(l);
    if (w.is_moe && options.plan.ep_size > 1) {
      const int64_t first = shard.first_expert, last = shard.first_expert + shard.num_experts;
      if (w.w13_quant.empty()) {
        w.w13 = w.w13.rows(first, last);
        w.w2 = w.w2.rows(first, last);
      } else {  // quantized experts (tensor parallelism over quantized weights is refused above)
        w.w13_quant = w.w13_quant.slice_stack(first, last);
        w.w2_quant = w.w2_quant.slice_stack(first, last);
      }
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
  placing.set("the embedding and lm_head", 0, weights_advice(false));
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
  if (options.experts != nullptr && s->mx_experts)
    return unimplemented(
        "mxfp8 experts on data-parallel GPU ranks (--dp): the exchange carries fp8-block "
        "activations (1 x 128 scales) only");
  if (options.experts != nullptr && options.experts->fp8_payload() != s->fp8_experts)
    return invalid_argument("{} experts need an expert exchange with a{} payload",
                            s->fp8_experts ? ops::quant_format_name(expert_format) : "bf16",
                            s->fp8_experts ? "n FP8" : " bf16");
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
    placing.set(fmt::format("the weights of layer {} of {}", l + 1, c.num_layers), s->bytes,
                weights_advice(s->fp8_experts));
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
    b.num_q_heads = c.num_q_heads, b.num_kv_heads = c.num_kv_heads;
    b.mlp_columns = static_cast<int>(c.intermediate_size);
    s->layers.push_back(std::move(b));
  }
  const int64_t T = options.max_num_tokens, H = c.hidden_size, kk = std::max(1, c.num_experts_per_tok);
  const int64_t moe_inter = std::max<int64_t>(c.moe_intermediate_size, 1), inter = std::max<int64_t>(c.intermediate_size, 1);
  const int64_t qkv_width = c.q_size() + 2 * c.kv_size(), E = std::max(1, c.num_experts);
  // Rows of the expert GEMMs: this rank's tokens' pairs, or (data-parallel
  // ranks) what the exchange may bring from every rank.
  const int64_t expert_rows = options.experts != nullptr ? T * kk * options.experts->world_size() : T * kk;
  const int64_t fp8_width = std::max<int64_t>({H, c.q_size(), inter});  // inputs quantized per 1 x 128
  s->max_logits_rows = options.max_logits_rows > 0
                           ? std::min<int64_t>(T, std::max<int64_t>(options.max_logits_rows, kMaxGraphTokens))
                           : T;
  placing.set(fmt::format("the activations for {} tokens a step", T), s->bytes,
              "lower --max-num-batched-tokens (and --max-num-seqs)");
  struct Alloc { DeviceTensor* t; DType dtype; Shape shape; };
  const Alloc allocs[] = {
      {&s->residual, DType::kF32, {T, H}},
      {&s->normed, DType::kBF16, {T, H}},
      {&s->qkv, DType::kBF16, {T, qkv_width}},
      {&s->q, DType::kBF16, {T, c.q_size()}},
      {&s->attended, DType::kBF16, {T, c.q_size()}},
      {&s->delta, DType::kF32, {T, H}},
      {&s->router_logits, DType::kF32, {T, E}},
      {&s->expert_ids, DType::kI32, {T, kk}},
      {&s->expert_weights, DType::kF32, {T, kk}},
      {&s->expert_offsets, DType::kI32, {E + 1}},
      {&s->tile_offsets, DType::kI32, {E + 1}},
      {&s->sorted_token, DType::kI32, {T * kk}},
      {&s->row_of, DType::kI32, {T * kk}},
      {&s->permute_counts, DType::kI32, {k::moe_permute_blocks(static_cast<int>(T * kk)), E}},
      {&s->act, DType::kBF16, {expert_rows, std::max(moe_inter, inter)}},
      {&s->expert_rows, DType::kF32, {expert_rows, H}},
      {&s->gate_up, DType::kBF16, {T, 2 * inter}},
      {&s->logit_rows, DType::kBF16, {T, H}},
      {&s->logits, DType::kF32, {s->max_logits_rows, c.vocab_size}},
      {&s->greedy, DType::kI32, {T}},
      {&s->sample_accepted, DType::kU8, {T}},
      {&s->token_ids, DType::kI32, {T}},
      {&s->positions, DType::kI32, {T}},
      {&s->token_seq, DType::kI32, {T}},
      {&s->logits_rows, DType::kI32, {T}},
      {&s->attention_workspace, DType::kF32, {16 << 20}},
      {&s->attention_groups, DType::kI32, {T + 1}},
      {&s->x_fp8, DType::kF8E4M3, {T, fp8_width}},
      {&s->x_scales, DType::kF32, {T, (fp8_width + 127) / 128}},
      {&s->act_fp8, DType::kF8E4M3, {expert_rows, moe_inter}},
      {&s->act_scales, DType::kF32, {expert_rows, (moe_inter + 127) / 128}},
  };
  for (const auto& a : allocs) MOE_RETURN_IF_ERROR(track(*a.t, DeviceTensor::allocate(a.dtype, a.shape)));
  if (options.comm != nullptr) MOE_RETURN_IF_ERROR(track(s->delta_bf16, DeviceTensor::allocate(DType::kBF16, {T, H})));
  if (s->fp8_attention) {
    const char* dense_gemm = std::getenv("MOE_FP8_DENSE_GEMM");
    s->cublas_fp8_projections = dense_gemm == nullptr || std::string_view(dense_gemm) != "grouped";
    MOE_RETURN_IF_ERROR(track(s->dense_offsets, DeviceTensor::allocate(DType::kI32, {2})));
    MOE_RETURN_IF_ERROR(track(s->dense_tile_offsets, DeviceTensor::allocate(DType::kI32, {2})));
    MOE_RETURN_IF_ERROR(track(s->qkv_f32, DeviceTensor::allocate(DType::kF32, {T, qkv_width})));
  }
  MOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s->stream));
  s->weights_and_activations_bytes = s->bytes;
  const int64_t max_model_len = options.max_model_len > 0 ? options.max_model_len : std::max<int64_t>(c.max_position_embeddings, 1);
  s->max_pages_per_seq = static_cast<int>((max_model_len + options.page_size - 1) / options.page_size);
  const bool size_from_memory = s->options.num_pages == 0 && options.kv_cache_bytes <= 0;
  // Sized from memory: a pool just large enough for a warm-up forward pass of
  // max_num_tokens first, so what that pass allocates (cuBLASLt workspaces,
  // kernel modules loaded on first launch) is counted before the real pool.
  const int warmup_tokens = static_cast<int>(std::min<int64_t>(T, max_model_len));
  const int32_t warmup_pages = (warmup_tokens + options.page_size - 1) / options.page_size;
  const size_t placed = s->bytes;
  auto model = std::unique_ptr<CudaQwen3MoeModel>(new CudaQwen3MoeModel(std::move(s)));
  placing.set("the MTP layer", placed, weights_advice(model->state_->fp8_experts));
  if (options.mtp != nullptr) MOE_RETURN_IF_ERROR(model->upload_mtp(*options.mtp));
  if (!size_from_memory && options.num_pages == 0) {  // a budget in bytes: pages of this model's page size
    const double pages = std::floor(options.kv_cache_bytes / static_cast<double>(model->kv_page_bytes()));
    const int per_seq = model->state_->max_pages_per_seq;
    if (pages < per_seq)
      return invalid_argument("a KV cache of {:.3f} GB holds {} pages of {} tokens on this GPU; one sequence of {} "
                              "tokens needs {}", options.kv_cache_bytes / 1e9, pages, options.page_size, max_model_len,
                              per_seq);
    model->state_->options.num_pages = static_cast<int32_t>(std::min<double>(pages, INT32_MAX - 1));
  }
  placing.set(size_from_memory ? "the KV pages of the warm-up pass" : "the KV cache", model->state_->bytes,
              size_from_memory ? "lower --max-num-batched-tokens" : "lower --kv-cache-gb");
  MOE_RETURN_IF_ERROR(model->allocate_kv_pool(size_from_memory ? warmup_pages : model->state_->options.num_pages));
  // Ranks finish their uploads at different times: meet before the warm-up's collectives.
  if (options.comm != nullptr) MOE_RETURN_IF_ERROR(options.comm->barrier());
  if (options.experts != nullptr) MOE_RETURN_IF_ERROR(options.experts->barrier());
  placing.set(fmt::format("a warm-up pass of {} tokens and the KV cache", warmup_tokens), model->state_->bytes,
              "lower --max-num-batched-tokens or --gpu-memory-utilization");
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
  const size_t heads = static_cast<size_t>(c.num_layers) * c.num_kv_heads +
                       (state_->mtp_layer ? state_->mtp_layer->num_kv_heads : 0);  // the MTP layer's: all
  return heads * 2 * state_->options.page_size * c.head_dim * 2;
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
  // The MTP layer runs whole on the rank that drafts (the only one that has
  // it): its heads and MLP columns are the full model's, which a TP rank's
  // activations are too narrow for.
  const ModelConfig& full = weights.config();
  b->num_q_heads = full.num_q_heads, b->num_kv_heads = full.num_kv_heads;
  b->mlp_columns = static_cast<int>(full.intermediate_size);
  const int64_t T = s.options.max_num_tokens, H = c.hidden_size;
  auto widen = [&](DeviceTensor& t, DType dtype, int64_t rows, int64_t cols) -> Status {
    if (t.shape().num_elements() >= rows * cols) return Status::ok();
    s.bytes -= t.num_bytes();
    return track(t, DeviceTensor::allocate(dtype, {rows, cols}));
  };
  const int64_t q_size = int64_t{b->num_q_heads} * c.head_dim,
                kv_size = int64_t{b->num_kv_heads} * c.head_dim;
  MOE_RETURN_IF_ERROR(widen(s.qkv, DType::kBF16, T, q_size + 2 * kv_size));
  MOE_RETURN_IF_ERROR(widen(s.q, DType::kBF16, T, q_size));
  MOE_RETURN_IF_ERROR(widen(s.attended, DType::kBF16, T, q_size));
  if (!w.is_moe) {
    MOE_RETURN_IF_ERROR(widen(s.gate_up, DType::kBF16, T, 2 * int64_t{b->mlp_columns}));
    MOE_RETURN_IF_ERROR(widen(s.act, DType::kBF16, T, b->mlp_columns));
  }
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
  MOE_RETURN_IF_ERROR(track(s.mtp_h, DeviceTensor::allocate(DType::kF32, {T, H})));
  MOE_RETURN_IF_ERROR(track(s.mtp_g, DeviceTensor::allocate(DType::kBF16, {T, H})));
  MOE_RETURN_IF_ERROR(track(s.mtp_concat, DeviceTensor::allocate(DType::kBF16, {T, 2 * H})));
  MOE_RETURN_IF_ERROR(track(s.target_hidden, DeviceTensor::allocate(DType::kBF16, {T, H})));
  MOE_RETURN_IF_ERROR(track(s.target_rows, DeviceTensor::allocate(DType::kI32, {T})));
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
    s.mtp_kv_layout = {1, m.num_kv_heads, c.head_dim, s.options.page_size, num_pages + 1};
    MOE_ASSIGN_OR_RETURN(s.mtp_kv_pool, DeviceBuffer::allocate(s.mtp_kv_layout.num_bytes()));
    s.bytes += s.mtp_kv_pool.size();
    MOE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(s.mtp_kv_pool.data(), 0, s.mtp_kv_pool.size(), s.stream));
    auto* mtp_base = s.mtp_kv_pool.data_as<uint8_t>();
    const Shape mtp_shape{num_pages + 1, m.num_kv_heads, s.options.page_size, c.head_dim};
    m.k_pages = TensorView(mtp_base + s.mtp_kv_layout.k_offset(0), DType::kBF16, mtp_shape,
                           Device::cuda(s.options.device));
    m.v_pages = TensorView(mtp_base + s.mtp_kv_layout.v_offset(0), DType::kBF16, mtp_shape,
                           Device::cuda(s.options.device));
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
  // A sequence of max_model_len must fit alone, or the scheduler could never
  // run one (serve's limit; generate leaves it 0 and checks its requests).
  if (s.options.max_model_len > 0 && pages < s.max_pages_per_seq)
    return resource_exhausted("the KV cache holds {} tokens ({} pages of {}) after {:.1f} GB of weights and activations "
                              "at --gpu-memory-utilization {}; one sequence of --max-model-len {} needs {} pages: lower "
                              "--max-model-len to at most {} or raise --gpu-memory-utilization",
                              static_cast<int64_t>(pages) * s.options.page_size, static_cast<int64_t>(pages),
                              s.options.page_size, s.weights_and_activations_bytes / 1e9,
                              s.options.gpu_memory_utilization, s.options.max_model_len, s.max_pages_per_seq,
                              static_cast<int64_t>(pages) * s.options.page_size);
  return allocate_kv_pool(static_cast<int32_t>(std::min<double>(pages, INT32_MAX - 1)));
}

}  // namespace moe::model
