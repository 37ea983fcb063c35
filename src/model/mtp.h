// Multi-token prediction (MTP) module: the draft model of speculative decoding
// (docs/speculative.md), as Qwen3.5 (Qwen3-Next) and DeepSeek-V3 define it.
//
// For position t, with h_t the target's last hidden state at t and x_{t+1}
// the token at t+1:
//   e  = rms_norm(embed(x_{t+1}), pre_fc_norm_embedding)        (DeepSeek: enorm)
//   g  = rms_norm(h_t, pre_fc_norm_hidden)                        (DeepSeek: hnorm)
//   u  = [e ; g] fc^T          fc [hidden, 2 * hidden]            (DeepSeek: eh_proj)
//   u  = one Qwen3-MoE decoder block at position t (its own KV pages; MoE or dense MLP)
//   o  = rms_norm(u, mtp.norm)  the MTP's own final norm          (DeepSeek: shared_head.norm)
//   logits(x_{t+2}) = o lm_head^T   (the target's lm_head, shared)
// The order of the concatenation, embedding first and hidden state second,
// is the one of vLLM's Qwen3NextMultiTokenPredictor.forward
// (`torch.cat([inputs_embeds, hidden_states])`, vllm/model_executor/models/
// qwen3_next_mtp.py) and of DeepSeek-V3's MTP (`eh_proj(cat([enorm(e),
// hnorm(h)]))`, vllm deepseek_mtp.py, "Standard MTP adapter" descriptions).
//
// "The last hidden state" h_t is what the target's lm_head reads: the
// residual stream after the last layer *and the final norm*. vLLM and SGLang
// hand exactly that to the MTP layers of DeepSeek-V3 and Qwen3-Next (their
// models' forward returns `norm(hidden_states, residual)`, and the proposer
// takes those as target hidden states); the released MTP weights were trained
// for it. The final norm of the MTP output is the MTP's own (`mtp.norm`,
// DeepSeek's `shared_head.norm`), not the target's `model.norm`.
//
// Chaining k drafts (one MTP layer reused, as vLLM does when
// num_speculative_tokens exceeds the number of MTP layers): step j + 1 runs at
// position t + j with the previous step's normed output o as h and its draft
// token as x, writing MTP KV at t + j. Those slots are overwritten with the
// target's true hidden states once the drafts are verified.
//
// Tensor names (a Qwen3.5 checkpoint's `mtp.*`, beside the target's own
// tensors in the model directory; also the layout of the side checkpoint
// given by --speculative-model for Qwen3-MoE):
//   mtp.pre_fc_norm_embedding.weight [hidden], mtp.pre_fc_norm_hidden.weight [hidden],
//   mtp.fc.weight [hidden, 2 * hidden], mtp.norm.weight [hidden],
//   mtp.layers.0.{input_layernorm, post_attention_layernorm}.weight [hidden],
//   mtp.layers.0.self_attn.{q,k,v,o}_proj.weight, mtp.layers.0.self_attn.{q,k}_norm.weight,
//   and the MLP: mtp.layers.0.mlp.gate.weight + mtp.layers.0.mlp.experts.E.{gate,up,down}_proj.weight
//   (MoE, the target's expert shapes) or mtp.layers.0.mlp.{gate,up,down}_proj.weight (dense,
//   intermediate_size). Shapes are the target config's.
//
// MtpWeights is read-only once built (any thread may read it). MtpModel is
// immutable; forward() may be called from one thread at a time per KV cache.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "core/thread_pool.h"
#include "model/config.h"
#include "model/weights.h"
#include "ops/attention.h"
#include "ops/rope.h"

namespace moe::model {

class SafetensorsCheckpoint;

// Which directory MtpWeights::load reads, and so which of its tensors it answers for.
enum class MtpCheckpoint {
  kSide,   // a checkpoint of the MTP layer alone (--speculative-model): any other tensor is an error
  kModel,  // the target model's own checkpoint: only the mtp.* tensors are read; the rest are the target's
};

// Whether DIR's checkpoint holds any mtp.* tensor (an MTP layer shipped in
// the model's own files). Errors: DIR has no readable checkpoint.
Expected<bool> has_mtp_tensors(const std::string& dir);

class MtpWeights {
 public:
  MtpWeights(MtpWeights&&) noexcept;
  MtpWeights& operator=(MtpWeights&&) noexcept;
  ~MtpWeights();

  const ModelConfig& config() const { return config_; }
  TensorView embed_norm() const { return embed_norm_; }    // [hidden]
  TensorView hidden_norm() const { return hidden_norm_; }  // [hidden]
  TensorView fc() const { return fc_; }                    // [hidden, 2 * hidden]
  TensorView final_norm() const { return final_norm_; }    // [hidden]
  const LayerWeights& layer() const { return layer_; }     // the decoder block (plain weights)

  // Reads DIR's safetensors: every tensor above must be there with its shape
  // and a float dtype, and any other tensor is an error (with kModel: any
  // other mtp.* tensor; the target's tensors are left to ModelWeights, and the
  // files are mapped a second time, sharing the page cache). The MLP is MoE
  // when mtp.layers.0.mlp.gate.weight is present (the target needs experts then).
  static Expected<MtpWeights> load(const std::string& dir, const ModelConfig& target_config,
                                   MtpCheckpoint kind = MtpCheckpoint::kSide);
  // Random weights of the right shapes (norms near 1, projections uniform in
  // +-1/sqrt(fan_in)), deterministic in `seed`; `moe` picks the MLP kind.
  static MtpWeights dummy(const ModelConfig& target_config, uint64_t seed, bool moe);

 private:
  explicit MtpWeights(ModelConfig config);
  TensorView own(Tensor tensor);

  ModelConfig config_;
  TensorView embed_norm_, hidden_norm_, fc_, final_norm_;
  LayerWeights layer_;
  std::vector<Tensor> owned_;
  std::unique_ptr<SafetensorsCheckpoint> checkpoint_;
};

// One MTP forward over a ragged batch (same layout as ForwardBatch): row i
// combines hidden[i] (the target's, or the previous MTP step's, output) with
// the embedding of token_ids[i] at positions[i].
struct MtpBatch {
  std::vector<int32_t> token_ids;    // [num_tokens]
  std::vector<int32_t> positions;    // [num_tokens]
  std::vector<int32_t> query_start;  // [num_seqs + 1]
  std::vector<int32_t> page_table;   // [num_seqs, max_pages_per_seq]
  int max_pages_per_seq = 0;
  std::vector<int32_t> output_rows;  // rows whose output (normed hidden, logits) is wanted
  // false: a runner may leave MtpOutput::logits empty (the drafter reads only
  // the greedy tokens; on the GPU a row's logits are 4 x vocab bytes to copy,
  // 0.6 MB at Qwen3's vocabulary).
  bool want_logits = true;
  // Set only for runners that keep the target's hidden states where it ran
  // (MtpRunner::keeps_target_hidden, the GPU's): row i's input is then row
  // target_rows[i] of the target's last forward pass, and `hidden` is ignored.
  std::vector<int32_t> target_rows;
  // Set only in the passes of MtpRunner::forward_chain: row i continues
  // output row previous_rows[i] of the pass before, taking that row's normed
  // output as h and its greedy token as its token (token_ids then only count
  // the rows; `hidden` is ignored).
  std::vector<int32_t> previous_rows;
  // false: a runner may leave MtpOutput::hidden empty (the GPU's chains its
  // passes from the rows it keeps; MtpRunner::keeps_target_hidden).
  bool want_hidden = true;
  int num_tokens() const { return static_cast<int>(token_ids.size()); }
};

struct MtpOutput {
  Tensor hidden;  // [output_rows, hidden] f32: the normed output, the next chained step's h (see want_hidden)
  Tensor logits;  // [output_rows, vocab] f32 (see MtpBatch::want_logits)
  std::vector<int32_t> greedy;  // [output_rows]: each row's argmax (lowest id on ties); set by MtpRunners
};

class MtpModel {
 public:
  // `target` provides the shared embedding and lm_head; both must outlive this.
  MtpModel(const MtpWeights& weights, const ModelWeights& target);

  const ModelConfig& config() const { return weights_.config(); }
  // hidden [num_tokens, hidden] f32. Writes the batch's K/V into `kv`.
  MtpOutput forward(ThreadPool& pool, const MtpBatch& batch, TensorView hidden, const ops::PagedKv& kv) const;

 private:
  void attention_block(ThreadPool& pool, const MtpBatch& batch, const ops::PagedKv& kv, TensorView x,
                       TensorView out) const;
  void mlp_block(ThreadPool& pool, TensorView x, TensorView out) const;

  const MtpWeights& weights_;
  const ModelWeights& target_;
  ops::RopeTable rope_;
};

}  // namespace moe::model
