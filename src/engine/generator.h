// Offline batch generation: runs several sequences of different lengths
// through the model together, one forward per step, on a paged KV cache.
//
// Drives the serving scheduler (engine/scheduler.h) synchronously: each step
// packs every running sequence's pending tokens (its prompt, or a chunk of it
// under `max_tokens_per_step`, or its last sampled token) into one ragged
// batch; prompts are admitted as pages allow, and a cache too small for all of
// them preempts (recomputes) the newest sequence. Prefix caching is off, so
// every run computes every token.
//
// Not thread-safe: one thread drives a Generator.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/thread_pool.h"
#include "engine/model_runner.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "engine/speculative.h"
#include "kv/kv_cache.h"
#include "model/mtp.h"
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
  int num_draft_tokens = 0;        // speculative decoding: drafts verified
  int num_accepted_draft_tokens = 0;
};

struct GeneratorOptions {
  int page_size = 16;
  int32_t num_pages = 0;              // 0: enough for every request at once
  DType kv_dtype = DType::kF32;
  int max_tokens_per_step = 0;        // prefill chunk budget; 0: unlimited
  std::vector<int32_t> eos_token_ids;
  // Speculative decoding (engine/speculative.h), k > 0 drafts per step, the
  // runner returning hidden states: with this MTP model on the CPU, or with
  // the MtpRunner make_mtp_runner() gives (the GPU's, CudaRunner::mtp_runner).
  const model::MtpModel* mtp = nullptr;
  std::function<std::unique_ptr<MtpRunner>()> make_mtp_runner;
  int num_speculative_tokens = 0;
};

struct GenerationStats {
  int num_steps = 0;
  int64_t num_prompt_tokens = 0;  // prefill tokens computed (recomputes included)
  int64_t num_generated_tokens = 0;
  double prefill_seconds = 0.0;  // steps that processed prompt tokens
  double decode_seconds = 0.0;   // steps of decode tokens only
  int num_decode_steps = 0;
  int64_t num_verifications = 0;  // speculative: chunks that verified drafts
  int64_t num_draft_tokens = 0;
  int64_t num_accepted_tokens = 0;
};

class Generator {
 public:
  // On the CPU model: each generate() builds a KV cache sized for its requests.
  Generator(const model::Qwen3MoeModel& model, ThreadPool& pool, GeneratorOptions options);
  // On any runner (the CUDA one), whose KV pool of `runner_num_pages` pages
  // the scheduler's page ids index; options.num_pages, if set, uses fewer.
  // `pool` runs the MTP draft layer (options.mtp) on the CPU; none: no speculation.
  Generator(ModelRunner& runner, int32_t runner_num_pages, GeneratorOptions options, ThreadPool* pool = nullptr);

  // Runs every request to completion. A request that could never fit in the
  // KV cache, or has bad parameters, makes the call fail before any work.
  Expected<std::vector<GenerationResult>> generate(const std::vector<GenerationRequest>& requests);
  const GenerationStats& stats() const { return stats_; }

 private:
  Expected<std::vector<GenerationResult>> run(const std::vector<GenerationRequest>& requests, ModelRunner& runner,
                                              int32_t num_pages, int64_t longest);
  // One step after scheduling: forward, sampling (verification with drafts),
  // complete_step (its updates in `updates`), then the next drafts. Returns
  // the run of tokens of each sampling chunk of `plan`.
  Expected<std::vector<std::vector<int32_t>>> forward_step(ModelRunner& runner, Scheduler& scheduler,
                                                           const StepPlan& plan, std::span<const RowSampling> rows,
                                                           MtpDrafter* drafter, std::vector<SequenceUpdate>& updates);

  const model::Qwen3MoeModel* model_ = nullptr;  // CPU path
  ThreadPool* pool_ = nullptr;
  ModelRunner* runner_ = nullptr;  // runner path
  int32_t runner_num_pages_ = 0;
  GeneratorOptions options_;
  GenerationStats stats_;
};

}  // namespace moe::engine
