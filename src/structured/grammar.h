// Structured outputs' grammars: what a constrained request's output must be
// (OpenAI's response_format json_object / json_schema, vLLM's guided_json,
// guided_choice, guided_regex, guided_grammar and structural_tag), compiled
// once per request into a table of nodes that the byte-level matcher
// (structured/matcher.h) walks.
//
// JSON Schema, the subset served (docs/server.md, "Structured outputs"):
// type (one name or a list), properties / required / additionalProperties
// (absent means false, as OpenAI's strict mode and xgrammar's default), items
// / prefixItems (or items as an array with additionalItems) / minItems /
// maxItems, minimum / maximum / exclusiveMinimum / exclusiveMaximum
// (structured/number_range.h), minLength / maxLength, enum, const, anyOf / oneOf
// (oneOf served as anyOf), allOf of one schema, pattern (structured/regex.h)
// or format (date, time, date-time, duration, uuid, email, ipv4, ipv6, hostname, uri), $ref into #/$defs or
// #/definitions (recursion allowed), true / {} (any value). Annotations
// (title, description, default, examples, $schema, $id, $comment, strict) are
// ignored; every other keyword is refused with an error naming it, so a
// request is never served as if a constraint had been applied when it was
// not. Properties are written in the schema's order; an optional one may be
// left out; other keys (additionalProperties) come after the declared ones,
// once no required one is left (xgrammar orders them so too).
//
// Pure data after compilation: any thread may read a Grammar.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "structured/cfg.h"
#include "structured/regex.h"

namespace moe::structured {

// A set of byte strings as a trie: node 0 is the root; a string's last node
// carries its index.
class LiteralTrie {
 public:
  void add(std::string_view bytes, int32_t value);  // values in increasing order
  // The child of `node` by `byte`, or -1.
  int32_t step(int32_t node, uint8_t byte) const;
  int32_t value(int32_t node) const { return nodes_[static_cast<size_t>(node)].value; }
  bool has_children(int32_t node) const { return !nodes_[static_cast<size_t>(node)].next.empty(); }
  // Whether a string ending at or below `node` has a value in [lo, hi].
  bool reaches(int32_t node, int32_t lo, int32_t hi) const;

 private:
  struct Node {
    std::vector<std::pair<uint8_t, int32_t>> next;
    int32_t value = -1;
    std::vector<int32_t> values_below;  // sorted; the node's own value included
  };
  std::vector<Node> nodes_{Node{}};
};

// Free text's watch for a structural tag's triggers: an Aho-Corasick
// automaton over bytes (state 0: nothing of a trigger read).
class TriggerScanner {
 public:
  explicit TriggerScanner(const std::vector<std::string>& triggers);
  // The state after `byte`, or -1 when a trigger ends with it.
  int32_t step(int32_t state, uint8_t byte) const;

 private:
  struct State {
    std::vector<std::pair<uint8_t, int32_t>> next;
    int32_t fail = 0;
    bool hit = false;  // a trigger ends here (or at a suffix of here)
  };
  int32_t child(int32_t state, uint8_t byte) const;
  std::vector<State> states_{State{}};
};

enum class NodeKind : uint8_t {
  kInteger,   // -?(0|[1-9][0-9]*), at most kMaxIntegerDigits digits; with bounds, `pattern`'s texts
  kNumber,    // JSON number; with bounds, `pattern`'s texts (no exponent)
  kString,    // min_length / max_length in code points, pattern
  kArray,     // prefix_items, then items (a node, -1: none), min_items / max_items
  kObject,    // properties in order, then additional ones
  kLiterals,  // one of `literals` (JSON texts: enum, const, true/false/null)
  kAnyOf,     // one of `alternatives` (also a $ref's slot, and "any value": Grammar::any_node)
  kChoice,    // raw text, one of `literals` (guided_choice): not JSON
  kRegex,     // raw text that `pattern` matches whole (guided_regex): not JSON
  kCfg,       // raw text that `cfg` derives (guided_grammar): not JSON
  kTagged,    // raw text (structural_tag): free text holding no trigger, and structures: a begin
              // string (`literals`), a JSON value of its schema (`alternatives`), its end (`tag_ends`)
};

inline constexpr int kMaxIntegerDigits = 19;
inline constexpr int kMaxFractionDigits = 20;
inline constexpr int kMaxExponentDigits = 3;

struct Property {
  std::string name;
  int32_t node = -1;
  bool required = false;
};

struct Node {
  NodeKind kind = NodeKind::kAnyOf;
  int32_t min_length = 0, max_length = -1;  // kString (-1: unbounded)
  std::shared_ptr<const Regex> pattern;     // kString: what its value must match, or null; kRegex;
                                            // kInteger / kNumber: the texts its bounds allow (number_range.h), or null
  std::vector<int32_t> prefix_items;        // kArray: the first items' nodes (prefixItems)
  int32_t items = -1;                       // kArray: the other items' node (-1: no other item)
  int32_t min_items = 0, max_items = -1;    // kArray
  std::vector<Property> properties;         // kObject
  LiteralTrie keys;                         // kObject: each property's key as JSON ("name") -> its index
  int32_t additional = -1;                  // kObject: the node of other keys' values, -1: none allowed
  LiteralTrie literals;                     // kLiterals, kChoice
  std::vector<int32_t> alternatives;        // kAnyOf
  std::shared_ptr<const Cfg> cfg;           // kCfg
  std::vector<std::string> tag_ends;        // kTagged: each structure's end string
  std::shared_ptr<const TriggerScanner> triggers;  // kTagged
};

inline constexpr size_t kMaxSchemaNesting = 128;  // of the schema document itself (annotations included)
inline constexpr size_t kMaxAlternatives = 64;    // an anyOf's, once flattened (the matcher's thread cap)
inline constexpr size_t kMaxPatternBytes = 4096;  // a pattern's source
inline constexpr size_t kMaxStructures = 64;      // a structural tag's
inline constexpr size_t kMaxTagBytes = 16384;     // a structural tag's triggers, begins and ends together

// Whether `value` nests arrays and objects deeper than `max_depth` (checked
// without recursion, before anything copies or walks a hostile document).
bool nesting_exceeds(const nlohmann::ordered_json& value, size_t max_depth);

// vLLM's structured_outputs options for the JSON a grammar writes.
struct JsonOptions {
  // Off (disable_any_whitespace): xgrammar's separators and nothing else:
  // one space after ',' and ':', no other whitespace outside strings.
  bool any_whitespace = true;
  // Off (disable_additional_properties): an object schema that says nothing
  // of other keys takes none, even without 'properties' ({"type": "object"}: {}).
  bool additional_properties = true;
};

class Grammar {
 public:
  // OpenAI's response_format {"type": "json_object"}: any JSON object.
  static std::shared_ptr<const Grammar> json_object(JsonOptions options = {});
  // A JSON Schema; the error names the keyword that is not served.
  static Expected<std::shared_ptr<const Grammar>> from_json_schema(const nlohmann::ordered_json& schema,
                                                                   JsonOptions options = {});
  // vLLM's guided_choice: exactly one of these strings (1 to 1024 of them, none empty).
  static Expected<std::shared_ptr<const Grammar>> from_choices(const std::vector<std::string>& choices);
  // vLLM's guided_regex: text (not JSON) the pattern (structured/regex.h) matches whole.
  static Expected<std::shared_ptr<const Grammar>> from_regex(std::string_view pattern);
  // vLLM's guided_grammar: text (not JSON) the EBNF grammar (structured/cfg.h) derives from its root.
  static Expected<std::shared_ptr<const Grammar>> from_ebnf(std::string_view grammar);
  // vLLM's structural_tag: {"structures": [{"begin", "schema", "end"}, ...],
  // "triggers": [...]}. The output is free text in which no trigger occurs,
  // except as the start of a structure: its begin string (each begins with a
  // trigger), a JSON value its schema allows, its end string; then free text
  // again. The output may end in free text.
  static Expected<std::shared_ptr<const Grammar>> from_structural_tag(const nlohmann::ordered_json& spec,
                                                                      JsonOptions options = {});
  // The serialised form from_source() compiles again (disaggregated serving
  // sends it to the prefill and decode instances): {"type": "json_object"},
  // {"type": "json_schema", "schema": ...}, {"type": "choice", "choices": [...]},
  // {"type": "regex", "pattern": "..."}, {"type": "grammar", "grammar": "..."} or
  // {"type": "structural_tag", "structures": [...], "triggers": [...]}; JSON
  // ones with "disable_any_whitespace" / "disable_additional_properties": true
  // where those options are set.
  static Expected<std::shared_ptr<const Grammar>> from_source(const nlohmann::ordered_json& source);
  const nlohmann::ordered_json& source() const { return source_; }

  int32_t root() const { return root_; }
  const JsonOptions& json_options() const { return options_; }
  const Node& node(int32_t i) const { return nodes_[static_cast<size_t>(i)]; }

 private:
  friend class SchemaCompiler;
  int32_t add(Node node);
  Status flatten_any_of();

  std::vector<Node> nodes_;
  int32_t root_ = -1;
  int32_t any_ = -1;
  nlohmann::ordered_json source_;
  JsonOptions options_;
  void set_options(JsonOptions options);  // and writes them into source_
};

}  // namespace moe::structured
