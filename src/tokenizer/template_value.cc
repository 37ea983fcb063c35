#include "tokenizer/template_value.h"


#include <algorithm>
#include <cmath>
#include <unordered_set>

#include <fmt/format.h>

#include "tokenizer/utf8.h"

namespace moe::tokenizer::tmpl {

Value Value::none() {
  Value v;
  v.kind_ = Kind::kNone;
  return v;
}
Value Value::boolean(bool b) {
  Value v;
  v.kind_ = Kind::kBool;
  v.bool_ = b;
  return v;
}
Value Value::integer(int64_t i) {
  Value v;
  v.kind_ = Kind::kInt;
  v.int_ = i;
  return v;
}
Value Value::number(double f) {
  Value v;
  v.kind_ = Kind::kFloat;
  v.float_ = f;
  return v;
}
Value Value::string(std::string s) {
  Value v;
  v.kind_ = Kind::kString;
  v.string_ = std::make_shared<const std::string>(std::move(s));
  return v;
}
Value Value::array(Array items) {
  Value v;
  v.kind_ = Kind::kArray;
  v.array_ = std::make_shared<Array>(std::move(items));
  return v;
}
Value Value::object(bool is_namespace) {
  Value v;
  v.kind_ = Kind::kObject;
  v.object_ = std::make_shared<Object>();
  v.object_->is_namespace = is_namespace;
  return v;
}
Value Value::function(Function fn) {
  Value v;
  v.kind_ = Kind::kFunction;
  v.function_ = std::make_shared<const Function>(std::move(fn));
  return v;
}

Value Value::from_json(const nlohmann::ordered_json& json) {
  switch (json.type()) {
    case nlohmann::ordered_json::value_t::null: return none();
    case nlohmann::ordered_json::value_t::boolean: return boolean(json.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return integer(json.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned:
      return integer(static_cast<int64_t>(json.get<uint64_t>()));
    case nlohmann::ordered_json::value_t::number_float: {
      const double f = json.get<double>();
      if (std::isfinite(f) && std::floor(f) == f && std::fabs(f) < 9007199254740992.0) {
        return integer(static_cast<int64_t>(f));
      }
      return number(f);
    }
    case nlohmann::ordered_json::value_t::string: return string(json.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      Array items;
      items.reserve(json.size());
      for (const auto& item : json) items.push_back(from_json(item));
      return array(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      Value v = object();
      for (const auto& [key, item] : json.items()) v.object_->items.emplace_back(key, from_json(item));
      return v;
    }
    default: return Value();
  }
}

bool Value::is_namespace() const { return kind_ == Kind::kObject && object_->is_namespace; }

bool Value::truthy() const {
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone: return false;
    case Kind::kBool: return bool_;
    case Kind::kInt: return int_ != 0;
    case Kind::kFloat: return float_ != 0 && !std::isnan(float_);
    case Kind::kString: return !string_->empty();
    case Kind::kArray: return !array_->empty();
    case Kind::kObject: return object_->is_namespace || !object_->items.empty();
    case Kind::kFunction: return true;
  }
  return false;
}

const char* Value::type_name() const {
  switch (kind_) {
    case Kind::kUndefined: return "undefined";
    case Kind::kNone: return "none";
    case Kind::kBool: return "boolean";
    case Kind::kInt: return "integer";
    case Kind::kFloat: return "float";
    case Kind::kString: return "string";
    case Kind::kArray: return "array";
    case Kind::kObject: return object_->is_namespace ? "namespace" : "object";
    case Kind::kFunction: return "function";
  }
  return "?";
}

std::string format_double(double f) {
  if (std::isnan(f)) return "NaN";
  if (std::isinf(f)) return f > 0 ? "Infinity" : "-Infinity";
  if (f == 0) return "0";
  // Shortest round-trip digits, laid out as JavaScript does.
  std::string s = fmt::format("{}", f);
  const size_t e = s.find('e');
  if (e != std::string::npos) {
    std::string mantissa = s.substr(0, e);
    int exponent = std::stoi(s.substr(e + 1));
    if (exponent >= -7 && exponent < 21) return fmt::format("{:f}", f);  // rare: fmt chose exponent form
    return fmt::format("{}e{}{}", mantissa, exponent < 0 ? "-" : "+", std::abs(exponent));
  }
  if (s.size() > 2 && s.ends_with(".0")) s.resize(s.size() - 2);
  return s;
}

std::string Value::to_output() const {
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone: return "";
    case Kind::kBool: return bool_ ? "true" : "false";
    case Kind::kInt: return std::to_string(int_);
    case Kind::kFloat: {
      if (float_ == 0 && std::signbit(float_)) return "-0.0";
      if (std::isfinite(float_) && std::floor(float_) == float_ && std::fabs(float_) < 1e21) {
        return fmt::format("{:.1f}", float_);
      }
      return format_double(float_);
    }
    case Kind::kString: return *string_;
    case Kind::kArray:
    case Kind::kObject: return to_json();
    case Kind::kFunction: return "[function]";
  }
  return "";
}

std::string json_quote(std::string_view s, bool ensure_ascii) {
  std::string out = "\"";
  size_t pos = 0;
  while (pos < s.size()) {
    const auto c = static_cast<unsigned char>(s[pos]);
    switch (c) {
      case '"': out += "\\\""; ++pos; continue;
      case '\\': out += "\\\\"; ++pos; continue;
      case '\b': out += "\\b"; ++pos; continue;
      case '\f': out += "\\f"; ++pos; continue;
      case '\n': out += "\\n"; ++pos; continue;
      case '\r': out += "\\r"; ++pos; continue;
      case '\t': out += "\\t"; ++pos; continue;
      default: break;
    }
    if (c < 0x20) {
      out += fmt::format("\\u{:04x}", c);
      ++pos;
      continue;
    }
    if (c < 0x80 || !ensure_ascii) {
      out += static_cast<char>(c);
      ++pos;
      continue;
    }
    char32_t cp;
    pos += decode_utf8(s, pos, cp);
    if (cp >= 0x10000) {
      const char32_t v = cp - 0x10000;
      out += fmt::format("\\u{:04x}\\u{:04x}", 0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF));
    } else {
      out += fmt::format("\\u{:04x}", static_cast<uint32_t>(cp));
    }
  }
  out += '"';
  return out;
}

namespace {

// Deeper values (only a template that builds a cycle, e.g. ns.x = ns, gets here)
// print as null instead of recursing without end.
constexpr int kMaxJsonDepth = 256;

void append_json(const Value& v, int indent, bool sort_keys, int depth, std::string& out) {
  if (depth > kMaxJsonDepth || out.size() > (size_t{64} << 20)) {
    out += "null";
    return;
  }
  const std::string item_sep = indent >= 0 ? "," : ", ";
  auto newline = [&](int d) {
    if (indent < 0) return;
    out += '\n';
    out.append(static_cast<size_t>(indent) * d, ' ');
  };
  switch (v.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone: out += "null"; return;
    case Value::Kind::kBool: out += v.as_bool() ? "true" : "false"; return;
    case Value::Kind::kInt: out += std::to_string(v.as_int()); return;
    case Value::Kind::kFloat: out += std::isfinite(v.as_double()) ? format_double(v.as_double()) : "null"; return;
    case Value::Kind::kString: out += json_quote(v.as_string()); return;
    case Value::Kind::kFunction: out += "null"; return;
    case Value::Kind::kArray: {
      const Array& items = v.as_array();
      out += '[';
      for (size_t i = 0; i < items.size(); ++i) {
        if (i > 0) out += item_sep;
        newline(depth + 1);
        append_json(items[i], indent, sort_keys, depth + 1, out);
      }
      if (!items.empty()) newline(depth);
      out += ']';
      return;
    }
    case Value::Kind::kObject: {
      std::vector<const std::pair<std::string, Value>*> entries;
      for (const auto& item : v.as_object().items) entries.push_back(&item);
      if (sort_keys) {
        std::stable_sort(entries.begin(), entries.end(), [](auto* a, auto* b) { return a->first < b->first; });
      }
      out += '{';
      for (size_t i = 0; i < entries.size(); ++i) {
        if (i > 0) out += item_sep;
        newline(depth + 1);
        out += json_quote(entries[i]->first);
        out += ": ";
        append_json(entries[i]->second, indent, sort_keys, depth + 1, out);
      }
      if (!entries.empty()) newline(depth);
      out += '}';
      return;
    }
  }
}

}  // namespace

std::string Value::to_json(int indent, bool sort_keys) const {
  std::string out;
  append_json(*this, indent, sort_keys, 0, out);
  return out;
}

bool reaches(const Value& value, const void* container) {
  std::vector<const Value*> pending = {&value};
  std::unordered_set<const void*> seen;
  while (!pending.empty()) {
    const Value* v = pending.back();
    pending.pop_back();
    if (v->is_array()) {
      const Array& a = v->as_array();
      if (&a == container) return true;
      if (!seen.insert(&a).second) continue;
      for (const Value& child : a) pending.push_back(&child);
    } else if (v->is_object()) {
      const Object& o = v->as_object();
      if (&o == container) return true;
      if (!seen.insert(&o).second) continue;
      for (const auto& [key, child] : o.items) pending.push_back(&child);
    }
  }
  return false;
}

const Value* Object::find(std::string_view key) const {
  for (const auto& [k, v] : items) {
    if (k == key) return &v;
  }
  return nullptr;
}

void Object::set(const std::string& key, Value value) {
  for (auto& [k, v] : items) {
    if (k == key) {
      v = std::move(value);
      return;
    }
  }
  items.emplace_back(key, std::move(value));
}

Value CallArgs::get(size_t index, std::string_view name) const {
  if (index < positional.size()) return positional[index];
  const Value* kw = keyword(name);
  return kw != nullptr ? *kw : Value();
}

const Value* CallArgs::keyword(std::string_view name) const {
  for (const auto& [k, v] : keywords) {
    if (k == name) return &v;
  }
  return nullptr;
}

bool values_equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) return a.as_double() == b.as_double();
  if (a.kind() != b.kind()) {
    // JavaScript's loose == also equates booleans with 0/1; templates rarely rely on it.
    if ((a.is_bool() && b.is_number()) || (a.is_number() && b.is_bool())) {
      return (a.is_bool() ? (a.as_bool() ? 1.0 : 0.0) : a.as_double()) ==
             (b.is_bool() ? (b.as_bool() ? 1.0 : 0.0) : b.as_double());
    }
    return (a.is_none() || a.is_undefined()) && (b.is_none() || b.is_undefined());
  }
  switch (a.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone: return true;
    case Value::Kind::kBool: return a.as_bool() == b.as_bool();
    case Value::Kind::kString: return a.as_string() == b.as_string();
    case Value::Kind::kArray: return &a.as_array() == &b.as_array();
    case Value::Kind::kObject: return &a.as_object() == &b.as_object();
    default: return false;
  }
}

}  // namespace moe::tokenizer::tmpl
