// Text <-> token ids, identical to Hugging Face tokenizers for byte-level BPE
// models (Qwen2/Qwen3 and GPT-2 style tokenizer.json files).
//
// Encoding: added tokens (special or not) are found first in the raw text,
// leftmost-longest; the text between them is NFC-normalized, split by the
// pretokenizer regex and encoded by BPE. Decoding: the byte-level decoder, with
// invalid UTF-8 in the output replaced by U+FFFD (as from_utf8_lossy does).
// Input text that is not valid UTF-8 is first sanitized (utf8.h).
//
// Immutable after load(): any thread may call every const method concurrently.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "tokenizer/added_tokens.h"
#include "tokenizer/bpe.h"
#include "tokenizer/pretokenizer.h"

namespace moe::tokenizer {

// From tokenizer_config.json (token strings) and generation_config.json (eos ids).
struct SpecialTokens {
  std::string bos, eos, pad;  // empty when the config names none
  std::optional<TokenId> bos_id, eos_id, pad_id;
  bool add_bos_token = false;
  // Every id that ends generation: generation_config.json's eos_token_id (one or a
  // list), plus tokenizer_config.json's eos token.
  std::vector<TokenId> eos_ids;
};

class Tokenizer {
 public:
  // Reads DIR/tokenizer.json, and DIR/tokenizer_config.json and
  // DIR/generation_config.json when they exist.
  static Expected<Tokenizer> load(const std::filesystem::path& model_dir);

  // The same from file contents; the two configs may be empty.
  static Expected<Tokenizer> from_json(std::string_view tokenizer_json, std::string_view tokenizer_config_json = {},
                                       std::string_view generation_config_json = {});

  // Ids of `text`. With parse_special = false, special tokens in the text are
  // encoded as plain text (for untrusted user content); non-special added tokens
  // are still matched, as Hugging Face does with split_special_tokens.
  std::vector<TokenId> encode(std::string_view text, bool parse_special = true) const;

  // Text of `ids`. Ids outside the vocabulary are skipped, as Hugging Face does.
  std::string decode(std::span<const TokenId> ids, bool skip_special_tokens = false) const;

  // The raw bytes `id` decodes to (possibly part of a UTF-8 sequence); empty for
  // an unknown id. Concatenating these and replacing invalid UTF-8 is decode().
  std::string_view token_bytes(TokenId id) const;
  bool is_special(TokenId id) const;
  // True for the tokens of tokenizer.json's "added_tokens" (special or not).
  bool is_added_token(TokenId id) const { return is_valid_id(id) && added_by_id_[id]; }
  bool is_valid_id(TokenId id) const { return id >= 0 && static_cast<size_t>(id) < num_ids(); }
  // Vocabulary size including added tokens (one past the largest id).
  size_t num_ids() const { return token_bytes_.size(); }

  // The id of a token given in its stored form (byte-level for BPE tokens, the
  // content for added tokens); nullopt when unknown.
  std::optional<TokenId> token_to_id(std::string_view token) const;

  const SpecialTokens& special_tokens() const { return special_; }
  // tokenizer_config.json's chat_template (the "default" one when it is a list);
  // empty when there is none.
  const std::string& chat_template() const { return chat_template_; }

 private:
  Tokenizer() = default;
  Status load_config(std::string_view tokenizer_config_json, std::string_view generation_config_json);
  void encode_text(std::string_view text, std::vector<TokenId>& ids) const;
  void encode_normalized(std::string_view text, std::vector<TokenId>& ids) const;

  BpeModel bpe_;
  std::optional<Pretokenizer> pretokenizer_;  // none: the whole text is one piece
  bool normalize_nfc_ = false;
  AddedTokens added_;
  std::vector<std::string> token_bytes_;  // by id, after the byte-level decoder
  std::vector<bool> special_by_id_;
  std::vector<bool> added_by_id_;
  SpecialTokens special_;
  std::string chat_template_;
};

}  // namespace moe::tokenizer
