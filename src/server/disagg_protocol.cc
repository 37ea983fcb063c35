#include "server/disagg_protocol.h"

#include <cmath>
#include <limits>
#include <set>

namespace moe::server::disagg {

using nlohmann::json;

namespace {

// Reads the fields of one JSON object with type and range checks; the first
// problem is kept and names the field.
class Reader {
 public:
  Reader(const json& j, std::string what, std::set<std::string> allowed) : j_(j), what_(std::move(what)) {
    if (!j.is_object()) {
      fail("{} must be a JSON object", what_);
      return;
    }
    for (const auto& [key, value] : j.items())
      if (!allowed.count(key)) {
        fail("{}: unknown field '{}'", what_, key.substr(0, 64));
        return;
      }
  }
  template <typename... Args>
  void fail(fmt::format_string<Args...> format, Args&&... args) {
    if (status_.is_ok()) status_ = invalid_argument(format, std::forward<Args>(args)...);
  }
  const json* field(const char* name, bool required) {
    if (!status_.is_ok()) return nullptr;
    auto it = j_.find(name);
    if (it == j_.end() || it->is_null()) {
      if (required) fail("{}: '{}' is required", what_, name);
      return nullptr;
    }
    return &*it;
  }
  int64_t integer(const char* name, int64_t lo, int64_t hi, bool required = true, int64_t fallback = 0) {
    const json* v = field(name, required);
    if (!v) return fallback;
    if (!v->is_number_integer()) return fail("{}: '{}' must be an integer", what_, name), fallback;
    const bool is_unsigned = v->is_number_unsigned();
    if (is_unsigned && v->get<uint64_t>() > static_cast<uint64_t>(hi))
      return fail("{}: '{}' is out of range", what_, name), fallback;
    const int64_t x = is_unsigned ? static_cast<int64_t>(v->get<uint64_t>()) : v->get<int64_t>();
    if (x < lo || x > hi) return fail("{}: '{}' must be in [{}, {}]", what_, name, lo, hi), fallback;
    return x;
  }
  double number(const char* name, double lo, double hi, bool required = true, double fallback = 0) {
    const json* v = field(name, required);
    if (!v) return fallback;
    if (!v->is_number()) return fail("{}: '{}' must be a number", what_, name), fallback;
    const double x = v->get<double>();
    if (!(x >= lo && x <= hi)) return fail("{}: '{}' must be in [{}, {}]", what_, name, lo, hi), fallback;
    return x;
  }
  bool boolean(const char* name, bool fallback = false) {
    const json* v = field(name, false);
    if (!v) return fallback;
    if (!v->is_boolean()) return fail("{}: '{}' must be a boolean", what_, name), fallback;
    return v->get<bool>();
  }
  std::string string(const char* name, size_t max_len, bool required = true) {
    const json* v = field(name, required);
    if (!v) return {};
    if (!v->is_string()) return fail("{}: '{}' must be a string", what_, name), std::string();
    if (v->get_ref<const std::string&>().size() > max_len)
      return fail("{}: '{}' is too long", what_, name), std::string();
    return v->get<std::string>();
  }
  std::vector<int32_t> ints(const char* name, size_t max_len, int64_t lo, int64_t hi, bool required = true) {
    std::vector<int32_t> out;
    const json* v = field(name, required);
    if (!v) return out;
    if (!v->is_array()) return fail("{}: '{}' must be an array", what_, name), out;
    if (v->size() > max_len) return fail("{}: '{}' has over {} entries", what_, name, max_len), out;
    out.reserve(v->size());
    for (const auto& x : *v) {
      if (!x.is_number_integer() || x.get<int64_t>() < lo || x.get<int64_t>() > hi)
        return fail("{}: '{}' must hold integers in [{}, {}]", what_, name, lo, hi), std::vector<int32_t>();
      out.push_back(static_cast<int32_t>(x.get<int64_t>()));
    }
    return out;
  }
  // Finite numbers (f32 values, as the engine keeps them).
  std::vector<float> floats(const char* name, size_t max_len) {
    std::vector<float> out;
    const json* v = field(name, false);
    if (!v) return out;
    if (!v->is_array()) return fail("{}: '{}' must be an array", what_, name), out;
    if (v->size() > max_len) return fail("{}: '{}' has over {} entries", what_, name, max_len), out;
    out.reserve(v->size());
    for (const auto& x : *v) {
      if (!x.is_number() || !(std::abs(x.get<double>()) <= std::numeric_limits<float>::max()))
        return fail("{}: '{}' must hold finite numbers", what_, name), std::vector<float>();
      out.push_back(static_cast<float>(x.get<double>()));
    }
    return out;
  }
  const json* object(const char* name, bool required = true) {
    const json* v = field(name, required);
    if (v && !v->is_object()) return fail("{}: '{}' must be an object", what_, name), nullptr;
    return v;
  }
  void merge(const Status& s) {
    if (status_.is_ok() && !s.is_ok()) status_ = s;
  }
  const Status& status() const { return status_; }

 private:
  const json& j_;
  std::string what_;
  Status status_;
};

Expected<json> parse_body(const std::string& body, const char* what) {
  if (body.size() > kMaxInternalBodyBytes)
    return out_of_range("{}: the body is over {} bytes", what, kMaxInternalBodyBytes);
  json j = json::parse(body, nullptr, false);
  if (j.is_discarded()) return invalid_argument("{}: the body is not valid JSON", what);
  return j;
}

constexpr int64_t kMaxTokenId = (int64_t{1} << 31) - 1;

GenerationSpec read_spec(Reader& r) {
  GenerationSpec s;
  s.request_id = r.string("request_id", 128);
  s.prompt = r.ints("prompt", kMaxPromptTokens, 0, kMaxTokenId);
  if (r.status().is_ok() && s.prompt.empty()) r.fail("'prompt' is empty");
  s.max_tokens = static_cast<int>(r.integer("max_tokens", 1, kMaxPromptTokens));
  s.sampling.temperature = static_cast<float>(r.number("temperature", 0, 1e6));
  s.sampling.top_p = static_cast<float>(r.number("top_p", 1e-9, 1));
  s.sampling.top_k = static_cast<int>(r.integer("top_k", 0, kMaxTokenId));
  s.sampling.min_p = static_cast<float>(r.number("min_p", 0, 1));
  const json* seed = r.field("seed", true);
  if (seed && !seed->is_number_unsigned() && !(seed->is_number_integer() && seed->get<int64_t>() >= 0))
    r.fail("'seed' must be a non-negative integer");
  else if (seed)
    s.sampling.seed = seed->get<uint64_t>();
  s.sampling.presence_penalty = static_cast<float>(r.number("presence_penalty", -2, 2, false, 0));
  s.sampling.frequency_penalty = static_cast<float>(r.number("frequency_penalty", -2, 2, false, 0));
  s.sampling.repetition_penalty = static_cast<float>(r.number("repetition_penalty", 1e-6, 2, false, 1));
  s.sampling.min_tokens = static_cast<int>(r.integer("min_tokens", 0, kMaxPromptTokens, false, 0));
  const std::vector<int32_t> bias_ids = r.ints("logit_bias_ids", 1 << 20, 0, kMaxTokenId, false);
  const std::vector<float> bias_values = r.floats("logit_bias_values", 1 << 20);
  if (r.status().is_ok() && bias_ids.size() != bias_values.size())
    r.fail("'logit_bias_ids' and 'logit_bias_values' differ in length");
  for (size_t i = 0; i < bias_ids.size() && i < bias_values.size(); ++i)
    s.sampling.logit_bias.emplace_back(bias_ids[i], bias_values[i]);
  // bad_words as their tokens end to end and each word's length.
  const std::vector<int32_t> bad_ids = r.ints("bad_words_ids", 1 << 20, 0, kMaxTokenId, false);
  const std::vector<int32_t> bad_lengths = r.ints("bad_words_lengths", 1 << 20, 1, kMaxTokenId, false);
  size_t bad_at = 0;
  for (int32_t n : bad_lengths) {
    if (static_cast<size_t>(n) > bad_ids.size() - bad_at) {
      r.fail("'bad_words_lengths' add up to more than 'bad_words_ids' holds");
      break;
    }
    s.sampling.bad_words.emplace_back(bad_ids.begin() + static_cast<std::ptrdiff_t>(bad_at),
                                      bad_ids.begin() + static_cast<std::ptrdiff_t>(bad_at + n));
    bad_at += static_cast<size_t>(n);
  }
  if (r.status().is_ok() && bad_at != bad_ids.size())
    r.fail("'bad_words_lengths' add up to less than 'bad_words_ids' holds");
  s.sampling.allowed_token_ids = r.ints("allowed_token_ids", 1 << 20, 0, kMaxTokenId, false);
  s.ignore_eos = r.boolean("ignore_eos");
  s.stop_token_ids = r.ints("stop_token_ids", 1024, 0, kMaxTokenId, false);
  s.num_logprobs = static_cast<int>(r.integer("num_logprobs", -1, 1 << 20, false, -1));
  s.num_prompt_logprobs = static_cast<int>(r.integer("num_prompt_logprobs", -1, 1 << 20, false, -1));
  s.timeout_s = r.number("timeout_s", 0, 1e7, false, 0);
  // The grammar as its source's text: an ordered document (a schema's
  // properties keep their order, which the output follows).
  const std::string grammar = r.string("grammar", kMaxInternalBodyBytes, false);
  if (!grammar.empty()) {
    const auto source = nlohmann::ordered_json::parse(grammar, nullptr, /*allow_exceptions=*/false);
    auto compiled = structured::Grammar::from_source(source);
    if (compiled) {
      s.grammar = *compiled;
    } else {
      r.fail("'grammar': {}", compiled.status().message());
    }
  }
  s.grammar_after_token = static_cast<int32_t>(r.integer("grammar_after_token", -1, kMaxTokenId, false, -1));
  return s;
}

const std::set<std::string> kSpecFields = {"request_id",
                                           "prompt",
                                           "max_tokens",
                                           "temperature",
                                           "top_p",
                                           "top_k",
                                           "min_p",
                                           "seed",
                                           "ignore_eos",
                                           "stop_token_ids",
                                           "num_logprobs",
                                           "num_prompt_logprobs",
                                           "timeout_s",
                                           "presence_penalty",
                                           "min_tokens",
                                           "logit_bias_ids",
                                           "logit_bias_values",
                                           "bad_words_ids",
                                           "bad_words_lengths",
                                           "allowed_token_ids",
                                           "frequency_penalty",
                                           "repetition_penalty",
                                           "grammar",
                                           "grammar_after_token"};

std::set<std::string> with_spec(std::set<std::string> more) {
  more.insert(kSpecFields.begin(), kSpecFields.end());
  return more;
}

json logprobs_json(const engine::TokenLogprobs& lp) {
  json top = json::array();
  for (const auto& [id, p] : lp.top) top.push_back({id, p});
  return {{"token", lp.token}, {"logprob", lp.logprob}, {"rank", lp.rank}, {"top", top}};
}

Expected<engine::TokenLogprobs> parse_logprobs(const json& j) {
  if (!j.is_object() || !j.contains("token") || !j["token"].is_number_integer() || !j.contains("logprob") ||
      !j["logprob"].is_number() || !j.contains("top") || !j["top"].is_array() || j["top"].size() > 4096)
    return invalid_argument("'logprobs' is malformed");
  engine::TokenLogprobs lp;
  lp.token = j["token"].get<int32_t>();
  lp.logprob = j["logprob"].get<float>();
  if (j.contains("rank")) {
    if (!j["rank"].is_number_integer() || j["rank"].get<int64_t>() < 0 ||
        j["rank"].get<int64_t>() > kMaxTokenId)
      return invalid_argument("'logprobs.rank' is malformed");
    lp.rank = j["rank"].get<int32_t>();
  }
  for (const auto& e : j["top"]) {
    if (!e.is_array() || e.size() != 2 || !e[0].is_number_integer() || !e[1].is_number())
      return invalid_argument("'logprobs.top' is malformed");
    lp.top.emplace_back(e[0].get<int32_t>(), e[1].get<float>());
  }
  return lp;
}

}  // namespace

StatusCode status_code_from_name(const std::string& name) {
  for (int c = 0; c <= static_cast<int>(StatusCode::kInternal); ++c)
    if (name == status_code_name(static_cast<StatusCode>(c))) return static_cast<StatusCode>(c);
  return StatusCode::kInternal;
}

json to_json(const GenerationSpec& s) {
  json j = {{"request_id", s.request_id},     {"prompt", s.prompt},
            {"max_tokens", s.max_tokens},     {"temperature", s.sampling.temperature},
            {"top_p", s.sampling.top_p},      {"top_k", s.sampling.top_k},
            {"min_p", s.sampling.min_p},      {"seed", s.sampling.seed.value_or(0)},
            {"ignore_eos", s.ignore_eos},     {"stop_token_ids", s.stop_token_ids},
            {"num_logprobs", s.num_logprobs}, {"timeout_s", s.timeout_s}};
  if (s.num_prompt_logprobs >= 0) j["num_prompt_logprobs"] = s.num_prompt_logprobs;
  const engine::SamplingParams& sampling = s.sampling;
  if (sampling.presence_penalty != 0) j["presence_penalty"] = sampling.presence_penalty;
  if (sampling.frequency_penalty != 0) j["frequency_penalty"] = sampling.frequency_penalty;
  if (sampling.repetition_penalty != 1) j["repetition_penalty"] = sampling.repetition_penalty;
  if (sampling.min_tokens != 0) j["min_tokens"] = sampling.min_tokens;
  if (s.grammar) j["grammar"] = s.grammar->source().dump();
  if (s.grammar_after_token >= 0) j["grammar_after_token"] = s.grammar_after_token;
  if (!sampling.logit_bias.empty()) {
    json ids = json::array(), values = json::array();
    for (const auto& [id, bias] : sampling.logit_bias) ids.push_back(id), values.push_back(bias);
    j["logit_bias_ids"] = ids;
    j["logit_bias_values"] = values;
  }
  if (!sampling.bad_words.empty()) {
    json ids = json::array(), lengths = json::array();
    for (const auto& word : sampling.bad_words) {
      for (int32_t id : word) ids.push_back(id);
      lengths.push_back(word.size());
    }
    j["bad_words_ids"] = ids;
    j["bad_words_lengths"] = lengths;
  }
  if (!sampling.allowed_token_ids.empty()) j["allowed_token_ids"] = sampling.allowed_token_ids;
  return j;
}

json to_json(const KvTarget& t) {
  json k = json::array(), v = json::array();
  for (const auto& d : t.k_regions) k.push_back(d.to_json());
  for (const auto& d : t.v_regions) v.push_back(d.to_json());
  return {{"decode_url", t.decode_url},
          {"reservation", t.reservation},
          {"pages", t.pages},
          {"num_layers", t.layout.num_layers},
          {"num_kv_heads", t.layout.num_kv_heads},
          {"head_dim", t.layout.head_dim},
          {"page_size", t.layout.page_size},
          {"dtype", dtype_name(t.layout.dtype)},
          {"num_mtp_layers", t.layout.num_mtp_layers},
          {"k_regions", k},
          {"v_regions", v}};
}

Expected<KvTarget> parse_kv_target(const json& j) {
  Reader r(j, "target",
           {"decode_url", "reservation", "pages", "num_layers", "num_kv_heads", "head_dim", "page_size",
            "dtype", "num_mtp_layers", "k_regions", "v_regions"});
  KvTarget t;
  t.decode_url = r.string("decode_url", 256);
  t.reservation = static_cast<uint32_t>(r.integer("reservation", 1, UINT32_MAX));
  t.pages = r.ints("pages", kMaxPromptTokens, 0, kMaxTokenId);
  t.layout.num_layers = static_cast<int>(r.integer("num_layers", 1, 4096));
  t.layout.num_kv_heads = static_cast<int>(r.integer("num_kv_heads", 1, 4096));
  t.layout.head_dim = static_cast<int>(r.integer("head_dim", 1, 65536));
  t.layout.page_size = static_cast<int>(r.integer("page_size", 1, 1024));
  const std::string dtype = r.string("dtype", 16);
  t.layout.num_mtp_layers = static_cast<int>(r.integer("num_mtp_layers", 0, 1, false, 0));
  MOE_RETURN_IF_ERROR(r.status());
  auto d = dtype_from_name(dtype);
  if (!d) return invalid_argument("target: unknown dtype '{}'", dtype);
  t.layout.dtype = *d;
  const int num_regions = t.layout.num_layers + t.layout.num_mtp_layers;
  for (const char* name : {"k_regions", "v_regions"}) {
    const json& regions = j[name];
    if (!regions.is_array() || static_cast<int>(regions.size()) != num_regions)
      return invalid_argument("target: '{}' must hold one region per layer (and the MTP layer's)", name);
    for (const auto& region : regions) {
      MOE_ASSIGN_OR_RETURN(auto desc, transfer::RegionDescriptor::from_json(region));
      (std::string(name) == "k_regions" ? t.k_regions : t.v_regions).push_back(std::move(desc));
    }
  }
  return t;
}

json to_json(const DecodeRequest& r) {
  json j = to_json(r.spec);
  j["writer_url"] = r.writer_url;
  j["writer_endpoint"] = r.writer_endpoint;
  j["lease_s"] = r.lease_s;
  return j;
}

Expected<DecodeRequest> parse_decode_request(const std::string& body) {
  MOE_ASSIGN_OR_RETURN(json j, parse_body(body, "decode request"));
  Reader r(j, "decode request", with_spec({"writer_url", "writer_endpoint", "lease_s"}));
  DecodeRequest d;
  d.spec = read_spec(r);
  d.writer_url = r.string("writer_url", 256);
  d.writer_endpoint = r.string("writer_endpoint", 256);
  d.lease_s = r.number("lease_s", 0, 1e6, false, 0);
  MOE_RETURN_IF_ERROR(r.status());
  return d;
}

json to_json(const PrefillRequest& r) {
  json j = to_json(r.spec);
  j["target"] = to_json(r.target);
  return j;
}

Expected<PrefillRequest> parse_prefill_request(const std::string& body) {
  MOE_ASSIGN_OR_RETURN(json j, parse_body(body, "prefill request"));
  Reader r(j, "prefill request", with_spec({"target"}));
  PrefillRequest p;
  p.spec = read_spec(r);
  const json* target = r.object("target");
  MOE_RETURN_IF_ERROR(r.status());
  MOE_ASSIGN_OR_RETURN(p.target, parse_kv_target(*target));
  if (static_cast<int64_t>(p.target.pages.size()) * p.target.layout.page_size <
      static_cast<int64_t>(p.spec.prompt.size()))
    return invalid_argument("target: {} pages cannot hold {} prompt tokens", p.target.pages.size(),
                            p.spec.prompt.size());
  return p;
}

json to_json(const PrefillResult& r) {
  json j = {{"first_token", r.first_token}, {"stop", r.stop}};
  j["logprobs"] = r.logprobs ? logprobs_json(*r.logprobs) : json(nullptr);
  if (!r.prompt_logprobs.empty()) {
    json prompt = json::array();
    for (const auto& lp : r.prompt_logprobs) prompt.push_back(logprobs_json(lp));
    j["prompt_logprobs"] = std::move(prompt);
  }
  return j;
}

Expected<PrefillResult> parse_prefill_result(const std::string& body) {
  MOE_ASSIGN_OR_RETURN(json j, parse_body(body, "prefill result"));
  Reader r(j, "prefill result", {"first_token", "stop", "logprobs", "prompt_logprobs"});
  PrefillResult p;
  p.first_token = static_cast<int32_t>(r.integer("first_token", 0, kMaxTokenId));
  p.stop = r.boolean("stop");
  MOE_RETURN_IF_ERROR(r.status());
  if (j.contains("logprobs") && !j["logprobs"].is_null()) {
    MOE_ASSIGN_OR_RETURN(p.logprobs, parse_logprobs(j["logprobs"]));
  }
  if (j.contains("prompt_logprobs")) {
    const json& prompt = j["prompt_logprobs"];
    if (!prompt.is_array() || prompt.size() > static_cast<size_t>(kMaxPromptTokens))
      return invalid_argument("'prompt_logprobs' is malformed");
    for (const auto& e : prompt) {
      MOE_ASSIGN_OR_RETURN(engine::TokenLogprobs lp, parse_logprobs(e));
      p.prompt_logprobs.push_back(std::move(lp));
    }
  }
  return p;
}

json to_json(const CommitRequest& r) {
  json j = {{"reservation", r.reservation},
            {"expected_batches", r.expected_batches},
            {"first_token", r.first_token}};
  if (!r.last_hidden.empty()) j["last_hidden"] = r.last_hidden;  // shortest round-trip decimals: exact f32
  return j;
}

Expected<CommitRequest> parse_commit_request(const std::string& body) {
  MOE_ASSIGN_OR_RETURN(json j, parse_body(body, "commit"));
  Reader r(j, "commit", {"reservation", "expected_batches", "first_token", "last_hidden"});
  CommitRequest c;
  c.reservation = static_cast<uint32_t>(r.integer("reservation", 1, UINT32_MAX));
  c.expected_batches = static_cast<uint64_t>(r.integer("expected_batches", 0, 1 << 30));
  c.first_token = static_cast<int32_t>(r.integer("first_token", 0, kMaxTokenId));
  c.last_hidden = r.floats("last_hidden", kMaxHiddenSize);
  MOE_RETURN_IF_ERROR(r.status());
  return c;
}

json to_json(const AbortRequest& r) {
  json j = {{"reservation", r.reservation}, {"decode_endpoint", r.decode_endpoint}, {"reason", r.reason}};
  if (r.stop) j["stop"] = true;
  return j;
}

Expected<AbortRequest> parse_abort_request(const std::string& body) {
  MOE_ASSIGN_OR_RETURN(json j, parse_body(body, "abort"));
  Reader r(j, "abort", {"reservation", "decode_endpoint", "reason", "stop"});
  AbortRequest a;
  a.reservation = static_cast<uint32_t>(r.integer("reservation", 1, UINT32_MAX));
  a.decode_endpoint = r.string("decode_endpoint", 256, false);
  a.reason = r.string("reason", 256, false);
  a.stop = r.boolean("stop");
  MOE_RETURN_IF_ERROR(r.status());
  return a;
}

json to_json(const TokenEvent& e) {
  json j = {{"token", e.token}, {"finish", engine::finish_reason_name(e.finish)}};
  if (e.logprobs) j["logprobs"] = logprobs_json(*e.logprobs);
  if (e.num_draft_tokens > 0) {
    j["draft_tokens"] = e.num_draft_tokens;
    j["accepted_tokens"] = e.num_accepted_draft_tokens;
  }
  if (!e.error.is_ok())
    j["error"] = {{"code", status_code_name(e.error.code())}, {"message", e.error.message()}};
  return j;
}

Expected<TokenEvent> parse_token_event(const json& j) {
  Reader r(j, "token event", {"token", "finish", "logprobs", "error", "draft_tokens", "accepted_tokens"});
  TokenEvent e;
  e.token = static_cast<int32_t>(r.integer("token", -1, kMaxTokenId));
  const std::string finish = r.string("finish", 16);
  e.num_draft_tokens = static_cast<int>(r.integer("draft_tokens", 0, kMaxTokenId, false, 0));
  e.num_accepted_draft_tokens = static_cast<int>(r.integer("accepted_tokens", 0, e.num_draft_tokens, false, 0));
  MOE_RETURN_IF_ERROR(r.status());
  if (finish == "stop")
    e.finish = engine::FinishReason::kStop;
  else if (finish == "length")
    e.finish = engine::FinishReason::kLength;
  else if (finish == "abort")
    e.finish = engine::FinishReason::kAbort;
  else if (!finish.empty())
    return invalid_argument("token event: unknown finish '{}'", finish.substr(0, 16));
  if (j.contains("logprobs")) {
    MOE_ASSIGN_OR_RETURN(e.logprobs, parse_logprobs(j["logprobs"]));
  }
  if (j.contains("error")) {
    const json& err = j["error"];
    if (!err.is_object() || !err.contains("code") || !err["code"].is_string() || !err.contains("message") ||
        !err["message"].is_string())
      return invalid_argument("token event: 'error' is malformed");
    e.error =
        Status(status_code_from_name(err["code"].get<std::string>()), err["message"].get<std::string>());
    if (e.error.is_ok()) e.error = internal_error("{}", err["message"].get<std::string>());
  }
  return e;
}

json to_json(const InstanceLoad& l) {
  return {{"role", l.role},
          {"transfer_endpoint", l.transfer_endpoint},
          {"kv_usage", l.kv_usage},
          {"num_running", l.num_running},
          {"num_waiting", l.num_waiting},
          {"max_num_seqs", l.max_num_seqs},
          {"pending_prompt_tokens", l.pending_prompt_tokens},
          {"prompt_tokens_total", l.prompt_tokens_total},
          {"busy_seconds_total", l.busy_seconds_total},
          {"num_reservations", l.num_reservations},
          {"max_model_len", l.max_model_len}};
}

Expected<InstanceLoad> parse_instance_load(const std::string& body) {
  MOE_ASSIGN_OR_RETURN(json j, parse_body(body, "load"));
  Reader r(j, "load",
           {"role", "transfer_endpoint", "kv_usage", "num_running", "num_waiting", "max_num_seqs",
            "pending_prompt_tokens", "prompt_tokens_total", "busy_seconds_total", "num_reservations",
            "max_model_len"});
  InstanceLoad l;
  l.role = r.string("role", 16);
  l.transfer_endpoint = r.string("transfer_endpoint", 256);
  l.kv_usage = r.number("kv_usage", 0, 1);
  l.num_running = static_cast<int>(r.integer("num_running", 0, 1 << 30));
  l.num_waiting = static_cast<int>(r.integer("num_waiting", 0, 1 << 30));
  l.max_num_seqs = static_cast<int>(r.integer("max_num_seqs", 0, 1 << 30));
  l.pending_prompt_tokens = r.integer("pending_prompt_tokens", 0, int64_t{1} << 50);
  l.prompt_tokens_total = r.integer("prompt_tokens_total", 0, int64_t{1} << 62);
  l.busy_seconds_total = r.number("busy_seconds_total", 0, 1e12);
  l.num_reservations = r.integer("num_reservations", 0, int64_t{1} << 40);
  l.max_model_len = static_cast<int>(r.integer("max_model_len", 1, INT32_MAX));
  MOE_RETURN_IF_ERROR(r.status());
  if (l.role != "prefill" && l.role != "decode") return invalid_argument("load: unknown role '{}'", l.role);
  return l;
}

InstanceLoad engine_load(const std::string& role, const engine::Engine& engine,
                         const transfer::TransferEngine& transfer) {
  const engine::EngineMetrics m = engine.metrics();
  InstanceLoad l;
  l.role = role;
  l.transfer_endpoint = transfer.endpoint();
  l.kv_usage = m.kv_cache_usage_perc;
  l.num_running = m.num_requests_running;
  l.num_waiting = m.num_requests_waiting;
  l.max_num_seqs = engine.options().scheduler.max_num_seqs;
  l.max_model_len = engine.options().scheduler.max_model_len;
  l.prompt_tokens_total = m.prompt_tokens_total;
  l.busy_seconds_total = m.busy_seconds_total;
  return l;
}

Expected<transfer::RegionId> register_kv_pool(transfer::TransferEngine& transfer, const TensorView& pool) {
  if (pool.device().kind != DeviceKind::kCuda)
    return transfer.register_region(const_cast<void*>(pool.data()), pool.num_bytes());
  auto id = transfer.register_region(const_cast<void*>(pool.data()), pool.num_bytes(), transfer::MemoryKind::kDevice,
                                     pool.device().index);
  if (!id) return id.status().with_context("the KV cache is in GPU memory, which only the CUDA IPC transport sends");
  return id;
}

engine::EngineRequest to_engine_request(const GenerationSpec& s) {
  engine::EngineRequest r;
  r.prompt = s.prompt;
  r.max_tokens = s.max_tokens;
  r.sampling = s.sampling;
  r.ignore_eos = s.ignore_eos;
  r.stop_token_ids = s.stop_token_ids;
  r.num_logprobs = s.num_logprobs;
  r.num_prompt_logprobs = s.num_prompt_logprobs;
  r.timeout_s = s.timeout_s;
  r.grammar = s.grammar;
  r.grammar_after_token = s.grammar_after_token;
  return r;
}

HttpResponse json_reply(int status, const json& body) { return {status, "application/json", body.dump(), {}}; }

HttpResponse error_reply(const Status& s) {
  int status = 500;
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange:
      status = 400;
      break;
    case StatusCode::kNotFound:
      status = 404;
      break;
    case StatusCode::kAborted:
      status = 409;
      break;
    case StatusCode::kResourceExhausted:
    case StatusCode::kUnavailable:
      status = 503;
      break;
    case StatusCode::kDeadlineExceeded:
      status = 504;
      break;
    default:
      break;
  }
  return {status, "application/json", error_json(s.message(), status_code_name(s.code())), {}};
}

}  // namespace moe::server::disagg
