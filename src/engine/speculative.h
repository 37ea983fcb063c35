// Speculative decoding with an MTP draft model (docs/speculative.md).
//
// Each decode step of a speculating sequence verifies the k draft tokens the
// MTP layer proposed after the previous step: the target runs the sequence's
// last token and its drafts (1 + k positions) in one ragged forward, every
// row sampled. Drafts are accepted in order:
//  - greedy requests: while the draft equals the target's argmax;
//  - sampled requests: rejection sampling (Leviathan et al. 2023, Chen et al.
//    2023): draft x drawn from q is accepted with probability
//    min(1, p(x) / q(x)); on rejection the token is drawn from
//    norm(max(0, p - q)). The emitted tokens are then distributed exactly as
//    p, the target's sampling distribution (temperature, top-k, top-p, min-p
//    applied as engine/sampler.h does). Our drafts are the MTP's argmax, so q
//    is one-hot: accept with probability p(x), else draw from p without x.
// After the first rejection, or after all k are accepted, the target's own
// token at that row follows, so a step emits 1..k+1 tokens. The scheduler
// appends them token by token (stop conditions apply to each), rolls the KV
// of rejected positions back and frees their pages.
//
// Then the MTP pass (MtpDrafter::propose): over every position whose target
// KV the step computed, the MTP layer combines the target's hidden state at t
// with the token at t + 1, writing the MTP's own KV (a one-layer cache indexed
// by the same page ids as the target's, so the scheduler's pages, rollback and
// prefix cache cover it); at the last known position its output gives draft 1,
// and k - 1 chained single-token steps give the rest.
//
// Pure functions: any thread. MtpDrafter: the thread that drives its
// scheduler (the engine thread, or the Generator's caller).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "core/thread_pool.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "kv/kv_cache.h"
#include "model/mtp.h"

namespace moe::engine {

inline constexpr int kMaxSpeculativeTokens = 8;

// --speculative-config, vLLM's spelling: {"method": "mtp", "num_speculative_tokens": k}.
struct SpeculativeConfig {
  std::string method;  // "mtp"; empty: speculative decoding is off
  int num_speculative_tokens = 0;
  bool enabled() const { return num_speculative_tokens > 0; }
};
// Empty text: off. Errors name the field (bad JSON, unknown method or field, k outside 1..8).
Expected<SpeculativeConfig> parse_speculative_config(const std::string& json_text);

// The distribution sample_token draws from for `params` (not greedy):
// probabilities over the whole vocabulary, zero outside the kept tokens.
std::vector<double> sampling_distribution(std::span<const float> logits, const SamplingParams& params);

// One position of rejection sampling. `p` the target's distribution, `q` the
// draft's (empty: one-hot at `draft`), `draft` drawn from q; `u_accept` and
// `u_resample` independent uniforms in [0, 1). Returns the emitted token and
// whether it is the accepted draft.
struct RejectionResult {
  int32_t token = -1;
  bool accepted = false;
};
RejectionResult rejection_step(std::span<const double> p, std::span<const double> q, int32_t draft, double u_accept,
                               double u_resample);

// StepSampling (engine/sampler.h) on the host, from a step's logits
// ([logits rows, vocab]; adjusted rows are changed in place): a row's sample
// is sample_token's for (seed, step); a draft row's acceptance draws for
// (seed ^ kAcceptSalt, step), its resample (rejection_step) for (seed, step).
inline constexpr uint64_t kAcceptSalt = 0x5370656341636370ull;
SampledStep sample_on_host(Tensor& logits, const StepSampling& sampling);

// Appends the rows of sampling chunk `c` of `plan` to `sampling`: one per
// draft, verifying it, and one after, with steps first.step, first.step + 1, ...
void add_chunk_rows(StepSampling& sampling, const StepPlan& plan, const model::ForwardBatch& batch, size_t c,
                    const RowSampling& first);
// The adjustments (logit_adjustments) of a sampling chunk's rows from
// `first_row` on: row first_row + j sees drafts[0 .. j) as output after the
// sequence's `tokens` (its last num_output the output so far), as the plain
// step after accepting those drafts would.
void add_chunk_adjustments(StepSampling& sampling, int32_t first_row, const SamplingParams& params,
                           std::span<const int32_t> tokens, size_t num_output,
                           std::span<const int32_t> drafts, std::span<const int32_t> stop_ids,
                           int64_t vocab_size);
// 0 .. num_tokens - 1: the hidden-state rows a drafting step needs.
std::vector<int32_t> every_row(const model::ForwardBatch& batch);

// The tokens of every sampling chunk of `plan` from its rows' samples
// (batch.logits_rows order: a chunk with drafts has 1 + num_drafts rows, the
// last without a draft): the accepted drafts in order, then the sample of the
// first row whose draft was rejected, or of the last row.
std::vector<std::vector<int32_t>> runs_from_samples(const StepPlan& plan, const SampledStep& sampled);

// Per-step speculation counts, for metrics.
struct SpecStepStats {
  int64_t num_draft_tokens = 0;     // drafts verified
  int64_t num_accepted_tokens = 0;  // of those, accepted
  std::vector<int> acceptance_lengths;  // per verifying chunk: tokens emitted (accepted + 1)
};
SpecStepStats spec_step_stats(const StepPlan& plan, std::span<const std::vector<int32_t>> runs);

// Where the MTP forward runs, over the MTP layer's one-layer KV cache (page
// ids shared with the target's): the CPU (CpuMtpRunner) or the GPU
// (engine/cuda_runner.h). forward() fails only on a device error; its output
// has every output row's greedy token (MtpOutput::greedy), and the logits
// unless the batch says it does not want them.
class MtpRunner {
 public:
  virtual ~MtpRunner() = default;
  virtual int64_t hidden_size() const = 0;
  virtual Expected<model::MtpOutput> forward(const model::MtpBatch& batch, TensorView hidden) = 0;
  // Chained passes after a forward() whose output is `first`: pass j's rows
  // continue output rows of pass j - 1 (pass 0: of `first`), named by their
  // MtpBatch::previous_rows. Returns each pass's greedy tokens, one per output
  // row. Here: forward() pass by pass, the states through the host; runners
  // that keep their states (keeps_target_hidden) queue every pass on the
  // device and wait once, reading their last forward's rows (then `first`
  // may be without hidden states).
  virtual Expected<std::vector<std::vector<int32_t>>> forward_chain(const model::MtpOutput& first,
                                                                    std::span<const model::MtpBatch> passes);
  virtual const kv::KvCache& cache() const = 0;
  // Whether the target's hidden states of its last forward are kept where
  // this runner reads them (MtpBatch::target_rows), and its own outputs for
  // forward_chain: the GPU's, when the target runs there too.
  virtual bool keeps_target_hidden() const { return false; }
};

// MtpModel on the CPU, its KV cache one layer of `target_layout`'s shape and page count.
class CpuMtpRunner final : public MtpRunner {
 public:
  CpuMtpRunner(const model::MtpModel& mtp, ThreadPool& pool, const kv::KvCacheLayout& target_layout);
  int64_t hidden_size() const override { return mtp_.config().hidden_size; }
  Expected<model::MtpOutput> forward(const model::MtpBatch& batch, TensorView hidden) override;
  const kv::KvCache& cache() const override { return cache_; }

 private:
  const model::MtpModel& mtp_;
  ThreadPool& pool_;
  kv::KvCache cache_;
};

class MtpDrafter {
 public:
  // On the CPU: the MTP's KV cache has one layer of `target_layout`'s shape and page count.
  MtpDrafter(const model::MtpModel& mtp, ThreadPool& pool, const kv::KvCacheLayout& target_layout,
             int num_speculative_tokens);
  // On any MtpRunner (the GPU's).
  MtpDrafter(std::unique_ptr<MtpRunner> runner, int num_speculative_tokens);

  int num_speculative_tokens() const { return num_speculative_tokens_; }
  size_t cache_bytes() const { return runner_->cache().num_bytes(); }
  const kv::KvCache& cache() const { return runner_->cache(); }
  int64_t hidden_size() const { return runner_->hidden_size(); }
  // Whether propose() reads the target's hidden states where the runner kept
  // them (then its `hidden` may be empty; MtpRunner::keeps_target_hidden).
  bool keeps_target_hidden() const { return runner_->keeps_target_hidden(); }

  // After scheduler.complete_step(plan, ...): extends the MTP's KV over the
  // positions the step computed (hidden: the target's last hidden state of
  // every row of `batch`) and gives every still-running sequence that just
  // sampled and `may_speculate` up to k drafts (fewer near max_tokens or
  // max_model_len; none when their pages are not available).
  void propose(Scheduler& scheduler, const StepPlan& plan, const model::ForwardBatch& batch, const Tensor& hidden,
               const std::function<bool(uint64_t id)>& may_speculate);

  // Disaggregated prefill, before scheduler.complete_step(plan, ...): the MTP
  // KV of the positions of the prompt-completing chunks `chunks` (indices into
  // plan.chunks, sampling chunks) whose next token is the prompt's, i.e. all
  // but the last (propose() would skip them: the prefill request finishes in
  // this step).
  void write_prompt_kv(const Scheduler& scheduler, const StepPlan& plan, const model::ForwardBatch& batch,
                       const Tensor& hidden, std::span<const size_t> chunks);
  // Disaggregated decode, once a prefilled sequence is added (its prompt's
  // MTP KV but the last position's in the cache, its first token appended):
  // the MTP step at the prompt's last position, from the target's hidden
  // state there (`last_hidden`, [hidden]) and the first token, then the
  // chained steps; the sequence gets its drafts as after a local prefill.
  void start_prefilled(Scheduler& scheduler, uint64_t id, std::span<const float> last_hidden);

 private:
  struct Drafting {
    uint64_t id = 0;
    int32_t next_position = 0;  // the position of the next chained MTP step
    std::vector<int32_t> drafts;
  };
  std::vector<Drafting> first_pass(Scheduler& scheduler, const StepPlan& plan,
                                   const model::ForwardBatch& batch, const Tensor& hidden,
                                   const std::function<bool(uint64_t)>& may_speculate,
                                   std::optional<model::MtpOutput>& out);
  void chain(Scheduler& scheduler, std::vector<Drafting>& drafting, const model::MtpOutput& first);
  // runner_->forward(); on an error (a device failure), logged once per
  // drafter, no output: the sequences decode without drafts this step.
  std::optional<model::MtpOutput> run(const model::MtpBatch& batch, TensorView hidden);

  std::unique_ptr<MtpRunner> runner_;
  int num_speculative_tokens_;
  bool warned_ = false;
};

}  // namespace moe::engine
