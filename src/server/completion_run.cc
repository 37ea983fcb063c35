#include "server/completion_run.h"

#include <algorithm>
#include <random>

#include "core/logging.h"
#include "tokenizer/utf8.h"

namespace moe::server {

using nlohmann::json;

namespace {

constexpr std::string_view kThinkOpen = "<think>";
constexpr std::string_view kThinkClose = "</think>";

int http_status_of(const Status& s) {
  switch (s.code()) {
    case StatusCode::kInvalidArgument: case StatusCode::kOutOfRange: return 400;
    case StatusCode::kResourceExhausted: case StatusCode::kUnavailable: return 503;
    case StatusCode::kDeadlineExceeded: return 504;
    default: return 500;
  }
}

}  // namespace

std::pair<std::string, std::string> ReasoningSplitter::feed(const std::string& text) {
  pending_ += text;
  std::string reasoning, content;
  if (mode_ == Mode::kStart) {
    if (pending_.size() < kThinkOpen.size() && std::string_view(kThinkOpen).substr(0, pending_.size()) == pending_)
      return {};
    if (pending_.starts_with(kThinkOpen)) {
      pending_.erase(0, kThinkOpen.size());
      mode_ = Mode::kReasoning;
    } else {
      mode_ = Mode::kContent;
    }
  }
  if (mode_ == Mode::kReasoning) {
    const size_t end = pending_.find(kThinkClose);
    const size_t call = tool_calls_ ? pending_.find(kToolCallOpen) : std::string::npos;
    if (end == std::string::npos && call == std::string::npos) {
      size_t keep = partial_tag(pending_, kThinkClose);
      if (tool_calls_) keep = std::max(keep, partial_tag(pending_, kToolCallOpen));
      reasoning = pending_.substr(0, pending_.size() - keep);
      pending_.erase(0, pending_.size() - keep);
      return {reasoning, content};
    }
    reasoning = pending_.substr(0, std::min(end, call));
    pending_.erase(0, call < end ? call : end + kThinkClose.size());  // the call stays, for the content
    mode_ = Mode::kContent;
  }
  content = std::move(pending_);
  pending_.clear();
  return {reasoning, content};
}

std::pair<std::string, std::string> ReasoningSplitter::finish() {
  std::string rest = std::move(pending_);
  pending_.clear();
  if (mode_ == Mode::kReasoning) return {rest, ""};
  return {"", rest};
}

CompletionRun::CompletionRun(RunConfig config, std::shared_ptr<HttpExchange> exchange, GenerationBackend& engine)
    : config_(std::move(config)), exchange_(std::move(exchange)), engine_(engine) {
  const auto n = static_cast<size_t>(config_.params.n);
  choices_.resize(config_.prompts.size() * n);
  for (size_t i = 0; i < choices_.size(); ++i) {
    choices_[i].prompt = i / n;
    choices_[i].splitter = ReasoningSplitter(config_.prompts[i / n].opens_reasoning, config_.parse_tool_calls);
    if (config_.parse_tool_calls)
      choices_[i].tool_parser = ToolCallParser(config_.tool_call_format, config_.tools);
    if (config_.tokenizer)
      choices_[i].detokenizer.emplace(*config_.tokenizer, config_.params.skip_special_tokens);
  }
  for (const auto& s : config_.params.stop) max_stop_len_ = std::max(max_stop_len_, s.size());
  if (config_.parse_tool_calls || !config_.forced_tools.empty()) {
    std::random_device random;
    call_id_salt_ = (uint64_t{random()} << 32) | random();
  }
}

std::optional<ApiError> CompletionRun::start(const engine::EngineRequest& base) {
  std::lock_guard lock(mutex_);
  for (size_t i = 0; i < choices_.size(); ++i) {
    const RunPrompt& prompt = config_.prompts[choices_[i].prompt];
    engine::EngineRequest request = base;
    request.prompt = prompt.ids;
    request.max_tokens = prompt.max_tokens;
    if (request.grammar) request.grammar_after_token = prompt.grammar_after_token;
    if (request.sampling.seed) request.sampling.seed = *request.sampling.seed + i % config_.params.n;
    auto self = shared_from_this();
    auto id = engine_.submit(
        std::move(request), [self, i](const engine::EngineOutput& out) { self->on_output(i, out); }, config_.request_id);
    if (!id) {
      failed_ = true;
      for (size_t k = 0; k < i; ++k) engine_.cancel(choices_[k].engine_id, engine::FinishReason::kAbort);
      const Status& s = id.status();
      ApiError error = bad_request(s.message());
      error.status = http_status_of(s);
      if (error.status == 503) {
        error.type = "service_unavailable";
        error.headers.emplace_back("Retry-After", "1");
      }
      return error;
    }
    choices_[i].engine_id = *id;
  }
  started_ = true;
  if (config_.params.stream) {
    HeaderList headers = config_.headers;
    exchange_->start_events(200, headers);
  }
  return std::nullopt;
}

void CompletionRun::cancel() {
  std::lock_guard lock(mutex_);
  for (const auto& c : choices_)
    if (!c.done && c.engine_id != 0) engine_.cancel(c.engine_id, engine::FinishReason::kAbort);
}

std::string CompletionRun::token_text(int32_t id) const {
  if (!config_.tokenizer) return {};
  const int32_t ids[] = {id};
  return config_.tokenizer->decode(ids, false);
}

void CompletionRun::add_token(Choice& c, const engine::EngineOutput& out) {
  c.token_ids.push_back(out.token);
  if (out.logprobs) c.logprobs.push_back(*out.logprobs);
  if (!out.prompt_logprobs.empty()) c.prompt_logprobs = out.prompt_logprobs;
  // The token that stopped generation (eos or a stop id) is not part of the text.
  const bool stop_token = out.finish == engine::FinishReason::kStop;
  c.token_offsets.push_back(c.text_chars);
  if (c.detokenizer && !stop_token) {
    const std::string piece = c.detokenizer->add(out.token);
    c.text_chars += tokenizer::num_code_points(piece);
    c.text += piece;
  }
}

bool CompletionRun::find_stop(Choice& c) {
  if (config_.params.stop.empty()) return false;
  if (static_cast<int64_t>(c.token_ids.size()) < config_.params.sampling.min_tokens) {
    c.stop_checked = c.text.size();  // as vLLM: no stop string ends within the first min_tokens tokens
    return false;
  }
  size_t best = std::string::npos, best_size = 0;  // the earliest match (the first listed at a tie)
  for (const auto& s : config_.params.stop) {
    const size_t from = c.stop_checked >= s.size() ? c.stop_checked - s.size() + 1 : 0;
    const size_t at = c.text.find(s, from);
    if (at < best) best = at, best_size = s.size();
  }
  c.stop_checked = c.text.size();
  if (best == std::string::npos) return false;
  c.text.resize(config_.params.include_stop_str_in_output ? best + best_size : best);
  return true;
}

size_t CompletionRun::stop_holdback(const Choice& c) const {
  size_t hold = 0;
  for (const auto& s : config_.params.stop) hold = std::max(hold, partial_tag(c.text, s));
  return hold;
}

void CompletionRun::on_output(size_t index, const engine::EngineOutput& out) {
  std::lock_guard lock(mutex_);
  if (failed_) return;
  Choice& c = choices_[index];
  if (c.done) return;  // cut by a stop string: the cancel's final output
  if (!out.error.is_ok()) return fail(out.error);
  c.num_cached_tokens = std::max(c.num_cached_tokens, out.num_cached_tokens);
  c.num_draft_tokens = std::max(c.num_draft_tokens, out.num_draft_tokens);
  c.num_accepted_draft_tokens = std::max(c.num_accepted_draft_tokens, out.num_accepted_draft_tokens);
  if (out.token >= 0) add_token(c, out);
  if (out.finish != engine::FinishReason::kNone) {
    if (c.detokenizer) c.text += c.detokenizer->finish();
    c.finish_reason = engine::finish_reason_name(out.finish);
    c.done = true;
  }
  if (find_stop(c)) {
    if (!c.done) engine_.cancel(c.engine_id, engine::FinishReason::kStop);
    c.finish_reason = "stop";
    c.done = true;
  }
  if (c.done) ++num_done_;
  if (config_.params.stream) stream_choice(index, c.done);
  if (num_done_ == choices_.size()) complete();
}

json CompletionRun::tool_call_json(size_t index, size_t k, const ToolCall& call, bool streamed) const {
  json j = {{"id", fmt::format("call_{:016x}{:04x}{:04x}", call_id_salt_, index, k)},
            {"type", "function"},
            {"function", {{"name", call.name}, {"arguments", call.arguments}}}};
  if (streamed) j["index"] = k;
  return j;
}

std::vector<ToolCall> CompletionRun::forced_calls(const std::string& content) const {
  std::vector<ToolCall> calls;
  const size_t begin = content.find_first_not_of(" \t\r\n");
  if (begin == std::string::npos) return calls;
  const std::string text = content.substr(begin, content.find_last_not_of(" \t\r\n") + 1 - begin);
  if (config_.forced_tools == "function") {
    calls.push_back({config_.forced_tool, text});
    return calls;
  }
  const json array = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!array.is_array()) return calls;
  for (const json& call : array) {
    if (!call.is_object() || !call.contains("name") || !call["name"].is_string() || !call.contains("parameters"))
      return {};
    calls.push_back({call["name"].get<std::string>(), call["parameters"].dump()});
  }
  return calls;
}

json CompletionRun::chunk_head() const {
  return {{"id", config_.id},
          {"object", config_.chat ? "chat.completion.chunk" : "text_completion"},
          {"created", config_.created},
          {"model", config_.model}};
}

json CompletionRun::logprobs_json(const Choice& c, size_t from, bool with_prompt) const {
  if (config_.params.logprobs < 0) return nullptr;
  if (config_.chat) {
    json content = json::array();
    for (size_t i = from; i < c.logprobs.size(); ++i) {
      auto entry = [&](int32_t id, float lp) {
        const std::string t = token_text(id);
        std::vector<int> bytes;  // the token's own bytes, also when they are part of a character
        if (config_.tokenizer)
          for (unsigned char b : config_.tokenizer->token_bytes(id)) bytes.push_back(b);
        return json{{"token", t}, {"logprob", lp}, {"bytes", bytes}};
      };
      json e = entry(c.logprobs[i].token, c.logprobs[i].logprob);
      e["top_logprobs"] = json::array();
      for (const auto& [id, lp] : c.logprobs[i].top) e["top_logprobs"].push_back(entry(id, lp));
      content.push_back(std::move(e));
    }
    return {{"content", content}};
  }
  json tokens = json::array(), token_logprobs = json::array(), top = json::array(), offsets = json::array();
  // Without a tokenizer a token shows as "token_id:N" (vLLM's return_tokens_as_token_ids form).
  auto label = [&](int32_t id) {
    return config_.tokenizer ? token_text(id) : fmt::format("token_id:{}", id);
  };
  auto add = [&](int32_t id, const engine::TokenLogprobs* lp, size_t offset) {  // lp null: nothing before it
    tokens.push_back(label(id));
    offsets.push_back(offset);
    token_logprobs.push_back(lp ? json(lp->logprob) : json(nullptr));
    json alternatives = json::object();
    if (lp)  // (a prompt's may hold more alternatives, for prompt_logprobs)
      for (size_t a = 0; a < lp->top.size() && static_cast<int>(a) < config_.params.logprobs; ++a)
        alternatives[label(lp->top[a].first)] = lp->top[a].second;
    top.push_back(lp && config_.params.logprobs > 0 ? alternatives : json(nullptr));
  };
  if (with_prompt && config_.echo_logprobs) {  // the echoed prompt first, its offsets from its own decoding
    const std::vector<int32_t>& ids = config_.prompts[c.prompt].ids;
    std::optional<tokenizer::IncrementalDetokenizer> prompt_text;
    if (config_.tokenizer) prompt_text.emplace(*config_.tokenizer, config_.params.skip_special_tokens);
    size_t offset = 0;
    for (size_t j = 0; j < ids.size(); ++j) {
      add(ids[j], j > 0 && j <= c.prompt_logprobs.size() ? &c.prompt_logprobs[j - 1] : nullptr, offset);
      if (prompt_text) offset += tokenizer::num_code_points(prompt_text->add(ids[j]));
    }
  }
  const size_t echo_chars = tokenizer::num_code_points(config_.prompts[c.prompt].echo_text);
  for (size_t i = from; i < c.logprobs.size(); ++i)
    add(c.logprobs[i].token, &c.logprobs[i], echo_chars + (i < c.token_offsets.size() ? c.token_offsets[i] : 0));
  return {{"tokens", tokens}, {"token_logprobs", token_logprobs}, {"top_logprobs", top}, {"text_offset", offsets}};
}

// vLLM's: null for the first token, then per position a map from token id to
// {logprob, rank, decoded_token}: the prompt's token and the top k.
json CompletionRun::prompt_logprobs_json(const Choice& c) const {
  json out = json::array({nullptr});
  auto entry = [&](int32_t id, float logprob, int rank) {
    return json{{"logprob", logprob}, {"rank", rank}, {"decoded_token", token_text(id)}};
  };
  for (const engine::TokenLogprobs& lp : c.prompt_logprobs) {
    json position = json::object();
    position[std::to_string(lp.token)] = entry(lp.token, lp.logprob, lp.rank);
    for (size_t a = 0; a < lp.top.size() && static_cast<int>(a) < config_.params.prompt_logprobs; ++a)
      position[std::to_string(lp.top[a].first)] =
          entry(lp.top[a].first, lp.top[a].second, static_cast<int>(a) + 1);
    out.push_back(std::move(position));
  }
  return out;
}

void CompletionRun::stream_choice(size_t index, bool final_chunk) {
  Choice& c = choices_[index];
  const size_t safe = c.done ? c.text.size() : c.text.size() - std::min(c.text.size(), stop_holdback(c));
  std::string delta = safe > c.emitted ? c.text.substr(c.emitted, safe - c.emitted) : std::string();
  const bool new_logprobs = c.logprobs.size() > c.logprobs_emitted;
  // Token ids are visible (return_token_ids, or no tokenizer): a chunk per token.
  const bool new_tokens = (config_.params.return_token_ids || !config_.tokenizer) && c.token_ids.size() > c.tokens_emitted;
  const size_t first_new_token = c.tokens_emitted;
  const bool first_chunk = !c.sent_role;
  c.tokens_emitted = c.token_ids.size();
  const std::string& echo = config_.prompts[c.prompt].echo_text;
  if (delta.empty() && !final_chunk && !new_logprobs && !new_tokens && (c.sent_role || !config_.chat) &&
      (c.sent_role || echo.empty()))
    return;
  json chunk = chunk_head();
  json choice = {{"index", index}};
  c.emitted = std::max(c.emitted, safe);
  if (config_.chat) {
    json d = json::object();
    if (!c.sent_role) d["role"] = config_.chat_role, c.sent_role = true;
    std::string content = delta;
    if (config_.reasoning_qwen3) {
      auto [reasoning, text] = c.splitter.feed(delta);
      if (final_chunk) {
        auto [r2, c2] = c.splitter.finish();
        reasoning += r2, text += c2;
      }
      if (!reasoning.empty()) d["reasoning_content"] = reasoning, d["reasoning"] = reasoning;
      content = std::move(text);
    }
    if (config_.parse_tool_calls) {
      ToolCallParser::Piece piece = c.tool_parser.feed(content);
      if (final_chunk) piece.append(c.tool_parser.finish(c.finish_reason == "stop"));
      content = std::move(piece.content);
      for (const auto& call : piece.calls)
        d["tool_calls"].push_back(tool_call_json(index, c.num_tool_calls++, call, true));
    }
    if (!config_.forced_tools.empty()) {
      c.forced_text += content;
      content.clear();
      if (final_chunk) {
        const std::vector<ToolCall> calls = forced_calls(c.forced_text);
        if (calls.empty()) content = std::move(c.forced_text);
        for (const auto& call : calls) d["tool_calls"].push_back(tool_call_json(index, c.num_tool_calls++, call, true));
      }
    }
    if (first_chunk) content = echo + content;  // chat echo: the final message's content first
    const bool parsed = config_.reasoning_qwen3 || config_.parse_tool_calls || !config_.forced_tools.empty();
    if (!parsed || !content.empty() || d.empty()) d["content"] = content;
    choice["delta"] = d;
  } else {
    choice["text"] = c.sent_role ? delta : echo + delta;  // the echo goes out with the first chunk
  }
  // Completions: text_offset continues over the tokens already sent, after the echo (as the full response's);
  // the echoed prompt's logprobs lead the first chunk's.
  const bool with_prompt = !config_.chat && !c.sent_role && config_.echo_logprobs;
  if (!config_.chat) c.sent_role = true;
  choice["logprobs"] = new_logprobs || with_prompt
                           ? logprobs_json(c, c.logprobs_emitted, with_prompt)
                           : json(nullptr);
  c.logprobs_emitted = c.logprobs.size();
  if (config_.params.return_token_ids) {  // vLLM's streamed form: the chunk's new ids, the prompt's in the first
    choice["token_ids"] = std::vector<int32_t>(c.token_ids.begin() + static_cast<std::ptrdiff_t>(first_new_token),
                                               c.token_ids.end());
    if (first_chunk) choice["prompt_token_ids"] = config_.prompts[c.prompt].ids;
  }
  choice["finish_reason"] = final_chunk ? json(finish_reason(c)) : json(nullptr);
  chunk["choices"] = json::array({choice});
  if (config_.params.include_usage) chunk["usage"] = nullptr;
  exchange_->send_event(chunk.dump(-1, ' ', false, json::error_handler_t::replace));
}

json CompletionRun::usage() const {
  // Each prompt counts once (its n choices share it), with its best-cached choice.
  int64_t completion = 0, prompt = 0, cached = 0;
  std::vector<int> prompt_cached(config_.prompts.size(), 0);
  for (const auto& c : choices_) {
    completion += static_cast<int64_t>(c.token_ids.size());
    prompt_cached[c.prompt] = std::max(prompt_cached[c.prompt], c.num_cached_tokens);
  }
  for (size_t p = 0; p < config_.prompts.size(); ++p)
    prompt += static_cast<int64_t>(config_.prompts[p].ids.size()), cached += prompt_cached[p];
  json u = {{"prompt_tokens", prompt},
            {"completion_tokens", completion},
            {"total_tokens", prompt + completion},
            {"prompt_tokens_details", {{"cached_tokens", cached}}}};
  int64_t drafts = 0, accepted = 0;
  for (const auto& c : choices_) drafts += c.num_draft_tokens, accepted += c.num_accepted_draft_tokens;
  if (drafts > 0)  // speculative decoding: this request's drafts (an extension of OpenAI's usage)
    u["speculative"] = {{"draft_tokens", drafts}, {"accepted_tokens", accepted},
                        {"acceptance_rate", static_cast<double>(accepted) / static_cast<double>(drafts)}};
  return u;
}

void CompletionRun::fail(const Status& status) {
  failed_ = true;
  for (const auto& c : choices_)
    if (!c.done) engine_.cancel(c.engine_id, engine::FinishReason::kAbort);
  const int http_status = http_status_of(status);
  const std::string type = http_status == 504   ? "timeout"
                           : http_status == 503 ? "service_unavailable"
                           : http_status < 500  ? "invalid_request_error"
                                                : "internal_error";
  if (config_.params.stream) {
    exchange_->send_event(error_json(status.message(), type, "", std::to_string(http_status)));
    exchange_->send_event("[DONE]");
    exchange_->end_events();
  } else {
    HttpResponse r{http_status, "application/json", error_json(status.message(), type), config_.headers};
    exchange_->respond(std::move(r));
  }
}

void CompletionRun::complete() {
  if (config_.params.stream) {
    if (config_.params.include_usage) {
      json chunk = chunk_head();
      chunk["choices"] = json::array();
      chunk["usage"] = usage();
      exchange_->send_event(chunk.dump());
    }
    exchange_->send_event("[DONE]");
    exchange_->end_events();
    return;
  }
  json body = {{"id", config_.id},
               {"object", config_.chat ? "chat.completion" : "text_completion"},
               {"created", config_.created},
               {"model", config_.model}};
  json choices = json::array();
  for (size_t i = 0; i < choices_.size(); ++i) {
    Choice& c = choices_[i];
    json choice = {{"index", i}};
    if (config_.chat) {
      json message = {{"role", config_.chat_role}};
      std::string content = c.text;
      if (config_.reasoning_qwen3) {
        auto [r1, c1] = c.splitter.feed(c.text);
        auto [r2, c2] = c.splitter.finish();
        const std::string reasoning = r1 + r2;
        content = c1 + c2;
        message["reasoning_content"] = reasoning.empty() ? json(nullptr) : json(reasoning);
        message["reasoning"] = message["reasoning_content"];
      }
      if (config_.parse_tool_calls) {
        ToolCallParser parser(config_.tool_call_format, config_.tools);
        ToolCallParser::Piece piece = parser.feed(content);
        piece.append(parser.finish(c.finish_reason == "stop"));
        content = std::move(piece.content);
        for (const auto& call : piece.calls)
          message["tool_calls"].push_back(tool_call_json(i, c.num_tool_calls++, call, false));
      }
      if (!config_.forced_tools.empty()) {
        for (const auto& call : forced_calls(content))
          message["tool_calls"].push_back(tool_call_json(i, c.num_tool_calls++, call, false));
        if (c.num_tool_calls > 0) content.clear();
      }
      // Only whitespace around the calls (the newlines between blocks), or
      // nothing after the reasoning: no content (null, as vLLM).
      const bool blank = content.find_first_not_of(" \t\r\n") == std::string::npos;
      const bool after_reasoning = !message.value("reasoning_content", json()).is_null();
      message["content"] = (blank && c.num_tool_calls > 0) || (content.empty() && after_reasoning) ? json(nullptr)
                                                                                                 : json(content);
      const std::string& echo = config_.prompts[c.prompt].echo_text;  // chat echo: the final message's content first
      if (!echo.empty())
        message["content"] = echo + (message["content"].is_null() ? "" : message["content"].get<std::string>());
      choice["message"] = message;
    } else {
      choice["text"] = config_.prompts[c.prompt].echo_text + c.text;
    }
    choice["logprobs"] = logprobs_json(c, 0, true);
    if (config_.params.prompt_logprobs >= 0) {
      if (config_.chat) {
        body["prompt_logprobs"] = prompt_logprobs_json(c);  // (every choice has the same prompt)
      } else {
        choice["prompt_logprobs"] = prompt_logprobs_json(c);
      }
    }
    choice["finish_reason"] = finish_reason(c);
    if (config_.params.return_token_ids) {
      choice["token_ids"] = c.token_ids;
      choice["prompt_token_ids"] = config_.prompts[c.prompt].ids;
    }
    choices.push_back(std::move(choice));
  }
  body["choices"] = std::move(choices);
  body["usage"] = usage();
  exchange_->respond({200, "application/json", body.dump(-1, ' ', false, json::error_handler_t::replace), config_.headers});
}

}  // namespace moe::server
