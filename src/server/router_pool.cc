#include "server/router_pool.h"

#include <algorithm>
#include <cmath>

#include "core/logging.h"
#include "engine/engine.h"
#include "server/http_client.h"

namespace moe::server {

namespace {
constexpr double kRateWindowS = 10;
}

Status check_max_model_len(int64_t instance_limit, int64_t router_limit) {
  if (instance_limit >= router_limit) return Status::ok();
  return invalid_argument(
      "it serves max_model_len {}, below this router's {}: start the router with --max-model-len {} (or the instance "
      "with {})",
      instance_limit, router_limit, instance_limit, router_limit);
}

const char* instance_role_name(InstanceRole role) {
  return role == InstanceRole::kPrefill ? "prefill" : "decode";
}

RouterPool::RouterPool(RouterPoolOptions options) : options_(std::move(options)) {}

RouterPool::~RouterPool() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

Status RouterPool::add(InstanceRole role, const std::string& url) {
  MOE_ASSIGN_OR_RETURN(HttpUrl parsed, HttpUrl::parse(url));
  const std::string key = parsed.to_string();
  std::lock_guard lock(mutex_);
  auto it = instances_.find(key);
  if (it != instances_.end()) {
    if (it->second.role != role)
      return invalid_argument("{} is already registered as a {} instance", key,
                              instance_role_name(it->second.role));
    return Status::ok();
  }
  Instance inst;
  inst.role = role;
  inst.url = key;
  instances_.emplace(key, std::move(inst));
  wake_.notify_all();
  return Status::ok();
}

void RouterPool::start() {
  std::vector<std::string> urls;
  {
    std::lock_guard lock(mutex_);
    for (const auto& [url, inst] : instances_) urls.push_back(url);
  }
  for (const auto& url : urls) check(url);
  thread_ = std::thread([this] { loop(); });
}

void RouterPool::loop() {
  std::unique_lock lock(mutex_);
  while (!stop_) {
    const double now = engine::monotonic_seconds();
    std::vector<std::string> due;
    for (const auto& [url, inst] : instances_)
      if (inst.next_check_s <= now) due.push_back(url);
    input_samples_.emplace_back(now, input_tokens_total_);
    while (input_samples_.size() > 2 && input_samples_.front().first < now - kRateWindowS)
      input_samples_.pop_front();
    lock.unlock();
    for (const auto& url : due) check(url);
    lock.lock();
    wake_.wait_for(lock, std::chrono::duration<double>(std::min(0.1, options_.health_interval_s)));
  }
}

// One health check: GET /internal/load. Success makes the instance healthy
// and refreshes its load; a failure backs off exponentially.
void RouterPool::check(const std::string& url) {
  const auto fetch = [&]() -> Expected<disagg::InstanceLoad> {
    MOE_ASSIGN_OR_RETURN(HttpUrl parsed, HttpUrl::parse(url));
    MOE_ASSIGN_OR_RETURN(HttpClientResponse reply,
                         http_call(parsed, "GET", "/internal/load", "", options_.check_timeout_s));
    if (reply.status != 200) return unavailable("GET /internal/load answered {}", reply.status);
    return disagg::parse_instance_load(reply.body);
  };
  Expected<disagg::InstanceLoad> load = fetch();
  std::lock_guard lock(mutex_);
  auto it = instances_.find(url);
  if (it == instances_.end()) return;
  Instance& inst = it->second;
  const double now = engine::monotonic_seconds();
  Status why = Status::ok();
  if (!load)
    why = load.status();
  else if (load->role != instance_role_name(inst.role))
    why = unavailable("it reports role '{}'", load->role);
  else if (options_.max_model_len > 0)
    why = check_max_model_len(load->max_model_len, options_.max_model_len);
  if (why.is_ok()) {
    if (!inst.healthy) log_info("router: {} instance {} is healthy", instance_role_name(inst.role), url);
    inst.healthy = true;
    inst.last_error.clear();
    inst.num_failures = 0;
    inst.next_check_s = now + options_.health_interval_s;
    if (inst.role == InstanceRole::kPrefill) {
      const int64_t tokens = load->prompt_tokens_total - inst.last_prompt_tokens;
      const double busy = load->busy_seconds_total - inst.last_busy_s;
      if (inst.last_prompt_tokens >= 0 && busy > 0.05 && tokens > 0) {
        const double sample = static_cast<double>(tokens) / busy;
        inst.capacity_tps = inst.capacity_tps == 0 ? sample : 0.7 * inst.capacity_tps + 0.3 * sample;
      }
      if (inst.last_prompt_tokens < 0 || busy > 0.05) {
        inst.last_prompt_tokens = load->prompt_tokens_total;
        inst.last_busy_s = load->busy_seconds_total;
      }
    }
    inst.load = std::move(load).value();
    return;
  }
  // A failing check is logged when the instance was healthy or, for one that
  // answers (not just still starting), when the reason is new.
  if (inst.healthy || (load && why.message() != inst.last_error))
    log_warn("router: {} instance {} is unhealthy: {}", instance_role_name(inst.role), url, why.to_string());
  if (load) inst.last_error = why.message();
  inst.healthy = false;
  inst.num_failures = std::min(inst.num_failures + 1, 30);
  inst.next_check_s = now + std::min(options_.max_backoff_s, 0.1 * std::pow(2.0, inst.num_failures));
}

void RouterPool::report_failure(const std::string& url, const Status& why) {
  std::lock_guard lock(mutex_);
  auto it = instances_.find(url);
  if (it == instances_.end() || !it->second.healthy) return;
  log_warn("router: {} instance {} failed a request: {}", instance_role_name(it->second.role), url,
           why.to_string());
  it->second.healthy = false;
  it->second.num_failures = 1;
  it->second.next_check_s = engine::monotonic_seconds() + 0.1;
}

std::optional<InstanceLease> RouterPool::pick_decode() {
  std::lock_guard lock(mutex_);
  Instance* best = nullptr;
  auto batch = [](const Instance& i) {
    return std::max(i.load.num_running + i.load.num_waiting, i.in_flight);
  };
  auto better = [&](const Instance& a, const Instance& b) {
    const bool a_under = batch(a) < options_.decode_batch_threshold,
               b_under = batch(b) < options_.decode_batch_threshold;
    if (a_under != b_under) return a_under;
    if (!a_under) return batch(a) < batch(b);
    if (a.load.kv_usage != b.load.kv_usage) return a.load.kv_usage < b.load.kv_usage;
    return a.in_flight < b.in_flight;
  };
  for (auto& [url, inst] : instances_)
    if (inst.role == InstanceRole::kDecode && inst.healthy && (!best || better(inst, *best))) best = &inst;
  if (!best) return std::nullopt;
  ++best->in_flight;
  return InstanceLease{best->url, best->load.transfer_endpoint, InstanceRole::kDecode, 0};
}

std::optional<InstanceLease> RouterPool::pick_prefill(int64_t num_prompt_tokens,
                                                      const std::set<std::string>& exclude) {
  std::lock_guard lock(mutex_);
  Instance* best = nullptr;
  auto pending = [](const Instance& i) { return std::max(i.load.pending_prompt_tokens, i.in_flight_tokens); };
  for (auto& [url, inst] : instances_) {
    if (inst.role != InstanceRole::kPrefill || !inst.healthy || exclude.count(url)) continue;
    if (!best || pending(inst) < pending(*best)) best = &inst;
  }
  if (!best) return std::nullopt;
  ++best->in_flight;
  best->in_flight_tokens += num_prompt_tokens;
  return InstanceLease{best->url, best->load.transfer_endpoint, InstanceRole::kPrefill, num_prompt_tokens};
}

void RouterPool::done(const InstanceLease& lease) {
  std::lock_guard lock(mutex_);
  auto it = instances_.find(lease.url);
  if (it == instances_.end()) return;
  --it->second.in_flight;
  it->second.in_flight_tokens -= lease.tokens;
}

void RouterPool::count_input_tokens(int64_t num_tokens) {
  std::lock_guard lock(mutex_);
  input_tokens_total_ += num_tokens;
}

bool RouterPool::has_healthy(InstanceRole role) const {
  std::lock_guard lock(mutex_);
  for (const auto& [url, inst] : instances_)
    if (inst.role == role && inst.healthy) return true;
  return false;
}

double RouterPool::input_tokens_per_second_locked(double now) const {
  if (input_samples_.empty()) return 0;
  const auto& [t0, n0] = input_samples_.front();
  const double span = std::max(now - t0, 1.0);
  return static_cast<double>(input_tokens_total_ - n0) / span;
}

std::string RouterPool::metrics_text() const {
  std::lock_guard lock(mutex_);
  const double now = engine::monotonic_seconds();
  const double input_rate = input_tokens_per_second_locked(now);
  std::string out;
  const auto head = [&](const char* name, const char* type, const char* help) {
    out += fmt::format("# HELP moeserve:{} {}\n# TYPE moeserve:{} {}\n", name, help, name, type);
  };
  const std::string model = fmt::format("model_name=\"{}\"", options_.model_name);
  head("router_input_tokens_total", "counter", "Input (prompt) tokens received by the router.");
  out += fmt::format("moeserve:router_input_tokens_total{{{}}} {}\n", model, input_tokens_total_);
  head("router_input_tokens_per_second", "gauge", "Input tokens received per second over the last 10 s.");
  out += fmt::format("moeserve:router_input_tokens_per_second{{{}}} {:.3f}\n", model, input_rate);
  head("router_instance_healthy", "gauge", "1 while the instance passes its health checks.");
  for (const auto& [url, inst] : instances_)
    out += fmt::format("moeserve:router_instance_healthy{{{},role=\"{}\",instance=\"{}\"}} {}\n", model,
                       instance_role_name(inst.role), url, inst.healthy ? 1 : 0);
  head("prefill_capacity_tokens_per_second", "gauge",
       "Measured prefill capacity of the instance: input tokens per second of forward time (0 until "
       "measured).");
  double capacity_sum = 0;
  int num_measured = 0, num_prefill = 0;
  for (const auto& [url, inst] : instances_) {
    if (inst.role != InstanceRole::kPrefill) continue;
    ++num_prefill;
    if (inst.capacity_tps > 0) capacity_sum += inst.capacity_tps, ++num_measured;
    out += fmt::format("moeserve:prefill_capacity_tokens_per_second{{{},instance=\"{}\"}} {:.3f}\n", model,
                       url, inst.capacity_tps);
  }
  head("prefill_pending_tokens", "gauge", "Input tokens queued or running on the prefill instance.");
  for (const auto& [url, inst] : instances_)
    if (inst.role == InstanceRole::kPrefill)
      out += fmt::format("moeserve:prefill_pending_tokens{{{},instance=\"{}\"}} {}\n", model, url,
                         std::max(inst.load.pending_prompt_tokens, inst.in_flight_tokens));
  // Enough prefill instances that the input rate does not outrun them: no queue builds.
  const double mean_capacity = num_measured ? capacity_sum / num_measured : 0;
  const int prefill_needed =
      mean_capacity > 0 ? static_cast<int>(std::ceil(input_rate / mean_capacity)) : num_prefill;
  head("prefill_instances_needed", "gauge",
       "Prefill instances needed so that no queue builds: ceil(input tokens/s / mean measured capacity).");
  out += fmt::format("moeserve:prefill_instances_needed{{{}}} {}\n", model,
                     std::max(prefill_needed, input_rate > 0 ? 1 : 0));
  head("decode_batch_threshold", "gauge", "The --decode-batch-threshold the decode batches are kept under.");
  out += fmt::format("moeserve:decode_batch_threshold{{{}}} {}\n", model, options_.decode_batch_threshold);
  head("decode_batch_size", "gauge", "Sequences running or waiting on the decode instance.");
  head("decode_kv_usage_perc", "gauge", "KV cache usage of the decode instance (0..1).");
  int64_t total_batch = 0;
  for (const auto& [url, inst] : instances_) {
    if (inst.role != InstanceRole::kDecode) continue;
    const int batch = inst.load.num_running + inst.load.num_waiting;
    if (inst.healthy) total_batch += batch;
    out += fmt::format("moeserve:decode_batch_size{{{},instance=\"{}\"}} {}\n", model, url, batch);
    out += fmt::format("moeserve:decode_kv_usage_perc{{{},instance=\"{}\"}} {:.4f}\n", model, url,
                       inst.load.kv_usage);
  }
  const auto threshold = static_cast<int64_t>(std::max(1, options_.decode_batch_threshold));
  head("decode_instances_needed", "gauge",
       "Decode instances needed to keep every batch under the threshold: ceil(sequences / threshold).");
  out += fmt::format("moeserve:decode_instances_needed{{{}}} {}\n", model,
                     (total_batch + threshold - 1) / threshold);
  return out;
}

}  // namespace moe::server
