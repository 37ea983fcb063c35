// The accuracy a quantized format costs on the golden models
// (tests/data/golden, transformers' float32 outputs from the bf16 weights):
// convert a golden checkpoint with `moeserve quantize`'s code, load it, run the
// CPU reference and compare with the goldens.
//
// Metrics, per model and format, over the golden prompts:
//   max |logit error|   largest |ours - golden| over the last-position logits
//   max rel. L2         largest ||ours - golden|| / ||golden|| over those rows
//   greedy agreement    teacher-forced: on prompt + golden greedy continuation
//                       (24 tokens), the fraction of continuation positions
//                       where our argmax is transformers' greedy token.
// Header-only so that the test (tests/model/quant_accuracy_test.cc) and the
// table tool (bench/quant_accuracy.cc) share one definition. One thread per call.
#pragma once

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kv/kv_cache.h"
#include "model/config.h"
#include "model/qwen3_moe.h"
#include "model/quantize_checkpoint.h"
#include "model/weights.h"

namespace moe::bench {

struct QuantAccuracy {
  std::string model;
  std::string format;
  double max_abs_logit_error = 0;
  double max_relative_l2 = 0;
  double max_abs_golden_logit = 0;  // the logits' scale, for reading the errors
  int num_agree = 0;
  int num_positions = 0;
  double agreement() const { return num_positions > 0 ? static_cast<double>(num_agree) / num_positions : 0.0; }
};

inline const std::vector<std::string>& golden_model_names() {
  static const std::vector<std::string> names = {"moe_basic", "moe_dense_layer", "moe_sparse_step", "moe_yarn",
                                                 "dense_qwen3"};
  return names;
}

// torch.argmax: the first index of the largest value.
inline int32_t first_argmax(const float* row, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (row[i] > row[best]) best = i;
  return static_cast<int32_t>(best);
}

// Logits of rows [first_row, seq.size()) of one prefill over `seq`.
inline Tensor prefill_rows(const model::Qwen3MoeModel& model, ThreadPool& pool, const std::vector<int32_t>& seq,
                           int32_t first_row) {
  const auto& c = model.config();
  const auto n = static_cast<int32_t>(seq.size());
  constexpr int kPageSize = 16;
  const int32_t pages = (n + kPageSize - 1) / kPageSize;
  kv::KvCache cache({c.num_layers, c.num_kv_heads, c.head_dim, kPageSize, pages, DType::kF32});
  std::vector<ops::PagedKv> layers;
  for (int l = 0; l < c.num_layers; ++l) layers.push_back(cache.layer(l));
  model::ForwardBatch batch;
  batch.token_ids = seq;
  for (int32_t i = 0; i < n; ++i) batch.positions.push_back(i);
  for (int32_t i = first_row; i < n; ++i) batch.logits_rows.push_back(i);
  batch.query_start = {0, n};
  for (int32_t p = 0; p < pages; ++p) batch.page_table.push_back(p);
  batch.max_pages_per_seq = pages;
  return model.forward(pool, batch, layers);
}

// Measures golden model `name` in `format` (kNone: the bf16 checkpoint
// itself), converting into work_dir/<name>-<format>, over the first
// `max_prompts` golden prompts (all when < 0).
inline Expected<QuantAccuracy> measure_quant_accuracy(const std::string& golden_root, const std::string& name,
                                                      ops::QuantFormat format, const std::string& work_dir,
                                                      ThreadPool& pool, int max_prompts = -1) {
  const std::string source = golden_root + "/" + name;
  std::string model_dir = source;
  if (format != ops::QuantFormat::kNone) {
    model::QuantizeOptions options;
    options.model_dir = source;
    options.out_dir = work_dir + "/" + name + "-" + std::string(ops::quant_format_name(format));
    options.format = format;
    options.force = true;
    MOE_ASSIGN_OR_RETURN(auto summary, model::quantize_checkpoint(options, {}));
    (void)summary;
    model_dir = options.out_dir;
  }
  MOE_ASSIGN_OR_RETURN(model::ModelConfig config, model::load_model_config(model_dir));
  MOE_ASSIGN_OR_RETURN(model::ModelWeights weights, model::ModelWeights::load(model_dir, config, pool));
  model::Qwen3MoeModel model(weights);
  std::ifstream in(source + "/golden.json");
  if (!in) return not_found("{}/golden.json: cannot read", source);
  const nlohmann::json golden = nlohmann::json::parse(in);
  QuantAccuracy result{name, std::string(format == ops::QuantFormat::kNone ? "bf16" : ops::quant_format_name(format))};
  const int64_t vocab = config.vocab_size;
  int num_prompts = 0;
  for (const auto& prompt : golden["prompts"]) {
    if (max_prompts >= 0 && num_prompts++ >= max_prompts) break;
    std::vector<int32_t> seq = prompt["ids"].get<std::vector<int32_t>>();
    const auto prompt_len = static_cast<int32_t>(seq.size());
    const auto greedy = prompt["greedy"].get<std::vector<int32_t>>();
    seq.insert(seq.end(), greedy.begin(), greedy.end() - 1);
    Tensor logits = prefill_rows(model, pool, seq, prompt_len - 1);
    const auto last = prompt["last_logits"].get<std::vector<float>>();
    double diff2 = 0, norm2 = 0;
    for (int64_t v = 0; v < vocab; ++v) {
      const double d = logits.data_as<float>()[v] - static_cast<double>(last[v]);
      diff2 += d * d;
      norm2 += static_cast<double>(last[v]) * last[v];
      result.max_abs_logit_error = std::max(result.max_abs_logit_error, std::fabs(d));
      result.max_abs_golden_logit = std::max(result.max_abs_golden_logit, std::fabs(static_cast<double>(last[v])));
    }
    result.max_relative_l2 = std::max(result.max_relative_l2, std::sqrt(diff2 / norm2));
    for (size_t i = 0; i < greedy.size(); ++i) {
      result.num_agree += first_argmax(logits.data_as<float>() + static_cast<int64_t>(i) * vocab, vocab) == greedy[i];
      result.num_positions += 1;
    }
  }
  return result;
}

}  // namespace moe::bench
