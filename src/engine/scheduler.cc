#include "engine/scheduler.h"

#include <algorithm>

#include "core/check.h"

namespace moe::engine {

const char* finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kAbort: return "abort";
    case FinishReason::kNone: break;
  }
  return "";
}

Scheduler::Scheduler(SchedulerOptions options)
    : options_(options), cache_(options.num_pages, options.page_size, options.enable_prefix_caching) {
  CHECK(options.max_num_seqs > 0 && options.max_num_batched_tokens > 0, "scheduler limits");
  // One sequence of max_model_len must always fit alone, or it could preempt
  // itself forever.
  CHECK(pages_for(options.max_model_len) <= options.num_pages, "max_model_len {} needs more than {} pages",
        options.max_model_len, options.num_pages);
}

Status Scheduler::add(SequenceSpec spec) {
  if (spec.prompt.empty()) return invalid_argument("the prompt is empty");
  if (spec.max_tokens < 1) return invalid_argument("max_tokens must be at least 1, got {}", spec.max_tokens);
  if (static_cast<int64_t>(spec.prompt.size()) + spec.max_tokens > options_.max_model_len)
    return invalid_argument("prompt ({} tokens) + max_tokens ({}) is over max_model_len {}", spec.prompt.size(),
                            spec.max_tokens, options_.max_model_len);
  if (seqs_.count(spec.id)) return invalid_argument("sequence id {} is in use", spec.id);
  auto seq = std::make_unique<Sequence>();
  seq->tokens = spec.prompt;
  seq->arrival = next_arrival_++;
  seq->spec = std::move(spec);
  waiting_.push_back(seq.get());
  seqs_.emplace(seq->spec.id, std::move(seq));
  return Status::ok();
}

void Scheduler::finish(Sequence& seq) {
  if (seq.spec.hold_pages && !seq.pages.empty()) {
    num_reserved_pages_ += static_cast<int32_t>(seq.pages.size());
    held_pages_[seq.spec.id] = std::move(seq.pages);
  } else {
    cache_.release(seq.pages);
  }
  if (seq.running) running_.erase(std::find(running_.begin(), running_.end(), &seq));
  else waiting_.erase(std::find(waiting_.begin(), waiting_.end(), &seq));
  seqs_.erase(seq.spec.id);
}

bool Scheduler::abort(uint64_t id) {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return false;
  finish(*it->second);
  return true;
}

int Scheduler::num_cached_tokens(uint64_t id) const {
  auto it = seqs_.find(id);
  return it == seqs_.end() ? 0 : it->second->num_cached_tokens;
}

bool Scheduler::grow(Sequence& seq, int64_t num_tokens) {
  const int32_t need = pages_for(num_tokens) - static_cast<int32_t>(seq.pages.size());
  if (need <= 0) return true;
  auto pages = cache_.allocate(need);
  if (!pages) return false;
  seq.pages.insert(seq.pages.end(), pages->begin(), pages->end());
  return true;
}

void Scheduler::preempt(Sequence& seq) {
  cache_.release(seq.pages);
  seq.pages.clear();
  seq.page_hashes.clear();
  seq.drafts.clear();
  seq.num_computed = 0;
  seq.running = false;
  running_.erase(std::find(running_.begin(), running_.end(), &seq));
  // Back to the waiting queue in arrival order (it is older than most waiters).
  auto pos = std::find_if(waiting_.begin(), waiting_.end(), [&](Sequence* w) { return w->arrival > seq.arrival; });
  waiting_.insert(pos, &seq);
  ++num_preemptions_;
}

// `take` includes the sequence's drafts (all of them: the caller trims them to the budget).
void Scheduler::add_chunk(Sequence& seq, int32_t take, StepPlan& plan) {
  const auto num_drafts = static_cast<int32_t>(seq.drafts.size());
  const bool in_prompt = seq.num_computed < static_cast<int32_t>(seq.spec.prompt.size());
  const bool sample = seq.num_computed + take - num_drafts == static_cast<int32_t>(seq.tokens.size());
  CHECK(num_drafts == 0 || sample, "sequence {}: drafts on a chunk that does not sample", seq.spec.id);
  plan.chunks.push_back({seq.spec.id, seq.num_computed, take, sample, num_drafts});
  (in_prompt || take - num_drafts > 1 ? plan.num_prefill_tokens : plan.num_decode_tokens) += take;
}

int32_t Scheduler::cap_prompt_logits(const Sequence& seq, int32_t take, int& logits_budget) const {
  if (!seq.spec.prompt_logits) return take;
  const int32_t rows = std::min(take, static_cast<int32_t>(seq.spec.prompt.size()) - 1 - seq.num_computed);
  if (rows <= 0) return take;  // past the prompt's rows
  const int32_t kept = std::min(rows, logits_budget);
  logits_budget -= kept;
  return kept < rows ? kept : take;
}

bool Scheduler::try_admit(Sequence& seq, int& budget, int& logits_budget, StepPlan& plan) {
  // Reuse cached full pages, but always leave at least one token to compute:
  // its logits give the next token.
  const auto num_tokens = static_cast<int32_t>(seq.tokens.size());
  std::vector<int32_t> cached =
      cache_.acquire_prefix(seq.tokens, seq.spec.prompt_logits ? 0 : (num_tokens - 1) / options_.page_size);
  const int32_t need = pages_for(num_tokens) - static_cast<int32_t>(cached.size());
  if (need > cache_.num_available()) {
    cache_.release(cached);
    return false;
  }
  const auto num_cached = static_cast<int32_t>(cached.size()) * options_.page_size;
  if (!seq.counted) {  // first admission, not a recompute after preemption
    seq.counted = true;
    prefix_query_tokens_ += num_tokens;
    prefix_hit_tokens_ += num_cached;
    seq.num_cached_tokens = num_cached;
  }
  seq.pages = std::move(cached);
  CHECK(grow(seq, num_tokens), "admission after the availability check");
  seq.num_computed = num_cached;
  // The cached pages are published already: their hashes start the chain.
  uint64_t parent = kv::kRootHash;
  for (int32_t i = 0; i < num_cached / options_.page_size; ++i) {
    parent = kv::chain_hash(parent, std::span(seq.tokens).subspan(static_cast<size_t>(i) * options_.page_size,
                                                                  static_cast<size_t>(options_.page_size)));
    seq.page_hashes.push_back(parent);
  }
  seq.running = true;
  waiting_.pop_front();
  running_.push_back(&seq);
  const int32_t take = cap_prompt_logits(seq, std::min(num_tokens - seq.num_computed, budget), logits_budget);
  if (take == 0) return true;  // no prompt-logits rows left in this step: computed from the next
  add_chunk(seq, take, plan);
  budget -= take;
  return true;
}

StepPlan Scheduler::schedule(double now_s) {
  StepPlan plan;
  std::vector<Sequence*> expired;
  for (auto& [id, seq] : seqs_)
    if (seq->spec.deadline_s > 0 && now_s >= seq->spec.deadline_s) expired.push_back(seq.get());
  for (Sequence* seq : expired) {
    plan.expired.push_back(seq->spec.id);
    finish(*seq);
  }

  int budget = options_.max_num_batched_tokens, logits_budget = options_.max_prompt_logits_tokens;
  const std::vector<Sequence*> running = running_;
  for (Sequence* seq : running) {
    if (budget <= 0) break;
    if (!seq->running) continue;  // preempted earlier in this step
    const int32_t pending = static_cast<int32_t>(seq->tokens.size()) - seq->num_computed;
    // Drafts only when the whole window fits the budget's remainder.
    if (pending + static_cast<int32_t>(seq->drafts.size()) > budget)
      seq->drafts.resize(static_cast<size_t>(std::max(0, budget - pending)));
    int32_t take = cap_prompt_logits(
        *seq, std::min(pending + static_cast<int32_t>(seq->drafts.size()), budget), logits_budget);
    if (take == 0) continue;  // its prompt-logits rows wait for the next step
    if (!seq->drafts.empty() && !grow(*seq, seq->num_computed + take)) {
      seq->drafts.clear();  // drop the speculation before preempting anyone
      take = std::min(pending, budget);
    }
    while (!grow(*seq, seq->num_computed + take)) {
      Sequence* victim = running_.back();
      plan.preempted.push_back(victim->spec.id);
      preempt(*victim);
      if (victim == seq) break;
    }
    if (!seq->running) continue;
    add_chunk(*seq, take, plan);
    budget -= take;
  }

  while (plan.preempted.empty() && !waiting_.empty() && budget > 0 &&
         static_cast<int>(running_.size()) < options_.max_num_seqs) {
    if (!try_admit(*waiting_.front(), budget, logits_budget, plan)) break;
  }
  return plan;
}

void Scheduler::publish_full_pages(Sequence& seq) {
  const int ps = options_.page_size;
  while (static_cast<int32_t>(seq.page_hashes.size() + 1) * ps <= seq.num_computed) {
    const size_t i = seq.page_hashes.size();
    const uint64_t parent = i == 0 ? kv::kRootHash : seq.page_hashes.back();
    seq.page_hashes.push_back(
        cache_.publish(parent, std::span(seq.tokens).subspan(i * ps, static_cast<size_t>(ps)), seq.pages[i]));
  }
}

std::vector<SequenceUpdate> Scheduler::complete_step(const StepPlan& plan, std::span<const int32_t> sampled) {
  std::vector<std::vector<int32_t>> runs;
  runs.reserve(sampled.size());
  for (int32_t token : sampled) runs.push_back({token});
  return complete_step(plan, std::span<const std::vector<int32_t>>(runs));
}

std::vector<SequenceUpdate> Scheduler::complete_step(const StepPlan& plan, std::span<const std::vector<int32_t>> runs) {
  std::vector<SequenceUpdate> updates;
  size_t next_sample = 0;
  for (const ScheduledChunk& chunk : plan.chunks) {
    auto it = seqs_.find(chunk.id);
    if (it == seqs_.end()) {  // aborted while the step ran
      if (chunk.sample) ++next_sample;
      continue;
    }
    Sequence& seq = *it->second;
    CHECK(seq.num_computed == chunk.start, "sequence {} computed {} but the chunk started at {}", chunk.id,
          seq.num_computed, chunk.start);
    if (!chunk.sample) {
      seq.num_computed += chunk.num_tokens;
      publish_full_pages(seq);
      continue;
    }
    CHECK(next_sample < runs.size(), "fewer sampled runs than sampling chunks");
    complete_run(seq, chunk, runs[next_sample++], updates);
  }
  CHECK(next_sample == runs.size(), "{} sampled runs for {} sampling chunks", runs.size(), next_sample);
  return updates;
}

// A sampling chunk's run: drafts accepted (a prefix of the chunk's), then the
// target's token. KV is valid for the chunk's known tokens and the accepted
// drafts; the rejected positions are rolled back.
void Scheduler::complete_run(Sequence& seq, const ScheduledChunk& chunk, const std::vector<int32_t>& run,
                             std::vector<SequenceUpdate>& updates) {
  CHECK(!run.empty() && static_cast<int32_t>(run.size()) <= chunk.num_drafts + 1,
        "sequence {}: a run of {} tokens for {} drafts", chunk.id, run.size(), chunk.num_drafts);
  CHECK(static_cast<int32_t>(seq.drafts.size()) == chunk.num_drafts, "sequence {}: drafts changed in the step",
        chunk.id);
  for (size_t j = 0; j + 1 < run.size(); ++j)
    CHECK(run[j] == seq.drafts[j], "sequence {}: run token {} is not the draft", chunk.id, j);
  const int32_t valid = chunk.num_tokens - chunk.num_drafts + static_cast<int32_t>(run.size()) - 1;
  seq.drafts.clear();
  FinishReason reason = FinishReason::kNone;
  for (int32_t token : run) {
    seq.tokens.push_back(token);
    SequenceUpdate u{seq.spec.id, token};
    u.num_prompt_tokens = static_cast<int>(seq.spec.prompt.size());
    u.num_cached_tokens = seq.num_cached_tokens;
    u.num_output_tokens = static_cast<int>(seq.tokens.size() - seq.spec.prompt.size());
    u.finish = reason = finish_reason_after(seq, token);
    updates.push_back(u);
    if (reason != FinishReason::kNone) break;
  }
  seq.num_computed = std::min(chunk.start + valid, static_cast<int32_t>(seq.tokens.size()));
  publish_full_pages(seq);
  trim_pages(seq);  // the pages of rejected drafts (or of drafts the step budget trimmed)
  if (reason != FinishReason::kNone) finish(seq);
}

// Frees the pages past the computed positions (those of rejected drafts).
void Scheduler::trim_pages(Sequence& seq) {
  const auto keep = static_cast<size_t>(std::max(1, pages_for(seq.num_computed)));
  if (seq.pages.size() <= keep) return;
  cache_.release(std::span<const int32_t>(seq.pages).subspan(keep));
  seq.pages.resize(keep);
}

int32_t Scheduler::max_drafts(uint64_t id) const {
  auto it = seqs_.find(id);
  if (it == seqs_.end() || !it->second->running) return 0;
  const Sequence& seq = *it->second;
  const auto num_tokens = static_cast<int32_t>(seq.tokens.size());
  const auto num_output = num_tokens - static_cast<int32_t>(seq.spec.prompt.size());
  if (seq.num_computed + 1 != num_tokens) return 0;  // not right after a sampled token
  return std::max(0, std::min(seq.spec.max_tokens - num_output, options_.max_model_len - num_tokens) - 1);
}

bool Scheduler::grow_for_drafts(uint64_t id, int32_t num_drafts) {
  Sequence& seq = *seqs_.at(id);
  CHECK(seq.running, "drafts for waiting sequence {}", id);
  return grow(seq, static_cast<int64_t>(seq.tokens.size()) + num_drafts);
}

void Scheduler::set_drafts(uint64_t id, std::vector<int32_t> drafts) {
  Sequence& seq = *seqs_.at(id);
  CHECK(seq.running && static_cast<int32_t>(drafts.size()) <= max_drafts(id), "sequence {}: {} drafts", id,
        drafts.size());
  CHECK(static_cast<int64_t>(seq.pages.size()) * options_.page_size >=
            static_cast<int64_t>(seq.tokens.size() + drafts.size()),
        "sequence {}: pages for its drafts", id);
  seq.drafts = std::move(drafts);
}

bool Scheduler::is_running(uint64_t id) const {
  auto it = seqs_.find(id);
  return it != seqs_.end() && it->second->running;
}

// Called once `token` is appended to `seq.tokens`.
FinishReason Scheduler::finish_reason_after(const Sequence& seq, int32_t token) const {
  const auto& spec = seq.spec;
  const bool eos = !spec.ignore_eos && std::count(spec.eos_token_ids.begin(), spec.eos_token_ids.end(), token);
  const bool stop = std::count(spec.stop_token_ids.begin(), spec.stop_token_ids.end(), token) > 0;
  if (eos || stop) return FinishReason::kStop;
  const auto num_output = static_cast<int>(seq.tokens.size() - spec.prompt.size());
  if (num_output >= spec.max_tokens || static_cast<int>(seq.tokens.size()) >= options_.max_model_len)
    return FinishReason::kLength;
  return FinishReason::kNone;
}

std::vector<int32_t> Scheduler::take_held_pages(uint64_t id) {
  auto it = held_pages_.find(id);
  if (it == held_pages_.end()) return {};
  std::vector<int32_t> pages = std::move(it->second);
  held_pages_.erase(it);
  return pages;
}

Expected<std::vector<int32_t>> Scheduler::reserve_pages(int32_t num_tokens) {
  if (num_tokens < 1 || num_tokens > options_.max_model_len)
    return invalid_argument("cannot reserve KV for {} tokens (max_model_len {})", num_tokens, options_.max_model_len);
  auto pages = cache_.allocate(pages_for(num_tokens));
  if (!pages) return resource_exhausted("no KV pages for {} tokens ({} available)", num_tokens, cache_.num_available());
  num_reserved_pages_ += static_cast<int32_t>(pages->size());
  return pages;
}

void Scheduler::release_reserved(std::span<const int32_t> pages) {
  CHECK(static_cast<int32_t>(pages.size()) <= num_reserved_pages_, "releasing {} pages, {} reserved", pages.size(),
        num_reserved_pages_);
  num_reserved_pages_ -= static_cast<int32_t>(pages.size());
  cache_.release(pages);
}

Expected<SequenceUpdate> Scheduler::add_prefilled(SequenceSpec spec, std::vector<int32_t> pages, int32_t first_token) {
  const auto num_prompt = static_cast<int32_t>(spec.prompt.size());
  if (spec.prompt.empty() || spec.max_tokens < 1 || num_prompt + spec.max_tokens > options_.max_model_len)
    return invalid_argument("prompt ({} tokens) + max_tokens ({}) is over max_model_len {}", num_prompt, spec.max_tokens,
                            options_.max_model_len);
  if (static_cast<int64_t>(pages.size()) * options_.page_size < num_prompt)
    return invalid_argument("{} pages cannot hold a prompt of {} tokens", pages.size(), num_prompt);
  if (seqs_.count(spec.id)) return invalid_argument("sequence id {} is in use", spec.id);
  CHECK(static_cast<int32_t>(pages.size()) <= num_reserved_pages_, "prefilled pages were not reserved");
  num_reserved_pages_ -= static_cast<int32_t>(pages.size());
  auto seq = std::make_unique<Sequence>();
  seq->tokens = spec.prompt;
  seq->tokens.push_back(first_token);
  seq->num_computed = num_prompt;
  seq->pages = std::move(pages);
  seq->arrival = next_arrival_++;
  seq->running = true;
  seq->counted = true;
  seq->spec = std::move(spec);
  Sequence& ref = *seq;
  seqs_.emplace(ref.spec.id, std::move(seq));
  running_.push_back(&ref);
  SequenceUpdate u{ref.spec.id, first_token};
  u.num_prompt_tokens = num_prompt;
  u.num_output_tokens = 1;
  u.finish = finish_reason_after(ref, first_token);
  if (u.finish != FinishReason::kNone) finish(ref);
  return u;
}

model::ForwardBatch Scheduler::build_batch(const StepPlan& plan) const {
  model::ForwardBatch batch;
  size_t max_pages = 1;
  for (const auto& chunk : plan.chunks) max_pages = std::max(max_pages, seqs_.at(chunk.id)->pages.size());
  batch.max_pages_per_seq = static_cast<int>(max_pages);
  batch.query_start.push_back(0);
  std::vector<int32_t> prompt_rows;  // prompt_logits sequences' rows, after the others
  for (const auto& chunk : plan.chunks) {
    const Sequence& seq = *seqs_.at(chunk.id);
    if (seq.spec.prompt_logits) {
      const auto last =
          static_cast<int32_t>(seq.spec.prompt.size()) - 1;  // the last prompt token has no successor
      for (int32_t i = 0; i < chunk.num_tokens && chunk.start + i < last; ++i)
        prompt_rows.push_back(batch.num_tokens() + i);
    }
    const int32_t num_known = chunk.num_tokens - chunk.num_drafts;
    for (int32_t i = 0; i < chunk.num_tokens; ++i) {
      batch.token_ids.push_back(i < num_known ? seq.tokens[chunk.start + i] : seq.drafts[i - num_known]);
      batch.positions.push_back(chunk.start + i);
    }
    batch.query_start.push_back(batch.num_tokens());
    std::vector<int32_t> row = seq.pages;
    row.resize(max_pages, -1);
    batch.page_table.insert(batch.page_table.end(), row.begin(), row.end());
    if (chunk.sample)  // every draft row is verified, then the last row's token follows
      for (int32_t r = chunk.num_drafts; r >= 0; --r) batch.logits_rows.push_back(batch.num_tokens() - 1 - r);
  }
  batch.logits_rows.insert(batch.logits_rows.end(), prompt_rows.begin(), prompt_rows.end());
  return batch;
}

void Scheduler::check_invariants() const {
  cache_.check_invariants();
  int64_t referenced = 0;
  for (const Sequence* seq : running_) {
    CHECK(seq->running, "running list holds a waiting sequence");
    CHECK(static_cast<int64_t>(seq->pages.size()) * options_.page_size >= seq->num_computed, "pages cover KV");
    referenced += static_cast<int64_t>(seq->pages.size());
  }
  for (const Sequence* seq : waiting_) CHECK(!seq->running && seq->pages.empty(), "waiting sequence holds pages");
  referenced += num_reserved_pages_;
  CHECK(running_.size() + waiting_.size() == seqs_.size(), "every sequence is running or waiting");
  // Shared pages are counted once per holder, so holders >= pages in use.
  CHECK(referenced >= cache_.num_used(), "{} page references < {} pages in use", referenced, cache_.num_used());
}

}  // namespace moe::engine
