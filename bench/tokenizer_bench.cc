// Tokenizer speed against Hugging Face tokenizers, same text, same run
// (bench/tokenizer_bench.sh runs the HF side first). Single-threaded: documents
// are encoded one after another; reports the median of the runs in MB/s, the
// ratio to HF, and checks every document's ids against HF's.
//
//   tokenizer_bench MODEL_DIR BENCH_DIR [NUM_RUNS]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tokenizer/tokenizer.h"

using moe::tokenizer::TokenId;
using moe::tokenizer::Tokenizer;

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: tokenizer_bench MODEL_DIR BENCH_DIR [NUM_RUNS]\n");
    return 2;
  }
  const std::string bench_dir = argv[2];
  const int num_runs = argc > 3 ? std::max(1, std::atoi(argv[3])) : 5;
  auto tok = Tokenizer::load(argv[1]);
  if (!tok) {
    std::fprintf(stderr, "tokenizer_bench: %s\n", tok.status().to_string().c_str());
    return 1;
  }
  std::vector<std::string> docs;
  std::vector<std::vector<TokenId>> hf_ids;
  std::ifstream in(bench_dir + "/docs.jsonl");
  std::string line;
  size_t num_bytes = 0;
  while (std::getline(in, line)) {
    const auto record = nlohmann::json::parse(line, nullptr, false);
    if (record.is_discarded()) continue;
    docs.push_back(record["text"]);
    hf_ids.push_back(record["ids"].get<std::vector<TokenId>>());
    num_bytes += docs.back().size();
  }
  std::ifstream hf_file(bench_dir + "/hf.json");
  const auto hf = nlohmann::json::parse(hf_file, nullptr, false);
  if (docs.empty() || hf.is_discarded()) {
    std::fprintf(stderr, "tokenizer_bench: run bench/tokenizer_bench.mjs first (missing %s)\n", bench_dir.c_str());
    return 1;
  }
  size_t num_identical = 0, num_tokens = 0;
  std::vector<double> seconds;
  for (int run = 0; run < num_runs; ++run) {
    const auto start = std::chrono::steady_clock::now();
    for (size_t i = 0; i < docs.size(); ++i) {
      const std::vector<TokenId> ids = tok->encode(docs[i]);
      if (run == 0) {
        num_identical += ids == hf_ids[i];
        num_tokens += ids.size();
      }
    }
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(seconds.begin(), seconds.end());
  const double ours = num_bytes / 1e6 / seconds[seconds.size() / 2];
  const double theirs = hf["mb_per_s"].get<double>();
  std::printf("documents: %zu, %.2f MB, %zu tokens; ids identical to HF: %zu / %zu\n", docs.size(), num_bytes / 1e6,
              num_tokens, num_identical, docs.size());
  std::printf("moeserve: %.2f MB/s (median of %d)\nHF tokenizers: %.2f MB/s\nratio: %.2fx\n", ours, num_runs, theirs,
              ours / theirs);
  return num_identical == docs.size() ? 0 : 1;
}
