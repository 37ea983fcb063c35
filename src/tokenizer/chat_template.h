// Chat templates: the Jinja subset that Hugging Face chat templates use
// (tokenizer_config.json's "chat_template"), rendered as @huggingface/jinja does
// with transformers' settings (trim_blocks, lstrip_blocks).
//
// Supported: text, {{ }}, {% if/elif/else %}, {% for %} with loop.* and else and
// an inline `if` filter, break/continue, {% set %} (names, ns.attr, tuples, block
// set), namespace(), {% macro %} with defaults and keyword arguments, comments,
// `-` whitespace control; literals (strings, numbers, booleans, none, lists,
// tuples, dicts); and or not, in / not in, comparisons, + - * / // % ** ~,
// ternaries, attribute and index access, Python slices (including [::-1]);
// filters (tojson, length/count, trim, default/d, join, upper, lower, title,
// capitalize, replace, first, last, list, string, int, float, abs, round, items,
// dictsort, unique, reverse, sort, min, max, sum, map, select, reject, selectattr,
// rejectattr, indent, safe, escape); tests (defined, undefined, none, boolean,
// true, false, string, number, integer, float, mapping, iterable, sequence,
// callable, odd, even, divisibleby, eq/equalto/sameas, ne, lt, le, gt, ge, in,
// lower, upper); string methods (startswith, endswith, split, strip, lstrip,
// rstrip, replace, upper, lower, title, capitalize, find, count, join, isdigit,
// isalpha, isspace), mapping methods (items, keys, values, get), list.append;
// globals range, namespace, dict, raise_exception, strftime_now.
//
// Errors (syntax and run time) name the line and column. Rendering is bounded
// (output size, call depth, loop iterations), so hostile messages or templates
// produce an error, never a crash or a hang.
//
// A ChatTemplate is immutable after create(): any thread may call render()
// concurrently; each render has its own state.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"

namespace moe::tokenizer {

namespace tmpl {
struct Node;
}

struct ChatTemplateLimits {
  // @huggingface/jinja ignores the argument of strip/lstrip/rstrip (it always
  // strips whitespace); Python's Jinja, which transformers and the model's
  // training used, honours it. Python is the default; the JS dialect exists so
  // the tests can show every other rendering is identical to that oracle.
  bool js_strip_dialect = false;
  size_t max_output_bytes = size_t{16} << 20;
  int max_call_depth = 64;
  int64_t max_loop_iterations = int64_t{1} << 18;  // all loops of one render
};

class ChatTemplate {
 public:
  static Expected<ChatTemplate> create(std::string_view source, ChatTemplateLimits limits = {});

  // Renders with `context`'s keys as the template's variables (messages, tools,
  // add_generation_prompt, enable_thinking, bos_token, any chat_template_kwargs).
  // Object keys keep their order, so tojson prints them as the client sent them.
  Expected<std::string> render(const nlohmann::ordered_json& context) const;

 private:
  using Program = std::vector<std::unique_ptr<tmpl::Node>>;
  ChatTemplate(std::shared_ptr<const Program> program, ChatTemplateLimits limits)
      : program_(std::move(program)), limits_(limits) {}

  std::shared_ptr<const Program> program_;
  ChatTemplateLimits limits_;
};

// The context transformers' apply_chat_template builds: messages, tools (when not
// null), add_generation_prompt, bos_token / eos_token, then every key of `kwargs`
// (chat_template_kwargs such as enable_thinking), which may override the others.
nlohmann::ordered_json make_chat_context(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                                         bool add_generation_prompt, const std::string& bos_token,
                                         const std::string& eos_token,
                                         const nlohmann::ordered_json& kwargs = nlohmann::ordered_json::object());

// Python's str.strip() / lstrip() / rstrip() without arguments: the
// whitespace (str.isspace) at the chosen ends removed.
std::string strip_whitespace(std::string_view s, bool left, bool right);

// transformers' continue_final_message: `rendered` (a conversation rendered
// without a generation prompt) cut right after the last occurrence of its
// final message's text `final_content`, stripped of whitespace, so that what
// the template puts after a message (its end of turn) is gone and the model
// continues the text. Trailing whitespace of the message stays when the
// rendering kept it there. An error when the stripped text does not occur
// (the template rewrote it).
Expected<std::string> continue_final_message(const std::string& rendered, const std::string& final_content);

}  // namespace moe::tokenizer
