#include "tokenizer/template_builtins.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>

#include <fmt/format.h>
#include <utf8proc.h>

#include "tokenizer/unicode_classes.h"
#include "tokenizer/utf8.h"

namespace moe::tokenizer::tmpl {
namespace {

bool is_py_space(char32_t c) { return (c >= 0x1C && c <= 0x1F) || char_class(c) == kSpace; }

std::u32string to_u32(std::string_view s) {
  std::u32string out;
  size_t pos = 0;
  while (pos < s.size()) {
    char32_t c;
    pos += decode_utf8(s, pos, c);
    out.push_back(c);
  }
  return out;
}

std::string from_u32(std::u32string_view s) {
  std::string out;
  for (char32_t c : s) append_utf8(c, out);
  return out;
}

std::string map_case(std::string_view s, bool upper) {
  std::u32string u = to_u32(s);
  for (char32_t& c : u) {
    c = static_cast<char32_t>(upper ? utf8proc_toupper(static_cast<utf8proc_int32_t>(c))
                                    : utf8proc_tolower(static_cast<utf8proc_int32_t>(c)));
  }
  return from_u32(u);
}

bool is_cased_letter(char32_t c) { return char_class(c) == kLetter; }

std::string title_case(std::string_view s) {
  std::u32string u = to_u32(s);
  bool previous_letter = false;
  for (char32_t& c : u) {
    const auto cp = static_cast<utf8proc_int32_t>(c);
    c = static_cast<char32_t>(previous_letter ? utf8proc_tolower(cp) : utf8proc_totitle(cp));
    previous_letter = is_cased_letter(c);
  }
  return from_u32(u);
}

std::string capitalize(std::string_view s) {
  std::u32string u = to_u32(s);
  for (size_t i = 0; i < u.size(); ++i) {
    const auto cp = static_cast<utf8proc_int32_t>(u[i]);
    u[i] = static_cast<char32_t>(i == 0 ? utf8proc_toupper(cp) : utf8proc_tolower(cp));
  }
  return from_u32(u);
}

// strip / lstrip / rstrip: `chars` undefined or none means whitespace.
std::string strip(std::string_view s, const Value& chars, bool left, bool right) {
  const std::u32string u = to_u32(s);
  const std::u32string set = chars.is_string() ? to_u32(chars.as_string()) : std::u32string();
  auto strippable = [&](char32_t c) { return chars.is_string() ? set.find(c) != std::u32string::npos : is_py_space(c); };
  size_t begin = 0, end = u.size();
  if (left) {
    while (begin < end && strippable(u[begin])) ++begin;
  }
  if (right) {
    while (end > begin && strippable(u[end - 1])) --end;
  }
  return from_u32(std::u32string_view(u).substr(begin, end - begin));
}

Expected<Value> split(const std::string& s, const Value& sep, const Value& maxsplit_value) {
  int64_t maxsplit = maxsplit_value.is_int() ? maxsplit_value.as_int() : -1;
  Array parts;
  if (!sep.is_string()) {  // runs of whitespace, none empty
    const std::u32string u = to_u32(s);
    size_t i = 0;
    while (i < u.size()) {
      while (i < u.size() && is_py_space(u[i])) ++i;
      if (i >= u.size()) break;
      if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) {
        size_t end = u.size();
        while (end > i && is_py_space(u[end - 1])) --end;
        parts.push_back(Value::string(from_u32(std::u32string_view(u).substr(i, end - i))));
        break;
      }
      size_t j = i;
      while (j < u.size() && !is_py_space(u[j])) ++j;
      parts.push_back(Value::string(from_u32(std::u32string_view(u).substr(i, j - i))));
      i = j;
    }
    return Value::array(std::move(parts));
  }
  const std::string& delimiter = sep.as_string();
  if (delimiter.empty()) return invalid_argument("split: empty separator");
  size_t start = 0;
  while (true) {
    if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) break;
    const size_t found = s.find(delimiter, start);
    if (found == std::string::npos) break;
    parts.push_back(Value::string(s.substr(start, found - start)));
    start = found + delimiter.size();
  }
  parts.push_back(Value::string(s.substr(start)));
  return Value::array(std::move(parts));
}

std::string replace_all(const std::string& s, const std::string& from, const std::string& to, int64_t count) {
  if (from.empty()) {
    // Python inserts `to` between code points (and at both ends).
    std::string out = to;
    int64_t n = 1;
    for (const std::string& c : split_code_points(s)) {
      out += c;
      if (count < 0 || n < count) {
        out += to;
        ++n;
      }
    }
    return out;
  }
  std::string out;
  size_t start = 0;
  int64_t n = 0;
  while (count < 0 || n < count) {
    const size_t found = s.find(from, start);
    if (found == std::string::npos) break;
    out.append(s, start, found - start);
    out += to;
    start = found + from.size();
    ++n;
  }
  out.append(s, start);
  return out;
}

bool affix_match(const std::string& s, const Value& affix, bool prefix) {
  auto one = [&](const std::string& a) { return prefix ? s.starts_with(a) : s.ends_with(a); };
  if (affix.is_string()) return one(affix.as_string());
  if (affix.is_array()) {
    for (const Value& v : affix.as_array()) {
      if (v.is_string() && one(v.as_string())) return true;
    }
  }
  return false;
}

// JavaScript's String.prototype.trim set.
bool is_js_space(char32_t c) {
  return c == 0xFEFF || (c != 0x85 && char_class(c) == kSpace);
}

std::string js_trim(std::string_view s, bool left, bool right) {
  const std::u32string u = to_u32(s);
  size_t begin = 0, end = u.size();
  if (left) {
    while (begin < end && is_js_space(u[begin])) ++begin;
  }
  if (right) {
    while (end > begin && is_js_space(u[end - 1])) --end;
  }
  return from_u32(std::u32string_view(u).substr(begin, end - begin));
}

Expected<Value> string_method(const std::string& s, std::string_view name, const CallArgs& args, bool& found,
                              bool js_strip) {
  found = true;
  if (js_strip && (name == "strip" || name == "lstrip" || name == "rstrip")) {
    return Value::string(js_trim(s, name != "rstrip", name != "lstrip"));
  }
  if (name == "startswith" || name == "endswith") {
    return Value::boolean(affix_match(s, args.get(0, "prefix"), name == "startswith"));
  }
  if (name == "strip") return Value::string(strip(s, args.get(0, "chars"), true, true));
  if (name == "lstrip") return Value::string(strip(s, args.get(0, "chars"), true, false));
  if (name == "rstrip") return Value::string(strip(s, args.get(0, "chars"), false, true));
  if (name == "split") return split(s, args.get(0, "sep"), args.get(1, "maxsplit"));
  if (name == "upper") return Value::string(map_case(s, true));
  if (name == "lower") return Value::string(map_case(s, false));
  if (name == "title") return Value::string(title_case(s));
  if (name == "capitalize") return Value::string(capitalize(s));
  if (name == "replace") {
    const Value from = args.get(0, "old"), to = args.get(1, "new"), count = args.get(2, "count");
    if (!from.is_string() || !to.is_string()) return invalid_argument("replace() needs two strings");
    const std::string result = replace_all(s, from.as_string(), to.as_string(), count.is_int() ? count.as_int() : -1);
    if (result.size() > kMaxBuiltBytes) return resource_exhausted("replace(): result too large");
    return Value::string(result);
  }
  if (name == "find") {
    const Value needle = args.get(0, "sub");
    if (!needle.is_string()) return invalid_argument("find() needs a string");
    const size_t at = s.find(needle.as_string());
    return Value::integer(at == std::string::npos ? -1 : static_cast<int64_t>(num_code_points(s.substr(0, at))));
  }
  if (name == "count") {
    const Value needle = args.get(0, "sub");
    if (!needle.is_string() || needle.as_string().empty()) return invalid_argument("count() needs a non-empty string");
    int64_t n = 0;
    for (size_t at = s.find(needle.as_string()); at != std::string::npos;
         at = s.find(needle.as_string(), at + needle.as_string().size())) {
      ++n;
    }
    return Value::integer(n);
  }
  if (name == "join") {
    const Value items = args.get(0, "iterable");
    if (!items.is_array()) return invalid_argument("join() needs a list");
    std::string out;
    for (size_t i = 0; i < items.as_array().size(); ++i) {
      if (i > 0) out += s;
      out += items.as_array()[i].to_output();
      if (out.size() > kMaxBuiltBytes) return resource_exhausted("join(): result too large");
    }
    return Value::string(out);
  }
  if (name == "isdigit" || name == "isalpha" || name == "isspace") {
    const std::u32string u = to_u32(s);
    const CharClass want = name == "isdigit" ? kNumber : name == "isalpha" ? kLetter : kSpace;
    return Value::boolean(!u.empty() && std::all_of(u.begin(), u.end(), [&](char32_t c) { return char_class(c) == want; }));
  }
  found = false;
  return Value();
}

Value items_of(const Object& object) {
  Array items;
  for (const auto& [k, v] : object.items) items.push_back(Value::array({Value::string(k), v}));
  return Value::array(std::move(items));
}

Expected<Value> object_method(const Object& object, std::string_view name, const CallArgs& args, bool& found) {
  found = true;
  if (name == "items") return items_of(object);
  if (name == "keys" || name == "values") {
    Array out;
    for (const auto& [k, v] : object.items) out.push_back(name == "keys" ? Value::string(k) : v);
    return Value::array(std::move(out));
  }
  if (name == "get") {
    const Value key = args.get(0, "key");
    const Value* v = key.is_string() ? object.find(key.as_string()) : nullptr;
    if (v != nullptr) return *v;
    const Value fallback = args.get(1, "default");
    return fallback.is_undefined() ? Value::none() : fallback;
  }
  found = false;
  return Value();
}

}  // namespace

std::vector<std::string> split_code_points(std::string_view s) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < s.size()) {
    char32_t c;
    const size_t len = decode_utf8(s, pos, c);
    out.emplace_back(s.substr(pos, len));
    pos += len;
  }
  return out;
}

Expected<Value> call_method(const Value& object, std::string_view name, const CallArgs& args, bool& found,
                            bool js_strip) {
  if (object.is_string()) return string_method(object.as_string(), name, args, found, js_strip);
  if (object.is_object() && !object.is_namespace()) return object_method(object.as_object(), name, args, found);
  if (object.is_array() && name == "append") {
    found = true;
    if (object.as_array().size() >= kMaxBuiltItems) return resource_exhausted("append(): list too large");
    const Value item = args.get(0, "item");
    if (reaches(item, &object.as_array())) return invalid_argument("append(): a list cannot contain itself");
    object.as_array().push_back(item);
    return Value::none();
  }
  found = false;
  return Value();
}

Value index_value(const Value& object, const Value& index) {
  if (object.is_object()) {
    if (!index.is_string()) return Value();
    const Value* v = object.as_object().find(index.as_string());
    return v != nullptr ? *v : Value();
  }
  if (!index.is_int()) return Value();
  int64_t i = index.as_int();
  if (object.is_array()) {
    const auto n = static_cast<int64_t>(object.as_array().size());
    if (i < 0) i += n;
    return i >= 0 && i < n ? object.as_array()[i] : Value();
  }
  if (object.is_string()) {
    const std::vector<std::string> chars = split_code_points(object.as_string());
    const auto n = static_cast<int64_t>(chars.size());
    if (i < 0) i += n;
    return i >= 0 && i < n ? Value::string(chars[i]) : Value();
  }
  return Value();
}

Expected<Value> slice_value(const Value& object, const Value& start_v, const Value& stop_v, const Value& step_v) {
  for (const Value* v : {&start_v, &stop_v, &step_v}) {
    if (!v->is_undefined() && !v->is_none() && !v->is_int()) return invalid_argument("slice indices must be integers");
  }
  const int64_t step = step_v.is_int() ? step_v.as_int() : 1;
  if (step == 0) return invalid_argument("slice step cannot be zero");
  std::vector<std::string> chars;
  const Array* items = nullptr;
  if (object.is_string()) {
    chars = split_code_points(object.as_string());
  } else if (object.is_array()) {
    items = &object.as_array();
  } else {
    return invalid_argument("cannot slice a {}", object.type_name());
  }
  const auto n = static_cast<int64_t>(items != nullptr ? items->size() : chars.size());
  // Python's slice.indices().
  auto clamp = [&](const Value& v, int64_t fallback) {
    if (!v.is_int()) return fallback;
    int64_t i = v.as_int();
    if (i < 0) i += n;
    if (step > 0) return std::clamp<int64_t>(i, 0, n);
    return std::clamp<int64_t>(i, -1, n - 1);
  };
  const int64_t start = clamp(start_v, step > 0 ? 0 : n - 1);
  const int64_t stop = clamp(stop_v, step > 0 ? n : -1);
  Array out_items;
  std::string out_string;
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
    if (items != nullptr) {
      out_items.push_back((*items)[i]);
    } else {
      out_string += chars[i];
    }
  }
  return items != nullptr ? Value::array(std::move(out_items)) : Value::string(std::move(out_string));
}

Expected<bool> apply_test(std::string_view name, const Value& v, const CallArgs& args) {
  const Value arg = args.get(0, "value");
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return v.is_none();
  if (name == "boolean") return v.is_bool();
  if (name == "true") return v.is_bool() && v.as_bool();
  if (name == "false") return v.is_bool() && !v.as_bool();
  if (name == "string") return v.is_string();
  if (name == "number") return v.is_number();
  if (name == "integer") return v.is_int();
  if (name == "float") return v.is_float();
  if (name == "mapping") return v.is_object() && !v.is_namespace();
  if (name == "iterable") return v.is_array() || v.is_string() || (v.is_object() && !v.is_namespace());
  if (name == "sequence") return v.is_array() || v.is_string() || (v.is_object() && !v.is_namespace());
  if (name == "callable") return v.is_function();
  if (name == "odd" || name == "even") {
    if (!v.is_int()) return invalid_argument("test '{}' needs an integer, got {}", name, v.type_name());
    return (v.as_int() % 2 != 0) == (name == "odd");
  }
  if (name == "divisibleby") {
    if (!v.is_int() || !arg.is_int() || arg.as_int() == 0) return invalid_argument("divisibleby needs integers");
    return v.as_int() % arg.as_int() == 0;
  }
  if (name == "lower" || name == "upper") {
    if (!v.is_string()) return false;
    return v.as_string() == map_case(v.as_string(), name == "upper");
  }
  if (name == "equalto" || name == "eq" || name == "==" || name == "sameas") return values_equal(v, arg);
  if (name == "ne" || name == "!=") return !values_equal(v, arg);
  if (name == "lt" || name == "gt" || name == "le" || name == "ge" || name == "<" || name == ">" || name == "<=" ||
      name == ">=") {
    if (!v.is_number() || !arg.is_number()) return invalid_argument("test '{}' needs numbers", name);
    const double a = v.as_double(), b = arg.as_double();
    if (name == "lt" || name == "<") return a < b;
    if (name == "gt" || name == ">") return a > b;
    if (name == "le" || name == "<=") return a <= b;
    return a >= b;
  }
  if (name == "in") {
    if (arg.is_string() && v.is_string()) return arg.as_string().find(v.as_string()) != std::string::npos;
    if (arg.is_array()) {
      return std::any_of(arg.as_array().begin(), arg.as_array().end(), [&](const Value& x) { return values_equal(x, v); });
    }
    if (arg.is_object() && v.is_string()) return arg.as_object().find(v.as_string()) != nullptr;
    return false;
  }
  return unimplemented("unknown test '{}'", name);
}

void add_global_functions(Object& globals) {
  globals.set("range", Value::function([](CallArgs& args) -> Expected<Value> {
    for (const Value& v : args.positional) {
      if (!v.is_int()) return invalid_argument("range() needs integers");
    }
    int64_t start = 0, stop = 0, step = 1;
    if (args.positional.size() == 1) {
      stop = args.positional[0].as_int();
    } else if (args.positional.size() >= 2) {
      start = args.positional[0].as_int();
      stop = args.positional[1].as_int();
      if (args.positional.size() >= 3) step = args.positional[2].as_int();
    } else {
      return invalid_argument("range() needs 1 to 3 arguments");
    }
    if (step == 0) return invalid_argument("range() step cannot be zero");
    Array items;
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
      if (items.size() >= kMaxBuiltItems) return resource_exhausted("range() too long");
      items.push_back(Value::integer(i));
    }
    return Value::array(std::move(items));
  }));
  auto make_mapping = [](bool is_namespace) {
    return [is_namespace](CallArgs& args) -> Expected<Value> {
      Value ns = Value::object(is_namespace);
      for (const Value& v : args.positional) {
        if (!v.is_object()) return invalid_argument("{}() takes a mapping", is_namespace ? "namespace" : "dict");
        for (const auto& [k, item] : v.as_object().items) ns.as_object().set(k, item);
      }
      for (const auto& [k, v] : args.keywords) ns.as_object().set(k, v);
      return ns;
    };
  };
  globals.set("namespace", Value::function(make_mapping(true)));
  globals.set("dict", Value::function(make_mapping(false)));
  globals.set("raise_exception", Value::function([](CallArgs& args) -> Expected<Value> {
    return invalid_argument("raise_exception: {}", args.get(0, "message").to_output());
  }));
  globals.set("strftime_now", Value::function([](CallArgs& args) -> Expected<Value> {
    const Value format = args.get(0, "format");
    if (!format.is_string()) return invalid_argument("strftime_now() needs a format string");
    const std::time_t now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
    std::tm local{};
    localtime_r(&now, &local);
    char buffer[256];
    const size_t n = std::strftime(buffer, sizeof(buffer), format.as_string().c_str(), &local);
    return Value::string(std::string(buffer, n));
  }));
}

}  // namespace moe::tokenizer::tmpl

namespace moe::tokenizer {

std::string strip_whitespace(std::string_view s, bool left, bool right) { return tmpl::strip(s, tmpl::Value(), left, right); }

}  // namespace moe::tokenizer
