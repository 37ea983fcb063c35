// A fake model runner for scheduler and engine tests. Its "KV cache" stores the
// token id written at each (page, slot); its logits for a row are a hash of the
// whole context read back through the sequence's page table, so any scheduling
// bug (a wrong page table, a shared page overwritten, a prefix reused wrongly,
// a lost recompute) changes the generated tokens. The oracle, next_token_logits
// on the plain token list, is what a correct engine must reproduce.
//
// Not thread-safe: called by the engine thread only.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "engine/model_runner.h"
#include "kv/prefix_cache.h"

namespace moe::engine::testing_fake {

inline std::vector<float> next_token_logits(std::span<const int32_t> context, int64_t vocab) {
  const uint64_t h = kv::chain_hash(kv::kRootHash, context);
  std::vector<float> logits(static_cast<size_t>(vocab));
  for (int64_t v = 0; v < vocab; ++v) {
    const uint64_t x = kv::chain_hash(h, std::vector<int32_t>{static_cast<int32_t>(v)});
    logits[static_cast<size_t>(v)] = static_cast<float>(x >> 40) / static_cast<float>(1 << 24) * 6.0f;
  }
  return logits;
}

// Greedy continuation straight from the oracle.
inline std::vector<int32_t> oracle_greedy(std::vector<int32_t> tokens, int max_tokens, int64_t vocab,
                                          int32_t eos = -1) {
  std::vector<int32_t> out;
  for (int i = 0; i < max_tokens; ++i) {
    auto logits = next_token_logits(tokens, vocab);
    const auto t = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    out.push_back(t);
    tokens.push_back(t);
    if (t == eos) break;
  }
  return out;
}

class FakeRunner final : public ModelRunner {
 public:
  FakeRunner(int64_t vocab, int page_size, int32_t num_pages)
      : vocab_(vocab), page_size_(page_size), slots_(static_cast<size_t>(num_pages) * page_size, -1) {}
  int64_t vocab_size() const override { return vocab_; }
  std::atomic<int> step_delay_ms{0};
  std::atomic<int> num_forwards{0};
  // Each step's sampling as the engine asked for it (then sampled on the
  // host, as ModelRunner does), when record_sampling is set.
  bool record_sampling = false;
  std::vector<StepSampling> samplings;

  Expected<SampledStep> forward_sample(const model::ForwardBatch& batch, const StepSampling& sampling,
                                       std::span<const int32_t> hidden_rows, Tensor& hidden) override {
    if (record_sampling) samplings.push_back(sampling);
    return ModelRunner::forward_sample(batch, sampling, hidden_rows, hidden);
  }

  Expected<Tensor> forward(const model::ForwardBatch& batch) override {
    if (step_delay_ms.load() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(step_delay_ms.load()));
    ++num_forwards;
    const int num_seqs = static_cast<int>(batch.query_start.size()) - 1;
    Tensor logits(DType::kF32, {static_cast<int64_t>(batch.logits_rows.size()), vocab_});
    // Every token's K/V first, then the logits rows in their order (which
    // need not follow the tokens': prompt-logits rows come last).
    std::vector<int> seq_of(batch.token_ids.size());
    for (int s = 0; s < num_seqs; ++s) {
      const int32_t* table = batch.page_table.data() + static_cast<size_t>(s) * batch.max_pages_per_seq;
      for (int32_t t = batch.query_start[s]; t < batch.query_start[s + 1]; ++t) {
        slot(table, batch.positions[t]) = batch.token_ids[t];
        seq_of[static_cast<size_t>(t)] = s;
      }
    }
    for (size_t r = 0; r < batch.logits_rows.size(); ++r) {
      const int32_t t = batch.logits_rows[r];
      const int32_t* table =
          batch.page_table.data() + static_cast<size_t>(seq_of[t]) * batch.max_pages_per_seq;
      std::vector<int32_t> context;
      for (int32_t p = 0; p <= batch.positions[t]; ++p) {
        const int32_t id = slot(table, p);
        EXPECT_GE(id, 0) << "position " << p << " was never written";
        context.push_back(id);
      }
      auto row = next_token_logits(context, vocab_);
      std::copy(row.begin(), row.end(), logits.data_as<float>() + r * vocab_);
    }
    return logits;
  }

 private:
  int32_t& slot(const int32_t* table, int32_t position) {
    const int32_t page = table[position / page_size_];
    EXPECT_GE(page, 0);
    return slots_.at(static_cast<size_t>(page) * page_size_ + position % page_size_);
  }
  int64_t vocab_;
  int page_size_;
  std::vector<int32_t> slots_;
};

}  // namespace moe::engine::testing_fake
