#include "engine/generator.h"

#include <algorithm>
#include <chrono>
#include <numeric>
#include <random>

#include "core/logging.h"
#include "engine/scheduler.h"

namespace moe::engine {
namespace {

int32_t pages_needed(int64_t tokens, int page_size) {
  return static_cast<int32_t>((tokens + page_size - 1) / page_size);
}

// Checks every request; the total and the longest prompt + max_tokens.
Status validate_requests(const std::vector<GenerationRequest>& requests, int64_t vocab_size, int page_size,
                         int64_t& total_pages, int64_t& longest) {
  for (size_t i = 0; i < requests.size(); ++i) {
    const auto& r = requests[i];
    if (r.prompt.empty()) return invalid_argument("request {}: the prompt is empty", i);
    if (r.max_tokens < 1) return invalid_argument("request {}: max_tokens must be >= 1, got {}", i, r.max_tokens);
    for (int32_t id : r.prompt)
      if (id < 0 || id >= vocab_size)
        return invalid_argument("request {}: token id {} is outside the vocabulary [0, {})", i, id, vocab_size);
    MOE_RETURN_IF_ERROR(validate_sampling(r.sampling, vocab_size).with_context(fmt::format("request {}", i)));
    if (r.sampling.adjusts_logits() || !r.sampling.allowed_token_ids.empty())
      return invalid_argument(
          "request {}: penalties, logit_bias, min_tokens, bad_words and allowed_token_ids are applied by the "
          "serving engine (Engine), not by the offline generator",
          i);
    const int64_t len = static_cast<int64_t>(r.prompt.size()) + r.max_tokens;
    total_pages += pages_needed(len, page_size);
    longest = std::max(longest, len);
  }
  return Status::ok();
}

}  // namespace

Generator::Generator(const model::Qwen3MoeModel& model, ThreadPool& pool, GeneratorOptions options)
    : model_(&model), pool_(&pool), options_(std::move(options)) {}

Generator::Generator(ModelRunner& runner, int32_t runner_num_pages, GeneratorOptions options, ThreadPool* pool)
    : pool_(pool), runner_(&runner), runner_num_pages_(runner_num_pages), options_(std::move(options)) {}

Expected<std::vector<GenerationResult>> Generator::generate(const std::vector<GenerationRequest>& requests) {
  const int64_t vocab_size = runner_ ? runner_->vocab_size() : model_->config().vocab_size;
  int64_t total_pages = 0, longest = 1;
  MOE_RETURN_IF_ERROR(validate_requests(requests, vocab_size, options_.page_size, total_pages, longest));
  if (runner_ != nullptr) {
    const int32_t pages = options_.num_pages > 0 ? std::min(options_.num_pages, runner_num_pages_) : runner_num_pages_;
    return run(requests, *runner_, pages, longest);
  }
  const model::ModelConfig& config = model_->config();
  const int32_t num_pages = options_.num_pages > 0 ? options_.num_pages : static_cast<int32_t>(total_pages);
  Qwen3Runner runner(*model_, *pool_,
                     {config.num_layers, model_->shard().num_kv_heads, config.head_dim, options_.page_size, num_pages,
                      options_.kv_dtype});
  return run(requests, runner, num_pages, longest);
}

// Requests are validated; `longest` is the longest prompt + max_tokens.
Expected<std::vector<GenerationResult>> Generator::run(const std::vector<GenerationRequest>& requests,
                                                       ModelRunner& runner, int32_t num_pages, int64_t longest) {
  const int page_size = options_.page_size;
  if (pages_needed(longest, page_size) > num_pages)
    return resource_exhausted("a request's prompt + max_tokens needs more KV pages than the cache has ({})", num_pages);
  if (requests.empty()) return std::vector<GenerationResult>{};

  // The serving scheduler, driven synchronously: continuous batching with
  // chunked prefill (decodes first) and preemption when pages run out.
  std::unique_ptr<MtpDrafter> drafter;
  const bool speculate = (options_.mtp != nullptr || options_.make_mtp_runner) && options_.num_speculative_tokens > 0;
  if (speculate && !runner.supports_hidden_states())
    return unimplemented("speculative decoding needs a model runner that returns hidden states");
  if (speculate && options_.make_mtp_runner) {
    std::unique_ptr<MtpRunner> mtp_runner = options_.make_mtp_runner();
    if (mtp_runner == nullptr) return invalid_argument("make_mtp_runner gave no MTP runner");
    drafter = std::make_unique<MtpDrafter>(std::move(mtp_runner), options_.num_speculative_tokens);
  } else if (speculate) {
    if (pool_ == nullptr) return invalid_argument("speculative decoding on the CPU needs a thread pool for the MTP layer");
    const model::ModelConfig& c = options_.mtp->config();
    drafter = std::make_unique<MtpDrafter>(
        *options_.mtp, *pool_,
        kv::KvCacheLayout{1, c.num_kv_heads, c.head_dim, page_size, num_pages, options_.kv_dtype},
        options_.num_speculative_tokens);
  }
  SchedulerOptions so;
  so.page_size = page_size;
  so.num_pages = num_pages;
  so.max_num_seqs = static_cast<int>(requests.size());
  so.max_num_batched_tokens = options_.max_tokens_per_step > 0 ? options_.max_tokens_per_step : INT32_MAX / 2;
  so.max_model_len = static_cast<int>(longest);
  so.enable_prefix_caching = false;
  Scheduler scheduler(so);
  std::random_device entropy;
  std::vector<uint64_t> seeds(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    const auto& r = requests[i];
    seeds[i] = r.sampling.seed ? *r.sampling.seed : (static_cast<uint64_t>(entropy()) << 32 | entropy());
    SequenceSpec spec{i, r.prompt, r.max_tokens, options_.eos_token_ids, r.stop_token_ids, r.ignore_eos, 0};
    MOE_RETURN_IF_ERROR(scheduler.add(std::move(spec)));
  }

  std::vector<GenerationResult> results(requests.size());
  stats_ = {};
  while (scheduler.has_work()) {
    const StepPlan plan = scheduler.schedule(0);
    CHECK(!plan.empty(), "nothing runnable although requests wait");
    const auto start = std::chrono::steady_clock::now();
    std::vector<RowSampling> rows;
    for (const ScheduledChunk& chunk : plan.chunks)
      if (chunk.sample)
        rows.push_back({requests[chunk.id].sampling, seeds[chunk.id], static_cast<uint64_t>(results[chunk.id].token_ids.size())});
    std::vector<SequenceUpdate> pending_updates;
    MOE_ASSIGN_OR_RETURN(auto runs, forward_step(runner, scheduler, plan, rows, drafter.get(), pending_updates));
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    (plan.num_prefill_tokens > 0 ? stats_.prefill_seconds : stats_.decode_seconds) += seconds;
    if (plan.num_prefill_tokens == 0) ++stats_.num_decode_steps;
    stats_.num_prompt_tokens += plan.num_prefill_tokens;
    ++stats_.num_steps;
    size_t next_run = 0;
    for (const ScheduledChunk& chunk : plan.chunks) {
      if (!chunk.sample) continue;
      const auto& run = runs[next_run++];
      if (chunk.num_drafts == 0) continue;
      ++stats_.num_verifications;
      stats_.num_draft_tokens += chunk.num_drafts;
      stats_.num_accepted_tokens += static_cast<int64_t>(run.size()) - 1;
      results[chunk.id].num_draft_tokens += chunk.num_drafts;
      results[chunk.id].num_accepted_draft_tokens += static_cast<int>(run.size()) - 1;
    }
    for (const SequenceUpdate& u : pending_updates) {
      results[u.id].token_ids.push_back(u.token);
      if (u.finish != FinishReason::kNone) results[u.id].finish_reason = finish_reason_name(u.finish);
      ++stats_.num_generated_tokens;
    }
    scheduler.check_invariants();
  }
  return results;
}

Expected<std::vector<std::vector<int32_t>>> Generator::forward_step(ModelRunner& runner, Scheduler& scheduler,
                                                                    const StepPlan& plan,
                                                                    std::span<const RowSampling> rows,
                                                                    MtpDrafter* drafter,
                                                                    std::vector<SequenceUpdate>& updates) {
  const model::ForwardBatch batch = scheduler.build_batch(plan);
  StepSampling sampling;
  size_t next = 0;
  for (size_t c = 0; c < plan.chunks.size(); ++c)
    if (plan.chunks[c].sample) add_chunk_rows(sampling, plan, batch, c, rows[next++]);
  // A drafter whose runner keeps the target's hidden states reads them there.
  const bool host_hidden = drafter != nullptr && !drafter->keeps_target_hidden();
  const std::vector<int32_t> hidden_rows = host_hidden ? every_row(batch) : std::vector<int32_t>{};
  Tensor hidden;
  MOE_ASSIGN_OR_RETURN(SampledStep sampled, runner.forward_sample(batch, sampling, hidden_rows, hidden));
  std::vector<std::vector<int32_t>> runs = runs_from_samples(plan, sampled);
  updates = scheduler.complete_step(plan, std::span<const std::vector<int32_t>>(runs));
  if (drafter != nullptr) drafter->propose(scheduler, plan, batch, hidden, [](uint64_t) { return true; });
  return runs;
}

}  // namespace moe::engine
