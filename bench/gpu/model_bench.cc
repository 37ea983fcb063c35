// Model-level GPU benchmarks (model_bench.h): dummy Qwen3-235B-A22B layers
// stepped through CudaQwen3MoeModel at decode batch sizes.
#include "bench/gpu/model_bench.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench/gpu/bench_util.h"
#include "engine/sampler.h"
#include "engine/speculative.h"
#include "model/config.h"
#include "model/cuda/cuda_model.h"

namespace moe::bench {
namespace {

// The model config at `config_path` with its first `num_layers` layers.
model::ModelConfig config_cut_to(const std::string& config_path, int num_layers) {
  std::ifstream in(config_path);
  std::string text((std::istreambuf_iterator<char>(in)), {});
  auto config = model::parse_model_config(text);
  check(config.status());
  config->num_layers = num_layers;
  return *config;
}

// A dummy-weight model for decode steps of `batch` sequences at `context`
// (random KV), `tokens_per_seq` query tokens each at most.
std::unique_ptr<model::CudaQwen3MoeModel> decode_model(const model::ModelConfig& config, int batch,
                                                       int context, int page, int tokens_per_seq, bool graphs,
                                                       ops::QuantFormat experts = ops::QuantFormat::kNone) {
  model::CudaModelOptions options;
  options.page_size = page;
  options.num_pages = batch * (context / page + 1);
  options.max_num_tokens = batch * tokens_per_seq;
  options.max_num_seqs = batch;
  options.use_cuda_graphs = graphs;
  options.dummy_expert_format = experts;
  auto m = model::CudaQwen3MoeModel::create_dummy(config, 1, options);
  check(m.status());
  check((*m)->fill_kv_random(5));
  return std::move(*m);
}

// A decode step of `batch` sequences at `context` verifying k drafts each
// (k + 1 tokens, every row a logits row), pages numbered per sequence.
model::ForwardBatch verify_step(int batch, int k, int context, int page) {
  model::ForwardBatch step;
  step.max_pages_per_seq = context / page + 1;
  step.query_start.push_back(0);
  for (int b = 0; b < batch; ++b) {
    for (int j = 0; j <= k; ++j) {
      step.logits_rows.push_back(static_cast<int32_t>(step.token_ids.size()));
      step.token_ids.push_back(1000 + b + 7 * j);
      step.positions.push_back(context - 1 - k + j);
    }
    step.query_start.push_back(static_cast<int32_t>(step.token_ids.size()));
    for (int p = 0; p < step.max_pages_per_seq; ++p)
      step.page_table.push_back(b * step.max_pages_per_seq + p);
  }
  return step;
}

}  // namespace

// Whole decoder layers of dummy Qwen3-235B at decode batch sizes, context 2048.
// only_batch (0: all): one batch size, e.g. for a profiler.
void bench_model(const std::string& config_path, int num_layers, double copy_gbs, ops::QuantFormat experts,
                 int only_batch) {
  const model::ModelConfig config = config_cut_to(config_path, num_layers);
  const int context = 2048, page = 16;
  for (int batch : {64, 128, 256}) {
    if (only_batch != 0 && batch != only_batch) continue;
    double step_ms = 0, eager_ms = 0;
    model::ForwardBatch step;
    for (bool graphs : {true, false}) {
      auto m = decode_model(config, batch, context, page, 1, graphs, experts);
      step = {};
      step.max_pages_per_seq = context / page + 1;
      step.query_start.push_back(0);
      for (int b = 0; b < batch; ++b) {
        step.token_ids.push_back(1000 + b);
        step.positions.push_back(context - 1);
        step.query_start.push_back(b + 1);
        step.logits_rows.push_back(b);
        for (int p = 0; p < step.max_pages_per_seq; ++p)
          step.page_table.push_back(b * step.max_pages_per_seq + p);
      }
      std::vector<double> ms;
      std::fprintf(
          stderr, "phase: batch %d, %s, from %.3f s\n", batch, graphs ? "graph" : "eager",
          std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
      for (int i = 0; i < 10; ++i) {
        const auto start = std::chrono::steady_clock::now();
        check(m->forward_greedy(step).status());
        ms.push_back(
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
      }
      std::sort(ms.begin() + 2, ms.end());  // the first two capture the graph / warm up
      (graphs ? step_ms : eager_ms) = ms[2 + (ms.size() - 2) / 2];
    }
    const model::ModelConfig& c = config;
    // Expert and attention projection bytes: bf16, or (dummy fp8-block: both
    // quantized) E4M3 plus one f32 scale per 128 x 128 block.
    const double bytes_per_weight = experts == ops::QuantFormat::kFp8Block ? 1.0 + 4.0 / (128 * 128) : 2.0;
    const double expert_elements = double(c.num_experts) * 3 * c.hidden_size * c.moe_intermediate_size;
    const double attention_elements =
        double(c.q_size() + 2 * c.kv_size()) * c.hidden_size + double(c.hidden_size) * c.q_size();
    const double layer_weights = bytes_per_weight * (attention_elements + expert_elements);
    const double kv = 2.0 * batch * context * c.num_kv_heads * c.head_dim * 2;
    const double head_bytes = 2.0 * 2 * c.vocab_size * c.hidden_size;
    const double floor_ms = (num_layers * (layer_weights + kv) + head_bytes) / (copy_gbs * 1e6);
    char shape[96], extra[200];
    std::snprintf(shape, sizeof shape, "%d layers, batch %d, ctx %d", num_layers, batch, context);
    const double per_layer = (step_ms - head_bytes / (copy_gbs * 1e6)) / num_layers;
    std::snprintf(
        extra, sizeof extra,
        "CUDA graph (eager %.2f ms); ~%.2f ms/layer; x94 ~ %.0f ms/step = %.0f tok/s (extrapolated)",
        eager_ms, per_layer, per_layer * 94, batch * 1000.0 / (per_layer * 94));
    report(experts == ops::QuantFormat::kFp8Block ? "decode_step_fp8" : "decode_step", shape, step_ms,
           floor_ms, extra);
  }
}

// Speculative verification on dummy Qwen3-235B layers (issue 10): one step
// that verifies k drafts per sequence (k + 1 query tokens each, logits at
// every row, eager: the CUDA graphs cover one token per sequence) against a
// plain decode step of the same batch (CUDA graph), context 2048. With
// per-draft acceptance a, a verification emits (1 - a^(k+1)) / (1 - a)
// tokens on average; the break-even a is where that equals the time ratio
// (the MTP drafter's own k passes not counted: about one layer each).
void bench_verify(const std::string& config_path, int num_layers) {
  const model::ModelConfig config = config_cut_to(config_path, num_layers);
  const int context = 2048, page = 16, max_k = 4;
  for (int batch : {32, 64, 128, 256}) {
    auto m = decode_model(config, batch, context, page, max_k + 1, true);
    auto step_of = [&](int k) { return verify_step(batch, k, context, page); };
    auto median_step_ms = [&](const model::ForwardBatch& step) {
      std::vector<double> ms;
      for (int i = 0; i < 10; ++i) {
        check(cudaDeviceSynchronize(), "sync");
        const auto start = std::chrono::steady_clock::now();
        check(m->forward_greedy(step).status());
        ms.push_back(
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
      }
      std::sort(ms.begin() + 2, ms.end());  // the first two capture the graph / warm up
      return ms[2 + (ms.size() - 2) / 2];
    };
    const double plain_ms = median_step_ms(step_of(0));
    for (int k = 1; k <= max_k; ++k) {
      const double ms = median_step_ms(step_of(k));
      const double ratio = ms / plain_ms;
      double lo = 0, hi = 1;  // break-even acceptance: (1 - a^(k+1)) / (1 - a) = ratio
      for (int it = 0; it < 60; ++it) {
        const double a = (lo + hi) / 2, emitted = a == 1 ? k + 1 : (1 - std::pow(a, k + 1)) / (1 - a);
        (emitted < ratio ? lo : hi) = a;
      }
      char shape[96], extra[160], break_even[48];
      std::snprintf(shape, sizeof shape, "%d layers, batch %d, k=%d, ctx %d", num_layers, batch, k, context);
      if (ratio > k + 1) {
        std::snprintf(break_even, sizeof break_even, "none (slower than k + 1 plain steps)");
      } else {
        std::snprintf(break_even, sizeof break_even, "%.0f%%", 100 * lo);
      }
      std::snprintf(extra, sizeof extra, "%.2fx a plain step (%.3f ms, graph); break-even acceptance %s",
                    ratio, plain_ms, break_even);
      report("verify_step", shape, ms, plain_ms, extra);
    }
  }
}

// A decode step's sampling on dummy Qwen3-235B layers (full vocabulary),
// batch 64, context 2048: the same step sampled on the GPU
// (CudaQwen3MoeModel::forward_sample: only tokens and fetched rows come back)
// and as the engine did before 2026-12-02 whenever a request wanted logprobs
// or penalties, or any request sampled with MTP drafts: every logits row
// copied to the host, then engine::sample_on_host. Floor column: the
// all-greedy step on the GPU.
namespace {

// Structured outputs: every greedy row of a step masked to the tokens its
// grammar allows, as bitmasks (StepSampling::mask_rows, mask_logits on the
// GPU) against the same masks as sparse -inf entries (adjust_logits: what the
// engine sent before), host preparation included. Half the rows inside a
// JSON string (~70% of the vocabulary allowed), half at a structural state
// (200 tokens allowed): Qwen3's figures (bench/results/2026-12-05_structured_outputs_cpu.md).
void bench_structured_masks(model::CudaQwen3MoeModel& m, const model::ForwardBatch& step, int batch, int64_t vocab,
                            double greedy_ms) {
  const int64_t words = engine::mask_words_per_row(vocab);
  std::mt19937 rng(7);
  std::vector<std::vector<uint32_t>> masks(static_cast<size_t>(batch), std::vector<uint32_t>(words, 0u));
  for (int b = 0; b < batch; ++b) {
    std::bernoulli_distribution in_string(0.7);
    std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(vocab) - 1);
    auto& mask = masks[static_cast<size_t>(b)];
    if (b % 2 == 0) {
      for (int32_t t = 0; t < vocab; ++t)
        if (in_string(rng)) mask[static_cast<size_t>(t) / 32] |= 1u << (t % 32);
    } else {
      for (int i = 0; i < 200; ++i) {
        const int32_t t = token(rng);
        mask[static_cast<size_t>(t) / 32] |= 1u << (t % 32);
      }
    }
  }
  std::vector<ops::cuda::SampleRow> rows(static_cast<size_t>(batch), ops::cuda::SampleRow{0, 0, 1, 0, 0, 0});
  for (auto& r : rows) r.draft = -1;
  auto time_host = [](const std::function<void()>& run) {
    const auto start = std::chrono::steady_clock::now();
    run();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  };
  // Host preparation, as the engine builds each step's sampling.
  engine::StepSampling bitmasks, entries;
  std::vector<double> bitmask_prep, entries_prep;
  for (int i = 0; i < 5; ++i) {
    bitmasks = {}, entries = {};
    bitmask_prep.push_back(time_host([&] {
      for (int b = 0; b < batch; ++b) {
        bitmasks.mask_rows.push_back(b);
        bitmasks.mask_words.insert(bitmasks.mask_words.end(), masks[static_cast<size_t>(b)].begin(),
                                   masks[static_cast<size_t>(b)].end());
      }
    }));
    entries_prep.push_back(time_host([&] {
      for (int b = 0; b < batch; ++b)
        for (int32_t t = 0; t < vocab; ++t)
          if (!engine::mask_keeps(masks[static_cast<size_t>(b)], t))
            entries.adjustments.push_back({b, t, -std::numeric_limits<float>::infinity(), 1.0f, 0.0f});
    }));
  }
  std::sort(bitmask_prep.begin(), bitmask_prep.end());
  std::sort(entries_prep.begin(), entries_prep.end());
  Tensor unused;
  auto device_ms = [&](const engine::StepSampling& s) {
    std::vector<double> ms;
    for (int i = 0; i < 10; ++i) {
      check(cudaDeviceSynchronize(), "sync");
      const auto start = std::chrono::steady_clock::now();
      auto out = m.forward_sample(step, {rows, s.adjustments, {}, s.mask_rows, s.mask_words}, {}, unused);
      check(out.status());
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    }
    std::sort(ms.begin() + 2, ms.end());
    return ms[2 + (ms.size() - 2) / 2];
  };
  // The two paths pick the same tokens.
  auto tokens_of = [&](const engine::StepSampling& s) {
    auto out = m.forward_sample(step, {rows, s.adjustments, {}, s.mask_rows, s.mask_words}, {}, unused);
    check(out.status());
    return out->tokens;
  };
  const std::vector<int32_t> by_mask = tokens_of(bitmasks), by_entries = tokens_of(entries);
  for (int b = 0; b < batch; ++b) {
    if (by_mask[static_cast<size_t>(b)] != by_entries[static_cast<size_t>(b)] ||
        !engine::mask_keeps(masks[static_cast<size_t>(b)], by_mask[static_cast<size_t>(b)])) {
      std::fprintf(stderr, "structured masks: row %d took %d by bitmask, %d by entries\n", b,
                   by_mask[static_cast<size_t>(b)], by_entries[static_cast<size_t>(b)]);
      std::exit(1);
    }
  }
  const double mask_ms = device_ms(bitmasks), entries_ms = device_ms(entries);
  char shape[160], extra[240];
  std::snprintf(shape, sizeof shape, "batch %d greedy, every row masked (%zu KB of bitmasks, %zu MB of entries)",
                batch, bitmasks.mask_words.size() * 4 / 1024, entries.adjustments.size() * 20 / (1024 * 1024));
  std::snprintf(extra, sizeof extra,
                "sparse -inf entries (before): step %.2f ms (+%.2f ms over unmasked); host prep %.2f ms by bitmask, "
                "%.2f ms by entries",
                entries_ms, entries_ms - greedy_ms, bitmask_prep[2], entries_prep[2]);
  report("structured_masks_step", shape, mask_ms, greedy_ms, extra);
}

}  // namespace

void bench_sampling(const std::string& config_path, int num_layers) {
  const model::ModelConfig config = config_cut_to(config_path, num_layers);
  const int context = 2048, page = 16, batch = 64;
  const int64_t vocab = config.vocab_size;
  auto m = decode_model(config, batch, context, page, 2, true);
  auto step_of = [&](int k) { return verify_step(batch, k, context, page); };
  struct Case {
    const char* name;
    int drafts;  // per sequence
    engine::SamplingParams params;
    bool logprobs_row;  // row 0 fetched
    int iterations;     // of the host path
  };
  engine::SamplingParams greedy, qwen, plain, penalized;
  greedy.temperature = 0;
  qwen.temperature = 0.6f, qwen.top_k = 20, qwen.top_p = 0.95f;  // Qwen3's generation_config
  plain.temperature = 1.0f;                                      // OpenAI's default: no top-k / top-p
  penalized = qwen;
  penalized.presence_penalty = 1.5f;  // Qwen3's model card, against endless repetition
  const std::vector<Case> cases = {
      {"greedy, one request with logprobs", 0, greedy, true, 8},
      {"Qwen3 sampling + presence_penalty 1.5", 0, penalized, false, 4},
      {"Qwen3 sampling, MTP k=1", 1, qwen, false, 4},
      {"temperature 1, MTP k=1", 1, plain, false, 2},
  };
  std::mt19937 rng(3);
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(vocab) - 1);
  double greedy_ms = 0;
  for (const Case& c : cases) {
    const model::ForwardBatch step = step_of(c.drafts);
    engine::StepSampling sampling;
    for (int b = 0; b < batch; ++b) {
      for (int j = 0; j <= c.drafts; ++j) {
        const int row = static_cast<int>(sampling.rows.size());
        sampling.rows.push_back({c.params, 100u + b, static_cast<uint64_t>(j)});
        sampling.drafts.push_back(j < c.drafts ? step.token_ids[row + 1] : -1);
      }
      if (c.params.adjusts_logits()) {  // a 2048-token history, half of it output
        std::vector<int32_t> history(context);
        for (auto& t : history) t = token(rng) % 20000;
        const auto e = engine::logit_adjustments(b, c.params, history, context / 2, {}, vocab);
        sampling.adjustments.insert(sampling.adjustments.end(), e.begin(), e.end());
      }
    }
    if (c.logprobs_row) sampling.fetch_rows.push_back(0);
    std::vector<ops::cuda::SampleRow> rows;
    for (size_t r = 0; r < sampling.rows.size(); ++r) {
      const auto& s = sampling.rows[r];
      rows.push_back({s.params.temperature, s.params.top_k, s.params.top_p, s.params.min_p, s.seed, s.step,
                      s.seed ^ engine::kAcceptSalt, sampling.drafts[r]});
    }
    auto median_ms = [&](int iterations, const std::function<void()>& run) {
      std::vector<double> ms;
      for (int i = 0; i < iterations + 2; ++i) {
        check(cudaDeviceSynchronize(), "sync");
        const auto start = std::chrono::steady_clock::now();
        run();
        ms.push_back(
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
      }
      std::sort(ms.begin() + 2, ms.end());  // the first two capture the graph / warm up
      return ms[2 + (ms.size() - 2) / 2];
    };
    Tensor unused;
    if (greedy_ms == 0) {
      std::vector<ops::cuda::SampleRow> greedy_rows(static_cast<size_t>(batch),
                                                    ops::cuda::SampleRow{0, 0, 1, 0, 0, 0});
      const model::ForwardBatch plain_step = step_of(0);
      greedy_ms = median_ms(8, [&] {
        check(m->forward_sample(plain_step, {greedy_rows, {}, {}}, {}, unused).status());
      });
    }
    const double device_ms = median_ms(8, [&] {
      check(m->forward_sample(step, {rows, sampling.adjustments, sampling.fetch_rows}, {}, unused).status());
    });
    const double host_ms = median_ms(c.iterations, [&] {
      auto logits = m->forward(step);
      check(logits.status());
      engine::sample_on_host(*logits, sampling);
    });
    char shape[160], extra[200];
    std::snprintf(shape, sizeof shape, "%d layers, batch %d, ctx %d: %s (%zu rows, %zu adjustments)",
                  num_layers, batch, context, c.name, rows.size(), sampling.adjustments.size());
    std::snprintf(extra, sizeof extra, "all rows to the host + CPU sampling (before): %.2f ms = %.1fx",
                  host_ms, host_ms / device_ms);
    report("sampling_step", shape, device_ms, greedy_ms, extra);
  }
  bench_structured_masks(*m, step_of(0), batch, vocab, greedy_ms);
}

}  // namespace moe::bench
