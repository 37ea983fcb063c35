// The serving scheduler: continuous batching over a paged KV cache.
//
// Each step (vLLM v1's policy, small enough to read in one sitting):
//  1. Sequences past their deadline are finished with kAbort (pages freed).
//  2. Running sequences, oldest first, get their pending tokens (a decode token,
//     or the next chunk of a prompt) under the per-step token budget. A sequence
//     whose next token needs a page when none is available preempts the newest
//     running sequence (recompute: its pages are released, it returns to the
//     front of the waiting queue and later recomputes prompt + generated tokens),
//     possibly itself.
//  3. If nothing was preempted, waiting sequences are admitted in arrival order
//     while there is budget, a sequence slot (max_num_seqs) and enough available
//     pages for all of their tokens (after reusing cached prefix pages). The
//     queue is FIFO: the head blocks the rest.
// After the forward pass, complete_step() advances the computed counts, appends
// sampled tokens, publishes newly completed full pages to the prefix cache and
// finishes sequences (eos / stop id / max_tokens / max_model_len).
//
// Speculative decoding (engine/speculative.h): a running sequence may carry
// draft tokens (set_drafts) after its last sampled token. Its next decode
// chunk then verifies them: 1 + num_drafts tokens in one chunk, every one
// sampled. complete_step() takes the verified run of each sampling chunk (the
// accepted drafts, then the target's own token), appends it token by token
// (stopping at the first that ends the sequence), sets the computed length
// back to the accepted positions and frees the pages beyond it.
//
// The scheduler knows nothing of the model, sampling or clocks: time comes in as
// an argument, so runs are deterministic and testable with a fake model runner.
// Not thread-safe: owned by the engine thread.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "core/status.h"
#include "kv/prefix_cache.h"
#include "model/qwen3_moe.h"

namespace moe::engine {

enum class FinishReason { kNone, kStop, kLength, kAbort };
const char* finish_reason_name(FinishReason reason);  // "stop", "length", "abort"

struct SchedulerOptions {
  int page_size = 16;
  int32_t num_pages = 0;
  int max_num_seqs = 256;
  int max_num_batched_tokens = 2048;  // per-step token budget (chunked prefill)
  int max_model_len = 4096;           // prompt + generated tokens
  bool enable_prefix_caching = true;
  // Prompt positions per step whose logits are kept (SequenceSpec::
  // prompt_logits): each is a vocabulary-wide f32 row copied to the host
  // (600 KB for Qwen3), so such prompts advance in chunks of this many.
  int max_prompt_logits_tokens = 512;
};

struct SequenceSpec {
  uint64_t id = 0;
  std::vector<int32_t> prompt;
  int max_tokens = 16;
  std::vector<int32_t> eos_token_ids;   // ignored when ignore_eos
  std::vector<int32_t> stop_token_ids;  // always honoured
  bool ignore_eos = false;
  double deadline_s = 0;  // in the caller's clock; 0: none
  // When it finishes, its pages are held (counted as reserved) instead of
  // freed, until take_held_pages() + release_reserved(): a disaggregated
  // prefill's KV is still being read by the transfer.
  bool hold_pages = false;
  // The logits of every prompt position (prompt logprobs): its chunks add a
  // logits row for each prompt token that has a successor in the prompt,
  // after all the usual rows of the batch (build_batch), and it computes its
  // whole prompt (no prefix-cache hit).
  bool prompt_logits = false;
};

// One sequence's share of a step.
struct ScheduledChunk {
  uint64_t id = 0;
  int32_t start = 0;       // first position computed in this step
  int32_t num_tokens = 0;
  bool sample = false;     // the chunk ends the known tokens: sample the next one
  int32_t num_drafts = 0;  // draft tokens at the chunk's end (each row sampled: verification)
};

struct StepPlan {
  std::vector<ScheduledChunk> chunks;  // in batch order
  std::vector<uint64_t> expired;       // finished by their deadline (now gone)
  std::vector<uint64_t> preempted;     // sent back to waiting in this step
  int num_prefill_tokens = 0;          // tokens of sequences still in their prompt
  int num_decode_tokens = 0;
  bool empty() const { return chunks.empty(); }
};

// What complete_step() did to a sequence that sampled.
struct SequenceUpdate {
  uint64_t id = 0;
  int32_t token = -1;
  FinishReason finish = FinishReason::kNone;  // set: the sequence is gone
  int num_prompt_tokens = 0;
  int num_output_tokens = 0;
  int num_cached_tokens = 0;  // prompt tokens found in the prefix cache
};

class Scheduler {
 public:
  explicit Scheduler(SchedulerOptions options);

  const SchedulerOptions& options() const { return options_; }

  // Queues a sequence; kInvalidArgument when it can never run (empty prompt,
  // prompt + max_tokens over max_model_len, an id already in use).
  Status add(SequenceSpec spec);
  // Finishes a sequence now and frees its pages; false when it is unknown.
  bool abort(uint64_t id);

  StepPlan schedule(double now_s);
  // `sampled` holds one token per chunk with sample = true, in plan order.
  std::vector<SequenceUpdate> complete_step(const StepPlan& plan, std::span<const int32_t> sampled);
  // The same with a run of tokens per sampling chunk: the chunk's accepted
  // drafts (a prefix of them, CHECKed), then one token; one update per token
  // appended (a run stops at the token that finishes the sequence).
  std::vector<SequenceUpdate> complete_step(const StepPlan& plan, std::span<const std::vector<int32_t>> runs);

  // Speculative decoding. How many drafts a running sequence that just
  // sampled may carry: each step emits at most drafts + 1 tokens, so the
  // limit keeps max_tokens and max_model_len; 0 for an unknown sequence.
  int32_t max_drafts(uint64_t id) const;
  // Grows a running sequence's pages to hold `num_drafts` positions past its
  // known tokens (the verification's, and the MTP's chained KV); false (and
  // nothing taken) when the pages are not available.
  bool grow_for_drafts(uint64_t id, int32_t num_drafts);
  // Drafts for the sequence's next step (its pages grown for them first).
  void set_drafts(uint64_t id, std::vector<int32_t> drafts);
  bool is_running(uint64_t id) const;
  // A known sequence's prompt and generated tokens, and how many have KV.
  const std::vector<int32_t>& tokens_of(uint64_t id) const { return seqs_.at(id)->tokens; }
  int32_t num_computed(uint64_t id) const { return seqs_.at(id)->num_computed; }

  // The ragged batch for `plan` (token ids, positions, page tables; logits rows
  // for the sampling chunks).
  model::ForwardBatch build_batch(const StepPlan& plan) const;

  int num_running() const { return static_cast<int>(running_.size()); }
  int num_waiting() const { return static_cast<int>(waiting_.size()); }
  bool has_work() const { return !running_.empty() || !waiting_.empty(); }
  const kv::PrefixCache& cache() const { return cache_; }
  // Prefix cache lookups of admitted sequences, in tokens (vLLM's counters).
  int64_t prefix_query_tokens() const { return prefix_query_tokens_; }
  int64_t prefix_hit_tokens() const { return prefix_hit_tokens_; }
  int64_t num_preemptions() const { return num_preemptions_; }
  // Tokens of a sequence's prompt found in the prefix cache at its admission.
  int num_cached_tokens(uint64_t id) const;

  // CHECKs the page bookkeeping (run after every step in debug builds).
  void check_invariants() const;

  // Disaggregated decode (docs/disagg.md). Pages for `num_tokens` held outside
  // any sequence while a prefill instance writes their KV; kResourceExhausted
  // (nothing taken) when too few are available.
  Expected<std::vector<int32_t>> reserve_pages(int32_t num_tokens);
  // Returns reserved pages that were not handed to add_prefilled().
  void release_reserved(std::span<const int32_t> pages);
  int32_t num_reserved_pages() const { return num_reserved_pages_; }
  // Adds a running sequence whose prompt KV is already in `pages` (taken from
  // a reservation, covering the whole prompt) and whose first token was sampled
  // by the prefill instance. Its next step decodes from that token. The
  // returned update's finish is set when the first token already ends it (the
  // pages are then released). kInvalidArgument for a spec add() would refuse
  // or too few pages; the pages stay reserved then.
  Expected<SequenceUpdate> add_prefilled(SequenceSpec spec, std::vector<int32_t> pages, int32_t first_token);
  // The pages a finished hold_pages sequence left held (empty if none); the
  // caller frees them with release_reserved() once nothing reads them.
  std::vector<int32_t> take_held_pages(uint64_t id);
  // The pages of a known sequence, in position order.
  const std::vector<int32_t>& pages_of(uint64_t id) const { return seqs_.at(id)->pages; }

 private:
  struct Sequence {
    SequenceSpec spec;
    std::vector<int32_t> tokens;  // prompt then generated
    std::vector<int32_t> drafts;  // speculative tokens after `tokens` (not part of it)
    int32_t num_computed = 0;     // tokens whose KV is in the cache
    std::vector<int32_t> pages;
    std::vector<uint64_t> page_hashes;  // chain hashes of the first pages, published
    uint64_t arrival = 0;
    int num_cached_tokens = 0;
    bool running = false;
    bool counted = false;  // in the prefix cache counters
  };
  int32_t pages_for(int64_t tokens) const {
    return static_cast<int32_t>((tokens + options_.page_size - 1) / options_.page_size);
  }
  bool grow(Sequence& seq, int64_t num_tokens);
  void preempt(Sequence& seq);
  void finish(Sequence& seq);
  bool try_admit(Sequence& seq, int& budget, int& logits_budget, StepPlan& plan);
  // `take` cut to the step's remaining prompt-logits rows (prompt_logits sequences; 0: none left).
  int32_t cap_prompt_logits(const Sequence& seq, int32_t take, int& logits_budget) const;
  void publish_full_pages(Sequence& seq);
  void add_chunk(Sequence& seq, int32_t take, StepPlan& plan);
  FinishReason finish_reason_after(const Sequence& seq, int32_t token) const;
  void complete_run(Sequence& seq, const ScheduledChunk& chunk, const std::vector<int32_t>& run,
                    std::vector<SequenceUpdate>& updates);
  void trim_pages(Sequence& seq);

  SchedulerOptions options_;
  kv::PrefixCache cache_;
  std::map<uint64_t, std::unique_ptr<Sequence>> seqs_;
  std::vector<Sequence*> running_;  // arrival order
  std::deque<Sequence*> waiting_;   // arrival order
  uint64_t next_arrival_ = 0;
  int64_t prefix_query_tokens_ = 0, prefix_hit_tokens_ = 0, num_preemptions_ = 0;
  int32_t num_reserved_pages_ = 0;
  std::map<uint64_t, std::vector<int32_t>> held_pages_;  // finished hold_pages sequences
};

}  // namespace moe::engine
