#include "tokenizer/chat_template.h"

#include <cctype>
#include <cmath>
#include <unordered_map>

#include "tokenizer/template_ast.h"
#include "tokenizer/template_builtins.h"

namespace moe::tokenizer {
namespace tmpl {
namespace {

constexpr int kMaxContextDepth = 128;  // nesting of the JSON context (messages, tools)

bool within_depth(const nlohmann::ordered_json& json, int depth) {
  if (depth > kMaxContextDepth) return false;
  if (json.is_array() || json.is_object()) {
    for (const auto& item : json) {
      if (!within_depth(item, depth + 1)) return false;
    }
  }
  return true;
}

Status at_node(const Node& node, const Status& status) {
  if (status.message().starts_with("chat template line")) return status;
  return Status(status.code(), fmt::format("chat template line {} column {}: {}", node.line, node.column, status.message()));
}

// One render: scopes, limits and counters. Not shared between threads.
class Interpreter {
 public:
  explicit Interpreter(const ChatTemplateLimits& limits) : limits_(limits) {}

  Expected<std::string> run(const std::vector<NodePtr>& program, const nlohmann::ordered_json& context) {
    if (!context.is_object()) return invalid_argument("chat template context must be a JSON object");
    if (!within_depth(context, 0)) return invalid_argument("chat template context nested too deeply");
    auto globals = std::make_shared<Frame>();
    Object functions;
    add_global_functions(functions);
    for (auto& [name, fn] : functions.items) (*globals)[name] = fn;
    for (const auto& [key, value] : context.items()) (*globals)[key] = Value::from_json(value);
    frames_.push_back(std::move(globals));
    std::string out;
    MOE_ASSIGN_OR_RETURN(Flow flow, exec_block(program, out));
    (void)flow;
    return out;
  }

 private:
  using Frame = std::unordered_map<std::string, Value>;
  enum class Flow { kNormal, kBreak, kContinue };

  Value lookup(const std::string& name) const {
    for (auto it = frames_.rbegin(); it != frames_.rend(); ++it) {
      const auto found = (*it)->find(name);
      if (found != (*it)->end()) return found->second;
    }
    return Value();
  }

  Status append_output(std::string& out, std::string_view text) const {
    if (out.size() + text.size() > limits_.max_output_bytes) {
      return resource_exhausted("output exceeds {} bytes", limits_.max_output_bytes);
    }
    out.append(text);
    return Status::ok();
  }

  Expected<Flow> exec_block(const std::vector<NodePtr>& body, std::string& out) {
    for (const NodePtr& node : body) {
      MOE_ASSIGN_OR_RETURN(Flow flow, exec(*node, out));
      if (flow != Flow::kNormal) return flow;
    }
    return Flow::kNormal;
  }

  Expected<Flow> exec(const Node& node, std::string& out) {
    switch (node.kind) {
      case NodeKind::kText: MOE_RETURN_IF_ERROR(append_output(out, node.name)); return Flow::kNormal;
      case NodeKind::kOutput: {
        MOE_ASSIGN_OR_RETURN(Value v, eval(*node.children[0]));
        MOE_RETURN_IF_ERROR(at_node(node, append_output(out, v.to_output())));
        return Flow::kNormal;
      }
      case NodeKind::kIf: {
        MOE_ASSIGN_OR_RETURN(Value cond, eval(*node.children[0]));
        return exec_block(cond.truthy() ? node.body : node.else_body, out);
      }
      case NodeKind::kFor: MOE_RETURN_IF_ERROR(exec_for(node, out)); return Flow::kNormal;
      case NodeKind::kSet: MOE_RETURN_IF_ERROR(exec_set(node)); return Flow::kNormal;
      case NodeKind::kMacro: frames_.back()->insert_or_assign(node.name, make_macro(node)); return Flow::kNormal;
      case NodeKind::kBreak: return Flow::kBreak;
      case NodeKind::kContinue: return Flow::kContinue;
      default: return at_node(node, internal_error("expression used as a statement"));
    }
  }

  Expected<Array> iterable_items(const Node& node, const Value& v) {
    if (v.is_array()) return v.as_array();
    if (v.is_object() && !v.is_namespace()) {
      Array keys;
      for (const auto& [k, item] : v.as_object().items) keys.push_back(Value::string(k));
      return keys;
    }
    if (v.is_string()) {
      Array chars;
      for (std::string& c : split_code_points(v.as_string())) chars.push_back(Value::string(std::move(c)));
      return chars;
    }
    if (v.is_undefined() || v.is_none()) return Array();
    return at_node(node, invalid_argument("cannot iterate over {}", v.type_name()));
  }

  Status exec_for(const Node& node, std::string& out) {
    MOE_ASSIGN_OR_RETURN(Value iterable, eval(*node.children[1]));
    MOE_ASSIGN_OR_RETURN(Array all_items, iterable_items(*node.children[1], iterable));
    const Node* filter = node.children[2].get();
    frames_.push_back(std::make_shared<Frame>());
    Array items;
    if (filter != nullptr) {  // loop.* counts only the items that pass the filter
      for (const Value& item : all_items) {
        MOE_RETURN_IF_ERROR(assign(*node.children[0], item));
        MOE_ASSIGN_OR_RETURN(Value keep, eval(*filter));
        if (keep.truthy()) items.push_back(item);
      }
    } else {
      items = std::move(all_items);
    }
    Status status = Status::ok();
    const auto n = static_cast<int64_t>(items.size());
    for (int64_t i = 0; i < n && status.is_ok(); ++i) {
      if (++iterations_ > limits_.max_loop_iterations) {
        status = at_node(node, resource_exhausted("more than {} loop iterations", limits_.max_loop_iterations));
        break;
      }
      Value loop = Value::object();
      Object& l = loop.as_object();
      l.set("index", Value::integer(i + 1));
      l.set("index0", Value::integer(i));
      l.set("revindex", Value::integer(n - i));
      l.set("revindex0", Value::integer(n - i - 1));
      l.set("first", Value::boolean(i == 0));
      l.set("last", Value::boolean(i == n - 1));
      l.set("length", Value::integer(n));
      l.set("previtem", i > 0 ? items[i - 1] : Value());
      l.set("nextitem", i + 1 < n ? items[i + 1] : Value());
      l.set("cycle", Value::function([i](CallArgs& args) -> Expected<Value> {
        if (args.positional.empty()) return invalid_argument("loop.cycle() needs arguments");
        return args.positional[static_cast<size_t>(i) % args.positional.size()];
      }));
      frames_.back()->insert_or_assign("loop", loop);
      status = assign(*node.children[0], items[i]);
      if (!status.is_ok()) break;
      auto flow = exec_block(node.body, out);
      if (!flow) {
        status = flow.status();
      } else if (*flow == Flow::kBreak) {
        break;
      }
    }
    frames_.pop_back();
    MOE_RETURN_IF_ERROR(status);
    if (n == 0) {
      MOE_ASSIGN_OR_RETURN(Flow flow, exec_block(node.else_body, out));
      (void)flow;
    }
    return Status::ok();
  }

  Status assign(const Node& target, const Value& v) {
    if (target.kind == NodeKind::kIdentifier) {
      frames_.back()->insert_or_assign(target.name, v);
      return Status::ok();
    }
    if (target.kind == NodeKind::kMember) {
      MOE_ASSIGN_OR_RETURN(Value object, eval(*target.children[0]));
      if (!object.is_object()) return at_node(target, invalid_argument("cannot set an attribute of {}", object.type_name()));
      if (reaches(v, &object.as_object()))
        return at_node(target, invalid_argument("cannot store '{}' inside itself", target.name));
      object.as_object().set(target.name, v);
      return Status::ok();
    }
    if (target.kind == NodeKind::kTuple) {
      if (!v.is_array() || v.as_array().size() != target.children.size()) {
        return at_node(target, invalid_argument("cannot unpack {} into {} names", v.type_name(), target.children.size()));
      }
      for (size_t i = 0; i < target.children.size(); ++i) MOE_RETURN_IF_ERROR(assign(*target.children[i], v.as_array()[i]));
      return Status::ok();
    }
    return at_node(target, invalid_argument("cannot assign to this expression"));
  }

  Status exec_set(const Node& node) {
    Value value;
    if (node.children[1]) {
      MOE_ASSIGN_OR_RETURN(value, eval(*node.children[1]));
    } else {
      std::string body;
      MOE_ASSIGN_OR_RETURN(Flow flow, exec_block(node.body, body));
      (void)flow;
      value = Value::string(std::move(body));
    }
    return assign(*node.children[0], value);
  }

  Value make_macro(const Node& node) {
    return Value::function([this, &node](CallArgs& args) -> Expected<Value> {
      if (call_depth_ >= limits_.max_call_depth) {
        return resource_exhausted("macro calls nested deeper than {}", limits_.max_call_depth);
      }
      auto frame = std::make_shared<Frame>();
      std::vector<std::shared_ptr<Frame>> saved = {frames_.front(), frame};
      std::swap(saved, frames_);  // a macro sees the globals and its parameters only
      ++call_depth_;
      Status status = Status::ok();
      for (size_t i = 0; i < node.params.size() && status.is_ok(); ++i) {
        const auto& [name, default_node] = node.params[i];
        if (i < args.positional.size()) {
          (*frame)[name] = args.positional[i];
        } else if (const Value* kw = args.keyword(name)) {
          (*frame)[name] = *kw;
        } else if (default_node) {
          auto v = eval(*default_node);
          if (v) (*frame)[name] = *v; else status = v.status();
        } else {
          (*frame)[name] = Value();
        }
      }
      std::string out;
      if (status.is_ok()) {
        auto flow = exec_block(node.body, out);
        if (!flow) status = flow.status();
      }
      --call_depth_;
      std::swap(saved, frames_);
      MOE_RETURN_IF_ERROR(status);
      return Value::string(std::move(out));
    });
  }

  Expected<CallArgs> eval_args(const Node& node, size_t first) {
    CallArgs args;
    for (size_t i = first; i < node.children.size(); ++i) {
      MOE_ASSIGN_OR_RETURN(Value v, eval(*node.children[i]));
      args.positional.push_back(std::move(v));
    }
    for (const auto& [name, value_node] : node.params) {
      MOE_ASSIGN_OR_RETURN(Value v, eval(*value_node));
      args.keywords.emplace_back(name, std::move(v));
    }
    return args;
  }

  Expected<Value> eval_call(const Node& node) {
    MOE_ASSIGN_OR_RETURN(CallArgs args, eval_args(node, 1));
    const Node& callee = *node.children[0];
    Value fn;
    if (callee.kind == NodeKind::kMember) {
      MOE_ASSIGN_OR_RETURN(Value object, eval(*callee.children[0]));
      const Value* attribute = object.is_object() ? object.as_object().find(callee.name) : nullptr;
      if (attribute != nullptr) {
        fn = *attribute;
      } else {
        bool found = false;
        auto result = call_method(object, callee.name, args, found, limits_.js_strip_dialect);
        if (!result) return at_node(node, result.status());
        if (!found) return at_node(callee, invalid_argument("{} has no method '{}'", object.type_name(), callee.name));
        return result;
      }
    } else {
      MOE_ASSIGN_OR_RETURN(fn, eval(callee));
    }
    if (!fn.is_function()) return at_node(callee, invalid_argument("cannot call {}", fn.type_name()));
    auto result = fn.as_function()(args);
    if (!result) return at_node(node, result.status());
    return result;
  }

  Expected<Value> eval_binary(const Node& node);
  Expected<Value> eval(const Node& node);

  const ChatTemplateLimits& limits_;
  std::vector<std::shared_ptr<Frame>> frames_;
  int call_depth_ = 0;
  int64_t iterations_ = 0;
};

Expected<Value> numeric_binary(const std::string& op, const Value& a, const Value& b) {
  const bool floats = a.is_float() || b.is_float();
  if (op == "+" || op == "-" || op == "*") {
    if (!floats) {
      int64_t r;
      const bool overflow = op == "+"   ? __builtin_add_overflow(a.as_int(), b.as_int(), &r)
                            : op == "-" ? __builtin_sub_overflow(a.as_int(), b.as_int(), &r)
                                        : __builtin_mul_overflow(a.as_int(), b.as_int(), &r);
      if (!overflow) return Value::integer(r);
    }
    const double x = a.as_double(), y = b.as_double();
    return Value::number(op == "+" ? x + y : op == "-" ? x - y : x * y);
  }
  if (op == "/") {
    if (b.as_double() == 0) return invalid_argument("division by zero");
    return Value::number(a.as_double() / b.as_double());
  }
  if (op == "//" || op == "%") {
    if (b.as_double() == 0) return invalid_argument("division by zero");
    if (!floats) {
      if (b.as_int() == -1) return Value::integer(op == "//" ? -a.as_int() : 0);  // no INT64_MIN / -1 trap
      const int64_t q = a.as_int() / b.as_int(), m = a.as_int() % b.as_int();
      if (op == "//") return Value::integer(q - ((m != 0 && ((m < 0) != (b.as_int() < 0))) ? 1 : 0));
      return Value::integer(m);  // JavaScript's % keeps the sign of the dividend
    }
    return Value::number(op == "//" ? std::floor(a.as_double() / b.as_double()) : std::fmod(a.as_double(), b.as_double()));
  }
  if (op == "**") {
    const double r = std::pow(a.as_double(), b.as_double());
    if (!std::isfinite(r)) return invalid_argument("exponentiation result is not finite");
    if (!floats && b.as_int() >= 0 && std::fabs(r) < 9.2e18) return Value::integer(static_cast<int64_t>(r));
    return Value::number(r);
  }
  const double x = a.as_double(), y = b.as_double();
  if (op == "<") return Value::boolean(x < y);
  if (op == ">") return Value::boolean(x > y);
  if (op == "<=") return Value::boolean(x <= y);
  if (op == ">=") return Value::boolean(x >= y);
  return invalid_argument("unsupported operator '{}' on numbers", op);
}

bool contains(const Value& container, const Value& item) {
  if (container.is_array()) {
    for (const Value& v : container.as_array()) {
      if (values_equal(v, item) && v.kind() == item.kind()) return true;
      if (v.is_number() && item.is_number() && v.as_double() == item.as_double()) return true;
    }
    return false;
  }
  if (container.is_string() && item.is_string()) return container.as_string().find(item.as_string()) != std::string::npos;
  if (container.is_object() && item.is_string()) return container.as_object().find(item.as_string()) != nullptr;
  return false;
}

Expected<Value> Interpreter::eval_binary(const Node& node) {
  const std::string& op = node.name;
  MOE_ASSIGN_OR_RETURN(Value left, eval(*node.children[0]));
  if (op == "and") return left.truthy() ? eval(*node.children[1]) : left;
  if (op == "or") return left.truthy() ? left : eval(*node.children[1]);
  MOE_ASSIGN_OR_RETURN(Value right, eval(*node.children[1]));
  if (op == "==") return Value::boolean(values_equal(left, right));
  if (op == "!=") return Value::boolean(!values_equal(left, right));
  if (op == "in" || op == "not in") {
    if (right.is_undefined()) return Value::boolean(op == "not in");
    if (left.is_undefined()) return at_node(node, invalid_argument("cannot test whether undefined is in a value"));
    return Value::boolean(contains(right, left) == (op == "in"));
  }
  if (left.is_undefined() || right.is_undefined()) {
    return at_node(node, invalid_argument("cannot apply '{}' to an undefined value", op));
  }
  if (left.is_none() || right.is_none()) return at_node(node, invalid_argument("cannot apply '{}' to none", op));
  if (op == "~") {
    std::string s = left.to_output() + right.to_output();
    if (s.size() > limits_.max_output_bytes) return at_node(node, resource_exhausted("string too long"));
    return Value::string(std::move(s));
  }
  auto numeric = [](const Value& v) { return v.is_number() || v.is_bool(); };
  auto as_number = [](const Value& v) { return v.is_bool() ? Value::integer(v.as_bool() ? 1 : 0) : v; };
  if (numeric(left) && numeric(right) && (left.is_number() || right.is_number() || op == "**")) {
    auto result = numeric_binary(op, as_number(left), as_number(right));
    if (!result) return at_node(node, result.status());
    return result;
  }
  if (op == "+" && left.is_array() && right.is_array()) {
    Array joined = left.as_array();
    joined.insert(joined.end(), right.as_array().begin(), right.as_array().end());
    return Value::array(std::move(joined));
  }
  if (op == "+" && (left.is_string() || right.is_string())) {
    std::string s = left.to_output() + right.to_output();
    if (s.size() > limits_.max_output_bytes) return at_node(node, resource_exhausted("string too long"));
    return Value::string(std::move(s));
  }
  if (op == "*" && (left.is_string() || right.is_string()) && (left.is_int() || right.is_int())) {
    const std::string& s = left.is_string() ? left.as_string() : right.as_string();
    const int64_t n = left.is_int() ? left.as_int() : right.as_int();
    if (n > 0 && s.size() * static_cast<uint64_t>(n) > limits_.max_output_bytes) {
      return at_node(node, resource_exhausted("string too long"));
    }
    std::string out;
    for (int64_t i = 0; i < n; ++i) out += s;
    return Value::string(std::move(out));
  }
  if (left.is_string() && right.is_string() && (op == "<" || op == ">" || op == "<=" || op == ">=")) {
    const int c = left.as_string().compare(right.as_string());
    return Value::boolean(op == "<" ? c < 0 : op == ">" ? c > 0 : op == "<=" ? c <= 0 : c >= 0);
  }
  return at_node(node, invalid_argument("unsupported operand types for '{}': {} and {}", op, left.type_name(),
                                        right.type_name()));
}

Expected<Value> Interpreter::eval(const Node& node) {
  switch (node.kind) {
    case NodeKind::kLiteral: return node.literal;
    case NodeKind::kIdentifier: return lookup(node.name);
    case NodeKind::kList:
    case NodeKind::kTuple: {
      Array items;
      for (const NodePtr& child : node.children) {
        MOE_ASSIGN_OR_RETURN(Value v, eval(*child));
        items.push_back(std::move(v));
      }
      return Value::array(std::move(items));
    }
    case NodeKind::kDict: {
      Value object = Value::object();
      for (size_t i = 0; i + 1 < node.children.size(); i += 2) {
        MOE_ASSIGN_OR_RETURN(Value key, eval(*node.children[i]));
        MOE_ASSIGN_OR_RETURN(Value v, eval(*node.children[i + 1]));
        if (!key.is_string()) return at_node(*node.children[i], invalid_argument("dict keys must be strings"));
        object.as_object().set(key.as_string(), std::move(v));
      }
      return object;
    }
    case NodeKind::kMember: {
      MOE_ASSIGN_OR_RETURN(Value object, eval(*node.children[0]));
      return index_value(object, object.is_object() || node.name.empty() || !std::isdigit(node.name[0])
                                     ? Value::string(node.name)
                                     : Value::integer(std::atoll(node.name.c_str())));
    }
    case NodeKind::kSubscript: {
      MOE_ASSIGN_OR_RETURN(Value object, eval(*node.children[0]));
      MOE_ASSIGN_OR_RETURN(Value index, eval(*node.children[1]));
      return index_value(object, index);
    }
    case NodeKind::kSlice: {
      MOE_ASSIGN_OR_RETURN(Value object, eval(*node.children[0]));
      Value parts[3];
      for (int i = 0; i < 3; ++i) {
        if (node.children[i + 1]) {
          MOE_ASSIGN_OR_RETURN(parts[i], eval(*node.children[i + 1]));
        }
      }
      auto result = slice_value(object, parts[0], parts[1], parts[2]);
      if (!result) return at_node(node, result.status());
      return result;
    }
    case NodeKind::kCall: return eval_call(node);
    case NodeKind::kFilter: {
      MOE_ASSIGN_OR_RETURN(Value operand, eval(*node.children[0]));
      MOE_ASSIGN_OR_RETURN(CallArgs args, eval_args(node, 1));
      auto result = apply_filter(node.name, operand, args);
      if (!result) return at_node(node, result.status());
      return result;
    }
    case NodeKind::kTest: {
      MOE_ASSIGN_OR_RETURN(Value operand, eval(*node.children[0]));
      MOE_ASSIGN_OR_RETURN(CallArgs args, eval_args(node, 1));
      auto result = apply_test(node.name, operand, args);
      if (!result) return at_node(node, result.status());
      return Value::boolean(*result != node.negated);
    }
    case NodeKind::kUnary: {
      MOE_ASSIGN_OR_RETURN(Value operand, eval(*node.children[0]));
      if (node.name == "not") return Value::boolean(!operand.truthy());
      if (operand.is_int()) {
        if (node.name == "+") return operand;
        if (operand.as_int() == INT64_MIN) return Value::number(-operand.as_double());
        return Value::integer(-operand.as_int());
      }
      if (operand.is_float()) return Value::number(node.name == "-" ? -operand.as_double() : operand.as_double());
      return at_node(node, invalid_argument("unary '{}' needs a number, got {}", node.name, operand.type_name()));
    }
    case NodeKind::kBinary: return eval_binary(node);
    case NodeKind::kTernary: {
      MOE_ASSIGN_OR_RETURN(Value cond, eval(*node.children[1]));
      if (cond.truthy()) return eval(*node.children[0]);
      if (node.children[2]) return eval(*node.children[2]);
      return Value();
    }
    default: return at_node(node, internal_error("statement used as an expression"));
  }
}

}  // namespace
}  // namespace tmpl

Expected<ChatTemplate> ChatTemplate::create(std::string_view source, ChatTemplateLimits limits) {
  MOE_ASSIGN_OR_RETURN(auto program, tmpl::parse_template(source));
  return ChatTemplate(std::make_shared<const Program>(std::move(program)), limits);
}

Expected<std::string> ChatTemplate::render(const nlohmann::ordered_json& context) const {
  tmpl::Interpreter interpreter(limits_);
  return interpreter.run(*program_, context);
}

nlohmann::ordered_json make_chat_context(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                                         bool add_generation_prompt, const std::string& bos_token,
                                         const std::string& eos_token, const nlohmann::ordered_json& kwargs) {
  nlohmann::ordered_json context = nlohmann::ordered_json::object();
  context["messages"] = messages;
  if (!tools.is_null()) context["tools"] = tools;
  context["add_generation_prompt"] = add_generation_prompt;
  context["bos_token"] = bos_token;
  context["eos_token"] = eos_token;
  if (kwargs.is_object()) {
    for (const auto& [key, value] : kwargs.items()) context[key] = value;
  }
  return context;
}

Expected<std::string> continue_final_message(const std::string& rendered, const std::string& final_content) {
  const std::string stripped = strip_whitespace(final_content, true, true);
  const std::string left_stripped = strip_whitespace(final_content, true, false);
  const size_t at = rendered.rfind(stripped);
  if (at == std::string::npos)
    return invalid_argument(
        "continue_final_message: the final message does not appear in the rendered chat (the chat template "
        "changes its text)");
  // The rendering kept the message whole from there (its trailing whitespace
  // too, and it had no leading whitespace): cut after it; else after its
  // stripped text.
  const bool whole = rendered.compare(at, left_stripped.size(), final_content) == 0;
  return rendered.substr(0, at + (whole ? left_stripped.size() : stripped.size()));
}

}  // namespace moe::tokenizer
