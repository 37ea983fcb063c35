#include "structured/matcher.h"

#include <algorithm>
#include <cstdint>
#include <deque>
#include <utility>

#include "structured/utf8_lead.h"

namespace moe::structured {
namespace {

// Frame kinds and their counters:
//   kValue    a value of `node` not begun yet (whitespace may come first)
//   kObject   a: the next declared property a key may name (earlier ones are
//             done or skipped; all once another key came); b: the node of the
//             value after the key read
//   kArray    a: items begun (the first ones are the node's prefix_items)
//   kString   node: a kString node, or -1 (a key); a: code points so far;
//             b: the next continuation byte's range (lo | hi << 8), or the
//             \u escape's value so far; c: how many continuation bytes
//             (UTF-8) or hex digits (\u) remain; with a pattern, re: its
//             automaton's state after the characters read, cp: the code
//             point being read
//   kNumber   flags: 1 for integers; a: digits in the current part; with
//             bounds (the node's pattern): re: the pattern's state, a: bytes read
//   kLiteral  a: the node in the literals' trie
//   kKey      a: the node in the object's keys' trie; [b, c]: the properties
//             it may name (the object's next one up to its first required one)
//   kText     raw text (a kRegex node): re: its pattern's state; b, c, cp as a string's UTF-8
//   kRule     raw text (a kCfg node), one open rule of a reading: a: the
//             position of the symbol it reads next (structured/cfg.h); the
//             reading's stack is the thread's frames; b, c, cp as a string's UTF-8
//   kTag      raw text (a kTagged node, structural_tag): phase kChars / kUtf8:
//             free text (d: the trigger scanner's state; b, c, cp as a
//             string's UTF-8); kBegin: a structure's begin (a: the node in the
//             begins' trie); kInValue: its JSON value above; kEndString: its
//             end (b: the structure, a: the end's bytes read)
enum Kind : uint8_t { kValue, kObject, kArray, kString, kNumber, kLiteral, kKey, kText, kRule, kTag };

// Phases of an object or an array.
enum ContainerPhase : uint8_t { kOpen, kStart, kAfterKey, kInValue, kAfterValue, kAfterComma, kInKey, kInExtraKey };
// Phases of a string, and its flag: a \uD800-\uDBFF escape read, its low half next.
enum StringPhase : uint8_t { kQuote, kChars, kEscape, kHex, kUtf8 };
constexpr uint8_t kLowSurrogateNext = 2;
constexpr uint8_t kExtraKey = 4;  // a key read as an extra one (additionalProperties): not a declared key
constexpr uint8_t kTextOnly = 8;  // free text whose next byte was forked off as a structure's begin: text here
// A structural tag's phases besides free text's kChars / kUtf8 and kInValue:
// a structure's begin, and its end.
constexpr uint8_t kBegin = 16;
constexpr uint8_t kEndString = 17;
// Phases of a number: the accepting ones are kIntDigits, kZero, kFracDigits, kExpDigits.
enum NumberPhase : uint8_t { kNumStart, kMinus, kIntDigits, kZero, kDot, kFracDigits, kExp, kExpSign, kExpDigits };

bool is_whitespace(uint8_t c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }
bool is_digit(uint8_t c) { return c >= '0' && c <= '9'; }
bool is_hex(uint8_t c) { return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

// Whether `regex` in `state` takes some code point of [lo, hi] (surrogates
// aside: they come only in pairs) that leaves a way to end within the
// string's length bounds (`used` code points, the coming one included).
// Asked before a character's last byte, so that no prefix leads to a dead end.
bool regex_allows(const Regex& regex, int32_t state, uint32_t lo, uint32_t hi, int32_t used, int32_t min_length,
                  int32_t max_length) {
  return regex.allows(state, lo, std::min(hi, 0xD7FFu), used, min_length, max_length) ||
         regex.allows(state, std::max(lo, 0xE000u), hi, used, min_length, max_length);
}

bool number_accepting(uint8_t phase) {
  return phase == kIntDigits || phase == kZero || phase == kFracDigits || phase == kExpDigits;
}

// Forks nested for one byte: a safety net (anyOf is flattened when compiled,
// so a value start forks once).
// A grammar's reading forks once per rule it opens before a byte's character.
constexpr int kMaxForkDepth = 64;

}  // namespace

enum class Matcher::Step : uint8_t { kConsumed, kRedispatch, kReject, kForked };

Matcher::Matcher(const Grammar& grammar) : grammar_(&grammar) {
  frames_.push_back(Frame{.kind = kValue, .node = grammar.root()});
  ends_.push_back(1);
}

bool Matcher::advance_into(uint8_t byte, Matcher& out) const {
  out.grammar_ = grammar_;
  out.frames_.clear();
  out.ends_.clear();
  size_t begin = 0;
  for (const uint32_t end : ends_) {
    const size_t start = out.frames_.size();
    out.frames_.insert(out.frames_.end(), frames_.begin() + static_cast<ptrdiff_t>(begin),
                       frames_.begin() + static_cast<ptrdiff_t>(end));
    feed(byte, start, out);
    begin = end;
  }
  return !out.failed();
}

bool Matcher::advance(std::string_view bytes) {
  Matcher a = *this, b = *this;
  for (const char ch : bytes) {
    if (!a.advance_into(static_cast<uint8_t>(ch), b)) return false;
    std::swap(a, b);
  }
  *this = std::move(a);
  return true;
}

bool Matcher::thread_accepting(size_t begin, size_t end) const {
  if (end == begin) return true;  // the value is whole
  if (frames_[begin].kind == kRule) {  // every open rule may end here
    const Cfg& cfg = *grammar_->node(frames_[begin].node).cfg;
    return std::all_of(frames_.begin() + static_cast<ptrdiff_t>(begin), frames_.begin() + static_cast<ptrdiff_t>(end),
                       [&](const Frame& r) { return r.phase != kUtf8 && cfg.nullable_from(r.a); });
  }
  if (frames_[begin].kind == kTag) {  // in free text, or where a structure with no end string may be whole
    const Frame& tag = frames_[begin];
    if (tag.phase == kChars) return true;
    if (tag.phase != kInValue && tag.phase != kEndString) return false;
    if (!grammar_->node(tag.node).tag_ends[static_cast<size_t>(tag.b)].empty()) return false;
    return tag.phase == kEndString || thread_accepting(begin + 1, end);
  }
  if (end - begin > 1) return false;
  const Frame& f = frames_[begin];
  if (f.kind == kNumber)
    return f.re >= 0 ? f.a > 0 && grammar_->node(f.node).pattern->accepting(f.re) : number_accepting(f.phase);
  if (f.kind == kLiteral) return grammar_->node(f.node).literals.value(f.a) >= 0;
  if (f.kind == kText) return f.phase == kChars && grammar_->node(f.node).pattern->accepting(f.re);
  if (f.kind == kValue && grammar_->node(f.node).kind == NodeKind::kRegex)  // raw text not begun: empty
    return grammar_->node(f.node).pattern->accepting(grammar_->node(f.node).pattern->start());
  if (f.kind == kValue && grammar_->node(f.node).kind == NodeKind::kCfg) return grammar_->node(f.node).cfg->nullable_from(0);
  if (f.kind == kValue && grammar_->node(f.node).kind == NodeKind::kTagged) return true;  // no text yet
  return false;
}

Matcher::PlainRuns Matcher::plain_runs() const {
  PlainRuns runs{.every_thread = !ends_.empty()};
  auto add_pattern = [&](const Frame& top, int32_t room) {
    const PatternState at{grammar_->node(top.node).pattern.get(), top.re};
    auto it = std::find_if(runs.patterns.begin(), runs.patterns.end(), [&](const PatternRun& r) { return r.at == at; });
    if (it == runs.patterns.end()) {
      runs.patterns.push_back({at, room});
    } else {
      it->room = std::min(it->room, room);
    }
  };
  uint32_t begin = 0;
  for (const uint32_t end : ends_) {
    const bool whole = end == std::exchange(begin, end);
    const Frame* top = whole ? nullptr : &frames_[end - 1];
    if (top && top->kind == kText && top->phase == kChars) {
      add_pattern(*top, INT32_MAX);
      continue;
    }
    if (!top || top->kind != kString || top->phase != kChars || (top->flags & kLowSurrogateNext)) {
      runs.every_thread = false;
      continue;
    }
    const Node& n = grammar_->node(top->node);
    const int32_t max_length = top->node >= 0 ? n.max_length : -1;
    if (top->re < 0) {
      runs.room = std::max(runs.room, max_length < 0 ? INT32_MAX : max_length - top->a);
    } else if (top->a >= n.min_length) {
      // Steps within max_length - most_min_left code points stay viable (Regex::viable).
      add_pattern(*top, max_length < 0 ? INT32_MAX : max_length - top->a - n.pattern->most_min_left());
    } else {
      runs.every_thread = false;
    }
  }
  return runs;
}

bool Matcher::threads_recur() const {
  size_t begin = 0;
  for (const uint32_t end : ends_) {
    if (end == begin) return false;
    const Frame& bottom = frames_[begin];
    if (bottom.kind != kRule && !(bottom.kind == kTag && end - begin == 1)) return false;
    begin = end;
  }
  return !ends_.empty();
}

bool Matcher::at_start() const {
  return ends_.size() == 1 && frames_.size() == 1 && frames_[0] == Frame{.kind = kValue, .node = grammar_->root()};
}

Matcher Matcher::only_thread(size_t i) const {
  Matcher m(*grammar_);
  const std::span<const Frame> t = thread(i);
  m.frames_.assign(t.begin(), t.end());
  m.ends_ = {static_cast<uint32_t>(t.size())};
  return m;
}

bool Matcher::accepting() const {
  size_t begin = 0;
  for (const uint32_t end : ends_) {
    if (thread_accepting(begin, end)) return true;
    begin = end;
  }
  return false;
}

// The thread in out.frames_[start, end) is done with this byte: kept unless
// an earlier thread is the same, or there are kMaxThreads already.
void Matcher::commit(size_t start, Matcher& out) const {
  const size_t size = out.frames_.size() - start;
  bool keep = out.ends_.size() < static_cast<size_t>(kMaxThreads);
  size_t begin = 0;
  for (size_t i = 0; keep && i < out.ends_.size(); ++i) {
    const size_t end = out.ends_[i];
    if (end - begin == size && std::equal(out.frames_.begin() + static_cast<ptrdiff_t>(begin),
                                          out.frames_.begin() + static_cast<ptrdiff_t>(end),
                                          out.frames_.begin() + static_cast<ptrdiff_t>(start)))
      keep = false;
    begin = end;
  }
  if (keep) {
    out.ends_.push_back(static_cast<uint32_t>(out.frames_.size()));
  } else {
    out.frames_.resize(start);
  }
}

namespace {

// How many handle() calls are open on this thread: a fork's variants feed
// the byte again, which may fork again.
thread_local int t_fork_depth = 0;

// A fork's variants and the thread's frames below them, one pair of buffers
// per nesting level, kept between bytes: no allocation per fork (the token
// filter forks at trie nodes by the hundred thousand).
struct ForkScratch {
  std::vector<Matcher::Frame> tops, base;
};
ForkScratch& fork_scratch() {
  thread_local std::deque<ForkScratch> levels;  // a deque: growing keeps the outer levels' buffers in place
  while (levels.size() <= static_cast<size_t>(t_fork_depth)) levels.emplace_back();
  return levels[static_cast<size_t>(t_fork_depth)];
}
std::vector<Matcher::Frame>& fork_tops() {
  std::vector<Matcher::Frame>& tops = fork_scratch().tops;
  tops.clear();
  return tops;
}

}  // namespace

// Each variant replaces the thread's top frame (with one or more frames), and
// the byte goes through each variant as its own thread.
void Matcher::fork(uint8_t byte, size_t start, Matcher& out, const std::vector<Frame>& tops, bool pair) const {
  // pair: each variant is two frames (the object in its new phase, then the key's frame)
  std::vector<Frame>& base = fork_scratch().base;
  base.assign(out.frames_.begin() + static_cast<ptrdiff_t>(start), out.frames_.end() - 1);
  out.frames_.resize(start);
  const size_t per_variant = pair ? 2 : 1;
  for (size_t v = 0; v + per_variant <= tops.size(); v += per_variant) {
    const size_t s = out.frames_.size();
    out.frames_.insert(out.frames_.end(), base.begin(), base.end());
    out.frames_.insert(out.frames_.end(), tops.begin() + static_cast<ptrdiff_t>(v),
                       tops.begin() + static_cast<ptrdiff_t>(v + per_variant));
    feed(byte, s, out);
  }
}

void Matcher::feed(uint8_t byte, size_t start, Matcher& out) const {
  int& fork_depth = t_fork_depth;
  if (fork_depth > kMaxForkDepth) {
    out.frames_.resize(start);
    return;
  }
  for (;;) {
    if (out.frames_.size() == start) {  // the value is whole: nothing may follow
      return;
    }
    ++fork_depth;
    const Step step = handle(byte, start, out);
    --fork_depth;
    switch (step) {
      case Step::kConsumed:
        commit(start, out);
        return;
      case Step::kReject:
        out.frames_.resize(start);
        return;
      case Step::kForked:
        return;
      case Step::kRedispatch:
        break;
    }
  }
}

// One byte against the top frame of the thread at out.frames_[start, +depth).
Matcher::Step Matcher::handle(uint8_t byte, size_t start, Matcher& out) const {
  std::vector<Frame>& f = out.frames_;
  const size_t depth = f.size() - start;
  Frame& top = f.back();
  const Grammar& g = *grammar_;
  // Pops the top frame, which is whole, and tells its parent.
  auto complete = [&]() {
    const Frame done = f.back();
    f.pop_back();
    if (f.size() == start) return;
    Frame& parent = f.back();
    if (parent.kind == kTag) {  // a structure's value: its end string next
      parent.phase = kEndString;
    } else if (parent.kind == kArray) {
      parent.phase = kAfterValue;
    } else if (parent.phase == kInValue) {
      parent.phase = kAfterValue;
    } else if (parent.phase == kInKey) {
      const Node& object = g.node(parent.node);
      const int32_t j = object.keys.value(done.a);
      parent.a = j + 1;
      parent.b = object.properties[static_cast<size_t>(j)].node;
      parent.phase = kAfterKey;
    } else {  // kInExtraKey
      const Node& object = g.node(parent.node);
      parent.a = static_cast<int32_t>(object.properties.size());
      parent.b = object.additional;
      parent.phase = kAfterKey;
    }
  };
  // top.ws: 0 before any whitespace, 1 after a space, 2 + n after a newline and n indent bytes.
  // With disable_any_whitespace (JsonOptions), only the space a separator owes.
  const bool any_whitespace = g.json_options().any_whitespace;
  auto whitespace = [&]() {
    if (!any_whitespace) return Step::kReject;
    if (top.ws == 0 && (byte == ' ' || byte == '\n')) {
      top.ws = byte == ' ' ? 1 : 2;
      return Step::kConsumed;
    }
    if (top.ws >= 2 && top.ws < 2 + kMaxIndent && (byte == ' ' || byte == '\t')) {
      ++top.ws;
      return Step::kConsumed;
    }
    return Step::kReject;
  };

  // A pattern's way on from frame t: some code point of [lo, hi] it takes
  // within a string's length bounds (raw text has none).
  auto pattern_allows = [&](const Frame& t, uint32_t lo, uint32_t hi) {
    if (t.kind == kRule) {  // the grammar's character class
      const Cfg& cfg = *g.node(t.node).cfg;
      return cfg.class_meets(cfg.symbol(t.a).id, lo, std::min(hi, 0xD7FFu)) ||
             cfg.class_meets(cfg.symbol(t.a).id, std::max(lo, 0xE000u), hi);
    }
    if (t.re < 0) return true;
    const Node& n = g.node(t.node);
    const bool string = t.kind == kString;
    return regex_allows(*n.pattern, t.re, lo, hi, string ? t.a : 0, string ? n.min_length : 0,
                        string ? n.max_length : -1);
  };
  // UTF-8 in strings and raw text: a lead byte, then its continuations
  // (t.c left, t.b the next one's range, t.cp the bits so far); with a
  // pattern (t.re), the code points the sequence may still spell must hold
  // one it takes, and `character` steps it with the whole one.
  auto utf8_first = [&](uint8_t lead_byte, Frame& t) {
    Utf8Lead lead;
    if (!utf8_lead(lead_byte, lead)) return Step::kReject;
    if (!pattern_allows(t, lead.first, lead.last)) return Step::kReject;
    t.phase = kUtf8;
    t.c = lead.continuations;
    t.b = lead.lo | (lead.hi << 8);
    t.cp = lead.bits;
    return Step::kConsumed;
  };
  auto utf8_next = [&](uint8_t next_byte, Frame& t, auto&& character) {
    if (next_byte < (t.b & 0xFF) || next_byte > (t.b >> 8)) return Step::kReject;
    t.b = 0x80 | (0xBF << 8);
    t.cp = (t.cp << 6) | (next_byte & 0x3F);
    if (--t.c == 0) {
      t.phase = kChars;
      return character(t.cp);
    }
    const int shift = 6 * t.c;
    return pattern_allows(t, t.cp << shift, (t.cp << shift) | ((1u << shift) - 1)) ? Step::kConsumed : Step::kReject;
  };

  switch (top.kind) {
    case kValue: {
      const Node& n = g.node(top.node);
      const bool raw = n.kind == NodeKind::kChoice || n.kind == NodeKind::kRegex || n.kind == NodeKind::kCfg ||
                       n.kind == NodeKind::kTagged;  // not JSON: no whitespace rules
      if (!raw && !any_whitespace) {  // one space after ':' and after an array's ','; none elsewhere
        const Frame* parent = depth > 1 ? &f[f.size() - 2] : nullptr;
        const bool owed = parent && ((parent->kind == kObject && parent->phase == kInValue) ||
                                     (parent->kind == kArray && parent->a > 1));
        if (is_whitespace(byte)) return owed && top.ws == 0 && byte == ' ' ? (top.ws = 1, Step::kConsumed) : Step::kReject;
        if (owed && top.ws == 0) return Step::kReject;
      } else if (depth == 1 && !raw && is_whitespace(byte)) {  // before the output's value
        return ++top.ws <= kMaxLeadingWhitespace ? Step::kConsumed : Step::kReject;
      }
      if (!raw && is_whitespace(byte)) return whitespace();
      switch (n.kind) {
        case NodeKind::kAnyOf: {
          std::vector<Frame>& tops = fork_tops();
          for (const int32_t alt : n.alternatives) tops.push_back(Frame{.kind = kValue, .ws = top.ws, .node = alt});
          fork(byte, start, out, tops, false);
          return Step::kForked;
        }
        case NodeKind::kInteger:
        case NodeKind::kNumber:
          top = Frame{.kind = kNumber,
                      .flags = static_cast<uint8_t>(n.kind == NodeKind::kInteger),
                      .node = top.node,
                      .re = n.pattern ? n.pattern->start() : -1};
          return Step::kRedispatch;
        case NodeKind::kString:
          top = Frame{.kind = kString, .node = top.node, .re = n.pattern ? n.pattern->start() : -1};
          return Step::kRedispatch;
        case NodeKind::kArray:
          top = Frame{.kind = kArray, .node = top.node};
          return Step::kRedispatch;
        case NodeKind::kObject:
          top = Frame{.kind = kObject, .node = top.node};
          return Step::kRedispatch;
        case NodeKind::kRegex:
          top = Frame{.kind = kText, .phase = kChars, .node = top.node, .re = n.pattern->start()};
          return Step::kRedispatch;
        case NodeKind::kCfg:
          top = Frame{.kind = kRule, .phase = kChars, .node = top.node, .a = 0};  // the start: root
          return Step::kRedispatch;
        case NodeKind::kLiterals:
        case NodeKind::kChoice:
          top = Frame{.kind = kLiteral, .node = top.node};
          return Step::kRedispatch;
        case NodeKind::kTagged:
          top = Frame{.kind = kTag, .phase = kChars, .node = top.node, .d = 0};
          return Step::kRedispatch;
      }
      return Step::kReject;
    }

    case kObject: {
      const Node& n = g.node(top.node);
      const auto num_properties = static_cast<int32_t>(n.properties.size());
      auto closable = [&] {
        for (int32_t i = top.a; i < num_properties; ++i)
          if (n.properties[static_cast<size_t>(i)].required) return false;
        return true;
      };
      auto key = [&]() {
        std::vector<Frame>& tops = fork_tops();
        int32_t last = top.a;  // the first required property from top.a, else the last one
        while (last < num_properties - 1 && !n.properties[static_cast<size_t>(last)].required) ++last;
        if (top.a < num_properties) {
          Frame object = top;
          object.phase = kInKey;
          object.ws = 0;
          tops.push_back(object);
          tops.push_back(Frame{.kind = kKey, .node = top.node, .a = 0, .b = top.a, .c = last});
        }
        if (n.additional >= 0 && closable()) {  // other keys after the required ones, declared ones no more
          Frame object = top;
          object.phase = kInExtraKey;
          object.ws = 0;
          tops.push_back(object);
          tops.push_back(Frame{.kind = kString, .flags = kExtraKey, .node = -1, .d = 0});
        }
        if (tops.empty()) return Step::kReject;
        fork(byte, start, out, tops, true);
        return Step::kForked;
      };
      if (!any_whitespace && top.phase == kAfterComma) {  // ", " before the next key
        if (top.ws == 0) return byte == ' ' ? (top.ws = 1, Step::kConsumed) : Step::kReject;
        if (is_whitespace(byte)) return Step::kReject;
      } else if (top.phase != kOpen && is_whitespace(byte)) {
        return whitespace();
      }
      top.ws = 0;
      switch (top.phase) {
        case kOpen:
          if (byte != '{' || depth > static_cast<size_t>(kMaxNesting)) return Step::kReject;
          top.phase = kStart;
          return Step::kConsumed;
        case kStart:
          if (byte == '}' && closable()) return complete(), Step::kConsumed;
          if (byte == '"') return key();
          return Step::kReject;
        case kAfterKey:
          if (byte != ':') return Step::kReject;
          top.phase = kInValue;
          f.push_back(Frame{.kind = kValue, .node = top.b});
          return Step::kConsumed;
        case kAfterValue:
          if (byte == '}' && closable()) return complete(), Step::kConsumed;
          // A comma only where a key may follow (no dead end).
          if (byte != ',' || (top.a >= num_properties && n.additional < 0)) return Step::kReject;
          top.phase = kAfterComma;
          return Step::kConsumed;
        case kAfterComma:
          if (byte == '"') return key();
          return Step::kReject;
        default:
          return Step::kReject;
      }
    }

    case kArray: {
      const Node& n = g.node(top.node);
      auto item = [&]() {
        const auto i = static_cast<size_t>(top.a++);
        top.phase = kInValue;
        top.ws = 0;
        f.push_back(Frame{.kind = kValue, .node = i < n.prefix_items.size() ? n.prefix_items[i] : n.items});
        return Step::kRedispatch;
      };
      if (!any_whitespace && top.phase == kAfterComma) return item();  // the item owes the ", " its space
      if (top.phase != kOpen && is_whitespace(byte)) return whitespace();
      switch (top.phase) {
        case kOpen:
          if (byte != '[' || depth > static_cast<size_t>(kMaxNesting)) return Step::kReject;
          top.phase = kStart;
          return Step::kConsumed;
        case kStart:
          if (byte == ']') return n.min_items == 0 ? (complete(), Step::kConsumed) : Step::kReject;
          if (n.max_items == 0) return Step::kReject;
          return item();
        case kAfterValue:
          top.ws = 0;
          if (byte == ']') return top.a >= n.min_items ? (complete(), Step::kConsumed) : Step::kReject;
          if (byte != ',' || (n.max_items >= 0 && top.a >= n.max_items)) return Step::kReject;
          top.phase = kAfterComma;
          return Step::kConsumed;
        case kAfterComma:
          return item();
        default:
          return Step::kReject;
      }
    }

    case kString: {
      // An extra key follows the declared keys' trie (as written: with the
      // same escapes) and may not close on one of them.
      if (top.flags & kExtraKey) {
        if (top.d >= 0) top.d = g.node(f[f.size() - 2].node).keys.step(top.d, byte);
        if (byte == '"' && top.phase == kChars && !(top.flags & kLowSurrogateNext) && top.d >= 0 &&
            g.node(f[f.size() - 2].node).keys.value(top.d) >= 0)
          return Step::kReject;
      }
      const int32_t max_length = top.node >= 0 ? g.node(top.node).max_length : -1;
      const int32_t min_length = top.node >= 0 ? g.node(top.node).min_length : 0;
      auto one_more = [&]() { return max_length < 0 || top.a < max_length ? (++top.a, true) : false; };
      // A whole character of the value: the pattern's next state (none: the thread dies).
      auto character = [&](uint32_t code_point) {
        if (top.re < 0) return Step::kConsumed;
        top.re = g.node(top.node).pattern->step(top.re, code_point);
        return g.node(top.node).pattern->viable(top.re, top.a, min_length, max_length) ? Step::kConsumed
                                                                                       : Step::kReject;
      };
      auto allows = [&](uint32_t lo, uint32_t hi) { return pattern_allows(top, lo, hi); };
      // The code points a \u escape with `digits` of its hex digits read may still spell.
      auto escape_allows = [&](uint32_t value, int digits) {
        const int shift = 4 * (4 - digits);
        const uint32_t lo = value << shift, hi = lo | ((1u << shift) - 1);
        if (top.flags & kLowSurrogateNext) {  // the low half of top.cp's pair
          const uint32_t base = 0x10000 + ((top.cp - 0xD800) << 10);
          return allows(base + (std::max(lo, 0xDC00u) - 0xDC00), base + (std::min(hi, 0xDFFFu) - 0xDC00));
        }
        if (allows(lo, hi)) return true;  // a character of its own
        if (hi < 0xD800 || lo > 0xDBFF) return false;
        return allows(0x10000 + ((std::max(lo, 0xD800u) - 0xD800) << 10),
                      0x10000 + ((std::min(hi, 0xDBFFu) - 0xD800) << 10) + 0x3FF);  // the high half of a pair
      };

      switch (top.phase) {
        case kQuote:
          if (byte != '"') return Step::kReject;
          top.phase = kChars;
          return Step::kConsumed;
        case kChars:
          if (top.flags & kLowSurrogateNext) {  // after \uD8xx-\uDBxx only its pair's \uDCxx-\uDFxx
            if (byte != '\\') return Step::kReject;
            top.phase = kEscape;  // one code point with the high half, counted there
            return Step::kConsumed;
          }
          if (byte == '"') {
            if (top.a < min_length || (top.re >= 0 && !g.node(top.node).pattern->accepting(top.re)))
              return Step::kReject;
            complete();
            return Step::kConsumed;
          }
          if (byte < 0x20) return Step::kReject;
          if (byte == '\\') {
            if (!one_more() || !allows(0, 0x10FFFF)) return Step::kReject;
            top.phase = kEscape;
            return Step::kConsumed;
          }
          if (byte < 0x80) return one_more() ? character(byte) : Step::kReject;
          return one_more() ? utf8_first(byte, top) : Step::kReject;
        case kUtf8:
          return utf8_next(byte, top, character);
        case kEscape:
          if (byte == 'u') {
            top.phase = kHex;
            top.c = 4;
            top.b = 0;
            return escape_allows(0, 0) ? Step::kConsumed : Step::kReject;
          }
          if ((top.flags & kLowSurrogateNext) ||
              std::string_view("\"\\/bfnrt").find(static_cast<char>(byte)) == std::string_view::npos)
            return Step::kReject;
          top.phase = kChars;
          switch (byte) {  // the character the escape stands for
            case 'b': return character('\b');
            case 'f': return character('\f');
            case 'n': return character('\n');
            case 'r': return character('\r');
            case 't': return character('\t');
            default: return character(byte);  // " \ /
          }
        case kHex: {
          // \uXXXX: surrogates only in pairs (what JSON parsers take), decided
          // by the first two digits so that no prefix is a dead end.
          if (!is_hex(byte)) return Step::kReject;
          const int digit = is_digit(byte) ? byte - '0' : (byte | 0x20) - 'a' + 10;
          const int pos = 4 - top.c;
          const bool low_next = top.flags & kLowSurrogateNext;
          if (pos == 0 && low_next && digit != 0xD) return Step::kReject;
          if (pos == 1 && (top.b == 0xD) && low_next != (digit >= 0xC)) return Step::kReject;
          top.b = top.b * 16 + digit;
          if (--top.c > 0) return escape_allows(static_cast<uint32_t>(top.b), 4 - top.c) ? Step::kConsumed : Step::kReject;
          top.phase = kChars;
          if (low_next) {
            top.flags &= ~kLowSurrogateNext;
            return character(0x10000 + ((top.cp - 0xD800) << 10) + (static_cast<uint32_t>(top.b) - 0xDC00));
          }
          if (top.b >= 0xD800 && top.b <= 0xDBFF) {
            top.flags |= kLowSurrogateNext;
            top.cp = static_cast<uint32_t>(top.b);  // the pair's character comes with its low half
            return escape_allows(0, 0) ? Step::kConsumed : Step::kReject;
          }
          return character(static_cast<uint32_t>(top.b));
        }
        default:
          return Step::kReject;
      }
    }

    case kText: {  // raw text: each whole character a step of the pattern
      const Regex& regex = *g.node(top.node).pattern;
      auto character = [&](uint32_t code_point) {
        top.re = regex.step(top.re, code_point);
        return top.re >= 0 ? Step::kConsumed : Step::kReject;
      };
      if (top.phase == kUtf8) return utf8_next(byte, top, character);
      return byte < 0x80 ? character(byte) : utf8_first(byte, top);
    }

    case kRule: {  // one open rule of a grammar's reading
      const Cfg& cfg = *g.node(top.node).cfg;
      const Cfg::Symbol& symbol = cfg.symbol(top.a);
      // A character of the class; refused where the reading could then not go
      // on within kMaxGrammarDepth (so that the limit is never a dead end).
      auto character = [&](uint32_t code_point) {
        if (!cfg.class_has(symbol.id, code_point)) return Step::kReject;
        ++top.a;
        thread_local std::vector<int32_t> positions;
        positions.clear();
        for (size_t i = start; i < f.size(); ++i) positions.push_back(f[i].a);
        return cfg.way_on(positions) ? Step::kConsumed : Step::kReject;
      };
      if (top.phase == kUtf8) return utf8_next(byte, top, character);
      switch (symbol.kind) {
        case Cfg::SymbolKind::kEnd:  // the rule is whole: its caller goes on (none: the output is whole)
          f.pop_back();
          return Step::kRedispatch;
        case Cfg::SymbolKind::kRule: {
          // Each alternative is a reading of its own; the caller goes on after
          // the rule unless the rule ends its run (a tail call: no frame kept).
          const bool tail = cfg.symbol(top.a + 1).kind == Cfg::SymbolKind::kEnd;
          if (!tail && static_cast<int32_t>(depth) >= kMaxGrammarDepth) return Step::kReject;
          Frame after = top;
          ++after.a;
          std::vector<Frame>& tops = fork_tops();
          for (const int32_t alt : cfg.alternatives(symbol.id)) {
            if (!tail) tops.push_back(after);
            tops.push_back(Frame{.kind = kRule, .phase = kChars, .node = top.node, .a = alt});
          }
          fork(byte, start, out, tops, !tail);
          return Step::kForked;
        }
        case Cfg::SymbolKind::kClass:
          return byte < 0x80 ? character(byte) : utf8_first(byte, top);
      }
      return Step::kReject;
    }

    case kTag: {  // structural_tag: free text, or a structure's begin, JSON value and end
      const Node& n = g.node(top.node);
      switch (top.phase) {
        case kChars:
        case kUtf8: {
          if (top.phase == kChars && !(top.flags & kTextOnly) && n.literals.step(0, byte) >= 0) {
            std::vector<Frame>& tops = fork_tops();  // a structure may begin here, or the byte is text
            Frame text = top, begin = top;
            text.flags |= kTextOnly;
            begin.phase = kBegin;
            begin.a = 0;
            tops.push_back(text);
            tops.push_back(begin);
            fork(byte, start, out, tops, false);
            return Step::kForked;
          }
          top.flags &= ~kTextOnly;
          top.d = n.triggers->step(top.d, byte);
          if (top.d < 0) return Step::kReject;  // free text holds no trigger
          if (top.phase == kUtf8) return utf8_next(byte, top, [](uint32_t) { return Step::kConsumed; });
          return byte < 0x80 ? Step::kConsumed : utf8_first(byte, top);
        }
        case kBegin: {
          const int32_t next = n.literals.step(top.a, byte);
          if (next < 0) return Step::kReject;
          top.a = next;
          const int32_t structure = n.literals.value(next);
          if (structure < 0) return Step::kConsumed;  // no begin is the start of another: whole here
          top.phase = kInValue;
          top.b = structure;
          top.a = 0;
          f.push_back(Frame{.kind = kValue, .node = n.alternatives[static_cast<size_t>(structure)]});
          return Step::kConsumed;
        }
        case kEndString: {
          const std::string& end = n.tag_ends[static_cast<size_t>(top.b)];
          // Whitespace between the value and its end as between JSON tokens, where the end does not
          // itself start with whitespace (which would make two readings of it).
          if (top.a == 0 && !end.empty() && !is_whitespace(static_cast<uint8_t>(end[0])) && is_whitespace(byte))
            return whitespace();
          if (static_cast<size_t>(top.a) < end.size()) {
            if (byte != static_cast<uint8_t>(end[static_cast<size_t>(top.a)])) return Step::kReject;
            if (static_cast<size_t>(++top.a) < end.size()) return Step::kConsumed;
            top = Frame{.kind = kTag, .phase = kChars, .node = top.node, .d = 0};  // free text again
            return Step::kConsumed;
          }
          top = Frame{.kind = kTag, .phase = kChars, .node = top.node, .d = 0};  // no end string
          return Step::kRedispatch;
        }
        default:
          return Step::kReject;
      }
    }

    case kNumber: {
      if (top.re >= 0) {  // bounds: the bytes their pattern takes (its digits bounded: no dead end)
        const Regex& regex = *g.node(top.node).pattern;
        const int32_t next = byte < 0x80 ? regex.step(top.re, byte) : -1;
        if (next >= 0) {
          top.re = next;
          ++top.a;
          return Step::kConsumed;
        }
        if (top.a > 0 && regex.accepting(top.re)) return complete(), Step::kRedispatch;
        return Step::kReject;
      }
      const bool integer = top.flags & 1;
      auto digit = [&](uint8_t phase, int max_digits) {
        if (top.phase != phase) top.a = 0;
        if (++top.a > max_digits) return Step::kReject;
        top.phase = phase;
        return Step::kConsumed;
      };
      switch (top.phase) {
        case kNumStart:
          if (byte == '-') return top.phase = kMinus, Step::kConsumed;
          [[fallthrough]];
        case kMinus:
          if (byte == '0') return top.phase = kZero, Step::kConsumed;
          if (is_digit(byte)) return digit(kIntDigits, kMaxIntegerDigits);
          return Step::kReject;
        case kIntDigits:
          if (is_digit(byte)) return digit(kIntDigits, kMaxIntegerDigits);
          [[fallthrough]];
        case kZero:
          if (!integer && byte == '.') return top.phase = kDot, Step::kConsumed;
          if (!integer && (byte == 'e' || byte == 'E')) return top.phase = kExp, Step::kConsumed;
          return complete(), Step::kRedispatch;
        case kDot:
          return is_digit(byte) ? digit(kFracDigits, kMaxFractionDigits) : Step::kReject;
        case kFracDigits:
          if (is_digit(byte)) return digit(kFracDigits, kMaxFractionDigits);
          if (byte == 'e' || byte == 'E') return top.phase = kExp, Step::kConsumed;
          return complete(), Step::kRedispatch;
        case kExp:
          if (byte == '+' || byte == '-') return top.phase = kExpSign, Step::kConsumed;
          [[fallthrough]];
        case kExpSign:
          return is_digit(byte) ? digit(kExpDigits, kMaxExponentDigits) : Step::kReject;
        case kExpDigits:
          if (is_digit(byte)) return digit(kExpDigits, kMaxExponentDigits);
          return complete(), Step::kRedispatch;
        default:
          return Step::kReject;
      }
    }

    case kLiteral: {
      const LiteralTrie& trie = g.node(top.node).literals;
      const int32_t next = trie.step(top.a, byte);
      if (next >= 0) {
        top.a = next;
        if (trie.value(next) >= 0 && !trie.has_children(next)) complete();
        return Step::kConsumed;
      }
      if (trie.value(top.a) >= 0) return complete(), Step::kRedispatch;  // a number literal, whole
      return Step::kReject;
    }

    case kKey: {
      const LiteralTrie& keys = g.node(top.node).keys;
      const int32_t next = keys.step(top.a, byte);
      if (next < 0 || !keys.reaches(next, top.b, top.c)) return Step::kReject;
      top.a = next;
      if (keys.value(next) >= 0) complete();  // keys end with their closing quote
      return Step::kConsumed;
    }
  }
  return Step::kReject;
}

}  // namespace moe::structured
