// One /v1/completions or /v1/chat/completions request in flight: its n engine
// requests (choices), their incremental detokenization, stop strings, the
// qwen3 reasoning split, and the response (one JSON body, or SSE chunks).
//
// Threads: start() on an I/O thread; on_output() on the backend's thread;
// cancel() from any thread. All state is guarded by one mutex.
#pragma once

#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "server/generation_backend.h"
#include "server/http_server.h"
#include "server/openai_protocol.h"
#include "server/tool_calls.h"
#include "tokenizer/detokenizer.h"
#include "tokenizer/tokenizer.h"

namespace moe::server {

// Splits Qwen3 output into reasoning ("<think>...</think>") and content, fed
// piece by piece; holds back text that may be the start of a tag. Qwen3's
// first templates leave <think> to the model; Qwen3-*-Thinking-2507's and
// Qwen3.5's end the prompt with it, so the output opens inside the reasoning
// and only closes it (`in_reasoning`). Reasoning that never closes (cut by
// max_tokens) is all reasoning. With `tool_calls` (the request's tools are
// parsed), a <tool_call> inside the reasoning ends it too: the call goes to
// the content, where the tool-call parser finds it (Qwen3.5 sometimes calls
// before </think>; vLLM's parser does the same).
class ReasoningSplitter {
 public:
  explicit ReasoningSplitter(bool in_reasoning = false, bool tool_calls = false)
      : mode_(in_reasoning ? Mode::kReasoning : Mode::kStart), tool_calls_(tool_calls) {}
  // Appends `text`; returns the (reasoning, content) text that is now final.
  std::pair<std::string, std::string> feed(const std::string& text);
  std::pair<std::string, std::string> finish();

 private:
  enum class Mode { kStart, kReasoning, kContent };
  Mode mode_ = Mode::kStart;
  bool tool_calls_ = false;
  std::string pending_;
};

// One prompt of a run (a completions batch has several; chat has one).
struct RunPrompt {
  std::vector<int32_t> ids;
  // With echo: prepended to each of its choices' text (completions: the
  // prompt; chat: the final message's content, vLLM's chat echo).
  std::string echo_text;
  int max_tokens = 0;     // each of its choices' budget
  bool opens_reasoning = false;  // chat: the prompt ends with <think> (the output starts as reasoning)
  int32_t grammar_after_token = -1;  // a structured output's grammar applies after it (EngineRequest)
};

struct RunConfig {
  bool chat = false;
  std::string id;     // "chatcmpl-..." / "cmpl-..."
  std::string model;
  int64_t created = 0;
  GenerationParams params;
  std::vector<RunPrompt> prompts;  // choice k is choice k % n of prompt k / n
  bool reasoning_qwen3 = false;
  // Chat: the response message's role (vLLM's: the final message's when the
  // prompt adds no generation prompt).
  std::string chat_role = "assistant";
  // Completions with echo and logprobs: the prompt's tokens lead the logprobs
  // (the first with a null logprob), as OpenAI's legacy API and vLLM.
  bool echo_logprobs = false;
  // Chat with tools and a --tool-call-parser: tool_calls out of the content.
  bool parse_tool_calls = false;
  ToolCallFormat tool_call_format = ToolCallFormat::kHermes;
  nlohmann::ordered_json tools;  // the request's, for argument types
  // tool_choice "required" or "function" (forced_tool): the content, which a
  // grammar made that function's arguments or an array of {"name",
  // "parameters"} calls, comes back as tool_calls (streamed: at the end).
  std::string forced_tools;
  std::string forced_tool;
  const tokenizer::Tokenizer* tokenizer = nullptr;
  HeaderList headers;  // added to the response (X-Request-Id)
  std::string request_id;  // propagated to the backend
};

class CompletionRun : public std::enable_shared_from_this<CompletionRun> {
 public:
  CompletionRun(RunConfig config, std::shared_ptr<HttpExchange> exchange, GenerationBackend& engine);

  // Submits one engine request per choice: `base` with the choice's prompt and
  // budget, and seed + i for choice i of its prompt (so a batch gives what its
  // prompts give alone). On failure nothing stays queued and the error is
  // returned for the caller to send.
  std::optional<ApiError> start(const engine::EngineRequest& base);
  // Cancels every choice still running (the client went away).
  void cancel();

 private:
  struct Choice {
    size_t prompt = 0;  // into config_.prompts
    uint64_t engine_id = 0;
    std::optional<tokenizer::IncrementalDetokenizer> detokenizer;
    std::string text;          // detokenized so far (cut at a stop string)
    size_t emitted = 0;        // bytes of text already streamed
    size_t stop_checked = 0;   // stop strings searched up to here
    std::vector<int32_t> token_ids;
    std::vector<engine::TokenLogprobs> logprobs;
    std::vector<engine::TokenLogprobs> prompt_logprobs;  // echo_logprobs: prompt tokens 1 .. n-1
    size_t logprobs_emitted = 0;
    std::vector<size_t> token_offsets;  // per token: characters of text before it (text_offset)
    size_t text_chars = 0;              // characters (code points) the tokens have added to text
    size_t tokens_emitted = 0;
    std::string finish_reason;
    bool done = false;
    bool sent_role = false;  // chat: the role; completions: the echo
    int num_cached_tokens = 0;
    int num_draft_tokens = 0, num_accepted_draft_tokens = 0;  // speculative decoding
    ReasoningSplitter splitter;
    std::string reasoning, content;  // non-streaming chat with the reasoning parser
    ToolCallParser tool_parser;      // streaming chat with parse_tool_calls
    size_t num_tool_calls = 0;       // sent so far
    std::string forced_text;         // streaming chat with forced_tools: the content so far
  };
  // One call of choice `index` as OpenAI writes it (streamed: with its index);
  // its id is "call_" and 24 hex digits: the run's random salt, the choice, k.
  nlohmann::json tool_call_json(size_t index, size_t k, const ToolCall& call, bool streamed) const;
  // forced_tools: the calls `content` holds (none when it does not parse: it stays content).
  std::vector<ToolCall> forced_calls(const std::string& content) const;
  // "tool_calls" where the model stopped after calling tools.
  static std::string finish_reason(const Choice& c) {
    return c.num_tool_calls > 0 && c.finish_reason == "stop" ? "tool_calls" : c.finish_reason;
  }
  void on_output(size_t index, const engine::EngineOutput& out);
  void add_token(Choice& c, const engine::EngineOutput& out);
  bool find_stop(Choice& c);
  size_t stop_holdback(const Choice& c) const;
  void stream_choice(size_t index, bool final_chunk);
  void fail(const Status& status);
  void complete();
  nlohmann::json usage() const;
  nlohmann::json chunk_head() const;
  // Logprobs from token `from` on; with_prompt (and echo_logprobs): the
  // echoed prompt's first. text_offset counts characters (code points, as
  // OpenAI and vLLM) into the choice's text, the echoed prompt included.
  nlohmann::json logprobs_json(const Choice& c, size_t from, bool with_prompt = false) const;
  nlohmann::json prompt_logprobs_json(const Choice& c) const;  // vLLM's prompt_logprobs
  std::string token_text(int32_t id) const;

  RunConfig config_;
  std::shared_ptr<HttpExchange> exchange_;
  GenerationBackend& engine_;
  std::mutex mutex_;
  std::vector<Choice> choices_;
  size_t num_done_ = 0;
  bool failed_ = false;   // an error was sent: ignore further outputs
  bool started_ = false;  // submission finished
  size_t max_stop_len_ = 0;
  uint64_t call_id_salt_ = 0;  // random per run: tool-call ids are unique across requests
};

}  // namespace moe::server
