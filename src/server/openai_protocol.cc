#include "server/openai_protocol.h"

#include <algorithm>
#include <charconv>
#include <limits>

namespace moe::server {
namespace {

using nlohmann::json;
using Json = nlohmann::ordered_json;

// Each reader leaves `out` unchanged when the field is absent or null.
std::optional<ApiError> read_bool(const Json& j, const char* key, bool& out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::nullopt;
  if (!it->is_boolean()) return bad_request(fmt::format("'{}' must be a boolean", key), key);
  out = it->get<bool>();
  return std::nullopt;
}

std::optional<ApiError> read_int(const Json& j, const char* key, int64_t lo, int64_t hi, std::optional<int64_t>& out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::nullopt;
  if (!it->is_number_integer() && !(it->is_number_float() && it->get<double>() == static_cast<int64_t>(it->get<double>())))
    return bad_request(fmt::format("'{}' must be an integer", key), key);
  const double v = it->get<double>();
  if (v < static_cast<double>(lo) || v > static_cast<double>(hi))
    return bad_request(fmt::format("'{}' must be between {} and {}, got {}", key, lo, hi, it->dump()), key);
  out = it->is_number_unsigned() ? static_cast<int64_t>(it->get<uint64_t>()) : it->get<int64_t>();
  return std::nullopt;
}

std::optional<ApiError> read_float(const Json& j, const char* key, double lo, double hi, float& out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::nullopt;
  if (!it->is_number()) return bad_request(fmt::format("'{}' must be a number", key), key);
  const double v = it->get<double>();
  if (!(v >= lo && v <= hi)) return bad_request(fmt::format("'{}' must be between {} and {}, got {}", key, lo, hi, v), key);
  out = static_cast<float>(v);
  return std::nullopt;
}

#define MOE_API_TRY(expr)                  \
  do {                                     \
    if (auto api_error_ = (expr)) return *api_error_; \
  } while (0)

// Fields this server does not implement: accepted at their neutral value
// (what clients send by default), a 400 naming the field otherwise, so that a
// request is never served as if they had been applied.
std::optional<ApiError> reject_unsupported(const Json& j) {
  auto unsupported = [](const char* key, const char* neutral) {
    return bad_request(
        fmt::format("'{}' is not supported by this server (send {} or leave it out)", key, neutral), key);
  };
  if (auto it = j.find("length_penalty"); it != j.end() && !it->is_null()) {  // beam search's
    if (!it->is_number()) return bad_request("'length_penalty' must be a number", "length_penalty");
    if (it->get<double>() != 1.0) return unsupported("length_penalty", "1");
  }
  if (auto it = j.find("suffix");
      it != j.end() && !it->is_null() && !(it->is_string() && it->get<std::string>().empty()))
    return unsupported("suffix", "\"\"");
  if (auto it = j.find("tool_choice"); it != j.end() && !it->is_null()) {
    const bool named = it->is_object() && it->value("type", "") == "function" && it->contains("function") &&
                       (*it)["function"].is_object() && (*it)["function"].contains("name") &&
                       (*it)["function"]["name"].is_string();
    if (!named && (!it->is_string() || (*it != "none" && *it != "auto" && *it != "required")))
      return bad_request(
          "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": "
          "{\"name\": ...}}",
          "tool_choice");
  }
  if (auto it = j.find("guided_whitespace_pattern"); it != j.end() && !it->is_null())
    return unsupported("guided_whitespace_pattern", "null");
  if (auto it = j.find("use_beam_search"); it != j.end() && !it->is_null() && *it != false)  // vLLM's
    return unsupported("use_beam_search", "false");
  return std::nullopt;
}

// vLLM's bad_words (strings; the server tokenizes them) and allowed_token_ids
// (distinct ids, sorted; ids outside the vocabulary are refused at submission).
std::optional<ApiError> read_token_restrictions(const Json& j, const RequestLimits& limits, GenerationParams& p) {
  if (auto it = j.find("bad_words"); it != j.end() && !it->is_null()) {
    const auto error = [] { return bad_request("'bad_words' must be an array of non-empty strings", "bad_words"); };
    if (!it->is_array()) return error();
    if (static_cast<int>(it->size()) > limits.max_bad_words)
      return bad_request(fmt::format("'bad_words' may hold at most {} words", limits.max_bad_words), "bad_words");
    for (const auto& word : *it) {
      if (!word.is_string() || word.get_ref<const std::string&>().empty()) return error();
      p.bad_words.push_back(word.get<std::string>());
    }
  }
  if (auto it = j.find("allowed_token_ids"); it != j.end() && !it->is_null()) {
    const auto error = [] {
      return bad_request("'allowed_token_ids' must be a non-empty array of token ids", "allowed_token_ids");
    };
    if (!it->is_array() || it->empty()) return error();
    std::vector<int32_t>& ids = p.sampling.allowed_token_ids;
    for (const auto& id : *it) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > std::numeric_limits<int32_t>::max())
        return error();
      ids.push_back(id.get<int32_t>());
    }
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  }
  return std::nullopt;
}

// OpenAI's logit_bias: an object from token ids (as strings) to a bias in
// [-100, 100]. Ids outside the vocabulary are refused at submission.
std::optional<ApiError> read_logit_bias(const Json& j, const RequestLimits& limits,
                                        std::vector<std::pair<int32_t, float>>& out) {
  auto it = j.find("logit_bias");
  if (it == j.end() || it->is_null()) return std::nullopt;
  const auto error = [] {
    return bad_request("'logit_bias' must be an object from token ids to numbers between -100 and 100",
                       "logit_bias");
  };
  if (!it->is_object()) return error();
  if (static_cast<int>(it->size()) > limits.max_logit_bias)
    return bad_request(fmt::format("'logit_bias' may hold at most {} tokens", limits.max_logit_bias),
                       "logit_bias");
  for (const auto& [key, value] : it->items()) {
    int64_t id = -1;
    const auto [end, ec] = std::from_chars(key.data(), key.data() + key.size(), id);
    if (ec != std::errc() || end != key.data() + key.size() || id < 0 ||
        id > std::numeric_limits<int32_t>::max() || !value.is_number())
      return error();
    const double bias = value.get<double>();
    if (!(bias >= -100 && bias <= 100)) return error();
    out.emplace_back(static_cast<int32_t>(id), static_cast<float>(bias));
  }
  return std::nullopt;
}

// A JSON document given as itself or as its text (vLLM takes both), its
// nesting checked before any copy (copies recurse).
std::optional<ApiError> read_document(const Json& value, const char* param, const char* what, Json& out) {
  if (structured::nesting_exceeds(value, structured::kMaxSchemaNesting))
    return bad_request(fmt::format("'{}': the {} nests deeper than {} levels", param, what,
                                   structured::kMaxSchemaNesting),
                       param);
  out = value;
  if (value.is_string()) {
    out = Json::parse(value.get<std::string>(), nullptr, /*allow_exceptions=*/false);
    if (out.is_discarded()) return bad_request(fmt::format("'{}' is not valid JSON", param), param);
  }
  return std::nullopt;
}

// A JSON schema as a grammar.
std::optional<ApiError> compile_schema(const Json& schema, const char* param, const structured::JsonOptions& options,
                                       GenerationParams& p) {
  Json parsed;
  MOE_API_TRY(read_document(schema, param, "JSON schema", parsed));
  if (!parsed.is_object() && !parsed.is_boolean())
    return bad_request(fmt::format("'{}' must be a JSON schema (an object)", param), param);
  auto grammar = structured::Grammar::from_json_schema(parsed, options);
  if (!grammar) return bad_request(fmt::format("'{}': {}", param, grammar.status().message()), param);
  p.grammar = *grammar;
  return std::nullopt;
}

// A regular expression the whole output must match (structured/regex.h).
std::optional<ApiError> compile_regex(const Json& pattern, const char* param, GenerationParams& p) {
  if (!pattern.is_string()) return bad_request(fmt::format("'{}' must be a string", param), param);
  auto grammar = structured::Grammar::from_regex(pattern.get<std::string>());
  if (!grammar) return bad_request(fmt::format("'{}': {}", param, grammar.status().message()), param);
  p.grammar = *grammar;
  return std::nullopt;
}

// An EBNF grammar the whole output must follow (structured/cfg.h).
std::optional<ApiError> compile_ebnf(const Json& text, const char* param, GenerationParams& p) {
  if (!text.is_string()) return bad_request(fmt::format("'{}' must be a string (an EBNF grammar)", param), param);
  auto grammar = structured::Grammar::from_ebnf(text.get<std::string>());
  if (!grammar) return bad_request(fmt::format("'{}': {}", param, grammar.status().message()), param);
  p.grammar = *grammar;
  return std::nullopt;
}

// vLLM's structural_tag: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}.
std::optional<ApiError> compile_structural_tag(const Json& spec, const char* param,
                                               const structured::JsonOptions& options, GenerationParams& p) {
  Json parsed;
  MOE_API_TRY(read_document(spec, param, "structural tag", parsed));
  auto grammar = structured::Grammar::from_structural_tag(parsed, options);
  if (!grammar) return bad_request(fmt::format("'{}': {}", param, grammar.status().message()), param);
  p.grammar = *grammar;
  return std::nullopt;
}

std::optional<ApiError> compile_choices(const Json& choices, const char* param, GenerationParams& p) {
  std::vector<std::string> strings;
  if (choices.is_array())
    for (const Json& c : choices)
      if (c.is_string()) strings.push_back(c.get<std::string>());
  if (!choices.is_array() || strings.size() != choices.size())
    return bad_request(fmt::format("'{}' must be an array of strings", param), param);
  auto grammar = structured::Grammar::from_choices(strings);
  if (!grammar) return bad_request(fmt::format("'{}': {}", param, grammar.status().message()), param);
  p.grammar = *grammar;
  return std::nullopt;
}

// Structured outputs (docs/server.md): OpenAI's response_format (json_object,
// json_schema; vLLM's structural_tag), vLLM's guided_json / guided_choice /
// guided_regex / guided_grammar / structural_tag and structured_outputs {json,
// choice, regex, grammar, json_object, structural_tag}; at most one of them.
// whitespace_pattern is refused by name.
std::optional<ApiError> read_structured_output(const Json& j, GenerationParams& p) {
  int count = 0;
  // structured_outputs' options for the JSON written, whichever field asks for JSON.
  structured::JsonOptions options;
  if (auto it = j.find("structured_outputs"); it != j.end() && it->is_object()) {
    for (const auto& [key, field] : {std::pair{"disable_any_whitespace", &structured::JsonOptions::any_whitespace},
                                     std::pair{"disable_additional_properties",
                                               &structured::JsonOptions::additional_properties}}) {
      const auto value = it->find(key);
      if (value == it->end() || value->is_null()) continue;
      if (!value->is_boolean())
        return bad_request(fmt::format("'structured_outputs.{}' must be a boolean", key), "structured_outputs");
      options.*field = !value->get<bool>();
    }
  }
  if (auto it = j.find("response_format"); it != j.end() && !it->is_null()) {
    const char* param = "response_format";
    if (!it->is_object() || !it->contains("type") || !(*it)["type"].is_string())
      return bad_request("'response_format' must be an object with a 'type'", param);
    const std::string type = (*it)["type"].get<std::string>();
    if (type == "json_object") {
      p.grammar = structured::Grammar::json_object(options), ++count;
    } else if (type == "json_schema") {
      const auto spec = it->find("json_schema");
      if (spec == it->end() || !spec->is_object() || !spec->contains("schema"))
        return bad_request("'response_format' of type json_schema needs 'json_schema': {\"name\", \"schema\"}", param);
      MOE_API_TRY(compile_schema((*spec)["schema"], param, options, p));
      ++count;
    } else if (type == "structural_tag") {
      MOE_API_TRY(compile_structural_tag(*it, param, options, p));
      ++count;
    } else if (type != "text") {
      return bad_request(fmt::format("'response_format' type '{}' is not supported by this server (text, json_object, "
                                     "json_schema, structural_tag)", type),
                         param);
    }
  }
  if (auto it = j.find("guided_json"); it != j.end() && !it->is_null()) {
    MOE_API_TRY(compile_schema(*it, "guided_json", options, p));
    ++count;
  }
  if (auto it = j.find("guided_choice"); it != j.end() && !it->is_null()) {
    MOE_API_TRY(compile_choices(*it, "guided_choice", p));
    ++count;
  }
  if (auto it = j.find("guided_regex"); it != j.end() && !it->is_null()) {
    MOE_API_TRY(compile_regex(*it, "guided_regex", p));
    ++count;
  }
  if (auto it = j.find("guided_grammar"); it != j.end() && !it->is_null()) {
    MOE_API_TRY(compile_ebnf(*it, "guided_grammar", p));
    ++count;
  }
  if (auto it = j.find("structural_tag"); it != j.end() && !it->is_null()) {
    MOE_API_TRY(compile_structural_tag(*it, "structural_tag", options, p));
    ++count;
  }
  if (auto it = j.find("structured_outputs"); it != j.end() && !it->is_null()) {
    const char* param = "structured_outputs";
    if (!it->is_object()) return bad_request("'structured_outputs' must be an object", param);
    for (const auto& [key, value] : it->items()) {
      if (value.is_null() || (key == "json_object" && value == false)) continue;
      if (key == "json") {
        MOE_API_TRY(compile_schema(value, param, options, p));
      } else if (key == "choice") {
        MOE_API_TRY(compile_choices(value, param, p));
      } else if (key == "regex") {
        MOE_API_TRY(compile_regex(value, param, p));
      } else if (key == "grammar") {
        MOE_API_TRY(compile_ebnf(value, param, p));
      } else if (key == "json_object") {
        if (value != true) return bad_request("'structured_outputs.json_object' must be a boolean", param);
        p.grammar = structured::Grammar::json_object(options);
      } else if (key == "structural_tag") {
        MOE_API_TRY(compile_structural_tag(value, param, options, p));
      } else if (key == "whitespace_pattern") {
        return bad_request("'structured_outputs.whitespace_pattern' is not supported by this server (json, choice, "
                           "regex, grammar, json_object and structural_tag are)",
                           param);
      } else {
        continue;  // options: disable_any_whitespace and disable_additional_properties read above, the others
                   // (disable_fallback, ...) choose among backends: nothing to apply
      }
      ++count;
    }
  }
  if (count > 1)
    return bad_request("one structured output at a time: response_format, guided_json, guided_choice, "
                       "guided_regex, guided_grammar, structural_tag or structured_outputs",
                       "response_format");
  return std::nullopt;
}

std::optional<ApiError> read_common(const Json& j, const RequestLimits& limits, GenerationParams& p) {
  MOE_API_TRY(reject_unsupported(j));
  MOE_API_TRY(read_structured_output(j, p));
  p.sampling = limits.default_sampling;
  if (auto it = j.find("model"); it != j.end() && !it->is_null()) {
    if (!it->is_string()) return bad_request("'model' must be a string", "model");
    p.model = it->get<std::string>();
  }
  std::optional<int64_t> v;
  MOE_API_TRY(read_int(j, "max_tokens", 1, std::numeric_limits<int32_t>::max(), v));
  if (v) p.max_tokens = static_cast<int>(*v);
  v.reset();
  MOE_API_TRY(read_int(j, "max_completion_tokens", 1, std::numeric_limits<int32_t>::max(), v));
  if (v) p.max_tokens = static_cast<int>(*v);
  MOE_API_TRY(read_float(j, "temperature", 0, 100, p.sampling.temperature));
  MOE_API_TRY(read_float(j, "top_p", 1e-9, 1, p.sampling.top_p));
  MOE_API_TRY(read_float(j, "min_p", 0, 1, p.sampling.min_p));
  v.reset();
  MOE_API_TRY(read_int(j, "top_k", -1, std::numeric_limits<int32_t>::max(), v));
  if (v) p.sampling.top_k = *v <= 0 ? 0 : static_cast<int>(*v);
  MOE_API_TRY(read_float(j, "presence_penalty", -2, 2, p.sampling.presence_penalty));
  MOE_API_TRY(read_float(j, "frequency_penalty", -2, 2, p.sampling.frequency_penalty));
  MOE_API_TRY(read_float(j, "repetition_penalty", 1e-6, 2, p.sampling.repetition_penalty));
  v.reset();
  MOE_API_TRY(read_int(j, "min_tokens", 0, std::numeric_limits<int32_t>::max(), v));
  if (v) p.sampling.min_tokens = static_cast<int>(*v);
  if (p.max_tokens && p.sampling.min_tokens > *p.max_tokens)
    return bad_request(fmt::format("'min_tokens' ({}) must not exceed 'max_tokens' ({})",
                                   p.sampling.min_tokens, *p.max_tokens),
                       "min_tokens");
  MOE_API_TRY(read_logit_bias(j, limits, p.sampling.logit_bias));
  MOE_API_TRY(read_token_restrictions(j, limits, p));
  v.reset();
  MOE_API_TRY(read_int(j, "prompt_logprobs", 0, limits.max_logprobs, v));
  if (v) p.prompt_logprobs = static_cast<int>(*v);
  v.reset();
  MOE_API_TRY(read_int(j, "seed", std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(), v));
  if (v) p.sampling.seed = static_cast<uint64_t>(*v);
  v.reset();
  MOE_API_TRY(read_int(j, "n", 1, limits.max_n, v));
  if (v) p.n = static_cast<int>(*v);
  v.reset();
  MOE_API_TRY(read_int(j, "best_of", 1, std::numeric_limits<int32_t>::max(), v));
  if (v && *v > p.n)
    return bad_request("'best_of' above 'n' is not supported by this server (send n or leave it out)",
                       "best_of");
  MOE_API_TRY(read_bool(j, "ignore_eos", p.ignore_eos));
  MOE_API_TRY(read_bool(j, "include_stop_str_in_output", p.include_stop_str_in_output));
  MOE_API_TRY(read_int(j, "truncate_prompt_tokens", 1, std::numeric_limits<int32_t>::max(), v));
  if (v) p.truncate_prompt_tokens = static_cast<int>(*v);
  v.reset();
  MOE_API_TRY(read_bool(j, "skip_special_tokens", p.skip_special_tokens));
  MOE_API_TRY(read_bool(j, "stream", p.stream));
  if (p.stream && p.prompt_logprobs >= 0)  // as vLLM
    return bad_request("'prompt_logprobs' is not available with 'stream'", "prompt_logprobs");
  MOE_API_TRY(read_bool(j, "return_token_ids", p.return_token_ids));
  if (auto it = j.find("stream_options"); it != j.end() && !it->is_null()) {
    if (!it->is_object()) return bad_request("'stream_options' must be an object", "stream_options");
    MOE_API_TRY(read_bool(*it, "include_usage", p.include_usage));
  }
  if (auto it = j.find("stop"); it != j.end() && !it->is_null()) {
    if (it->is_string()) {
      p.stop.push_back(it->get<std::string>());
    } else if (it->is_array()) {
      if (static_cast<int>(it->size()) > limits.max_stop_strings)
        return bad_request(fmt::format("'stop' may hold at most {} strings", limits.max_stop_strings), "stop");
      for (const auto& s : *it) {
        if (!s.is_string()) return bad_request("'stop' must be a string or an array of strings", "stop");
        p.stop.push_back(s.get<std::string>());
      }
    } else {
      return bad_request("'stop' must be a string or an array of strings", "stop");
    }
    for (const auto& s : p.stop)
      if (s.empty()) return bad_request("'stop' strings must not be empty", "stop");
  }
  if (auto it = j.find("stop_token_ids"); it != j.end() && !it->is_null()) {
    if (!it->is_array() || it->size() > 64) return bad_request("'stop_token_ids' must be an array of token ids", "stop_token_ids");
    for (const auto& t : *it) {
      if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > std::numeric_limits<int32_t>::max())
        return bad_request("'stop_token_ids' must be an array of token ids", "stop_token_ids");
      p.stop_token_ids.push_back(t.get<int32_t>());
    }
  }
  return std::nullopt;
}

std::optional<Json> parse_object(const std::string& body, ApiError& error) {
  Json j = Json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    error = bad_request("the request body is not valid JSON");
    return std::nullopt;
  }
  if (!j.is_object()) {
    error = bad_request("the request body must be a JSON object");
    return std::nullopt;
  }
  // Copies of a JSON value recurse: a body nested deep enough would overflow
  // the stack wherever a field of it is copied.
  constexpr size_t kMaxBodyNesting = 512;
  if (structured::nesting_exceeds(j, kMaxBodyNesting)) {
    error = bad_request(fmt::format("the request body nests deeper than {} levels", kMaxBodyNesting));
    return std::nullopt;
  }
  return j;
}

}  // namespace

ApiError context_length_error(int max_model_len, int64_t prompt_tokens, int64_t max_tokens, const std::string& param) {
  const bool chat = param == "messages";
  return bad_request(
      fmt::format("This model's maximum context length is {} tokens. However, you requested {} tokens ({} in the {}, "
                  "{} in the completion). Please reduce the length of the {} or completion.",
                  max_model_len, prompt_tokens + max_tokens, prompt_tokens, chat ? "messages" : "prompt", max_tokens,
                  chat ? "messages" : "prompt"),
      param, "context_length_exceeded");
}

std::variant<CompletionRequest, ApiError> parse_completion_request(const std::string& body, const RequestLimits& limits) {
  ApiError error;
  auto j = parse_object(body, error);
  if (!j) return error;
  CompletionRequest r;
  MOE_API_TRY(read_common(*j, limits, r.params));
  if (r.params.max_tokens == std::nullopt && !j->contains("max_tokens")) r.params.max_tokens = 16;  // OpenAI's default
  MOE_API_TRY(read_bool(*j, "echo", r.echo));
  std::optional<int64_t> lp;
  MOE_API_TRY(read_int(*j, "logprobs", 0, limits.max_logprobs, lp));
  if (lp) r.params.logprobs = static_cast<int>(*lp);
  auto it = j->find("prompt");
  if (it == j->end() || it->is_null()) return bad_request("'prompt' is required", "prompt");
  // A string or an array of token ids is one prompt; an array of those (all
  // strings or all id arrays) is a batch.
  auto read_ids = [](const Json& ids, PromptInput& out) -> std::optional<ApiError> {
    for (const auto& t : ids) {
      if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > std::numeric_limits<int32_t>::max())
        return bad_request("'prompt' token ids must be non-negative integers", "prompt");
      out.ids.push_back(t.get<int32_t>());
    }
    return std::nullopt;
  };
  const Json& prompt = *it;
  if (prompt.is_string()) {
    r.prompts.push_back({prompt.get<std::string>(), {}});
  } else if (prompt.is_array() && !prompt.empty() && prompt[0].is_number()) {
    MOE_API_TRY(read_ids(prompt, r.prompts.emplace_back()));
  } else if (prompt.is_array() && !prompt.empty() && (prompt[0].is_string() || prompt[0].is_array())) {
    const bool text = prompt[0].is_string();
    for (const auto& p : prompt) {
      if (text ? !p.is_string() : !p.is_array() || p.empty())
        return bad_request("a batch of prompts must be all strings or all non-empty arrays of token ids",
                           "prompt");
      if (text) {
        r.prompts.push_back({p.get<std::string>(), {}});
      } else {
        MOE_API_TRY(read_ids(p, r.prompts.emplace_back()));
      }
    }
  } else {
    return bad_request("'prompt' must be a string, an array of token ids, or an array of either", "prompt");
  }
  for (const auto& p : r.prompts)
    if (p.text && p.text->empty()) return bad_request("'prompt' must not be empty", "prompt");
  const int max_choices = std::max(limits.max_choices, limits.max_n);
  if (r.prompts.size() * static_cast<size_t>(r.params.n) > static_cast<size_t>(max_choices))
    return bad_request(fmt::format("{} prompts x n = {} asks for more than {} choices in one request",
                                   r.prompts.size(), r.params.n, max_choices),
                       "prompt");
  return r;
}

// A tool's parameters schema ({"type": "object", "properties": {}} when it has
// none: arguments "{}").
std::variant<Json, ApiError> tool_parameters(const Json& tool) {
  if (!tool.is_object() || !tool.contains("function") || !tool["function"].is_object() ||
      !tool["function"].contains("name") || !tool["function"]["name"].is_string())
    return bad_request("each tool must be {\"type\": \"function\", \"function\": {\"name\", \"parameters\"}}", "tools");
  const Json& f = tool["function"];
  if (auto p = f.find("parameters"); p != f.end() && !p->is_null()) return *p;
  return Json{{"type", "object"}, {"properties", Json::object()}};
}

// tool_choice "required" or a named function: the output is constrained (as
// vLLM does it) to that function's arguments (one JSON object), or to an array
// of one or more {"name", "parameters"} calls of the request's tools.
std::optional<ApiError> read_tool_choice(const Json& j, ChatRequest& r) {
  auto it = j.find("tool_choice");
  if (it == j.end() || it->is_null()) return std::nullopt;
  if (structured::nesting_exceeds(r.tools, structured::kMaxSchemaNesting))
    return bad_request(fmt::format("'tools' nest deeper than {} levels", structured::kMaxSchemaNesting), "tools");
  if (it->is_string()) r.tool_choice = it->get<std::string>();
  if (r.tool_choice != "required" && !it->is_object()) return std::nullopt;
  if (!r.tools.is_array() || r.tools.empty())
    return bad_request("'tool_choice' \"required\" or a named function needs 'tools'", "tool_choice");
  if (r.params.grammar)
    return bad_request("'tool_choice' \"required\" or a named function constrains the output itself: send no "
                       "response_format or guided_* with it",
                       "tool_choice");
  Json schema;
  if (it->is_object()) {
    r.tool_choice = "function";
    r.forced_tool = (*it)["function"]["name"].get<std::string>();
    for (const Json& tool : r.tools) {
      auto parameters = tool_parameters(tool);
      if (auto* e = std::get_if<ApiError>(&parameters)) return *e;
      if (tool["function"]["name"] == r.forced_tool) schema = std::get<Json>(parameters);
    }
    if (schema.is_null())
      return bad_request(fmt::format("'tool_choice' names the function '{}', which is not in 'tools'", r.forced_tool),
                         "tool_choice");
  } else {
    Json calls = Json::array();
    for (const Json& tool : r.tools) {
      auto parameters = tool_parameters(tool);
      if (auto* e = std::get_if<ApiError>(&parameters)) return *e;
      calls.push_back({{"type", "object"},
                       {"properties", {{"name", {{"const", tool["function"]["name"]}}},
                                       {"parameters", std::get<Json>(parameters)}}},
                       {"required", {"name", "parameters"}}});
    }
    schema = {{"type", "array"}, {"minItems", 1}, {"items", {{"anyOf", calls}}}};
  }
  auto grammar = structured::Grammar::from_json_schema(schema);
  if (!grammar) return bad_request(fmt::format("'tools': {}", grammar.status().message()), "tools");
  r.params.grammar = *grammar;
  return std::nullopt;
}

std::variant<ChatRequest, ApiError> parse_chat_request(const std::string& body, const RequestLimits& limits) {
  ApiError error;
  auto j = parse_object(body, error);
  if (!j) return error;
  ChatRequest r;
  MOE_API_TRY(read_common(*j, limits, r.params));
  bool logprobs = false;
  MOE_API_TRY(read_bool(*j, "logprobs", logprobs));
  std::optional<int64_t> top;
  MOE_API_TRY(read_int(*j, "top_logprobs", 0, limits.max_logprobs, top));
  if (top && !logprobs) return bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs");
  if (logprobs) r.params.logprobs = static_cast<int>(top.value_or(0));
  MOE_API_TRY(read_bool(*j, "add_generation_prompt", r.add_generation_prompt));
  MOE_API_TRY(read_bool(*j, "continue_final_message", r.continue_final_message));
  if (r.continue_final_message && r.add_generation_prompt)
    return bad_request("'continue_final_message' and 'add_generation_prompt' cannot both be true (send "
                       "\"add_generation_prompt\": false to continue the final message)",
                       "continue_final_message");
  MOE_API_TRY(read_bool(*j, "echo", r.echo));
  if (auto it = j->find("chat_template_kwargs"); it != j->end() && !it->is_null()) {
    if (!it->is_object()) return bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs");
    r.chat_template_kwargs = *it;
  }
  if (auto it = j->find("tools"); it != j->end() && !it->is_null()) {
    if (!it->is_array()) return bad_request("'tools' must be an array", "tools");
    r.tools = *it;
  }
  MOE_API_TRY(read_tool_choice(*j, r));
  auto it = j->find("messages");
  if (it == j->end() || !it->is_array() || it->empty())
    return bad_request("'messages' must be a non-empty array", "messages");
  r.messages = Json::array();
  for (const auto& m : *it) {
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      return bad_request("each message must be an object with a string 'role'", "messages");
    Json message = m;
    const auto& content = m.contains("content") ? m["content"] : Json();
    if (content.is_array()) {  // [{type: "text", text}] parts, joined
      std::string text;
      for (const auto& part : content) {
        if (!part.is_object() || !part.contains("type") || part["type"] != "text" || !part.contains("text") ||
            !part["text"].is_string())
          return bad_request("only text content parts are supported", "messages");
        text += part["text"].get<std::string>();
      }
      message["content"] = text;
    } else if (!content.is_string() && !content.is_null()) {
      return bad_request("message 'content' must be a string, an array of text parts or null", "messages");
    }
    r.messages.push_back(std::move(message));
  }
  return r;
}

}  // namespace moe::server
