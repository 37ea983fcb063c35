// Our chat-template renderer against @huggingface/jinja: the real Qwen3 template,
// a Qwen3.5-style template and one-feature snippets, each rendered by
// tools/tokenizer/oracle.mjs into the build directory.
#include <map>

#include <gtest/gtest.h>

#include "oracle_files.h"
#include "tokenizer/chat_template.h"

namespace moe::tokenizer {
namespace {

using testing::oracle_path;

TEST(ChatTemplateOracle, RenderingsMatchHuggingFaceJinja) {
  std::ifstream templates_file(oracle_path("chat_templates.json"));
  ASSERT_TRUE(templates_file.good()) << "missing " << oracle_path("chat_templates.json");
  const auto templates = nlohmann::ordered_json::parse(templates_file);
  // Compared in the JS dialect (strip's argument ignored, see ChatTemplateLimits);
  // the Python-dialect renderings that differ are counted and reported.
  ChatTemplateLimits js_dialect;
  js_dialect.js_strip_dialect = true;
  std::map<std::string, ChatTemplate> compiled, compiled_python;
  for (const auto& [name, source] : templates.items()) {
    auto t = ChatTemplate::create(source.get<std::string>(), js_dialect);
    ASSERT_TRUE(t.has_value()) << name << ": " << t.status().to_string();
    compiled.emplace(name, std::move(t).value());
    compiled_python.emplace(name, std::move(ChatTemplate::create(source.get<std::string>())).value());
  }
  int num_python_differs = 0;
  std::ifstream in(oracle_path("chat.jsonl"));
  ASSERT_TRUE(in.good()) << "missing " << oracle_path("chat.jsonl");
  std::map<std::string, std::pair<int, int>> per_template;  // equal, total
  std::string line;
  while (std::getline(in, line)) {
    const auto record = nlohmann::ordered_json::parse(line);
    const std::string name = record["template"];
    ASSERT_TRUE(record["error"].is_null()) << name << ": the oracle failed: " << record["error"];
    auto rendered = compiled.at(name).render(record["context"]);
    auto python = compiled_python.at(name).render(record["context"]);
    if (!python.has_value() || *python != record["rendered"].get<std::string>()) ++num_python_differs;
    auto& [num_equal, num_total] = per_template[name];
    ++num_total;
    if (rendered.has_value() && *rendered == record["rendered"].get<std::string>()) {
      ++num_equal;
    } else {
      ADD_FAILURE() << name << " differs for context " << record["context"].dump() << "\n  ours: "
                    << (rendered.has_value() ? nlohmann::json(*rendered).dump() : rendered.status().to_string())
                    << "\n  HF:   " << record["rendered"].dump();
    }
  }
  int num_conversations = 0;
  for (const auto& [name, counts] : per_template) {
    if (!name.starts_with("snippet_")) {
      std::printf("%s: %d / %d conversations identical to @huggingface/jinja\n", name.c_str(), counts.first,
                  counts.second);
      num_conversations += counts.second;
    }
  }
  std::printf("python dialect (strip honours its argument): %d renderings differ from @huggingface/jinja\n",
              num_python_differs);
  EXPECT_GE(per_template["qwen3"].second, 50);
  EXPECT_GE(num_conversations, 100);
}

}  // namespace
}  // namespace moe::tokenizer
