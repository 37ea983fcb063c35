#include "apps/moeserve/bench_command.h"

#include <poll.h>

#include <cerrno>
#include <cstring>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>
#include <thread>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <nlohmann/json.hpp>

#include "core/logging.h"
#include "core/status.h"

namespace moe::apps {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

struct BenchArgs {
  std::string url = "http://127.0.0.1:8000";
  std::string model;
  std::string dataset = "random";
  int input_len = 128;
  int output_len = 64;
  int num_prompts = 100;
  double request_rate = 0;  // 0: all at once (inf)
  int max_concurrency = 0;  // 0: no limit
  int64_t seed = 0;
  int vocab_lo = 10, vocab_hi = 1000;
  std::string save_result;
  std::string api_key;  // sent as "Authorization: Bearer KEY" (default: $OPENAI_API_KEY)
  double timeout_s = 300;  // a request fails after this long without a byte from the server (0: never)
  std::string host, port;  // vLLM's --host/--port: the URL http://HOST:PORT (defaults 127.0.0.1, 8000)
  std::string percentile_metrics = "ttft,tpot,itl,e2el";
  std::string metric_percentiles = "99";
  std::vector<std::string> goodput;  // "ttft:MS", "tpot:MS", "e2el:MS"
};

// --percentile-metrics, --metric-percentiles and --goodput, checked.
struct Reporting {
  std::vector<std::string> metrics;   // of ttft, tpot, itl, e2el
  std::vector<double> percentiles;    // in (0, 100]
  std::vector<std::pair<std::string, double>> slo_ms;  // goodput: every one met
};

Expected<Reporting> parse_reporting(const BenchArgs& args) {
  Reporting r;
  auto split = [](const std::string& s) {
    std::vector<std::string> out;
    size_t begin = 0;
    while (begin <= s.size()) {
      const size_t end = std::min(s.find(',', begin), s.size());
      if (end > begin) out.push_back(s.substr(begin, end - begin));
      begin = end + 1;
    }
    return out;
  };
  const std::vector<std::string> known = {"ttft", "tpot", "itl", "e2el"};
  for (const std::string& m : split(args.percentile_metrics)) {
    if (std::find(known.begin(), known.end(), m) == known.end())
      return invalid_argument("--percentile-metrics: '{}' is not one of ttft, tpot, itl, e2el", m);
    r.metrics.push_back(m);
  }
  for (const std::string& p : split(args.metric_percentiles)) {
    char* end = nullptr;
    const double v = std::strtod(p.c_str(), &end);
    if (end != p.c_str() + p.size() || !(v > 0 && v <= 100))
      return invalid_argument("--metric-percentiles: '{}' is not a percentile in (0, 100]", p);
    r.percentiles.push_back(v);
  }
  for (const std::string& g : args.goodput) {
    const size_t colon = g.find(':');
    const std::string name = g.substr(0, colon);
    char* end = nullptr;
    const double ms = colon == std::string::npos ? -1 : std::strtod(g.c_str() + colon + 1, &end);
    if ((name != "ttft" && name != "tpot" && name != "e2el") || colon == std::string::npos ||
        end != g.c_str() + g.size() || !(ms >= 0))
      return invalid_argument("--goodput: '{}' is not ttft:MS, tpot:MS or e2el:MS", g);
    r.slo_ms.emplace_back(name, ms);
  }
  return r;
}

// Threads, one per request in flight: "no limit" means this many at most.
constexpr int kMaxInFlight = 1024;

struct Outcome {
  bool ok = false;
  std::string error;
  int prompt_len = 0, output_tokens = 0;
  double ttft_s = 0, e2e_s = 0;
  std::vector<double> itl_s;
};

struct Endpoint {
  std::string host, port;
};

Expected<Endpoint> parse_url(const std::string& url) {
  const std::string prefix = "http://";
  if (url.rfind(prefix, 0) != 0) return invalid_argument("--url must start with http://, got '{}'", url);
  std::string rest = url.substr(prefix.size());
  rest = rest.substr(0, rest.find('/'));
  const size_t colon = rest.rfind(':');
  if (colon == std::string::npos) return Endpoint{rest, "80"};
  return Endpoint{rest.substr(0, colon), rest.substr(colon + 1)};
}

// One HTTP exchange; `on_body` sees the body as it arrives.
Status http_exchange(const Endpoint& ep, const std::string& api_key, double timeout_s, const std::string& method,
                     const std::string& target, const std::string& body, int& status,
                     const std::function<void(std::string_view)>& on_body) {
  try {
    net::io_context ioc;
    tcp::resolver resolver(ioc);
    beast::tcp_stream stream(ioc);
    stream.connect(resolver.resolve(ep.host, ep.port));
    http::request<http::string_body> req{method == "POST" ? http::verb::post : http::verb::get, target, 11};
    req.set(http::field::host, ep.host);
    req.set(http::field::content_type, "application/json");
    if (!api_key.empty()) req.set(http::field::authorization, "Bearer " + api_key);
    req.body() = body;
    req.prepare_payload();
    http::write(stream, req);
    // The reads: non-blocking, waiting in poll() for at most timeout_s between bytes.
    stream.socket().non_blocking(true);
    const int timeout_ms = timeout_s > 0 ? static_cast<int>(std::min(timeout_s * 1e3, 2e9)) : -1;
    auto wait_readable = [&](const beast::error_code& ec) -> Status {
      if (ec != net::error::would_block && ec != net::error::try_again) return unavailable("{}", ec.message());
      pollfd p{stream.socket().native_handle(), POLLIN, 0};
      const int ready = ::poll(&p, 1, timeout_ms);
      if (ready == 0) return deadline_exceeded("no answer for {} s (--timeout)", timeout_s);
      if (ready < 0 && errno != EINTR) return unavailable("poll: {}", std::strerror(errno));
      return Status::ok();
    };
    beast::flat_buffer buffer;
    http::response_parser<http::buffer_body> parser;
    parser.body_limit(std::uint64_t{1} << 40);
    while (!parser.is_header_done()) {
      beast::error_code ec;
      http::read_header(stream, buffer, parser, ec);
      if (ec) MOE_RETURN_IF_ERROR(wait_readable(ec));
    }
    status = static_cast<int>(parser.get().result_int());
    char chunk[16384];
    while (!parser.is_done()) {
      parser.get().body().data = chunk;
      parser.get().body().size = sizeof chunk;
      beast::error_code ec;
      http::read_some(stream, buffer, parser, ec);
      if (ec && ec != http::error::need_buffer) MOE_RETURN_IF_ERROR(wait_readable(ec));
      on_body(std::string_view(chunk, sizeof chunk - parser.get().body().size));
    }
    beast::error_code ignored;
    stream.socket().shutdown(tcp::socket::shutdown_both, ignored);
    return Status::ok();
  } catch (const std::exception& e) {
    return unavailable("{}", e.what());
  }
}

// The message of an OpenAI error body, else the body's first bytes.
std::string error_message(const std::string& body) {
  const json j = json::parse(body, nullptr, false);
  if (j.is_object() && j.contains("error") && j["error"].is_object() && j["error"].contains("message") &&
      j["error"]["message"].is_string())
    return j["error"]["message"].get<std::string>();
  return body.substr(0, 500);
}

Outcome run_one(const Endpoint& ep, const BenchArgs& args, const std::string& model,
                const std::vector<int32_t>& prompt, int max_tokens) {
  Outcome o;
  o.prompt_len = static_cast<int>(prompt.size());
  const json body = {{"model", model},       {"prompt", prompt},       {"max_tokens", max_tokens},
                     {"temperature", 0},     {"ignore_eos", true},     {"stream", true},
                     {"stream_options", {{"include_usage", true}}}};
  const auto start = Clock::now();
  auto last = start, last_event = start;
  bool first = true;
  std::string pending, error_body;
  int status = 0;
  auto on_event = [&](const std::string& data) {
    last_event = Clock::now();  // E2EL ends at the last event, as vLLM's
    if (data == "[DONE]") return;
    const json j = json::parse(data, nullptr, false);
    if (j.is_discarded()) return;
    if (j.contains("error")) o.error = j["error"].value("message", "error event");
    if (j.contains("usage") && j["usage"].is_object()) o.output_tokens = j["usage"].value("completion_tokens", 0);
    if (!j.contains("choices") || j["choices"].empty()) return;
    const auto now = Clock::now();
    if (first) o.ttft_s = std::chrono::duration<double>(now - start).count(), first = false;
    else o.itl_s.push_back(std::chrono::duration<double>(now - last).count());
    last = now;
  };
  Status s = http_exchange(ep, args.api_key, args.timeout_s, "POST", "/v1/completions", body.dump(), status,
                           [&](std::string_view bytes) {
    if (status != 200) {
      error_body.append(bytes);
      return;
    }
    pending.append(bytes);
    size_t end;
    while ((end = pending.find("\n\n")) != std::string::npos) {
      std::string event = pending.substr(0, end);
      pending.erase(0, end + 2);
      if (event.rfind("data: ", 0) == 0) on_event(event.substr(6));
    }
  });
  o.e2e_s = std::chrono::duration<double>(last_event - start).count();
  if (!s.is_ok()) o.error = s.message();
  else if (status != 200) o.error = fmt::format("HTTP {}: {}", status, error_message(error_body));
  o.ok = o.error.empty() && !first;
  return o;
}

struct Stat {
  double mean = 0, median = 0, std = 0;
  std::vector<double> percentiles;  // per Reporting::percentiles
};
// In ms; std is numpy's (population), percentiles numpy's linear interpolation.
Stat stats_ms(std::vector<double> v, const std::vector<double>& percentiles) {
  Stat s;
  s.percentiles.assign(percentiles.size(), 0.0);
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  for (double x : v) s.mean += x;
  s.mean /= static_cast<double>(v.size());
  for (double x : v) s.std += (x - s.mean) * (x - s.mean);
  s.std = std::sqrt(s.std / static_cast<double>(v.size())) * 1e3;
  s.mean *= 1e3;
  auto pct = [&](double p) {
    const double pos = p * static_cast<double>(v.size() - 1);
    const auto lo = static_cast<size_t>(pos);
    const size_t hi = std::min(lo + 1, v.size() - 1);
    return (v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo))) * 1e3;
  };
  s.median = pct(0.5);
  for (size_t i = 0; i < percentiles.size(); ++i) s.percentiles[i] = pct(percentiles[i] / 100);
  return s;
}

// "99" for 99.0, "99.9" for 99.9 (vLLM's labels and JSON keys).
std::string percentile_label(double p) {
  std::string s = fmt::format("{}", p);
  if (s.size() > 2 && s.ends_with(".0")) s.resize(s.size() - 2);
  return s;
}

Expected<std::string> find_model(const Endpoint& ep, const BenchArgs& args) {
  int status = 0;
  std::string body;
  Status s = http_exchange(ep, args.api_key, args.timeout_s, "GET", "/v1/models", "", status,
                           [&](std::string_view b) { body.append(b); });
  if (!s.is_ok()) return unavailable("GET {}/v1/models: {} (is the server up?)", args.url, s.message());
  if (status != 200)
    return unavailable("GET {}/v1/models: HTTP {}: {}{}", args.url, status, error_message(body),
                       status == 401 ? " (--api-key, or $OPENAI_API_KEY)" : "");
  const json j = json::parse(body, nullptr, false);
  if (j.is_discarded() || !j.contains("data") || !j["data"].is_array() || j["data"].empty() ||
      !j["data"][0].is_object())
    return unavailable("GET {}/v1/models lists no model", args.url);
  return j["data"][0].value("id", "");
}

Status print_and_save(const BenchArgs& args, const Reporting& rep, const std::string& model,
                      const std::vector<Outcome>& outcomes, double duration_s) {
  int completed = 0, good = 0;
  int64_t input_tokens = 0, output_tokens = 0;
  std::vector<double> ttft, tpot, itl, e2el;
  json errors = json::array();
  for (const auto& o : outcomes) {
    if (!o.ok) {
      errors.push_back(o.error);
      continue;
    }
    ++completed;
    input_tokens += o.prompt_len;
    output_tokens += o.output_tokens;
    ttft.push_back(o.ttft_s);
    e2el.push_back(o.e2e_s);
    const double request_tpot = o.output_tokens > 1 ? (o.e2e_s - o.ttft_s) / (o.output_tokens - 1) : 0;
    if (o.output_tokens > 1) tpot.push_back(request_tpot);
    itl.insert(itl.end(), o.itl_s.begin(), o.itl_s.end());
    bool meets = true;  // goodput: every SLO met
    for (const auto& [name, ms] : rep.slo_ms) {
      const double value_s = name == "ttft" ? o.ttft_s : name == "tpot" ? request_tpot : o.e2e_s;
      meets = meets && value_s * 1e3 <= ms;
    }
    good += meets;
  }
  const Stat t = stats_ms(ttft, rep.percentiles), p = stats_ms(tpot, rep.percentiles),
             i = stats_ms(itl, rep.percentiles), e = stats_ms(e2el, rep.percentiles);
  auto line = [](const char* k, double v) { std::printf("%-40s%-10.2f\n", k, v); };
  std::printf("============ Serving Benchmark Result ============\n");
  std::printf("%-40s%-10d\n", "Successful requests:", completed);
  if (!errors.empty()) std::printf("%-40s%-10zu\n", "Failed requests:", errors.size());
  if (args.max_concurrency > 0) std::printf("%-40s%-10d\n", "Maximum request concurrency:", args.max_concurrency);
  line("Benchmark duration (s):", duration_s);
  std::printf("%-40s%-10ld\n%-40s%-10ld\n", "Total input tokens:", static_cast<long>(input_tokens),
              "Total generated tokens:", static_cast<long>(output_tokens));
  line("Request throughput (req/s):", completed / duration_s);
  if (!rep.slo_ms.empty()) line("Request goodput (req/s):", good / duration_s);
  line("Output token throughput (tok/s):", static_cast<double>(output_tokens) / duration_s);
  line("Total Token throughput (tok/s):", static_cast<double>(input_tokens + output_tokens) / duration_s);
  const std::pair<const char*, Stat> sections[] = {{"Time to First Token", t}, {"Time per Output Token (excl. 1st token)", p},
                                                   {"Inter-token Latency", i}, {"End-to-end Latency", e}};
  const char* names[] = {"TTFT", "TPOT", "ITL", "E2EL"};
  auto selected = [&](int s) {
    std::string n = names[s];
    std::transform(n.begin(), n.end(), n.begin(), ::tolower);
    return std::find(rep.metrics.begin(), rep.metrics.end(), n) != rep.metrics.end();
  };
  for (int s = 0; s < 4; ++s) {
    if (!selected(s)) continue;
    const std::string title = sections[s].first;
    const size_t pad = title.size() < 48 ? (50 - title.size()) / 2 : 1;
    std::printf("%s%s%s\n", std::string(pad, '-').c_str(), title.c_str(), std::string(50 - pad - title.size(), '-').c_str());
    line(fmt::format("Mean {} (ms):", names[s]).c_str(), sections[s].second.mean);
    line(fmt::format("Median {} (ms):", names[s]).c_str(), sections[s].second.median);
    for (size_t k = 0; k < rep.percentiles.size(); ++k)
      line(fmt::format("P{} {} (ms):", percentile_label(rep.percentiles[k]), names[s]).c_str(),
           sections[s].second.percentiles[k]);
  }
  std::printf("==================================================\n");
  std::fflush(stdout);
  if (!errors.empty())
    log_warn("bench: {} of {} requests failed; first error: {}", errors.size(), outcomes.size(),
             errors[0].get<std::string>());
  json r = {{"backend", "moeserve"}, {"model_id", model}, {"url", args.url}, {"dataset", args.dataset},
            {"random_input_len", args.input_len}, {"random_output_len", args.output_len},
            {"num_prompts", args.num_prompts},
            {"request_rate", args.request_rate > 0 ? json(args.request_rate) : json("inf")},
            {"max_concurrency", args.max_concurrency > 0 ? json(args.max_concurrency) : json(nullptr)},
            {"seed", args.seed}, {"duration", duration_s}, {"completed", completed}, {"failed", errors.size()},
            {"total_input_tokens", input_tokens}, {"total_output_tokens", output_tokens},
            {"request_throughput", completed / duration_s},
            {"output_throughput", static_cast<double>(output_tokens) / duration_s},
            {"total_token_throughput", static_cast<double>(input_tokens + output_tokens) / duration_s}, {"errors", errors}};
  if (!rep.slo_ms.empty()) r["request_goodput"] = good / duration_s;
  for (int s = 0; s < 4; ++s) {
    if (!selected(s)) continue;
    std::string n = names[s];
    std::transform(n.begin(), n.end(), n.begin(), ::tolower);
    r["mean_" + n + "_ms"] = sections[s].second.mean;
    r["median_" + n + "_ms"] = sections[s].second.median;
    r["std_" + n + "_ms"] = sections[s].second.std;
    for (size_t k = 0; k < rep.percentiles.size(); ++k)
      r["p" + percentile_label(rep.percentiles[k]) + "_" + n + "_ms"] = sections[s].second.percentiles[k];
  }
  r["ttfts"] = ttft;
  r["e2els"] = e2el;
  if (!args.save_result.empty()) {
    std::ofstream out(args.save_result);
    out << r.dump(2) << "\n";
    out.close();
    if (!out) return unavailable("--save-result: cannot write {}", args.save_result);
  }
  if (completed == 0)
    return unavailable("all {} requests failed; first error: {}", outcomes.size(), errors[0].get<std::string>());
  return Status::ok();
}

Status run_bench(BenchArgs args) {
  if (args.dataset != "random") return invalid_argument("--dataset-name: only 'random' is supported");
  MOE_ASSIGN_OR_RETURN(const Reporting reporting, parse_reporting(args));
  if (!args.host.empty() || !args.port.empty())  // vLLM's spelling of the URL
    args.url = fmt::format("http://{}:{}", args.host.empty() ? "127.0.0.1" : args.host,
                           args.port.empty() ? "8000" : args.port);
  if (args.vocab_lo < 0 || args.vocab_hi <= args.vocab_lo) return invalid_argument("--random-vocab-lo must be >= 0 and below --random-vocab-hi");
  if (!(args.request_rate >= 0)) return invalid_argument("--request-rate must be >= 0 (0 or inf: all at once)");
  if (std::isinf(args.request_rate)) args.request_rate = 0;
  if (args.max_concurrency < 0) return invalid_argument("--max-concurrency must be >= 0 (0: no limit)");
  if (!(args.timeout_s >= 0)) return invalid_argument("--timeout must be >= 0 (0: wait forever)");
  if (!args.save_result.empty()) {  // fail now, not after the run
    const auto dir = std::filesystem::absolute(args.save_result).parent_path();
    if (!std::filesystem::is_directory(dir))
      return invalid_argument("--save-result: no directory {}", dir.string());
  }
  if (args.api_key.empty())
    if (const char* key = std::getenv("OPENAI_API_KEY")) args.api_key = key;
  MOE_ASSIGN_OR_RETURN(Endpoint ep, parse_url(args.url));
  std::string model = args.model;
  if (model.empty()) {
    MOE_ASSIGN_OR_RETURN(model, find_model(ep, args));
  }
  std::mt19937_64 rng(static_cast<uint64_t>(args.seed));
  std::uniform_int_distribution<int32_t> token(args.vocab_lo, args.vocab_hi - 1);
  std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(args.num_prompts));
  for (auto& p : prompts) {
    p.resize(static_cast<size_t>(args.input_len));
    for (auto& t : p) t = token(rng);
  }
  // Arrival times: Poisson at request_rate, or all at once.
  std::vector<double> arrival(prompts.size(), 0.0);
  std::exponential_distribution<double> gap(args.request_rate > 0 ? args.request_rate : 1.0);
  for (size_t i = 1; i < arrival.size(); ++i) arrival[i] = arrival[i - 1] + (args.request_rate > 0 ? gap(rng) : 0.0);
  log_info("bench: {} prompts of {} tokens, {} output tokens, rate {}, concurrency {}, model '{}'", args.num_prompts,
           args.input_len, args.output_len, args.request_rate > 0 ? fmt::format("{}", args.request_rate) : "inf",
           args.max_concurrency > 0 ? std::to_string(args.max_concurrency) : "unlimited", model);
  // As vLLM's: one request first, so that a server that refuses them all
  // (a wrong model, prompts over its context) fails the run at once.
  {
    const Outcome test = run_one(ep, args, model, prompts[0], args.output_len);
    if (!test.ok)
      return unavailable("the initial test request failed: {}", test.error.empty() ? "no tokens" : test.error);
  }
  int workers = args.max_concurrency > 0 ? std::min(args.max_concurrency, args.num_prompts) : args.num_prompts;
  if (workers > kMaxInFlight) {
    log_warn("bench: at most {} requests in flight (one thread each), not {}", kMaxInFlight, workers);
    workers = kMaxInFlight;
  }
  std::vector<Outcome> outcomes(prompts.size());
  std::atomic<size_t> next{0}, done{0}, failed{0};
  std::mutex progress_mutex;
  const auto start = Clock::now();
  auto last_progress = start;
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&] {
      for (size_t i; (i = next.fetch_add(1)) < prompts.size();) {
        std::this_thread::sleep_until(start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(arrival[i])));
        outcomes[i] = run_one(ep, args, model, prompts[i], args.output_len);
        if (!outcomes[i].ok) ++failed;
        const size_t n = ++done;
        std::lock_guard lock(progress_mutex);  // a line every 10 s on long runs
        if (Clock::now() - last_progress >= std::chrono::seconds(10) && n < prompts.size()) {
          last_progress = Clock::now();
          log_info("bench: {} of {} requests done ({} failed), {:.0f} s", n, prompts.size(), failed.load(),
                   std::chrono::duration<double>(last_progress - start).count());
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  return print_and_save(args, reporting, model, outcomes,
                        std::chrono::duration<double>(Clock::now() - start).count());
}

}  // namespace

void add_bench_command(CLI::App& app) {
  auto args = std::make_shared<BenchArgs>();
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks");
  bench->require_subcommand(1);
  CLI::App* cmd = bench->add_subcommand("serve", "Load-test an OpenAI-compatible server (like `vllm bench serve`)");
  cmd->add_option("--url,--base-url", args->url, "Server base URL (http://host:port)");
  cmd->add_option("--host", args->host, "Server host, with --port instead of --url (vLLM's; default 127.0.0.1)");
  cmd->add_option("--port", args->port, "Server port, with --host (default 8000)");
  cmd->add_option("--model", args->model, "Model name (default: the first of /v1/models)");
  cmd->add_option("--dataset-name,--dataset", args->dataset, "random (random token ids)");
  cmd->add_option("--random-input-len", args->input_len, "Prompt tokens")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--random-output-len", args->output_len, "Generated tokens (ignore_eos)")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--num-prompts", args->num_prompts, "Requests to send")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--request-rate", args->request_rate, "Poisson arrivals per second (0 or inf = all at once)");
  cmd->add_option("--max-concurrency", args->max_concurrency,
                  "Requests in flight at most (0 = no limit: at most 1024, one thread each)");
  cmd->add_option("--seed", args->seed, "Dataset and arrival seed");
  cmd->add_option("--random-vocab-lo", args->vocab_lo, "Lowest random token id");
  cmd->add_option("--random-vocab-hi", args->vocab_hi, "One past the highest random token id");
  cmd->add_option("--save-result", args->save_result, "Write the results as JSON to this file");
  cmd->add_option("--api-key", args->api_key, "Sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)");
  cmd->add_option("--percentile-metrics", args->percentile_metrics,
                  "Metrics with percentiles, comma-separated, of ttft,tpot,itl,e2el");
  cmd->add_option("--metric-percentiles", args->metric_percentiles,
                  "Percentiles to report, comma-separated");
  cmd->add_option("--goodput", args->goodput,
                  "SLOs a request must all meet to count for goodput: ttft:MS tpot:MS e2el:MS")->default_str("");
  cmd->add_option("--timeout", args->timeout_s,
                  "Seconds without a byte from the server before a request fails (0: never)");
  cmd->callback([args] {
    Status status = run_bench(*args);
    if (!status.is_ok()) {
      log_error("{}", status.to_string());
      throw CLI::RuntimeError(1);
    }
  });
}

}  // namespace moe::apps
