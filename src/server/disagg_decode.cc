#include "server/disagg_decode.h"

#include <random>

#include "core/check.h"
#include "core/logging.h"
#include "server/http_client.h"
#include "server/metrics_text.h"

namespace moe::server {

using nlohmann::json;
using disagg::error_reply;
using disagg::json_reply;

DecodeService::DecodeService(engine::Engine& engine, transfer::TransferEngine& transfer,
                             DecodeServiceOptions options)
    : engine_(engine),
      transfer_(transfer),
      options_(std::move(options)),
      // Random first id: imm values of two decode instances rarely meet at one prefill instance.
      table_(static_cast<uint32_t>(std::random_device{}())),
      worker_([this] { tick(); }, 0.1) {}

Expected<std::unique_ptr<DecodeService>> DecodeService::create(engine::Engine& engine,
                                                               transfer::TransferEngine& transfer,
                                                               const kv::KvCache& cache,
                                                               DecodeServiceOptions options) {
  std::unique_ptr<DecodeService> s(new DecodeService(engine, transfer, std::move(options)));
  const kv::KvCacheLayout& l = cache.layout();
  const kv::KvCache* mtp = engine.mtp_cache();
  s->layout_ = {l.num_layers, l.num_kv_heads, l.head_dim, l.page_size, l.dtype, mtp ? 1 : 0};
  if (mtp) {
    const kv::KvCacheLayout& m = mtp->layout();
    CHECK(m.num_kv_heads == l.num_kv_heads && m.head_dim == l.head_dim && m.page_size == l.page_size &&
              m.dtype == l.dtype && m.num_pages == l.num_pages,
          "the MTP layer's KV cache is laid out as a model layer's");
  }
  for (int layer = 0; layer < l.num_layers + s->layout_.num_mtp_layers; ++layer) {
    const ops::PagedKv kv = layer < l.num_layers ? cache.layer(layer) : mtp->layer(0);  // the MTP layer last
    for (const TensorView* pool : {&kv.k_pages, &kv.v_pages}) {
      MOE_ASSIGN_OR_RETURN(transfer::RegionId id, disagg::register_kv_pool(transfer, *pool));
      MOE_ASSIGN_OR_RETURN(transfer::RegionDescriptor desc, transfer.describe(id));
      (pool == &kv.k_pages ? s->k_regions_ : s->v_regions_).push_back(id);
      (pool == &kv.k_pages ? s->k_descs_ : s->v_descs_).push_back(std::move(desc));
    }
  }
  log_info("decode: KV of {} layers in {} (page size {}, {}), written by prefill instances over {}", l.num_layers,
           cache.on_device() ? fmt::format("the memory of GPU {}", cache.device().index) : std::string("host memory"),
           l.page_size, dtype_name(l.dtype), transfer::transport_name(s->k_descs_.at(0).transport));
  DecodeService* self = s.get();
  transfer.set_completion_callback(
      [self](uint32_t imm, uint64_t) { self->worker_.post([self, imm] { self->check_landed(imm); }); });
  transfer.set_peer_lost_callback([self](const std::string& peer, const Status&) {
    self->worker_.post([self, peer] { self->on_writer_lost(peer); });
  });
  return s;
}

DecodeService::~DecodeService() {
  transfer_.set_completion_callback({});
  transfer_.set_peer_lost_callback({});
  worker_.stop();
  notifier_.stop();
}

void DecodeService::handle(HttpRequest request, std::shared_ptr<HttpExchange> exchange) {
  const std::string& path = request.path;
  if (path == "/health") return exchange->respond({engine_.healthy() ? 200 : 503, "text/plain", "", {}});
  if (path == "/metrics") return exchange->respond({200, "text/plain; version=0.0.4", metrics_text(), {}});
  if (path == "/internal/load") return exchange->respond(json_reply(200, to_json(load())));
  if (path != "/internal/decode" && path != "/internal/commit" && path != "/internal/abort")
    return exchange->respond(
        {404, "application/json", error_json("no route for " + path, "not_found_error"), {}});
  if (request.method != "POST")
    return exchange->respond(
        {405, "application/json", error_json("use POST for " + path, "invalid_request_error"), {}});
  if (path == "/internal/decode") return handle_decode(request, exchange);
  exchange->respond(path == "/internal/commit" ? handle_commit(request) : handle_abort(request));
}

void DecodeService::handle_decode(const HttpRequest& request, const std::shared_ptr<HttpExchange>& exchange) {
  auto parsed = disagg::parse_decode_request(request.body);
  if (!parsed) {
    ++num_rejected_;
    return exchange->respond(error_reply(parsed.status()));
  }
  for (int32_t id : parsed->spec.prompt)
    if (id >= engine_.vocab_size()) {
      ++num_rejected_;
      return exchange->respond(error_reply(invalid_argument("token id {} is outside the vocabulary", id)));
    }
  const auto num_tokens = static_cast<int32_t>(parsed->spec.prompt.size());
  const int max_model_len = engine_.options().scheduler.max_model_len;
  if (static_cast<int64_t>(num_tokens) + parsed->spec.max_tokens > max_model_len) {
    ++num_rejected_;
    return exchange->respond(
        error_reply(invalid_argument("prompt ({} tokens) + max_tokens ({}) is over max_model_len {}",
                                     num_tokens, parsed->spec.max_tokens, max_model_len)));
  }
  engine_.reserve(num_tokens, [this, request = std::move(parsed).value(),
                               exchange](Expected<std::vector<int32_t>> pages) mutable {
    worker_.post([this, request = std::move(request), exchange, pages = std::move(pages)]() mutable {
      on_reserved(std::move(request), std::move(exchange), std::move(pages));
    });
  });
}

void DecodeService::on_reserved(disagg::DecodeRequest request, std::shared_ptr<HttpExchange> exchange,
                                Expected<std::vector<int32_t>> pages) {
  if (!pages) return exchange->respond(error_reply(pages.status()));
  const double lease_s = request.lease_s > 0 ? request.lease_s : options_.default_lease_s;
  std::lock_guard lock(mutex_);
  const engine::Reservation& r = table_.create(request.spec.request_id, *pages, request.writer_endpoint,
                                               engine::monotonic_seconds(), lease_s);
  const uint32_t id = r.id;
  if (Status s = transfer_.arm(id, request.writer_endpoint); !s.is_ok()) {
    (void)table_.abort(id, "arm failed");
    (void)table_.release(id);
    engine_.release(std::move(pages).value());
    return exchange->respond(error_reply(s));
  }
  disagg::KvTarget target;
  target.decode_url = options_.self_url;
  target.reservation = id;
  target.pages = *pages;
  target.layout = layout_;
  target.k_regions = k_descs_;
  target.v_regions = v_descs_;
  exchange->start_events(200, {{"X-Request-Id", request.spec.request_id}});
  exchange->send_event(json{{"reserved", disagg::to_json(target)}}.dump());
  streams_[id] = Stream{std::move(request), exchange};
  exchange->on_close([this, id] { worker_.post([this, id] { on_stream_closed(id); }); });
  log_debug("decode: reservation {} ({} pages) for request {}", id, pages->size(),
            streams_[id].request.spec.request_id);
}

HttpResponse DecodeService::handle_commit(const HttpRequest& request) {
  auto commit = disagg::parse_commit_request(request.body);
  if (!commit) return ++num_rejected_, error_reply(commit.status());
  if (commit->first_token >= engine_.vocab_size())
    return ++num_rejected_,
           error_reply(invalid_argument("first token {} is outside the vocabulary", commit->first_token));
  // One batch per layer; the MTP layer's batch and the hidden state come together or not at all.
  const auto num_layers = static_cast<uint64_t>(layout_.num_layers);
  const bool with_mtp = layout_.num_mtp_layers > 0 && commit->expected_batches == num_layers + 1;
  Status shape;
  if (commit->expected_batches != num_layers && !with_mtp)
    shape = invalid_argument("commit: {} batches, the plan sends one per layer ({}{})", commit->expected_batches,
                             num_layers, layout_.num_mtp_layers > 0 ? ", + 1 with the MTP layer" : "");
  else if (with_mtp && static_cast<int64_t>(commit->last_hidden.size()) != engine_.mtp_hidden_size())
    shape = invalid_argument("commit: the MTP layer came with {} hidden-state values, not {}",
                             commit->last_hidden.size(), engine_.mtp_hidden_size());
  else if (!with_mtp && !commit->last_hidden.empty())
    shape = invalid_argument("commit: 'last_hidden' without the MTP layer's batch");
  {
    std::lock_guard lock(mutex_);
    const engine::Reservation* r = table_.find(commit->reservation);
    if (r && !shape.is_ok()) return ++num_rejected_, error_reply(shape);
    Status s = table_.commit(commit->reservation, commit->expected_batches, commit->first_token,
                             std::move(commit->last_hidden));
    if (!s.is_ok()) return ++num_rejected_, error_reply(s);
    auto it = streams_.find(commit->reservation);
    const bool would_draft = it != streams_.end() && it->second.request.spec.max_tokens > 1;
    if (layout_.num_mtp_layers > 0 && !with_mtp && would_draft) ++num_commits_without_mtp_;
  }
  ++num_commits_;
  const uint32_t id = commit->reservation;
  worker_.post([this, id] { check_landed(id); });
  return json_reply(200, {{"state", "committed"}});
}

void DecodeService::check_landed(uint32_t id) {
  bool ready = false;
  {
    std::lock_guard lock(mutex_);
    const engine::Reservation* r = table_.find(id);
    if (!r || r->state != engine::ReservationState::kCommitted) return;
    ready = transfer_.poll_imm(id).num_completed >= r->expected_batches;
  }
  if (ready) activate(id);
}

void DecodeService::activate(uint32_t id) {
  std::lock_guard lock(mutex_);
  auto r = table_.activate(id);
  if (!r) return;
  (void)transfer_.disarm(id);  // every expected batch is stored; nothing more may land
  ++num_activated_;
  auto it = streams_.find(id);
  if (it == streams_.end()) {  // cannot happen: a closed stream aborts first
    engine_.release(std::move(r->pages));
    return;
  }
  engine::EngineRequest request = disagg::to_engine_request(it->second.request.spec);
  request.num_prompt_logprobs = -1;  // the prefill instance computed them
  engine::PrefilledPrompt prompt{r->pages, r->first_token, std::move(r->last_hidden)};
  auto engine_id = engine_.submit_prefilled(
      std::move(request), std::move(prompt), [this, id](const engine::EngineOutput& out) {
        disagg::TokenEvent event{out.token,        out.logprobs,         out.finish,
                                 out.error,        out.num_draft_tokens, out.num_accepted_draft_tokens};
        std::lock_guard lock(mutex_);
        auto it = streams_.find(id);
        if (it == streams_.end()) return;
        if (out.finish == engine::FinishReason::kNone) {
          it->second.exchange->send_event(disagg::to_json(event).dump());
          return;
        }
        end_stream(id, event);
      });
  if (!engine_id) {
    engine_.release(std::move(r->pages));
    end_stream(id, disagg::TokenEvent{-1, {}, engine::FinishReason::kAbort, engine_id.status()});
    return;
  }
  it->second.engine_id = *engine_id;
}

void DecodeService::end_stream(uint32_t id, const disagg::TokenEvent& last) {
  auto it = streams_.find(id);
  if (it == streams_.end()) return;
  if (!it->second.ended) {
    it->second.exchange->send_event(disagg::to_json(last).dump());
    it->second.exchange->end_events();
  }
  streams_.erase(it);
}

HttpResponse DecodeService::handle_abort(const HttpRequest& request) {
  auto abort = disagg::parse_abort_request(request.body);
  if (!abort) return ++num_rejected_, error_reply(abort.status());
  const uint32_t id = abort->reservation;
  std::lock_guard lock(mutex_);
  if (table_.find(id)) {
    worker_.post(
        [this, id, reason = abort->reason.empty() ? std::string("aborted by the router") : abort->reason] {
          start_abort(id, reason);
        });
    return json_reply(200, {{"state", "aborting"}});
  }
  auto it = streams_.find(id);
  if (it == streams_.end()) return ++num_rejected_, error_reply(not_found("no reservation {}", id));
  if (it->second.engine_id != 0)
    engine_.cancel(it->second.engine_id, abort->stop ? engine::FinishReason::kStop : engine::FinishReason::kAbort);
  return json_reply(200, {{"state", "cancelled"}});
}

void DecodeService::start_abort(uint32_t id, const std::string& reason) {
  std::string writer_url;
  {
    std::lock_guard lock(mutex_);
    auto started = table_.abort(id, reason);
    if (!started || !*started) return;
    ++num_aborts_;
    auto it = streams_.find(id);
    if (it != streams_.end()) {
      writer_url = it->second.request.writer_url;
      end_stream(id,
                 {-1, {}, engine::FinishReason::kAbort, aborted("the KV transfer was aborted: {}", reason)});
    }
  }
  log_info("decode: reservation {} aborting ({}); waiting for its writer to stop", id, reason);
  if (writer_url.empty()) return release(id, "no writer to notify");
  notifier_.post([this, id, writer_url] { notify_writer(id, writer_url, 0); });
}

// Runs on the notifier: tells the writer to stop and waits for its
// acknowledgement. The pages are released only then, or once the writer is
// gone (connection refused, peer lost); otherwise it tries again.
void DecodeService::notify_writer(uint32_t id, std::string writer_url, int attempt) {
  {
    std::lock_guard lock(mutex_);
    if (!table_.find(id)) return;  // released meanwhile (writer lost)
  }
  auto url = HttpUrl::parse(writer_url);
  const std::string reason = attempt == 0 ? "aborted" : "aborted (retry)";
  disagg::AbortRequest msg{id, transfer_.endpoint(), reason};
  auto reply = url ? http_call(*url, "POST", "/internal/abort", disagg::to_json(msg).dump(),
                               options_.writer_ack_timeout_s)
                   : Expected<HttpClientResponse>(url.status());
  const bool acked = reply && (reply->status == 200 || reply->status == 404);
  const bool gone = !reply && reply.status().code() == StatusCode::kUnavailable;
  if (acked || gone) {
    worker_.post([this, id, gone] { release(id, gone ? "writer gone" : "writer acknowledged"); });
    return;
  }
  log_warn("decode: the writer of reservation {} did not acknowledge the abort ({}); pages stay held", id,
           reply ? fmt::format("HTTP {}", reply->status) : reply.status().to_string());
  notifier_.post_after(std::min(5.0, 0.25 * (1 << std::min(attempt, 4))),
                       [this, id, writer_url, attempt] { notify_writer(id, writer_url, attempt + 1); });
}

void DecodeService::release(uint32_t id, const char* why) {
  std::lock_guard lock(mutex_);
  auto r = table_.release(id);
  if (!r) return;
  (void)transfer_.disarm(id);
  ++num_released_;
  log_info("decode: reservation {} released ({}): {} pages free again", id, why, r->pages.size());
  engine_.release(std::move(r->pages));
}

void DecodeService::on_writer_lost(const std::string& endpoint) {
  std::lock_guard lock(mutex_);
  for (engine::Reservation& r : table_.writer_lost(endpoint)) {
    (void)transfer_.disarm(r.id);
    ++num_writer_lost_;
    ++num_released_;
    log_warn("decode: writer {} lost: reservation {} released", endpoint, r.id);
    end_stream(
        r.id,
        {-1, {}, engine::FinishReason::kAbort, unavailable("the prefill instance {} was lost", endpoint)});
    engine_.release(std::move(r.pages));
  }
}

void DecodeService::on_stream_closed(uint32_t id) {
  bool reserved = false;
  {
    std::lock_guard lock(mutex_);
    auto it = streams_.find(id);
    if (it != streams_.end()) {
      it->second.ended = true;
      if (it->second.engine_id != 0) engine_.cancel(it->second.engine_id);
    }
    reserved = table_.find(id) != nullptr;
  }
  if (reserved) start_abort(id, "the router closed the stream");
}

void DecodeService::tick() {
  std::vector<uint32_t> expired;
  {
    std::lock_guard lock(mutex_);
    expired = table_.expire(engine::monotonic_seconds());
  }
  for (uint32_t id : expired) {
    ++num_lease_expired_;
    // expire() marked them aborting: notify as start_abort would.
    std::string writer_url;
    {
      std::lock_guard lock(mutex_);
      ++num_aborts_;
      auto it = streams_.find(id);
      if (it != streams_.end()) {
        writer_url = it->second.request.writer_url;
        end_stream(
            id, {-1, {}, engine::FinishReason::kAbort, deadline_exceeded("the KV transfer lease expired")});
      }
    }
    log_warn("decode: the lease of reservation {} expired; waiting for its writer to stop", id);
    if (writer_url.empty())
      release(id, "no writer to notify");
    else
      notifier_.post([this, id, writer_url] { notify_writer(id, writer_url, 0); });
  }
}

disagg::InstanceLoad DecodeService::load() const {
  disagg::InstanceLoad l = disagg::engine_load("decode", engine_, transfer_);
  std::lock_guard lock(mutex_);
  l.num_reservations = static_cast<int64_t>(table_.size());
  return l;
}

std::string DecodeService::metrics_text() const {
  std::string out = render_metrics(engine_.metrics(), options_.model_name);
  const std::string label = fmt::format("model_name=\"{}\"", options_.model_name);
  int64_t reservations = 0, reserved_pages = 0;
  {
    std::lock_guard lock(mutex_);
    reservations = static_cast<int64_t>(table_.size());
    reserved_pages = table_.num_pages();
  }
  const auto counter = [&](const char* name, const char* help, int64_t value) {
    out += fmt::format("# HELP moeserve:{} {}\n# TYPE moeserve:{} counter\nmoeserve:{}{{{}}} {}\n", name,
                       help, name, name, label, value);
  };
  out += fmt::format(
      "# HELP moeserve:disagg_reservations KV reservations held (reserved, committed or aborting).\n"
      "# TYPE moeserve:disagg_reservations gauge\nmoeserve:disagg_reservations{{{}}} {}\n"
      "# HELP moeserve:disagg_reserved_pages KV pages held by reservations.\n"
      "# TYPE moeserve:disagg_reserved_pages gauge\nmoeserve:disagg_reserved_pages{{{}}} {}\n",
      label, reservations, label, reserved_pages);
  if (!k_descs_.empty())
    out += fmt::format(
        "# HELP moeserve:disagg_kv_transport_info Where this instance's KV is and how it arrives.\n"
        "# TYPE moeserve:disagg_kv_transport_info gauge\n"
        "moeserve:disagg_kv_transport_info{{{},memory=\"{}\",transport=\"{}\"}} 1\n",
        label, transfer::memory_kind_name(k_descs_[0].memory), transfer::transport_name(k_descs_[0].transport));
  counter("disagg_commits_total", "Commits received from prefill instances.", num_commits_);
  counter("disagg_activated_total", "Reservations whose writes all landed, now decoding.", num_activated_);
  counter("disagg_aborts_total", "Reservations aborted (router, stream closed, lease expiry).", num_aborts_);
  counter("disagg_lease_expired_total", "Reservations whose lease expired before their writes landed.",
          num_lease_expired_);
  counter("disagg_writer_lost_total",
          "Reservations released because their writer's connection was torn down.", num_writer_lost_);
  counter("disagg_released_total", "Aborted reservations whose pages were freed after the writer stopped.",
          num_released_);
  counter("disagg_rejected_messages_total",
          "Internal messages refused (malformed, unknown ids, wrong state).", num_rejected_);
  if (layout_.num_mtp_layers > 0)
    counter("disagg_commits_without_mtp_total",
            "Commits of requests that could draft (max_tokens over 1) without the MTP state (a "
            "prefill instance without the MTP layer): they decode without drafts.",
            num_commits_without_mtp_);
  return out;
}

}  // namespace moe::server
