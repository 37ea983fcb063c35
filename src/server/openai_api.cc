#include "server/openai_api.h"

#include <cctype>
#include <chrono>
#include <random>

#include "core/logging.h"
#include "server/completion_run.h"
#include "server/metrics_text.h"
#include "server/responses_api.h"

namespace moe::server {

using nlohmann::json;

namespace {

HttpResponse json_response(int status, const json& body) { return {status, "application/json", body.dump(), {}}; }

HttpResponse not_found(const std::string& path) {
  return {404, "application/json", error_json("no route for " + path, "not_found_error", "", "not_found"), {}};
}

// A request id made of safe characters only (it is echoed in a header).
std::string sanitize_request_id(const std::string& id) {
  std::string out;
  for (char ch : id)
    if (std::isalnum(static_cast<unsigned char>(ch)) || ch == '-' || ch == '_' || ch == '.') out += ch;
  return out.substr(0, 128);
}

}  // namespace

OpenAiApi::OpenAiApi(GenerationBackend& engine, const tokenizer::Tokenizer* tokenizer, ApiOptions options)
    : engine_(engine), tokenizer_(tokenizer), options_(std::move(options)) {
  created_s_ = std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  next_request_ = (static_cast<uint64_t>(std::random_device{}()) << 20) | 1;  // ids differ across restarts
  const std::string& source =
      !options_.chat_template.empty() || !tokenizer_ ? options_.chat_template : tokenizer_->chat_template();
  if (tokenizer_ && !source.empty()) {
    auto t = tokenizer::ChatTemplate::create(source);
    if (t) chat_template_.emplace(std::move(t).value());
    else chat_template_error_ = t.status().message();
  }
}

bool OpenAiApi::authorized(const HttpRequest& request) const {
  if (options_.api_key.empty()) return true;
  // "Bearer KEY"; the scheme is case-insensitive (RFC 9110 11.1), the key is not.
  const std::string value = request.header("authorization");
  constexpr std::string_view kScheme = "bearer ";
  if (value.size() != kScheme.size() + options_.api_key.size()) return false;
  for (size_t i = 0; i < kScheme.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(value[i])) != kScheme[i]) return false;
  return value.compare(kScheme.size(), std::string::npos, options_.api_key) == 0;
}

namespace {

ApiError model_not_found(const std::string& name) {
  return {404, fmt::format("The model `{}` does not exist.", name), "NotFoundError", "model", "model_not_found", {}};
}

HttpResponse method_not_allowed(const std::string& path, const char* allowed) {
  return {405, "application/json", error_json(fmt::format("use {} for {}", allowed, path), "invalid_request_error"),
          {{"Allow", allowed}}};
}

}  // namespace

void OpenAiApi::handle(HttpRequest request, std::shared_ptr<HttpExchange> exchange) {
  std::string request_id = sanitize_request_id(request.header("x-request-id"));
  if (request_id.empty()) request_id = fmt::format("{:016x}", next_request_.fetch_add(1) * 0x9e3779b97f4a7c15ull);
  const HeaderList id_header = {{"X-Request-Id", request_id}};
  auto reply = [&](HttpResponse r) {
    r.headers.insert(r.headers.end(), id_header.begin(), id_header.end());
    exchange->respond(std::move(r));
  };
  const std::string& path = request.path;
  const bool is_post = request.method == "POST";
  const bool is_get = request.method == "GET";
  constexpr std::string_view kModelPrefix = "/v1/models/";
  const bool models = path == "/v1/models" || path.starts_with(kModelPrefix);
  if (path == "/health" || path == "/metrics" || models) {
    if (!is_get) return reply(method_not_allowed(path, "GET"));
  } else if (path == "/v1/completions" || path == "/v1/chat/completions" || path == "/v1/responses" ||
             path == "/tokenize" || path == "/detokenize") {
    if (!is_post) return reply(method_not_allowed(path, "POST"));
  } else {
    return reply(not_found(path));
  }
  if (path == "/health") return reply({engine_.healthy() ? 200 : 503, "text/plain", "", {}});
  if (path == "/metrics") return reply({200, "text/plain; version=0.0.4", engine_.metrics_text(options_.model_name), {}});
  if (!authorized(request))
    return reply({401, "application/json",
                  error_json("Incorrect API key provided.", "invalid_request_error", "", "invalid_api_key"), {}});
  if (path == "/v1/models") return reply(handle_models());
  if (models) {  // GET /v1/models/{model}: the OpenAI client's models.retrieve()
    const std::string name = path.substr(kModelPrefix.size());
    if (name != options_.model_name) return reply(model_not_found(name).to_response());
    return reply(json_response(200, model_json()));
  }
  if (path == "/tokenize") return reply(handle_tokenize(request));
  if (path == "/detokenize") return reply(handle_detokenize(request));
  if (!engine_.healthy())
    return reply({503, "application/json", error_json("the engine has failed", "service_unavailable"), {}});
  if (path == "/v1/responses") {  // served as the chat request it makes, its answer made a Response
    auto chat = responses_to_chat(request.body);
    if (auto* e = std::get_if<ApiError>(&chat)) {
      ApiError error = *e;
      error.headers.insert(error.headers.end(), id_header.begin(), id_header.end());
      return exchange->respond(error.to_response());
    }
    auto responses = make_responses_exchange(exchange, responses_shell(request.body), "resp_" + request_id);
    request.body = std::get<nlohmann::ordered_json>(chat).dump();
    return handle_completion(request, responses, /*chat=*/true, request_id);
  }
  handle_completion(request, exchange, path == "/v1/chat/completions", request_id);
}

std::string EngineBackend::metrics_text(const std::string& model_name) const {
  return render_metrics(engine_.metrics(), model_name);
}

nlohmann::json OpenAiApi::model_json() const {
  return {{"id", options_.model_name},
          {"object", "model"},
          {"created", created_s_},
          {"owned_by", "moeserve"},
          {"root", options_.model_name},
          {"max_model_len", options_.limits.max_model_len}};
}

HttpResponse OpenAiApi::handle_models() const {
  return json_response(200, {{"object", "list"}, {"data", json::array({model_json()})}});
}

std::optional<ApiError> OpenAiApi::prepare_chat(const ChatRequest& chat, RunPrompt& out) const {
  if (!tokenizer_) return bad_request("this model has no tokenizer: use /v1/completions with token ids");
  if (!chat_template_)
    return bad_request(chat_template_error_.empty() ? "this model has no chat template"
                                                    : "the model's chat template does not parse: " + chat_template_error_);
  const auto& special = tokenizer_->special_tokens();
  auto context = tokenizer::make_chat_context(chat.messages, chat.tools, chat.add_generation_prompt, special.bos,
                                              special.eos, chat.chat_template_kwargs);
  auto text = chat_template_->render(context);
  if (!text) return bad_request("the chat template failed on these messages: " + text.status().message(), "messages");
  const nlohmann::ordered_json& final_message = chat.messages.back();
  const nlohmann::ordered_json& final_content = final_message.contains("content") ? final_message["content"] : nullptr;
  if (chat.continue_final_message) {
    if (!final_content.is_string())
      return bad_request("'continue_final_message' needs text content in the final message", "messages");
    auto continued = tokenizer::continue_final_message(*text, final_content.get<std::string>());
    if (!continued) return bad_request(continued.status().message(), "continue_final_message");
    text = std::move(continued);
  }
  // vLLM's chat echo: the final message's content, when it has the response's role.
  if (chat.echo && final_content.is_string() && final_message["role"] == chat_role(chat))
    out.echo_text = final_content.get<std::string>();
  out.ids = tokenizer_->encode(*text, /*parse_special=*/true);
  if (chat.continue_final_message) {
    // The output goes on inside the final message: inside its reasoning when
    // the prompt's last <think> is still open.
    const size_t open = text->rfind("<think>"), close = text->rfind("</think>");
    out.opens_reasoning = open != std::string::npos && (close == std::string::npos || close < open);
    if (options_.reasoning_parser_qwen3 && out.opens_reasoning)
      out.grammar_after_token = tokenizer_->token_to_id("</think>").value_or(-1);
    return std::nullopt;
  }
  // Qwen3-*-Thinking-2507's and Qwen3.5's templates open the reasoning in the prompt.
  const size_t end = text->find_last_not_of(" \t\r\n");
  const std::string_view trimmed = std::string_view(*text).substr(0, end == std::string::npos ? 0 : end + 1);
  out.opens_reasoning = trimmed.ends_with("<think>");
  // With a reasoning parser, a structured output's grammar applies after the
  // reasoning: from the start where the prompt closed it (Qwen3's
  // enable_thinking false), else once the model writes </think>.
  if (options_.reasoning_parser_qwen3 && !trimmed.ends_with("</think>"))
    out.grammar_after_token = tokenizer_->token_to_id("</think>").value_or(-1);
  return std::nullopt;
}

// The response message's role: vLLM's, the final message's when the prompt
// adds no generation prompt.
std::string OpenAiApi::chat_role(const ChatRequest& chat) {
  return chat.add_generation_prompt ? "assistant" : chat.messages.back()["role"].get<std::string>();
}

// vLLM's bad_words as token sequences: each word with its leading whitespace
// removed, then also after a space (the word inside text) where that
// tokenizes to as many tokens as the word alone and starts differently.
std::optional<ApiError> OpenAiApi::tokenize_bad_words(const GenerationParams& params,
                                                      std::vector<std::vector<int32_t>>& out) const {
  if (params.bad_words.empty()) return std::nullopt;
  if (!tokenizer_) return bad_request("'bad_words' needs the model's tokenizer", "bad_words");
  size_t num_tokens = 0;
  for (const std::string& word : params.bad_words) {
    const std::string bare = tokenizer::strip_whitespace(word, true, false);
    std::vector<int32_t> alone = tokenizer_->encode(bare, /*parse_special=*/true);
    if (alone.empty()) return bad_request("'bad_words' entries must tokenize to at least one token", "bad_words");
    std::vector<int32_t> spaced = tokenizer_->encode(" " + bare, /*parse_special=*/true);
    const bool also_spaced = !spaced.empty() && spaced.size() == alone.size() && spaced[0] != alone[0];
    num_tokens += alone.size() + (also_spaced ? spaced.size() : 0);
    out.push_back(std::move(alone));
    if (also_spaced) out.push_back(std::move(spaced));
  }
  const RequestLimits& limits = options_.limits;
  if (static_cast<int>(out.size()) > limits.max_bad_words || num_tokens > static_cast<size_t>(limits.max_bad_words_tokens))
    return bad_request(fmt::format("'bad_words' tokenize to {} token sequences of {} tokens; at most {} of {} in all",
                                   out.size(), num_tokens, limits.max_bad_words, limits.max_bad_words_tokens),
                       "bad_words");
  return std::nullopt;
}

std::optional<ApiError> OpenAiApi::prepare_completion(const PromptInput& prompt, bool echo, bool skip_special,
                                                      RunPrompt& out) const {
  if (prompt.text) {
    if (!tokenizer_) return bad_request("this model has no tokenizer: send the prompt as token ids", "prompt");
    out.ids = tokenizer_->encode(*prompt.text, true);
    if (echo) out.echo_text = *prompt.text;
  } else {
    out.ids = prompt.ids;
    if (echo && tokenizer_) out.echo_text = tokenizer_->decode(prompt.ids, skip_special);
  }
  for (int32_t id : out.ids)
    if (id >= engine_.vocab_size())
      return bad_request(fmt::format("token id {} is outside the vocabulary [0, {})", id, engine_.vocab_size()), "prompt");
  if (out.ids.empty()) return bad_request("the prompt encodes to no tokens", "prompt");
  return std::nullopt;
}

void OpenAiApi::handle_completion(const HttpRequest& request, const std::shared_ptr<HttpExchange>& exchange,
                                  bool chat, const std::string& request_id) {
  const HeaderList id_header = {{"X-Request-Id", request_id}};
  auto reply_error = [&](ApiError e) {
    e.headers.insert(e.headers.end(), id_header.begin(), id_header.end());
    exchange->respond(e.to_response());
  };
  const RequestLimits& limits = options_.limits;
  GenerationParams params;
  std::vector<RunPrompt> prompts;
  bool parse_tool_calls = false, echo_logprobs = false;
  std::string forced_tools, forced_tool, role = "assistant";
  nlohmann::ordered_json tools;
  if (chat) {
    auto parsed = parse_chat_request(request.body, limits);
    if (auto* e = std::get_if<ApiError>(&parsed)) return reply_error(*e);
    const auto& r = std::get<ChatRequest>(parsed);
    params = r.params;
    parse_tool_calls =
        options_.tool_call_parser && r.tools.is_array() && !r.tools.empty() && r.tool_choice == "auto";
    if (parse_tool_calls) tools = r.tools;
    if (r.tool_choice == "required" || r.tool_choice == "function") forced_tools = r.tool_choice, forced_tool = r.forced_tool;
    if (auto e = prepare_chat(r, prompts.emplace_back())) return reply_error(*e);
    role = chat_role(r);
  } else {
    auto parsed = parse_completion_request(request.body, limits);
    if (auto* e = std::get_if<ApiError>(&parsed)) return reply_error(*e);
    const auto& r = std::get<CompletionRequest>(parsed);
    params = r.params;
    echo_logprobs = r.echo && params.logprobs >= 0;
    for (const auto& p : r.prompts)
      if (auto e = prepare_completion(p, r.echo, params.skip_special_tokens, prompts.emplace_back()))
        return reply_error(*e);
  }
  if (params.model && *params.model != options_.model_name) return reply_error(model_not_found(*params.model));
  if (params.truncate_prompt_tokens) {  // vLLM's: keep each prompt's last k tokens
    const auto keep = static_cast<size_t>(*params.truncate_prompt_tokens);
    for (auto& p : prompts) {
      if (p.ids.size() <= keep) continue;
      p.ids.erase(p.ids.begin(), p.ids.end() - static_cast<std::ptrdiff_t>(keep));
      if (!p.echo_text.empty() && tokenizer_) p.echo_text = tokenizer_->decode(p.ids, params.skip_special_tokens);
    }
  }
  for (const auto& [token, bias] : params.sampling.logit_bias)
    if (token >= engine_.vocab_size())
      return reply_error(bad_request(fmt::format("logit_bias names token {}, outside the vocabulary [0, {})", token,
                                                 engine_.vocab_size()),
                                     "logit_bias"));
  for (int32_t token : params.sampling.allowed_token_ids)
    if (token >= engine_.vocab_size())
      return reply_error(bad_request(fmt::format("allowed_token_ids names token {}, outside the vocabulary [0, {})",
                                                 token, engine_.vocab_size()),
                                     "allowed_token_ids"));
  if (auto e = tokenize_bad_words(params, params.sampling.bad_words)) return reply_error(*e);
  const int64_t num_choices = static_cast<int64_t>(prompts.size()) * params.n;
  if (num_choices > limits.max_waiting)
    return reply_error(bad_request(fmt::format("this request has {} choices ({} prompt(s) x n = {}); the server queues "
                                               "at most {} requests (--max-waiting)",
                                               num_choices, prompts.size(), params.n, limits.max_waiting),
                                   "n"));
  const char* param = chat ? "messages" : "prompt";
  for (size_t p = 0; p < prompts.size(); ++p) {
    const auto num_prompt = static_cast<int64_t>(prompts[p].ids.size());
    if (num_prompt >= limits.max_model_len ||
        (params.max_tokens && num_prompt + *params.max_tokens > limits.max_model_len)) {
      ApiError e =
          context_length_error(limits.max_model_len, num_prompt, params.max_tokens.value_or(1), param);
      if (prompts.size() > 1) e.message += fmt::format(" (prompt {} of the batch)", p);
      return reply_error(e);
    }
    prompts[p].max_tokens = params.max_tokens.value_or(static_cast<int>(limits.max_model_len - num_prompt));
  }
  if (params.grammar && !tokenizer_)
    return reply_error(bad_request("structured outputs need the model's tokenizer", "response_format"));
  // A grammar from the first token leaves no room for reasoning: the output is content.
  if (params.grammar)
    for (RunPrompt& p : prompts)
      if (p.grammar_after_token < 0) p.opens_reasoning = false;
  engine::EngineRequest base;  // the prompt and budget are each choice's (CompletionRun::start)
  base.grammar = params.grammar;
  base.sampling = params.sampling;
  base.ignore_eos = params.ignore_eos;
  base.stop_token_ids = params.stop_token_ids;
  base.num_logprobs = params.logprobs;
  // The echoed prompt's logprobs lead the logprobs (echo with logprobs), and/or vLLM's prompt_logprobs.
  base.num_prompt_logprobs = std::max(echo_logprobs ? params.logprobs : -1, params.prompt_logprobs);
  base.timeout_s = options_.request_timeout_s;

  RunConfig config;
  config.chat = chat;
  config.id = (chat ? "chatcmpl-" : "cmpl-") + request_id;
  config.model = options_.model_name;
  config.created = std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  config.params = params;
  config.prompts = std::move(prompts);
  config.reasoning_qwen3 = chat && options_.reasoning_parser_qwen3;
  config.chat_role = role;
  config.parse_tool_calls = parse_tool_calls;
  config.forced_tools = forced_tools;
  config.forced_tool = forced_tool;
  config.echo_logprobs = echo_logprobs;
  if (parse_tool_calls) config.tool_call_format = *options_.tool_call_parser, config.tools = std::move(tools);
  config.tokenizer = tokenizer_;
  config.headers = id_header;
  config.request_id = request_id;
  auto run = std::make_shared<CompletionRun>(std::move(config), exchange, engine_);
  if (auto e = run->start(base)) return reply_error(*e);
  exchange->on_close([run] { run->cancel(); });
}

HttpResponse OpenAiApi::handle_tokenize(const HttpRequest& request) const {
  json j = json::parse(request.body, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return bad_request("the request body must be a JSON object").to_response();
  if (const auto m = j.find("model"); m != j.end() && !m->is_null()) {
    if (!m->is_string()) return bad_request("'model' must be a string", "model").to_response();
    if (m->get<std::string>() != options_.model_name) return model_not_found(m->get<std::string>()).to_response();
  }
  if (!tokenizer_) return bad_request("this model has no tokenizer").to_response();
  std::vector<int32_t> ids;
  if (j.contains("messages")) {
    auto parsed = parse_chat_request(request.body, options_.limits);
    if (auto* e = std::get_if<ApiError>(&parsed)) return e->to_response();
    RunPrompt p;
    if (auto e = prepare_chat(std::get<ChatRequest>(parsed), p)) return e->to_response();
    ids = p.ids;
  } else if (j.contains("prompt") && j["prompt"].is_string()) {
    const auto flag = j.find("add_special_tokens");
    if (flag != j.end() && !flag->is_boolean())
      return bad_request("'add_special_tokens' must be a boolean", "add_special_tokens").to_response();
    const bool add_special = flag == j.end() || flag->get<bool>();
    ids = tokenizer_->encode(j["prompt"].get<std::string>(), add_special);
  } else {
    return bad_request("'prompt' (a string) or 'messages' is required", "prompt").to_response();
  }
  return json_response(200, {{"count", ids.size()}, {"max_model_len", options_.limits.max_model_len}, {"tokens", ids}});
}

HttpResponse OpenAiApi::handle_detokenize(const HttpRequest& request) const {
  json j = json::parse(request.body, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("tokens") || !j["tokens"].is_array())
    return bad_request("'tokens' (an array of token ids) is required", "tokens").to_response();
  if (!tokenizer_) return bad_request("this model has no tokenizer").to_response();
  std::vector<int32_t> ids;
  for (const auto& t : j["tokens"]) {
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= engine_.vocab_size())
      return bad_request("'tokens' must hold token ids of this model", "tokens").to_response();
    ids.push_back(t.get<int32_t>());
  }
  return json_response(200, {{"prompt", tokenizer_->decode(ids, false)}});
}

}  // namespace moe::server
