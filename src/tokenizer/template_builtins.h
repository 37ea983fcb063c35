// Filters, tests, methods and global functions of the chat-template language.
// Internal to the template interpreter. Strings are indexed, sliced and measured
// by code points (Python's semantics).
//
// Free functions with no shared state: any thread may call them.
#pragma once

#include <string>
#include <string_view>

#include "core/status.h"
#include "tokenizer/template_value.h"

namespace moe::tokenizer::tmpl {

// `operand | name(args)`.
Expected<Value> apply_filter(std::string_view name, const Value& operand, const CallArgs& args);

// `operand is name(args)`.
Expected<bool> apply_test(std::string_view name, const Value& operand, const CallArgs& args);

// `object.name(args)` for the methods of strings, arrays and mappings. Sets
// `found` to false (and returns undefined) when there is no such method.
// `js_strip`: strip/lstrip/rstrip ignore their argument (ChatTemplateLimits).
Expected<Value> call_method(const Value& object, std::string_view name, const CallArgs& args, bool& found,
                            bool js_strip = false);

// The functions every template sees: range, namespace, dict, raise_exception,
// strftime_now.
void add_global_functions(Object& globals);

// Python-style slicing and indexing of arrays and strings (by code point).
Expected<Value> slice_value(const Value& object, const Value& start, const Value& stop, const Value& step);
Value index_value(const Value& object, const Value& index);

// Code points of a UTF-8 string as separate strings (their count:
// num_code_points, tokenizer/utf8.h).
std::vector<std::string> split_code_points(std::string_view s);

// Longest list (range, append) and string (join, replace) a template may build.
inline constexpr size_t kMaxBuiltItems = size_t{1} << 20;
inline constexpr size_t kMaxBuiltBytes = size_t{1} << 24;

}  // namespace moe::tokenizer::tmpl
