// Tool calls as Qwen models write them, inside <tool_call> blocks (their
// chat templates describe the format to the model):
//
//   hermes (Qwen2.5, Qwen3): a JSON object per block
//     <tool_call>
//     {"name": "get_weather", "arguments": {"city": "Paris"}}
//     </tool_call>
//
//   qwen3_coder (Qwen3-Coder, Qwen3.5): XML-like, one element per argument
//     <tool_call>
//     <function=get_weather>
//     <parameter=city>
//     Paris
//     </parameter>
//     </function>
//     </tool_call>
//   A parameter's text becomes a JSON value by the type the request's tool
//   schema gives it (string, integer, number, boolean, object, array); without
//   one, JSON if it parses as such, else a string.
//
// ToolCallParser takes the assistant's content text piece by piece (as it is
// generated) and separates the calls from the rest. Text that only may be the
// start of a tag is held back until it is decided. A block that does not parse
// as a call (or names no function) stays in the content as written. A last
// block left open is a call when the model stopped there on its own (a stop
// string or token such as "</tool_call>") and its body parses; cut by
// max_tokens, it stays content. As vLLM's parser, qwen3_coder takes a
// parameter without "</parameter>" up to the next "<parameter=" or
// "</function>", and a function without "</function>" up to the block's end.
#pragma once

#include <algorithm>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace moe::server {

// The tag that opens a call block (the reasoning split ends at it too).
inline constexpr std::string_view kToolCallOpen = "<tool_call>";

// Length of the longest suffix of `text` that is a proper prefix of `tag`
// (text to hold back while it may still become the tag).
inline size_t partial_tag(std::string_view text, std::string_view tag) {
  for (size_t n = std::min(text.size(), tag.size() - 1); n > 0; --n)
    if (text.substr(text.size() - n) == tag.substr(0, n)) return n;
  return 0;
}

struct ToolCall {
  std::string name;
  std::string arguments;  // JSON text ("{}" when the model wrote none)
};

enum class ToolCallFormat { kHermes, kQwen3Coder };

class ToolCallParser {
 public:
  // `tools`: the request's tools (an array of {"type": "function", "function":
  // {"name", "parameters": JSON schema}}), for qwen3_coder's argument types.
  explicit ToolCallParser(ToolCallFormat format = ToolCallFormat::kHermes,
                          nlohmann::ordered_json tools = nlohmann::ordered_json())
      : format_(format), tools_(std::move(tools)) {}
  struct Piece {
    std::string content;          // final content text
    std::vector<ToolCall> calls;  // calls completed by this piece

    void append(Piece&& next) {
      content += next.content;
      for (auto& call : next.calls) calls.push_back(std::move(call));
    }
  };
  Piece feed(const std::string& text);
  // The end of the text: an open last block becomes a call if `stopped` (the
  // model ended the text, not max_tokens) and it parses; whatever else is held
  // back goes out as content.
  Piece finish(bool stopped);

 private:
  std::optional<ToolCall> parse(std::string_view body) const;  // a block's body as a call

  ToolCallFormat format_;
  nlohmann::ordered_json tools_;
  std::string pending_;  // undecided text: a partial tag, or an open block
  bool in_call_ = false;
};

}  // namespace moe::server
