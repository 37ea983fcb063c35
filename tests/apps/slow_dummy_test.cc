// Full-size shapes: the public Qwen3-235B-A22B config with dummy weights, cut
// to one layer so it fits a CI machine (7.5 GB: embeddings, lm_head and one
// layer's 128 experts). Labelled "slow": Release only.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sys/wait.h>

TEST(DummyQwen3_235B, OneLayerGenerates) {
  const std::string command = std::string(MOESERVE_BIN) + " generate --model " + MOE_SOURCE_DIR +
                              "/tests/data/configs/qwen3-235b-a22b.config.json --load-format dummy --num-layers 1 " +
                              "--prompt-ids 1,2,3,4,5 --max-tokens 3 --ignore-eos --output json";
  FILE* pipe = popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string out;
  std::array<char, 4096> buffer{};
  size_t n;
  while ((n = fread(buffer.data(), 1, buffer.size(), pipe)) > 0) out.append(buffer.data(), n);
  const int status = pclose(pipe);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
  auto result = nlohmann::json::parse(out);
  ASSERT_EQ(result["token_ids"].size(), 3u);
  for (const auto& id : result["token_ids"]) {
    EXPECT_GE(id.get<int>(), 0);
    EXPECT_LT(id.get<int>(), 151936);
  }
}
