// Model weights: the tensors of a Qwen3-MoE (or dense Qwen3) checkpoint, checked
// against the config and arranged for the forward pass.
//
// Weights are loaded from Hugging Face safetensors (single file or sharded),
// or generated (`--load-format dummy`: random values of the right shapes and
// dtypes). Expert projections are packed at load into grouped layouts (DESIGN
// section 4): w13 [num_experts, 2 * moe_inter, hidden] with gate rows first,
// then up, and w2 [num_experts, hidden, moe_inter]. Other tensors are views
// into the memory-mapped files. ModelWeights owns everything its views point
// to; once built it is read-only and any thread may read it.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/tensor.h"
#include "core/thread_pool.h"
#include "model/config.h"
#include "model/quant_weights.h"

namespace moe::model {

class SafetensorsCheckpoint;
class TensorFetcher;

struct LayerWeights {
  TensorView input_norm;           // [hidden]
  TensorView post_attention_norm;  // [hidden]
  TensorView q_proj;               // [num_q_heads * head_dim, hidden]
  TensorView k_proj;               // [num_kv_heads * head_dim, hidden]
  TensorView v_proj;               // [num_kv_heads * head_dim, hidden]
  TensorView o_proj;               // [hidden, num_q_heads * head_dim]
  TensorView q_norm;               // [head_dim]
  TensorView k_norm;               // [head_dim]
  bool is_moe = false;
  TensorView router;  // MoE: [num_experts, hidden]
  TensorView w13;     // MoE: [num_experts, 2 * moe_inter, hidden]; dense: [2 * inter, hidden]
  TensorView w2;      // MoE: [num_experts, hidden, moe_inter];     dense: [hidden, inter]
  // Quantized models (ModelWeights::quant_format()): the projections stored in
  // that format, same shapes as above; the plain view of a quantized
  // projection is empty. Attention projections may stay plain (bf16).
  ops::QuantizedTensor q_proj_quant, k_proj_quant, v_proj_quant, o_proj_quant, w13_quant, w2_quant;
};

// Tensors named mtp.* are an MTP layer's (model/mtp.h), which Qwen3.5 and
// Qwen3-Next checkpoints ship in the model's own safetensors: the target's
// loader leaves them to MtpWeights.
inline bool is_mtp_tensor(std::string_view name) { return name.starts_with("mtp."); }

enum class LoadFormat { kAuto, kSafetensors, kDummy };

struct LoadOptions {
  LoadFormat format = LoadFormat::kAuto;
  uint64_t dummy_seed = 0;
};

class ModelWeights {
 public:
  ModelWeights(ModelWeights&&) noexcept;
  ModelWeights& operator=(ModelWeights&&) noexcept;
  ~ModelWeights();

  const ModelConfig& config() const { return config_; }
  TensorView embed_tokens() const { return embed_tokens_; }  // [vocab, hidden]
  TensorView final_norm() const { return final_norm_; }      // [hidden]
  TensorView lm_head() const { return lm_head_; }            // [vocab, hidden] (the embedding when tied)
  const LayerWeights& layer(int i) const { return layers_.at(static_cast<size_t>(i)); }
  int num_layers() const { return static_cast<int>(layers_.size()); }
  // Bytes of weight data the model reads (views and owned tensors).
  size_t num_bytes() const;

  // Reads DIR's safetensors and checks every tensor: present, expected shape,
  // float dtype; a tensor the model does not use is an error too, except the
  // mtp.* tensors (is_mtp_tensor): those are the MTP layer's (MtpWeights).
  static Expected<ModelWeights> load(const std::string& model_dir, const ModelConfig& config, ThreadPool& pool);
  // Random weights (uniform in +-1/sqrt(fan_in), norms near 1) in config.dtype.
  // With a quantization format, the projections (experts, dense MLPs and
  // attention) are random values of the same ranges quantized to it.
  static ModelWeights dummy(const ModelConfig& config, uint64_t seed, ThreadPool& pool,
                            ops::QuantFormat quantization = ops::QuantFormat::kNone);
  // The format of the quantized projections (kNone: none).
  ops::QuantFormat quant_format() const { return quant_format_; }

 private:
  explicit ModelWeights(ModelConfig config);
  TensorView own(Tensor tensor);
  ops::QuantizedTensor own(OwnedQuantized quantized);
  Status load_layer(TensorFetcher& fetch, int layer);
  Status load_projection(TensorFetcher& fetch, const std::string& name, Shape shape, TensorView& plain,
                         ops::QuantizedTensor& quant);
  Status load_quantized_mlp(TensorFetcher& fetch, int layer, LayerWeights& lw);

  ModelConfig config_;
  TensorView embed_tokens_, final_norm_, lm_head_;
  std::vector<LayerWeights> layers_;
  std::vector<Tensor> owned_;
  std::vector<OwnedQuantized> owned_quantized_;
  ops::QuantFormat quant_format_ = ops::QuantFormat::kNone;
  std::unique_ptr<SafetensorsCheckpoint> checkpoint_;
};

}  // namespace moe::model
