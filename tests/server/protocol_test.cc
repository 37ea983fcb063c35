// Request parsing (openai_protocol.h), the qwen3 reasoning split, the
// Prometheus text format and the speculative-decoding fields of the
// disaggregated messages (disagg_protocol.h), without a server.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <regex>
#include <set>

#include "server/completion_run.h"
#include "server/disagg_protocol.h"
#include "server/metrics_text.h"
#include "server/openai_protocol.h"
#include "server/tool_calls.h"
#include "structured/matcher.h"
#include "tokenizer/tokenizer.h"

namespace moe::server {
namespace {

// The parameter a 400 names for a one-message chat or a "x" completion with
// `fields` added, or "(accepted)".
std::string param_of(const std::string& fields, bool chat = false) {
  const std::string body =
      chat ? R"({"messages":[{"role":"user","content":"x"}])" + fields + "}" : R"({"prompt":"x")" + fields + "}";
  if (chat) {
    auto r = parse_chat_request(body, {});
    return std::holds_alternative<ApiError>(r) ? std::get<ApiError>(r).param : std::string("(accepted)");
  }
  auto r = parse_completion_request(body, {});
  return std::holds_alternative<ApiError>(r) ? std::get<ApiError>(r).param : std::string("(accepted)");
}

TEST(Protocol, ParsesCompletionFieldsAndDefaults) {
  auto r = parse_completion_request(
      R"({"model":"m","prompt":[1,2,3],"max_tokens":7,"temperature":0.5,"top_p":0.9,"top_k":-1,"min_p":0.1,
          "seed":-3,"n":2,"logprobs":3,"stop":"x","stop_token_ids":[9],"ignore_eos":true,"stream":true,
          "stream_options":{"include_usage":true},"unknown_field":{"ignored":true}})",
      {});
  ASSERT_TRUE(std::holds_alternative<CompletionRequest>(r)) << std::get<ApiError>(r).message;
  const auto& c = std::get<CompletionRequest>(r);
  ASSERT_EQ(c.prompts.size(), 1u);
  EXPECT_EQ(c.prompts[0].ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_FALSE(c.prompts[0].text);
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

TEST(Protocol, CompletionPromptsComeOneOrAsABatch) {
  RequestLimits limits;
  limits.max_choices = 6, limits.max_n = 2;
  auto prompts = [&](const char* body) {
    auto r = parse_completion_request(body, limits);
    if (auto* e = std::get_if<ApiError>(&r)) {
      EXPECT_EQ(e->param, "prompt") << body;
      return std::vector<PromptInput>{};
    }
    return std::get<CompletionRequest>(r).prompts;
  };
  auto one = prompts(R"({"prompt":"hello"})");
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].text, "hello");
  auto texts = prompts(R"({"prompt":["a","bc","d"]})");
  ASSERT_EQ(texts.size(), 3u);
  EXPECT_EQ(texts[1].text, "bc");
  auto ids = prompts(R"({"prompt":[[1,2],[3]]})");
  ASSERT_EQ(ids.size(), 2u);
  EXPECT_EQ(ids[0].ids, (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(ids[1].ids, (std::vector<int32_t>{3}));
  EXPECT_FALSE(ids[1].text);
  EXPECT_EQ(prompts(R"({"prompt":["x"]})").size(), 1u);                // a batch of one
  EXPECT_EQ(prompts(R"({"prompt":["a","b","c"],"n":2})").size(), 3u);  // 6 choices: at the limit
  limits.max_n = 8;  // a larger --max-n raises the limit for one prompt and for batches
  EXPECT_EQ(prompts(R"({"prompt":["a","b","c","d"],"n":2})").size(), 4u);
  limits.max_n = 2;
  // Rejected, each naming 'prompt': empty, mixed, nested empty, a bad id, too many choices.
  for (const char* bad : {R"({"prompt":[]})", R"({"prompt":""})", R"({"prompt":["a",""]})",
                          R"({"prompt":["a",[1]]})", R"({"prompt":[[1],[]]})", R"({"prompt":[[1],[-2]]})",
                          R"({"prompt":[[1],"a"]})", R"({"prompt":[["a"]]})", R"({"prompt":{"text":"a"}})",
                          R"({"prompt":["a","b","c","d"],"n":2})", R"({"prompt":[1,[2]]})"}) {
    EXPECT_TRUE(prompts(bad).empty()) << bad;
  }
}

TEST(Protocol, UnsupportedFieldsPassOnlyAtTheirNeutralValue) {
  // What clients send by default is accepted.
  for (
      const char* neutral :
      {R"(,"presence_penalty":0,"frequency_penalty":0.0,"repetition_penalty":1,"logit_bias":{},"min_tokens":0)",
       R"(,"logit_bias":null,"suffix":"","best_of":1,"user":"u")", R"(,"n":2,"best_of":2)",
       R"(,"presence_penalty":null,"guided_json":null)"})
    EXPECT_EQ(param_of(neutral), "(accepted)") << neutral;
  EXPECT_EQ(param_of(R"(,"response_format":{"type":"text"},"tool_choice":"auto")", true), "(accepted)");
  EXPECT_EQ(param_of(R"(,"tool_choice":"none")", true), "(accepted)");
  // Anything else is a 400 that names the field.
  EXPECT_EQ(param_of(R"(,"length_penalty":0.5)"), "length_penalty");
  EXPECT_EQ(param_of(R"(,"suffix":"end")"), "suffix");
  EXPECT_EQ(param_of(R"(,"best_of":3)"), "best_of");
  EXPECT_EQ(param_of(R"(,"guided_grammar":"root ::= x")"), "guided_grammar");  // 'x' is not defined
  EXPECT_EQ(param_of(R"(,"guided_grammar":"root ::= \"x\"")"), "(accepted)");
  EXPECT_EQ(param_of(R"(,"response_format":{"type":"grammar"})", true), "response_format");
  EXPECT_EQ(param_of(R"(,"tool_choice":"required")", true), "tool_choice");  // without tools
  EXPECT_EQ(param_of(R"(,"tool_choice":{"type":"function","function":{"name":"f"}})", true), "tool_choice");
}

// Penalties, logit_bias and min_tokens reach the engine's sampling
// parameters; values out of OpenAI's (vLLM's) ranges are a 400 naming them.
TEST(Protocol, LogitsAdjustmentsAreReadAndRangeChecked) {
  auto parse = [](const std::string& fields) {
    return parse_completion_request(R"({"prompt":"x","max_tokens":8)" + fields + "}", {});
  };
  auto r =
      parse(R"(,"presence_penalty":0.5,"frequency_penalty":-1.25,"repetition_penalty":1.1,"min_tokens":4,)"
            R"("logit_bias":{"50256":-100,"7":2.5})");
  ASSERT_TRUE(std::holds_alternative<CompletionRequest>(r)) << std::get<ApiError>(r).message;
  const engine::SamplingParams& s = std::get<CompletionRequest>(r).params.sampling;
  EXPECT_EQ(s.presence_penalty, 0.5f);
  EXPECT_EQ(s.frequency_penalty, -1.25f);
  EXPECT_EQ(s.repetition_penalty, 1.1f);
  EXPECT_EQ(s.min_tokens, 4);
  EXPECT_EQ(s.logit_bias, (std::vector<std::pair<int32_t, float>>{{50256, -100.0f}, {7, 2.5f}}));
  EXPECT_TRUE(s.adjusts_logits());
  auto neutral = parse(R"(,"presence_penalty":0,"frequency_penalty":0,"repetition_penalty":1,"min_tokens":0,)"
                       R"("logit_bias":{})");
  ASSERT_TRUE(std::holds_alternative<CompletionRequest>(neutral));
  EXPECT_FALSE(std::get<CompletionRequest>(neutral).params.sampling.adjusts_logits());
  auto param_of = [&](const std::string& fields) {
    auto bad = parse(fields);
    return std::holds_alternative<ApiError>(bad) ? std::get<ApiError>(bad).param : std::string("(accepted)");
  };
  for (const auto& [fields, param] : std::vector<std::pair<std::string, std::string>>{
           {R"(,"presence_penalty":2.5)", "presence_penalty"},
           {R"(,"frequency_penalty":-2.01)", "frequency_penalty"},
           {R"(,"frequency_penalty":"0")", "frequency_penalty"},
           {R"(,"repetition_penalty":0)", "repetition_penalty"},
           {R"(,"repetition_penalty":3)", "repetition_penalty"},
           {R"(,"min_tokens":-1)", "min_tokens"},
           {R"(,"min_tokens":9)", "min_tokens"},  // over max_tokens
           {R"(,"logit_bias":[1,2])", "logit_bias"},
           {R"(,"logit_bias":{"a":1})", "logit_bias"},
           {R"(,"logit_bias":{"-3":1})", "logit_bias"},
           {R"(,"logit_bias":{"12x":1})", "logit_bias"},
           {R"(,"logit_bias":{"3":101})", "logit_bias"},
           {R"(,"logit_bias":{"3":"1"})", "logit_bias"},
           {R"(,"logit_bias":{"99999999999":1})", "logit_bias"}})
    EXPECT_EQ(param_of(fields), param) << fields;
  EXPECT_EQ(param_of(R"(,"min_tokens":8)"), "(accepted)");
}

// vLLM's bad_words (text, tokenized by the server) and allowed_token_ids
// (distinct, sorted), chat's continue_final_message (only without a generation
// prompt) and echo; malformed values are a 400 naming the field.
TEST(Protocol, TokenRestrictionsAndChatContinuationAreRead) {
  auto r = parse_completion_request(R"({"prompt":"x","bad_words":[" a b","c"],"allowed_token_ids":[9,3,9,0]})", {});
  ASSERT_TRUE(std::holds_alternative<CompletionRequest>(r)) << std::get<ApiError>(r).message;
  const GenerationParams& p = std::get<CompletionRequest>(r).params;
  EXPECT_EQ(p.bad_words, (std::vector<std::string>{" a b", "c"}));
  EXPECT_EQ(p.sampling.allowed_token_ids, (std::vector<int32_t>{0, 3, 9}));
  RequestLimits limits;
  std::string many = R"(,"bad_words":[)";
  for (int i = 0; i <= limits.max_bad_words; ++i) many += (i ? ",\"w" : "\"w") + std::to_string(i) + "\"";
  many += "]";
  for (const auto& [fields, param] : std::vector<std::pair<std::string, std::string>>{
           {R"(,"bad_words":"a")", "bad_words"},
           {R"(,"bad_words":["a",""])", "bad_words"},
           {R"(,"bad_words":[1])", "bad_words"},
           {many, "bad_words"},
           {R"(,"bad_words":null,"allowed_token_ids":null)", "(accepted)"},
           {R"(,"bad_words":[])", "(accepted)"},
           {R"(,"allowed_token_ids":[])", "allowed_token_ids"},
           {R"(,"allowed_token_ids":[1,-2])", "allowed_token_ids"},
           {R"(,"allowed_token_ids":[1.5])", "allowed_token_ids"},
           {R"(,"allowed_token_ids":[3000000000])", "allowed_token_ids"},
           {R"(,"allowed_token_ids":{"1":1})", "allowed_token_ids"}})
    EXPECT_EQ(param_of(fields), param) << fields;
  EXPECT_EQ(param_of(R"(,"continue_final_message":true)", true), "continue_final_message");
  EXPECT_EQ(param_of(R"(,"continue_final_message":true,"add_generation_prompt":true)", true), "continue_final_message");
  EXPECT_EQ(param_of(R"(,"continue_final_message":"yes","add_generation_prompt":false)", true),
            "continue_final_message");
  EXPECT_EQ(param_of(R"(,"echo":1)", true), "echo");
  auto chat = parse_chat_request(
      R"({"messages":[{"role":"assistant","content":"x"}],"continue_final_message":true,"add_generation_prompt":false,)"
      R"("echo":true})",
      {});
  ASSERT_TRUE(std::holds_alternative<ChatRequest>(chat)) << std::get<ApiError>(chat).message;
  EXPECT_TRUE(std::get<ChatRequest>(chat).continue_final_message);
  EXPECT_TRUE(std::get<ChatRequest>(chat).echo);
  EXPECT_FALSE(std::get<ChatRequest>(chat).add_generation_prompt);
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

// `text` fed to `splitter` in pieces of `piece` bytes: all its (reasoning, content).
std::pair<std::string, std::string> split_in_pieces(ReasoningSplitter splitter, const std::string& text,
                                                    size_t piece) {
  std::string reasoning, content;
  for (size_t i = 0; i < text.size(); i += piece) {
    auto [r, c] = splitter.feed(text.substr(i, piece));
    reasoning += r, content += c;
  }
  auto [r, c] = splitter.finish();
  return {reasoning + r, content + c};
}

TEST(Reasoning, SplitsThinkBlocksFedInAnyPieces) {
  const std::string text = "<think>\nstep one</think>\n\nThe answer.";
  for (size_t piece = 1; piece <= text.size(); ++piece) {
    auto [reasoning, content] = split_in_pieces(ReasoningSplitter(), text, piece);
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

// Qwen3-*-Thinking-2507 and Qwen3.5 put <think> in the prompt: the output
// only closes the reasoning.
TEST(Reasoning, APromptThatOpensTheReasoningStartsInIt) {
  const std::string text = "\nstep one</think>\n\nThe answer.";
  for (size_t piece = 1; piece <= text.size(); ++piece) {
    auto [reasoning, content] = split_in_pieces(ReasoningSplitter(/*in_reasoning=*/true), text, piece);
    EXPECT_EQ(reasoning, "\nstep one") << piece;
    EXPECT_EQ(content, "\n\nThe answer.") << piece;
  }
  // With tools, a call before </think> ends the reasoning; without, it is reasoning text.
  const std::string early = "let me look it up<tool_call>\n{\"name\": \"f\"}\n</tool_call>";
  for (size_t piece = 1; piece <= early.size(); ++piece) {
    auto [reasoning, content] =
        split_in_pieces(ReasoningSplitter(/*in_reasoning=*/true, /*tool_calls=*/true), early, piece);
    EXPECT_EQ(reasoning, "let me look it up") << piece;
    EXPECT_EQ(content, "<tool_call>\n{\"name\": \"f\"}\n</tool_call>") << piece;
  }
  ReasoningSplitter cut(true);  // never closed (max_tokens): all reasoning
  auto [r1, c1] = cut.feed("thinking about <tool_call> and more");
  auto [r2, c2] = cut.finish();
  EXPECT_EQ(r1 + r2, "thinking about <tool_call> and more");
  EXPECT_EQ(c1 + c2, "");
}

// `text` fed to `parser` in pieces of `piece` bytes: all its content and calls.
std::pair<std::string, std::vector<ToolCall>> parse_in_pieces(ToolCallParser parser, const std::string& text,
                                                              size_t piece) {
  std::string content;
  std::vector<ToolCall> calls;
  for (size_t i = 0; i < text.size(); i += piece) {
    auto out = parser.feed(text.substr(i, piece));
    content += out.content;
    calls.insert(calls.end(), out.calls.begin(), out.calls.end());
  }
  auto rest = parser.finish(/*stopped=*/true);
  content += rest.content;
  calls.insert(calls.end(), rest.calls.begin(), rest.calls.end());
  return {content, calls};
}

TEST(ToolCalls, HermesBlocksBecomeCallsFedInAnyPieces) {
  const std::string text =
      "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", "
      "\"days\": 2}}\n"
      "</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": \"{\\\"tz\\\": "
      "\\\"CET\\\"}\"}\n</tool_call>"
      "<tool_call>not json</tool_call> a < b <tool_c";
  for (size_t piece = 1; piece <= text.size(); ++piece) {
    auto [content, calls] = parse_in_pieces(ToolCallParser(), text, piece);
    ASSERT_EQ(calls.size(), 2u) << piece;
    EXPECT_EQ(calls[0].name, "get_weather");
    EXPECT_EQ(calls[0].arguments, R"({"city":"Paris","days":2})");
    EXPECT_EQ(calls[1].name, "get_time");
    EXPECT_EQ(calls[1].arguments, R"({"tz": "CET"})");  // a string stays as the model wrote it
    // Text around the calls, the block that is not a call, and a tag cut off by the end stay content.
    EXPECT_EQ(content, "Let me check.\n\n<tool_call>not json</tool_call> a < b <tool_c") << piece;
  }
  ToolCallParser open;
  EXPECT_EQ(open.feed("<tool_call>{\"name\": \"f\"").content, "");
  EXPECT_EQ(open.finish(true).content, "<tool_call>{\"name\": \"f\"");  // unterminated JSON: content
  // A last block the model left open by stopping (at a stop string "</tool_call>", say) is a call;
  // cut by max_tokens it stays content.
  const std::string unclosed = "Sure.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n";
  for (bool stopped : {true, false}) {
    ToolCallParser p;
    auto out = p.feed(unclosed);
    out.append(p.finish(stopped));
    if (stopped) {
      ASSERT_EQ(out.calls.size(), 1u);
      EXPECT_EQ(out.calls[0].arguments, R"({"a":1})");
      EXPECT_EQ(out.content, "Sure.\n");
    } else {
      EXPECT_TRUE(out.calls.empty());
      EXPECT_EQ(out.content, unclosed);
    }
  }
  ToolCallParser bare;
  auto out = bare.feed("<tool_call>{\"name\": \"f\"}</tool_call>");
  ASSERT_EQ(out.calls.size(), 1u);
  EXPECT_EQ(out.calls[0].arguments, "{}");
  EXPECT_TRUE(bare.feed("<tool_call>{\"arguments\": {}}</tool_call>").calls.empty());  // no name: content
  // String arguments that are not an object's JSON go out as a JSON string, so clients can parse them.
  for (const auto& [written, sent] : std::vector<std::pair<std::string, std::string>>{
           {R"("Paris")", R"("Paris")"}, {R"("[1, 2]")", R"("[1, 2]")"}, {"5", "5"}, {R"("{\"a\": 1}")", R"({"a": 1})"}}) {
    ToolCallParser p;
    auto r = p.feed("<tool_call>{\"name\": \"f\", \"arguments\": " + written + "}</tool_call>");
    ASSERT_EQ(r.calls.size(), 1u) << written;
    EXPECT_EQ(r.calls[0].arguments, sent) << written;
  }
}

TEST(ToolCalls, Qwen3CoderBlocksTakeTheirArgumentTypesFromTheToolSchema) {
  const auto tools = nlohmann::ordered_json::parse(R"([{"type": "function", "function": {"name": "book",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "nights": {"type": "integer"},
      "breakfast": {"type": "boolean"}, "guests": {"type": "array"}, "budget": {"type": "number"}}}}}])");
  const std::string text =
      "I will book "
      "it.\n<tool_call>\n<function=book>\n<parameter=city>\n1984\n</parameter>\n<parameter=nights>\n3\n"
      "</parameter>\n<parameter=breakfast>\ntrue\n</parameter>\n<parameter=guests>\n[\"Ann\", "
      "\"Bo\"]\n</parameter>\n"
      "<parameter=budget>\nabout 200\n</parameter>\n<parameter=note>\nline one\nline "
      "two\n</parameter>\n</function>\n"
      "</tool_call><tool_call>\n<function=book>\n<parameter=city>\nRome\n</function>\n</tool_call> done";
  for (size_t piece = 1; piece <= text.size(); piece += (piece < 16 ? 1 : 7)) {
    auto [content, calls] = parse_in_pieces(ToolCallParser(ToolCallFormat::kQwen3Coder, tools), text, piece);
    ASSERT_EQ(calls.size(), 2u) << piece;
    EXPECT_EQ(calls[0].name, "book");
    // city is a string even though "1984" parses as a number; budget's text is
    // no number, so it stays a string; note has no schema and no JSON: a string.
    EXPECT_EQ(nlohmann::ordered_json::parse(calls[0].arguments),
              nlohmann::ordered_json::parse(R"({"city": "1984", "nights": 3, "breakfast": true,
                  "guests": ["Ann", "Bo"], "budget": "about 200", "note": "line one\nline two"})"));
    // The second block's parameter is never closed: as vLLM's parser, it ends at </function>.
    EXPECT_EQ(calls[1].arguments, R"({"city":"Rome"})");
    EXPECT_EQ(content, "I will book it.\n done") << piece;
  }
  // A parameter left open ends at the next one; an open last block (the model stopped at
  // "</tool_call>") is a call, its </function> missing too.
  const std::string open_text = "<tool_call>\n<function=book>\n<parameter=city>\nRome\n<parameter=nights>\n2\n"
                                "</parameter>\n<parameter=note>\nlate\n";
  auto [open_content, open_calls] =
      parse_in_pieces(ToolCallParser(ToolCallFormat::kQwen3Coder, tools), open_text, 3);
  ASSERT_EQ(open_calls.size(), 1u);
  EXPECT_EQ(open_content, "");
  EXPECT_EQ(nlohmann::ordered_json::parse(open_calls[0].arguments),
            nlohmann::ordered_json::parse(R"({"city": "Rome", "nights": 2, "note": "late"})"));
  ToolCallParser cut(ToolCallFormat::kQwen3Coder, tools);  // cut by max_tokens: content
  auto cut_out = cut.feed(open_text);
  cut_out.append(cut.finish(/*stopped=*/false));
  EXPECT_TRUE(cut_out.calls.empty());
  EXPECT_EQ(cut_out.content, open_text);
  ToolCallParser no_function_end(ToolCallFormat::kQwen3Coder);  // as vLLM: </function> may be missing
  auto closed = no_function_end.feed("<tool_call>\n<function=f>\n<parameter=a>\n1\n</tool_call>");
  ASSERT_EQ(closed.calls.size(), 1u);
  EXPECT_EQ(closed.calls[0].arguments, R"({"a":1})");
  EXPECT_TRUE(no_function_end.feed("<tool_call>\n<function=f>\ntext\n</tool_call>").calls.empty());
  ToolCallParser hermes_text(ToolCallFormat::kQwen3Coder);
  EXPECT_TRUE(hermes_text.feed("<tool_call>{\"name\": \"f\"}</tool_call>").calls.empty());  // not this format
  ToolCallParser no_params(ToolCallFormat::kQwen3Coder);
  auto out = no_params.feed("<tool_call><function=now></function></tool_call>");
  ASSERT_EQ(out.calls.size(), 1u);
  EXPECT_EQ(out.calls[0].arguments, "{}");
  // As vLLM's parser: True / False for a boolean, and null (any case) for any type.
  ToolCallParser python_style(ToolCallFormat::kQwen3Coder, tools);
  auto typed = python_style.feed("<tool_call>\n<function=book>\n<parameter=breakfast>\nFalse\n</parameter>\n"
                                 "<parameter=city>\nNULL\n</parameter>\n</function>\n</tool_call>");
  ASSERT_EQ(typed.calls.size(), 1u);
  EXPECT_EQ(nlohmann::ordered_json::parse(typed.calls[0].arguments),
            nlohmann::ordered_json::parse(R"({"breakfast": false, "city": null})"));
}

// A CompletionRun driven by a scripted backend: the demo tokenizer's ids of
// an assistant turn that calls a tool come back as OpenAI tool_calls.
class ScriptedBackend final : public GenerationBackend {
 public:
  Expected<uint64_t> submit(engine::EngineRequest, engine::OutputCallback on_output,
                            const std::string&) override {
    callbacks.push_back(std::move(on_output));
    return callbacks.size();
  }
  void cancel(uint64_t, engine::FinishReason) override {}
  int64_t vocab_size() const override { return 1 << 20; }
  bool healthy() const override { return true; }
  std::string metrics_text(const std::string&) const override { return {}; }
  void play(size_t request, const std::vector<int32_t>& ids) {
    for (int32_t id : ids) callbacks[request](engine::EngineOutput{.token = id});
    callbacks[request](engine::EngineOutput{.finish = engine::FinishReason::kStop});
  }
  std::vector<engine::OutputCallback> callbacks;
};

class CapturedExchange final : public HttpExchange {
 public:
  void respond(HttpResponse r) override { body = r.body; }
  void start_events(int, HeaderList) override {}
  void send_event(std::string data) override { events.push_back(std::move(data)); }
  void end_events() override {}
  void on_close(std::function<void()>) override {}
  std::string body;
  std::vector<std::string> events;
};

// A chat turn parsed for hermes tool calls: `ids` played by a scripted
// backend through a CompletionRun; the exchange holds what it sent.
std::shared_ptr<CapturedExchange> run_tool_call_chat(const tokenizer::Tokenizer& tok, const std::vector<int32_t>& ids,
                                                     bool stream, const std::string& request_id,
                                                     std::vector<std::string> stop = {}) {
  RunConfig config;
  config.chat = true, config.id = "chatcmpl-x", config.model = "m", config.request_id = request_id;
  config.params.stream = stream;
  config.params.stop = std::move(stop);
  config.prompts = {RunPrompt{{1, 2, 3}, "", 64}};
  config.tokenizer = &tok;
  config.parse_tool_calls = true;
  ScriptedBackend backend;
  auto exchange = std::make_shared<CapturedExchange>();
  auto run = std::make_shared<CompletionRun>(config, exchange, backend);
  EXPECT_FALSE(run->start(engine::EngineRequest{}).has_value());
  backend.play(0, ids);
  return exchange;
}

// Parallel calls as Qwen's templates write them (a newline between blocks):
// no content beside them, so "content" is null (docs/server.md).
TEST(ToolCalls, OnlyWhitespaceBesideTheCallsIsNoContent) {
  auto tok = tokenizer::Tokenizer::load(std::string(MOE_SOURCE_DIR) + "/models/moeserve-demo");
  ASSERT_TRUE(tok.has_value()) << tok.status().to_string();
  const std::string turn = "<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n"
                           "<tool_call>\n{\"name\": \"b\", \"arguments\": {}}\n</tool_call>\n";
  const auto exchange = run_tool_call_chat(*tok, tok->encode(turn, false), /*stream=*/false, "r2");
  const auto message = nlohmann::json::parse(exchange->body)["choices"][0]["message"];
  ASSERT_EQ(message["tool_calls"].size(), 2u);
  EXPECT_TRUE(message["content"].is_null()) << message.dump();
}

// A client that stops at "</tool_call>" (one call per turn): the open block is the call.
TEST(ToolCalls, AStopStringAtTheBlocksEndLeavesTheCall) {
  auto tok = tokenizer::Tokenizer::load(std::string(MOE_SOURCE_DIR) + "/models/moeserve-demo");
  ASSERT_TRUE(tok.has_value()) << tok.status().to_string();
  const std::string turn = "Sure.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": 1}}\n</tool_call>\n"
                           "<tool_call>\n{\"name\": \"b\", \"arguments\": {}}\n</tool_call>";
  for (bool stream : {false, true}) {
    SCOPED_TRACE(stream ? "streaming" : "one response");
    const auto exchange = run_tool_call_chat(*tok, tok->encode(turn, false), stream, "r3", {"</tool_call>"});
    nlohmann::json calls = nlohmann::json::array(), finish;
    std::string content;
    if (!stream) {
      const auto choice = nlohmann::json::parse(exchange->body)["choices"][0];
      calls = choice["message"]["tool_calls"];
      content = choice["message"]["content"].get<std::string>();
      finish = choice["finish_reason"];
    } else {
      for (const auto& e : exchange->events) {
        if (e == "[DONE]") continue;
        const auto choice = nlohmann::json::parse(e)["choices"][0];
        if (choice["delta"].contains("content")) content += choice["delta"]["content"].get<std::string>();
        for (const auto& call : choice["delta"].value("tool_calls", nlohmann::json::array())) calls.push_back(call);
        if (!choice["finish_reason"].is_null()) finish = choice["finish_reason"];
      }
    }
    ASSERT_EQ(calls.size(), 1u);
    EXPECT_EQ(calls[0]["function"]["name"], "a");
    EXPECT_EQ(calls[0]["function"]["arguments"], R"({"x":1})");
    EXPECT_EQ(content, "Sure.\n");
    EXPECT_EQ(finish, "tool_calls");
  }
}

TEST(ToolCalls, ChatResponsesCarryThemStreamingOrNot) {
  auto tok = tokenizer::Tokenizer::load(std::string(MOE_SOURCE_DIR) + "/models/moeserve-demo");
  ASSERT_TRUE(tok.has_value()) << tok.status().to_string();
  const std::string turn =
      "Sure.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
  const std::vector<int32_t> turn_ids = tok->encode(turn, false);
  std::set<std::string> ids;
  for (bool stream : {false, true}) {
    SCOPED_TRACE(stream ? "streaming" : "one response");
    const auto exchange = run_tool_call_chat(*tok, turn_ids, stream, "r1");
    nlohmann::json message, call, finish;
    if (!stream) {
      const auto body = nlohmann::json::parse(exchange->body);
      message = body["choices"][0]["message"];
      finish = body["choices"][0]["finish_reason"];
      ASSERT_EQ(message["tool_calls"].size(), 1u);
      call = message["tool_calls"][0];
    } else {
      std::string content;
      for (const auto& e : exchange->events) {
        if (e == "[DONE]") continue;
        const auto chunk = nlohmann::json::parse(e);
        const auto& delta = chunk["choices"][0]["delta"];
        if (delta.contains("content")) content += delta["content"].get<std::string>();
        if (delta.contains("tool_calls")) {
          ASSERT_TRUE(call.is_null()) << "one call, in one chunk";
          call = delta["tool_calls"][0];
          EXPECT_EQ(call["index"], 0);
        }
        if (!chunk["choices"][0]["finish_reason"].is_null()) finish = chunk["choices"][0]["finish_reason"];
      }
      message["content"] = content;
      ASSERT_FALSE(call.is_null());
    }
    EXPECT_EQ(message["content"], "Sure.");
    EXPECT_EQ(finish, "tool_calls");
    EXPECT_EQ(call["type"], "function");
    // Random ids: a client that sends the same X-Request-Id twice still gets distinct call ids.
    EXPECT_TRUE(std::regex_match(call["id"].get<std::string>(), std::regex("call_[0-9a-f]{24}"))) << call["id"];
    EXPECT_TRUE(ids.insert(call["id"].get<std::string>()).second) << call["id"];
    EXPECT_EQ(call["function"]["name"], "get_weather");
    EXPECT_EQ(nlohmann::json::parse(call["function"]["arguments"].get<std::string>()),
              nlohmann::json::parse(R"({"city": "Paris"})"));
  }
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

// A request's logits adjustments reach the prefill and decode instances
// unchanged; neutral ones are left out of the message.
TEST(DisaggProtocol, DecodeRequestCarriesTheLogitsAdjustments) {
  disagg::DecodeRequest r;
  r.spec.request_id = "r1";
  r.spec.prompt = {5, 6, 7};
  r.spec.max_tokens = 9;
  r.spec.sampling.seed = 3;
  r.spec.sampling.presence_penalty = 0.25f;
  r.spec.sampling.frequency_penalty = -1.5f;
  r.spec.sampling.repetition_penalty = 1.3f;
  r.spec.sampling.min_tokens = 4;
  r.spec.sampling.logit_bias = {{11, -100.0f}, {4, 0.125f}};
  r.writer_url = "http://127.0.0.1:1";
  r.writer_endpoint = "127.0.0.1:2";
  auto back = disagg::parse_decode_request(disagg::to_json(r).dump());
  ASSERT_TRUE(back.has_value()) << back.status().to_string();
  const engine::SamplingParams& s = back->spec.sampling;
  EXPECT_EQ(s.presence_penalty, 0.25f);
  EXPECT_EQ(s.frequency_penalty, -1.5f);
  EXPECT_EQ(s.repetition_penalty, 1.3f);
  EXPECT_EQ(s.min_tokens, 4);
  EXPECT_EQ(s.logit_bias, r.spec.sampling.logit_bias);
  EXPECT_EQ(disagg::to_engine_request(back->spec).sampling.logit_bias, r.spec.sampling.logit_bias);
  r.spec.sampling = {};
  r.spec.sampling.seed = 3;
  const auto plain = disagg::to_json(r);
  EXPECT_FALSE(plain.dump().find("penalty") != std::string::npos ||
               plain.dump().find("logit_bias") != std::string::npos);
  back = disagg::parse_decode_request(plain.dump());
  ASSERT_TRUE(back.has_value());
  EXPECT_FALSE(back->spec.sampling.adjusts_logits());
  nlohmann::json uneven = disagg::to_json(r);
  uneven["logit_bias_ids"] = {1, 2};
  uneven["logit_bias_values"] = {1.0};
  EXPECT_FALSE(disagg::parse_decode_request(uneven.dump()).has_value());
  // bad_words and allowed_token_ids, as the engine keeps them.
  r.spec.sampling.bad_words = {{7}, {1, 2, 3}, {4, 4}};
  r.spec.sampling.allowed_token_ids = {0, 4, 7, 12};
  back = disagg::parse_decode_request(disagg::to_json(r).dump());
  ASSERT_TRUE(back.has_value()) << back.status().to_string();
  EXPECT_EQ(back->spec.sampling.bad_words, r.spec.sampling.bad_words);
  EXPECT_EQ(back->spec.sampling.allowed_token_ids, r.spec.sampling.allowed_token_ids);
  EXPECT_EQ(disagg::to_engine_request(back->spec).sampling.bad_words, r.spec.sampling.bad_words);
  for (const auto& lengths : {nlohmann::json{1, 3}, nlohmann::json{1, 3, 3}, nlohmann::json{1, 0, 5}}) {
    nlohmann::json broken = disagg::to_json(r);
    broken["bad_words_lengths"] = lengths;  // adding up to less, to more, a word of none
    EXPECT_FALSE(disagg::parse_decode_request(broken.dump()).has_value()) << lengths;
  }
}

// Structured outputs: each spelling gives a grammar; a schema's error names
// the keyword; the grammar crosses the disaggregated protocol as its source
// with the schema's property order.
TEST(Protocol, StructuredOutputsCompileOrNameWhatIsNotServed) {
  auto grammar_of = [](const std::string& fields) -> std::shared_ptr<const structured::Grammar> {
    auto r = parse_chat_request(R"({"messages":[{"role":"user","content":"x"}])" + fields + "}", {});
    return std::holds_alternative<ChatRequest>(r) ? std::get<ChatRequest>(r).params.grammar : nullptr;
  };
  auto matches = [](const std::shared_ptr<const structured::Grammar>& g, std::string_view text) {
    structured::Matcher m(*g);
    return m.advance(text) && m.accepting();
  };
  const std::string schema = R"({"type":"object","properties":{"z":{"type":"integer"},"a":{"type":"boolean"}},"required":["z","a"]})";
  for (const std::string& fields :
       {R"(,"response_format":{"type":"json_schema","json_schema":{"name":"s","schema":)" + schema + "}}",
        R"(,"guided_json":)" + schema, R"(,"guided_json":)" + nlohmann::json(schema).dump(),
        R"(,"structured_outputs":{"json":)" + schema + "}"}) {
    auto g = grammar_of(fields);
    ASSERT_TRUE(g) << fields;
    EXPECT_TRUE(matches(g, R"({"z": 1, "a": true})")) << fields;
    EXPECT_FALSE(matches(g, R"({"a": true, "z": 1})")) << fields;
  }
  EXPECT_TRUE(matches(grammar_of(R"(,"response_format":{"type":"json_object"})"), "{}"));
  EXPECT_TRUE(matches(grammar_of(R"(,"structured_outputs":{"json_object":true})"), "{}"));
  EXPECT_TRUE(matches(grammar_of(R"(,"guided_choice":["x","y"])"), "y"));
  EXPECT_TRUE(matches(grammar_of(R"(,"structured_outputs":{"choice":["x","y"],"disable_any_whitespace":true})"), "x"));
  EXPECT_FALSE(grammar_of(R"(,"response_format":{"type":"text"})"));
  auto error_of = [](const std::string& fields) {
    auto r = parse_chat_request(R"({"messages":[{"role":"user","content":"x"}])" + fields + "}", {});
    return std::holds_alternative<ApiError>(r) ? std::get<ApiError>(r).message : std::string("(accepted)");
  };
  // Regular expressions: a schema's pattern (a search in the decoded value), guided_regex (the whole text).
  EXPECT_TRUE(matches(grammar_of(R"(,"guided_json":{"type":"string","pattern":"b+"})"), R"("abba")"));
  EXPECT_FALSE(matches(grammar_of(R"(,"guided_json":{"type":"string","pattern":"^b+$"})"), R"("abba")"));
  EXPECT_TRUE(matches(grammar_of(R"(,"guided_regex":"[0-9]{3}-x")"), "123-x"));
  EXPECT_FALSE(matches(grammar_of(R"(,"guided_regex":"[0-9]{3}-x")"), "0123-x"));
  EXPECT_TRUE(matches(grammar_of(R"j(,"structured_outputs":{"regex":"(yes|no)!"})j"), "no!"));
  EXPECT_NE(error_of(R"(,"guided_json":{"type":"string","pattern":"(a)\\1"})").find("backreferences"),
            std::string::npos);
  EXPECT_NE(error_of(R"j(,"guided_regex":"a(?!b)")j").find("look-ahead"), std::string::npos);
  EXPECT_NE(error_of(R"(,"guided_regex":7)").find("must be a string"), std::string::npos);
  // EBNF grammars (guided_grammar, structured_outputs.grammar): the whole text.
  const std::string sql = R"(root ::= \"SELECT \" [a-z]+ (\", \" [a-z]+)* \" FROM t;\")";
  for (const std::string& fields : {R"(,"guided_grammar":")" + sql + "\"", R"(,"structured_outputs":{"grammar":")" + sql + "\"}"}) {
    auto g = grammar_of(fields);
    ASSERT_TRUE(g) << fields;
    EXPECT_TRUE(matches(g, "SELECT a, bc FROM t;")) << fields;
    EXPECT_FALSE(matches(g, "SELECT FROM t;")) << fields;
  }
  EXPECT_NE(error_of(R"(,"structured_outputs":{"grammar":"a"})").find("'::='"), std::string::npos);
  EXPECT_NE(error_of(R"(,"guided_grammar":"root ::= e\ne ::= e \"+\" | \"1\"")").find("left recursion"),
            std::string::npos);
  EXPECT_NE(error_of(R"(,"guided_grammar":["root ::= \"a\""])").find("must be a string"), std::string::npos);
  // structural_tag (vLLM's three spellings): free text, and a structure after each trigger.
  const std::string tag =
      R"({"type":"structural_tag","structures":[{"begin":"<f=a>","schema":{"type":"object","properties":{"x":{"type":"integer"}},"required":["x"]},"end":"</f>"}],"triggers":["<f="]})";
  for (const std::string& fields : {",\"response_format\":" + tag,
                                    ",\"structured_outputs\":{\"structural_tag\":" + nlohmann::json(tag).dump() + "}",
                                    ",\"structural_tag\":" + tag}) {
    auto g = grammar_of(fields);
    ASSERT_TRUE(g) << fields;
    EXPECT_TRUE(matches(g, R"(Calling. <f=a>{"x": 1}</f> Done.)")) << fields;
    EXPECT_TRUE(matches(g, "no call at all")) << fields;
    EXPECT_FALSE(matches(g, R"(<f=b>{"x": 1}</f>)")) << fields;
    EXPECT_FALSE(matches(g, R"(<f=a>{"y": 1}</f>)")) << fields;
    auto back = structured::Grammar::from_source(g->source());  // what disaggregated serving sends
    ASSERT_TRUE(back.has_value()) << back.status().to_string();
    EXPECT_TRUE(matches(*back, R"(<f=a>{"x": 2}</f>)"));
    EXPECT_FALSE(matches(*back, R"(<f=a>{"x": "2"}</f>)"));
  }
  EXPECT_NE(error_of(R"(,"structured_outputs":{"structural_tag":"{}"})").find("structures"), std::string::npos);
  EXPECT_NE(error_of(R"(,"response_format":{"type":"structural_tag","format":{"type":"any_text"}})").find("'format'"),
            std::string::npos);
  EXPECT_NE(error_of(R"(,"structural_tag":{"structures":[{"begin":"x","schema":{}}],"triggers":["<"]})").find("none of its triggers"),
            std::string::npos);
  EXPECT_NE(error_of(R"(,"structured_outputs":{"whitespace_pattern":" *"})").find("whitespace_pattern"), std::string::npos);
  // structured_outputs' options apply to the JSON, whichever field asks for it.
  for (const char* fields : {R"(,"structured_outputs":{"json":{"type":"object"},"disable_any_whitespace":true})",
                                    R"(,"guided_json":{"type":"object"},"structured_outputs":{"disable_any_whitespace":true})",
                                    R"(,"response_format":{"type":"json_object"},"structured_outputs":{"disable_any_whitespace":true})"}) {
    auto g = grammar_of(fields);
    ASSERT_TRUE(g) << fields;
    EXPECT_TRUE(matches(g, R"({"a": [1, 2]})")) << fields;
    EXPECT_FALSE(matches(g, R"({"a":[1,2]})")) << fields;
    EXPECT_FALSE(matches(g, R"({ "a": [1, 2]})")) << fields;
  }
  auto closed = grammar_of(R"(,"structured_outputs":{"json":{"type":"object"},"disable_additional_properties":true})");
  ASSERT_TRUE(closed);
  EXPECT_TRUE(matches(closed, "{}"));
  EXPECT_FALSE(matches(closed, R"({"a": 1})"));
  EXPECT_TRUE(matches(grammar_of(R"(,"structured_outputs":{"json":{"type":"object"},"disable_any_whitespace":false})"),
                      R"({ "a" : 1 })"));
  EXPECT_NE(error_of(R"(,"structured_outputs":{"json":{},"disable_any_whitespace":"yes"})").find("must be a boolean"),
            std::string::npos);
  EXPECT_NE(error_of(R"(,"guided_choice":["a"],"guided_json":{})").find("one structured output"), std::string::npos);
  EXPECT_NE(error_of(R"(,"guided_choice":"a")").find("array of strings"), std::string::npos);

  // tool_choice: the named function's arguments, or an array of calls.
  const std::string tools =
      R"(,"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"x":{"type":"integer"}},"required":["x"]}}},)"
      R"({"type":"function","function":{"name":"g"}}])";
  auto named = grammar_of(tools + R"(,"tool_choice":{"type":"function","function":{"name":"f"}})");
  ASSERT_TRUE(named);
  EXPECT_TRUE(matches(named, R"({"x": 3})"));
  EXPECT_FALSE(matches(named, R"({})"));
  auto required = grammar_of(tools + R"(,"tool_choice":"required")");
  ASSERT_TRUE(required);
  EXPECT_TRUE(matches(required, R"([{"name": "g", "parameters": {}}, {"name": "f", "parameters": {"x": 1}}])"));
  EXPECT_FALSE(matches(required, R"([])"));
  EXPECT_FALSE(matches(required, R"([{"name": "h", "parameters": {}}])"));
  EXPECT_FALSE(grammar_of(tools + R"(,"tool_choice":"auto")"));
  EXPECT_NE(error_of(tools + R"(,"tool_choice":{"type":"function","function":{"name":"h"}})").find("'h'"),
            std::string::npos);
  EXPECT_NE(error_of(R"(,"tool_choice":"required")").find("needs 'tools'"), std::string::npos);

  disagg::DecodeRequest r;
  r.spec.request_id = "r1";
  r.spec.prompt = {5, 6, 7};
  r.spec.sampling.seed = 3;
  r.spec.grammar = grammar_of(R"(,"guided_json":)" + schema);
  r.spec.grammar_after_token = 42;
  r.writer_url = "http://127.0.0.1:1";
  r.writer_endpoint = "127.0.0.1:2";
  auto back = disagg::parse_decode_request(disagg::to_json(r).dump());
  ASSERT_TRUE(back.has_value()) << back.status().to_string();
  ASSERT_TRUE(back->spec.grammar);
  EXPECT_TRUE(matches(back->spec.grammar, R"({"z": 1, "a": true})"));  // z first, as sent
  EXPECT_EQ(back->spec.grammar_after_token, 42);
  EXPECT_EQ(disagg::to_engine_request(back->spec).grammar, back->spec.grammar);
  r.spec.grammar = grammar_of(R"(,"guided_regex":"[a-c]{2}\\.")");  // a regex travels as its pattern
  auto regex_back = disagg::parse_decode_request(disagg::to_json(r).dump());
  ASSERT_TRUE(regex_back.has_value()) << regex_back.status().to_string();
  EXPECT_TRUE(matches(regex_back->spec.grammar, "ab."));
  EXPECT_FALSE(matches(regex_back->spec.grammar, "ab"));
  r.spec.grammar = grammar_of(R"(,"guided_grammar":"root ::= (\"ab\")+ \".\"")");  // a grammar as its text
  auto ebnf_back = disagg::parse_decode_request(disagg::to_json(r).dump());
  ASSERT_TRUE(ebnf_back.has_value()) << ebnf_back.status().to_string();
  EXPECT_TRUE(matches(ebnf_back->spec.grammar, "abab."));
  EXPECT_FALSE(matches(ebnf_back->spec.grammar, "aba."));
  nlohmann::json bad = disagg::to_json(r);
  bad["grammar"] = R"({"type":"regex"})";  // no pattern
  auto refused = disagg::parse_decode_request(bad.dump());
  ASSERT_FALSE(refused.has_value());
  EXPECT_NE(refused.status().message().find("grammar"), std::string::npos);
}

// The MTP state of a commit is the target's f32 hidden state: it must arrive
// bit for bit (the decode side drafts from it), and only finite numbers pass.
TEST(DisaggProtocol, CommitCarriesTheHiddenStateExactly) {
  disagg::CommitRequest c{7, 5, 42, {0.1f, -std::numeric_limits<float>::max(), 1e-45f, 1.17549435e-38f, 123456.789f, -0.0f}};
  auto back = disagg::parse_commit_request(disagg::to_json(c).dump());
  ASSERT_TRUE(back.has_value()) << back.status().to_string();
  ASSERT_EQ(back->last_hidden.size(), c.last_hidden.size());
  for (size_t i = 0; i < c.last_hidden.size(); ++i) {
    EXPECT_EQ(back->last_hidden[i], c.last_hidden[i]) << i;
    EXPECT_EQ(std::signbit(back->last_hidden[i]), std::signbit(c.last_hidden[i])) << i;
  }
  c.last_hidden.clear();
  EXPECT_FALSE(disagg::to_json(c).contains("last_hidden"));
  back = disagg::parse_commit_request(disagg::to_json(c).dump());
  ASSERT_TRUE(back.has_value());
  EXPECT_TRUE(back->last_hidden.empty());
  for (const char* bad : {R"({"reservation":1,"expected_batches":2,"first_token":3,"last_hidden":[1,"x"]})",
                          R"({"reservation":1,"expected_batches":2,"first_token":3,"last_hidden":[1e300]})",
                          R"({"reservation":1,"expected_batches":2,"first_token":3,"last_hidden":{"a":1}})"}) {
    auto r = disagg::parse_commit_request(bad);
    ASSERT_FALSE(r.has_value()) << bad;
    EXPECT_NE(r.status().message().find("last_hidden"), std::string::npos) << r.status().to_string();
  }
}

// A target with the MTP layer lists its regions after the model's layers.
TEST(DisaggProtocol, AbortCarriesAStopStringsStop) {
  for (bool stop : {false, true}) {
    disagg::AbortRequest a{7, "127.0.0.1:2", "a stop string", stop};
    auto back = disagg::parse_abort_request(disagg::to_json(a).dump());
    ASSERT_TRUE(back.has_value()) << back.status().to_string();
    EXPECT_EQ(back->reservation, 7u);
    EXPECT_EQ(back->reason, "a stop string");
    EXPECT_EQ(back->stop, stop);
  }
  EXPECT_FALSE(disagg::parse_abort_request(R"({"reservation": 7, "stop": "yes"})").has_value());
}

TEST(DisaggProtocol, TargetCountsTheMtpLayersRegions) {
  disagg::KvTarget t;
  t.decode_url = "http://127.0.0.1:1";
  t.reservation = 9;
  t.pages = {3, 4};
  t.layout = {2, 1, 8, 4, DType::kF32, 1};
  transfer::RegionDescriptor d;
  d.endpoint = "127.0.0.1:2";
  d.length_bytes = 64;
  t.k_regions = t.v_regions = {d, d};
  EXPECT_FALSE(disagg::parse_kv_target(disagg::to_json(t)).has_value()) << "2 layers + the MTP layer need 3 regions";
  t.k_regions = t.v_regions = {d, d, d};
  auto back = disagg::parse_kv_target(disagg::to_json(t));
  ASSERT_TRUE(back.has_value()) << back.status().to_string();
  EXPECT_EQ(back->layout.num_mtp_layers, 1);
  EXPECT_EQ(back->k_regions.size(), 3u);
  nlohmann::json j = disagg::to_json(t);
  j["num_mtp_layers"] = 2;
  EXPECT_FALSE(disagg::parse_kv_target(j).has_value());
  j.erase("num_mtp_layers");  // an instance without speculation
  j["k_regions"].erase(2), j["v_regions"].erase(2);
  back = disagg::parse_kv_target(j);
  ASSERT_TRUE(back.has_value()) << back.status().to_string();
  EXPECT_EQ(back->layout.num_mtp_layers, 0);
}

TEST(DisaggProtocol, TokenEventsCarryTheDraftCounts) {
  disagg::TokenEvent e{5, {}, engine::FinishReason::kNone, {}, 12, 7};
  auto back = disagg::parse_token_event(disagg::to_json(e));
  ASSERT_TRUE(back.has_value()) << back.status().to_string();
  EXPECT_EQ(back->num_draft_tokens, 12);
  EXPECT_EQ(back->num_accepted_draft_tokens, 7);
  EXPECT_FALSE(disagg::to_json(disagg::TokenEvent{5}).contains("draft_tokens"));
  nlohmann::json j = disagg::to_json(e);
  j["accepted_tokens"] = 13;  // more accepted than drafted
  EXPECT_FALSE(disagg::parse_token_event(j).has_value());
}

// The roles register each KV pool where it lives: host pools go to TCP; a
// pool marked as device memory (the CUDA runner's) only to CUDA IPC, never to
// a transport that would read it with the CPU. Here the "device" pool is host
// memory: refused whether or not the machine has a GPU (no CUDA IPC transport
// without one; not cudaMalloc'ed memory with one), with a message saying why.
TEST(DisaggProtocol, KvPoolsRegisterWhereTheyLive) {
  auto transfer = transfer::TransferEngine::create({});
  ASSERT_TRUE(transfer.has_value()) << transfer.status().to_string();
  std::vector<float> memory(2 * 4 * 8);
  const TensorView host(memory.data(), DType::kF32, {2, 1, 4, 8});
  auto id = disagg::register_kv_pool(**transfer, host);
  ASSERT_TRUE(id.has_value()) << id.status().to_string();
  auto desc = (*transfer)->describe(*id);
  ASSERT_TRUE(desc.has_value());
  EXPECT_EQ(desc->transport, transfer::TransportKind::kTcp);
  EXPECT_EQ(desc->memory, transfer::MemoryKind::kHost);
  const TensorView device(memory.data(), DType::kF32, {2, 1, 4, 8}, Device::cuda(0));
  auto refused = disagg::register_kv_pool(**transfer, device);
  ASSERT_FALSE(refused.has_value());
  EXPECT_NE(refused.status().message().find("only the CUDA IPC transport sends"), std::string::npos)
      << refused.status().to_string();
}

}  // namespace
}  // namespace moe::server
