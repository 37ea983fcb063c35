// Values of the chat-template (Jinja subset) interpreter. Semantics follow
// @huggingface/jinja, the oracle the tests compare with: None and undefined print
// as nothing, booleans print as "true"/"false", arrays and objects print as JSON.
//
// Arrays, objects and namespaces are shared by reference (as in Python), so a
// Value copy is cheap. Values are not thread-safe; each render owns its own.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"

namespace moe::tokenizer::tmpl {

class Value;
struct Object;
struct CallArgs;
using Array = std::vector<Value>;
using Function = std::function<Expected<Value>(CallArgs& args)>;

class Value {
 public:
  enum class Kind { kUndefined, kNone, kBool, kInt, kFloat, kString, kArray, kObject, kFunction };

  Value() = default;
  static Value none();
  static Value boolean(bool b);
  static Value integer(int64_t i);
  static Value number(double f);
  static Value string(std::string s);
  static Value array(Array items = {});
  static Value object(bool is_namespace = false);
  static Value function(Function fn);
  // Whole-valued JSON numbers become integers, as in JavaScript.
  static Value from_json(const nlohmann::ordered_json& json);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_bool() const { return kind_ == Kind::kBool; }
  bool is_int() const { return kind_ == Kind::kInt; }
  bool is_float() const { return kind_ == Kind::kFloat; }
  bool is_number() const { return kind_ == Kind::kInt || kind_ == Kind::kFloat; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_array() const { return kind_ == Kind::kArray; }
  bool is_object() const { return kind_ == Kind::kObject; }
  bool is_function() const { return kind_ == Kind::kFunction; }
  bool is_namespace() const;

  bool as_bool() const { return bool_; }
  int64_t as_int() const { return int_; }
  double as_double() const { return kind_ == Kind::kInt ? static_cast<double>(int_) : float_; }
  const std::string& as_string() const { return *string_; }
  Array& as_array() const { return *array_; }
  Object& as_object() const { return *object_; }
  const Function& as_function() const { return *function_; }

  bool truthy() const;
  // What {{ value }} prints.
  std::string to_output() const;
  // The `tojson` filter: indent < 0 means one line with ", " and ": ".
  std::string to_json(int indent = -1, bool sort_keys = false) const;
  const char* type_name() const;

 private:
  Kind kind_ = Kind::kUndefined;
  bool bool_ = false;
  int64_t int_ = 0;
  double float_ = 0;
  std::shared_ptr<const std::string> string_;
  std::shared_ptr<Array> array_;
  std::shared_ptr<Object> object_;
  std::shared_ptr<const Function> function_;
};

// An object (mapping) or a namespace; keys keep their insertion order.
// True when `container` (an Array or Object) is reachable from `value`:
// storing `value` into `container` would then make a reference cycle, which
// shared ownership could never free, so set and append refuse it.
bool reaches(const Value& value, const void* container);

struct Object {
  std::vector<std::pair<std::string, Value>> items;
  bool is_namespace = false;

  const Value* find(std::string_view key) const;
  void set(const std::string& key, Value value);
};

// Positional and keyword arguments of a call.
struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keywords;

  // The argument at `index`, else the keyword `name`, else undefined.
  Value get(size_t index, std::string_view name) const;
  const Value* keyword(std::string_view name) const;
};

bool values_equal(const Value& a, const Value& b);
// A JSON string literal (JSON.stringify): ", \, control characters escaped.
std::string json_quote(std::string_view s, bool ensure_ascii = false);
// JavaScript's Number.prototype.toString for a double.
std::string format_double(double f);

}  // namespace moe::tokenizer::tmpl
