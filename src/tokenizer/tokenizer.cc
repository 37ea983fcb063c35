#include "tokenizer/tokenizer.h"

#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "tokenizer/utf8.h"

namespace moe::tokenizer {
namespace {

using nlohmann::json;

Expected<std::string> read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return not_found("cannot open {}", path.string());
  std::ostringstream buffer;
  buffer << in.rdbuf();
  if (in.bad()) return data_loss("error reading {}", path.string());
  return buffer.str();
}

Expected<json> parse_json(std::string_view text, std::string_view name) {
  json parsed = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) return invalid_argument("{} is not valid JSON", name);
  return parsed;
}

// A normalizer we can run: none, NFC, or a Sequence of those.
Status check_normalizer(const json& normalizer, bool& nfc_out) {
  if (normalizer.is_null()) return Status::ok();
  const std::string type = normalizer.value("type", "");
  if (type == "NFC") {
    nfc_out = true;
    return Status::ok();
  }
  if (type == "Sequence" && normalizer.contains("normalizers")) {
    for (const auto& inner : normalizer["normalizers"]) MOE_RETURN_IF_ERROR(check_normalizer(inner, nfc_out));
    return Status::ok();
  }
  return unimplemented("tokenizer.json: normalizer '{}' is not supported", type);
}

// The GPT-2 regex that ByteLevel applies when its use_regex is true.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Finds the one regex the pre_tokenizer applies (Split/Isolated, or ByteLevel
// with use_regex); "" when it applies none. Anything else is refused.
Status find_split_pattern(const json& pre, std::string& pattern) {
  if (pre.is_null()) return Status::ok();
  const std::string type = pre.value("type", "");
  if (type == "Sequence" && pre.contains("pretokenizers")) {
    for (const auto& inner : pre["pretokenizers"]) MOE_RETURN_IF_ERROR(find_split_pattern(inner, pattern));
    return Status::ok();
  }
  std::string found;
  if (type == "ByteLevel") {
    if (pre.value("add_prefix_space", false)) {
      return unimplemented("tokenizer.json: ByteLevel add_prefix_space is not supported");
    }
    if (!pre.value("use_regex", true)) return Status::ok();
    found = kGpt2Pattern;
  } else if (type == "Split") {
    if (pre.value("behavior", "") != "Isolated" || pre.value("invert", false)) {
      return unimplemented("tokenizer.json: Split behavior '{}' is not supported (only Isolated)",
                           pre.value("behavior", ""));
    }
    const json& p = pre.value("pattern", json::object());
    if (!p.contains("Regex") || !p["Regex"].is_string()) {
      return unimplemented("tokenizer.json: Split needs a Regex pattern");
    }
    found = p["Regex"].get<std::string>();
  } else {
    return unimplemented("tokenizer.json: pre_tokenizer '{}' is not supported", type);
  }
  if (!pattern.empty()) return unimplemented("tokenizer.json: more than one splitting pre_tokenizer");
  pattern = found;
  return Status::ok();
}

// What the ByteLevel decoder turns one token into: its byte-level characters mapped
// back to bytes, or the token's own UTF-8 when one character has no byte.
std::string byte_level_decode(std::string_view token) {
  std::string bytes;
  size_t pos = 0;
  while (pos < token.size()) {
    char32_t cp;
    pos += decode_utf8(token, pos, cp);
    const int b = char_to_byte(cp);
    if (b < 0) return std::string(token);
    bytes.push_back(static_cast<char>(b));
  }
  return bytes;
}

// tokenizer_config.json names tokens as strings or as {"content": ...} objects.
std::string token_content(const json& config, const char* key) {
  const auto it = config.find(key);
  if (it == config.end()) return {};
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
    return (*it)["content"].get<std::string>();
  }
  return {};
}

}  // namespace

Expected<Tokenizer> Tokenizer::load(const std::filesystem::path& model_dir) {
  MOE_ASSIGN_OR_RETURN(std::string tokenizer_json, read_file(model_dir / "tokenizer.json"));
  std::string config_json, generation_json;
  if (std::filesystem::exists(model_dir / "tokenizer_config.json")) {
    MOE_ASSIGN_OR_RETURN(config_json, read_file(model_dir / "tokenizer_config.json"));
  }
  if (std::filesystem::exists(model_dir / "generation_config.json")) {
    MOE_ASSIGN_OR_RETURN(generation_json, read_file(model_dir / "generation_config.json"));
  }
  auto tokenizer = from_json(tokenizer_json, config_json, generation_json);
  if (!tokenizer) return tokenizer.status().with_context(model_dir.string());
  return tokenizer;
}

Expected<Tokenizer> Tokenizer::from_json(std::string_view tokenizer_json, std::string_view tokenizer_config_json,
                                         std::string_view generation_config_json) try {
  MOE_ASSIGN_OR_RETURN(json root, parse_json(tokenizer_json, "tokenizer.json"));
  if (!root.is_object()) return invalid_argument("tokenizer.json is not an object");
  Tokenizer tok;
  MOE_ASSIGN_OR_RETURN(tok.bpe_, BpeModel::create(root.value("model", json())));
  MOE_RETURN_IF_ERROR(check_normalizer(root.value("normalizer", json()), tok.normalize_nfc_));
  std::string pattern;
  MOE_RETURN_IF_ERROR(find_split_pattern(root.value("pre_tokenizer", json()), pattern));
  if (!pattern.empty()) {
    MOE_ASSIGN_OR_RETURN(Pretokenizer pre, Pretokenizer::create(pattern));
    tok.pretokenizer_.emplace(std::move(pre));
  }
  const json decoder = root.value("decoder", json());
  if (!decoder.is_object() || decoder.value("type", "") != "ByteLevel") {
    return unimplemented("tokenizer.json: only the ByteLevel decoder is supported");
  }

  size_t num_ids = tok.bpe_.vocab_size();
  std::vector<AddedToken> raw, normalized;
  for (const json& entry : root.value("added_tokens", json::array())) {
    AddedToken token;
    token.id = entry.at("id").get<int32_t>();
    token.content = entry.at("content").get<std::string>();
    token.special = entry.value("special", false);
    token.normalized = entry.value("normalized", !token.special);
    if (token.id < 0 || token.id > (1 << 30) || token.content.empty()) {
      return invalid_argument("tokenizer.json: added token '{}' has a bad id or no content", token.content);
    }
    if (entry.value("lstrip", false) || entry.value("rstrip", false) || entry.value("single_word", false)) {
      return unimplemented("tokenizer.json: added token '{}': lstrip/rstrip/single_word are not supported",
                           token.content);
    }
    num_ids = std::max(num_ids, static_cast<size_t>(token.id) + 1);
    tok.added_.all.push_back(token);
    (token.normalized ? normalized : raw).push_back(token);
  }
  tok.added_.raw = AddedTokenMatcher(std::move(raw));
  tok.added_.normalized = AddedTokenMatcher(std::move(normalized));

  tok.token_bytes_.resize(num_ids);
  tok.special_by_id_.assign(num_ids, false);
  tok.added_by_id_.assign(num_ids, false);
  for (size_t id = 0; id < tok.bpe_.vocab_size(); ++id) {
    tok.token_bytes_[id] = byte_level_decode(tok.bpe_.id_to_token(static_cast<TokenId>(id)));
  }
  for (const AddedToken& token : tok.added_.all) {
    tok.token_bytes_[token.id] = byte_level_decode(token.content);
    tok.special_by_id_[token.id] = token.special;
    tok.added_by_id_[token.id] = true;
  }
  MOE_RETURN_IF_ERROR(tok.load_config(tokenizer_config_json, generation_config_json));
  return tok;
} catch (const json::exception& e) {
  return invalid_argument("tokenizer files: {}", e.what());
}

Status Tokenizer::load_config(std::string_view tokenizer_config_json, std::string_view generation_config_json) {
  if (!tokenizer_config_json.empty()) {
    MOE_ASSIGN_OR_RETURN(json config, parse_json(tokenizer_config_json, "tokenizer_config.json"));
    if (!config.is_object()) return invalid_argument("tokenizer_config.json is not an object");
    special_.bos = token_content(config, "bos_token");
    special_.eos = token_content(config, "eos_token");
    special_.pad = token_content(config, "pad_token");
    special_.add_bos_token = config.value("add_bos_token", false);
    const auto& tmpl = config.find("chat_template");
    if (tmpl != config.end() && tmpl->is_string()) {
      chat_template_ = tmpl->get<std::string>();
    } else if (tmpl != config.end() && tmpl->is_array()) {
      for (const json& named : *tmpl) {
        if (named.value("name", "") == "default") chat_template_ = named.value("template", "");
      }
    }
  }
  auto id_of = [&](const std::string& token) -> std::optional<TokenId> {
    return token.empty() ? std::nullopt : token_to_id(token);
  };
  special_.bos_id = id_of(special_.bos);
  special_.eos_id = id_of(special_.eos);
  special_.pad_id = id_of(special_.pad);
  if (!generation_config_json.empty()) {
    MOE_ASSIGN_OR_RETURN(json generation, parse_json(generation_config_json, "generation_config.json"));
    const json eos = generation.is_object() ? generation.value("eos_token_id", json()) : json();
    if (eos.is_number_integer()) special_.eos_ids.push_back(eos.get<TokenId>());
    if (eos.is_array()) {
      for (const json& id : eos) {
        if (id.is_number_integer()) special_.eos_ids.push_back(id.get<TokenId>());
      }
    }
  }
  if (special_.eos_id && std::find(special_.eos_ids.begin(), special_.eos_ids.end(), *special_.eos_id) ==
                             special_.eos_ids.end()) {
    special_.eos_ids.push_back(*special_.eos_id);
  }
  return Status::ok();
}

std::optional<TokenId> Tokenizer::token_to_id(std::string_view token) const {
  for (const AddedToken& added : added_.all) {
    if (added.content == token) return added.id;
  }
  const TokenId id = bpe_.token_to_id(token);
  if (id < 0) return std::nullopt;
  return id;
}

std::vector<TokenId> Tokenizer::encode(std::string_view text, bool parse_special) const {
  std::string sanitized;
  if (!is_valid_utf8(text)) {
    sanitized = sanitize_utf8(text);
    text = sanitized;
  }
  std::vector<TokenId> ids;
  ids.reserve(text.size() / 3 + 1);
  std::vector<Segment> segments;
  added_.raw.split(text, parse_special, segments);
  for (const Segment& segment : segments) {
    if (segment.id >= 0) {
      ids.push_back(segment.id);
    } else {
      encode_text(segment.text, ids);
    }
  }
  return ids;
}

void Tokenizer::encode_text(std::string_view text, std::vector<TokenId>& ids) const {
  std::string normalized_storage;
  if (normalize_nfc_ && !is_ascii(text)) {
    normalized_storage = nfc(text);
    text = normalized_storage;
  }
  if (added_.normalized.empty()) {
    encode_normalized(text, ids);
    return;
  }
  std::vector<Segment> segments;
  added_.normalized.split(text, /*match_special=*/true, segments);
  for (const Segment& segment : segments) {
    if (segment.id >= 0) {
      ids.push_back(segment.id);
    } else {
      encode_normalized(segment.text, ids);
    }
  }
}

void Tokenizer::encode_normalized(std::string_view text, std::vector<TokenId>& ids) const {
  if (!pretokenizer_) {
    bpe_.encode_piece(text, ids);
    return;
  }
  std::vector<std::string_view> pieces;
  pretokenizer_->split(text, pieces);
  for (std::string_view piece : pieces) bpe_.encode_piece(piece, ids);
}

std::string Tokenizer::decode(std::span<const TokenId> ids, bool skip_special_tokens) const {
  std::string bytes;
  for (TokenId id : ids) {
    if (!is_valid_id(id)) continue;
    if (skip_special_tokens && special_by_id_[id]) continue;
    bytes += token_bytes_[id];
  }
  if (is_valid_utf8(bytes)) return bytes;
  return sanitize_utf8(bytes);
}

std::string_view Tokenizer::token_bytes(TokenId id) const {
  if (!is_valid_id(id)) return {};
  return token_bytes_[id];
}

bool Tokenizer::is_special(TokenId id) const { return is_valid_id(id) && special_by_id_[id]; }

}  // namespace moe::tokenizer
