// tokenize:   each stdin line is a JSON string -> one JSON array of ids per line.
//             With --chat each line is a chat request object instead
//             ({"messages": [...], "tools": [...], "add_generation_prompt": true,
//             and any chat_template_kwargs}), rendered with the model's chat
//             template and then tokenized.
// detokenize: each stdin line is a JSON array of ids -> one JSON string per line.
// A bad line produces {"error": "line N: ..."} in its place; the command then
// exits with status 1 after the last line. A model that cannot load is a message
// on stderr and status 1.
#include "apps/moeserve/tokenize_command.h"

#include <iostream>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace moe::apps {
namespace {

using nlohmann::ordered_json;
using tokenizer::TokenId;
using tokenizer::Tokenizer;

struct TokenizeArgs {
  std::string model;
  bool chat = false;
  bool no_special = false;
  bool skip_special_tokens = false;
};

std::string error_line(size_t line_number, const std::string& message) {
  return ordered_json{{"error", fmt::format("line {}: {}", line_number, message)}}.dump(
      -1, ' ', false, ordered_json::error_handler_t::replace);
}

Expected<std::string> tokenize_line(const Tokenizer& tok, const tokenizer::ChatTemplate* chat, const TokenizeArgs& args,
                                    const std::string& line) {
  const ordered_json input = ordered_json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (input.is_discarded()) return invalid_argument("not valid JSON");
  std::string text;
  if (chat != nullptr) {
    if (!input.is_object() || !input.contains("messages")) return invalid_argument("expected an object with \"messages\"");
    ordered_json kwargs = input;
    kwargs.erase("messages");
    kwargs.erase("tools");
    kwargs.erase("add_generation_prompt");
    const ordered_json context = tokenizer::make_chat_context(
        input["messages"], input.value("tools", ordered_json()), input.value("add_generation_prompt", false),
        tok.special_tokens().bos, tok.special_tokens().eos, kwargs);
    MOE_ASSIGN_OR_RETURN(text, chat->render(context));
  } else {
    if (!input.is_string()) return invalid_argument("expected a JSON string");
    text = input.get<std::string>();
  }
  return ordered_json(tok.encode(text, !args.no_special)).dump();
}

Expected<std::string> detokenize_line(const Tokenizer& tok, const TokenizeArgs& args, const std::string& line) {
  const ordered_json input = ordered_json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (input.is_discarded()) return invalid_argument("not valid JSON");
  if (!input.is_array()) return invalid_argument("expected a JSON array of token ids");
  std::vector<TokenId> ids;
  for (const ordered_json& id : input) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= static_cast<int64_t>(tok.num_ids())) {
      return invalid_argument("{} is not a token id (vocabulary of {})", id.dump(), tok.num_ids());
    }
    ids.push_back(static_cast<TokenId>(id.get<int64_t>()));
  }
  return ordered_json(tok.decode(ids, args.skip_special_tokens)).dump(-1, ' ', false,
                                                                       ordered_json::error_handler_t::replace);
}

// Runs `handle` on every non-empty stdin line; returns the number of bad lines.
template <typename Handle>
size_t for_each_line(Handle&& handle) {
  std::ios::sync_with_stdio(false);
  size_t num_errors = 0;
  size_t line_number = 0;
  std::string line;
  while (std::getline(std::cin, line)) {
    ++line_number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    Expected<std::string> out = handle(line);
    if (out) {
      std::cout << *out << '\n';
    } else {
      ++num_errors;
      std::cout << error_line(line_number, out.status().message()) << '\n';
    }
  }
  std::cout.flush();
  return num_errors;
}

Expected<Tokenizer> load_or_report(const std::string& model) {
  auto tok = Tokenizer::load(model);
  if (!tok) std::cerr << "moeserve: " << tok.status().to_string() << '\n';
  return tok;
}

void run_tokenize(const TokenizeArgs& args) {
  auto tok = load_or_report(args.model);
  if (!tok) throw CLI::RuntimeError(1);
  std::unique_ptr<tokenizer::ChatTemplate> chat;
  if (args.chat) {
    if (tok->chat_template().empty()) {
      std::cerr << "moeserve: " << args.model << " has no chat_template in tokenizer_config.json\n";
      throw CLI::RuntimeError(1);
    }
    auto compiled = tokenizer::ChatTemplate::create(tok->chat_template());
    if (!compiled) {
      std::cerr << "moeserve: " << compiled.status().to_string() << '\n';
      throw CLI::RuntimeError(1);
    }
    chat = std::make_unique<tokenizer::ChatTemplate>(std::move(compiled).value());
  }
  const size_t num_errors =
      for_each_line([&](const std::string& line) { return tokenize_line(*tok, chat.get(), args, line); });
  if (num_errors > 0) throw CLI::RuntimeError(1);
}

void run_detokenize(const TokenizeArgs& args) {
  auto tok = load_or_report(args.model);
  if (!tok) throw CLI::RuntimeError(1);
  const size_t num_errors = for_each_line([&](const std::string& line) { return detokenize_line(*tok, args, line); });
  if (num_errors > 0) throw CLI::RuntimeError(1);
}

}  // namespace

void add_tokenize_commands(CLI::App& app) {
  auto args = std::make_shared<TokenizeArgs>();
  CLI::App* tokenize = app.add_subcommand("tokenize", "JSON strings on stdin -> JSON arrays of token ids on stdout");
  tokenize->add_option("--model", args->model, "model directory (tokenizer.json, tokenizer_config.json)")->required();
  tokenize->add_flag("--chat", args->chat, "lines are chat requests, rendered with the model's chat template");
  tokenize->add_flag("--no-special", args->no_special, "encode special-token text as plain text (untrusted input)");
  tokenize->callback([args] { run_tokenize(*args); });

  CLI::App* detokenize = app.add_subcommand("detokenize", "JSON arrays of token ids on stdin -> JSON strings on stdout");
  detokenize->add_option("--model", args->model, "model directory (tokenizer.json)")->required();
  detokenize->add_flag("--skip-special-tokens", args->skip_special_tokens, "leave special tokens out of the text");
  detokenize->callback([args] { run_detokenize(*args); });
}

}  // namespace moe::apps
