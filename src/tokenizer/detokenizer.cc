#include "tokenizer/detokenizer.h"

#include "tokenizer/utf8.h"

namespace moe::tokenizer {

// Emitting up to complete_utf8_prefix() is safe: the held-back tail is a proper
// prefix of a valid sequence, and every byte before it is either a whole
// character or an ill-formed subpart whose replacement no later byte can change.
std::string IncrementalDetokenizer::add(TokenId id) {
  if (!tokenizer_->is_valid_id(id)) return {};
  if (skip_special_tokens_ && tokenizer_->is_special(id)) return {};
  pending_ += tokenizer_->token_bytes(id);
  const size_t complete = complete_utf8_prefix(pending_);
  if (complete == 0) return {};
  std::string out = sanitize_utf8(std::string_view(pending_).substr(0, complete));
  pending_.erase(0, complete);
  return out;
}

std::string IncrementalDetokenizer::finish() {
  std::string out = sanitize_utf8(pending_);
  pending_.clear();
  return out;
}

}  // namespace moe::tokenizer
