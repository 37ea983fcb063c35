#include "server/disagg_prefill.h"

#include <fmt/ranges.h>

#include "core/logging.h"
#include "server/http_client.h"
#include "server/metrics_text.h"
#include "transfer/kv_plan.h"

namespace moe::server {

using nlohmann::json;
using disagg::error_reply;
using disagg::json_reply;

// Sends each layer's KV of one prompt once the forward pass has written it
// for the whole prompt: one TransferEngine batch per layer, imm = the
// reservation. Called on the engine thread; submits only (never blocks).
// With `with_mtp` the engine's MTP layer follows as one more batch (the
// decode instance's last regions), and its hidden state goes with the commit.
class PrefillService::Exporter final : public engine::KvExportSink {
 public:
  Exporter(transfer::TransferEngine& transfer, const PrefillService& service, disagg::KvTarget target,
           int32_t num_prompt_tokens, bool with_mtp)
      : transfer_(transfer),
        service_(service),
        target_(std::move(target)),
        num_prompt_tokens_(num_prompt_tokens),
        with_mtp_(with_mtp) {}

  bool wants_mtp() const override { return with_mtp_; }

  // The MTP layer's cache holds every k/v head on this rank (the drafter
  // runs whole on the leader), so its plan is a single rank's.
  void on_mtp_written(int32_t num_tokens, std::span<const int32_t> pages,
                      std::span<const float> last_hidden) override {
    std::lock_guard lock(mutex_);
    if (!error_.is_ok() || !with_mtp_ || num_tokens != num_prompt_tokens_) return;
    const auto& src = service_.layout_;
    const transfer::KvSideLayout src_side{src.num_kv_heads, src.head_dim, src.page_size, src.dtype, 1, 0};
    const auto& d = target_.layout;
    const transfer::KvSideLayout dst_side{d.num_kv_heads, d.head_dim, d.page_size, d.dtype, 1, 0};
    const size_t num_src_pages = static_cast<size_t>((num_tokens + src.page_size - 1) / src.page_size);
    auto plan = transfer::KvTransferPlan::build(src_side, 0, dst_side,
                                                pages.subspan(0, std::min(num_src_pages, pages.size())),
                                                target_.pages, num_tokens);
    if (!plan) return void(error_ = plan.status());
    const size_t l = static_cast<size_t>(d.num_layers);  // the MTP layer's regions follow the model's
    const transfer::KvLayerRemote dst{target_.k_regions[l], 0, target_.v_regions[l], 0};
    const transfer::KvLayerRegions from{*service_.mtp_k_region_, 0, *service_.mtp_v_region_, 0};
    auto id = transfer_.submit_scattered(plan->layer_writes(from, dst), target_.reservation);
    if (!id) return void(error_ = id.status());
    batches_.push_back(*id);
    num_bytes_ += plan->bytes_per_layer();
    last_hidden_.assign(last_hidden.begin(), last_hidden.end());
  }

  void on_layer_written(int layer, int32_t start, int32_t num_tokens,
                        std::span<const int32_t> pages) override {
    std::lock_guard lock(mutex_);
    if (!error_.is_ok() || start + num_tokens < num_prompt_tokens_)
      return;  // sent with the prompt's last chunk
    if (plans_.empty() && !(error_ = build_plans(pages)).is_ok()) return;
    // Every rank's heads of this layer in one batch (the ranks share page ids).
    const size_t l = static_cast<size_t>(layer);
    const transfer::KvLayerRemote dst{target_.k_regions[l], 0, target_.v_regions[l], 0};
    std::vector<transfer::RegionRuns> groups;
    uint64_t bytes = 0;
    for (size_t rank = 0; rank < plans_.size(); ++rank) {
      if (!plans_[rank].is_writer()) continue;  // a replica of heads another rank sends
      const transfer::KvLayerRegions src{service_.k_regions_[rank][l], 0, service_.v_regions_[rank][l], 0};
      for (auto& g : plans_[rank].layer_writes(src, dst)) groups.push_back(std::move(g));
      bytes += plans_[rank].bytes_per_layer();
    }
    auto id = transfer_.submit_scattered(groups, target_.reservation);
    if (!id) return void(error_ = id.status());
    batches_.push_back(*id);
    num_bytes_ += bytes;
  }

  Status build_plans(std::span<const int32_t> pages) {
    const auto& src = service_.layout_;
    const transfer::KvSideLayout src_side{src.num_kv_heads, src.head_dim, src.page_size, src.dtype,
                                          service_.tp_size_, 0};
    const auto& d = target_.layout;
    const transfer::KvSideLayout dst_side{d.num_kv_heads, d.head_dim, d.page_size, d.dtype, 1, 0};
    const size_t num_src_pages = static_cast<size_t>((num_prompt_tokens_ + src.page_size - 1) / src.page_size);
    for (int rank = 0; rank < service_.tp_size_; ++rank) {
      MOE_ASSIGN_OR_RETURN(auto plan, transfer::KvTransferPlan::build(
                                          src_side, rank, dst_side,
                                          pages.subspan(0, std::min(num_src_pages, pages.size())),
                                          target_.pages, num_prompt_tokens_));
      plans_.push_back(std::move(plan));
    }
    return Status::ok();
  }

  // The engine keeps the prompt's pages until the batches reading them are
  // done here: release_pages() (the service calls it then) gives them back.
  void on_finished(std::function<void()> release) override {
    std::unique_lock lock(mutex_);
    if (!sent_) {
      release_ = std::move(release);
      return;
    }
    lock.unlock();
    release();
  }
  void release_pages() {
    std::function<void()> release;
    {
      std::lock_guard lock(mutex_);
      sent_ = true;
      release.swap(release_);
    }
    if (release) release();
  }

  Status error() const {
    std::lock_guard lock(mutex_);
    return error_;
  }
  uint64_t num_batches() const {
    std::lock_guard lock(mutex_);
    return batches_.size();
  }
  uint64_t num_bytes() const {  // of the batches submitted so far
    std::lock_guard lock(mutex_);
    return num_bytes_;
  }
  std::vector<transfer::TransferId> batches() const {
    std::lock_guard lock(mutex_);
    return batches_;
  }
  const disagg::KvTarget& target() const { return target_; }
  // Set once the MTP layer was submitted (the commit carries it); else empty.
  std::vector<float> last_hidden() const {
    std::lock_guard lock(mutex_);
    return last_hidden_;
  }

 private:
  transfer::TransferEngine& transfer_;
  const PrefillService& service_;
  const disagg::KvTarget target_;
  const int32_t num_prompt_tokens_;
  const bool with_mtp_;
  mutable std::mutex mutex_;
  std::vector<transfer::KvTransferPlan> plans_;  // one per rank
  std::vector<transfer::TransferId> batches_;
  uint64_t num_bytes_ = 0;
  std::vector<float> last_hidden_;
  Status error_;
  std::function<void()> release_;  // from the engine, until the batches are done
  bool sent_ = false;              // every batch is done: release at once
};

PrefillService::PrefillService(engine::Engine& engine, transfer::TransferEngine& transfer,
                               PrefillServiceOptions options)
    : engine_(engine), transfer_(transfer), options_(std::move(options)) {}

Expected<std::unique_ptr<PrefillService>> PrefillService::create(engine::Engine& engine,
                                                                 transfer::TransferEngine& transfer,
                                                                 std::vector<const kv::KvCache*> rank_caches,
                                                                 int num_kv_heads, PrefillServiceOptions options) {
  if (rank_caches.empty()) return invalid_argument("a prefill instance needs its KV cache");
  std::unique_ptr<PrefillService> s(new PrefillService(engine, transfer, std::move(options)));
  const kv::KvCacheLayout& l = rank_caches[0]->layout();
  s->layout_ = {l.num_layers, num_kv_heads, l.head_dim, l.page_size, l.dtype};
  s->tp_size_ = static_cast<int>(rank_caches.size());
  for (const kv::KvCache* cache : rank_caches) {
    s->k_regions_.emplace_back();
    s->v_regions_.emplace_back();
    for (int layer = 0; layer < l.num_layers; ++layer) {
      const ops::PagedKv kv = cache->layer(layer);
      MOE_ASSIGN_OR_RETURN(auto k, disagg::register_kv_pool(transfer, kv.k_pages));
      MOE_ASSIGN_OR_RETURN(auto v, disagg::register_kv_pool(transfer, kv.v_pages));
      s->k_regions_.back().push_back(k);
      s->v_regions_.back().push_back(v);
    }
  }
  s->kv_on_device_ = rank_caches[0]->on_device();
  MOE_ASSIGN_OR_RETURN(const transfer::RegionDescriptor first, transfer.describe(s->k_regions_[0][0]));
  s->kv_transport_ = transfer::transport_name(first.transport);
  std::string where = s->kv_on_device_ ? fmt::format("the memory of GPU {}", rank_caches[0]->device().index)
                                       : std::string("host memory");
  if (s->tp_size_ > 1) {
    std::vector<std::string> gpus;
    for (const kv::KvCache* cache : rank_caches) gpus.push_back(std::to_string(cache->device().index));
    where = s->kv_on_device_ ? fmt::format("the memory of GPUs {} ({} ranks, heads split)",
                                           fmt::join(gpus, ","), s->tp_size_)
                             : fmt::format("host memory ({} ranks, heads split)", s->tp_size_);
  }
  log_info("prefill: KV of {} layers in {} (page size {}, {}), sent with the {} transport", l.num_layers,
           where, l.page_size, dtype_name(l.dtype), s->kv_transport_);
  if (const kv::KvCache* mtp = engine.mtp_cache()) {
    const ops::PagedKv kv = mtp->layer(0);
    MOE_ASSIGN_OR_RETURN(s->mtp_k_region_, disagg::register_kv_pool(transfer, kv.k_pages));
    MOE_ASSIGN_OR_RETURN(s->mtp_v_region_, disagg::register_kv_pool(transfer, kv.v_pages));
  }
  return s;
}

PrefillService::~PrefillService() {
  worker_.stop();
}

void PrefillService::handle(HttpRequest request, std::shared_ptr<HttpExchange> exchange) {
  const std::string& path = request.path;
  if (path == "/health") return exchange->respond({engine_.healthy() ? 200 : 503, "text/plain", "", {}});
  if (path == "/metrics") return exchange->respond({200, "text/plain; version=0.0.4", metrics_text(), {}});
  if (path == "/internal/load") return exchange->respond(json_reply(200, to_json(load())));
  if (path != "/internal/prefill" && path != "/internal/abort")
    return exchange->respond(
        {404, "application/json", error_json("no route for " + path, "not_found_error"), {}});
  if (request.method != "POST")
    return exchange->respond(
        {405, "application/json", error_json("use POST for " + path, "invalid_request_error"), {}});
  if (path == "/internal/prefill") return handle_prefill(request, exchange);
  handle_abort(request, exchange);
}

void PrefillService::handle_prefill(const HttpRequest& request,
                                    const std::shared_ptr<HttpExchange>& exchange) {
  auto parsed = disagg::parse_prefill_request(request.body);
  if (!parsed) return ++num_rejected_, exchange->respond(error_reply(parsed.status()));
  const disagg::KvTarget& target = parsed->target;
  if (target.layout.num_layers != layout_.num_layers || target.layout.num_kv_heads != layout_.num_kv_heads ||
      target.layout.head_dim != layout_.head_dim || target.layout.dtype != layout_.dtype)
    return ++num_rejected_, exchange->respond(error_reply(
                                invalid_argument("the decode instance's KV layout ({} layers, {} kv heads, "
                                                 "head_dim {}, {}) differs from this one's",
                                                 target.layout.num_layers, target.layout.num_kv_heads,
                                                 target.layout.head_dim, dtype_name(target.layout.dtype))));
  // KV in GPU memory leaves only through CUDA IPC (no staging through host memory yet).
  if (kv_on_device_ && !target.k_regions.empty() && target.k_regions[0].transport != transfer::TransportKind::kCudaIpc)
    return ++num_rejected_,
           exchange->respond(error_reply(unimplemented(
               "this prefill instance's KV is in GPU memory and goes only to decode instances with their KV in GPU "
               "memory of the same host (CUDA IPC); {} offers {} memory over {}",
               target.decode_url, transfer::memory_kind_name(target.k_regions[0].memory),
               transfer::transport_name(target.k_regions[0].transport))));
  const std::string endpoint = target.k_regions.empty() ? std::string() : target.k_regions[0].endpoint;
  const std::string key = endpoint + "/" + std::to_string(target.reservation);
  engine::EngineRequest req = disagg::to_engine_request(parsed->spec);
  req.max_tokens = 1;  // prefill only: the first token
  const auto num_prompt = static_cast<int32_t>(req.prompt.size());
  auto exporter =
      std::make_shared<Exporter>(transfer_, *this, parsed->target, num_prompt, sends_mtp(*parsed));
  req.kv_export = exporter;
  std::lock_guard lock(mutex_);
  if (jobs_.count(key))
    return ++num_rejected_,
           exchange->respond(error_reply(invalid_argument("reservation {} is already being written", key)));
  auto id = engine_.submit(std::move(req), [this, key](const engine::EngineOutput& out) {
    if (out.finish != engine::FinishReason::kNone) worker_.post([this, key, out] { on_prefilled(key, out); });
  });
  if (!id) return exchange->respond(error_reply(id.status()));
  jobs_[key] = Job{exporter, exchange, *id, num_prompt, true};
  pending_prompt_tokens_ += num_prompt;
  ++num_prefills_;
  exchange->on_close(
      [this, key] { worker_.post([this, key] { cancel_job(key, "the router closed the connection"); }); });
}

// Whether the MTP state goes with this prompt: both sides speculate, and the
// decode instance will draft for it (a second token is to come).
// Without, the request decodes there without drafts (docs/speculative.md).
bool PrefillService::sends_mtp(const disagg::PrefillRequest& request) {
  const bool here = mtp_k_region_.has_value(), there = request.target.layout.num_mtp_layers > 0;
  if (here != there && !warned_mtp_mismatch_.exchange(true))
    log_warn("prefill: {} has {} MTP layer and this instance {}: its requests decode without drafts "
             "(start both with the same --speculative-config and --speculative-model)",
             request.target.decode_url, there ? "an" : "no", here ? "has one" : "has none");
  return here && there && request.spec.max_tokens > 1;
}

void PrefillService::on_prefilled(const std::string& key, const engine::EngineOutput& out) {
  std::shared_ptr<Exporter> exporter;
  std::shared_ptr<HttpExchange> exchange;
  {
    std::lock_guard lock(mutex_);
    auto it = jobs_.find(key);
    if (it == jobs_.end()) return;
    if (it->second.running) pending_prompt_tokens_ -= it->second.num_prompt_tokens;
    it->second.running = false;
    exporter = it->second.exporter;
    exchange = it->second.exchange;
  }
  num_kv_bytes_sent_ += static_cast<int64_t>(exporter->num_bytes());
  Status error = !out.error.is_ok() ? out.error : exporter->error();
  if (error.is_ok() && out.token < 0) error = aborted("the prefill was cancelled");
  if (!error.is_ok()) {
    ++num_failed_;
    (void)transfer_.cancel(exporter->target().reservation);
    exchange->respond(error_reply(error));
    return forget_when_sent(key);
  }
  disagg::PrefillResult result;
  result.first_token = out.token;
  result.stop = out.finish == engine::FinishReason::kStop;
  result.logprobs = out.logprobs;
  result.prompt_logprobs = out.prompt_logprobs;
  commit(key, std::move(result));
}

// Tells the decode instance every write is submitted (it activates the
// sequence once they have all landed), then answers the router.
void PrefillService::commit(const std::string& key, disagg::PrefillResult result) {
  std::shared_ptr<Exporter> exporter;
  std::shared_ptr<HttpExchange> exchange;
  {
    std::lock_guard lock(mutex_);
    auto it = jobs_.find(key);
    if (it == jobs_.end()) return;
    exporter = it->second.exporter;
    exchange = it->second.exchange;
  }
  const disagg::KvTarget& target = exporter->target();
  disagg::CommitRequest msg{target.reservation, exporter->num_batches(), result.first_token,
                            exporter->last_hidden()};
  auto url = HttpUrl::parse(target.decode_url);
  auto reply = url ? http_call(*url, "POST", "/internal/commit", disagg::to_json(msg).dump(),
                               options_.commit_timeout_s)
                   : Expected<HttpClientResponse>(url.status());
  if (!reply || reply->status != 200) {
    ++num_failed_;
    (void)transfer_.cancel(target.reservation);
    const Status s = reply ? unavailable("the decode instance refused the commit: HTTP {} {}", reply->status,
                                         reply->body.substr(0, 200))
                           : reply.status();
    exchange->respond(error_reply(s));
  } else {
    exchange->respond(json_reply(200, disagg::to_json(result)));
  }
  forget_when_sent(key);
}

// A job is forgotten once its batches are done at this end: until then an
// abort from the decode instance must find it (and cancel them).
void PrefillService::forget_when_sent(const std::string& key) {
  std::shared_ptr<Exporter> exporter;
  {
    std::lock_guard lock(mutex_);
    auto it = jobs_.find(key);
    if (it == jobs_.end()) return;
    exporter = it->second.exporter;
  }
  for (transfer::TransferId id : exporter->batches()) {
    if (!transfer_.poll(id).has_value()) {
      worker_.post_after(0.05, [this, key] { forget_when_sent(key); });
      return;
    }
  }
  for (transfer::TransferId id : exporter->batches())
    (void)transfer_.wait(id, std::chrono::milliseconds(0));  // forget
  exporter->release_pages();
  std::lock_guard lock(mutex_);
  jobs_.erase(key);
}

void PrefillService::cancel_job(const std::string& key, const char* why) {
  std::shared_ptr<Exporter> exporter;
  {
    std::lock_guard lock(mutex_);
    auto it = jobs_.find(key);
    if (it == jobs_.end()) return;
    if (it->second.running) engine_.cancel(it->second.engine_id);
    exporter = it->second.exporter;
  }
  // When cancel() returns, no further byte of this reservation leaves here.
  (void)transfer_.cancel(exporter->target().reservation);
  log_info("prefill: reservation {} cancelled ({})", key, why);
}

// Acknowledged on the worker once no byte of the reservation can leave here
// (cancel_job blocks until then), after the fault-injection delay if any.
void PrefillService::handle_abort(const HttpRequest& request, const std::shared_ptr<HttpExchange>& exchange) {
  auto abort = disagg::parse_abort_request(request.body);
  if (!abort) return ++num_rejected_, exchange->respond(error_reply(abort.status()));
  const std::string key = abort->decode_endpoint + "/" + std::to_string(abort->reservation);
  {
    std::lock_guard lock(mutex_);
    if (!jobs_.count(key))
      return ++num_rejected_,
             exchange->respond(error_reply(not_found("no transfer for reservation {}", key)));
  }
  ++num_aborts_;
  worker_.post_after(options_.fault_abort_ack_delay_s, [this, key, exchange] {
    cancel_job(key, "aborted by the decode instance");
    exchange->respond(json_reply(200, {{"state", "stopped"}}));
  });
}

disagg::InstanceLoad PrefillService::load() const {
  disagg::InstanceLoad l = disagg::engine_load("prefill", engine_, transfer_);
  std::lock_guard lock(mutex_);
  l.pending_prompt_tokens = pending_prompt_tokens_;
  return l;
}

std::string PrefillService::metrics_text() const {
  std::string out = render_metrics(engine_.metrics(), options_.model_name);
  const std::string label = fmt::format("model_name=\"{}\"", options_.model_name);
  const auto counter = [&](const char* name, const char* help, int64_t value) {
    out += fmt::format("# HELP moeserve:{} {}\n# TYPE moeserve:{} counter\nmoeserve:{}{{{}}} {}\n", name,
                       help, name, name, label, value);
  };
  {
    std::lock_guard lock(mutex_);
    out += fmt::format(
        "# HELP moeserve:disagg_pending_prompt_tokens Prompt tokens queued or running here.\n"
        "# TYPE moeserve:disagg_pending_prompt_tokens gauge\nmoeserve:disagg_pending_prompt_tokens{{{}}} "
        "{}\n",
        label, pending_prompt_tokens_);
  }
  out += fmt::format(
      "# HELP moeserve:disagg_kv_transport_info Where this instance's KV is and how it leaves.\n"
      "# TYPE moeserve:disagg_kv_transport_info gauge\n"
      "moeserve:disagg_kv_transport_info{{{},memory=\"{}\",transport=\"{}\"}} 1\n",
      label, kv_on_device_ ? "device" : "host", kv_transport_);
  counter("disagg_kv_bytes_sent_total", "KV bytes of the batches submitted to decode instances.", num_kv_bytes_sent_);
  counter("disagg_prefills_total", "Prefills with a KV target accepted.", num_prefills_);
  counter("disagg_prefill_failures_total", "Prefills that failed (cancelled, transfer or commit error).",
          num_failed_);
  counter("disagg_writer_aborts_total", "Aborts from decode instances acknowledged.", num_aborts_);
  counter("disagg_rejected_messages_total", "Internal messages refused (malformed, unknown ids).",
          num_rejected_);
  return out;
}

}  // namespace moe::server
