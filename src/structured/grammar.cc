#include "structured/grammar.h"

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

#include "core/check.h"
#include "structured/number_range.h"

namespace moe::structured {
namespace {

using Json = nlohmann::ordered_json;

constexpr size_t kMaxNodes = 1 << 14;
constexpr int kMaxDepth = 64;
constexpr size_t kMaxChoices = 1024;
constexpr int64_t kMaxSchemaRegexStates = 1 << 16;

}  // namespace

void LiteralTrie::add(std::string_view bytes, int32_t value) {
  // Values come in increasing order, so every node's values_below stays sorted.
  CHECK(nodes_[0].values_below.empty() || nodes_[0].values_below.back() < value, "literal {} out of order", value);
  int32_t node = 0;
  nodes_[0].values_below.push_back(value);
  for (const char ch : bytes) {
    const auto byte = static_cast<uint8_t>(ch);
    int32_t next = step(node, byte);
    if (next < 0) {
      next = static_cast<int32_t>(nodes_.size());
      nodes_[static_cast<size_t>(node)].next.emplace_back(byte, next);
      nodes_.emplace_back();
    }
    node = next;
    nodes_[static_cast<size_t>(node)].values_below.push_back(value);
  }
  nodes_[static_cast<size_t>(node)].value = value;
}

int32_t LiteralTrie::step(int32_t node, uint8_t byte) const {
  for (const auto& [b, next] : nodes_[static_cast<size_t>(node)].next)
    if (b == byte) return next;
  return -1;
}

bool LiteralTrie::reaches(int32_t node, int32_t lo, int32_t hi) const {
  const auto& v = nodes_[static_cast<size_t>(node)].values_below;
  auto it = std::lower_bound(v.begin(), v.end(), lo);
  return it != v.end() && *it <= hi;
}

bool nesting_exceeds(const nlohmann::ordered_json& value, size_t max_depth) {
  // Iterative: a hostile document deep enough to overflow the stack is the point.
  std::vector<std::pair<const Json*, size_t>> stack = {{&value, 1}};
  while (!stack.empty()) {
    const auto [v, depth] = stack.back();
    stack.pop_back();
    if (!v->is_structured()) continue;
    if (depth > max_depth) return true;
    for (const Json& child : *v) stack.emplace_back(&child, depth + 1);
  }
  return false;
}

// Every anyOf node's alternatives become the non-anyOf nodes it reaches
// through anyOf nodes ($ref slots included), each once: a value start then
// forks once, whatever the nesting of anyOf and $ref, and a cycle of them
// (a $ref to itself) adds nothing. An anyOf that reaches nothing, or more
// alternatives than the matcher keeps threads, is refused.
Status Grammar::flatten_any_of() {
  std::vector<std::vector<int32_t>> leaves(nodes_.size());
  for (size_t i = 0; i < nodes_.size(); ++i) {
    if (nodes_[i].kind != NodeKind::kAnyOf) continue;
    std::vector<uint8_t> seen(nodes_.size(), 0);
    std::vector<int32_t> stack(nodes_[i].alternatives.rbegin(), nodes_[i].alternatives.rend());
    seen[i] = 1;
    while (!stack.empty()) {
      const int32_t n = stack.back();
      stack.pop_back();
      if (seen[static_cast<size_t>(n)]) continue;
      seen[static_cast<size_t>(n)] = 1;
      const Node& node = nodes_[static_cast<size_t>(n)];
      if (node.kind != NodeKind::kAnyOf) {
        leaves[i].push_back(n);
        continue;
      }
      for (auto it = node.alternatives.rbegin(); it != node.alternatives.rend(); ++it) stack.push_back(*it);
    }
    if (leaves[i].empty()) return invalid_argument("a JSON schema's $ref / anyOf cycle accepts no value");
    if (leaves[i].size() > kMaxAlternatives)
      return invalid_argument("a JSON schema's anyOf / oneOf (or type list) has {} alternatives; at most {} are "
                              "served", leaves[i].size(), kMaxAlternatives);
  }
  for (size_t i = 0; i < nodes_.size(); ++i)
    if (nodes_[i].kind == NodeKind::kAnyOf) nodes_[i].alternatives = std::move(leaves[i]);
  return Status::ok();
}

int32_t Grammar::add(Node node) {
  nodes_.push_back(std::move(node));
  return static_cast<int32_t>(nodes_.size() - 1);
}

// Compiles one JSON Schema document into a Grammar's nodes.
// The automata of a grammar's patterns, formats and bounds, each compiled
// once; together at most kMaxSchemaRegexStates states (a request body of
// bounded numbers or patterns is cheap to write and not to compile).
struct SchemaAutomata {
  std::map<std::pair<std::string, RegexMatch>, std::shared_ptr<const Regex>> compiled;
  int64_t states = 0;
};

class SchemaCompiler {
 public:
  SchemaCompiler(Grammar& g, const Json& document, SchemaAutomata& automata)
      : g_(g), document_(document), automata_(automata) {}

  Expected<int32_t> compile(const Json& schema, int depth) {
    if (depth > kMaxDepth) return invalid_argument("the JSON schema nests deeper than {} levels", kMaxDepth);
    if (g_.nodes_.size() > kMaxNodes) return invalid_argument("the JSON schema is too large (over {} nodes)", kMaxNodes);
    if (schema.is_boolean()) {
      if (schema.get<bool>()) return g_.any_;
      return invalid_argument("the JSON schema 'false' accepts no value");
    }
    if (!schema.is_object()) return invalid_argument("a JSON schema must be an object or a boolean");
    MOE_RETURN_IF_ERROR(check_keywords(schema));
    MOE_RETURN_IF_ERROR(check_siblings(schema));
    if (auto it = schema.find("$ref"); it != schema.end()) return compile_ref(*it, depth);
    if (auto it = schema.find("allOf"); it != schema.end()) {
      if (!it->is_array() || it->size() != 1)
        return invalid_argument("JSON schema 'allOf' is served with exactly one schema");
      return compile((*it)[0], depth + 1);
    }
    for (const char* key : {"anyOf", "oneOf"}) {
      if (auto it = schema.find(key); it != schema.end()) {
        if (!it->is_array() || it->empty())
          return invalid_argument("JSON schema '{}' must be a non-empty array of schemas", key);
        Node any_of{.kind = NodeKind::kAnyOf};
        for (const Json& alternative : *it) {
          MOE_ASSIGN_OR_RETURN(const int32_t n, compile(alternative, depth + 1));
          any_of.alternatives.push_back(n);
        }
        return g_.add(std::move(any_of));
      }
    }
    if (auto it = schema.find("const"); it != schema.end()) return literals(Json::array({*it}));
    if (auto it = schema.find("enum"); it != schema.end()) {
      if (!it->is_array() || it->empty()) return invalid_argument("JSON schema 'enum' must be a non-empty array");
      return literals(*it);
    }
    auto type = schema.find("type");
    if (type == schema.end()) {  // the type the keywords imply, else any value
      if (schema.contains("properties") || schema.contains("required") || schema.contains("additionalProperties"))
        return compile_type(schema, "object", depth);
      if (schema.contains("items") || schema.contains("prefixItems") || schema.contains("additionalItems") ||
          schema.contains("minItems") || schema.contains("maxItems"))
        return compile_type(schema, "array", depth);
      if (schema.contains("minimum") || schema.contains("maximum") || schema.contains("exclusiveMinimum") ||
          schema.contains("exclusiveMaximum"))
        return compile_type(schema, "number", depth);
      if (schema.contains("minLength") || schema.contains("maxLength") || schema.contains("pattern") ||
          schema.contains("format"))
        return compile_type(schema, "string", depth);
      return g_.any_;
    }
    if (type->is_string()) return compile_type(schema, type->get<std::string>(), depth);
    if (!type->is_array() || type->empty())
      return invalid_argument("JSON schema 'type' must be a type name or a non-empty array of them");
    Node any_of{.kind = NodeKind::kAnyOf};
    for (const Json& t : *type) {
      if (!t.is_string()) return invalid_argument("JSON schema 'type' must be a type name or an array of them");
      MOE_ASSIGN_OR_RETURN(const int32_t n, compile_type(schema, t.get<std::string>(), depth));
      any_of.alternatives.push_back(n);
    }
    return g_.add(std::move(any_of));
  }

 private:
  // Keywords with no effect on what is valid (annotations, and the $defs a $ref reads).
  static bool is_annotation(const std::string& key) {
    static const std::set<std::string> annotations = {"title",      "description", "default",  "examples",
                                                       "$schema",    "$id",         "$comment", "deprecated",
                                                       "readOnly",   "writeOnly",   "strict",   "$defs",
                                                       "definitions"};
    return annotations.contains(key);
  }

  static Status check_keywords(const Json& schema) {
    static const std::set<std::string> served = {
        "type",     "properties", "required",         "additionalProperties", "items",   "prefixItems",
        "additionalItems", "minItems", "maxItems", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
        "minLength", "maxLength",  "pattern",          "format",               "enum",    "const",
        "anyOf",    "oneOf",      "allOf",            "$ref"};
    for (const auto& [key, value] : schema.items()) {
      (void)value;
      if (!served.contains(key) && !is_annotation(key))
        return invalid_argument("JSON schema keyword '{}' is not supported by this server", key);
    }
    return Status::ok();
  }

  // $ref, allOf, anyOf / oneOf, const and enum take the schema's place: any
  // other validation keyword beside one would be dropped, so it is refused
  // ("type" beside enum / const is allowed: the values say it).
  static Status check_siblings(const Json& schema) {
    const char* combinators[] = {"$ref", "allOf", "anyOf", "oneOf", "const", "enum"};
    for (const char* c : combinators) {
      if (!schema.contains(c)) continue;
      for (const auto& [key, value] : schema.items()) {
        (void)value;
        if (key == c || is_annotation(key)) continue;
        if (key == "type" && (std::string_view(c) == "const" || std::string_view(c) == "enum")) continue;
        return invalid_argument("JSON schema keyword '{}' beside '{}' is not supported by this server (put it "
                                "inside the alternatives)",
                                key, c);
      }
    }
    return Status::ok();
  }

  Expected<int32_t> compile_ref(const Json& ref, int depth) {
    if (!ref.is_string()) return invalid_argument("JSON schema '$ref' must be a string");
    const std::string path = ref.get<std::string>();
    if (auto it = refs_.find(path); it != refs_.end()) return it->second;
    std::string name;
    const Json* defs = nullptr;
    for (const char* prefix : {"#/$defs/", "#/definitions/"}) {
      if (path.starts_with(prefix)) {
        name = path.substr(std::string_view(prefix).size());
        const std::string key = std::string(prefix).substr(2, std::string_view(prefix).size() - 3);
        if (auto it = document_.find(key); it != document_.end() && it->is_object()) defs = &*it;
      }
    }
    if (path == "#") return invalid_argument("JSON schema '$ref' \"#\" (the whole schema) is not supported; use $defs");
    if (!defs || !defs->contains(name))
      return invalid_argument("JSON schema '$ref' \"{}\" names no entry of $defs or definitions", path);
    // A placeholder first, so that a recursive reference finds it.
    const int32_t slot = g_.add(Node{.kind = NodeKind::kAnyOf});
    refs_[path] = slot;
    MOE_ASSIGN_OR_RETURN(const int32_t target, compile((*defs)[name], depth + 1));
    g_.nodes_[static_cast<size_t>(slot)].alternatives = {target};
    return slot;
  }

  Expected<int32_t> literals(const Json& values) {
    Node n{.kind = NodeKind::kLiterals};
    int32_t i = 0;
    for (const Json& v : values) n.literals.add(v.dump(), i++);
    return g_.add(std::move(n));
  }

  static Expected<int32_t> count(const Json& schema, const char* key, int32_t fallback) {
    auto it = schema.find(key);
    if (it == schema.end()) return fallback;
    if (!it->is_number_integer() || it->get<int64_t>() < 0 || it->get<int64_t>() > (1 << 20))
      return invalid_argument("JSON schema '{}' must be an integer in [0, {}]", key, 1 << 20);
    return static_cast<int32_t>(it->get<int64_t>());
  }

  // A string's `pattern` or `format` (one of them) as its regular expression.
  Status string_pattern(const Json& schema, Node& n) {
    auto pattern = schema.find("pattern");
    auto format = schema.find("format");
    if (pattern != schema.end() && format != schema.end())
      return invalid_argument("JSON schema 'pattern' and 'format' together are not supported by this server");
    std::string source;
    const char* keyword = "pattern";
    if (pattern != schema.end()) {
      if (!pattern->is_string()) return invalid_argument("JSON schema 'pattern' must be a string");
      source = pattern->get<std::string>();
    } else if (format != schema.end()) {
      keyword = "format";
      if (!format->is_string()) return invalid_argument("JSON schema 'format' must be a string");
      const std::string name = format->get<std::string>();
      source = format_pattern(name);
      if (source.empty())
        return invalid_argument("JSON schema 'format' \"{}\" is not supported by this server (date, time, date-time, "
                                "duration, uuid, email, ipv4, ipv6, hostname and uri are)",
                                name);
      if (name == "hostname") n.max_length = n.max_length < 0 ? 253 : std::min(n.max_length, 253);
    } else {
      return Status::ok();
    }
    if (source.size() > kMaxPatternBytes)
      return invalid_argument("JSON schema 'pattern' is longer than {} bytes", kMaxPatternBytes);
    auto regex = automaton(source, RegexMatch::kSearch);
    if (!regex) return invalid_argument("JSON schema '{}': {}", keyword, regex.status().message());
    if (!(*regex)->viable((*regex)->start(), 0, n.min_length, n.max_length))
      return invalid_argument("JSON schema '{}' matches no string within 'minLength' / 'maxLength'", keyword);
    n.pattern = std::move(*regex);
    return Status::ok();
  }

  Expected<int32_t> compile_type(const Json& schema, const std::string& type, int depth) {
    if (type == "null") return literals(Json::array({nullptr}));
    if (type == "boolean") return literals(Json::array({true, false}));
    if (type == "integer" || type == "number") return compile_number(schema, type == "integer");
    if (type == "string") {
      Node n{.kind = NodeKind::kString};
      MOE_ASSIGN_OR_RETURN(n.min_length, count(schema, "minLength", 0));
      MOE_ASSIGN_OR_RETURN(n.max_length, count(schema, "maxLength", -1));
      if (n.max_length >= 0 && n.max_length < n.min_length)
        return invalid_argument("JSON schema 'maxLength' is below 'minLength'");
      MOE_RETURN_IF_ERROR(string_pattern(schema, n));
      return g_.add(std::move(n));
    }
    if (type == "array") return compile_array(schema, depth);
    if (type == "object") return compile_object(schema, depth);
    return invalid_argument("JSON schema type '{}' is not a JSON type", type);
  }

  // The tightest of the lower (upper) bounds; an exclusive one wins a tie.
  static void tighten(std::optional<NumberBound>& bound, NumberBound b, int sign) {
    const int c = bound ? compare(b.value, bound->value) * sign : 1;
    if (c > 0 || (c == 0 && !b.inclusive)) bound = std::move(b);
  }

  // A bound as the decimal its JSON text writes (0.1 is one tenth).
  static Expected<Decimal> bound_value(const Json& value, const char* key) {
    if (!value.is_number()) return invalid_argument("JSON schema '{}' must be a number", key);
    return Decimal::parse(value.dump(), key);
  }

  // minimum / maximum / exclusiveMinimum / exclusiveMaximum (numbers; or, as
  // in draft 4, exclusiveMinimum / exclusiveMaximum true beside minimum / maximum).
  static Expected<NumberRange> number_range(const Json& schema) {
    NumberRange range;
    for (const auto& [key, exclusive_key, sign] : {std::tuple{"minimum", "exclusiveMinimum", 1},
                                                    std::tuple{"maximum", "exclusiveMaximum", -1}}) {
      auto& bound = sign > 0 ? range.lower : range.upper;
      bool draft4_exclusive = false;
      if (auto it = schema.find(exclusive_key); it != schema.end()) {
        if (it->is_boolean()) {
          draft4_exclusive = it->get<bool>();
          if (draft4_exclusive && !schema.contains(key))
            return invalid_argument("JSON schema '{}' true needs '{}'", exclusive_key, key);
        } else {
          MOE_ASSIGN_OR_RETURN(Decimal value, bound_value(*it, exclusive_key));
          tighten(bound, NumberBound{std::move(value), false}, sign);
        }
      }
      if (auto it = schema.find(key); it != schema.end()) {
        MOE_ASSIGN_OR_RETURN(Decimal value, bound_value(*it, key));
        tighten(bound, NumberBound{std::move(value), !draft4_exclusive}, sign);
      }
    }
    return range;
  }

  Expected<int32_t> compile_number(const Json& schema, bool integer) {
    Node n{.kind = integer ? NodeKind::kInteger : NodeKind::kNumber};
    MOE_ASSIGN_OR_RETURN(const NumberRange range, number_range(schema));
    if (!range.lower && !range.upper) return g_.add(std::move(n));
    MOE_ASSIGN_OR_RETURN(const std::string source, number_range_pattern(range, integer));
    auto regex = automaton(source, RegexMatch::kWhole);
    if (!regex) return invalid_argument("the JSON schema's bounds: {}", regex.status().message());
    n.pattern = std::move(*regex);
    return g_.add(std::move(n));
  }

  // items / prefixItems (2020-12), or items as an array and additionalItems
  // (draft 7): the first items by position, the others by one schema (false: none).
  Expected<int32_t> compile_array(const Json& schema, int depth) {
    Node n{.kind = NodeKind::kArray, .items = g_.any_};
    MOE_ASSIGN_OR_RETURN(n.min_items, count(schema, "minItems", 0));
    MOE_ASSIGN_OR_RETURN(n.max_items, count(schema, "maxItems", -1));
    if (n.max_items >= 0 && n.max_items < n.min_items)
      return invalid_argument("JSON schema 'maxItems' is below 'minItems'");
    auto items = schema.find("items");
    auto prefix = schema.find("prefixItems");
    auto additional = schema.find("additionalItems");
    if (items != schema.end() && items->is_array()) {
      if (prefix != schema.end())
        return invalid_argument("JSON schema 'items' as an array beside 'prefixItems' is not supported");
      prefix = items;
      items = additional;
    } else if (additional != schema.end()) {
      return invalid_argument("JSON schema 'additionalItems' is served only beside 'items' as an array");
    }
    if (prefix != schema.end()) {
      if (!prefix->is_array()) return invalid_argument("JSON schema 'prefixItems' must be an array of schemas");
      for (const Json& item : *prefix) {
        MOE_ASSIGN_OR_RETURN(const int32_t node, compile(item, depth + 1));
        n.prefix_items.push_back(node);
      }
    }
    if (items != schema.end()) {
      if (*items == false) {
        n.items = -1;
        const auto fixed = static_cast<int32_t>(n.prefix_items.size());
        n.max_items = n.max_items < 0 ? fixed : std::min(n.max_items, fixed);
        if (n.min_items > n.max_items)
          return invalid_argument("JSON schema 'minItems' asks for more items than 'prefixItems' lists and 'items' "
                                  "false allows");
      } else {
        MOE_ASSIGN_OR_RETURN(n.items, compile(*items, depth + 1));
      }
    }
    return g_.add(std::move(n));
  }

  Expected<int32_t> compile_object(const Json& schema, int depth) {
    Node n{.kind = NodeKind::kObject};
    std::set<std::string> required;
    if (auto it = schema.find("required"); it != schema.end()) {
      if (!it->is_array()) return invalid_argument("JSON schema 'required' must be an array of names");
      for (const Json& name : *it) {
        if (!name.is_string()) return invalid_argument("JSON schema 'required' must be an array of names");
        required.insert(name.get<std::string>());
      }
    }
    if (auto it = schema.find("properties"); it != schema.end()) {
      if (!it->is_object()) return invalid_argument("JSON schema 'properties' must be an object");
      for (const auto& [name, sub] : it->items()) {
        MOE_ASSIGN_OR_RETURN(const int32_t node, compile(sub, depth + 1));
        n.keys.add(Json(name).dump(), static_cast<int32_t>(n.properties.size()));
        n.properties.push_back({name, node, required.contains(name)});
      }
    }
    for (const std::string& name : required) {
      if (std::none_of(n.properties.begin(), n.properties.end(), [&](const Property& p) { return p.name == name; }))
        return invalid_argument("JSON schema 'required' names \"{}\", which is not in 'properties'", name);
    }
    if (auto it = schema.find("additionalProperties"); it != schema.end() && *it != false) {
      MOE_ASSIGN_OR_RETURN(n.additional, compile(*it, depth + 1));
    } else if (!schema.contains("properties") && !schema.contains("additionalProperties") &&
               g_.options_.additional_properties) {
      n.additional = g_.any_;  // {"type": "object"} alone: any object (unless disable_additional_properties)
    }
    return g_.add(std::move(n));
  }

  // A pattern's automaton (SchemaAutomata).
  Expected<std::shared_ptr<const Regex>> automaton(const std::string& source, RegexMatch match) {
    const auto key = std::pair(source, match);
    if (auto it = automata_.compiled.find(key); it != automata_.compiled.end()) return it->second;
    auto regex = Regex::compile(source, match);
    if (!regex) return regex.status();
    automata_.states += regex->num_states();
    if (automata_.states > kMaxSchemaRegexStates)
      return invalid_argument("the JSON schema's patterns, formats and bounds are too large together (over {} "
                              "automaton states)",
                              kMaxSchemaRegexStates);
    return automata_.compiled[key] = std::make_shared<const Regex>(std::move(*regex));
  }

  Grammar& g_;
  const Json& document_;
  SchemaAutomata& automata_;
  std::map<std::string, int32_t> refs_;
};

// The well-known nodes every grammar starts with: any value (an anyOf of the
// JSON kinds), then any object, whose values are any.
static void add_any_nodes(std::vector<Node>& nodes, int32_t& any) {
  // any = anyOf(object of any, array of any, string, number, true/false/null)
  any = static_cast<int32_t>(nodes.size());
  nodes.push_back(Node{.kind = NodeKind::kAnyOf});
  const auto object = static_cast<int32_t>(nodes.size());
  nodes.push_back(Node{.kind = NodeKind::kObject, .additional = any});
  const auto array = static_cast<int32_t>(nodes.size());
  nodes.push_back(Node{.kind = NodeKind::kArray, .items = any});
  const auto string = static_cast<int32_t>(nodes.size());
  nodes.push_back(Node{.kind = NodeKind::kString});
  const auto number = static_cast<int32_t>(nodes.size());
  nodes.push_back(Node{.kind = NodeKind::kNumber});
  const auto words = static_cast<int32_t>(nodes.size());
  Node w{.kind = NodeKind::kLiterals};
  w.literals.add("true", 0);
  w.literals.add("false", 1);
  w.literals.add("null", 2);
  nodes.push_back(std::move(w));
  nodes[static_cast<size_t>(any)].alternatives = {object, array, string, number, words};
}

void Grammar::set_options(JsonOptions options) {
  options_ = options;
  if (!options.any_whitespace) source_["disable_any_whitespace"] = true;
  if (!options.additional_properties) source_["disable_additional_properties"] = true;
}

std::shared_ptr<const Grammar> Grammar::json_object(JsonOptions options) {
  auto g = std::make_shared<Grammar>();
  add_any_nodes(g->nodes_, g->any_);
  g->root_ = g->any_ + 1;  // the any-object node
  g->source_ = {{"type", "json_object"}};
  options.additional_properties = true;  // any object is what it asks for
  g->set_options(options);
  return g;
}

Expected<std::shared_ptr<const Grammar>> Grammar::from_json_schema(const nlohmann::ordered_json& schema,
                                                                   JsonOptions options) {
  if (nesting_exceeds(schema, kMaxSchemaNesting))
    return invalid_argument("the JSON schema nests deeper than {} levels", kMaxSchemaNesting);
  auto g = std::make_shared<Grammar>();
  add_any_nodes(g->nodes_, g->any_);
  g->options_ = options;
  SchemaAutomata automata;
  SchemaCompiler compiler(*g, schema, automata);
  MOE_ASSIGN_OR_RETURN(g->root_, compiler.compile(schema, 0));
  MOE_RETURN_IF_ERROR(g->flatten_any_of());
  g->source_ = {{"type", "json_schema"}, {"schema", schema}};
  g->set_options(options);
  return std::shared_ptr<const Grammar>(std::move(g));
}

Expected<std::shared_ptr<const Grammar>> Grammar::from_choices(const std::vector<std::string>& choices) {
  if (choices.empty() || choices.size() > kMaxChoices)
    return invalid_argument("a choice must list 1 to {} strings", kMaxChoices);
  auto g = std::make_shared<Grammar>();
  add_any_nodes(g->nodes_, g->any_);
  Node n{.kind = NodeKind::kChoice};
  for (size_t i = 0; i < choices.size(); ++i) {
    if (choices[i].empty()) return invalid_argument("a choice may not be the empty string");
    n.literals.add(choices[i], static_cast<int32_t>(i));
  }
  g->root_ = g->add(std::move(n));
  g->source_ = {{"type", "choice"}, {"choices", choices}};
  return std::shared_ptr<const Grammar>(std::move(g));
}

Expected<std::shared_ptr<const Grammar>> Grammar::from_regex(std::string_view pattern) {
  if (pattern.size() > kMaxPatternBytes) return invalid_argument("a regex is longer than {} bytes", kMaxPatternBytes);
  auto regex = Regex::compile(pattern, RegexMatch::kWhole);
  if (!regex) return regex.status();
  auto g = std::make_shared<Grammar>();
  add_any_nodes(g->nodes_, g->any_);
  g->root_ = g->add(Node{.kind = NodeKind::kRegex, .pattern = std::make_shared<const Regex>(std::move(*regex))});
  g->source_ = {{"type", "regex"}, {"pattern", pattern}};
  return std::shared_ptr<const Grammar>(std::move(g));
}

Expected<std::shared_ptr<const Grammar>> Grammar::from_ebnf(std::string_view grammar) {
  auto cfg = Cfg::compile(grammar);
  if (!cfg) return cfg.status();
  auto g = std::make_shared<Grammar>();
  add_any_nodes(g->nodes_, g->any_);
  g->root_ = g->add(Node{.kind = NodeKind::kCfg, .cfg = std::make_shared<const Cfg>(std::move(*cfg))});
  g->source_ = {{"type", "grammar"}, {"grammar", grammar}};
  return std::shared_ptr<const Grammar>(std::move(g));
}

TriggerScanner::TriggerScanner(const std::vector<std::string>& triggers) {
  for (const std::string& trigger : triggers) {
    int32_t s = 0;
    for (const char ch : trigger) {
      int32_t next = child(s, static_cast<uint8_t>(ch));
      if (next == 0) {
        next = static_cast<int32_t>(states_.size());
        states_[static_cast<size_t>(s)].next.emplace_back(static_cast<uint8_t>(ch), next);
        states_.emplace_back();
      }
      s = next;
    }
    states_[static_cast<size_t>(s)].hit = true;
  }
  // Failure links breadth first: the longest proper suffix that is a prefix of a trigger.
  std::vector<int32_t> queue;
  for (const auto& [byte, next] : states_[0].next) queue.push_back(next);
  for (size_t i = 0; i < queue.size(); ++i) {
    const int32_t s = queue[i];
    for (const auto& [byte, next] : states_[static_cast<size_t>(s)].next) {
      int32_t f = states_[static_cast<size_t>(s)].fail;
      while (f != 0 && child(f, byte) == 0) f = states_[static_cast<size_t>(f)].fail;
      const int32_t target = child(f, byte);
      State& n = states_[static_cast<size_t>(next)];
      n.fail = target == next ? 0 : target;
      n.hit = n.hit || states_[static_cast<size_t>(n.fail)].hit;
      queue.push_back(next);
    }
  }
}

int32_t TriggerScanner::child(int32_t state, uint8_t byte) const {
  for (const auto& [b, next] : states_[static_cast<size_t>(state)].next)
    if (b == byte) return next;
  return 0;
}

int32_t TriggerScanner::step(int32_t state, uint8_t byte) const {
  while (state != 0 && child(state, byte) == 0) state = states_[static_cast<size_t>(state)].fail;
  state = child(state, byte);
  return states_[static_cast<size_t>(state)].hit ? -1 : state;
}

Expected<std::shared_ptr<const Grammar>> Grammar::from_structural_tag(const nlohmann::ordered_json& spec,
                                                                      JsonOptions options) {
  const char* shape = "a structural tag is {\"structures\": [{\"begin\", \"schema\", \"end\"}, ...], \"triggers\": [...]}";
  if (!spec.is_object()) return invalid_argument("{}", shape);
  if (spec.contains("format"))
    return invalid_argument("a structural tag's 'format' (xgrammar's format objects) is not supported by this server; "
                            "{}", shape);
  const auto structures = spec.find("structures");
  const auto triggers = spec.find("triggers");
  if (structures == spec.end() || !structures->is_array() || structures->empty() || triggers == spec.end() ||
      !triggers->is_array() || triggers->empty())
    return invalid_argument("{}, both non-empty", shape);
  if (structures->size() > kMaxStructures)
    return invalid_argument("a structural tag lists {} structures; at most {} are served", structures->size(),
                            kMaxStructures);
  size_t bytes = 0;
  std::vector<std::string> trigger_texts;
  for (const Json& t : *triggers) {
    if (!t.is_string() || t.get<std::string>().empty())
      return invalid_argument("a structural tag's triggers must be non-empty strings");
    trigger_texts.push_back(t.get<std::string>());
    bytes += trigger_texts.back().size();
  }
  if (nesting_exceeds(spec, kMaxSchemaNesting))
    return invalid_argument("the structural tag nests deeper than {} levels", kMaxSchemaNesting);
  auto g = std::make_shared<Grammar>();
  add_any_nodes(g->nodes_, g->any_);
  g->options_ = options;
  Node n{.kind = NodeKind::kTagged};
  std::set<std::string> begins;
  SchemaAutomata automata;
  for (const Json& structure : *structures) {
    if (!structure.is_object() || !structure.contains("begin") || !structure["begin"].is_string() ||
        structure["begin"].get<std::string>().empty() || (structure.contains("end") && !structure["end"].is_string()))
      return invalid_argument("a structural tag's structure is {{\"begin\": a non-empty string, \"schema\", \"end\": "
                              "a string}}");
    const std::string begin = structure["begin"].get<std::string>();
    const std::string end = structure.value("end", std::string());
    bytes += begin.size() + end.size();
    if (!begins.insert(begin).second)
      return invalid_argument("a structural tag lists the begin \"{}\" twice", begin);
    if (std::none_of(trigger_texts.begin(), trigger_texts.end(), [&](const std::string& t) { return begin.starts_with(t); }))
      return invalid_argument("a structural tag's begin \"{}\" starts with none of its triggers", begin);
    Json schema = structure.contains("schema") && !structure["schema"].is_null() ? structure["schema"] : Json(true);
    if (schema.is_string()) {
      schema = Json::parse(schema.get<std::string>(), nullptr, /*allow_exceptions=*/false);
      if (schema.is_discarded()) return invalid_argument("a structural tag's schema for \"{}\" is not valid JSON", begin);
    }
    SchemaCompiler compiler(*g, schema, automata);
    auto root = compiler.compile(schema, 0);
    if (!root) return invalid_argument("a structural tag's schema for \"{}\": {}", begin, root.status().message());
    n.literals.add(begin, static_cast<int32_t>(n.alternatives.size()));
    n.alternatives.push_back(*root);
    n.tag_ends.push_back(end);
  }
  if (bytes > kMaxTagBytes)
    return invalid_argument("a structural tag's triggers, begins and ends are longer than {} bytes together",
                            kMaxTagBytes);
  for (const std::string& begin : begins) {  // a begin ending inside another would be ambiguous
    int32_t node = 0;
    for (const char ch : begin) node = n.literals.step(node, static_cast<uint8_t>(ch));
    if (n.literals.has_children(node))
      return invalid_argument("a structural tag's begin \"{}\" is the start of another begin", begin);
  }
  n.triggers = std::make_shared<const TriggerScanner>(trigger_texts);
  g->root_ = g->add(std::move(n));
  MOE_RETURN_IF_ERROR(g->flatten_any_of());
  g->source_ = {{"type", "structural_tag"}, {"structures", *structures}, {"triggers", *triggers}};
  g->set_options(options);
  return std::shared_ptr<const Grammar>(std::move(g));
}

Expected<std::shared_ptr<const Grammar>> Grammar::from_source(const nlohmann::ordered_json& source) {
  if (!source.is_object() || !source.contains("type") || !source["type"].is_string())
    return invalid_argument("a structured-output grammar must be an object with a 'type'");
  const std::string type = source["type"].get<std::string>();
  const JsonOptions options{.any_whitespace = source.value("disable_any_whitespace", false) != true,
                            .additional_properties = source.value("disable_additional_properties", false) != true};
  if (type == "json_object") return json_object(options);
  if (type == "json_schema" && source.contains("schema")) return from_json_schema(source["schema"], options);
  if (type == "choice" && source.contains("choices") && source["choices"].is_array()) {
    std::vector<std::string> choices;
    for (const Json& c : source["choices"]) {
      if (!c.is_string()) return invalid_argument("every choice must be a string");
      choices.push_back(c.get<std::string>());
    }
    return from_choices(choices);
  }
  if (type == "regex" && source.contains("pattern") && source["pattern"].is_string())
    return from_regex(source["pattern"].get<std::string>());
  if (type == "grammar" && source.contains("grammar") && source["grammar"].is_string())
    return from_ebnf(source["grammar"].get<std::string>());
  if (type == "structural_tag") return from_structural_tag(source, options);
  return invalid_argument("unknown structured-output grammar type '{}'", type);
}

}  // namespace moe::structured
