// Recursive-descent parser of the chat-template language, with Jinja's operator
// precedence: ternary < or < and < not < comparisons < + - < ~ < * / // % < ** <
// unary < postfix (.attr [index] (call)) and filters/tests.
#include <cerrno>
#include <cstdlib>

#include "tokenizer/template_ast.h"
#include "tokenizer/template_lexer.h"

namespace moe::tokenizer::tmpl {
namespace {

constexpr int kMaxNesting = 200;  // deeper templates are refused, not crashed on

bool is_keyword(std::string_view w) {
  return w == "and" || w == "or" || w == "not" || w == "in" || w == "is" || w == "if" || w == "else" ||
         w == "elif" || w == "endif" || w == "for" || w == "endfor" || w == "recursive";
}

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : tokens_(std::move(tokens)) {}

  Expected<std::vector<NodePtr>> run() {
    std::vector<NodePtr> body;
    std::string end_tag;
    MOE_RETURN_IF_ERROR(parse_body(body, {}, end_tag));
    return body;
  }

 private:
  const Token& peek(size_t ahead = 0) const {
    return tokens_[std::min(pos_ + ahead, tokens_.size() - 1)];
  }
  bool at_op(std::string_view op, size_t ahead = 0) const {
    return peek(ahead).type == Tok::kOp && peek(ahead).text == op;
  }
  bool at_name(std::string_view name, size_t ahead = 0) const {
    return peek(ahead).type == Tok::kName && peek(ahead).text == name;
  }
  Status error_at(const Token& t, const std::string& message) const {
    return invalid_argument("chat template line {} column {}: {}", t.line, t.column, message);
  }
  Status expect_op(std::string_view op) {
    if (!at_op(op)) return error_at(peek(), fmt::format("expected '{}', found '{}'", op, describe(peek())));
    ++pos_;
    return Status::ok();
  }
  Status expect_name(std::string_view name) {
    if (!at_name(name)) return error_at(peek(), fmt::format("expected '{}', found '{}'", name, describe(peek())));
    ++pos_;
    return Status::ok();
  }
  Status expect_close_stmt() {
    if (peek().type != Tok::kCloseStmt) return error_at(peek(), fmt::format("expected '%}}', found '{}'", describe(peek())));
    ++pos_;
    return Status::ok();
  }
  static std::string describe(const Token& t) { return t.type == Tok::kEnd ? "end of template" : t.text; }
  NodePtr make(NodeKind kind, const Token& at) const {
    auto node = std::make_unique<Node>();
    node->kind = kind;
    node->line = at.line;
    node->column = at.column;
    return node;
  }

  // Parses statements until one of `end_tags` opens a {% %} tag (left unconsumed
  // past its name, which goes to `found`) or the template ends (then `end_tags`
  // must be empty).
  Status parse_body(std::vector<NodePtr>& body, std::initializer_list<std::string_view> end_tags, std::string& found) {
    if (++nesting_ > kMaxNesting) return error_at(peek(), "blocks nested too deeply");
    while (true) {
      const Token& t = peek();
      if (t.type == Tok::kEnd) {
        --nesting_;
        if (end_tags.size() == 0) return Status::ok();
        return error_at(t, fmt::format("unexpected end of template: missing '{{% {} %}}'", *end_tags.begin()));
      }
      if (t.type == Tok::kText) {
        auto node = make(NodeKind::kText, t);
        node->name = t.text;
        body.push_back(std::move(node));
        ++pos_;
      } else if (t.type == Tok::kOpenExpr) {
        ++pos_;
        auto node = make(NodeKind::kOutput, t);
        MOE_ASSIGN_OR_RETURN(NodePtr expr, parse_expression());
        node->children.push_back(std::move(expr));
        if (peek().type != Tok::kCloseExpr) return error_at(peek(), fmt::format("expected '}}}}', found '{}'", describe(peek())));
        ++pos_;
        body.push_back(std::move(node));
      } else if (t.type == Tok::kOpenStmt) {
        const Token& name = peek(1);
        for (std::string_view end : end_tags) {
          if (name.type == Tok::kName && name.text == end) {
            pos_ += 2;
            found = name.text;
            --nesting_;
            return Status::ok();
          }
        }
        ++pos_;
        MOE_ASSIGN_OR_RETURN(NodePtr statement, parse_statement());
        if (statement) body.push_back(std::move(statement));
      } else {
        return error_at(t, fmt::format("unexpected '{}'", describe(t)));
      }
    }
  }

  // After "{%"; returns null for statements that produce nothing (generation tags).
  Expected<NodePtr> parse_statement() {
    const Token& t = peek();
    if (t.type != Tok::kName) return error_at(t, fmt::format("expected a statement name, found '{}'", describe(t)));
    ++pos_;
    if (t.text == "if") return parse_if(t);
    if (t.text == "for") return parse_for(t);
    if (t.text == "set") return parse_set(t);
    if (t.text == "macro") return parse_macro(t);
    if (t.text == "break" || t.text == "continue") {
      MOE_RETURN_IF_ERROR(expect_close_stmt());
      return make(t.text == "break" ? NodeKind::kBreak : NodeKind::kContinue, t);
    }
    if (t.text == "generation" || t.text == "endgeneration") {
      MOE_RETURN_IF_ERROR(expect_close_stmt());
      return NodePtr();
    }
    return error_at(t, fmt::format("unknown statement '{}'", t.text));
  }

  Expected<NodePtr> parse_if(const Token& start) {
    auto node = make(NodeKind::kIf, start);
    MOE_ASSIGN_OR_RETURN(NodePtr cond, parse_expression());
    node->children.push_back(std::move(cond));
    MOE_RETURN_IF_ERROR(expect_close_stmt());
    std::string found;
    MOE_RETURN_IF_ERROR(parse_body(node->body, {"elif", "else", "endif"}, found));
    if (found == "elif") {
      MOE_ASSIGN_OR_RETURN(NodePtr elif, parse_if(peek()));
      node->else_body.push_back(std::move(elif));
      return node;  // the nested if consumed the endif
    }
    if (found == "else") {
      MOE_RETURN_IF_ERROR(expect_close_stmt());
      MOE_RETURN_IF_ERROR(parse_body(node->else_body, {"endif"}, found));
    }
    MOE_RETURN_IF_ERROR(expect_close_stmt());
    return node;
  }

  Expected<NodePtr> parse_for(const Token& start) {
    auto node = make(NodeKind::kFor, start);
    MOE_ASSIGN_OR_RETURN(NodePtr target, parse_target());
    node->children.push_back(std::move(target));
    MOE_RETURN_IF_ERROR(expect_name("in"));
    MOE_ASSIGN_OR_RETURN(NodePtr iterable, parse_or());
    node->children.push_back(std::move(iterable));
    if (at_name("if")) {
      ++pos_;
      MOE_ASSIGN_OR_RETURN(NodePtr filter, parse_or());
      node->children.push_back(std::move(filter));
    } else {
      node->children.push_back(nullptr);
    }
    if (at_name("recursive")) return error_at(peek(), "recursive loops are not supported");
    MOE_RETURN_IF_ERROR(expect_close_stmt());
    std::string found;
    MOE_RETURN_IF_ERROR(parse_body(node->body, {"else", "endfor"}, found));
    if (found == "else") {
      MOE_RETURN_IF_ERROR(expect_close_stmt());
      MOE_RETURN_IF_ERROR(parse_body(node->else_body, {"endfor"}, found));
    }
    MOE_RETURN_IF_ERROR(expect_close_stmt());
    return node;
  }

  // A loop or assignment target: a name, name.attr, or names separated by commas.
  Expected<NodePtr> parse_target() {
    const Token& first = peek();
    if (first.type != Tok::kName || is_keyword(first.text)) {
      return error_at(first, fmt::format("expected a variable name, found '{}'", describe(first)));
    }
    MOE_ASSIGN_OR_RETURN(NodePtr target, parse_primary());
    if (at_op(".")) {
      ++pos_;
      if (peek().type != Tok::kName) return error_at(peek(), "expected an attribute name");
      auto member = make(NodeKind::kMember, peek());
      member->name = peek().text;
      ++pos_;
      member->children.push_back(std::move(target));
      return member;
    }
    if (!at_op(",")) return target;
    auto tuple = make(NodeKind::kTuple, first);
    tuple->children.push_back(std::move(target));
    while (at_op(",")) {
      ++pos_;
      if (peek().type != Tok::kName) return error_at(peek(), "expected a variable name");
      MOE_ASSIGN_OR_RETURN(NodePtr next, parse_primary());
      tuple->children.push_back(std::move(next));
    }
    return tuple;
  }

  Expected<NodePtr> parse_set(const Token& start) {
    auto node = make(NodeKind::kSet, start);
    MOE_ASSIGN_OR_RETURN(NodePtr target, parse_target());
    node->children.push_back(std::move(target));
    if (at_op("=")) {
      ++pos_;
      MOE_ASSIGN_OR_RETURN(NodePtr value, parse_expression_or_tuple());
      node->children.push_back(std::move(value));
      MOE_RETURN_IF_ERROR(expect_close_stmt());
      return node;
    }
    node->children.push_back(nullptr);
    MOE_RETURN_IF_ERROR(expect_close_stmt());
    std::string found;
    MOE_RETURN_IF_ERROR(parse_body(node->body, {"endset"}, found));
    MOE_RETURN_IF_ERROR(expect_close_stmt());
    return node;
  }

  Expected<NodePtr> parse_macro(const Token& start) {
    auto node = make(NodeKind::kMacro, start);
    if (peek().type != Tok::kName) return error_at(peek(), "expected a macro name");
    node->name = peek().text;
    ++pos_;
    MOE_RETURN_IF_ERROR(expect_op("("));
    while (!at_op(")")) {
      if (peek().type != Tok::kName) return error_at(peek(), "expected a parameter name");
      std::string param = peek().text;
      ++pos_;
      NodePtr default_value;
      if (at_op("=")) {
        ++pos_;
        MOE_ASSIGN_OR_RETURN(default_value, parse_expression());
      }
      node->params.emplace_back(std::move(param), std::move(default_value));
      if (!at_op(",")) break;
      ++pos_;
    }
    MOE_RETURN_IF_ERROR(expect_op(")"));
    MOE_RETURN_IF_ERROR(expect_close_stmt());
    std::string found;
    MOE_RETURN_IF_ERROR(parse_body(node->body, {"endmacro"}, found));
    MOE_RETURN_IF_ERROR(expect_close_stmt());
    return node;
  }

  // `a, b` without brackets is a tuple (in set statements).
  Expected<NodePtr> parse_expression_or_tuple() {
    const Token& start = peek();
    MOE_ASSIGN_OR_RETURN(NodePtr first, parse_expression());
    if (!at_op(",")) return first;
    auto tuple = make(NodeKind::kTuple, start);
    tuple->children.push_back(std::move(first));
    while (at_op(",")) {
      ++pos_;
      MOE_ASSIGN_OR_RETURN(NodePtr next, parse_expression());
      tuple->children.push_back(std::move(next));
    }
    return tuple;
  }

  class DepthGuard {
   public:
    explicit DepthGuard(int& depth) : depth_(depth) { ++depth_; }
    ~DepthGuard() { --depth_; }
    bool too_deep() const { return depth_ > kMaxNesting; }

   private:
    int& depth_;
  };

  Expected<NodePtr> parse_expression() {
    DepthGuard guard(nesting_);
    if (guard.too_deep()) return error_at(peek(), "expression nested too deeply");
    const Token& start = peek();
    MOE_ASSIGN_OR_RETURN(NodePtr value, parse_or());
    if (!at_name("if")) return value;
    ++pos_;
    auto node = make(NodeKind::kTernary, start);
    MOE_ASSIGN_OR_RETURN(NodePtr cond, parse_or());
    node->children.push_back(std::move(value));
    node->children.push_back(std::move(cond));
    if (at_name("else")) {
      ++pos_;
      MOE_ASSIGN_OR_RETURN(NodePtr other, parse_expression());
      node->children.push_back(std::move(other));
    } else {
      node->children.push_back(nullptr);
    }
    return node;
  }

  NodePtr binary(const Token& op, std::string name, NodePtr left, NodePtr right) const {
    auto node = make(NodeKind::kBinary, op);
    node->name = std::move(name);
    node->children.push_back(std::move(left));
    node->children.push_back(std::move(right));
    return node;
  }

  Expected<NodePtr> parse_or() {
    MOE_ASSIGN_OR_RETURN(NodePtr left, parse_and());
    while (at_name("or")) {
      const Token& op = peek();
      ++pos_;
      MOE_ASSIGN_OR_RETURN(NodePtr right, parse_and());
      left = binary(op, "or", std::move(left), std::move(right));
    }
    return left;
  }

  Expected<NodePtr> parse_and() {
    MOE_ASSIGN_OR_RETURN(NodePtr left, parse_not());
    while (at_name("and")) {
      const Token& op = peek();
      ++pos_;
      MOE_ASSIGN_OR_RETURN(NodePtr right, parse_not());
      left = binary(op, "and", std::move(left), std::move(right));
    }
    return left;
  }

  Expected<NodePtr> parse_not() {
    if (at_name("not")) {
      DepthGuard guard(nesting_);
      if (guard.too_deep()) return error_at(peek(), "expression nested too deeply");
      auto node = make(NodeKind::kUnary, peek());
      node->name = "not";
      ++pos_;
      MOE_ASSIGN_OR_RETURN(NodePtr operand, parse_not());
      node->children.push_back(std::move(operand));
      return node;
    }
    return parse_compare();
  }

  Expected<NodePtr> parse_compare() {
    MOE_ASSIGN_OR_RETURN(NodePtr left, parse_math1());
    while (true) {
      const Token& op = peek();
      std::string name;
      if (op.type == Tok::kOp && (op.text == "==" || op.text == "!=" || op.text == "<" || op.text == ">" ||
                                  op.text == "<=" || op.text == ">=")) {
        name = op.text;
        ++pos_;
      } else if (at_name("in")) {
        name = "in";
        ++pos_;
      } else if (at_name("not") && at_name("in", 1)) {
        name = "not in";
        pos_ += 2;
      } else {
        return left;
      }
      MOE_ASSIGN_OR_RETURN(NodePtr right, parse_math1());
      left = binary(op, name, std::move(left), std::move(right));
    }
  }

  Expected<NodePtr> parse_math1() {
    MOE_ASSIGN_OR_RETURN(NodePtr left, parse_concat());
    while (at_op("+") || at_op("-")) {
      const Token& op = peek();
      ++pos_;
      MOE_ASSIGN_OR_RETURN(NodePtr right, parse_concat());
      left = binary(op, op.text, std::move(left), std::move(right));
    }
    return left;
  }

  Expected<NodePtr> parse_concat() {
    MOE_ASSIGN_OR_RETURN(NodePtr left, parse_math2());
    while (at_op("~")) {
      const Token& op = peek();
      ++pos_;
      MOE_ASSIGN_OR_RETURN(NodePtr right, parse_math2());
      left = binary(op, "~", std::move(left), std::move(right));
    }
    return left;
  }

  Expected<NodePtr> parse_math2() {
    MOE_ASSIGN_OR_RETURN(NodePtr left, parse_pow());
    while (at_op("*") || at_op("/") || at_op("//") || at_op("%")) {
      const Token& op = peek();
      ++pos_;
      MOE_ASSIGN_OR_RETURN(NodePtr right, parse_pow());
      left = binary(op, op.text, std::move(left), std::move(right));
    }
    return left;
  }

  Expected<NodePtr> parse_pow() {
    MOE_ASSIGN_OR_RETURN(NodePtr left, parse_unary());
    while (at_op("**")) {
      const Token& op = peek();
      ++pos_;
      MOE_ASSIGN_OR_RETURN(NodePtr right, parse_unary());
      left = binary(op, "**", std::move(left), std::move(right));
    }
    return left;
  }

  // `-x | f` is (-x) | f, as in Jinja: the operand of a sign takes no filters.
  Expected<NodePtr> parse_unary(bool with_filters = true) {
    DepthGuard guard(nesting_);
    if (guard.too_deep()) return error_at(peek(), "expression nested too deeply");
    NodePtr node;
    if (at_op("-") || at_op("+")) {
      node = make(NodeKind::kUnary, peek());
      node->name = peek().text;
      ++pos_;
      MOE_ASSIGN_OR_RETURN(NodePtr operand, parse_unary(/*with_filters=*/false));
      node->children.push_back(std::move(operand));
    } else {
      MOE_ASSIGN_OR_RETURN(node, parse_primary());
      MOE_ASSIGN_OR_RETURN(node, parse_postfix(std::move(node)));
    }
    if (!with_filters) return node;
    return parse_filters_and_tests(std::move(node));
  }

  Expected<NodePtr> parse_primary() {
    const Token& t = peek();
    switch (t.type) {
      case Tok::kInt:
      case Tok::kFloat: {
        auto node = make(NodeKind::kLiteral, t);
        if (t.type == Tok::kInt) {
          errno = 0;
          const long long v = std::strtoll(t.text.c_str(), nullptr, 10);
          if (errno == ERANGE) return error_at(t, "integer literal out of range");
          node->literal = Value::integer(v);
        } else {
          node->literal = Value::number(std::strtod(t.text.c_str(), nullptr));
        }
        ++pos_;
        return node;
      }
      case Tok::kString: {
        auto node = make(NodeKind::kLiteral, t);
        std::string value;
        while (peek().type == Tok::kString) value += tokens_[pos_++].text;  // "a" "b" is "ab"
        node->literal = Value::string(std::move(value));
        return node;
      }
      case Tok::kName: {
        ++pos_;
        if (t.text == "true" || t.text == "True" || t.text == "false" || t.text == "False") {
          auto node = make(NodeKind::kLiteral, t);
          node->literal = Value::boolean(t.text == "true" || t.text == "True");
          return node;
        }
        if (t.text == "none" || t.text == "None") {
          auto node = make(NodeKind::kLiteral, t);
          node->literal = Value::none();
          return node;
        }
        auto node = make(NodeKind::kIdentifier, t);
        node->name = t.text;
        return node;
      }
      case Tok::kOp:
        if (t.text == "(") return parse_parenthesized();
        if (t.text == "[") return parse_list();
        if (t.text == "{") return parse_dict();
        break;
      default: break;
    }
    return error_at(t, fmt::format("unexpected '{}' in expression", describe(t)));
  }

  Expected<NodePtr> parse_parenthesized() {
    const Token& start = peek();
    ++pos_;
    if (at_op(")")) {
      ++pos_;
      return make(NodeKind::kTuple, start);
    }
    MOE_ASSIGN_OR_RETURN(NodePtr first, parse_expression());
    if (at_op(")")) {
      ++pos_;
      return first;
    }
    auto tuple = make(NodeKind::kTuple, start);
    tuple->children.push_back(std::move(first));
    while (at_op(",")) {
      ++pos_;
      if (at_op(")")) break;
      MOE_ASSIGN_OR_RETURN(NodePtr next, parse_expression());
      tuple->children.push_back(std::move(next));
    }
    MOE_RETURN_IF_ERROR(expect_op(")"));
    return tuple;
  }

  Expected<NodePtr> parse_list() {
    auto node = make(NodeKind::kList, peek());
    ++pos_;
    while (!at_op("]")) {
      MOE_ASSIGN_OR_RETURN(NodePtr item, parse_expression());
      node->children.push_back(std::move(item));
      if (!at_op(",")) break;
      ++pos_;
    }
    MOE_RETURN_IF_ERROR(expect_op("]"));
    return node;
  }

  Expected<NodePtr> parse_dict() {
    auto node = make(NodeKind::kDict, peek());
    ++pos_;
    while (!at_op("}")) {
      MOE_ASSIGN_OR_RETURN(NodePtr key, parse_expression());
      MOE_RETURN_IF_ERROR(expect_op(":"));
      MOE_ASSIGN_OR_RETURN(NodePtr value, parse_expression());
      node->children.push_back(std::move(key));
      node->children.push_back(std::move(value));
      if (!at_op(",")) break;
      ++pos_;
    }
    MOE_RETURN_IF_ERROR(expect_op("}"));
    return node;
  }

  // Arguments after "(": positional first, then name=value.
  Status parse_call_args(Node& node) {
    MOE_RETURN_IF_ERROR(expect_op("("));
    while (!at_op(")")) {
      if (peek().type == Tok::kName && at_op("=", 1)) {
        std::string name = peek().text;
        pos_ += 2;
        MOE_ASSIGN_OR_RETURN(NodePtr value, parse_expression());
        node.params.emplace_back(std::move(name), std::move(value));
      } else {
        if (!node.params.empty()) return error_at(peek(), "positional argument after a keyword argument");
        MOE_ASSIGN_OR_RETURN(NodePtr value, parse_expression());
        node.children.push_back(std::move(value));
      }
      if (!at_op(",")) break;
      ++pos_;
    }
    return expect_op(")");
  }

  Expected<NodePtr> parse_postfix(NodePtr node) {
    while (true) {
      const Token& t = peek();
      if (at_op(".")) {
        ++pos_;
        const Token& name = peek();
        if (name.type != Tok::kName && name.type != Tok::kInt) {
          return error_at(name, fmt::format("expected an attribute name after '.', found '{}'", describe(name)));
        }
        ++pos_;
        auto member = make(NodeKind::kMember, name);
        member->name = name.text;
        member->children.push_back(std::move(node));
        node = std::move(member);
      } else if (at_op("[")) {
        ++pos_;
        MOE_ASSIGN_OR_RETURN(node, parse_subscript(t, std::move(node)));
      } else if (at_op("(")) {
        auto call = make(NodeKind::kCall, t);
        call->children.push_back(std::move(node));
        MOE_RETURN_IF_ERROR(parse_call_args(*call));
        node = std::move(call);
      } else {
        return node;
      }
    }
  }

  // After "[": an index, or a slice start:stop:step with each part optional.
  Expected<NodePtr> parse_subscript(const Token& start, NodePtr object) {
    NodePtr parts[3];
    int num_colons = 0;
    for (int part = 0; part < 3; ++part) {
      if (!at_op(":") && !at_op("]")) {
        MOE_ASSIGN_OR_RETURN(parts[part], parse_expression());
      }
      if (!at_op(":") || part == 2) break;
      ++pos_;
      ++num_colons;
    }
    MOE_RETURN_IF_ERROR(expect_op("]"));
    if (num_colons == 0) {
      if (!parts[0]) return error_at(start, "empty subscript");
      auto node = make(NodeKind::kSubscript, start);
      node->children.push_back(std::move(object));
      node->children.push_back(std::move(parts[0]));
      return node;
    }
    auto node = make(NodeKind::kSlice, start);
    node->children.push_back(std::move(object));
    for (auto& part : parts) node->children.push_back(std::move(part));
    return node;
  }

  Expected<NodePtr> parse_filters_and_tests(NodePtr node) {
    while (true) {
      if (at_op("|")) {
        ++pos_;
        const Token& name = peek();
        if (name.type != Tok::kName) return error_at(name, "expected a filter name after '|'");
        ++pos_;
        auto filter = make(NodeKind::kFilter, name);
        filter->name = name.text;
        filter->children.push_back(std::move(node));
        if (at_op("(")) MOE_RETURN_IF_ERROR(parse_call_args(*filter));
        node = std::move(filter);
      } else if (at_name("is")) {
        ++pos_;
        auto test = make(NodeKind::kTest, peek());
        if (at_name("not")) {
          test->negated = true;
          ++pos_;
        }
        const Token& name = peek();
        if (name.type != Tok::kName) return error_at(name, "expected a test name after 'is'");
        ++pos_;
        test->name = name.text;
        test->children.push_back(std::move(node));
        if (at_op("(")) {
          MOE_RETURN_IF_ERROR(parse_call_args(*test));
        } else if (peek().type == Tok::kInt || peek().type == Tok::kFloat || peek().type == Tok::kString ||
                   (peek().type == Tok::kName && !is_keyword(peek().text))) {
          MOE_ASSIGN_OR_RETURN(NodePtr arg, parse_primary());  // `x is sameas false`
          test->children.push_back(std::move(arg));
        }
        node = std::move(test);
      } else {
        return node;
      }
    }
  }

  std::vector<Token> tokens_;
  size_t pos_ = 0;
  int nesting_ = 0;
};

}  // namespace

Expected<std::vector<NodePtr>> parse_template(std::string_view source) {
  MOE_ASSIGN_OR_RETURN(std::vector<Token> tokens, lex_template(source));
  return Parser(std::move(tokens)).run();
}

}  // namespace moe::tokenizer::tmpl
