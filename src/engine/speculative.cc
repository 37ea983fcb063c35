#include "engine/speculative.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <utility>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/logging.h"

namespace moe::engine {
namespace {

// A draw from `probs` (any non-negative weights with a positive sum) by inverse CDF in id order.
int32_t draw(std::span<const double> probs, double u) {
  const double total = std::accumulate(probs.begin(), probs.end(), 0.0);
  const double target = u * total;
  double cumulative = 0;
  int32_t last_positive = 0;
  for (size_t i = 0; i < probs.size(); ++i) {
    if (probs[i] <= 0) continue;
    cumulative += probs[i];
    last_positive = static_cast<int32_t>(i);
    if (target < cumulative) return last_positive;
  }
  return last_positive;
}

}  // namespace

Expected<SpeculativeConfig> parse_speculative_config(const std::string& json_text) {
  SpeculativeConfig config;
  if (json_text.empty()) return config;
  const auto j = nlohmann::json::parse(json_text, nullptr, false);
  if (j.is_discarded() || !j.is_object())
    return invalid_argument("--speculative-config must be a JSON object such as "
                            "'{{\"method\":\"mtp\",\"num_speculative_tokens\":2}}', got '{}'",
                            json_text);
  bool has_k = false;
  for (const auto& [key, value] : j.items()) {
    if (key == "method") {
      if (!value.is_string()) return invalid_argument("--speculative-config: \"method\" must be a string");
      config.method = value.get<std::string>();
      if (config.method != "mtp")
        return invalid_argument("--speculative-config: method '{}' is not supported (only \"mtp\")", config.method);
    } else if (key == "num_speculative_tokens") {
      if (!value.is_number_integer())
        return invalid_argument("--speculative-config: \"num_speculative_tokens\" must be an integer");
      const auto k = value.get<int64_t>();
      if (k < 1 || k > kMaxSpeculativeTokens)
        return invalid_argument("--speculative-config: num_speculative_tokens must be in 1..{}, got {}",
                                kMaxSpeculativeTokens, k);
      config.num_speculative_tokens = static_cast<int>(k);
      has_k = true;
    } else {
      return invalid_argument("--speculative-config: unknown field \"{}\" (known: method, num_speculative_tokens)",
                              key);
    }
  }
  if (config.method.empty()) return invalid_argument("--speculative-config: \"method\" is missing (use \"mtp\")");
  if (!has_k) return invalid_argument("--speculative-config: \"num_speculative_tokens\" is missing");
  return config;
}

std::vector<double> sampling_distribution(std::span<const float> logits, const SamplingParams& params) {
  CHECK(!params.is_greedy(), "the distribution of a greedy request is one-hot");
  const SamplingCandidates c = sampling_candidates(logits, params);
  std::vector<double> dense(logits.size(), 0.0);
  for (size_t i = 0; i < c.ids.size(); ++i) dense[static_cast<size_t>(c.ids[i])] = c.probs[i] / c.kept_mass;
  return dense;
}

RejectionResult rejection_step(std::span<const double> p, std::span<const double> q, int32_t draft, double u_accept,
                               double u_resample) {
  CHECK(draft >= 0 && static_cast<size_t>(draft) < p.size(), "draft {} outside the vocabulary", draft);
  CHECK(q.empty() || q.size() == p.size(), "draft and target distributions differ in size");
  const double q_draft = q.empty() ? 1.0 : q[static_cast<size_t>(draft)];
  if (q_draft > 0 && u_accept < std::min(1.0, p[static_cast<size_t>(draft)] / q_draft)) return {draft, true};
  std::vector<double> residual(p.size());
  double mass = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    const double qi = q.empty() ? (static_cast<int32_t>(i) == draft ? 1.0 : 0.0) : q[i];
    mass += residual[i] = std::max(0.0, p[i] - qi);
  }
  // p == q leaves no residual (and rejection then has probability 0): draw from p.
  return {draw(mass > 0 ? std::span<const double>(residual) : p, u_resample), false};
}

SampledStep sample_on_host(Tensor& logits, const StepSampling& sampling) {
  const int64_t rows = logits.view().dim(0), vocab = logits.view().dim(1);
  CHECK(static_cast<int64_t>(sampling.rows.size()) <= rows && sampling.drafts.size() == sampling.rows.size(),
        "{} sampled rows ({} drafts) of {} logits rows", sampling.rows.size(), sampling.drafts.size(), rows);
  auto row = [&](int64_t r) {
    return std::span<float>(logits.data_as<float>() + r * vocab, static_cast<size_t>(vocab));
  };
  SampledStep out;
  out.fetched = Tensor(DType::kF32, {static_cast<int64_t>(sampling.fetch_rows.size()), vocab});
  for (size_t i = 0; i < sampling.fetch_rows.size(); ++i) {
    const int32_t r = sampling.fetch_rows[i];
    CHECK(r >= 0 && r < rows, "fetch row {} of {}", r, rows);
    std::copy_n(row(r).data(), vocab, out.fetched.data_as<float>() + static_cast<int64_t>(i) * vocab);
  }
  for (const ops::LogitAdjustment& a : sampling.adjustments) {
    CHECK(a.row >= 0 && a.row < rows && a.token >= 0 && a.token < vocab, "adjustment of ({}, {})", a.row,
          a.token);
    float& x = row(a.row)[static_cast<size_t>(a.token)];
    x = ops::adjusted_logit(x, a);
  }
  apply_token_masks(std::span<float>(logits.data_as<float>(), static_cast<size_t>(rows * vocab)), vocab, sampling);
  for (size_t r = 0; r < sampling.rows.size(); ++r) {
    const RowSampling& s = sampling.rows[r];
    const int32_t draft = sampling.drafts[r];
    const auto logits_row = row(static_cast<int64_t>(r));
    int32_t token = -1;
    bool accepted = false;
    if (draft < 0) {
      token = sample_token(logits_row, s.params, s.seed, s.step);
    } else if (s.params.is_greedy()) {
      token = argmax(logits_row);
      accepted = token == draft;
    } else {
      const RejectionResult result =
          rejection_step(sampling_distribution(logits_row, s.params), {}, draft,
                         uniform_draw(s.seed ^ kAcceptSalt, s.step), uniform_draw(s.seed, s.step));
      token = result.token;
      accepted = result.accepted;
    }
    out.tokens.push_back(token);
    out.accepted.push_back(accepted ? 1 : 0);
  }
  return out;
}

void add_chunk_rows(StepSampling& sampling, const StepPlan& plan, const model::ForwardBatch& batch, size_t c,
                    const RowSampling& first) {
  const ScheduledChunk& chunk = plan.chunks[c];
  CHECK(chunk.sample, "rows of a chunk that does not sample");
  const int32_t* drafts = batch.token_ids.data() + batch.query_start[c + 1] - chunk.num_drafts;
  for (int32_t j = 0; j <= chunk.num_drafts; ++j) {
    sampling.rows.push_back({first.params, first.seed, first.step + static_cast<uint64_t>(j)});
    sampling.drafts.push_back(j < chunk.num_drafts ? drafts[j] : -1);
  }
}

void add_chunk_adjustments(StepSampling& sampling, int32_t first_row, const SamplingParams& params,
                           std::span<const int32_t> tokens, size_t num_output,
                           std::span<const int32_t> drafts, std::span<const int32_t> stop_ids,
                           int64_t vocab_size) {
  std::vector<int32_t> history(tokens.begin(), tokens.end());
  for (size_t j = 0; j <= drafts.size(); ++j) {
    if (j > 0) history.push_back(drafts[j - 1]);
    const auto entries = logit_adjustments(first_row + static_cast<int32_t>(j), params, history,
                                           num_output + j, stop_ids, vocab_size);
    sampling.adjustments.insert(sampling.adjustments.end(), entries.begin(), entries.end());
  }
}

std::vector<int32_t> every_row(const model::ForwardBatch& batch) {
  std::vector<int32_t> rows(static_cast<size_t>(batch.num_tokens()));
  std::iota(rows.begin(), rows.end(), 0);
  return rows;
}

std::vector<std::vector<int32_t>> runs_from_samples(const StepPlan& plan, const SampledStep& sampled) {
  std::vector<std::vector<int32_t>> runs;
  size_t row = 0;
  for (const ScheduledChunk& chunk : plan.chunks) {
    if (!chunk.sample) continue;
    CHECK(row + chunk.num_drafts < sampled.tokens.size(), "a sample for every verified row");
    std::vector<int32_t> run;
    for (int32_t j = 0; j <= chunk.num_drafts; ++j) {  // the accepted drafts, then one sample
      run.push_back(sampled.tokens[row + j]);
      if (j == chunk.num_drafts || !sampled.accepted[row + j]) break;
    }
    runs.push_back(std::move(run));
    row += static_cast<size_t>(chunk.num_drafts) + 1;
  }
  CHECK(row == sampled.tokens.size(), "{} samples used of {}", row, sampled.tokens.size());
  return runs;
}

SpecStepStats spec_step_stats(const StepPlan& plan, std::span<const std::vector<int32_t>> runs) {
  SpecStepStats stats;
  size_t next = 0;
  for (const ScheduledChunk& chunk : plan.chunks) {
    if (!chunk.sample) continue;
    const auto& run = runs[next++];
    if (chunk.num_drafts == 0) continue;
    stats.num_draft_tokens += chunk.num_drafts;
    stats.num_accepted_tokens += static_cast<int64_t>(run.size()) - 1;
    stats.acceptance_lengths.push_back(static_cast<int>(run.size()));
  }
  return stats;
}

CpuMtpRunner::CpuMtpRunner(const model::MtpModel& mtp, ThreadPool& pool, const kv::KvCacheLayout& target_layout)
    : mtp_(mtp),
      pool_(pool),
      cache_(kv::KvCacheLayout{1, mtp.config().num_kv_heads, mtp.config().head_dim, target_layout.page_size,
                               target_layout.num_pages, target_layout.dtype}) {}

Expected<model::MtpOutput> CpuMtpRunner::forward(const model::MtpBatch& batch, TensorView hidden) {
  model::MtpOutput out = mtp_.forward(pool_, batch, hidden, cache_.layer(0));
  const int64_t vocab = out.logits.view().dim(1);
  for (int64_t r = 0; r < out.logits.view().dim(0); ++r)
    out.greedy.push_back(argmax(std::span<const float>(out.logits.data_as<float>() + r * vocab, vocab)));
  return out;
}

Expected<std::vector<std::vector<int32_t>>> MtpRunner::forward_chain(
    const model::MtpOutput& first, std::span<const model::MtpBatch> passes) {
  const int64_t h = hidden_size();
  std::vector<std::vector<int32_t>> greedy;
  model::MtpOutput last;
  const model::MtpOutput* previous = &first;
  for (const model::MtpBatch& pass : passes) {
    const auto from_rows = static_cast<int64_t>(previous->greedy.size());
    if (static_cast<int>(pass.previous_rows.size()) != pass.num_tokens() ||
        previous->hidden.view().dim(0) != from_rows)
      return invalid_argument(
          "a chained MTP pass needs one previous row per token, and the previous hidden states");
    model::MtpBatch batch = pass;
    batch.previous_rows.clear();
    batch.want_hidden = true;
    Tensor input(DType::kF32, {batch.num_tokens(), h});
    for (int i = 0; i < batch.num_tokens(); ++i) {
      const int32_t row = pass.previous_rows[static_cast<size_t>(i)];
      if (row < 0 || row >= from_rows)
        return invalid_argument("previous row {} of a pass with {} output rows", row, from_rows);
      batch.token_ids[static_cast<size_t>(i)] = previous->greedy[static_cast<size_t>(row)];
      std::copy_n(previous->hidden.data_as<float>() + row * h, h, input.data_as<float>() + i * h);
    }
    MOE_ASSIGN_OR_RETURN(model::MtpOutput out, forward(batch, input.view()));
    greedy.push_back(out.greedy);
    last = std::move(out);
    previous = &last;
  }
  return greedy;
}

MtpDrafter::MtpDrafter(const model::MtpModel& mtp, ThreadPool& pool, const kv::KvCacheLayout& target_layout,
                       int num_speculative_tokens)
    : MtpDrafter(std::make_unique<CpuMtpRunner>(mtp, pool, target_layout), num_speculative_tokens) {}

MtpDrafter::MtpDrafter(std::unique_ptr<MtpRunner> runner, int num_speculative_tokens)
    : runner_(std::move(runner)), num_speculative_tokens_(num_speculative_tokens) {
  CHECK(runner_ != nullptr, "an MTP drafter needs a runner");
  CHECK(num_speculative_tokens >= 1 && num_speculative_tokens <= kMaxSpeculativeTokens, "k = {}",
        num_speculative_tokens);
}

std::optional<model::MtpOutput> MtpDrafter::run(const model::MtpBatch& batch, TensorView hidden) {
  auto out = runner_->forward(batch, hidden);
  if (out) return std::move(out).value();
  if (!std::exchange(warned_, true))
    log_error("speculative decoding: the MTP forward failed ({}); sequences decode without drafts when it does",
              out.status().to_string());
  return std::nullopt;
}

namespace {
// The page table rows of an MTP batch, padded with -1.
void fill_page_table(const Scheduler& scheduler, std::span<const uint64_t> ids, model::MtpBatch& batch) {
  size_t max_pages = 1;
  for (uint64_t id : ids) max_pages = std::max(max_pages, scheduler.pages_of(id).size());
  batch.max_pages_per_seq = static_cast<int>(max_pages);
  for (uint64_t id : ids) {
    std::vector<int32_t> row = scheduler.pages_of(id);
    row.resize(max_pages, -1);
    batch.page_table.insert(batch.page_table.end(), row.begin(), row.end());
  }
}
}  // namespace

std::vector<MtpDrafter::Drafting> MtpDrafter::first_pass(Scheduler& scheduler, const StepPlan& plan,
                                                         const model::ForwardBatch& batch,
                                                         const Tensor& hidden,
                                                         const std::function<bool(uint64_t)>& may_speculate,
                                                         std::optional<model::MtpOutput>& out) {
  model::MtpBatch mb;
  mb.query_start.push_back(0);
  std::vector<uint64_t> ids;
  std::vector<int32_t> hidden_rows;
  std::vector<Drafting> drafting;
  for (size_t c = 0; c < plan.chunks.size(); ++c) {
    const ScheduledChunk& chunk = plan.chunks[c];
    if (!scheduler.is_running(chunk.id)) continue;  // finished (or aborted): no drafts needed
    const int32_t computed = scheduler.num_computed(chunk.id);
    const int32_t valid = computed - chunk.start;
    const std::vector<int32_t>& tokens = scheduler.tokens_of(chunk.id);
    CHECK(valid > 0 && valid <= chunk.num_tokens && static_cast<int32_t>(tokens.size()) > computed,
          "sequence {}: {} positions computed of a chunk of {}", chunk.id, valid, chunk.num_tokens);
    for (int32_t j = 0; j < valid; ++j) {  // h_t with the token at t + 1
      mb.token_ids.push_back(tokens[static_cast<size_t>(chunk.start + j + 1)]);
      mb.positions.push_back(chunk.start + j);
      hidden_rows.push_back(batch.query_start[c] + j);
    }
    mb.query_start.push_back(mb.num_tokens());
    ids.push_back(chunk.id);
    if (chunk.sample && may_speculate(chunk.id) && scheduler.max_drafts(chunk.id) > 0) {
      mb.output_rows.push_back(mb.num_tokens() - 1);
      drafting.push_back({chunk.id, computed, {}});
    }
  }
  if (ids.empty()) return {};
  fill_page_table(scheduler, ids, mb);
  mb.want_logits = false;
  mb.want_hidden = !runner_->keeps_target_hidden();  // such a runner chains from the rows it keeps
  const int64_t h = hidden_size();
  Tensor input(DType::kF32, {runner_->keeps_target_hidden() ? 0 : mb.num_tokens(), h});
  if (runner_->keeps_target_hidden()) {
    mb.target_rows = std::move(hidden_rows);
  } else {
    for (size_t r = 0; r < hidden_rows.size(); ++r)
      std::copy_n(hidden.data_as<float>() + hidden_rows[r] * h, h,
                  input.data_as<float>() + static_cast<int64_t>(r) * h);
  }
  out = run(mb, input);
  if (!out) return {};
  for (size_t i = 0; i < drafting.size(); ++i) drafting[i].drafts.push_back(out->greedy[i]);
  return drafting;
}

// Chained steps: each runs at the next position with the previous step's
// output as h and its draft as the token, until every sequence has its
// drafts. Which sequences take part in which pass is known before the first
// (their limits), so the runner gets every pass at once (forward_chain).
void MtpDrafter::chain(Scheduler& scheduler, std::vector<Drafting>& drafting, const model::MtpOutput& first) {
  std::vector<size_t> limit(drafting.size());
  for (size_t i = 0; i < drafting.size(); ++i) {
    const int32_t k = std::min(num_speculative_tokens_, scheduler.max_drafts(drafting[i].id));
    limit[i] = scheduler.grow_for_drafts(drafting[i].id, k) ? static_cast<size_t>(k) : 0;
    if (drafting[i].drafts.size() > limit[i]) drafting[i].drafts.resize(limit[i]);
  }
  std::vector<model::MtpBatch> passes;
  std::vector<std::vector<size_t>> members;      // per pass, the drafting index of each row
  std::vector<int32_t> row_of(drafting.size());  // a sequence's row in the pass before
  for (size_t i = 0; i < drafting.size(); ++i)
    row_of[i] = static_cast<int32_t>(i);  // the first pass's output rows
  for (size_t pass = 0;; ++pass) {
    std::vector<size_t> active;
    for (size_t i = 0; i < drafting.size(); ++i)
      if (!drafting[i].drafts.empty() && drafting[i].drafts.size() + pass < limit[i]) active.push_back(i);
    if (active.empty()) break;
    model::MtpBatch mb;
    mb.query_start.push_back(0);
    std::vector<uint64_t> ids;
    for (size_t a = 0; a < active.size(); ++a) {
      const Drafting& d = drafting[active[a]];
      mb.token_ids.push_back(0);  // the previous row's greedy token
      mb.previous_rows.push_back(row_of[active[a]]);
      mb.positions.push_back(d.next_position + static_cast<int32_t>(pass));
      mb.query_start.push_back(mb.num_tokens());
      mb.output_rows.push_back(static_cast<int32_t>(a));
      ids.push_back(d.id);
    }
    for (size_t a = 0; a < active.size(); ++a) row_of[active[a]] = static_cast<int32_t>(a);
    fill_page_table(scheduler, ids, mb);
    mb.want_logits = false;
    mb.want_hidden = !runner_->keeps_target_hidden();
    passes.push_back(std::move(mb));
    members.push_back(std::move(active));
  }
  if (passes.empty()) return;
  auto greedy = runner_->forward_chain(first, passes);
  if (!greedy) {  // keep the drafts made so far
    if (!std::exchange(warned_, true))
      log_error("speculative decoding: the chained MTP passes failed ({}); sequences keep their first drafts",
                greedy.status().to_string());
    return;
  }
  for (size_t pass = 0; pass < passes.size(); ++pass)
    for (size_t a = 0; a < members[pass].size(); ++a)
      drafting[members[pass][a]].drafts.push_back((*greedy)[pass][a]);
}

void MtpDrafter::write_prompt_kv(const Scheduler& scheduler, const StepPlan& plan, const model::ForwardBatch& batch,
                                 const Tensor& hidden, std::span<const size_t> chunks) {
  model::MtpBatch mb;
  mb.query_start.push_back(0);
  std::vector<uint64_t> ids;
  std::vector<int32_t> hidden_rows;
  for (size_t c : chunks) {
    const ScheduledChunk& chunk = plan.chunks[c];
    const std::vector<int32_t>& tokens = scheduler.tokens_of(chunk.id);
    CHECK(chunk.sample && static_cast<int32_t>(tokens.size()) == chunk.start + chunk.num_tokens,
          "sequence {}: an MTP export from a chunk that does not complete its tokens", chunk.id);
    if (chunk.num_tokens < 2) continue;  // the last position needs the token to be sampled
    for (int32_t j = 0; j + 1 < chunk.num_tokens; ++j) {  // h_t with the prompt's token at t + 1
      mb.token_ids.push_back(tokens[static_cast<size_t>(chunk.start + j + 1)]);
      mb.positions.push_back(chunk.start + j);
      hidden_rows.push_back(batch.query_start[c] + j);
    }
    mb.query_start.push_back(mb.num_tokens());
    ids.push_back(chunk.id);
  }
  if (ids.empty()) return;
  fill_page_table(scheduler, ids, mb);
  const int64_t h = hidden_size();
  Tensor input(DType::kF32, {mb.num_tokens(), h});
  for (size_t r = 0; r < hidden_rows.size(); ++r)
    std::copy_n(hidden.data_as<float>() + hidden_rows[r] * h, h, input.data_as<float>() + static_cast<int64_t>(r) * h);
  (void)run(mb, input);  // KV only: no output rows
}

void MtpDrafter::start_prefilled(Scheduler& scheduler, uint64_t id, std::span<const float> last_hidden) {
  const int64_t h = hidden_size();
  CHECK(static_cast<int64_t>(last_hidden.size()) == h, "sequence {}: a hidden state of {} values, not {}", id,
        last_hidden.size(), h);
  if (!scheduler.is_running(id) || scheduler.max_drafts(id) <= 0) return;
  const int32_t computed = scheduler.num_computed(id);  // the prompt; its first token follows
  model::MtpBatch mb;
  mb.token_ids.push_back(scheduler.tokens_of(id)[static_cast<size_t>(computed)]);
  mb.positions.push_back(computed - 1);
  mb.query_start = {0, 1};
  mb.output_rows.push_back(0);
  const uint64_t ids[] = {id};
  fill_page_table(scheduler, ids, mb);
  mb.want_logits = false;
  Tensor input(DType::kF32, {1, h});
  std::copy(last_hidden.begin(), last_hidden.end(), input.data_as<float>());
  mb.want_hidden = !runner_->keeps_target_hidden();
  std::optional<model::MtpOutput> out = run(mb, input);
  if (!out) return;
  std::vector<Drafting> drafting = {{id, computed, {out->greedy[0]}}};
  chain(scheduler, drafting, *out);
  scheduler.set_drafts(id, std::move(drafting[0].drafts));
}

void MtpDrafter::propose(Scheduler& scheduler, const StepPlan& plan, const model::ForwardBatch& batch,
                         const Tensor& hidden, const std::function<bool(uint64_t id)>& may_speculate) {
  std::optional<model::MtpOutput> first;
  std::vector<Drafting> drafting = first_pass(scheduler, plan, batch, hidden, may_speculate, first);
  if (drafting.empty()) return;
  chain(scheduler, drafting, *first);
  for (Drafting& d : drafting) scheduler.set_drafts(d.id, std::move(d.drafts));
}

}  // namespace moe::engine
