// OpenAI API request parsing and validation: JSON bodies of /v1/completions and
// /v1/chat/completions into plain structs, with errors that name the parameter
// (ApiError, answered as {"error": {message, type, param, code}}). Unknown
// fields are ignored, as OpenAI and vLLM do.
//
// Pure functions: any thread.
#pragma once

#include <limits>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/sampler.h"
#include "structured/grammar.h"
#include "server/http_server.h"

namespace moe::server {

struct ApiError {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;
  std::string code;
  HeaderList headers;
  HttpResponse to_response() const { return {status, "application/json", error_json(message, type, param, code), headers}; }
};

inline ApiError bad_request(std::string message, std::string param = {}, std::string code = {}) {
  return ApiError{400, std::move(message), "invalid_request_error", std::move(param), std::move(code), {}};
}

struct RequestLimits {
  int max_n = 16;
  int max_choices = 256;  // prompts x n in one completions batch (or max_n, if larger)
  int max_logprobs = 20;
  int max_stop_strings = 16;
  int max_logit_bias = 1024;  // tokens in one request's logit_bias
  // vLLM's bad_words: the words, and (after tokenization, up to two token
  // sequences a word) the sequences and their tokens together, as vLLM's.
  int max_bad_words = 128;
  int max_bad_words_tokens = 1024;
  int max_model_len = 4096;
  // The engine queues at most this many requests (--max-waiting): one with more
  // choices (prompts x n) could never be admitted, so it is a 400, not a 503.
  int max_waiting = std::numeric_limits<int>::max();
  // Sampling defaults for fields a request leaves out (the model's
  // generation_config.json, as vLLM's --generation-config auto).
  engine::SamplingParams default_sampling;
};

// Sampling and output options shared by both endpoints.
struct GenerationParams {
  std::optional<int> max_tokens;  // max_completion_tokens, else max_tokens
  engine::SamplingParams sampling;
  std::vector<std::string> stop;
  std::vector<int32_t> stop_token_ids;
  // vLLM's bad_words, as text: the server tokenizes them into sampling.bad_words.
  std::vector<std::string> bad_words;
  int n = 1;
  int logprobs = -1;  // -1: none; else the number of top alternatives
  int prompt_logprobs = -1;  // vLLM's extension: -1 none; else each prompt token's logprob and top k
  bool ignore_eos = false;
  bool include_stop_str_in_output = false;    // vLLM's: the stop string stays at the end of the text
  std::optional<int> truncate_prompt_tokens;  // vLLM's: only the prompt's last k tokens are used
  bool skip_special_tokens = true;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  bool return_token_ids = false;  // vLLM's extension: token ids in each choice
  std::shared_ptr<const structured::Grammar> grammar;  // structured output (response_format, guided_*); null: none
  std::optional<std::string> model;
};

// One prompt of /v1/completions: text, or token ids.
struct PromptInput {
  std::optional<std::string> text;
  std::vector<int32_t> ids;  // when the prompt is an array of ids
};

struct CompletionRequest {
  GenerationParams params;
  // One prompt, or a batch (an array of strings or of token-id arrays):
  // choice prompt * n + i is choice i of that prompt, as OpenAI orders them.
  std::vector<PromptInput> prompts;
  bool echo = false;
};

struct ChatRequest {
  GenerationParams params;
  nlohmann::ordered_json messages;  // validated: [{role, content as a string}]
  nlohmann::ordered_json tools;     // null when absent
  std::string tool_choice = "auto";  // "none", "required", or "function" (forced_tool names it)
  std::string forced_tool;
  nlohmann::ordered_json chat_template_kwargs = nlohmann::ordered_json::object();
  bool add_generation_prompt = true;
  // vLLM's: the prompt ends inside the final message (its text continued,
  // no end-of-turn after it); needs add_generation_prompt false.
  bool continue_final_message = false;
  // vLLM's chat echo: the final message's content leads each choice's content
  // when it has the response's role (add_generation_prompt false).
  bool echo = false;
};

// Parses `body`; invalid JSON, wrong types and out-of-range values give a 400.
std::variant<CompletionRequest, ApiError> parse_completion_request(const std::string& body, const RequestLimits& limits);
std::variant<ChatRequest, ApiError> parse_chat_request(const std::string& body, const RequestLimits& limits);

// OpenAI's wording for a prompt + completion over the context.
ApiError context_length_error(int max_model_len, int64_t prompt_tokens, int64_t max_tokens, const std::string& param);

}  // namespace moe::server
