#include "server/router.h"

#include <algorithm>
#include <limits>
#include <random>

#include "core/logging.h"
#include "server/disagg_protocol.h"
#include "server/http_client.h"

namespace moe::server {

using nlohmann::json;

namespace {

// The message of an instance's JSON error body, or the body's start.
std::string error_message(const std::string& body) {
  json j = json::parse(body, nullptr, false);
  if (j.is_object() && j.contains("error") && j["error"].is_object() && j["error"].contains("message") &&
      j["error"]["message"].is_string())
    return j["error"]["message"].get<std::string>();
  return body.substr(0, 200);
}

Status status_of_http(int http_status, const std::string& body) {
  const std::string message = error_message(body);
  switch (http_status) {
    case 400:
    case 404:
    case 409:
      return invalid_argument("{}", message);
    case 503:
      return unavailable("{}", message);
    case 504:
      return deadline_exceeded("{}", message);
    default:
      return internal_error("HTTP {}: {}", http_status, message);
  }
}

// Gives a chosen instance back to the pool when the attempt ends.
struct LeaseGuard {
  RouterPool& pool;
  std::optional<InstanceLease> lease;
  ~LeaseGuard() {
    if (lease) pool.done(*lease);
  }
};

}  // namespace

class Router::Job {
 public:
  Job(Router& router, uint64_t id, engine::EngineRequest request, engine::OutputCallback on_output,
      std::string request_id)
      : router_(router),
        id_(id),
        request_(std::move(request)),
        on_output_(std::move(on_output)),
        request_id_(std::move(request_id)),
        arrival_s_(engine::monotonic_seconds()) {}

  void run();
  void cancel(engine::FinishReason finish = engine::FinishReason::kAbort) {
    // A stop string cut by the CompletionRun while this job's thread emits a
    // decode token: once emit() returns, the job has the decode instance end
    // the sequence as stopped (stream_decode), then closes the stream.
    if (finish == engine::FinishReason::kStop && std::this_thread::get_id() == runner_ && streaming_) {
      stop_requested_ = true;
      return;
    }
    cancelled_ = true;
    std::lock_guard lock(mutex_);
    for (auto* call : {decode_call_.get(), prefill_call_.get()})
      if (call) call->abort();
  }
  std::thread thread;

 private:
  enum class Outcome { kDone, kRetry };
  Outcome attempt(const disagg::GenerationSpec& spec, std::set<std::string>& excluded, int attempt_index);
  Outcome stream_decode(HttpCall& decode, const std::string& decode_url, uint32_t reservation);
  std::shared_ptr<HttpCall> new_call(std::shared_ptr<HttpCall>& slot) {
    auto call = std::make_shared<HttpCall>();
    std::lock_guard lock(mutex_);
    slot = call;
    if (cancelled_) call->abort();
    return call;
  }
  double remaining_s() const { return std::max(0.0, deadline_s_ - engine::monotonic_seconds()); }
  // The final output for a failed call: cancelled, past the deadline, or `error`.
  void fail(const Status& error);
  void emit(int32_t token, std::optional<engine::TokenLogprobs> logprobs, engine::FinishReason finish,
            Status error = {}, std::vector<engine::TokenLogprobs> prompt_logprobs = {});
  // Tells the decode instance to drop `reservation` (or, `stop`, to end its
  // running sequence as stopped).
  void abort_reservation(const std::string& decode_url, uint32_t reservation, bool stop = false);

  Router& router_;
  const uint64_t id_;
  engine::EngineRequest request_;
  engine::OutputCallback on_output_;
  const std::string request_id_;
  const double arrival_s_;
  double deadline_s_ = std::numeric_limits<double>::infinity();
  int num_output_tokens_ = 0;
  int num_draft_tokens_ = 0, num_accepted_draft_tokens_ = 0;  // the decode instance's, so far
  bool finished_ = false;
  std::atomic<bool> cancelled_{false};
  std::atomic<std::thread::id> runner_{};  // the thread in run()
  bool streaming_ = false;                 // in stream_decode (runner only)
  bool stop_requested_ = false;            // cancel(kStop) from within emit() (runner only)
  std::mutex mutex_;  // guards the call slots
  std::shared_ptr<HttpCall> decode_call_, prefill_call_;
};

void Router::Job::emit(int32_t token, std::optional<engine::TokenLogprobs> logprobs,
                       engine::FinishReason finish, Status error,
                       std::vector<engine::TokenLogprobs> prompt_logprobs) {
  if (finished_) return;
  engine::EngineOutput out;
  out.id = id_;
  out.token = token;
  out.logprobs = std::move(logprobs);
  out.prompt_logprobs = std::move(prompt_logprobs);
  out.finish = finish;
  out.error = std::move(error);
  if (!out.error.is_ok()) out.finish = engine::FinishReason::kAbort;
  if (token >= 0) ++num_output_tokens_;
  out.num_prompt_tokens = static_cast<int>(request_.prompt.size());
  out.num_output_tokens = num_output_tokens_;
  out.num_draft_tokens = num_draft_tokens_;
  out.num_accepted_draft_tokens = num_accepted_draft_tokens_;
  finished_ = out.finish != engine::FinishReason::kNone;
  try {
    on_output_(out);
  } catch (const std::exception& e) {
    log_error("router: the output callback of request {} threw: {}", request_id_, e.what());
  }
}

void Router::Job::fail(const Status& error) {
  if (cancelled_) return emit(-1, {}, engine::FinishReason::kAbort);
  if (engine::monotonic_seconds() >= deadline_s_) {
    ++router_.num_deadline_;
    return emit(-1, {}, engine::FinishReason::kAbort,
                deadline_exceeded("the request ran past its deadline of {} s", request_.timeout_s));
  }
  ++router_.num_failed_;
  emit(-1, {}, engine::FinishReason::kAbort, error);
}

void Router::Job::abort_reservation(const std::string& decode_url, uint32_t reservation, bool stop) {
  auto url = HttpUrl::parse(decode_url);
  if (!url) return;
  disagg::AbortRequest msg{reservation, "", stop ? "a stop string" : "the prefill failed", stop};
  auto reply = http_call(*url, "POST", "/internal/abort", disagg::to_json(msg).dump(), 2.0,
                         {{"X-Request-Id", request_id_}});
  if (!reply || reply->status != 200)
    log_warn("router: abort of reservation {} on {} not acknowledged: {}", reservation, decode_url,
             reply ? fmt::format("HTTP {}", reply->status) : reply.status().to_string());
}

void Router::Job::run() {
  runner_ = std::this_thread::get_id();
  if (request_.timeout_s > 0) deadline_s_ = arrival_s_ + request_.timeout_s;
  if (!request_.sampling.seed)
    request_.sampling.seed = std::random_device{}();  // prefill and decode draw alike
  disagg::GenerationSpec spec;
  spec.request_id = request_id_;
  spec.prompt = request_.prompt;
  spec.max_tokens = request_.max_tokens;
  spec.sampling = request_.sampling;
  spec.ignore_eos = request_.ignore_eos;
  spec.stop_token_ids = request_.stop_token_ids;
  spec.num_logprobs = request_.num_logprobs;
  spec.num_prompt_logprobs = request_.num_prompt_logprobs;
  spec.grammar = request_.grammar;
  spec.grammar_after_token = request_.grammar_after_token;
  std::set<std::string> excluded;
  for (int i = 0; i <= router_.options_.max_prefill_retries && !finished_; ++i) {
    if (i > 0) ++router_.num_retries_;
    spec.timeout_s = request_.timeout_s > 0 ? std::max(remaining_s(), 1e-3) : 0;
    if (attempt(spec, excluded, i) == Outcome::kDone) return;
  }
  if (!finished_) fail(unavailable("the prefill failed on {} instance(s)", excluded.size()));
}

Router::Job::Outcome Router::Job::attempt(const disagg::GenerationSpec& spec, std::set<std::string>& excluded,
                                          int attempt_index) {
  if (cancelled_ || remaining_s() <= 0) return fail(aborted("cancelled")), Outcome::kDone;
  LeaseGuard decode{router_.pool_, router_.pool_.pick_decode()};
  if (!decode.lease) return fail(unavailable("no healthy decode instance")), Outcome::kDone;
  LeaseGuard prefill{router_.pool_,
                     router_.pool_.pick_prefill(static_cast<int64_t>(spec.prompt.size()), excluded)};
  if (!prefill.lease) return fail(unavailable("no healthy prefill instance")), Outcome::kDone;
  const std::vector<std::pair<std::string, std::string>> headers = {{"X-Request-Id", request_id_}};
  const std::string& d_url = decode.lease->url;
  const std::string& p_url = prefill.lease->url;

  // (1) reserve: the decode stream's first event is the reservation.
  auto d_call = new_call(decode_call_);
  disagg::DecodeRequest dreq{spec, p_url, prefill.lease->transfer_endpoint, router_.options_.lease_s};
  Status s = d_call->send(*HttpUrl::parse(d_url), "POST", "/internal/decode", disagg::to_json(dreq).dump(),
                          headers, std::min(remaining_s(), router_.options_.connect_timeout_s));
  auto d_status = s.is_ok() ? d_call->read_head(remaining_s()) : Expected<int>(s);
  if (!d_status) {
    if (cancelled_ || remaining_s() <= 0) return fail(d_status.status()), Outcome::kDone;
    router_.pool_.report_failure(d_url, d_status.status());
    return Outcome::kRetry;
  }
  if (*d_status != 200) {
    auto body = d_call->read_body(std::min(remaining_s(), 5.0));
    return fail(status_of_http(*d_status, body ? *body : "")), Outcome::kDone;
  }
  auto first = d_call->next_event(remaining_s());
  json reserved = first && *first ? json::parse(**first, nullptr, false) : json();
  auto target = reserved.is_object() && reserved.contains("reserved")
                    ? disagg::parse_kv_target(reserved["reserved"])
                    : Expected<disagg::KvTarget>(unavailable("no reservation"));
  if (!target) return fail(first ? target.status() : first.status()), Outcome::kDone;

  // (2) prefill with the reservation as target; the answer is the first token.
  auto p_call = new_call(prefill_call_);
  disagg::PrefillRequest preq{spec, *target};
  s = p_call->send(*HttpUrl::parse(p_url), "POST", "/internal/prefill", disagg::to_json(preq).dump(), headers,
                   std::min(remaining_s(), router_.options_.connect_timeout_s));
  auto p_status = s.is_ok() ? p_call->read_head(remaining_s()) : Expected<int>(s);
  auto p_body = p_status ? p_call->read_body(remaining_s()) : Expected<std::string>(p_status.status());
  const bool retry = !p_body || *p_status >= 500;
  if (retry && !cancelled_ && remaining_s() > 0) {
    const Status why = p_body ? status_of_http(*p_status, *p_body) : p_body.status();
    log_warn("router: request {}: prefill on {} failed (attempt {}): {}", request_id_, p_url,
             attempt_index + 1, why.to_string());
    if (!p_body) router_.pool_.report_failure(p_url, why);
    excluded.insert(p_url);
    abort_reservation(d_url, target->reservation);
    d_call->abort();
    return Outcome::kRetry;
  }
  if (!p_body) return fail(p_body.status()), Outcome::kDone;
  if (*p_status != 200) return fail(status_of_http(*p_status, *p_body)), Outcome::kDone;
  router_.pool_.done(*prefill.lease);  // its pending tokens are computed
  prefill.lease.reset();
  auto result = disagg::parse_prefill_result(*p_body);
  if (!result) return fail(result.status()), Outcome::kDone;
  engine::FinishReason finish = engine::FinishReason::kNone;
  if (result->stop)
    finish = engine::FinishReason::kStop;
  else if (spec.max_tokens <= 1 ||
           static_cast<int64_t>(spec.prompt.size()) + 1 >= router_.options_.max_model_len)
    finish = engine::FinishReason::kLength;
  if (spec.num_prompt_logprobs >= 0 && result->prompt_logprobs.size() + 1 != spec.prompt.size())
    return fail(internal_error("the prefill instance sent {} prompt logprobs for a {}-token prompt",
                               result->prompt_logprobs.size(), spec.prompt.size())),
           Outcome::kDone;
  emit(result->first_token, result->logprobs, finish, {}, std::move(result->prompt_logprobs));
  if (finished_) {
    d_call->abort();  // the decode instance frees the reservation
    return Outcome::kDone;
  }
  // (3) the rest comes from the decode instance.
  return stream_decode(*d_call, d_url, target->reservation);
}

Router::Job::Outcome Router::Job::stream_decode(HttpCall& decode, const std::string& decode_url,
                                                uint32_t reservation) {
  streaming_ = true;
  while (!finished_) {
    auto event = decode.next_event(remaining_s());
    if (!event || !*event) {
      const Status why = event ? unavailable("the decode stream ended early") : event.status();
      if (!cancelled_ && remaining_s() > 0) ++router_.num_decode_lost_;
      fail(unavailable("the decode instance was lost: {}", why.message()));
      return Outcome::kDone;
    }
    json j = json::parse(**event, nullptr, false);
    auto token = disagg::parse_token_event(j);
    if (!token) {
      fail(internal_error("bad event from the decode instance: {}", token.status().message()));
      return Outcome::kDone;
    }
    if (!token->error.is_ok()) {
      fail(token->error);
      return Outcome::kDone;
    }
    num_draft_tokens_ = std::max(num_draft_tokens_, token->num_draft_tokens);
    num_accepted_draft_tokens_ = std::max(num_accepted_draft_tokens_, token->num_accepted_draft_tokens);
    emit(token->token, token->logprobs, token->finish);
    if (stop_requested_ && !finished_) {
      // The sequence is counted as stopped on the decode instance, then the stream closes
      // (the decode instance's cancel for the close comes second and changes nothing).
      abort_reservation(decode_url, reservation, /*stop=*/true);
      finished_ = true;
      decode.abort();
    }
  }
  return Outcome::kDone;
}

Router::Router(RouterOptions options) : options_(std::move(options)), pool_(options_.pool) {}

Router::~Router() { shutdown(); }

void Router::shutdown() {
  std::vector<std::shared_ptr<Job>> jobs;
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
    for (auto& [id, job] : jobs_) jobs.push_back(job);
  }
  for (auto& job : jobs) job->cancel();
  while (true) {
    {
      std::lock_guard lock(mutex_);
      if (jobs_.empty()) break;
    }
    std::this_thread::sleep_for(
        std::chrono::milliseconds(5));  // workers end promptly once their calls are cut
  }
  reap();
}

void Router::reap() {
  std::vector<std::thread> done;
  {
    std::lock_guard lock(mutex_);
    done.swap(finished_);
  }
  for (auto& t : done) t.join();
}

Expected<uint64_t> Router::submit(engine::EngineRequest request, engine::OutputCallback on_output,
                                  const std::string& request_id) {
  reap();
  if (request.prompt.empty()) return invalid_argument("the prompt is empty");
  for (int32_t id : request.prompt)
    if (id < 0 || id >= options_.vocab_size)
      return invalid_argument("token id {} is outside the vocabulary [0, {})", id, options_.vocab_size);
  if (request.max_tokens < 1)
    return invalid_argument("max_tokens must be at least 1, got {}", request.max_tokens);
  MOE_RETURN_IF_ERROR(engine::validate_sampling(request.sampling, options_.vocab_size));
  if (!pool_.has_healthy(InstanceRole::kDecode)) return unavailable("no healthy decode instance");
  if (!pool_.has_healthy(InstanceRole::kPrefill)) return unavailable("no healthy prefill instance");
  pool_.count_input_tokens(static_cast<int64_t>(request.prompt.size()));
  ++num_requests_;
  std::lock_guard lock(mutex_);
  if (stopping_) return unavailable("the router is shutting down");
  const uint64_t id = next_id_++;
  auto job = std::make_shared<Job>(*this, id, std::move(request), std::move(on_output), request_id);
  jobs_[id] = job;
  job->thread = std::thread([this, job, id] {
    job->run();
    std::lock_guard lock(mutex_);
    finished_.push_back(std::move(job->thread));
    jobs_.erase(id);
  });
  return id;
}

void Router::cancel(uint64_t id, engine::FinishReason finish) {
  std::shared_ptr<Job> job;
  {
    std::lock_guard lock(mutex_);
    auto it = jobs_.find(id);
    if (it == jobs_.end()) return;
    job = it->second;
  }
  job->cancel(finish);
}

bool Router::healthy() const {
  return pool_.has_healthy(InstanceRole::kDecode) && pool_.has_healthy(InstanceRole::kPrefill);
}

bool Router::handle_internal(const HttpRequest& request, const std::shared_ptr<HttpExchange>& exchange) {
  if (request.path != "/internal/register") return false;
  auto reply = [&](int status, const std::string& body) {
    exchange->respond({status, "application/json", body, {}});
  };
  if (!options_.api_key.empty() && request.header("authorization") != "Bearer " + options_.api_key)
    return reply(401,
                 error_json("Incorrect API key provided.", "invalid_request_error", "", "invalid_api_key")),
           true;
  if (request.method != "POST") return reply(405, error_json("use POST", "invalid_request_error")), true;
  json j = json::parse(request.body, nullptr, false);
  const bool has_limit = j.is_object() && j.contains("max_model_len");
  if (!j.is_object() || !j.contains("role") || !j["role"].is_string() || !j.contains("url") ||
      !j["url"].is_string() || (has_limit && !j["max_model_len"].is_number_integer()) ||
      j.size() != (has_limit ? 3u : 2u))
    return reply(400, error_json("expected {\"role\": \"prefill\"|\"decode\", \"url\": \"http://host:port\", "
                                 "\"max_model_len\": N (optional)}",
                                 "invalid_request_error")),
           true;
  const std::string role = j["role"].get<std::string>();
  if (role != "prefill" && role != "decode")
    return reply(400, error_json("'role' must be prefill or decode", "invalid_request_error", "role")), true;
  // The router admits requests up to its own max_model_len (and gives
  // requests without max_tokens the rest of it): an instance with a lower
  // limit would refuse them.
  if (has_limit) {
    const int64_t limit = j["max_model_len"].get<int64_t>();
    if (Status s = check_max_model_len(limit, options_.max_model_len); !s.is_ok())
      return reply(400, error_json("the instance: " + s.message(), "invalid_request_error", "max_model_len")), true;
    if (limit > options_.max_model_len)
      log_warn("router: the {} instance {} serves max_model_len {}; this router admits at most {} (--max-model-len)",
               role, j["url"].get<std::string>(), limit, options_.max_model_len);
  }
  Status s = pool_.add(role == "prefill" ? InstanceRole::kPrefill : InstanceRole::kDecode,
                       j["url"].get<std::string>());
  if (!s.is_ok()) return reply(400, error_json(s.message(), "invalid_request_error", "url")), true;
  log_info("router: registered {} instance {}", role, j["url"].get<std::string>());
  reply(200, json{{"registered", true}}.dump());
  return true;
}

std::string Router::metrics_text(const std::string& model_name) const {
  std::string out = pool_.metrics_text();
  const auto counter = [&](const char* name, const char* help, int64_t value) {
    out += fmt::format(
        "# HELP moeserve:{} {}\n# TYPE moeserve:{} counter\nmoeserve:{}{{model_name=\"{}\"}} {}\n", name,
        help, name, name, model_name, value);
  };
  counter("router_requests_total", "Generation requests (choices) accepted by the router.", num_requests_);
  counter("router_prefill_retries_total", "Prefill attempts retried on another instance.", num_retries_);
  counter("router_failed_total", "Requests that ended with an error.", num_failed_);
  counter("router_decode_lost_total", "Requests whose decode instance was lost mid-stream.",
          num_decode_lost_);
  counter("router_deadline_total", "Requests that ran past their deadline.", num_deadline_);
  return out;
}

}  // namespace moe::server
