#include "structured/token_filter.h"

#include <algorithm>
#include <numeric>

#include "core/check.h"
#include "structured/utf8_lead.h"

namespace moe::structured {

namespace {

// The plain string characters: printable ASCII but '"' and '\\' (whole
// UTF-8 sequences are the others).
bool plain_ascii(uint8_t c) { return c >= 0x20 && c < 0x80 && c != '"' && c != '\\'; }

// The code points of `bytes` when it is a run of plain string characters,
// else 0.
int32_t plain_code_points(std::string_view bytes) {
  int32_t n = 0;
  for (size_t i = 0; i < bytes.size(); ++n) {
    const auto c = static_cast<uint8_t>(bytes[i++]);
    if (plain_ascii(c)) continue;
    Utf8Lead lead;
    if (!utf8_lead(c, lead) || i + static_cast<size_t>(lead.continuations) > bytes.size()) return 0;
    for (int32_t k = 0; k < lead.continuations; ++k) {
      const auto next = static_cast<uint8_t>(bytes[i++]);
      if (next < (k == 0 ? lead.lo : 0x80) || next > (k == 0 ? lead.hi : 0xBF)) return 0;
    }
  }
  return n;
}

}  // namespace

TokenVocabulary::TokenVocabulary(std::vector<std::string> token_bytes) : token_bytes_(std::move(token_bytes)) {
  std::vector<int32_t> ids, rest;
  plain_mask_.assign((token_bytes_.size() + 31) / 32, 0);
  for (int32_t id = 0; id < size(); ++id) {
    if (bytes(id).empty()) continue;
    ids.push_back(id);
    if (const int32_t n = plain_code_points(bytes(id)); n > 0) {
      plain_tokens_.emplace_back(id, n);
      plain_mask_[static_cast<size_t>(id) / 32] |= 1u << (id % 32);
    } else {
      rest.push_back(id);
    }
  }
  std::sort(plain_tokens_.begin(), plain_tokens_.end(), [](auto x, auto y) { return x.second < y.second; });
  if (!plain_tokens_.empty()) longest_plain_ = plain_tokens_.back().second;
  auto by_bytes = [&](int32_t x, int32_t y) { return bytes(x) < bytes(y); };
  std::sort(ids.begin(), ids.end(), by_bytes);
  std::sort(rest.begin(), rest.end(), by_bytes);
  nodes_.emplace_back();
  build(0, ids, 0);
  rest_root_ = static_cast<int32_t>(nodes_.size());
  nodes_.emplace_back();
  build(rest_root_, rest, 0);
}

std::shared_ptr<const TokenVocabulary> TokenVocabulary::from_tokenizer(const tokenizer::Tokenizer& tokenizer,
                                                                       int64_t vocab_size) {
  std::vector<std::string> bytes(static_cast<size_t>(vocab_size));
  for (int32_t id = 0; id < vocab_size; ++id)
    if (tokenizer.is_valid_id(id) && !tokenizer.is_special(id)) bytes[static_cast<size_t>(id)] = tokenizer.token_bytes(id);
  return std::make_shared<const TokenVocabulary>(std::move(bytes));
}

// Fills trie node `node`, the prefix of length `depth` that the `ids` (sorted
// by bytes) share: the tokens ending there, then its children, contiguous,
// one per next byte, each built in turn.
void TokenVocabulary::build(int32_t node, std::span<const int32_t> ids, size_t depth) {
  size_t i = 0;
  const auto first_token = static_cast<int32_t>(tokens_.size());
  while (i < ids.size() && bytes(ids[i]).size() == depth) tokens_.push_back(ids[i++]);  // shortest sort first
  std::vector<std::pair<size_t, size_t>> groups;  // [begin, end) of ids sharing the byte at `depth`
  while (i < ids.size()) {
    const char byte = bytes(ids[i])[depth];
    size_t j = i;
    while (j < ids.size() && bytes(ids[j])[depth] == byte) ++j;
    groups.emplace_back(i, j);
    i = j;
  }
  const auto first_child = static_cast<int32_t>(nodes_.size());
  TrieNode& n = nodes_[static_cast<size_t>(node)];
  n.first_token = first_token;
  n.num_tokens = static_cast<int32_t>(tokens_.size()) - first_token;
  n.first_child = first_child;
  n.num_children = static_cast<int32_t>(groups.size());
  for (const auto& [b, e] : groups) {
    (void)e;
    nodes_.push_back(TrieNode{.byte = static_cast<uint8_t>(bytes(ids[b])[depth])});
  }
  for (size_t k = 0; k < groups.size(); ++k)
    build(first_child + static_cast<int32_t>(k), ids.subspan(groups[k].first, groups[k].second - groups[k].first),
          depth + 1);
}

void TokenVocabulary::walk(int32_t node, size_t depth, std::vector<Matcher>& level,
                           std::vector<uint32_t>& mask) const {
  if (level.size() < depth + 2) level.resize(depth + 2, level[0]);
  const TrieNode& n = nodes_[static_cast<size_t>(node)];
  for (int32_t c = n.first_child; c < n.first_child + n.num_children; ++c) {
    const TrieNode& child = nodes_[static_cast<size_t>(c)];
    if (!level[depth].advance_into(child.byte, level[depth + 1])) continue;
    for (int32_t t = child.first_token; t < child.first_token + child.num_tokens; ++t) {
      const int32_t id = tokens_[static_cast<size_t>(t)];
      mask[static_cast<size_t>(id) / 32] |= 1u << (id % 32);
    }
    if (child.num_children > 0) walk(c, depth + 1, level, mask);
  }
}

void TokenVocabulary::allowed_tokens(const Matcher& matcher, std::vector<uint32_t>& mask,
                                     TokenSetCache* cache) const {
  // Each thread's tokens, from the cache or its own walk: where threads recur,
  // and at the start when requests share the cache.
  if (cache && (matcher.threads_recur() || (cache->shares_readings() && matcher.at_start()))) {
    mask.assign(plain_mask_.size(), 0);
    for (size_t i = 0; i < matcher.num_threads(); ++i) cache->add_reading(*this, matcher, i, mask);
    return;
  }
  thread_local std::vector<Matcher> level;  // the matcher after each prefix on the walk's path
  if (level.empty()) {
    level.push_back(matcher);
  } else {
    level[0] = matcher;
  }
  const Matcher::PlainRuns runs = matcher.plain_runs();
  if (runs.room == INT32_MAX) {
    mask = plain_mask_;
  } else {
    mask.assign(plain_mask_.size(), 0);
    for (const auto& [id, n] : plain_tokens_) {
      if (n > runs.room) break;
      mask[static_cast<size_t>(id) / 32] |= 1u << (id % 32);
    }
  }
  bool patterns_settled = true;
  for (const Matcher::PatternRun& r : runs.patterns) {
    if (runs.room == INT32_MAX) break;
    if (r.room < longest_plain_) {  // its length bounds may bind: left to the walk
      patterns_settled = false;
    } else if (cache) {
      cache->add_pattern(*this, r.at, mask);
    } else {
      add_pattern_tokens(*r.at.regex, r.at.state, mask);
    }
  }
  // The others by the walk; the plain ones too where some may be taken
  // otherwise than as string characters (a thread elsewhere, or in a string
  // whose bounds may bind: a run one thread refuses may suit another).
  const bool plain_settled = runs.room == INT32_MAX || (runs.every_thread && patterns_settled);
  walk(plain_settled ? rest_root_ : 0, 0, level, mask);
}

void TokenVocabulary::add_pattern_tokens(const Regex& regex, int32_t state, std::vector<uint32_t>& mask) const {
  walk_pattern(regex, 0, state, PendingUtf8{}, mask);
}

// The walk of add_pattern_tokens below trie node `node`: `state` is the
// automaton's after the path's whole characters, `pending` a UTF-8 sequence
// the path has begun. As the matcher reads a string, a sequence goes on only
// while the code points it may still spell hold one the automaton takes.
void TokenVocabulary::walk_pattern(const Regex& regex, int32_t node, int32_t state, PendingUtf8 pending,
                                   std::vector<uint32_t>& mask) const {
  const TrieNode& n = nodes_[static_cast<size_t>(node)];
  for (int32_t c = n.first_child; c < n.first_child + n.num_children; ++c) {
    const TrieNode& child = nodes_[static_cast<size_t>(c)];
    const uint8_t byte = child.byte;
    int32_t next = state;
    PendingUtf8 p = pending;
    if (p.left == 0) {
      Utf8Lead lead;
      if (plain_ascii(byte)) {
        next = regex.step(state, byte);
      } else if (utf8_lead(byte, lead) && regex.allows(state, lead.first, lead.last)) {
        p = {lead.continuations, lead.lo, lead.hi, lead.bits};
      } else {
        continue;
      }
    } else {
      if (byte < p.lo || byte > p.hi) continue;
      p.bits = (p.bits << 6) | (byte & 0x3F);
      p.lo = 0x80, p.hi = 0xBF;
      if (--p.left == 0) {
        next = regex.step(state, p.bits);
      } else {
        const int shift = 6 * p.left;
        if (!regex.allows(state, p.bits << shift, (p.bits << shift) | ((1u << shift) - 1))) continue;
      }
    }
    if (next < 0) continue;
    if (p.left == 0) {
      for (int32_t t = child.first_token; t < child.first_token + child.num_tokens; ++t) {
        const int32_t id = tokens_[static_cast<size_t>(t)];
        mask[static_cast<size_t>(id) / 32] |= 1u << (id % 32);
      }
    }
    if (child.num_children > 0) walk_pattern(regex, c, next, p, mask);
  }
}

template <class IsKey, class Fill>
void TokenSetCache::add(IsKey&& is_key, Entry key, Fill&& fill, std::vector<uint32_t>& mask) {
  const std::lock_guard lock(mutex_);
  auto it = std::find_if(entries_.begin(), entries_.end(), is_key);
  if (it == entries_.end()) {
    ++misses_;
    if (entries_.size() < capacity_) {
      it = entries_.insert(entries_.end(), std::move(key));
    } else {
      it = std::min_element(entries_.begin(), entries_.end(),
                            [](const Entry& x, const Entry& y) { return x.last_used < y.last_used; });
      it->pattern = key.pattern;
      it->reading = std::move(key.reading);
    }
    it->tokens.assign(mask.size(), 0);
    fill(it->tokens);
  }
  it->last_used = ++clock_;
  for (size_t w = 0; w < mask.size(); ++w) mask[w] |= it->tokens[w];
}

void TokenSetCache::add_pattern(const TokenVocabulary& vocabulary, const Matcher::PatternState& p,
                                std::vector<uint32_t>& mask) {
  add([&](const Entry& e) { return e.reading.empty() && e.pattern == p; }, Entry{.pattern = p},
      [&](std::vector<uint32_t>& tokens) { vocabulary.add_pattern_tokens(*p.regex, p.state, tokens); }, mask);
}

void TokenSetCache::add_reading(const TokenVocabulary& vocabulary, const Matcher& matcher, size_t thread,
                                std::vector<uint32_t>& mask) {
  if (shared_readings_) return shared_readings_->add_reading(vocabulary, matcher, thread, mask);
  const std::span<const Matcher::Frame> frames = matcher.thread(thread);
  add([&](const Entry& e) { return std::equal(e.reading.begin(), e.reading.end(), frames.begin(), frames.end()); },
      Entry{.reading = {frames.begin(), frames.end()}},
      [&](std::vector<uint32_t>& tokens) { vocabulary.allowed_tokens(matcher.only_thread(thread), tokens); }, mask);
}

TokenConstraint::TokenConstraint(std::shared_ptr<const Grammar> grammar,
                                 std::shared_ptr<const TokenVocabulary> vocabulary, std::vector<int32_t> end_ids,
                                 std::shared_ptr<TokenSetCache> shared_readings)
    : grammar_(std::move(grammar)), vocabulary_(std::move(vocabulary)), end_ids_(std::move(end_ids)),
      matcher_(*grammar_), cache_(std::make_shared<TokenSetCache>(std::move(shared_readings))) {}

void TokenConstraint::allowed_tokens(std::vector<uint32_t>& mask) const {
  vocabulary_->allowed_tokens(matcher_, mask, cache_.get());
  const bool none = std::all_of(mask.begin(), mask.end(), [](uint32_t w) { return w == 0; });
  if (!none && !matcher_.accepting()) return;
  for (const int32_t id : end_ids_)
    if (id >= 0 && id < vocabulary_->size()) mask[static_cast<size_t>(id) / 32] |= 1u << (id % 32);
}

bool TokenConstraint::accept(int32_t token) {
  if (std::find(end_ids_.begin(), end_ids_.end(), token) != end_ids_.end()) return matcher_.accepting();
  if (token < 0 || token >= vocabulary_->size() || vocabulary_->bytes(token).empty()) return false;
  return matcher_.advance(vocabulary_->bytes(token));
}

}  // namespace moe::structured
