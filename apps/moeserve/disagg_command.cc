// The disaggregated roles (docs/disagg.md): `moeserve prefill`, `moeserve
// decode`, `moeserve router`, and `moeserve serve --disagg`, which starts a
// local cluster (prefill and decode instances as child processes, the router
// in this process), supervises the children and stops them all on
// SIGINT/SIGTERM.
#include <fcntl.h>
#include <fmt/ranges.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <thread>

#include "apps/moeserve/load_options.h"
#include "apps/moeserve/serve_command.h"
#include "core/logging.h"
#include "server/disagg_decode.h"
#include "server/disagg_prefill.h"
#include "server/http_client.h"
#include "server/router.h"
#include "tokenizer/tokenizer.h"
#include "transfer/transfer_engine.h"

namespace moe::apps {
namespace {

Status register_with_router(const std::string& router_url, const std::string& role,
                            const std::string& self_url, const std::string& api_key, int max_model_len) {
  MOE_ASSIGN_OR_RETURN(auto url, server::HttpUrl::parse(router_url));
  std::vector<std::pair<std::string, std::string>> headers;
  if (!api_key.empty()) headers.emplace_back("Authorization", "Bearer " + api_key);
  const std::string body =
      nlohmann::json{{"role", role}, {"url", self_url}, {"max_model_len", max_model_len}}.dump();
  MOE_ASSIGN_OR_RETURN(auto reply, server::http_call(url, "POST", "/internal/register", body, 10, headers));
  if (reply.status != 200)
    return unavailable("the router refused the registration: HTTP {} {}", reply.status, reply.body);
  return Status::ok();
}

// The router over `prefill` and `decode` instance URLs, behind the OpenAI API,
// until SIGINT/SIGTERM (`signals`, blocked in every thread).
Status run_router(ServeArgs args, const std::vector<std::string>& prefill,
                  const std::vector<std::string>& decode, const sigset_t& signals,
                  const std::function<void()>& on_listening = {}) {
  if (args.model.empty()) args.model = find_default_model();
  MOE_RETURN_IF_ERROR(check_api_args(args));
  MOE_ASSIGN_OR_RETURN(model::ModelConfig config, load_config(args.model));
  if (args.served_model_name.empty())
    args.served_model_name = std::filesystem::path(args.model).filename().string();
  std::optional<tokenizer::Tokenizer> tok;
  if (std::filesystem::exists(std::filesystem::path(args.model) / "tokenizer.json")) {
    MOE_ASSIGN_OR_RETURN(auto t, tokenizer::Tokenizer::load(args.model));
    tok.emplace(std::move(t));
  }
  // max_model_len as the instances compute it: serve --disagg knows their
  // device; a standalone router takes the model's whole context, as GPU
  // instances do (an instance below it is refused, saying so).
  if (!args.disagg && args.max_model_len == 0 && config.max_position_embeddings > 0)
    args.max_model_len = static_cast<int>(std::min<int64_t>(config.max_position_embeddings, INT32_MAX));
  MOE_ASSIGN_OR_RETURN(auto sched, scheduler_options(args, config, 1));
  server::RouterOptions options;
  options.pool.decode_batch_threshold = args.decode_batch_threshold;
  options.pool.model_name = args.served_model_name;
  options.vocab_size = config.vocab_size;
  options.max_model_len = sched.max_model_len;
  options.pool.max_model_len = sched.max_model_len;  // instances below it are never healthy
  options.max_prefill_retries = args.max_prefill_retries;
  options.lease_s = args.disagg ? 0 : args.lease_s;  // the cluster gives --lease to its decode instances
  options.api_key = args.api_key;
  server::HttpServer http;  // declared first: destroyed last
  server::Router router(options);
  for (const auto& url : prefill)
    MOE_RETURN_IF_ERROR(router.add_instance(server::InstanceRole::kPrefill, url));
  for (const auto& url : decode) MOE_RETURN_IF_ERROR(router.add_instance(server::InstanceRole::kDecode, url));
  router.start();
  server::OpenAiApi api(router, tok ? &*tok : nullptr, api_options(args, sched));
  MOE_RETURN_IF_ERROR(
      http.start(http_options(args), [&](server::HttpRequest r, std::shared_ptr<server::HttpExchange> e) {
        if (!router.handle_internal(r, e)) api.handle(std::move(r), std::move(e));
      }));
  log_info("router: {} prefill and {} decode instance(s), decode batch threshold {}", prefill.size(),
           decode.size(), args.decode_batch_threshold);
  std::printf("moeserve: listening on http://%s:%u (model '%s', disaggregated router)\n", args.host.c_str(),
              http.port(), args.served_model_name.c_str());
  std::fflush(stdout);
  if (on_listening) on_listening();
  int signal_number = 0;
  sigwait(&signals, &signal_number);
  log_info("signal {}: shutting down the router", signal_number);
  http.close_listener();
  router.shutdown();  // each request in flight ends (finish_reason "abort")
  http.stop(kDrainSeconds);
  return Status::ok();
}

// ---- the local cluster of `serve --disagg` ----

struct Child {
  std::string role;
  int index = 0;
  pid_t pid = -1;
  int stdout_fd = -1;  // kept open: the child's stdout must not break
  std::string url;
};

// `gpus`: the instance's GPUs with --device cuda (one per rank).
std::vector<std::string> child_argv(const ServeArgs& a, const std::string& role,
                                    const std::vector<int>& gpus) {
  std::vector<std::string> v = {"moeserve", role, "--model", a.model, "--host", "127.0.0.1", "--port", "0"};
  auto add = [&](const char* flag, const std::string& value) { v.push_back(flag), v.push_back(value); };
  // Prefill instances take the ranks of --tp/--ep; decode instances run one rank each.
  if (role == "prefill" && a.parallel.tp > 1) add("--tp", std::to_string(a.parallel.tp));
  if (role == "prefill" && a.parallel.ep > 1) add("--ep", std::to_string(a.parallel.ep));
  if (a.device.cuda()) {
    add("--device", "cuda");
    if (gpus.size() == 1)
      add("--gpu", std::to_string(gpus[0]));
    else
      add("--gpus", fmt::format("{}", fmt::join(gpus, ",")));
    add("--gpu-memory-utilization", fmt::format("{}", a.device.gpu_memory_utilization));
    if (a.device.enforce_eager) v.push_back("--enforce-eager");
  }
  if (!a.served_model_name.empty()) add("--served-model-name", a.served_model_name);
  if (a.max_num_seqs > 0) add("--max-num-seqs", std::to_string(a.max_num_seqs));  // else the device's default
  if (a.max_model_len > 0) add("--max-model-len", std::to_string(a.max_model_len));
  if (a.max_num_batched_tokens > 0) add("--max-num-batched-tokens", std::to_string(a.max_num_batched_tokens));
  if (a.kv_cache_gb > 0) add("--kv-cache-gb", fmt::format("{}", a.kv_cache_gb));
  add("--page-size", std::to_string(a.page_size));
  add("--kv-dtype", a.kv_dtype);
  if (a.no_prefix_caching) v.push_back("--no-enable-prefix-caching");
  if (a.disable_log_stats) v.push_back("--disable-log-stats");
  add("--threads", std::to_string(a.threads));
  add("--request-timeout", fmt::format("{}", a.request_timeout_s));
  add("--max-waiting", std::to_string(a.max_waiting));
  add("--max-logprobs", std::to_string(a.max_logprobs));
  add("--load-format", a.load.load_format);
  if (a.load.num_layers > 0) add("--num-layers", std::to_string(a.load.num_layers));
  add("--quantization", a.load.quantization);
  if (role == "decode" && a.lease_s > 0) add("--lease", fmt::format("{}", a.lease_s));
  // Both roles speculate alike: prefill sends the MTP state, decode drafts from it.
  if (!a.speculative.config_json.empty()) add("--speculative-config", a.speculative.config_json);
  if (!a.speculative.model_dir.empty()) add("--speculative-model", a.speculative.model_dir);
  return v;
}

Expected<Child> spawn_child(const ServeArgs& args, const std::string& role, int index,
                            const std::vector<int>& gpus) {
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC) != 0) return internal_error("pipe: {}", std::strerror(errno));
  const std::vector<std::string> argv_strings = child_argv(args, role, gpus);
  std::vector<char*> argv;
  for (const auto& s : argv_strings) argv.push_back(const_cast<char*>(s.c_str()));
  argv.push_back(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) return internal_error("fork: {}", std::strerror(errno));
  if (pid == 0) {                      // the child: only async-signal-safe calls until exec
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // no orphans, even if the parent is killed
    if (getppid() != parent) _exit(1);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    dup2(pipe_fds[1], STDOUT_FILENO);
    execv("/proc/self/exe", argv.data());
    _exit(127);
  }
  close(pipe_fds[1]);
  Child c{role, index, pid, pipe_fds[0], ""};
  return c;
}

// The child's first stdout line names its URL ("moeserve: listening on http://...").
Status await_listening(Child& c, double timeout_s) {
  std::string out;
  const double deadline = engine::monotonic_seconds() + timeout_s;
  while (true) {
    const size_t at = out.find("listening on http://");
    if (at != std::string::npos) {
      const size_t end = out.find_first_of(" \n", at + 13);
      if (end != std::string::npos) {
        c.url = out.substr(at + 13, end - at - 13);
        return Status::ok();
      }
    }
    pollfd p{c.stdout_fd, POLLIN, 0};
    const int ms = static_cast<int>((deadline - engine::monotonic_seconds()) * 1000);
    if (ms <= 0) return deadline_exceeded("{} instance {} did not start in {} s", c.role, c.index, timeout_s);
    if (::poll(&p, 1, std::min(ms, 1000)) <= 0) continue;
    char buf[512];
    const ssize_t n = ::read(c.stdout_fd, buf, sizeof buf);
    if (n <= 0)
      return unavailable("{} instance {} exited during start-up (see its log above)", c.role, c.index);
    out.append(buf, static_cast<size_t>(n));
  }
}

void stop_children(std::vector<Child>& children) {
  for (const Child& c : children)
    if (c.pid > 0) kill(c.pid, SIGTERM);
  const double deadline = engine::monotonic_seconds() + 10;
  for (Child& c : children) {
    while (c.pid > 0) {
      const pid_t r = waitpid(c.pid, nullptr, WNOHANG);
      if (r == c.pid || r < 0) {
        c.pid = -1;
        break;
      }
      if (engine::monotonic_seconds() > deadline) kill(c.pid, SIGKILL);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (c.stdout_fd >= 0) close(c.stdout_fd), c.stdout_fd = -1;
  }
}

}  // namespace

Status run_cluster(ServeArgs args) {
  if (args.model.empty()) args.model = find_default_model();
  const ParallelArgs& par = args.parallel;
  if (par.dp > 1)
    return invalid_argument(
        "serve --disagg runs single-rank decode instances; for data-parallel decode ranks run "
        "`moeserve decode --dp N --ep N --router URL` behind `moeserve router` (docs/parallel.md)");
  if (par.tp > 1 && par.ep > 1 && par.tp != par.ep)
    return invalid_argument("--tp {} and --ep {}: with both above 1 they must be equal (docs/parallel.md)",
                            par.tp, par.ep);
  // With --device cuda, GPU slots in order: each prefill instance's ranks
  // (--tp/--ep of them), then one per decode instance; slot s on --gpu + s
  // or --gpus[s].
  const int num_instances = args.prefill_instances + args.decode_instances;
  const int prefill_ranks = par.world();
  const int num_slots = args.prefill_instances * prefill_ranks + args.decode_instances;
  std::vector<std::vector<int>> gpus(static_cast<size_t>(num_instances));
  if (args.device.cuda()) {
    // Named in errors: one GPU per instance, or the slots of multi-rank prefill instances.
    const char* what = prefill_ranks == 1 ? "instances" : "GPU slots (prefill ranks, then decode instances)";
    std::vector<int> taken;
    for (int slot = 0, i = 0; i < num_instances; ++i) {
      const int ranks = i < args.prefill_instances ? prefill_ranks : 1;
      for (int r = 0; r < ranks; ++r, ++slot) {
        MOE_ASSIGN_OR_RETURN(const int gpu, rank_gpu(args.device, slot, num_slots, what));
        if (std::find(taken.begin(), taken.end(), gpu) != taken.end() && args.kv_cache_gb <= 0)
          return invalid_argument(
              "serve --disagg --device cuda: {} sharing GPU {} need --kv-cache-gb (each would size its KV pool "
              "from memory the other is about to take)",
              prefill_ranks == 1 ? "instances" : "instances or ranks", gpu);
        taken.push_back(gpu);
        gpus[i].push_back(gpu);
      }
    }
  } else if (!args.device.gpus.empty() || args.device.gpu != 0) {
    return invalid_argument("--gpu/--gpus only apply with --device cuda");
  }
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);  // every thread from here on; the children unblock
  std::vector<Child> children;
  std::mutex children_mutex;
  auto fail = [&](Status s) {
    std::lock_guard lock(children_mutex);
    stop_children(children);
    return s;
  };
  for (int i = 0; i < num_instances; ++i) {
    const bool prefill = i < args.prefill_instances;
    auto child =
        spawn_child(args, prefill ? "prefill" : "decode", prefill ? i : i - args.prefill_instances, gpus[i]);
    if (!child) return fail(child.status());
    children.push_back(*child);
  }
  std::vector<std::string> prefill_urls, decode_urls;
  for (Child& c : children) {
    if (Status s = await_listening(c, 600); !s.is_ok()) return fail(s);
    (c.role == "prefill" ? prefill_urls : decode_urls).push_back(c.url);
    const std::vector<int>& on = gpus[&c - children.data()];
    log_info("cluster: {} instance {} (pid {}) at {}{}{}", c.role, c.index, c.pid, c.url,
             c.role == "prefill" && prefill_ranks > 1
                 ? fmt::format(", {} ranks (tp {}, ep {})", prefill_ranks, par.tp, par.ep)
                 : std::string(),
             on.empty() ? std::string() : fmt::format(" on GPU {}", fmt::join(on, ",")));
  }
  // The supervisor: a child that dies is logged; the router's health checks
  // take it out of rotation.
  std::atomic<bool> stopping{false};
  std::thread supervisor([&] {
    while (!stopping) {
      {
        std::lock_guard lock(children_mutex);
        for (Child& c : children) {
          int status = 0;
          if (c.pid <= 0 || waitpid(c.pid, &status, WNOHANG) != c.pid) continue;
          if (WIFSIGNALED(status))
            log_error("cluster: {} instance {} (pid {}) was killed by signal {}", c.role, c.index, c.pid,
                      WTERMSIG(status));
          else
            log_error("cluster: {} instance {} (pid {}) exited with status {}", c.role, c.index, c.pid,
                      WEXITSTATUS(status));
          c.pid = -1;
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });
  Status status = run_router(args, prefill_urls, decode_urls, signals);
  stopping = true;
  supervisor.join();
  std::lock_guard lock(children_mutex);
  stop_children(children);
  log_info("cluster: every instance stopped");
  return status;
}

Status run_instance(const ServeArgs& args, engine::Engine& engine, const InstanceKv& kv, server::HttpServer& http,
                    const sigset_t& signals) {
  transfer::EngineOptions transfer_options;
  transfer_options.listen_host = args.transfer_host;
  transfer_options.listen_port = static_cast<uint16_t>(args.transfer_port);
  MOE_ASSIGN_OR_RETURN(transfer_options, transfer::apply_env_overrides(transfer_options));
  MOE_ASSIGN_OR_RETURN(auto transfer, transfer::TransferEngine::create(transfer_options));
  std::unique_ptr<server::DecodeService> decode;
  std::unique_ptr<server::PrefillService> prefill;
  server::HttpHandler handler;
  if (args.role == "decode") {
    server::DecodeServiceOptions o;
    o.model_name = args.served_model_name;
    if (args.lease_s > 0) o.default_lease_s = args.lease_s;
    MOE_ASSIGN_OR_RETURN(decode, server::DecodeService::create(engine, *transfer, *kv.rank_caches.at(0), o));
    handler = [&decode](server::HttpRequest r, std::shared_ptr<server::HttpExchange> e) {
      decode->handle(std::move(r), std::move(e));
    };
  } else {
    server::PrefillServiceOptions o;
    o.model_name = args.served_model_name;
    o.fault_abort_ack_delay_s = args.fault_abort_ack_delay_s;
    MOE_ASSIGN_OR_RETURN(prefill, server::PrefillService::create(engine, *transfer, kv.rank_caches, kv.num_kv_heads, o));
    handler = [&prefill](server::HttpRequest r, std::shared_ptr<server::HttpExchange> e) {
      prefill->handle(std::move(r), std::move(e));
    };
  }
  server::HttpServerOptions http_opts = http_options(args);
  http_opts.max_body_bytes = server::disagg::kMaxInternalBodyBytes;
  http_opts.read_timeout_s = std::max(http_opts.read_timeout_s, 60.0);
  MOE_RETURN_IF_ERROR(http.start(http_opts, handler));
  const std::string self_url = fmt::format("http://{}:{}", args.host, http.port());
  if (decode) decode->set_self_url(self_url);  // prefill instances send their commits there
  std::printf("moeserve: listening on %s (%s instance, transfer %s)\n", self_url.c_str(), args.role.c_str(),
              transfer->endpoint().c_str());
  std::fflush(stdout);
  log_info("{} instance listening on {}, TransferEngine at {}", args.role, self_url, transfer->endpoint());
  if (!args.router_url.empty()) {
    Status s = register_with_router(args.router_url, args.role, self_url, args.api_key,
                                    engine.options().scheduler.max_model_len);
    if (!s.is_ok()) log_error("could not register with the router {}: {}", args.router_url, s.to_string());
  }
  int signal_number = 0;
  sigwait(&signals, &signal_number);
  log_info("signal {}: shutting down the {} instance", signal_number, args.role);
  http.close_listener();
  engine.shutdown();  // its last outputs still reach the service
  http.stop(kDrainSeconds);
  decode.reset();
  prefill.reset();
  return Status::ok();
}

void add_cluster_options(CLI::App* cmd, ServeArgs& args) {
  cmd->add_flag("--disagg", args.disagg,
                "Run a local disaggregated cluster: router + prefill + decode processes");
  cmd->add_option("--prefill-instances", args.prefill_instances, "Prefill instances of --disagg")
      ->check(CLI::Range(1, 64));
  cmd->add_option("--decode-instances", args.decode_instances, "Decode instances of --disagg")
      ->check(CLI::Range(1, 64));
  cmd->add_option("--decode-batch-threshold", args.decode_batch_threshold,
                  "Router: keep each decode batch under this many sequences when possible")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--max-prefill-retries", args.max_prefill_retries,
                  "Router: prefill retries on another instance")
      ->check(CLI::Range(0, 16));
  cmd->add_option("--lease", args.lease_s,
                  "Seconds a decode reservation waits for its KV before it is aborted")
      ->check(CLI::Range(0.01, 1e6));
}

void add_disagg_commands(CLI::App& app) {
  for (const char* role : {"prefill", "decode"}) {
    auto args = std::make_shared<ServeArgs>();
    args->role = role;
    CLI::App* cmd =
        app.add_subcommand(role, std::string("Run a ") + role + " instance of a disaggregated deployment");
    add_engine_options(cmd, *args);
    cmd->add_option("--transfer-host", args->transfer_host,
                    "Address of the TransferEngine listener");
    cmd->add_option("--transfer-port", args->transfer_port, "Port of the TransferEngine listener (0: any)")
        ->check(CLI::Range(0, 65535));
    cmd->add_option("--router", args->router_url,
                    "Register with this router (http://host:port) once listening");
    if (std::string(role) == "prefill")
      cmd->add_option("--fault-delay-abort-ack", args->fault_abort_ack_delay_s,
                      "Fault injection (tests): acknowledge aborts after this many seconds");
    if (std::string(role) == "decode")
      cmd->add_option("--lease", args->lease_s, "Seconds a reservation waits for its KV before it is aborted")
          ->check(CLI::Range(0.01, 1e6));
    cmd->callback([args] {
      Status status = run_serve(*args);
      if (!status.is_ok()) {
        log_error("{}", status.to_string());
        throw CLI::RuntimeError(1);
      }
    });
  }
  auto args = std::make_shared<ServeArgs>();
  auto prefill = std::make_shared<std::vector<std::string>>();
  auto decode = std::make_shared<std::vector<std::string>>();
  CLI::App* cmd = app.add_subcommand(
      "router", "Run the disaggregated router (the OpenAI API) over prefill and decode instances");
  cmd->add_option("--model", args->model,
                  "Model directory: its tokenizer, chat template and config (default: the demo)");
  cmd->add_option("--served-model-name", args->served_model_name, "Model name in the API");
  cmd->add_option("--host", args->host, "Address to bind");
  cmd->add_option("--port", args->port, "Port (0: any free port)")->check(CLI::Range(0, 65535));
  cmd->add_option("--api-key", args->api_key, "Require 'Authorization: Bearer KEY' on the API");
  cmd->add_option("--prefill", *prefill, "Prefill instance URLs (http://host:port)")->default_str("");
  cmd->add_option("--decode", *decode, "Decode instance URLs (http://host:port)")->default_str("");
  cmd->add_option("--max-model-len", args->max_model_len,
                  "As the instances' --max-model-len (default: the model's max_position_embeddings)")
      ->default_str("");
  cmd->add_option("--request-timeout", args->request_timeout_s,
                  "Deadline of each request in seconds (0 = none)");
  cmd->add_option("--http-threads", args->http_threads, "HTTP I/O threads")->check(CLI::Range(1, 64));
  cmd->add_option("--max-body-bytes", args->max_body_bytes, "Largest request body (413 above)");
  cmd->add_option("--read-timeout", args->read_timeout_s, "Seconds to receive a request");
  cmd->add_option("--max-connections", args->max_connections, "Open connections before 503 + close");
  cmd->add_option("--max-n", args->max_n, "Largest n")->check(CLI::Range(1, 1024));
  cmd->add_option("--max-logprobs", args->max_logprobs, "Largest logprobs")->check(CLI::Range(0, 1000));
  add_api_options(cmd, *args);
  add_cluster_options(cmd, *args);
  cmd->callback([args, prefill, decode] {
    sigset_t signals;
    sigemptyset(&signals);
    sigaddset(&signals, SIGINT);
    sigaddset(&signals, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &signals, nullptr);
    Status status = run_router(*args, *prefill, *decode, signals);
    if (!status.is_ok()) {
      log_error("{}", status.to_string());
      throw CLI::RuntimeError(1);
    }
  });
}

}  // namespace moe::apps
