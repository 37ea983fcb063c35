// The filters of the chat-template language (`value | name(args)`).
#include <algorithm>
#include <cmath>

#include <fmt/format.h>
#include <utf8proc.h>

#include "tokenizer/template_builtins.h"
#include "tokenizer/utf8.h"

namespace moe::tokenizer::tmpl {
namespace {

Expected<Array> iterate(const Value& v, std::string_view filter) {
  if (v.is_array()) return v.as_array();
  if (v.is_string()) {
    Array out;
    for (std::string& c : split_code_points(v.as_string())) out.push_back(Value::string(std::move(c)));
    return out;
  }
  if (v.is_object() && !v.is_namespace()) {
    Array out;
    for (const auto& [k, item] : v.as_object().items) out.push_back(Value::string(k));
    return out;
  }
  return invalid_argument("filter '{}' needs a list, got {}", filter, v.type_name());
}

// attribute "a.b" or an integer index, as map/sort/join/selectattr take it.
Value get_attribute(const Value& v, const Value& attribute) {
  if (attribute.is_int()) return index_value(v, attribute);
  if (!attribute.is_string()) return Value();
  Value current = v;
  std::string_view path = attribute.as_string();
  while (true) {
    const size_t dot = path.find('.');
    current = index_value(current, Value::string(std::string(path.substr(0, dot))));
    if (dot == std::string_view::npos) return current;
    path.remove_prefix(dot + 1);
  }
}

// Ordering for sort/min/max: numbers, then strings; other kinds compare equal.
bool less_than(const Value& a, const Value& b, bool case_sensitive) {
  if (a.is_number() && b.is_number()) return a.as_double() < b.as_double();
  if (a.is_string() && b.is_string()) {
    if (case_sensitive) return a.as_string() < b.as_string();
    std::string x = a.as_string(), y = b.as_string();
    std::transform(x.begin(), x.end(), x.begin(), [](unsigned char c) { return std::tolower(c); });
    std::transform(y.begin(), y.end(), y.begin(), [](unsigned char c) { return std::tolower(c); });
    return x < y;
  }
  return false;
}

// select / reject / selectattr / rejectattr.
Expected<Value> filter_items(std::string_view name, const Value& operand, const CallArgs& args) {
  MOE_ASSIGN_OR_RETURN(Array items, iterate(operand, name));
  const bool by_attribute = name == "selectattr" || name == "rejectattr";
  const bool keep_matching = name == "select" || name == "selectattr";
  const size_t test_index = by_attribute ? 1 : 0;
  const Value test = test_index < args.positional.size() ? args.positional[test_index] : Value();
  CallArgs test_args;
  for (size_t i = test_index + 1; i < args.positional.size(); ++i) test_args.positional.push_back(args.positional[i]);
  Array out;
  for (const Value& item : items) {
    const Value subject = by_attribute ? get_attribute(item, args.get(0, "attribute")) : item;
    bool matches;
    if (test.is_string()) {
      MOE_ASSIGN_OR_RETURN(matches, apply_test(test.as_string(), subject, test_args));
    } else {
      matches = subject.truthy();
    }
    if (matches == keep_matching) out.push_back(item);
  }
  return Value::array(std::move(out));
}

Expected<Value> map_items(const Value& operand, const CallArgs& args) {
  MOE_ASSIGN_OR_RETURN(Array items, iterate(operand, "map"));
  Array out;
  if (const Value* attribute = args.keyword("attribute")) {
    const Value* fallback = args.keyword("default");
    for (const Value& item : items) {
      Value v = get_attribute(item, *attribute);
      out.push_back(v.is_undefined() && fallback != nullptr ? *fallback : v);
    }
    return Value::array(std::move(out));
  }
  const Value filter = args.get(0, "filter");
  if (!filter.is_string()) return invalid_argument("map() needs a filter name or attribute=");
  CallArgs filter_args;
  for (size_t i = 1; i < args.positional.size(); ++i) filter_args.positional.push_back(args.positional[i]);
  for (const Value& item : items) {
    MOE_ASSIGN_OR_RETURN(Value v, apply_filter(filter.as_string(), item, filter_args));
    out.push_back(std::move(v));
  }
  return Value::array(std::move(out));
}

std::string indent_text(const std::string& s, const Value& width_v, bool first, bool blank) {
  const std::string pad = width_v.is_string() ? width_v.as_string()
                                              : std::string(width_v.is_int() ? std::max<int64_t>(0, width_v.as_int()) : 4, ' ');
  std::string out;
  size_t start = 0;
  bool first_line = true;
  while (start <= s.size()) {
    size_t end = s.find('\n', start);
    const bool last = end == std::string::npos;
    if (last) end = s.size();
    const std::string_view line(s.data() + start, end - start);
    if ((!first_line || first) && (blank || !line.empty())) out += pad;
    out += line;
    if (last) break;
    out += '\n';
    start = end + 1;
    first_line = false;
  }
  return out;
}

Expected<Value> string_filter(std::string_view name, const Value& operand, const CallArgs& args) {
  const std::string s = operand.is_string() ? operand.as_string() : operand.to_output();
  bool found = false;
  if (name == "trim") return call_method(Value::string(s), "strip", args, found);
  if (name == "upper" || name == "lower" || name == "title" || name == "capitalize" || name == "replace") {
    return call_method(Value::string(s), name, args, found);
  }
  if (name == "indent") {
    return Value::string(indent_text(s, args.get(0, "width"), args.get(1, "first").truthy(), args.get(2, "blank").truthy()));
  }
  if (name == "escape" || name == "e") {
    std::string out;
    for (char c : s) {
      switch (c) {
        case '&': out += "&amp;"; break;
        case '<': out += "&lt;"; break;
        case '>': out += "&gt;"; break;
        case '"': out += "&#34;"; break;
        case '\'': out += "&#39;"; break;
        default: out += c;
      }
    }
    return Value::string(out);
  }
  return unimplemented("unknown filter '{}'", name);
}

Expected<Value> number_filter(std::string_view name, const Value& operand, const CallArgs& args) {
  if (name == "int") {
    if (operand.is_int()) return operand;
    if (operand.is_float() && std::fabs(operand.as_double()) < 9.2e18) {
      return Value::integer(static_cast<int64_t>(std::trunc(operand.as_double())));
    }
    if (operand.is_bool()) return Value::integer(operand.as_bool() ? 1 : 0);
    if (operand.is_string()) {
      char* end = nullptr;
      const long long v = std::strtoll(operand.as_string().c_str(), &end, 10);
      if (end != operand.as_string().c_str() && *end == '\0') return Value::integer(v);
    }
    const Value fallback = args.get(0, "default");
    return fallback.is_undefined() ? Value::integer(0) : fallback;
  }
  if (name == "float") {
    if (operand.is_number()) return Value::number(operand.as_double());
    if (operand.is_string()) {
      char* end = nullptr;
      const double v = std::strtod(operand.as_string().c_str(), &end);
      if (end != operand.as_string().c_str() && *end == '\0') return Value::number(v);
    }
    const Value fallback = args.get(0, "default");
    return fallback.is_undefined() ? Value::number(0) : fallback;
  }
  if (!operand.is_number()) return invalid_argument("filter '{}' needs a number, got {}", name, operand.type_name());
  if (name == "abs") {
    if (operand.is_int() && operand.as_int() != INT64_MIN) return Value::integer(std::llabs(operand.as_int()));
    return Value::number(std::fabs(operand.as_double()));
  }
  // round
  const Value precision = args.get(0, "precision");
  const double scale = std::pow(10.0, precision.is_int() ? static_cast<double>(precision.as_int()) : 0.0);
  const Value method = args.get(1, "method");
  double x = operand.as_double() * scale;
  if (method.is_string() && method.as_string() == "floor") {
    x = std::floor(x);
  } else if (method.is_string() && method.as_string() == "ceil") {
    x = std::ceil(x);
  } else {
    x = std::round(x);
  }
  return Value::number(x / scale);
}

Expected<Value> list_filter(std::string_view name, const Value& operand, const CallArgs& args) {
  if (name == "first" || name == "last") {
    MOE_ASSIGN_OR_RETURN(Array items, iterate(operand, name));
    if (items.empty()) return Value();
    return name == "first" ? items.front() : items.back();
  }
  if (name == "list") {
    MOE_ASSIGN_OR_RETURN(Array items, iterate(operand, name));
    return Value::array(std::move(items));
  }
  if (name == "reverse") {
    if (operand.is_string()) {
      std::vector<std::string> chars = split_code_points(operand.as_string());
      std::string out;
      for (auto it = chars.rbegin(); it != chars.rend(); ++it) out += *it;
      return Value::string(out);
    }
    MOE_ASSIGN_OR_RETURN(Array items, iterate(operand, name));
    std::reverse(items.begin(), items.end());
    return Value::array(std::move(items));
  }
  if (name == "join") {
    MOE_ASSIGN_OR_RETURN(Array items, iterate(operand, name));
    const Value sep = args.get(0, "d");
    const Value attribute = args.get(1, "attribute");
    std::string out;
    for (size_t i = 0; i < items.size(); ++i) {
      if (i > 0 && sep.is_string()) out += sep.as_string();
      out += (attribute.is_undefined() ? items[i] : get_attribute(items[i], attribute)).to_output();
      if (out.size() > kMaxBuiltBytes) return resource_exhausted("join: result too large");
    }
    return Value::string(out);
  }
  if (name == "unique") {
    MOE_ASSIGN_OR_RETURN(Array items, iterate(operand, name));
    Array out;
    for (const Value& v : items) {
      if (std::none_of(out.begin(), out.end(), [&](const Value& o) { return values_equal(o, v); })) out.push_back(v);
    }
    return Value::array(std::move(out));
  }
  if (name == "sort" || name == "min" || name == "max") {
    MOE_ASSIGN_OR_RETURN(Array items, iterate(operand, name));
    const Value attribute = args.keyword("attribute") ? *args.keyword("attribute") : Value();
    const bool case_sensitive = args.keyword("case_sensitive") && args.keyword("case_sensitive")->truthy();
    auto key = [&](const Value& v) { return attribute.is_undefined() ? v : get_attribute(v, attribute); };
    std::stable_sort(items.begin(), items.end(),
                     [&](const Value& a, const Value& b) { return less_than(key(a), key(b), case_sensitive); });
    if (name == "min") return items.empty() ? Value() : items.front();
    if (name == "max") return items.empty() ? Value() : items.back();
    if (args.get(0, "reverse").truthy()) std::reverse(items.begin(), items.end());
    return Value::array(std::move(items));
  }
  if (name == "sum") {
    MOE_ASSIGN_OR_RETURN(Array items, iterate(operand, name));
    const Value attribute = args.keyword("attribute") ? *args.keyword("attribute") : Value();
    Value total = args.keyword("start") ? *args.keyword("start") : Value::integer(0);
    for (const Value& item : items) {
      const Value v = attribute.is_undefined() ? item : get_attribute(item, attribute);
      if (!v.is_number() || !total.is_number()) return invalid_argument("sum needs numbers");
      total = total.is_int() && v.is_int() ? Value::integer(total.as_int() + v.as_int())
                                           : Value::number(total.as_double() + v.as_double());
    }
    return total;
  }
  if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
    return filter_items(name, operand, args);
  }
  if (name == "map") return map_items(operand, args);
  return unimplemented("unknown filter '{}'", name);
}

}  // namespace

Expected<Value> apply_filter(std::string_view name, const Value& operand, const CallArgs& args) {
  if (name == "tojson") {
    const Value indent = args.get(0, "indent");
    const Value* sort_keys = args.keyword("sort_keys");
    return Value::string(operand.to_json(indent.is_int() ? static_cast<int>(std::clamp<int64_t>(indent.as_int(), 0, 64)) : -1,
                                         sort_keys != nullptr && sort_keys->truthy()));
  }
  if (name == "length" || name == "count") {
    if (operand.is_string()) return Value::integer(static_cast<int64_t>(num_code_points(operand.as_string())));
    if (operand.is_array()) return Value::integer(static_cast<int64_t>(operand.as_array().size()));
    if (operand.is_object()) return Value::integer(static_cast<int64_t>(operand.as_object().items.size()));
    return invalid_argument("filter 'length' needs a string, list or mapping, got {}", operand.type_name());
  }
  if (name == "default" || name == "d") {
    const bool use_if_falsy = args.get(1, "boolean").truthy();
    if (operand.is_undefined() || (use_if_falsy && !operand.truthy())) {
      const Value fallback = args.get(0, "default_value");
      return fallback.is_undefined() ? Value::string("") : fallback;
    }
    return operand;
  }
  if (name == "string") return Value::string(operand.to_output());
  if (name == "safe") return operand;
  if (name == "items") {
    if (!operand.is_object()) return invalid_argument("filter 'items' needs a mapping, got {}", operand.type_name());
    bool found;
    return call_method(operand, "items", args, found);
  }
  if (name == "dictsort") {
    if (!operand.is_object()) return invalid_argument("filter 'dictsort' needs a mapping");
    Object sorted = operand.as_object();
    std::stable_sort(sorted.items.begin(), sorted.items.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    Array out;
    for (const auto& [k, v] : sorted.items) out.push_back(Value::array({Value::string(k), v}));
    return Value::array(std::move(out));
  }
  if (name == "int" || name == "float" || name == "abs" || name == "round") return number_filter(name, operand, args);
  if (name == "trim" || name == "upper" || name == "lower" || name == "title" || name == "capitalize" ||
      name == "replace" || name == "indent" || name == "escape" || name == "e") {
    return string_filter(name, operand, args);
  }
  return list_filter(name, operand, args);
}

}  // namespace moe::tokenizer::tmpl
