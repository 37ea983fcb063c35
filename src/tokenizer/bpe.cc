#include "tokenizer/bpe.h"

#include <algorithm>
#include <queue>

#include <nlohmann/json.hpp>

#include "tokenizer/utf8.h"

namespace moe::tokenizer {
namespace {

// Pieces up to this many bytes merge with the quadratic scan, which beats the
// heap for the short words that make up almost all text.
constexpr size_t kSmallPieceBytes = 48;

uint64_t pair_key(TokenId left, TokenId right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

uint64_t hash_pair(uint64_t key) {
  key ^= key >> 33;
  key *= 0xff51afd7ed558ccdULL;
  key ^= key >> 33;
  key *= 0xc4ceb9fe1a85ec53ULL;
  key ^= key >> 33;
  return key;
}

std::array<char32_t, 256> make_byte_to_char() {
  std::array<char32_t, 256> table{};
  char32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    table[b] = printable ? static_cast<char32_t>(b) : next++;
  }
  return table;
}

// Splits a merges entry: ["a", "b"] (tokenizers >= 0.20) or "a b" (older files).
bool split_merge(const nlohmann::json& entry, std::string& left, std::string& right) {
  if (entry.is_array() && entry.size() == 2 && entry[0].is_string() && entry[1].is_string()) {
    left = entry[0].get<std::string>();
    right = entry[1].get<std::string>();
    return true;
  }
  if (!entry.is_string()) return false;
  const std::string& s = entry.get_ref<const std::string&>();
  const size_t space = s.find(' ', 1);
  if (space == std::string::npos) return false;
  left = s.substr(0, space);
  right = s.substr(space + 1);
  return true;
}

}  // namespace

const std::array<char32_t, 256>& byte_to_char_table() {
  static const std::array<char32_t, 256> table = make_byte_to_char();
  return table;
}

int char_to_byte(char32_t c) {
  if (c < 256) {
    const bool printable = (c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF);
    return printable ? static_cast<int>(c) : -1;
  }
  const auto& table = byte_to_char_table();
  if (c >= 256 + 68) return -1;
  for (int b = 0; b < 256; ++b) {
    if (table[b] == c) return b;
  }
  return -1;
}

Expected<BpeModel> BpeModel::create(const nlohmann::json& model) {
  if (!model.is_object() || model.value("type", "") != "BPE") {
    return unimplemented("tokenizer.json: model type '{}' is not supported (only BPE)",
                         model.is_object() ? model.value("type", "?") : "?");
  }
  if (model.contains("dropout") && !model["dropout"].is_null()) {
    return unimplemented("tokenizer.json: BPE dropout is not supported");
  }
  const auto& vocab = model.find("vocab");
  const auto& merges = model.find("merges");
  if (vocab == model.end() || !vocab->is_object() || merges == model.end() || !merges->is_array()) {
    return invalid_argument("tokenizer.json: model needs a 'vocab' object and a 'merges' array");
  }
  BpeModel bpe;
  for (const auto& [token, id_json] : vocab->items()) {
    if (!id_json.is_number_integer() || id_json.get<int64_t>() < 0 || id_json.get<int64_t>() > (1 << 30)) {
      return invalid_argument("tokenizer.json: vocab entry '{}' has a bad id", token);
    }
    const auto id = static_cast<TokenId>(id_json.get<int64_t>());
    if (static_cast<size_t>(id) >= bpe.id_to_token_.size()) bpe.id_to_token_.resize(id + 1);
    bpe.id_to_token_[id] = token;
    bpe.vocab_.emplace(token, id);
  }
  const auto& byte_chars = byte_to_char_table();
  for (int b = 0; b < 256; ++b) {
    std::string token;
    append_utf8(byte_chars[b], token);
    const TokenId id = bpe.token_to_id(token);
    if (id < 0) return invalid_argument("tokenizer.json: byte-level token for byte {} is missing", b);
    bpe.byte_token_[b] = id;
  }
  size_t table_size = 1024;
  while (table_size < merges->size() * 2) table_size *= 2;
  bpe.merge_table_.assign(table_size, MergeEntry{kEmptyPair, 0, 0});
  bpe.merge_mask_ = table_size - 1;
  std::string left, right;
  for (size_t rank = 0; rank < merges->size(); ++rank) {
    if (!split_merge((*merges)[rank], left, right)) {
      return invalid_argument("tokenizer.json: merge {} is malformed", rank);
    }
    const TokenId left_id = bpe.token_to_id(left);
    const TokenId right_id = bpe.token_to_id(right);
    const TokenId merged_id = bpe.token_to_id(left + right);
    if (left_id < 0 || right_id < 0 || merged_id < 0) {
      return invalid_argument("tokenizer.json: merge {} ('{}' '{}') uses a token not in the vocab", rank, left,
                              right);
    }
    int32_t existing_rank;
    TokenId existing_merged;
    if (!bpe.find_merge(left_id, right_id, existing_rank, existing_merged)) {
      bpe.insert_merge(left_id, right_id, static_cast<int32_t>(rank), merged_id);
    }
  }
  return bpe;
}

TokenId BpeModel::token_to_id(std::string_view token) const {
  const auto it = vocab_.find(std::string(token));
  return it == vocab_.end() ? -1 : it->second;
}

const std::string& BpeModel::id_to_token(TokenId id) const {
  static const std::string kEmpty;
  if (id < 0 || static_cast<size_t>(id) >= id_to_token_.size()) return kEmpty;
  return id_to_token_[id];
}

bool BpeModel::find_merge(TokenId left, TokenId right, int32_t& rank, TokenId& merged) const {
  const uint64_t key = pair_key(left, right);
  for (uint64_t slot = hash_pair(key) & merge_mask_;; slot = (slot + 1) & merge_mask_) {
    const MergeEntry& entry = merge_table_[slot];
    if (entry.pair == key) {
      rank = entry.rank;
      merged = entry.merged;
      return true;
    }
    if (entry.pair == kEmptyPair) return false;
  }
}

void BpeModel::insert_merge(TokenId left, TokenId right, int32_t rank, TokenId merged) {
  const uint64_t key = pair_key(left, right);
  uint64_t slot = hash_pair(key) & merge_mask_;
  while (merge_table_[slot].pair != kEmptyPair) slot = (slot + 1) & merge_mask_;
  merge_table_[slot] = MergeEntry{key, rank, merged};
}

void BpeModel::encode_piece(std::string_view piece, std::vector<TokenId>& ids) const {
  if (piece.empty()) return;
  std::vector<TokenId> symbols(piece.size());
  for (size_t i = 0; i < piece.size(); ++i) symbols[i] = byte_token_[static_cast<unsigned char>(piece[i])];
  if (symbols.size() <= kSmallPieceBytes) {
    merge_small(symbols);
  } else {
    merge_large(symbols);
  }
  ids.insert(ids.end(), symbols.begin(), symbols.end());
}

void BpeModel::merge_small(std::vector<TokenId>& symbols) const {
  while (symbols.size() > 1) {
    int32_t best_rank = INT32_MAX;
    size_t best_pos = 0;
    TokenId best_merged = -1;
    for (size_t i = 0; i + 1 < symbols.size(); ++i) {
      int32_t rank;
      TokenId merged;
      if (find_merge(symbols[i], symbols[i + 1], rank, merged) && rank < best_rank) {
        best_rank = rank;
        best_pos = i;
        best_merged = merged;
      }
    }
    if (best_merged < 0) return;
    symbols[best_pos] = best_merged;
    symbols.erase(symbols.begin() + static_cast<std::ptrdiff_t>(best_pos) + 1);
  }
}

// Same result as merge_small in O(n log n): a heap of candidate merges ordered by
// (rank, position) over a doubly linked list of symbols; stale entries (whose left
// or right symbol changed since they were pushed) are skipped when popped.
void BpeModel::merge_large(std::vector<TokenId>& symbols) const {
  const size_t n = symbols.size();
  std::vector<int32_t> prev(n), next(n);
  std::vector<bool> alive(n, true);
  for (size_t i = 0; i < n; ++i) {
    prev[i] = static_cast<int32_t>(i) - 1;
    next[i] = i + 1 < n ? static_cast<int32_t>(i + 1) : -1;
  }
  struct Candidate {
    int32_t rank;
    int32_t pos;
    TokenId left, right, merged;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  auto push = [&](int32_t pos) {
    if (pos < 0 || next[pos] < 0) return;
    int32_t rank;
    TokenId merged;
    const TokenId left = symbols[pos];
    const TokenId right = symbols[next[pos]];
    if (find_merge(left, right, rank, merged)) heap.push(Candidate{rank, pos, left, right, merged});
  };
  for (size_t i = 0; i + 1 < n; ++i) push(static_cast<int32_t>(i));
  while (!heap.empty()) {
    const Candidate top = heap.top();
    heap.pop();
    const int32_t pos = top.pos;
    if (!alive[pos] || next[pos] < 0 || symbols[pos] != top.left || symbols[next[pos]] != top.right) continue;
    const int32_t right_pos = next[pos];
    symbols[pos] = top.merged;
    alive[right_pos] = false;
    next[pos] = next[right_pos];
    if (next[pos] >= 0) prev[next[pos]] = pos;
    push(prev[pos]);
    push(pos);
  }
  size_t out = 0;
  for (int32_t i = 0; i >= 0; i = next[i]) symbols[out++] = symbols[i];
  symbols.resize(out);
}

}  // namespace moe::tokenizer
