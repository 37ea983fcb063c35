// The OpenAI-compatible HTTP API over a generation backend (the colocated
// engine, or the disaggregated router): /v1/completions,
// /v1/chat/completions (streaming and not), /v1/models, /tokenize,
// /detokenize, /health, /metrics.
//
// The router's work happens here (DESIGN section 2): validation, the chat
// template, tokenization, incremental detokenization, stop strings, the qwen3
// reasoning split, SSE framing. A client that disconnects has its engine
// requests cancelled. Every accepted request ends with a response or an
// explicit error (an error event once a stream has started).
//
// Threads: handle() runs on HTTP I/O threads, concurrently; per-request state
// is then driven by the engine's output callbacks (engine thread) under the
// request's own mutex.
#pragma once

#include <atomic>
#include <memory>
#include <optional>
#include <string>

#include "engine/engine.h"
#include "server/completion_run.h"
#include "server/generation_backend.h"
#include "server/http_server.h"
#include "server/openai_protocol.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace moe::server {

struct ApiOptions {
  std::string model_name = "moeserve";
  std::string api_key;  // empty: no authentication
  RequestLimits limits;
  bool reasoning_parser_qwen3 = false;
  std::optional<ToolCallFormat> tool_call_parser;  // tool_calls out of chat content (server/tool_calls.h)
  double request_timeout_s = 600;  // engine deadline of each request; 0: none
  std::string chat_template;       // --chat-template: replaces the tokenizer's (Jinja text)
};

class OpenAiApi {
 public:
  // `tokenizer` may be null (a model without one): then only token-id prompts work.
  OpenAiApi(GenerationBackend& engine, const tokenizer::Tokenizer* tokenizer, ApiOptions options);

  void handle(HttpRequest request, std::shared_ptr<HttpExchange> exchange);

  const ApiOptions& options() const { return options_; }

 private:
  void handle_completion(const HttpRequest& request, const std::shared_ptr<HttpExchange>& exchange, bool chat,
                         const std::string& request_id);
  std::optional<ApiError> prepare_chat(const ChatRequest& chat, RunPrompt& out) const;
  static std::string chat_role(const ChatRequest& chat);
  std::optional<ApiError> tokenize_bad_words(const GenerationParams& params,
                                             std::vector<std::vector<int32_t>>& out) const;
  std::optional<ApiError> prepare_completion(const PromptInput& prompt, bool echo, bool skip_special,
                                             RunPrompt& out) const;
  HttpResponse handle_tokenize(const HttpRequest& request) const;
  HttpResponse handle_detokenize(const HttpRequest& request) const;
  nlohmann::json model_json() const;  // the served model, as /v1/models lists it
  HttpResponse handle_models() const;
  bool authorized(const HttpRequest& request) const;

  GenerationBackend& engine_;
  const tokenizer::Tokenizer* tokenizer_;
  std::optional<tokenizer::ChatTemplate> chat_template_;
  std::string chat_template_error_;
  ApiOptions options_;
  std::atomic<uint64_t> next_request_{1};
  int64_t created_s_;
};

}  // namespace moe::server
