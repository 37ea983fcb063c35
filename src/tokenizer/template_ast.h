// The syntax tree of a chat template (Jinja subset) and the parser that builds it.
// Internal to chat_template.cc; see chat_template.h for the supported language.
//
// A parsed tree is immutable: any thread may render from it concurrently.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/status.h"
#include "tokenizer/template_value.h"

namespace moe::tokenizer::tmpl {

enum class NodeKind {
  // Statements.
  kText,      // name = the text
  kOutput,    // {{ children[0] }}
  kIf,        // children[0] = condition; body; else_body (an elif is a nested kIf)
  kFor,       // children = {target, iterable, filter or null}; body; else_body
  kSet,       // children = {target, value or null (then body is the value)}
  kMacro,     // name; params = (name, default or null); body
  kBreak,
  kContinue,
  // Expressions.
  kLiteral,     // literal
  kIdentifier,  // name
  kList,        // children
  kTuple,       // children
  kDict,        // children = k0, v0, k1, v1, ...
  kMember,      // children[0].name
  kSubscript,   // children[0][children[1]]
  kSlice,       // children[0][children[1] : children[2] : children[3]], each but the first nullable
  kCall,        // children[0](children[1..], params as keyword arguments)
  kFilter,      // children[0] | name(children[1..], params)
  kTest,        // children[0] is [not] name(children[1..])
  kUnary,       // name in {not, -, +}; children[0]
  kBinary,      // name = operator; children[0], children[1]
  kTernary,     // children[0] if children[1] else children[2] (nullable)
};

struct Node;
using NodePtr = std::unique_ptr<Node>;

struct Node {
  NodeKind kind;
  int line = 0;
  int column = 0;
  std::string name;
  Value literal;
  bool negated = false;
  std::vector<NodePtr> children;
  std::vector<std::pair<std::string, NodePtr>> params;
  std::vector<NodePtr> body;
  std::vector<NodePtr> else_body;
};

// Parses template source into statements. Errors name the line and column.
Expected<std::vector<NodePtr>> parse_template(std::string_view source);

}  // namespace moe::tokenizer::tmpl
