#include "engine/generator.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <random>

#include "core/logging.h"

namespace moe::engine {
namespace {

struct Sequence {
  int index = 0;                    // into the request list
  std::vector<int32_t> tokens;      // prompt then generated
  int32_t prompt_len = 0;
  int32_t num_computed = 0;         // tokens whose KV is in the cache
  uint64_t seed = 0;
  kv::PageTable pages;
  GenerationResult result;
};

int32_t pages_needed(int64_t tokens, int page_size) {
  return static_cast<int32_t>((tokens + page_size - 1) / page_size);
}

}  // namespace

Generator::Generator(const model::Qwen3MoeModel& model, ThreadPool& pool, GeneratorOptions options)
    : model_(model), pool_(pool), options_(std::move(options)) {}

Expected<std::vector<GenerationResult>> Generator::generate(const std::vector<GenerationRequest>& requests) {
  const model::ModelConfig& config = model_.config();
  const int page_size = options_.page_size;
  int64_t total_pages = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    const auto& r = requests[i];
    if (r.prompt.empty()) return invalid_argument("request {}: the prompt is empty", i);
    if (r.max_tokens < 1) return invalid_argument("request {}: max_tokens must be >= 1, got {}", i, r.max_tokens);
    for (int32_t id : r.prompt)
      if (id < 0 || id >= config.vocab_size)
        return invalid_argument("request {}: token id {} is outside the vocabulary [0, {})", i, id, config.vocab_size);
    MOE_RETURN_IF_ERROR(validate_sampling(r.sampling).with_context(fmt::format("request {}", i)));
    total_pages += pages_needed(static_cast<int64_t>(r.prompt.size()) + r.max_tokens, page_size);
  }
  const int32_t num_pages = options_.num_pages > 0 ? options_.num_pages : static_cast<int32_t>(total_pages);
  for (size_t i = 0; i < requests.size(); ++i)
    if (pages_needed(static_cast<int64_t>(requests[i].prompt.size()) + requests[i].max_tokens, page_size) > num_pages)
      return resource_exhausted("request {}: prompt + max_tokens needs more KV pages than the cache has ({})", i,
                                num_pages);

  kv::KvCache cache({config.num_layers, config.num_kv_heads, config.head_dim, page_size, num_pages, options_.kv_dtype});
  std::vector<ops::PagedKv> kv_layers;
  for (int l = 0; l < config.num_layers; ++l) kv_layers.push_back(cache.layer(l));

  std::vector<GenerationResult> results(requests.size());
  std::deque<int> waiting;
  for (size_t i = 0; i < requests.size(); ++i) waiting.push_back(static_cast<int>(i));
  std::vector<Sequence> running;
  std::random_device entropy;
  stats_ = {};

  while (!waiting.empty() || !running.empty()) {
    // Admit in arrival order while the whole request fits.
    while (!waiting.empty()) {
      const auto& r = requests[waiting.front()];
      const int32_t need = pages_needed(static_cast<int64_t>(r.prompt.size()) + r.max_tokens, page_size);
      if (need > cache.allocator().num_free()) break;
      Sequence s;
      s.index = waiting.front();
      s.tokens = r.prompt;
      s.prompt_len = static_cast<int32_t>(r.prompt.size());
      s.seed = r.sampling.seed ? *r.sampling.seed : (static_cast<uint64_t>(entropy()) << 32 | entropy());
      CHECK(s.pages.reserve(s.prompt_len + r.max_tokens, page_size, cache.allocator()).is_ok(), "admission");
      running.push_back(std::move(s));
      waiting.pop_front();
    }
    CHECK(!running.empty(), "nothing runnable although requests wait");

    // Build the step: each sequence contributes its uncomputed tokens, under the budget.
    model::ForwardBatch batch;
    int budget = options_.max_tokens_per_step > 0 ? options_.max_tokens_per_step : INT32_MAX;
    std::vector<Sequence*> in_batch;
    std::vector<bool> wants_logits;
    size_t max_pages = 0;
    for (auto& s : running) max_pages = std::max(max_pages, s.pages.pages().size());
    batch.max_pages_per_seq = static_cast<int>(max_pages);
    batch.query_start.push_back(0);
    bool has_prompt_tokens = false;
    // Decoding sequences first, so a long prompt never starves them of the budget.
    std::vector<Sequence*> order;
    for (auto& s : running)
      if (s.num_computed >= s.prompt_len) order.push_back(&s);
    for (auto& s : running)
      if (s.num_computed < s.prompt_len) order.push_back(&s);
    for (Sequence* s : order) {
      if (budget <= 0) break;
      const int32_t pending = static_cast<int32_t>(s->tokens.size()) - s->num_computed;
      const int32_t take = std::min(pending, budget);
      budget -= take;
      has_prompt_tokens |= s->num_computed < s->prompt_len;
      for (int32_t i = 0; i < take; ++i) {
        batch.token_ids.push_back(s->tokens[s->num_computed + i]);
        batch.positions.push_back(s->num_computed + i);
      }
      batch.query_start.push_back(static_cast<int32_t>(batch.token_ids.size()));
      std::vector<int32_t> row = s->pages.pages();
      row.resize(max_pages, -1);
      batch.page_table.insert(batch.page_table.end(), row.begin(), row.end());
      const bool completes = take == pending;
      if (completes) batch.logits_rows.push_back(static_cast<int32_t>(batch.token_ids.size()) - 1);
      s->num_computed += take;
      in_batch.push_back(s);
      wants_logits.push_back(completes);
    }

    const auto start = std::chrono::steady_clock::now();
    Tensor logits = model_.forward(pool_, batch, kv_layers);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    (has_prompt_tokens ? stats_.prefill_seconds : stats_.decode_seconds) += seconds;
    ++stats_.num_steps;

    // Sample for each sequence whose tokens are all computed.
    int64_t row = 0;
    for (size_t i = 0; i < in_batch.size(); ++i) {
      if (!wants_logits[i]) continue;
      Sequence& s = *in_batch[i];
      const auto& r = requests[s.index];
      std::span<const float> row_logits(logits.data_as<float>() + row * config.vocab_size, config.vocab_size);
      ++row;
      const auto num_generated = static_cast<uint64_t>(s.tokens.size()) - s.prompt_len;
      const int32_t token = sample_token(row_logits, r.sampling, s.seed, num_generated);
      s.tokens.push_back(token);
      s.result.token_ids.push_back(token);
      const bool is_eos = !r.ignore_eos && std::count(options_.eos_token_ids.begin(), options_.eos_token_ids.end(), token);
      const bool is_stop = std::count(r.stop_token_ids.begin(), r.stop_token_ids.end(), token) > 0;
      if (is_eos || is_stop) s.result.finish_reason = "stop";
      else if (static_cast<int>(s.result.token_ids.size()) >= r.max_tokens) s.result.finish_reason = "length";
    }
    // Retire finished sequences.
    for (auto it = running.begin(); it != running.end();) {
      if (it->result.finish_reason.empty()) {
        ++it;
        continue;
      }
      stats_.num_prompt_tokens += it->prompt_len;
      stats_.num_generated_tokens += static_cast<int64_t>(it->result.token_ids.size());
      it->pages.release(cache.allocator());
      results[it->index] = std::move(it->result);
      it = running.erase(it);
    }
    cache.allocator().check_invariants();
  }
  return results;
}

}  // namespace moe::engine
