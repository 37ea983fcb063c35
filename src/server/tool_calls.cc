#include "server/tool_calls.h"

#include <nlohmann/json.hpp>
#include <optional>

namespace moe::server {
namespace {

constexpr std::string_view kOpen = "<tool_call>";
constexpr std::string_view kClose = "</tool_call>";

// The call a block's body describes, if it is one.
std::optional<ToolCall> parse_call(std::string_view body) {
  const auto j = nlohmann::ordered_json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return std::nullopt;
  const auto name = j.find("name");
  if (name == j.end() || !name->is_string() || name->get<std::string>().empty()) return std::nullopt;
  ToolCall call{name->get<std::string>(), "{}"};
  // "arguments" as the model wrote it: an object (or any JSON value), or a
  // string that already holds the JSON text.
  if (const auto args = j.find("arguments"); args != j.end() && !args->is_null())
    call.arguments = args->is_string() ? args->get<std::string>() : args->dump();
  return call;
}

}  // namespace

ToolCallParser::Piece ToolCallParser::feed(const std::string& text) {
  pending_ += text;
  Piece out;
  while (true) {
    if (!in_call_) {
      const size_t open = pending_.find(kOpen);
      if (open == std::string::npos) {
        const size_t keep = partial_tag(pending_, kOpen);
        out.content += pending_.substr(0, pending_.size() - keep);
        pending_.erase(0, pending_.size() - keep);
        return out;
      }
      out.content += pending_.substr(0, open);
      pending_.erase(0, open);  // pending_ starts with the open tag
      in_call_ = true;
    }
    const size_t close = pending_.find(kClose, kOpen.size());
    if (close == std::string::npos) return out;  // the block is still open
    const std::string_view body = std::string_view(pending_).substr(kOpen.size(), close - kOpen.size());
    if (auto call = parse_call(body)) {
      out.calls.push_back(std::move(*call));
    } else {
      out.content += pending_.substr(0, close + kClose.size());
    }
    pending_.erase(0, close + kClose.size());
    in_call_ = false;
  }
}

ToolCallParser::Piece ToolCallParser::finish() {
  Piece out;
  out.content = std::move(pending_);
  pending_.clear();
  in_call_ = false;
  return out;
}

}  // namespace moe::server
