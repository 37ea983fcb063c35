// Lexer of the chat-template language; see template_lexer.h.
#include "tokenizer/template_lexer.h"

#include <fmt/format.h>

namespace moe::tokenizer::tmpl {
namespace {

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }
bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_word(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || is_digit(c) || c == '_' ||
         static_cast<unsigned char>(c) >= 0x80;
}

class Lexer {
 public:
  explicit Lexer(std::string_view source) : src_(source) {
    if (src_.ends_with('\n')) src_.remove_suffix(1);
  }

  Expected<std::vector<Token>> run() {
    while (pos_ < src_.size()) {
      MOE_RETURN_IF_ERROR(lex_text());
      if (pos_ >= src_.size()) break;
      MOE_RETURN_IF_ERROR(lex_tag());
    }
    tokens_.push_back(Token{Tok::kEnd, "", line_, column_});
    return std::move(tokens_);
  }

 private:
  Status error(const std::string& message) const {
    return invalid_argument("chat template line {} column {}: {}", line_, column_, message);
  }

  void advance(size_t n = 1) {
    for (size_t i = 0; i < n && pos_ < src_.size(); ++i) {
      if (src_[pos_] == '\n') {
        ++line_;
        column_ = 1;
      } else if ((static_cast<unsigned char>(src_[pos_]) & 0xC0) != 0x80) {
        ++column_;
      }
      ++pos_;
    }
  }
  bool at(std::string_view s) const { return src_.substr(pos_, s.size()) == s; }
  bool at_tag_open() const { return at("{{") || at("{%") || at("{#"); }

  void strip_previous_text() {
    if (!tokens_.empty() && tokens_.back().type == Tok::kText) {
      std::string& text = tokens_.back().text;
      while (!text.empty() && is_space(text.back())) text.pop_back();
      if (text.empty()) tokens_.pop_back();
    }
  }
  void skip_whitespace() {
    while (pos_ < src_.size() && is_space(src_[pos_])) advance();
  }

  Status lex_text() {
    const int line = line_, column = column_;
    std::string text;
    while (pos_ < src_.size() && !at_tag_open()) {
      text += src_[pos_];
      advance();
    }
    // lstrip_blocks: spaces and tabs between a line start (in the source) and {% or {# go.
    if (pos_ < src_.size() && (at("{%") || at("{#"))) {
      size_t r = pos_;
      while (r > 0 && (src_[r - 1] == ' ' || src_[r - 1] == '\t')) --r;
      if (r == 0 || src_[r - 1] == '\n' || src_[r - 1] == '\r') {
        while (!text.empty() && (text.back() == ' ' || text.back() == '\t')) text.pop_back();
      }
    }
    if (!text.empty()) tokens_.push_back(Token{Tok::kText, std::move(text), line, column});
    return Status::ok();
  }

  Status lex_tag() {
    if (at("{#")) {
      advance(2);
      const bool strip_before = at("-");
      const size_t end = src_.find("#}", pos_);
      if (end == std::string_view::npos) return error("missing end of comment tag '#}'");
      const bool strip_after = end > pos_ && src_[end - 1] == '-';
      if (strip_before) strip_previous_text();
      advance(end + 2 - pos_);
      finish_block_tag(strip_after);
      return Status::ok();
    }
    const bool expr = at("{{");
    tokens_.push_back(Token{expr ? Tok::kOpenExpr : Tok::kOpenStmt, expr ? "{{" : "{%", line_, column_});
    advance(2);
    if (at("-")) {
      // Strip the text before this tag (the open token is already pushed: move it).
      Token open = std::move(tokens_.back());
      tokens_.pop_back();
      strip_previous_text();
      tokens_.push_back(std::move(open));
      advance();
    }
    int depth = 0;  // brackets inside the tag, so "}}" in a dict literal does not close it
    while (true) {
      skip_whitespace();
      if (pos_ >= src_.size()) return error(expr ? "missing '}}'" : "missing '%}'");
      const std::string_view close = expr ? "}}" : "%}";
      const bool dash_close = at("-") && src_.substr(pos_ + 1, 2) == close;
      if ((depth == 0 && at(close)) || dash_close) {
        tokens_.push_back(Token{expr ? Tok::kCloseExpr : Tok::kCloseStmt, std::string(close), line_, column_});
        advance(dash_close ? 3 : 2);
        if (expr) {
          if (dash_close) skip_whitespace();
        } else {
          finish_block_tag(dash_close);
        }
        return Status::ok();
      }
      MOE_RETURN_IF_ERROR(lex_inner(depth));
    }
  }

  // After %} or #}: `-` strips following whitespace, else trim_blocks drops one newline.
  void finish_block_tag(bool strip_after) {
    if (strip_after) {
      skip_whitespace();
    } else if (at("\n")) {
      advance();
    }
  }

  Status lex_inner(int& depth) {
    const int line = line_, column = column_;
    const char c = src_[pos_];
    if (c == '\'' || c == '"') {
      advance();
      std::string value;
      while (true) {
        if (pos_ >= src_.size()) return error("unterminated string literal");
        const char d = src_[pos_];
        if (d == c) break;
        if (d == '\\') {
          advance();
          if (pos_ >= src_.size()) return error("unterminated string literal");
          const char e = src_[pos_];
          switch (e) {
            case 'n': value += '\n'; break;
            case 't': value += '\t'; break;
            case 'r': value += '\r'; break;
            case 'b': value += '\b'; break;
            case 'f': value += '\f'; break;
            case 'v': value += '\v'; break;
            case '\'': value += '\''; break;
            case '"': value += '"'; break;
            case '\\': value += '\\'; break;
            default: return error(std::string("unknown escape '\\") + e + "' in string literal");
          }
          advance();
          continue;
        }
        value += d;
        advance();
      }
      advance();
      tokens_.push_back(Token{Tok::kString, std::move(value), line, column});
      return Status::ok();
    }
    if (is_digit(c)) {
      std::string number;
      while (pos_ < src_.size() && is_digit(src_[pos_])) {
        number += src_[pos_];
        advance();
      }
      const bool after_dot = !tokens_.empty() && tokens_.back().type == Tok::kOp && tokens_.back().text == ".";
      if (!after_dot && at(".") && pos_ + 1 < src_.size() && is_digit(src_[pos_ + 1])) {
        number += '.';
        advance();
        while (pos_ < src_.size() && is_digit(src_[pos_])) {
          number += src_[pos_];
          advance();
        }
        tokens_.push_back(Token{Tok::kFloat, std::move(number), line, column});
      } else {
        tokens_.push_back(Token{Tok::kInt, std::move(number), line, column});
      }
      return Status::ok();
    }
    if (is_word(c)) {
      std::string word;
      while (pos_ < src_.size() && is_word(src_[pos_])) {
        word += src_[pos_];
        advance();
      }
      tokens_.push_back(Token{Tok::kName, std::move(word), line, column});
      return Status::ok();
    }
    static constexpr std::string_view kOps[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~",
                                                "<",  ">",  "(",  ")",  "[",  "]",  "{", "}", ",", ".", ":", "|", "="};
    for (std::string_view op : kOps) {
      if (at(op)) {
        if (op == "(" || op == "[" || op == "{") ++depth;
        if (op == ")" || op == "]" || op == "}") --depth;
        tokens_.push_back(Token{Tok::kOp, std::string(op), line, column});
        advance(op.size());
        return Status::ok();
      }
    }
    return error(std::string("unexpected character '") + c + "'");
  }

  std::string_view src_;
  size_t pos_ = 0;
  int line_ = 1;
  int column_ = 1;
  std::vector<Token> tokens_;
};

}  // namespace

Expected<std::vector<Token>> lex_template(std::string_view source) { return Lexer(source).run(); }

}  // namespace moe::tokenizer::tmpl
