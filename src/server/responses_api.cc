#include "server/responses_api.h"

#include <fmt/format.h>

#include <optional>
#include <set>
#include <string_view>
#include <utility>
#include <vector>

namespace moe::server {

using Json = nlohmann::ordered_json;

namespace {

std::optional<Json> parse_object(const std::string& body) {
  Json j = Json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return std::nullopt;
  return j;
}

// j[key] when j is an object holding a string there, else `fallback`.
std::string string_field(const Json& j, const char* key, const std::string& fallback = {}) {
  if (!j.is_object()) return fallback;
  auto it = j.find(key);
  return it != j.end() && it->is_string() ? it->get<std::string>() : fallback;
}

bool is_null_or(const Json& j, const char* key, const Json& neutral) {
  auto it = j.find(key);
  return it == j.end() || it->is_null() || *it == neutral;
}

// The text of a message's content: a string, or parts of text (input_text,
// output_text, text) joined.
std::variant<std::string, ApiError> content_text(const Json& content) {
  if (content.is_string()) return content.get<std::string>();
  if (content.is_null()) return std::string();
  if (!content.is_array())
    return bad_request("'input': a message's content must be a string or an array of text parts", "input");
  std::string text;
  for (const Json& part : content) {
    const std::string type = string_field(part, "type");
    if ((type != "input_text" && type != "output_text" && type != "text") || !part.contains("text") ||
        !part["text"].is_string())
      return bad_request(fmt::format("'input': only text content parts are served (got '{}')", type),
                         "input");
    text += part["text"].get<std::string>();
  }
  return text;
}

// Input items as chat messages: messages (developer as system), function
// calls (an assistant message's tool_calls, consecutive calls in one) and
// their outputs (tool messages). Reasoning items are left out, as the chat
// templates drop earlier turns' reasoning.
std::optional<ApiError> add_input_items(const Json& input, Json& messages) {
  for (const Json& item : input) {
    if (!item.is_object()) return bad_request("'input' items must be objects", "input");
    const std::string type = item.contains("type")   ? string_field(item, "type")
                             : item.contains("role") ? "message"
                                                     : "";
    if (type == "message") {
      const std::string role =
          item.contains("role") && item["role"].is_string() ? item["role"].get<std::string>() : "";
      if (role != "user" && role != "assistant" && role != "system" && role != "developer")
        return bad_request(
            fmt::format("'input': a message's role must be user, assistant, system or developer, "
                        "got '{}'",
                        role),
            "input");
      auto text = content_text(item.contains("content") ? item["content"] : Json());
      if (auto* e = std::get_if<ApiError>(&text)) return *e;
      messages.push_back(
          {{"role", role == "developer" ? "system" : role}, {"content", std::get<std::string>(text)}});
    } else if (type == "function_call") {
      for (const char* key : {"call_id", "name", "arguments"})
        if (!item.contains(key) || !item[key].is_string())
          return bad_request(fmt::format("'input': a function_call needs a string '{}'", key), "input");
      Json call = {{"id", item["call_id"]},
                   {"type", "function"},
                   {"function", {{"name", item["name"]}, {"arguments", item["arguments"]}}}};
      const bool extends = !messages.empty() && messages.back()["role"] == "assistant" &&
                           messages.back().contains("tool_calls");
      if (!extends)
        messages.push_back({{"role", "assistant"}, {"content", ""}, {"tool_calls", Json::array()}});
      messages.back()["tool_calls"].push_back(std::move(call));
    } else if (type == "function_call_output") {
      if (!item.contains("call_id") || !item["call_id"].is_string())
        return bad_request("'input': a function_call_output needs a string 'call_id'", "input");
      auto text = content_text(item.contains("output") ? item["output"] : Json());
      if (auto* e = std::get_if<ApiError>(&text)) return *e;
      messages.push_back(
          {{"role", "tool"}, {"tool_call_id", item["call_id"]}, {"content", std::get<std::string>(text)}});
    } else if (type != "reasoning") {
      return bad_request(fmt::format("'input': items of type '{}' are not served (messages, function_call, "
                                     "function_call_output and reasoning are)",
                                     type),
                         "input");
    }
  }
  return std::nullopt;
}

// Function tools as chat tools; tool_choice in the chat spelling.
std::optional<ApiError> add_tools(const Json& request, Json& chat) {
  if (auto it = request.find("tools"); it != request.end() && !it->is_null()) {
    if (!it->is_array()) return bad_request("'tools' must be an array", "tools");
    Json tools = Json::array();
    for (const Json& tool : *it) {
      if (!tool.is_object() || string_field(tool, "type") != "function" || !tool.contains("name") ||
          !tool["name"].is_string())
        return bad_request(
            "'tools': only {\"type\": \"function\", \"name\", \"parameters\"} tools are served", "tools");
      Json function = {{"name", tool["name"]}};
      for (const char* key : {"description", "parameters", "strict"})
        if (tool.contains(key) && !tool[key].is_null()) function[key] = tool[key];
      tools.push_back({{"type", "function"}, {"function", std::move(function)}});
    }
    if (!tools.empty()) chat["tools"] = std::move(tools);
  }
  if (auto it = request.find("tool_choice"); it != request.end() && !it->is_null()) {
    if (it->is_string()) {
      chat["tool_choice"] = *it;
    } else if (it->is_object() && string_field(*it, "type") == "function" && it->contains("name") &&
               (*it)["name"].is_string()) {
      chat["tool_choice"] = {{"type", "function"}, {"function", {{"name", (*it)["name"]}}}};
    } else {
      return bad_request(
          "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"name\"}",
          "tool_choice");
    }
  }
  return std::nullopt;
}

// text.format as response_format.
std::optional<ApiError> add_text_format(const Json& request, Json& chat) {
  auto it = request.find("text");
  if (it == request.end() || it->is_null()) return std::nullopt;
  if (!it->is_object()) return bad_request("'text' must be an object", "text");
  if (!is_null_or(*it, "verbosity", "medium"))
    return bad_request("'text.verbosity' is not supported by this server (send \"medium\" or leave it out)",
                       "text");
  auto format = it->find("format");
  if (format == it->end() || format->is_null()) return std::nullopt;
  const std::string type = string_field(*format, "type");
  if (type == "text") return std::nullopt;
  if (type == "json_object") {
    chat["response_format"] = {{"type", "json_object"}};
  } else if (type == "json_schema") {
    if (format->contains("name") && !(*format)["name"].is_string())
      return bad_request("'text.format.name' must be a string", "text");
    Json schema = {{"name", string_field(*format, "name", "response")}};
    for (const char* key : {"schema", "strict", "description"})
      if (format->contains(key)) schema[key] = (*format)[key];
    chat["response_format"] = {{"type", "json_schema"}, {"json_schema", std::move(schema)}};
  } else {
    return bad_request(
        "'text.format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": "
        "\"json_schema\", \"name\", \"schema\"}",
        "text");
  }
  return std::nullopt;
}

// Fields this server cannot serve at other than their neutral value: a 400
// naming them (no response is stored, nothing runs in the background).
std::optional<ApiError> reject_unserved(const Json& request) {
  const std::pair<const char*, Json> neutral[] = {{"previous_response_id", Json()},
                                                  {"conversation", Json()},
                                                  {"store", false},
                                                  {"background", false},
                                                  {"truncation", "disabled"},
                                                  {"prompt", Json()},
                                                  {"max_tool_calls", Json()},
                                                  {"top_logprobs", 0}};
  for (const auto& [key, value] : neutral)
    if (!is_null_or(request, key, value))
      return bad_request(fmt::format("'{}' is not supported by this server (send {} or leave it out)", key,
                                     value.is_null() ? "null" : value.dump()),
                         key);
  if (auto it = request.find("parallel_tool_calls");
      it != request.end() && !it->is_null() && !it->is_boolean())
    return bad_request("'parallel_tool_calls' must be a boolean", "parallel_tool_calls");
  if (auto it = request.find("include");
      it != request.end() && !it->is_null() && !(it->is_array() && it->empty()))
    return bad_request("'include' is not supported by this server (send [] or leave it out)", "include");
  if (auto it = request.find("reasoning"); it != request.end() && !it->is_null()) {
    if (!it->is_object()) return bad_request("'reasoning' must be an object", "reasoning");
    if (!is_null_or(*it, "effort", Json()) || !is_null_or(*it, "summary", Json()))
      return bad_request(
          "'reasoning.effort' and 'reasoning.summary' are not supported by this server (Qwen3's "
          "reasoning is switched by chat_template_kwargs.enable_thinking)",
          "reasoning");
  }
  return std::nullopt;
}

// Chat fields that a Responses request may carry as they are (vLLM's
// sampling extensions among them).
const std::set<std::string> kChatFields = {"model",
                                           "temperature",
                                           "top_p",
                                           "top_k",
                                           "min_p",
                                           "seed",
                                           "stop",
                                           "stop_token_ids",
                                           "presence_penalty",
                                           "frequency_penalty",
                                           "repetition_penalty",
                                           "min_tokens",
                                           "logit_bias",
                                           "bad_words",
                                           "allowed_token_ids",
                                           "ignore_eos",
                                           "skip_special_tokens",
                                           "include_stop_str_in_output",
                                           "chat_template_kwargs",
                                           "structured_outputs",
                                           "guided_json",
                                           "guided_regex",
                                           "guided_choice",
                                           "guided_grammar",
                                           "structural_tag",
                                           "return_token_ids"};

}  // namespace

std::variant<Json, ApiError> responses_to_chat(const std::string& body) {
  auto request = parse_object(body);
  if (!request) return bad_request("the request body must be a JSON object");
  const Json& r = *request;
  if (auto e = reject_unserved(r)) return *e;
  Json chat = Json::object();
  for (const auto& [key, value] : r.items())
    if (kChatFields.contains(key)) chat[key] = value;
  Json messages = Json::array();
  if (auto it = r.find("instructions"); it != r.end() && !it->is_null()) {
    if (!it->is_string()) return bad_request("'instructions' must be a string", "instructions");
    messages.push_back({{"role", "system"}, {"content", *it}});
  }
  auto input = r.find("input");
  if (input == r.end() || !(input->is_string() || input->is_array()))
    return bad_request("'input' (a string or an array of items) is required", "input");
  if (input->is_string()) {
    messages.push_back({{"role", "user"}, {"content", *input}});
  } else {
    if (auto e = add_input_items(*input, messages)) return *e;
  }
  if (messages.empty()) return bad_request("'input' holds no message", "input");
  chat["messages"] = std::move(messages);
  if (auto it = r.find("max_output_tokens"); it != r.end() && !it->is_null())
    chat["max_completion_tokens"] = *it;
  if (auto e = add_tools(r, chat)) return *e;
  if (auto e = add_text_format(r, chat)) return *e;
  if (auto it = r.find("stream"); it != r.end() && !it->is_null()) {
    chat["stream"] = *it;
    if (it->is_boolean() && it->get<bool>()) chat["stream_options"] = {{"include_usage", true}};
  }
  return chat;
}

Json responses_shell(const std::string& body) {
  const Json r = parse_object(body).value_or(Json::object());
  auto field = [&](const char* key, Json fallback) {
    auto it = r.find(key);
    return it == r.end() || it->is_null() ? fallback : *it;
  };
  return {{"instructions", field("instructions", nullptr)},
          {"max_output_tokens", field("max_output_tokens", nullptr)},
          {"metadata", field("metadata", Json::object())},
          {"parallel_tool_calls", field("parallel_tool_calls", true)},
          {"previous_response_id", nullptr},
          {"reasoning", {{"effort", nullptr}, {"summary", nullptr}}},
          {"store", false},
          {"temperature", field("temperature", nullptr)},
          {"text", field("text", Json{{"format", {{"type", "text"}}}})},
          {"tool_choice", field("tool_choice", "auto")},
          {"tools", field("tools", Json::array())},
          {"top_p", field("top_p", nullptr)},
          {"truncation", "disabled"},
          {"user", field("user", nullptr)}};
}

namespace {

// An error body naming a chat field names the Responses field it came from.
std::string with_responses_param(const std::string& body) {
  Json j = Json::parse(body, nullptr, false);
  if (j.is_discarded() || !j.contains("error") || !j["error"].is_object()) return body;
  Json& param = j["error"]["param"];
  if (!param.is_string()) return body;
  static const std::pair<const char*, const char*> kNames[] = {
      {"max_completion_tokens", "max_output_tokens"}, {"messages", "input"}, {"response_format", "text"}};
  for (const auto& [chat, responses] : kNames)
    if (param == chat) param = responses;
  return j.dump();
}

class ResponsesExchange final : public HttpExchange {
 public:
  ResponsesExchange(std::shared_ptr<HttpExchange> client, Json shell, std::string id)
      : client_(std::move(client)), shell_(std::move(shell)), id_(std::move(id)) {}

  // The chat path's one answer: a chat.completion becomes the Response;
  // errors (the same {"error": ...} body in both APIs) pass with the
  // parameter they name in the Responses spelling.
  void respond(HttpResponse response) override {
    if (response.status == 200) {
      const Json chat = Json::parse(response.body, nullptr, false);
      if (!chat.is_discarded() && chat.contains("choices") && !chat["choices"].empty()) {
        created_ = chat.value("created", int64_t{0});
        model_ = string_field(chat, "model");
        const Json& choice = chat["choices"][0];
        const Json& message = choice["message"];
        if (message.contains("reasoning_content") && message["reasoning_content"].is_string())
          output_.push_back(reasoning_item(message["reasoning_content"].get<std::string>()));
        if (message.contains("content") && message["content"].is_string() &&
            !message["content"].get_ref<const std::string&>().empty())
          output_.push_back(message_item(message["content"].get<std::string>(), "completed"));
        if (message.contains("tool_calls"))
          for (const Json& call : message["tool_calls"])
            if (calls_++ == 0 || parallel_calls()) output_.push_back(function_call_item(call, "completed"));
        finish_reason_ = string_field(choice, "finish_reason");
        usage_ = chat.value("usage", Json());
        response.body = response_object(false).dump(-1, ' ', false, Json::error_handler_t::replace);
      }
    } else {
      response.body = with_responses_param(response.body);
    }
    client_->respond(std::move(response));
  }

  void start_events(int status, HeaderList headers) override {
    client_->start_events(status, std::move(headers));
  }

  // A chat chunk in, the Responses events it makes out.
  void send_event(std::string data) override {
    if (finished_) return;
    if (data == "[DONE]") return finish();
    const Json chunk = Json::parse(data, nullptr, false);
    if (chunk.is_discarded()) return;
    if (chunk.contains("error")) {  // the chat path's error event: an error event, then the stream ends
      const Json& e = chunk["error"];
      emit({{"type", "error"},
            {"code", e.value("code", Json())},
            {"message", string_field(e, "message")},
            {"param", e.value("param", Json())}});
      finished_ = true;
      return;
    }
    if (!announced_) {
      created_ = chunk.value("created", int64_t{0});
      model_ = string_field(chunk, "model");
      emit({{"type", "response.created"}, {"response", response_object(true)}});
      emit({{"type", "response.in_progress"}, {"response", response_object(true)}});
      announced_ = true;
    }
    if (chunk.contains("usage") && !chunk["usage"].is_null()) usage_ = chunk["usage"];
    if (!chunk.contains("choices")) return;
    for (const Json& choice : chunk["choices"]) {
      if (choice.value("index", 0) != 0) continue;
      const Json delta = choice.value("delta", Json::object());
      if (delta.contains("reasoning_content") && delta["reasoning_content"].is_string())
        add_text(Open::kReasoning, delta["reasoning_content"].get<std::string>());
      if (delta.contains("content") && delta["content"].is_string())
        add_text(Open::kMessage, delta["content"].get<std::string>());
      if (delta.contains("tool_calls"))
        for (const Json& call : delta["tool_calls"]) add_function_call(call);
      if (choice.contains("finish_reason") && choice["finish_reason"].is_string())
        finish_reason_ = choice["finish_reason"].get<std::string>();
    }
  }

  void end_events() override {
    if (!finished_ && announced_) finish();
    client_->end_events();
  }

  void on_close(std::function<void()> fn) override { client_->on_close(std::move(fn)); }

 private:
  enum class Open { kNone, kReasoning, kMessage };

  std::string item_id(const char* prefix) const {
    return fmt::format("{}_{}_{}", prefix, id_.substr(5), output_.size());
  }

  Json reasoning_item(const std::string& text) const {
    return {{"id", item_id("rs")},
            {"type", "reasoning"},
            {"summary", Json::array()},
            {"content", Json::array({{{"type", "reasoning_text"}, {"text", text}}})},
            {"status", "completed"}};
  }
  Json message_item(const std::string& text, const char* status) const {
    Json content = Json::array();
    if (!text.empty() || std::string_view(status) == "completed") content.push_back(output_text_part(text));
    return {{"id", item_id("msg")},
            {"type", "message"},
            {"status", status},
            {"role", "assistant"},
            {"content", content}};
  }
  static Json output_text_part(const std::string& text) {
    return {
        {"type", "output_text"}, {"text", text}, {"annotations", Json::array()}, {"logprobs", Json::array()}};
  }
  Json function_call_item(const Json& call, const char* status) const {
    const Json function = call.value("function", Json::object());
    return {{"id", item_id("fc")},
            {"type", "function_call"},
            {"call_id", string_field(call, "id")},
            {"name", string_field(function, "name")},
            {"arguments", std::string_view(status) == "completed" ? string_field(function, "arguments") : ""},
            {"status", status}};
  }

  Json usage_object() const {
    if (usage_.is_null()) return nullptr;
    const int64_t input = usage_.value("prompt_tokens", int64_t{0}),
                  output = usage_.value("completion_tokens", int64_t{0});
    int64_t cached = 0;
    if (usage_.contains("prompt_tokens_details") && usage_["prompt_tokens_details"].is_object())
      cached = usage_["prompt_tokens_details"].value("cached_tokens", int64_t{0});
    return {{"input_tokens", input},
            {"input_tokens_details", {{"cached_tokens", cached}}},
            {"output_tokens", output},
            {"output_tokens_details", {{"reasoning_tokens", 0}}},
            {"total_tokens", input + output}};
  }

  Json response_object(bool in_progress) const {
    const bool incomplete = finish_reason_ == "length";
    Json r = {
        {"id", id_},
        {"object", "response"},
        {"created_at", created_},
        {"status", in_progress  ? "in_progress"
                   : incomplete ? "incomplete"
                                : "completed"},
        {"error", nullptr},
        {"incomplete_details", incomplete && !in_progress ? Json{{"reason", "max_output_tokens"}} : Json()},
        {"model", model_},
        {"output", in_progress ? Json::array() : output_}};
    for (const auto& [key, value] : shell_.items()) r[key] = value;
    r["usage"] = in_progress ? Json() : usage_object();
    return r;
  }

  void emit(Json event) {
    event["sequence_number"] = sequence_++;
    std::string type = event["type"].get<std::string>();
    client_->send_named_event(std::move(type), event.dump(-1, ' ', false, Json::error_handler_t::replace));
  }

  // Text of the open item's kind; another kind closes the open one first.
  void add_text(Open kind, const std::string& text) {
    if (text.empty()) return;
    if (open_ != kind) {
      close_open();
      open_ = kind;
      open_text_.clear();
      open_id_ = item_id(kind == Open::kReasoning ? "rs" : "msg");
      Json item = kind == Open::kReasoning ? reasoning_item("") : message_item("", "in_progress");
      item["id"] = open_id_;
      if (kind == Open::kReasoning) item["content"] = Json::array(), item["status"] = "in_progress";
      emit({{"type", "response.output_item.added"}, {"output_index", output_.size()}, {"item", item}});
      emit({{"type", "response.content_part.added"},
            {"item_id", open_id_},
            {"output_index", output_.size()},
            {"content_index", 0},
            {"part", kind == Open::kReasoning ? Json{{"type", "reasoning_text"}, {"text", ""}}
                                              : output_text_part("")}});
    }
    open_text_ += text;
    Json delta = {
        {"type", kind == Open::kReasoning ? "response.reasoning_text.delta" : "response.output_text.delta"},
        {"item_id", open_id_},
        {"output_index", output_.size()},
        {"content_index", 0},
        {"delta", text}};
    if (kind == Open::kMessage) delta["logprobs"] = Json::array();
    emit(std::move(delta));
  }

  void close_open() {
    if (open_ == Open::kNone) return;
    const bool reasoning = open_ == Open::kReasoning;
    emit({{"type", reasoning ? "response.reasoning_text.done" : "response.output_text.done"},
          {"item_id", open_id_},
          {"output_index", output_.size()},
          {"content_index", 0},
          {"text", open_text_}});
    const Json part =
        reasoning ? Json{{"type", "reasoning_text"}, {"text", open_text_}} : output_text_part(open_text_);
    emit({{"type", "response.content_part.done"},
          {"item_id", open_id_},
          {"output_index", output_.size()},
          {"content_index", 0},
          {"part", part}});
    Json item = reasoning ? reasoning_item(open_text_) : message_item(open_text_, "completed");
    item["id"] = open_id_;
    emit({{"type", "response.output_item.done"}, {"output_index", output_.size()}, {"item", item}});
    output_.push_back(std::move(item));
    open_ = Open::kNone;
  }

  // parallel_tool_calls false: the model's first call only.
  bool parallel_calls() const { return shell_.value("parallel_tool_calls", Json(true)) != Json(false); }

  void add_function_call(const Json& call) {
    if (calls_++ > 0 && !parallel_calls()) return;
    close_open();
    Json item = function_call_item(call, "in_progress");
    const size_t index = output_.size();
    emit({{"type", "response.output_item.added"}, {"output_index", index}, {"item", item}});
    const std::string arguments = string_field(call.value("function", Json::object()), "arguments");
    emit({{"type", "response.function_call_arguments.delta"},
          {"item_id", item["id"]},
          {"output_index", index},
          {"delta", arguments}});
    emit({{"type", "response.function_call_arguments.done"},
          {"item_id", item["id"]},
          {"output_index", index},
          {"arguments", arguments}});
    item["arguments"] = arguments, item["status"] = "completed";
    emit({{"type", "response.output_item.done"}, {"output_index", index}, {"item", item}});
    output_.push_back(std::move(item));
  }

  void finish() {
    close_open();
    const Json response = response_object(false);
    emit({{"type", response["status"] == "incomplete" ? "response.incomplete" : "response.completed"},
          {"response", response}});
    finished_ = true;
  }

  std::shared_ptr<HttpExchange> client_;
  const Json shell_;
  const std::string id_;
  int64_t created_ = 0;
  std::string model_;
  Json output_ = Json::array();
  Json usage_;
  std::string finish_reason_;
  int calls_ = 0;  // function calls the model made
  // Streaming.
  bool announced_ = false, finished_ = false;
  int64_t sequence_ = 0;
  Open open_ = Open::kNone;
  std::string open_id_, open_text_;
};

}  // namespace

std::shared_ptr<HttpExchange> make_responses_exchange(std::shared_ptr<HttpExchange> client, Json shell,
                                                      std::string id) {
  return std::make_shared<ResponsesExchange>(std::move(client), std::move(shell), std::move(id));
}

}  // namespace moe::server
