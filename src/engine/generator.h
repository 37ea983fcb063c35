// Offline batch generation: runs several sequences of different lengths
// through the model together, one forward per step, on a paged KV cache.
//
// Each step packs every running sequence's pending tokens (its prompt, or a
// chunk of it under `max_tokens_per_step`, or its last sampled token) into one
// ragged batch. A request is admitted when the pages for its prompt plus
// max_tokens are free; otherwise it waits for running ones to finish. This is
// the minimal runner of the foundation; the serving engine (continuous
// batching, preemption, prefix caching) builds on the same pieces.
//
// Not thread-safe: one thread drives a Generator.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/thread_pool.h"
#include "engine/sampler.h"
#include "kv/kv_cache.h"
#include "model/qwen3_moe.h"

namespace moe::engine {

struct GenerationRequest {
  std::vector<int32_t> prompt;
  int max_tokens = 16;
  SamplingParams sampling;
  bool ignore_eos = false;
  std::vector<int32_t> stop_token_ids;  // in addition to the model's eos ids
};

struct GenerationResult {
  std::vector<int32_t> token_ids;  // generated tokens only
  std::string finish_reason;       // "stop" or "length"
};

struct GeneratorOptions {
  int page_size = 16;
  int32_t num_pages = 0;              // 0: enough for every request at once
  DType kv_dtype = DType::kF32;
  int max_tokens_per_step = 0;        // prefill chunk budget; 0: unlimited
  std::vector<int32_t> eos_token_ids;
};

struct GenerationStats {
  int num_steps = 0;
  int64_t num_prompt_tokens = 0;
  int64_t num_generated_tokens = 0;
  double prefill_seconds = 0.0;  // steps that processed prompt tokens
  double decode_seconds = 0.0;   // steps of decode tokens only
};

class Generator {
 public:
  Generator(const model::Qwen3MoeModel& model, ThreadPool& pool, GeneratorOptions options);

  // Runs every request to completion. A request that could never fit in the
  // KV cache, or has bad parameters, makes the call fail before any work.
  Expected<std::vector<GenerationResult>> generate(const std::vector<GenerationRequest>& requests);
  const GenerationStats& stats() const { return stats_; }

 private:
  const model::Qwen3MoeModel& model_;
  ThreadPool& pool_;
  GeneratorOptions options_;
  GenerationStats stats_;
};

}  // namespace moe::engine
