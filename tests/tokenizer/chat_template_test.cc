// Chat-template behaviour that needs no oracle: errors name the line and column,
// hostile templates and contexts end in an error (never a crash or a hang), and
// Python's strip(chars) semantics in the default dialect.
#include <gtest/gtest.h>

#include "tokenizer/chat_template.h"

namespace moe::tokenizer {
namespace {

std::string render(const std::string& source, const nlohmann::ordered_json& context = nlohmann::ordered_json::object()) {
  auto t = ChatTemplate::create(source);
  if (!t) return "ERROR " + t.status().message();
  auto out = t->render(context);
  return out ? *out : "ERROR " + out.status().message();
}

TEST(ChatTemplate, SyntaxErrorsNameLineAndColumn) {
  EXPECT_EQ(render("line one\n{% if x %}\n  {{ x + }}\n{% endif %}"),
            "ERROR chat template line 3 column 10: unexpected '}}' in expression");
  EXPECT_EQ(render("{% for x in y %}"), "ERROR chat template line 1 column 17: unexpected end of template: missing '{% else %}'");
  EXPECT_EQ(render("{{ 'abc }}"), "ERROR chat template line 1 column 11: unterminated string literal");
  EXPECT_EQ(render("ok\n {% frobnicate %}"), "ERROR chat template line 2 column 5: unknown statement 'frobnicate'");
}

TEST(ChatTemplate, RuntimeErrorsNameLineAndColumn) {
  EXPECT_EQ(render("\n{{ raise_exception('bad role') }}"), "ERROR chat template line 2 column 19: raise_exception: bad role");
  EXPECT_EQ(render("{{ 1 + none }}"), "ERROR chat template line 1 column 6: cannot apply '+' to none");
  EXPECT_EQ(render("{{ x.startswith('a') }}"), "ERROR chat template line 1 column 6: undefined has no method 'startswith'");
}

TEST(ChatTemplate, HostileInputsAreBounded) {
  EXPECT_TRUE(render("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}").starts_with("ERROR"));
  EXPECT_TRUE(render("{% for i in range(100000000) %}{% endfor %}").starts_with("ERROR"));
  EXPECT_TRUE(render("{% for i in range(5000) %}{% for j in range(5000) %}{% endfor %}{% endfor %}").starts_with("ERROR"));
  // A container stored inside itself would be a reference cycle: refused, not leaked.
  EXPECT_TRUE(render("{% set ns = namespace(a=1) %}{% set ns.b = ns %}{{ ns | tojson }}").starts_with("ERROR"));
  EXPECT_TRUE(render("{% set ns = namespace(a=namespace()) %}{% set ns.a.up = ns %}").starts_with("ERROR"));
  EXPECT_TRUE(render("{% set l = [] %}{% set _ = l.append(l) %}").starts_with("ERROR"));
  EXPECT_EQ(render("{% set ns = namespace(a=1) %}{% set other = namespace(b=2) %}{% set ns.o = other %}{{ ns.o.b }}"), "2");
  EXPECT_TRUE(render("{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}").starts_with("ERROR"));
  EXPECT_TRUE(render("{{ 'x' * 1000000000000 }}").starts_with("ERROR"));
  nlohmann::ordered_json deep = "leaf";
  for (int i = 0; i < 1000; ++i) deep = nlohmann::ordered_json::array({deep});
  EXPECT_TRUE(render("{{ x }}", {{"x", deep}}).starts_with("ERROR"));
}

TEST(ChatTemplate, PythonStripHonoursItsArgument) {
  EXPECT_EQ(render("[{{ '\\n  a \\n'.lstrip('\\n') }}][{{ 'xxhixx'.strip('x') }}][{{ '  b  '.strip() }}]"),
            "[  a \n][hi][b]");
  ChatTemplateLimits js;
  js.js_strip_dialect = true;
  auto t = ChatTemplate::create("[{{ '\\n  a \\n'.lstrip('\\n') }}]", js);
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(*t->render(nlohmann::ordered_json::object()), "[a \n]");
}

// transformers' continue_final_message: the rendering cut after the final
// message's last occurrence -- after the whole message where the rendering
// kept it so, else after its stripped text; an error where the template
// rewrote the text.
TEST(ChatTemplate, ContinueFinalMessageCutsAfterTheMessage) {
  auto cut = [](const std::string& rendered, const std::string& content) {
    auto r = continue_final_message(rendered, content);
    return r ? *r : "error: " + r.status().message();
  };
  EXPECT_EQ(cut("<u>Hi</u><a>Hi there</a>\n", "Hi there"), "<u>Hi</u><a>Hi there");
  EXPECT_EQ(cut("<a>Hi</a><a>Hi</a>", "Hi"), "<a>Hi</a><a>Hi") << "the last occurrence";
  EXPECT_EQ(cut("<a>Well  </a>", "Well  "), "<a>Well  ") << "trailing whitespace kept by the template";
  EXPECT_EQ(cut("<a>Well</a>", "Well  "), "<a>Well") << "trimmed by the template";
  EXPECT_EQ(cut("<a>Well \n</a>", " Well \n"), "<a>Well") << "leading whitespace: the stripped text";
  EXPECT_EQ(cut("<a>Well\u00a0</a>", "Well\u00a0"), "<a>Well\u00a0") << "Unicode whitespace, kept";
  EXPECT_EQ(cut("<a>\u00a0Well\u00a0</a>", "\u00a0Well\u00a0"), "<a>\u00a0Well") << "Unicode whitespace, leading";
  EXPECT_EQ(cut("<a>\u00a0Well\u00a0</a>", "Well\u00a0\u2003"), "<a>\u00a0Well");
  EXPECT_NE(cut("<a>WELL</a>", "Well").find("error"), std::string::npos);
  EXPECT_EQ(strip_whitespace(" \t\x1c a b \u3000", true, true), "a b");
  EXPECT_EQ(strip_whitespace("  a  ", true, false), "a  ");
}

TEST(ChatTemplate, ContextHelperSetsTransformersVariables) {
  const auto context = make_chat_context(nlohmann::ordered_json::array({{{"role", "user"}, {"content", "hi"}}}),
                                         nullptr, true, "", "<|im_end|>", {{"enable_thinking", false}});
  EXPECT_EQ(render("{{ messages[0].content }}|{{ add_generation_prompt }}|{{ tools is defined }}|{{ enable_thinking }}",
                   context),
            "hi|true|false|false");
}

}  // namespace
}  // namespace moe::tokenizer
