#include "engine/engine.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <exception>
#include <limits>
#include <numeric>
#include <utility>

#include "core/check.h"
#include "core/logging.h"

namespace moe::engine {

double monotonic_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

namespace {

// log_softmax of `logits` at the sampled token, and the top k (raw model
// distribution, as vLLM and OpenAI report it).
TokenLogprobs compute_logprobs(std::span<const float> logits, int32_t token, int k) {
  const float max_logit = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (float x : logits) sum += std::exp(static_cast<double>(x - max_logit));
  const auto log_z = static_cast<float>(max_logit + std::log(sum));
  TokenLogprobs out;
  out.token = token;
  out.logprob = logits[static_cast<size_t>(token)] - log_z;
  const float own = logits[static_cast<size_t>(token)];
  out.rank = 1;
  for (size_t i = 0; i < logits.size(); ++i)
    out.rank += logits[i] > own || (logits[i] == own && static_cast<int32_t>(i) < token);
  if (k > 0) {
    std::vector<int32_t> ids(logits.size());
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i);
    const auto kk = std::min<size_t>(static_cast<size_t>(k), ids.size());
    std::partial_sort(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(kk), ids.end(), [&](int32_t a, int32_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    for (size_t i = 0; i < kk; ++i) out.top.emplace_back(ids[i], logits[static_cast<size_t>(ids[i])] - log_z);
  }
  return out;
}

// Runs an output callback; an exception from it (the caller's code) is logged
// and contained, so it cannot take the engine thread down.
void deliver(const OutputCallback& callback, const EngineOutput& out) {
  try {
    callback(out);
  } catch (const std::exception& e) {
    log_error("engine: the output callback of request {} threw: {}", out.id, e.what());
  }
}

}  // namespace

Engine::Engine(std::unique_ptr<ModelRunner> runner, EngineOptions options, std::unique_ptr<MtpDrafter> drafter)
    : runner_(std::move(runner)),
      drafter_(std::move(drafter)),
      options_(std::move(options)),
      vocab_size_(runner_->vocab_size()),
      scheduler_(options_.scheduler),
      seed_source_(std::random_device{}()) {
  CHECK(!drafter_ || runner_->supports_hidden_states(), "speculative decoding needs a runner with hidden states");
  const int mask_threads = options_.mask_threads > 0
                               ? options_.mask_threads
                               : std::min(8, std::max(1, static_cast<int>(std::thread::hardware_concurrency())));
  if (mask_threads > 1) mask_pool_ = std::make_unique<ThreadPool>(mask_threads);
  thread_ = std::thread([this] { loop(); });
}

Engine::~Engine() { shutdown(); }

void Engine::shutdown() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

Expected<uint64_t> Engine::submit(EngineRequest request, OutputCallback on_output) {
  if (request.prompt.empty()) return invalid_argument("the prompt is empty");
  for (int32_t id : request.prompt)
    if (id < 0 || id >= vocab_size_) return invalid_argument("token id {} is outside the vocabulary [0, {})", id, vocab_size_);
  if (request.max_tokens < 1) return invalid_argument("max_tokens must be at least 1, got {}", request.max_tokens);
  const int64_t total = static_cast<int64_t>(request.prompt.size()) + request.max_tokens;
  if (total > options_.scheduler.max_model_len)
    return invalid_argument("prompt ({} tokens) + max_tokens ({}) is over max_model_len {}", request.prompt.size(),
                            request.max_tokens, options_.scheduler.max_model_len);
  MOE_RETURN_IF_ERROR(validate_sampling(request.sampling, vocab_size_));
  if (request.num_logprobs > vocab_size_) return invalid_argument("logprobs must be at most {}", vocab_size_);
  if (request.num_prompt_logprobs > vocab_size_)
    return invalid_argument("prompt logprobs must be at most {}", vocab_size_);
  if (request.kv_export && !runner_->supports_layer_hook())
    return invalid_argument("this model runner cannot export KV layer by layer");
  MOE_RETURN_IF_ERROR(check_grammar(request));
  Active active;
  active.request = std::move(request);
  active.on_output = std::move(on_output);
  return enqueue(std::move(active));
}

Status Engine::check_grammar(const EngineRequest& request) const {
  if (!request.grammar) return Status::ok();
  if (!options_.vocabulary) return invalid_argument("structured outputs need the model's tokenizer");
  if (request.grammar_after_token >= vocab_size_)
    return invalid_argument("grammar_after_token {} is outside the vocabulary", request.grammar_after_token);
  if (options_.vocabulary->size() != vocab_size_)
    return internal_error("the structured-output vocabulary has {} tokens, the model {}", options_.vocabulary->size(),
                          vocab_size_);
  return Status::ok();
}

Expected<uint64_t> Engine::enqueue(Active active) {
  if (dead_.load()) return unavailable("the engine has failed");
  active.arrival_s = monotonic_seconds();
  uint64_t id = 0;
  {
    std::lock_guard lock(mutex_);
    if (stop_) return unavailable("the engine is shutting down");
    if (num_queued_ >= options_.max_waiting)
      return resource_exhausted("the request queue is full ({} waiting)", num_queued_);
    id = next_id_++;
    ++num_queued_;
    incoming_.emplace_back(id, std::move(active));
  }
  wake_.notify_one();
  return id;
}

Expected<uint64_t> Engine::submit_prefilled(EngineRequest request, PrefilledPrompt prompt, OutputCallback on_output) {
  if (request.prompt.empty()) return invalid_argument("the prompt is empty");
  for (int32_t id : request.prompt)
    if (id < 0 || id >= vocab_size_) return invalid_argument("token id {} is outside the vocabulary [0, {})", id, vocab_size_);
  if (prompt.first_token < 0 || prompt.first_token >= vocab_size_)
    return invalid_argument("first token {} is outside the vocabulary [0, {})", prompt.first_token, vocab_size_);
  if (request.max_tokens < 1) return invalid_argument("max_tokens must be at least 1, got {}", request.max_tokens);
  MOE_RETURN_IF_ERROR(validate_sampling(request.sampling, vocab_size_));
  if (request.kv_export) return invalid_argument("a prefilled request exports no KV");
  if (request.num_prompt_logprobs >= 0)
    return invalid_argument("a prefilled request has no prompt logprobs here");
  MOE_RETURN_IF_ERROR(check_grammar(request));
  if (request.grammar && request.grammar_after_token < 0) {
    structured::TokenConstraint constraint(request.grammar, options_.vocabulary, options_.eos_token_ids);
    if (!constraint.accept(prompt.first_token))
      return invalid_argument("the first token {} is not one the request's grammar allows", prompt.first_token);
  }
  const auto& allowed = request.sampling.allowed_token_ids;
  if (!allowed.empty() && std::find(allowed.begin(), allowed.end(), prompt.first_token) == allowed.end())
    return invalid_argument("the first token {} is not in the request's allowed_token_ids", prompt.first_token);
  if (!prompt.last_hidden.empty() && static_cast<int64_t>(prompt.last_hidden.size()) != mtp_hidden_size())
    return invalid_argument("the prefilled MTP state has {} values; this engine's {}", prompt.last_hidden.size(),
                            drafter_ ? fmt::format("MTP layer takes {}", mtp_hidden_size()) : "has no MTP layer");
  Active active;
  active.request = std::move(request);
  active.on_output = std::move(on_output);
  active.prefilled_pages = std::move(prompt.pages);
  active.first_token = prompt.first_token;
  active.last_hidden = std::move(prompt.last_hidden);
  active.has_mtp_state = !active.last_hidden.empty();
  active.num_output_tokens = 1;
  return enqueue(std::move(active));
}

void Engine::reserve(int32_t num_tokens, std::function<void(Expected<std::vector<int32_t>>)> done) {
  {
    std::lock_guard lock(mutex_);
    if (!stop_) {
      commands_.push_back([this, num_tokens, done] { done(scheduler_.reserve_pages(num_tokens)); });
      wake_.notify_one();
      return;
    }
  }
  done(unavailable("the engine is shutting down"));
}

void Engine::release(std::vector<int32_t> pages) {
  {
    std::lock_guard lock(mutex_);
    commands_.push_back([this, pages = std::move(pages)] { scheduler_.release_reserved(pages); });
  }
  wake_.notify_one();
}

void Engine::cancel(uint64_t id, FinishReason finish) {
  {
    std::lock_guard lock(mutex_);
    cancels_.emplace_back(id, finish == FinishReason::kStop ? FinishReason::kStop : FinishReason::kAbort);
  }
  wake_.notify_one();
}

EngineMetrics Engine::metrics() const {
  std::lock_guard lock(mutex_);
  return metrics_;
}

void Engine::finish(uint64_t id, EngineOutput out) {
  auto it = active_.find(id);
  if (it == active_.end()) return;
  Active& a = it->second;
  out.id = id;
  out.num_prompt_tokens = static_cast<int>(a.request.prompt.size());
  out.num_output_tokens = a.num_output_tokens;
  out.num_draft_tokens = a.num_draft_tokens;
  out.num_accepted_draft_tokens = a.num_accepted_tokens;
  if (out.finish == FinishReason::kNone) out.finish = FinishReason::kAbort;
  const double now = monotonic_seconds();
  {
    std::lock_guard lock(mutex_);
    metrics_.request_success_total[static_cast<int>(out.finish)]++;
    metrics_.e2e_request_latency_seconds.observe(now - a.arrival_s);
    if (a.first_token_s >= 0 && a.num_output_tokens > 1)
      metrics_.time_per_output_token_seconds.observe((now - a.first_token_s) / (a.num_output_tokens - 1));
  }
  if (a.request.kv_export) {  // the transfer may still read the pages
    std::vector<int32_t> held = scheduler_.take_held_pages(id);
    a.request.kv_export->on_finished([this, held = std::move(held)]() mutable {
      if (!held.empty()) release(std::move(held));
    });
  }
  OutputCallback callback = std::move(a.on_output);
  active_.erase(it);
  deliver(callback, out);
}

void Engine::drain_queues() {
  std::vector<std::pair<uint64_t, Active>> incoming;
  std::vector<std::pair<uint64_t, FinishReason>> cancels;
  std::vector<std::function<void()>> commands;
  {
    std::lock_guard lock(mutex_);
    incoming.swap(incoming_);
    cancels.swap(cancels_);
    commands.swap(commands_);
  }
  for (auto& command : commands) command();
  for (auto& [id, active] : incoming) admit(id, std::move(active));
  for (auto [id, reason] : cancels) {
    if (!scheduler_.abort(id)) continue;
    EngineOutput out;
    out.finish = reason;
    finish(id, std::move(out));
  }
}

void Engine::admit(uint64_t id, Active active) {
  SequenceSpec spec;
  spec.id = id;
  spec.prompt = active.request.prompt;
  spec.max_tokens = active.request.max_tokens;
  spec.eos_token_ids = options_.eos_token_ids;
  spec.stop_token_ids = active.request.stop_token_ids;
  spec.ignore_eos = active.request.ignore_eos;
  spec.hold_pages = active.request.kv_export != nullptr;
  spec.prompt_logits = active.request.num_prompt_logprobs >= 0;
  if (spec.prompt_logits) active.prompt_logprobs.resize(active.request.prompt.size() - 1);
  if (active.request.timeout_s > 0) spec.deadline_s = active.arrival_s + active.request.timeout_s;
  const auto& sampling = active.request.sampling;
  active.seed = sampling.seed ? *sampling.seed : seed_source_();
  const bool prefilled = active.first_token >= 0;
  std::vector<int32_t> pages = std::move(active.prefilled_pages);
  const std::vector<float> last_hidden = std::move(active.last_hidden);
  const int32_t first_token = active.first_token;
  if (prefilled) active.first_token_s = active.arrival_s;
  if (active.request.grammar) {
    std::vector<int32_t> end_ids = options_.eos_token_ids;
    end_ids.insert(end_ids.end(), active.request.stop_token_ids.begin(), active.request.stop_token_ids.end());
    active.constraint.emplace(active.request.grammar, options_.vocabulary, std::move(end_ids),
                              shared_readings(*active.request.grammar));
    active.awaiting_grammar = active.request.grammar_after_token >= 0;
    if (prefilled) constrain_token(active, first_token);  // checked by submit_prefilled
  }
  if (!sampling.allowed_token_ids.empty()) {
    active.allowed_mask.assign(static_cast<size_t>(mask_words_per_row(vocab_size_)), 0u);
    for (int32_t t : sampling.allowed_token_ids)  // (in the vocabulary: validate_sampling)
      active.allowed_mask[static_cast<size_t>(t) / 32] |= 1u << (static_cast<uint32_t>(t) % 32);
  }
  auto [it, inserted] = active_.emplace(id, std::move(active));
  CHECK(inserted, "request id {} twice", id);
  EngineOutput out;
  if (!prefilled) {
    out.error = scheduler_.add(std::move(spec));
    if (!out.error.is_ok()) finish(id, std::move(out));
    return;
  }
  auto update = scheduler_.add_prefilled(std::move(spec), std::move(pages), first_token);
  if (!update) {
    out.error = update.status();
    finish(id, std::move(out));
  } else if (update->finish != FinishReason::kNone) {
    out.finish = update->finish;  // the first token ended it: nothing more to add (no drafts either)
    finish(id, std::move(out));
  } else if (drafter_ && may_speculate(id)) {
    drafter_->start_prefilled(scheduler_, id, last_hidden);
  }
}

void Engine::update_gauges() {
  std::lock_guard lock(mutex_);
  metrics_.num_requests_running = scheduler_.num_running();
  metrics_.num_requests_waiting = scheduler_.num_waiting() + static_cast<int>(incoming_.size());
  num_queued_ = metrics_.num_requests_waiting;
  const auto& cache = scheduler_.cache();
  metrics_.kv_cache_usage_perc = static_cast<double>(cache.num_used()) / std::max(1, cache.num_pages());
  metrics_.num_preemptions_total = scheduler_.num_preemptions();
  metrics_.prefix_cache_queries_total = scheduler_.prefix_query_tokens();
  metrics_.prefix_cache_hits_total = scheduler_.prefix_hit_tokens();
}

void Engine::loop() {
  while (true) {
    {
      std::unique_lock lock(mutex_);
      const auto has_work = [&] {
        return stop_ || !incoming_.empty() || !cancels_.empty() || !commands_.empty() || scheduler_.has_work();
      };
      if (runner_->steps_in_lockstep()) {  // step() runs an idle step when there is nothing to do
        wake_.wait_for(lock, std::chrono::milliseconds(1), has_work);
      } else {
        wake_.wait(lock, has_work);
      }
      if (stop_) break;
    }
    drain_queues();
    if (dead_.load()) fail_all(unavailable("the engine has failed"));
    else step();
    update_gauges();
  }
  runner_->leave();
  fail_all(unavailable("the engine is shutting down"));
}

void Engine::fail_all(const Status& status) {
  drain_queues();
  std::vector<uint64_t> ids;
  for (const auto& [id, active] : active_) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  for (uint64_t id : ids) {
    scheduler_.abort(id);
    EngineOutput out;
    out.error = status;
    finish(id, std::move(out));
  }
  update_gauges();
}

void Engine::take_prompt_logprobs(const StepPlan& plan, const float* rows, int64_t num_rows) {
  int64_t row = 0;
  for (const ScheduledChunk& chunk : plan.chunks) {
    Active& a = active_.at(chunk.id);
    if (a.request.num_prompt_logprobs < 0) continue;
    const auto& prompt = a.request.prompt;
    for (int32_t p = chunk.start;
         p < chunk.start + chunk.num_tokens && p + 1 < static_cast<int32_t>(prompt.size()); ++p, ++row) {
      CHECK(row < num_rows, "prompt logits row {} of {}", row, num_rows);
      auto& slot = a.prompt_logprobs[static_cast<size_t>(p)];  // the logprob of token p + 1
      if (slot) continue;
      slot =
          compute_logprobs(std::span<const float>(rows + row * vocab_size_, static_cast<size_t>(vocab_size_)),
                           prompt[static_cast<size_t>(p) + 1], a.request.num_prompt_logprobs);
    }
  }
  CHECK(row == num_rows, "{} prompt logits rows used of {}", row, num_rows);
}

// At most every 10 s while steps run, one line as vLLM logs: throughputs
// (averaged since the previous line, idle time included), batch, KV usage.
void Engine::log_throughput(double now) {
  if (!options_.log_stats) return;
  if (last_log_s_ == 0) last_log_s_ = now;
  if (now - last_log_s_ < 10) return;
  int64_t prompt = 0, generated = 0;
  {
    std::lock_guard lock(mutex_);
    prompt = metrics_.prompt_tokens_total;
    generated = metrics_.generation_tokens_total;
  }
  const double seconds = now - last_log_s_;
  const auto& cache = scheduler_.cache();
  log_info("engine: prompt {:.1f} tokens/s, generation {:.1f} tokens/s, running {}, waiting {}, KV cache {:.1f}%, "
           "prefix cache hits {:.1f}%",
           static_cast<double>(prompt - logged_prompt_tokens_) / seconds,
           static_cast<double>(generated - logged_generation_tokens_) / seconds, scheduler_.num_running(),
           scheduler_.num_waiting(), 100.0 * cache.num_used() / std::max(1, cache.num_pages()),
           scheduler_.prefix_query_tokens() > 0
               ? 100.0 * static_cast<double>(scheduler_.prefix_hit_tokens()) / static_cast<double>(scheduler_.prefix_query_tokens())
               : 0.0);
  last_log_s_ = now;
  logged_prompt_tokens_ = prompt;
  logged_generation_tokens_ = generated;
}

// The per-layer hook of a step with KV-exporting requests (empty when none):
// each such chunk hands over its positions not exported yet, which include
// a prefix-cache hit on its first chunk.
std::function<void(int)> Engine::export_hook(const StepPlan& plan) {
  std::vector<const ScheduledChunk*> chunks;
  for (const ScheduledChunk& chunk : plan.chunks)
    if (active_.at(chunk.id).request.kv_export) chunks.push_back(&chunk);
  if (chunks.empty()) return {};
  return [this, chunks = std::move(chunks)](int layer) {
    for (const ScheduledChunk* chunk : chunks) {
      const Active& a = active_.at(chunk->id);
      const int32_t end = chunk->start + chunk->num_tokens;
      if (end <= a.num_exported_tokens) continue;
      a.request.kv_export->on_layer_written(layer, a.num_exported_tokens, end - a.num_exported_tokens,
                                            scheduler_.pages_of(chunk->id));
    }
  };
}

void Engine::after_export(const StepPlan& plan) {
  for (const ScheduledChunk& chunk : plan.chunks) {
    Active& a = active_.at(chunk.id);
    if (a.request.kv_export) a.num_exported_tokens = std::max(a.num_exported_tokens, chunk.start + chunk.num_tokens);
  }
}

// The step's forward pass and sampling, where the runner's logits are (the
// GPU samples there and sends back only the rows that logprobs need): one row
// per sampling chunk and draft, all of a chunk's rows fetched when the
// request wants logprobs (of the model's own logits, vLLM's default: row j
// gives the logprob of the run's token j), its penalties and bias as
// adjustments, then every prompt-logits row (SequenceSpec::prompt_logits,
// after the usual rows). One run of tokens per sampling chunk.
Status Engine::run_forward(const StepPlan& plan, const model::ForwardBatch& batch,
                           std::vector<std::vector<int32_t>>& runs, StepLogprobs& logprobs, Tensor& hidden) {
  StepSampling sampling;
  struct LogprobChunk {
    uint64_t id;
    size_t run;         // its run among the step's
    int64_t first_row;  // its first fetched row
  };
  std::vector<LogprobChunk> logprob_chunks;
  std::vector<MaskJob> mask_jobs;
  size_t num_runs = 0;
  for (size_t c = 0; c < plan.chunks.size(); ++c) {
    const ScheduledChunk& chunk = plan.chunks[c];
    if (!chunk.sample) continue;
    ++num_runs;
    const Active& a = active_.at(chunk.id);
    const auto row = static_cast<int32_t>(sampling.rows.size());
    add_chunk_rows(sampling, plan, batch, c,
                   {a.request.sampling, a.seed, static_cast<uint64_t>(a.num_output_tokens)});
    const std::span<const int32_t> drafts(batch.token_ids.data() + batch.query_start[c + 1] - chunk.num_drafts,
                                          static_cast<size_t>(chunk.num_drafts));
    const size_t chunk_entries = sampling.adjustments.size();
    if (a.request.sampling.adjusts_logits()) {
      std::vector<int32_t> stop_ids = a.request.stop_token_ids;
      if (!a.request.ignore_eos)
        stop_ids.insert(stop_ids.end(), options_.eos_token_ids.begin(), options_.eos_token_ids.end());
      add_chunk_adjustments(sampling, row, a.request.sampling, scheduler_.tokens_of(chunk.id),
                            static_cast<size_t>(a.num_output_tokens), drafts, stop_ids, vocab_size_);
    }
    if (a.masks_tokens())
      mask_jobs.push_back({.id = chunk.id, .first_row = row, .entries_begin = chunk_entries,
                           .entries_end = sampling.adjustments.size(), .drafts = drafts, .rows = {}, .words = {}});
    if (a.request.num_logprobs >= 0) {
      logprob_chunks.push_back({chunk.id, num_runs - 1, static_cast<int64_t>(sampling.fetch_rows.size())});
      for (int32_t j = 0; j <= chunk.num_drafts; ++j) sampling.fetch_rows.push_back(row + j);
    }
  }
  run_mask_jobs(mask_jobs, sampling);
  const auto num_logprob_rows = static_cast<int64_t>(sampling.fetch_rows.size());
  for (auto r = static_cast<int32_t>(sampling.rows.size());
       r < static_cast<int32_t>(batch.logits_rows.size()); ++r)
    sampling.fetch_rows.push_back(r);
  // The drafter's runner may keep the target's hidden states where they are;
  // the host needs them then only for an MTP export.
  const bool host_hidden = drafter_ && (!drafter_->keeps_target_hidden() || !mtp_export_chunks(plan).empty());
  const std::vector<int32_t> hidden_rows = host_hidden ? every_row(batch) : std::vector<int32_t>{};
  Status status;
  runner_->set_layer_hook(export_hook(plan));
  try {  // the runner's libraries may throw: the module boundary
    auto sampled = runner_->forward_sample(batch, sampling, hidden_rows, hidden);
    status = sampled.status();
    if (sampled) {
      runs = runs_from_samples(plan, *sampled);
      const float* fetched = sampled->fetched.data_as<float>();
      for (const auto& [id, run, first_row] : logprob_chunks) {
        const int k = active_.at(id).request.num_logprobs;
        std::vector<TokenLogprobs>& out = logprobs[id];
        for (size_t j = 0; j < runs[run].size(); ++j) {
          const float* logits = fetched + (first_row + static_cast<int64_t>(j)) * vocab_size_;
          out.push_back(compute_logprobs(std::span<const float>(logits, static_cast<size_t>(vocab_size_)),
                                         runs[run][j], k));
        }
      }
      take_prompt_logprobs(plan, fetched + num_logprob_rows * vocab_size_,
                           static_cast<int64_t>(sampling.fetch_rows.size()) - num_logprob_rows);
    }
  } catch (const std::exception& e) {
    status = internal_error("{}", e.what());
  }
  runner_->set_layer_hook({});
  after_export(plan);
  return status;
}

// Takes a generated token into the request's grammar state; false when the
// grammar does not allow it.
bool Engine::constrain_token(Active& a, int32_t token) {
  if (a.awaiting_grammar) {
    a.awaiting_grammar = token != a.request.grammar_after_token;
    return true;
  }
  return a.constraint->accept(token);
}

// A masked chunk's rows (Active::masks_tokens): each gets the mask of the
// tokens its grammar allows next, and'ed with allowed_token_ids' mask
// (StepSampling::mask_rows; every other token's logit becomes -inf after the
// adjustments). Row j follows drafts [0, j); after a draft the grammar
// refuses, the rows keep the last mask (their samples are dropped with the
// draft). Rows before the grammar applies (grammar_after_token) get the
// allowed tokens' mask alone, or none. any_allowed is false when the first
// row's mask allows only tokens the request's own adjustments ban (-inf:
// min_tokens before the output is whole, bad_words). Reads only the request's
// state: jobs of different requests run on any threads at once.
void Engine::add_token_masks(MaskJob& job, std::span<const ops::LogitAdjustment> adjustments) const {
  const Active& a = active_.at(job.id);
  std::optional<structured::TokenConstraint> state = a.constraint;
  bool awaiting = a.awaiting_grammar;
  std::vector<uint32_t> mask;
  const auto words = static_cast<size_t>(mask_words_per_row(vocab_size_));
  bool follows = true;
  for (size_t j = 0; j <= job.drafts.size(); ++j) {
    const int32_t row = job.first_row + static_cast<int32_t>(j);
    const bool grammar = state && !awaiting;
    if (awaiting && j < job.drafts.size()) awaiting = job.drafts[j] != a.request.grammar_after_token;
    if (!grammar && a.allowed_mask.empty()) continue;
    if (!grammar) {
      mask = a.allowed_mask;
    } else if (follows) {
      state->allowed_tokens(mask);
      mask.resize(words, 0u);  // (the vocabulary has the model's size: checked at submission)
      if (!a.allowed_mask.empty())
        for (size_t w = 0; w < words; ++w) mask[w] &= a.allowed_mask[w];
    }
    job.rows.push_back(row);
    job.words.insert(job.words.end(), mask.begin(), mask.end());
    if (j == 0) {  // the request's entries name each token at most once per row
      int64_t allowed = 0;
      for (uint32_t w : mask) allowed += std::popcount(w);
      for (size_t e = job.entries_begin; e < job.entries_end; ++e) {
        const ops::LogitAdjustment& entry = adjustments[e];
        if (entry.row == row && std::isinf(entry.bias) && entry.bias < 0 && mask_keeps(mask, entry.token)) --allowed;
      }
      job.any_allowed = allowed > 0;
    }
    if (grammar && j < job.drafts.size() && follows) follows = state->accept(job.drafts[j]);
  }
}

// The step's mask jobs, on the mask threads when there are several, then
// their rows into `sampling` in chunk order.
void Engine::run_mask_jobs(std::vector<MaskJob>& jobs, StepSampling& sampling) {
  if (mask_pool_ && jobs.size() > 1) {
    mask_pool_->parallel_for(0, static_cast<int64_t>(jobs.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) add_token_masks(jobs[static_cast<size_t>(j)], sampling.adjustments);
    });
  } else {
    for (MaskJob& job : jobs) add_token_masks(job, sampling.adjustments);
  }
  for (MaskJob& job : jobs) {
    active_.at(job.id).mask_conflict = !job.any_allowed;
    sampling.mask_rows.insert(sampling.mask_rows.end(), job.rows.begin(), job.rows.end());
    sampling.mask_words.insert(sampling.mask_words.end(), job.words.begin(), job.words.end());
  }
}

// The readings cache of `grammar`'s source, made when no live request has it.
std::shared_ptr<structured::TokenSetCache> Engine::shared_readings(const structured::Grammar& grammar) {
  std::string key = grammar.source().dump();
  if (auto cache = shared_readings_[key].lock()) return cache;
  if (shared_readings_.size() > 256)  // the sources no request holds any more
    std::erase_if(shared_readings_, [](const auto& entry) { return entry.second.expired(); });
  auto cache = std::make_shared<structured::TokenSetCache>(nullptr, structured::TokenSetCache::kSharedCapacity);
  shared_readings_[std::move(key)] = cache;
  return cache;
}

// Whether a request may carry drafts. KV-exporting requests decode plainly,
// and so do prefilled ones that came without the MTP state (no MTP KV for a
// prompt computed elsewhere).
bool Engine::may_speculate(uint64_t id) const {
  auto it = active_.find(id);
  if (it == active_.end()) return false;
  const Active& a = it->second;
  return !a.request.kv_export && (a.first_token < 0 || a.has_mtp_state);
}

// Disaggregated prefill with a drafter: the chunks that complete an
// MTP-exporting prompt get the MTP KV of their positions (but the last)
// before complete_step() finishes the request, and the sink gets that layer
// and the last hidden state.
std::vector<size_t> Engine::mtp_export_chunks(const StepPlan& plan) const {
  std::vector<size_t> chunks;
  for (size_t c = 0; c < plan.chunks.size(); ++c) {
    const ScheduledChunk& chunk = plan.chunks[c];
    const EngineRequest& request = active_.at(chunk.id).request;
    const bool completes_prompt = chunk.start + chunk.num_tokens == static_cast<int32_t>(request.prompt.size());
    if (chunk.sample && completes_prompt && request.kv_export && request.kv_export->wants_mtp()) chunks.push_back(c);
  }
  return chunks;
}

void Engine::export_mtp(const StepPlan& plan, const model::ForwardBatch& batch, const Tensor& hidden) {
  const std::vector<size_t> chunks = mtp_export_chunks(plan);
  if (chunks.empty()) return;
  drafter_->write_prompt_kv(scheduler_, plan, batch, hidden, chunks);
  const int64_t h = drafter_->hidden_size();
  for (size_t c : chunks) {
    const ScheduledChunk& chunk = plan.chunks[c];
    const int32_t last_row = batch.query_start[c + 1] - 1;
    std::span<const float> last_hidden(hidden.data_as<float>() + last_row * h, static_cast<size_t>(h));
    active_.at(chunk.id).request.kv_export->on_mtp_written(chunk.start + chunk.num_tokens,
                                                           scheduler_.pages_of(chunk.id), last_hidden);
  }
}

// Global and per-request acceptance counts of a speculative step.
void Engine::record_speculation(const StepPlan& plan, std::span<const std::vector<int32_t>> runs) {
  const SpecStepStats stats = spec_step_stats(plan, runs);
  if (stats.acceptance_lengths.empty()) return;
  size_t next = 0;
  for (const ScheduledChunk& chunk : plan.chunks) {
    if (!chunk.sample) continue;
    const auto& run = runs[next++];
    auto it = active_.find(chunk.id);
    if (chunk.num_drafts == 0 || it == active_.end()) continue;
    it->second.num_draft_tokens += chunk.num_drafts;
    it->second.num_accepted_tokens += static_cast<int>(run.size()) - 1;
  }
  std::lock_guard lock(mutex_);
  metrics_.spec_decode_num_drafts_total += static_cast<int64_t>(stats.acceptance_lengths.size());
  metrics_.spec_decode_num_draft_tokens_total += stats.num_draft_tokens;
  metrics_.spec_decode_num_accepted_tokens_total += stats.num_accepted_tokens;
  for (int length : stats.acceptance_lengths) metrics_.spec_decode_acceptance_length.observe(length);
}

bool Engine::fail_on_error(const Status& status) {
  if (status.is_ok()) return true;
  log_error("engine: the forward pass failed: {}", status.to_string());
  dead_ = true;
  fail_all(internal_error("the forward pass failed: {}", status.message()));
  return false;
}

void Engine::step() {
  const double now = monotonic_seconds();
  StepPlan plan = scheduler_.schedule(now);
  for (uint64_t id : plan.expired) {
    EngineOutput out;
    out.error = deadline_exceeded("the request ran past its deadline of {} s", active_.at(id).request.timeout_s);
    finish(id, std::move(out));
  }
  if (plan.empty()) {
    if (runner_->steps_in_lockstep() && !dead_) fail_on_error(runner_->idle_step());
    return;
  }
  for (const auto& chunk : plan.chunks) {
    Active& a = active_.at(chunk.id);
    if (a.first_scheduled_s >= 0) continue;
    a.first_scheduled_s = now;
    std::lock_guard lock(mutex_);
    metrics_.request_queue_time_seconds.observe(now - a.arrival_s);
  }
  const model::ForwardBatch batch = scheduler_.build_batch(plan);
  std::vector<std::vector<int32_t>> runs;
  StepLogprobs logprobs;
  Tensor hidden;
  const double forward_start = monotonic_seconds();
  const Status status = run_forward(plan, batch, runs, logprobs, hidden);
  if (!fail_on_error(status)) return;
  if (drafter_) export_mtp(plan, batch, hidden);
  const std::vector<SequenceUpdate> updates = scheduler_.complete_step(plan, std::span<const std::vector<int32_t>>(runs));
  if (drafter_) {
    record_speculation(plan, runs);
    drafter_->propose(scheduler_, plan, batch, hidden, [this](uint64_t id) { return may_speculate(id); });
  }
  if (options_.check_invariants) scheduler_.check_invariants();
  const double done = monotonic_seconds();
  {
    std::lock_guard lock(mutex_);
    metrics_.prompt_tokens_total += plan.num_prefill_tokens;
    metrics_.generation_tokens_total += static_cast<int64_t>(updates.size());
    ++metrics_.num_steps_total;
    metrics_.busy_seconds_total += done - forward_start;
  }
  log_throughput(done);
  std::unordered_map<uint64_t, size_t> logprobs_taken;  // a request's updates come in its run's order
  for (size_t i = 0; i < updates.size(); ++i) {
    const SequenceUpdate& u = updates[i];
    auto active = active_.find(u.id);
    if (active == active_.end()) continue;  // ended by an earlier token of its run
    Active& a = active->second;
    a.num_output_tokens = u.num_output_tokens;
    EngineOutput out;
    out.id = u.id;
    out.token = u.token;
    // A token outside the masks ends the request with an error, never a
    // wrong or cut output: an end token where the output is not whole (the
    // grammar can go no further: a matcher limit), or any token where every
    // allowed one was banned (min_tokens, bad_words).
    if (a.masks_tokens() && u.token >= 0 &&
        (std::exchange(a.mask_conflict, false) || (a.constraint && !constrain_token(a, u.token)))) {
      out.token = -1;
      out.error = invalid_argument(
          "the output cannot go on within the request's grammar or allowed_token_ids (a limit of docs/server.md's "
          "structured outputs, or min_tokens / bad_words banning every token they allow)");
      out.finish = FinishReason::kAbort;
      if (u.finish == FinishReason::kNone) scheduler_.abort(u.id);  // else the scheduler has let it go
      finish(u.id, std::move(out));
      continue;
    }
    if (auto it = logprobs.find(u.id); it != logprobs.end()) {
      size_t& taken = logprobs_taken[u.id];
      CHECK(taken < it->second.size(), "request {}: more tokens than logprobs", u.id);
      out.logprobs = std::move(it->second[taken++]);
    }
    if (!a.prompt_logprobs.empty() && !a.prompt_logprobs_sent) {
      a.prompt_logprobs_sent = true;
      for (auto& lp : a.prompt_logprobs) {
        CHECK(lp.has_value(), "request {}: a prompt position without logprobs", u.id);
        out.prompt_logprobs.push_back(std::move(*lp));
      }
    }
    out.num_prompt_tokens = u.num_prompt_tokens;
    out.num_output_tokens = u.num_output_tokens;
    out.num_draft_tokens = a.num_draft_tokens;
    out.num_accepted_draft_tokens = a.num_accepted_tokens;
    if (a.first_token_s < 0) {
      a.first_token_s = done;
      std::lock_guard lock(mutex_);
      metrics_.time_to_first_token_seconds.observe(done - a.arrival_s);
    }
    out.num_cached_tokens = u.num_cached_tokens;  // (the scheduler forgets a finished sequence)
    if (u.finish != FinishReason::kNone) {
      out.finish = u.finish;
      finish(u.id, std::move(out));
    } else {
      deliver(a.on_output, out);
    }
  }
}

}  // namespace moe::engine
