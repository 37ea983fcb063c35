// OpenAI's Responses API (POST /v1/responses), served through the chat path:
// the request becomes a chat-completions body (responses_to_chat: instructions
// and input items as messages, tools, text.format as response_format), which
// OpenAiApi serves as any chat request; a ResponsesExchange between it and the
// client turns what the chat path writes -- one chat.completion, or its
// chunks -- into a Response object or the Responses event stream
// (response.created ... response.output_text.delta ... response.completed).
//
// Not stored: `store`, `previous_response_id`, `background` and the like are
// 400s at any value but their neutral one, as docs/server.md lists.
//
// Threads: responses_to_chat anywhere; a ResponsesExchange is called by one
// writer at a time (the CompletionRun behind it holds its mutex when it writes).
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <variant>

#include "server/http_server.h"
#include "server/openai_protocol.h"

namespace moe::server {

// The chat-completions body that serves a Responses request `body`, or the
// 400 naming what is not served.
std::variant<nlohmann::ordered_json, ApiError> responses_to_chat(const std::string& body);

// What the client sees of the chat path's answer: `shell` holds the Response
// object's request-side fields (responses_shell), `id` its "resp_..." id.
std::shared_ptr<HttpExchange> make_responses_exchange(std::shared_ptr<HttpExchange> client,
                                                      nlohmann::ordered_json shell, std::string id);

// The Response fields that echo the request (instructions, tools, text,
// max_output_tokens, ...), for make_responses_exchange. `body` must have
// passed responses_to_chat.
nlohmann::ordered_json responses_shell(const std::string& body);

}  // namespace moe::server
