// Tool calls in the Hermes format that Qwen2.5 and Qwen3 are trained to
// write (their chat templates describe it to the model):
//
//   <tool_call>
//   {"name": "get_weather", "arguments": {"city": "Paris"}}
//   </tool_call>
//
// ToolCallParser takes the assistant's content text piece by piece (as it is
// generated) and separates the calls from the rest. Text that only may be the
// start of a tag is held back until it is decided. A block whose JSON does not
// parse, or has no string "name", stays in the content as written, as does an
// unterminated block at the end.
#pragma once

#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

namespace moe::server {

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

class ToolCallParser {
 public:
  struct Piece {
    std::string content;          // final content text
    std::vector<ToolCall> calls;  // calls completed by this piece
  };
  Piece feed(const std::string& text);
  // The end of the text: whatever is held back goes out as content.
  Piece finish();

 private:
  std::string pending_;  // undecided text: a partial tag, or an open block
  bool in_call_ = false;
};

}  // namespace moe::server
