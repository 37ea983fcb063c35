// Request parsing (openai_protocol.h), the qwen3 reasoning split and the
// Prometheus text format, without a server.
#include <gtest/gtest.h>

#include "server/completion_run.h"
#include "server/metrics_text.h"
#include "server/openai_protocol.h"

namespace moe::server {
namespace {

TEST(Protocol, ParsesCompletionFieldsAndDefaults) {
  auto r = parse_completion_request(
      R"({"model":"m","prompt":[1,2,3],"max_tokens":7,"temperature":0.5,"top_p":0.9,"top_k":-1,"min_p":0.1,
          "seed":-3,"n":2,"logprobs":3,"stop":"x","stop_token_ids":[9],"ignore_eos":true,"stream":true,
          "stream_options":{"include_usage":true},"unknown_field":{"ignored":true}})",
      {});
  ASSERT_TRUE(std::holds_alternative<CompletionRequest>(r)) << std::get<ApiError>(r).message;
  const auto& c = std::get<CompletionRequest>(r);
  EXPECT_EQ(c.prompt_ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(c.params.max_tokens, 7);
  EXPECT_FLOAT_EQ(c.params.sampling.temperature, 0.5f);
  EXPECT_EQ(c.params.sampling.top_k, 0);
  EXPECT_EQ(*c.params.sampling.seed, static_cast<uint64_t>(-3));
  EXPECT_EQ(c.params.n, 2);
  EXPECT_EQ(c.params.logprobs, 3);
  EXPECT_EQ(c.params.stop, std::vector<std::string>{"x"});
  EXPECT_TRUE(c.params.include_usage && c.params.stream && c.params.ignore_eos);
  auto d = parse_completion_request(R"({"prompt":"hi"})", {});
  EXPECT_EQ(std::get<CompletionRequest>(d).params.max_tokens, 16);  // OpenAI's completions default
  EXPECT_FLOAT_EQ(std::get<CompletionRequest>(d).params.sampling.temperature, 1.0f);
}

TEST(Protocol, MaxCompletionTokensWinsAndChatContentPartsJoin) {
  auto r = parse_chat_request(
      R"({"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],
          "max_tokens":3,"max_completion_tokens":5,"logprobs":true,"top_logprobs":2,
          "chat_template_kwargs":{"enable_thinking":false}})",
      {});
  ASSERT_TRUE(std::holds_alternative<ChatRequest>(r)) << std::get<ApiError>(r).message;
  const auto& c = std::get<ChatRequest>(r);
  EXPECT_EQ(c.params.max_tokens, 5);
  EXPECT_EQ(c.params.logprobs, 2);
  EXPECT_EQ(c.messages[0]["content"], "ab");
  EXPECT_EQ(c.chat_template_kwargs["enable_thinking"], false);
}

TEST(Protocol, ErrorsNameTheParameter) {
  RequestLimits limits;
  limits.max_n = 4;
  auto param_of = [&](const char* body) {
    auto r = parse_completion_request(body, limits);
    return std::holds_alternative<ApiError>(r) ? std::get<ApiError>(r).param : std::string("(accepted)");
  };
  EXPECT_EQ(param_of(R"({"prompt":"x","n":5})"), "n");
  EXPECT_EQ(param_of(R"({"prompt":"x","max_tokens":1.5})"), "max_tokens");
  EXPECT_EQ(param_of(R"({"prompt":"x","max_tokens":2.0})"), "(accepted)");
  EXPECT_EQ(param_of(R"({"prompt":"x","top_p":0})"), "top_p");
  EXPECT_EQ(param_of(R"({"prompt":[1,"a"]})"), "prompt");
  EXPECT_EQ(param_of(R"({"prompt":"x","stop":[1]})"), "stop");
  EXPECT_EQ(param_of(R"({"prompt":"x","logprobs":21})"), "logprobs");
  EXPECT_EQ(param_of(R"({"prompt":"x","max_tokens":null})"), "(accepted)");
  const ApiError e = context_length_error(100, 90, 20, "messages");
  EXPECT_EQ(e.message,
            "This model's maximum context length is 100 tokens. However, you requested 110 tokens (90 in the messages, "
            "20 in the completion). Please reduce the length of the messages or completion.");
}

TEST(Reasoning, SplitsThinkBlocksFedInAnyPieces) {
  const std::string text = "<think>\nstep one</think>\n\nThe answer.";
  for (size_t piece = 1; piece <= text.size(); ++piece) {
    ReasoningSplitter s;
    std::string reasoning, content;
    for (size_t i = 0; i < text.size(); i += piece) {
      auto [r, c] = s.feed(text.substr(i, piece));
      reasoning += r, content += c;
    }
    auto [r, c] = s.finish();
    reasoning += r, content += c;
    EXPECT_EQ(reasoning, "\nstep one") << piece;
    EXPECT_EQ(content, "\n\nThe answer.") << piece;
  }
  ReasoningSplitter plain;
  auto [r, c] = plain.feed("No thinking here");
  EXPECT_EQ(r, "");
  EXPECT_EQ(c, "No thinking here");
  ReasoningSplitter unfinished;
  auto [r1, c1] = unfinished.feed("<think>still going");
  auto [r2, c2] = unfinished.finish();
  EXPECT_EQ(r1 + r2, "still going");
  EXPECT_EQ(c1 + c2, "");
}

TEST(MetricsText, HistogramsAreCumulativeWithVllmNames) {
  engine::EngineMetrics m;
  m.time_to_first_token_seconds.observe(0.003);
  m.time_to_first_token_seconds.observe(0.5);
  m.time_to_first_token_seconds.observe(1e9);
  m.generation_tokens_total = 42;
  const std::string text = render_metrics(m, "demo");
  EXPECT_NE(text.find("moeserve:generation_tokens_total{model_name=\"demo\"} 42\n"), std::string::npos);
  EXPECT_NE(text.find("moeserve:time_to_first_token_seconds_bucket{model_name=\"demo\",le=\"0.005\"} 1\n"),
            std::string::npos);
  EXPECT_NE(text.find("moeserve:time_to_first_token_seconds_bucket{model_name=\"demo\",le=\"0.5\"} 2\n"),
            std::string::npos);
  EXPECT_NE(text.find("moeserve:time_to_first_token_seconds_bucket{model_name=\"demo\",le=\"+Inf\"} 3\n"),
            std::string::npos);
  EXPECT_NE(text.find("moeserve:time_to_first_token_seconds_count{model_name=\"demo\"} 3\n"), std::string::npos);
  EXPECT_NE(text.find("# TYPE moeserve:kv_cache_usage_perc gauge"), std::string::npos);
}

}  // namespace
}  // namespace moe::server
