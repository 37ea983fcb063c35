// Incremental detokenization for streaming: ids arrive one at a time, text leaves
// as soon as it is complete. A piece never ends inside a UTF-8 character, and the
// pieces (with finish()) concatenate to exactly Tokenizer::decode of all the ids,
// including its U+FFFD replacement of bytes that never form a valid character.
//
// One instance per sequence; not thread-safe (one thread at a time). The
// Tokenizer must outlive it.
#pragma once

#include <string>

#include "tokenizer/tokenizer.h"

namespace moe::tokenizer {

class IncrementalDetokenizer {
 public:
  IncrementalDetokenizer(const Tokenizer& tokenizer, bool skip_special_tokens)
      : tokenizer_(&tokenizer), skip_special_tokens_(skip_special_tokens) {}

  // The text that `id` completes (often empty while a character is split
  // between tokens). Unknown ids add nothing, as in decode().
  std::string add(TokenId id);

  // The rest: bytes held back for an unfinished character, as U+FFFD.
  std::string finish();

  // Bytes received but not yet returned (at most 3).
  size_t num_pending_bytes() const { return pending_.size(); }

 private:
  const Tokenizer* tokenizer_;
  bool skip_special_tokens_;
  std::string pending_;
};

}  // namespace moe::tokenizer
