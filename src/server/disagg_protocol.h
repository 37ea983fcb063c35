// The internal messages of disaggregated serving (docs/disagg.md): plain JSON
// objects, each field checked for type and range and unknown fields refused,
// so a truncated, oversized or hostile message is an error naming the field,
// never undefined behaviour. Nothing here executes or deserialises objects.
//
//   router -> decode  POST /internal/decode   DecodeRequest, answered by SSE:
//                                              a ReservedEvent, then TokenEvents
//   router -> prefill POST /internal/prefill  PrefillRequest -> PrefillResult
//   prefill -> decode POST /internal/commit   CommitRequest -> {"state": ...}
//   router -> decode  POST /internal/abort    AbortRequest (reservation) -> ack
//   decode -> prefill POST /internal/abort    AbortRequest (writer side) -> ack once no write can land
//   any -> instance   GET /internal/load      InstanceLoad (also the health check)
//
// Pure functions: any thread.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"
#include "engine/engine.h"
#include "server/http_server.h"
#include "transfer/transfer_engine.h"

namespace moe::server::disagg {

inline constexpr size_t kMaxInternalBodyBytes = 8 << 20;
inline constexpr int kMaxPromptTokens = 1 << 20;
inline constexpr size_t kMaxHiddenSize = 1 << 16;  // CommitRequest::last_hidden

// What the generation needs, shared by the decode and prefill requests.
struct GenerationSpec {
  std::string request_id;
  std::vector<int32_t> prompt;
  int max_tokens = 1;
  engine::SamplingParams sampling;  // the seed is always set (the router draws one)
  bool ignore_eos = false;
  std::vector<int32_t> stop_token_ids;
  int num_logprobs = -1;
  int num_prompt_logprobs = -1;  // computed by the prefill instance, sent back with the first token
  double timeout_s = 0;
  // Structured output: the grammar (sent as its source, compiled again by
  // the receiver) and EngineRequest::grammar_after_token.
  std::shared_ptr<const structured::Grammar> grammar;
  int32_t grammar_after_token = -1;
};

struct KvLayout {
  int num_layers = 0, num_kv_heads = 0, head_dim = 0, page_size = 0;
  DType dtype = DType::kF32;
  // Speculative decoding: 1 when the decode instance has an MTP layer, whose
  // KV (the same heads, head_dim, page size and dtype, the same page ids)
  // travels as one more layer after the model's: its regions come last.
  int num_mtp_layers = 0;
};

// Where the prefill instance writes: a reservation on a decode instance.
struct KvTarget {
  std::string decode_url;    // control endpoint, for the commit
  uint32_t reservation = 0;  // also the imm of every write
  std::vector<int32_t> pages;
  KvLayout layout;
  std::vector<transfer::RegionDescriptor> k_regions, v_regions;  // per layer, then the MTP layer's
};

struct DecodeRequest {
  GenerationSpec spec;
  std::string writer_url;       // the prefill instance's control endpoint
  std::string writer_endpoint;  // its TransferEngine endpoint
  double lease_s = 0;           // 0: the decode instance's default
};

struct PrefillRequest {
  GenerationSpec spec;
  KvTarget target;
};

struct PrefillResult {
  int32_t first_token = -1;
  bool stop = false;  // the first token is eos or a stop token id
  std::optional<engine::TokenLogprobs> logprobs;
  // spec.num_prompt_logprobs >= 0: the logprobs of prompt tokens 1 .. n-1.
  std::vector<engine::TokenLogprobs> prompt_logprobs;
};

struct CommitRequest {
  uint32_t reservation = 0;
  uint64_t expected_batches = 0;  // one per layer, + 1 when the MTP layer was sent
  int32_t first_token = -1;
  // With the MTP layer: the target's hidden state at the prompt's last
  // position (engine::PrefilledPrompt::last_hidden); empty otherwise.
  std::vector<float> last_hidden;
};

struct AbortRequest {
  uint32_t reservation = 0;
  std::string decode_endpoint;  // writer side: which decode instance's imm (its TransferEngine endpoint)
  std::string reason;
  // Decode side, a running sequence: the router's stop string ended it, so it
  // finishes as "stop", not "abort" (the instance's request_success_total).
  bool stop = false;
};

// One event of the decode stream after the reservation.
struct TokenEvent {
  int32_t token = -1;  // -1: none (a final event)
  std::optional<engine::TokenLogprobs> logprobs;
  engine::FinishReason finish = engine::FinishReason::kNone;
  Status error;
  // Speculative decoding, so far in the request (engine::EngineOutput's).
  int num_draft_tokens = 0, num_accepted_draft_tokens = 0;
};

struct InstanceLoad {
  std::string role;  // "prefill" or "decode"
  std::string transfer_endpoint;
  double kv_usage = 0;
  int num_running = 0, num_waiting = 0, max_num_seqs = 0;
  int64_t pending_prompt_tokens = 0;  // prefill: queued and running prompt tokens
  int64_t prompt_tokens_total = 0;    // computed so far (the router reads the prefill instances')
  double busy_seconds_total = 0;      // time in forward passes
  int64_t num_reservations = 0;       // decode
  int max_model_len = 0;              // the instance's limit (the router's must not exceed it)
};

// The fields every role reports from its engine and TransferEngine.
InstanceLoad engine_load(const std::string& role, const engine::Engine& engine,
                         const transfer::TransferEngine& transfer);

// One KV pool (a layer's K or V pages) as a TransferEngine region: device
// memory (the CUDA runner's pool) goes to the CUDA IPC transport, host memory
// to TCP (the CPU never reads or writes device pools).
Expected<transfer::RegionId> register_kv_pool(transfer::TransferEngine& transfer, const TensorView& pool);

nlohmann::json to_json(const GenerationSpec& spec);
nlohmann::json to_json(const KvTarget& target);
nlohmann::json to_json(const DecodeRequest& r);
nlohmann::json to_json(const PrefillRequest& r);
nlohmann::json to_json(const PrefillResult& r);
nlohmann::json to_json(const CommitRequest& r);
nlohmann::json to_json(const AbortRequest& r);
nlohmann::json to_json(const TokenEvent& e);
nlohmann::json to_json(const InstanceLoad& l);

Expected<DecodeRequest> parse_decode_request(const std::string& body);
Expected<PrefillRequest> parse_prefill_request(const std::string& body);
Expected<PrefillResult> parse_prefill_result(const std::string& body);
Expected<CommitRequest> parse_commit_request(const std::string& body);
Expected<AbortRequest> parse_abort_request(const std::string& body);
Expected<TokenEvent> parse_token_event(const nlohmann::json& j);
Expected<KvTarget> parse_kv_target(const nlohmann::json& j);
Expected<InstanceLoad> parse_instance_load(const std::string& body);

// The engine's request for a spec (the decode side's full request; the
// prefill side caps max_tokens at 1 itself).
engine::EngineRequest to_engine_request(const GenerationSpec& spec);
// Status codes travel as names ("kUnavailable" -> its code); an unknown name is kInternal.
StatusCode status_code_from_name(const std::string& name);

// Replies of the internal endpoints: a JSON body, or an error in the public
// API's shape with the status its code maps to (400, 404, 409, 503, 504,
// else 500).
HttpResponse json_reply(int status, const nlohmann::json& body);
HttpResponse error_reply(const Status& s);

}  // namespace moe::server::disagg
