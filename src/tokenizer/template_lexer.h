// Tokens of the chat-template language. Internal to the template parser.
//
// Free functions with no shared state: any thread may call them.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace moe::tokenizer::tmpl {

enum class Tok { kText, kOpenExpr, kCloseExpr, kOpenStmt, kCloseStmt, kName, kInt, kFloat, kString, kOp, kEnd };

struct Token {
  Tok type;
  std::string text;
  int line = 1;
  int column = 1;
};

// Splits template source into text and tag tokens, applying the whitespace rules
// of @huggingface/jinja with transformers' settings (trim_blocks, lstrip_blocks,
// one trailing newline dropped, `-` markers). Errors name the line and column.
Expected<std::vector<Token>> lex_template(std::string_view source);

}  // namespace moe::tokenizer::tmpl
