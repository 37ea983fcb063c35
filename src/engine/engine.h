// The serving engine: one loop thread that owns the scheduler and the model
// runner, fed by a thread-safe request queue, answering each request through
// its own output callback.
//
// Every submitted request ends with exactly one final output (finish set:
// stop / length / abort, with `error` set when it failed: deadline, engine
// failure, shutdown). Before that, one output per generated token.
//
// Threads: submit(), cancel(), metrics(), healthy() and the accessors may be
// called from any thread. Output callbacks run on the engine thread and must
// not block (post the work elsewhere).
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/status.h"
#include "core/thread_pool.h"
#include "engine/metrics.h"
#include "engine/model_runner.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "engine/speculative.h"
#include "structured/token_filter.h"

namespace moe::engine {

// Receives a prefill's KV as the forward pass writes it, layer by layer
// (disaggregated prefill, docs/disagg.md): positions [start, start +
// num_tokens) of `layer` are in `pages` (the sequence's pages, position p in
// pages[p / page_size]). Called on the engine thread inside the forward pass:
// it must only queue work (transfers), never block.
class KvExportSink {
 public:
  virtual ~KvExportSink() = default;
  virtual void on_layer_written(int layer, int32_t start, int32_t num_tokens, std::span<const int32_t> pages) = 0;
  // The request finished; its pages stay untouched until the sink calls
  // `release_pages` (exactly once, from any thread) when its transfers no
  // longer read them. Called on the engine thread, before the final output.
  virtual void on_finished(std::function<void()> release_pages) { release_pages(); }
  // Speculative decoding (docs/speculative.md, "Disaggregated serving"): a
  // sink that also takes the MTP layer's KV says so here; the engine then, with
  // a drafter, calls on_mtp_written() once, in the step that completes the
  // prompt, after the forward pass: the MTP KV of the prompt's positions
  // [0, num_tokens - 1) is in the drafter's cache (Engine::mtp_cache()) at
  // `pages` (position num_tokens - 1 needs the first token: the decode side
  // computes it), and `last_hidden` [hidden] is the target's hidden state at
  // the prompt's last position (after the final norm).
  virtual bool wants_mtp() const { return false; }
  virtual void on_mtp_written(int32_t num_tokens, std::span<const int32_t> pages, std::span<const float> last_hidden) {
    (void)num_tokens, (void)pages, (void)last_hidden;
  }
};

struct EngineRequest {
  std::vector<int32_t> prompt;
  int max_tokens = 16;
  SamplingParams sampling;
  bool ignore_eos = false;
  std::vector<int32_t> stop_token_ids;  // in addition to the model's eos ids
  int num_logprobs = -1;                // -1: none; k >= 0: the sampled token's logprob and the top k
  // -1: none; k >= 0: the logprob and top k of every prompt token after the
  // first (EngineOutput::prompt_logprobs; the prompt is computed whole, no
  // prefix-cache hit).
  int num_prompt_logprobs = -1;
  double timeout_s = 0;                 // 0: no deadline
  // Structured output (structured/grammar.h): every token is one the grammar
  // allows after the output so far, and eos or a stop token only where the
  // output may end (needs EngineOptions::vocabulary).
  std::shared_ptr<const structured::Grammar> grammar;
  // >= 0: the grammar applies only after this token is generated (a
  // reasoning model's </think>: the reasoning before it is free, as vLLM's
  // reasoning parsers have it); -1: from the first token.
  int32_t grammar_after_token = -1;
  // Set: every layer's KV of the prompt is handed to it as it is written
  // (needs a runner with layer hooks; the prefix-cached part included).
  std::shared_ptr<KvExportSink> kv_export;
};

struct TokenLogprobs {
  int32_t token = -1;
  float logprob = 0;
  int rank = 0;  // the token's rank in the vocabulary by logit, from 1 (ties: lower id first)
  std::vector<std::pair<int32_t, float>> top;  // most probable first
};

struct EngineOutput {
  uint64_t id = 0;
  int32_t token = -1;  // the new token; -1 in a final output that adds none
  std::optional<TokenLogprobs> logprobs;
  // In the output with the first token (num_prompt_logprobs >= 0): prompt
  // tokens 1 .. n-1, each given the ones before it.
  std::vector<TokenLogprobs> prompt_logprobs;
  FinishReason finish = FinishReason::kNone;
  Status error;  // not ok: the request failed (finish is kAbort)
  int num_prompt_tokens = 0;
  int num_output_tokens = 0;
  int num_cached_tokens = 0;  // prompt tokens found in the prefix cache
  // Speculative decoding, so far in the request (set in every output): drafts
  // verified and accepted.
  int num_draft_tokens = 0;
  int num_accepted_draft_tokens = 0;
};
using OutputCallback = std::function<void(const EngineOutput&)>;

// A prompt prefilled elsewhere (disaggregated decode, Engine::submit_prefilled).
struct PrefilledPrompt {
  std::vector<int32_t> pages;  // from Engine::reserve(), holding the prompt's KV
  int32_t first_token = -1;    // sampled by the prefill instance
  // Speculative decoding: the target's hidden state at the prompt's last
  // position ([hidden] f32, after the final norm), sent with the MTP layer's
  // KV of the prompt (in the same pages of the drafter's cache). Empty: no
  // MTP state, the request decodes without drafts.
  std::vector<float> last_hidden;
};

struct EngineOptions {
  SchedulerOptions scheduler;
  std::vector<int32_t> eos_token_ids;
  int max_waiting = 1024;  // submit() refuses more queued requests (kResourceExhausted)
  bool log_stats = true;   // the throughput line every 10 s (log_throughput)
  // The tokens' bytes, for structured outputs (EngineRequest::grammar); null:
  // such requests are refused.
  std::shared_ptr<const structured::TokenVocabulary> vocabulary;
  // Threads that find a step's token masks (structured outputs, allowed
  // token ids), one request at a time each: a request's first mask of a state
  // may walk the whole vocabulary (~8 ms at Qwen3's), so a step that starts
  // many such requests would otherwise wait for them one after another.
  // 0: up to 8, one per hardware thread; 1: the engine thread alone.
  int mask_threads = 0;
#ifdef NDEBUG
  bool check_invariants = false;
#else
  bool check_invariants = true;  // the scheduler's page bookkeeping after every step
#endif
};

class Engine {
 public:
  // With `drafter`, decode steps speculate (engine/speculative.h): the runner
  // must return hidden states and the drafter's KV cache must have the
  // scheduler's page count. Requests with logprobs or KV export, and
  // prefilled ones, decode without drafts.
  Engine(std::unique_ptr<ModelRunner> runner, EngineOptions options, std::unique_ptr<MtpDrafter> drafter = nullptr);
  ~Engine();  // stops the loop; requests still in flight end with kUnavailable
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Validates and queues a request; the id names it for cancel().
  Expected<uint64_t> submit(EngineRequest request, OutputCallback on_output);
  // Disaggregated decode (docs/disagg.md). reserve() holds pages for
  // `num_tokens` outside any request and answers on the engine thread (the
  // page ids, or kResourceExhausted); release() gives them back;
  // submit_prefilled() starts a request whose prompt KV is in `prompt.pages`
  // (from a reservation) and whose first output token was sampled elsewhere:
  // it decodes from there, speculating when `prompt.last_hidden` is set (the
  // drafter then drafts at once, as after a local prefill). Its outputs start
  // with the second token (or a final output with token -1 when the first one
  // already ended it). If it is refused at submission or on the engine
  // thread, the pages stay reserved: the caller releases them.
  void reserve(int32_t num_tokens, std::function<void(Expected<std::vector<int32_t>>)> done);
  void release(std::vector<int32_t> pages);
  Expected<uint64_t> submit_prefilled(EngineRequest request, PrefilledPrompt prompt, OutputCallback on_output);
  // Ends the request as soon as the loop sees it, freeing its pages; a no-op
  // for an unknown or finished id. `finish` is what its final output and the
  // metrics say: kAbort (the client left, or the request failed), or kStop
  // when the caller ends it on a stop string it found in the text.
  void cancel(uint64_t id, FinishReason finish = FinishReason::kAbort);

  EngineMetrics metrics() const;
  bool healthy() const { return !dead_.load(); }
  const EngineOptions& options() const { return options_; }
  int64_t vocab_size() const { return vocab_size_; }
  // The drafter's one-layer KV cache, indexed by the scheduler's page ids
  // (null without speculative decoding): the disaggregated roles send and
  // receive it as one more layer. Its memory is written on the engine thread.
  const kv::KvCache* mtp_cache() const { return drafter_ ? &drafter_->cache() : nullptr; }
  // The hidden size PrefilledPrompt::last_hidden must have (0: no drafter).
  int64_t mtp_hidden_size() const { return drafter_ ? drafter_->hidden_size() : 0; }
  // Stops the loop and fails what is left (idempotent; the destructor calls it).
  void shutdown();

 private:
  struct Active {
    EngineRequest request;
    OutputCallback on_output;
    uint64_t seed = 0;
    double arrival_s = 0, first_scheduled_s = -1, first_token_s = -1;
    int num_output_tokens = 0;
    std::vector<int32_t> prefilled_pages;  // submit_prefilled(): the reservation
    int32_t first_token = -1;              // submit_prefilled(): sampled by the prefill instance
    std::vector<float> last_hidden;        // submit_prefilled(): the MTP state, until admitted
    bool has_mtp_state = false;            // submit_prefilled() with the MTP state: may speculate
    int32_t num_exported_tokens = 0;       // request.kv_export: positions handed over
    int num_draft_tokens = 0, num_accepted_tokens = 0;  // speculative decoding
    // request.num_prompt_logprobs: per prompt position 1 .. n-1, filled as its
    // chunks run (a recompute after preemption fills nothing twice).
    std::vector<std::optional<TokenLogprobs>> prompt_logprobs;
    bool prompt_logprobs_sent = false;
    std::optional<structured::TokenConstraint> constraint;  // request.grammar: after the output so far
    bool awaiting_grammar = false;  // request.grammar_after_token not generated yet
    // sampling.allowed_token_ids as a token mask (StepSampling's words); empty: none.
    std::vector<uint32_t> allowed_mask;
    // This step: every token the masks allow is banned (min_tokens, bad_words).
    bool mask_conflict = false;
    bool masks_tokens() const { return constraint.has_value() || !allowed_mask.empty(); }
  };
  // A step's logprobs, per request that asked for them: one per token of its
  // run (accepted drafts, then the sample), in order.
  using StepLogprobs = std::unordered_map<uint64_t, std::vector<TokenLogprobs>>;
  Expected<uint64_t> enqueue(Active active);
  void admit(uint64_t id, Active active);
  std::function<void(int)> export_hook(const StepPlan& plan);
  void after_export(const StepPlan& plan);
  std::vector<size_t> mtp_export_chunks(
      const StepPlan& plan) const;  // chunks whose prompt exports its MTP state
  void export_mtp(const StepPlan& plan, const model::ForwardBatch& batch, const Tensor& hidden);
  Status run_forward(const StepPlan& plan, const model::ForwardBatch& batch,
                     std::vector<std::vector<int32_t>>& runs, StepLogprobs& logprobs, Tensor& hidden);
  bool may_speculate(uint64_t id) const;
  // One masked chunk's rows of a step (add_token_masks), found apart from
  // the others.
  struct MaskJob {
    uint64_t id;
    int32_t first_row;
    size_t entries_begin, entries_end;  // the chunk's own adjustments, in the step's
    std::span<const int32_t> drafts;
    std::vector<int32_t> rows;
    std::vector<uint32_t> words;
    bool any_allowed = true;
  };
  void add_token_masks(MaskJob& job, std::span<const ops::LogitAdjustment> adjustments) const;
  void run_mask_jobs(std::vector<MaskJob>& jobs, StepSampling& sampling);
  static bool constrain_token(Active& a, int32_t token);
  Status check_grammar(const EngineRequest& request) const;
  void record_speculation(const StepPlan& plan, std::span<const std::vector<int32_t>> runs);
  void loop();
  void drain_queues();
  void step();
  // false (and the engine failed: every request ends with the error) unless ok.
  bool fail_on_error(const Status& status);
  // The rows of prompt logits the step fetched (SequenceSpec::prompt_logits,
  // in chunk order) become their requests' prompt logprobs.
  void take_prompt_logprobs(const StepPlan& plan, const float* rows, int64_t num_rows);
  void finish(uint64_t id, EngineOutput out);
  void fail_all(const Status& status);
  void update_gauges();
  void log_throughput(double now);

  std::unique_ptr<ModelRunner> runner_;
  std::unique_ptr<MtpDrafter> drafter_;  // null: no speculative decoding
  std::unique_ptr<ThreadPool> mask_pool_;  // EngineOptions::mask_threads > 1
  // Per grammar source (its JSON text), the token sets of recurring readings
  // that its requests share (structured::TokenSetCache); engine thread only.
  std::unordered_map<std::string, std::weak_ptr<structured::TokenSetCache>> shared_readings_;
  std::shared_ptr<structured::TokenSetCache> shared_readings(const structured::Grammar& grammar);
  EngineOptions options_;
  int64_t vocab_size_;
  Scheduler scheduler_;  // engine thread only
  std::unordered_map<uint64_t, Active> active_;  // engine thread only
  std::mt19937_64 seed_source_;                  // engine thread only
  double last_log_s_ = 0;                        // engine thread only (log_throughput)
  int64_t logged_prompt_tokens_ = 0, logged_generation_tokens_ = 0;

  mutable std::mutex mutex_;  // guards the queues, stop_, next_id_, metrics_, num_queued_
  std::condition_variable wake_;
  std::vector<std::pair<uint64_t, Active>> incoming_;
  std::vector<std::pair<uint64_t, FinishReason>> cancels_;
  std::vector<std::function<void()>> commands_;  // run on the engine thread (reserve, release)
  uint64_t next_id_ = 1;
  int num_queued_ = 0;  // incoming + waiting in the scheduler
  bool stop_ = false;
  EngineMetrics metrics_;
  std::atomic<bool> dead_{false};
  std::thread thread_;
};

// Seconds on a monotonic clock (the engine's and its deadlines' time base).
double monotonic_seconds();

}  // namespace moe::engine
