#include "server/tool_calls.h"

#include <nlohmann/json.hpp>
#include <algorithm>
#include <cctype>
#include <optional>

namespace moe::server {
namespace {

constexpr std::string_view kClose = "</tool_call>";

using Json = nlohmann::ordered_json;

// hermes: the call a block's body describes, if it is one.
std::optional<ToolCall> parse_json_call(std::string_view body) {
  const auto j = nlohmann::ordered_json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return std::nullopt;
  const auto name = j.find("name");
  if (name == j.end() || !name->is_string() || name->get<std::string>().empty()) return std::nullopt;
  ToolCall call{name->get<std::string>(), "{}"};
  // "arguments" as the model wrote it: an object (or any JSON value), or a
  // string that already holds an object's JSON text; any other string is
  // passed on as a JSON string (as vLLM's json.dumps), so that the arguments
  // are always JSON a client can parse.
  if (const auto args = j.find("arguments"); args != j.end() && !args->is_null()) {
    call.arguments = args->dump();
    if (args->is_string()) {
      const auto inner = nlohmann::ordered_json::parse(args->get<std::string>(), nullptr, false);
      if (!inner.is_discarded() && inner.is_object()) call.arguments = args->get<std::string>();
    }
  }
  return call;
}

std::string_view trim_newlines(std::string_view v) {
  if (v.starts_with('\n')) v.remove_prefix(1);
  if (v.ends_with('\n')) v.remove_suffix(1);
  return v;
}

// The JSON schema type of parameter `key` of function `name` in `tools`, or "".
std::string schema_type(const Json& tools, const std::string& name, const std::string& key) {
  if (!tools.is_array()) return {};
  for (const auto& tool : tools) {
    const Json* f = tool.is_object() && tool.contains("function") ? &tool["function"] : &tool;
    if (!f->is_object() || !f->contains("name") || (*f)["name"] != name) continue;
    const auto params = f->find("parameters");
    if (params == f->end() || !params->is_object() || !params->contains("properties")) return {};
    const auto& props = (*params)["properties"];
    if (!props.is_object() || !props.contains(key) || !props[key].is_object()) return {};
    const auto type = props[key].find("type");
    return type != props[key].end() && type->is_string() ? type->get<std::string>() : std::string();
  }
  return {};
}

// A parameter's text as a JSON value of its schema type. As vLLM's
// qwen3_coder parser: "null" (any case) is null whatever the type, and a
// boolean may be written True / False.
Json typed_value(std::string_view text, const std::string& type) {
  std::string lower(text);
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char ch) { return std::tolower(ch); });
  if (lower == "null") return nullptr;
  if (type == "boolean" && (lower == "true" || lower == "false")) return lower == "true";
  if (type == "string") return std::string(text);
  const Json parsed = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) return std::string(text);
  if (type.empty()) return parsed;
  const bool fits = (type == "integer" && parsed.is_number_integer()) ||
                    (type == "number" && parsed.is_number()) || (type == "boolean" && parsed.is_boolean()) ||
                    (type == "object" && parsed.is_object()) || (type == "array" && parsed.is_array()) ||
                    (type == "null" && parsed.is_null());
  return fits ? parsed : Json(std::string(text));
}

// qwen3_coder: <function=NAME> (<parameter=KEY>VALUE</parameter>)* </function>,
// either end tag may be missing (as vLLM's parser reads it).
std::optional<ToolCall> parse_xml_call(std::string_view body, const Json& tools) {
  constexpr std::string_view kFunction = "<function=", kFunctionEnd = "</function>";
  constexpr std::string_view kParameter = "<parameter=", kParameterEnd = "</parameter>";
  auto skip_space = [](std::string_view& v) {
    while (!v.empty() && (v.front() == ' ' || v.front() == '\n' || v.front() == '\t' || v.front() == '\r'))
      v.remove_prefix(1);
  };
  skip_space(body);
  if (!body.starts_with(kFunction)) return std::nullopt;
  body.remove_prefix(kFunction.size());
  const size_t name_end = body.find('>');
  if (name_end == std::string_view::npos || name_end == 0) return std::nullopt;
  const std::string name(body.substr(0, name_end));
  body.remove_prefix(name_end + 1);
  Json args = Json::object();
  while (true) {
    skip_space(body);
    if (body.starts_with(kFunctionEnd) || body.empty()) break;
    if (!body.starts_with(kParameter)) return std::nullopt;
    body.remove_prefix(kParameter.size());
    const size_t key_end = body.find('>');
    if (key_end == std::string_view::npos || key_end == 0) return std::nullopt;
    // The value ends at its "</parameter>"; where that is missing, at the next
    // parameter, else at the function's end, else at the block's.
    const size_t close = body.find(kParameterEnd, key_end);
    const size_t next = body.find(kParameter, key_end);
    size_t value_end = close, skip = kParameterEnd.size();
    if (close == std::string_view::npos || next < close) {
      value_end = std::min({next, body.rfind(kFunctionEnd), body.size()});
      if (value_end < key_end) value_end = body.size();
      skip = 0;
    }
    const std::string key(body.substr(0, key_end));
    args[key] = typed_value(trim_newlines(body.substr(key_end + 1, value_end - key_end - 1)),
                            schema_type(tools, name, key));
    body.remove_prefix(value_end + skip);
  }
  if (body.starts_with(kFunctionEnd)) body.remove_prefix(kFunctionEnd.size());
  skip_space(body);
  if (!body.empty()) return std::nullopt;  // text after the function: not a call as the format has it
  return ToolCall{name, args.dump()};
}

}  // namespace

ToolCallParser::Piece ToolCallParser::feed(const std::string& text) {
  pending_ += text;
  Piece out;
  while (true) {
    if (!in_call_) {
      const size_t open = pending_.find(kToolCallOpen);
      if (open == std::string::npos) {
        const size_t keep = partial_tag(pending_, kToolCallOpen);
        out.content += pending_.substr(0, pending_.size() - keep);
        pending_.erase(0, pending_.size() - keep);
        return out;
      }
      out.content += pending_.substr(0, open);
      pending_.erase(0, open);  // pending_ starts with the open tag
      in_call_ = true;
    }
    const size_t close = pending_.find(kClose, kToolCallOpen.size());
    if (close == std::string::npos) return out;  // the block is still open
    const std::string_view body =
        std::string_view(pending_).substr(kToolCallOpen.size(), close - kToolCallOpen.size());
    if (auto call = parse(body)) {
      out.calls.push_back(std::move(*call));
    } else {
      out.content += pending_.substr(0, close + kClose.size());
    }
    pending_.erase(0, close + kClose.size());
    in_call_ = false;
  }
}

std::optional<ToolCall> ToolCallParser::parse(std::string_view body) const {
  return format_ == ToolCallFormat::kHermes ? parse_json_call(body) : parse_xml_call(body, tools_);
}

ToolCallParser::Piece ToolCallParser::finish(bool stopped) {
  Piece out;
  std::optional<ToolCall> call;
  if (in_call_ && stopped) call = parse(std::string_view(pending_).substr(kToolCallOpen.size()));
  if (call) out.calls.push_back(std::move(*call));
  else out.content = std::move(pending_);
  pending_.clear();
  in_call_ = false;
  return out;
}

}  // namespace moe::server
