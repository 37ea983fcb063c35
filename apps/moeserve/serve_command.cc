#include "apps/moeserve/serve_command.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "apps/moeserve/device_options.h"
#include "comm/cpu/shm_communicator.h"
#include "core/logging.h"
#include "engine/engine.h"
#include "engine/rank_group.h"
#include "model/config.h"
#include "model/qwen3_moe.h"
#include "model/weights.h"
#ifdef MOE_WITH_CUDA
#include "apps/moeserve/gpu_ranks.h"
#include "engine/cuda_runner.h"
#endif
#include "server/http_server.h"
#include "server/openai_api.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace moe::apps {

struct GpuRanks;  // CUDA builds: the GPU ranks of an instance (gpu_ranks.h)

// Sampling defaults from DIR/generation_config.json (temperature, top_p,
// top_k, min_p, repetition_penalty), as vLLM applies them; OpenAI's defaults when absent.
engine::SamplingParams generation_defaults(const std::string& model_dir) {
  engine::SamplingParams s;
  std::ifstream in(std::filesystem::path(model_dir) / "generation_config.json");
  if (!in.good()) return s;
  const auto j = nlohmann::json::parse(in, nullptr, false);
  if (!j.is_object()) return s;
  if (j.contains("temperature") && j["temperature"].is_number()) s.temperature = j["temperature"].get<float>();
  if (j.contains("top_p") && j["top_p"].is_number()) s.top_p = j["top_p"].get<float>();
  if (j.contains("top_k") && j["top_k"].is_number_integer()) s.top_k = std::max(0, j["top_k"].get<int>());
  if (j.contains("min_p") && j["min_p"].is_number()) s.min_p = j["min_p"].get<float>();
  if (j.contains("repetition_penalty") && j["repetition_penalty"].is_number())
    s.repetition_penalty = j["repetition_penalty"].get<float>();
  if (!engine::validate_sampling(s).is_ok()) return {};
  return s;
}

// The demo model ships with the source tree; an installed binary looks next to itself.
std::string find_default_model() {
  namespace fs = std::filesystem;
  const fs::path source = fs::path(MOE_SOURCE_DIR) / "models" / "moeserve-demo";
  if (fs::exists(source / "config.json")) return source.string();
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  for (const fs::path& p : {exe.parent_path() / "../models/moeserve-demo", exe.parent_path() / "../../models/moeserve-demo"})
    if (!ec && fs::exists(p / "config.json")) return fs::weakly_canonical(p).string();
  return source.string();
}

Expected<engine::SchedulerOptions> scheduler_options(const ServeArgs& args, const model::ModelConfig& config,
                                                     size_t page_bytes_all_layers) {
  engine::SchedulerOptions s;
  s.page_size = args.page_size;
  const bool gpu = args.device.cuda();
  s.max_num_seqs = args.max_num_seqs > 0 ? args.max_num_seqs : gpu ? kDefaultGpuMaxNumSeqs : kDefaultCpuMaxNumSeqs;
  s.max_num_batched_tokens = args.max_num_batched_tokens > 0 ? args.max_num_batched_tokens
                             : gpu                          ? kDefaultGpuMaxNumBatchedTokens
                                                            : kDefaultCpuMaxNumBatchedTokens;
  s.enable_prefix_caching = !args.no_prefix_caching;
  const int64_t model_max = config.max_position_embeddings > 0 ? config.max_position_embeddings : 4096;
  // GPUs serve the model's whole context by default (their pool is sized from
  // memory and must hold one such sequence); the CPU's 1 GB pool, 4096 tokens.
  s.max_model_len = args.max_model_len > 0 ? args.max_model_len
                    : gpu                  ? static_cast<int>(std::min<int64_t>(model_max, INT32_MAX))
                                           : static_cast<int>(std::min<int64_t>(model_max, kDefaultCpuMaxModelLen));
  if (s.max_model_len > model_max)
    return invalid_argument("--max-model-len {} is over the model's max_position_embeddings {}", s.max_model_len, model_max);
  const int64_t pages_per_seq = (s.max_model_len + s.page_size - 1) / s.page_size;
  if (args.device.cuda()) return s;  // the CUDA model sizes its pool (cuda_model_options) and sets num_pages
  const double gb = args.kv_cache_gb > 0 ? args.kv_cache_gb : kDefaultCpuKvCacheGb;
  const auto budget_pages = static_cast<int64_t>(gb * 1e9 / static_cast<double>(page_bytes_all_layers));
  s.num_pages = static_cast<int32_t>(std::min<int64_t>(budget_pages, pages_per_seq * s.max_num_seqs));
  if (s.num_pages < pages_per_seq)
    return invalid_argument("--kv-cache-gb {} holds {} pages; one sequence of --max-model-len {} needs {}", gb,
                            budget_pages, s.max_model_len, pages_per_seq);
  return s;
}

server::ApiOptions api_options(const ServeArgs& args, const engine::SchedulerOptions& sched) {
  server::ApiOptions o;
  o.model_name = args.served_model_name;
  o.api_key = args.api_key;
  o.limits.max_model_len = sched.max_model_len;
  o.limits.max_n = args.max_n;
  o.limits.max_logprobs = args.max_logprobs;
  o.limits.max_waiting = args.max_waiting;
  o.limits.default_sampling = generation_defaults(args.model);
  o.reasoning_parser_qwen3 = args.reasoning_parser == "qwen3";
  if (args.tool_call_parser == "hermes") o.tool_call_parser = server::ToolCallFormat::kHermes;
  if (args.tool_call_parser == "qwen3_coder") o.tool_call_parser = server::ToolCallFormat::kQwen3Coder;
  o.request_timeout_s = args.request_timeout_s;
  o.chat_template = args.chat_template_text;
  return o;
}

server::HttpServerOptions http_options(const ServeArgs& args) {
  server::HttpServerOptions o;
  o.host = args.host;
  o.port = static_cast<uint16_t>(args.port);
  o.num_threads = args.http_threads;
  o.max_body_bytes = args.max_body_bytes;
  o.read_timeout_s = args.read_timeout_s;
  o.max_connections = args.max_connections;
  return o;
}

// The effective configuration, the sampling defaults and the KV capacity.
static void log_startup(const ServeArgs& args, const engine::SchedulerOptions& sched, const kv::KvCacheLayout& layout,
                 int num_threads) {
  const auto num_layers = static_cast<size_t>(layout.num_layers);
  const int64_t kv_tokens = static_cast<int64_t>(sched.num_pages) * sched.page_size;
  log_info(
      "config: model={} served as '{}', device={}, threads={}, max_num_seqs={}, max_model_len={}, "
      "max_num_batched_tokens={}, page_size={}, kv_dtype={}, prefix_caching={}, reasoning_parser={}, "
      "tool_call_parser={}",
      args.model, args.served_model_name, args.device.device, num_threads, sched.max_num_seqs,
      sched.max_model_len, sched.max_num_batched_tokens, sched.page_size, args.kv_dtype,
      sched.enable_prefix_caching ? "on" : "off",
      args.reasoning_parser.empty() ? "none" : args.reasoning_parser,
      args.tool_call_parser.empty() ? "none" : args.tool_call_parser);
  const engine::SamplingParams defaults = generation_defaults(args.model);
  log_info(
      "sampling defaults (generation_config.json): temperature={} top_p={} top_k={} min_p={} "
      "repetition_penalty={}",
      defaults.temperature, defaults.top_p, defaults.top_k, defaults.min_p, defaults.repetition_penalty);
  log_info("KV cache: {} pages, {} tokens, {:.1f} MB; maximum concurrency at max_model_len {}: {:.1f}x", sched.num_pages,
           kv_tokens, static_cast<double>(layout.page_bytes() * num_layers * sched.num_pages) / 1e6,
           sched.max_model_len, static_cast<double>(kv_tokens) / sched.max_model_len);
}

// Reads the checkpoint files once, showing progress (a bar on a terminal,
// a line per 10% otherwise), so the loader that follows maps them from the
// page cache: on a large model the disk read is what takes the time.
static void prefetch_weights(const std::string& model_dir) {
  namespace fs = std::filesystem;
  std::vector<fs::path> files;
  uintmax_t total = 0;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(model_dir, ec))
    if (entry.path().extension() == ".safetensors") files.push_back(entry.path()), total += entry.file_size(ec);
  if (files.empty() || total == 0) return;
  // A checkpoint that would not stay in the page cache would be read twice.
  const auto free_bytes = static_cast<double>(sysconf(_SC_AVPHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGESIZE));
  if (static_cast<double>(total) > 0.5 * free_bytes) return;
  std::sort(files.begin(), files.end());
  const bool tty = isatty(STDERR_FILENO) != 0;
  std::vector<char> buffer(size_t{16} << 20);
  uintmax_t done = 0;
  int last_decile = -1;
  for (const auto& file : files) {
    std::ifstream in(file, std::ios::binary);
    while (in.read(buffer.data(), static_cast<std::streamsize>(buffer.size())) || in.gcount() > 0) {
      done += static_cast<uintmax_t>(in.gcount());
      const double frac = static_cast<double>(done) / static_cast<double>(total);
      if (tty) {
        const int width = 40, filled = static_cast<int>(frac * width);
        std::fprintf(stderr, "\rloading weights [%s%s] %5.1f%% of %.1f MB", std::string(filled, '#').c_str(),
                     std::string(width - filled, ' ').c_str(), 100 * frac, static_cast<double>(total) / 1e6);
      } else if (static_cast<int>(frac * 10) > last_decile) {
        last_decile = static_cast<int>(frac * 10);
        log_info("loading weights: {:.0f}% of {:.1f} MB ({} files)", 100 * frac, static_cast<double>(total) / 1e6,
                 files.size());
      }
    }
  }
  if (tty) std::fprintf(stderr, "\n");
}

namespace {

Status check_parallel_args(const ServeArgs& args) {
  const ParallelArgs& p = args.parallel;
  if (p.dp > 1 && (args.role != "decode" || args.router_url.empty()))
    return invalid_argument("--dp runs data-parallel decode ranks, each registering with the router as its own "
                            "decode endpoint: use `moeserve decode --dp N --ep N --router URL`");
  if (p.dp > 1 && (p.tp != 1 || p.ep != p.dp))
    return invalid_argument("--dp {} needs --ep {} (experts split over the same ranks) and --tp 1", p.dp,
                            p.dp);
  if (p.world() > 1 && p.dp == 1 && args.role == "decode")
    return invalid_argument("a decode instance runs data-parallel ranks: use --dp N --ep N, not --tp");
  return Status::ok();
}

Expected<std::unique_ptr<comm::Communicator>> open_rank_communicator(const std::string& group, int rank, int world) {
  comm::ShmGroupOptions o;
  o.name = group, o.rank = rank, o.world_size = world;
  // A rank lost inside a collective fails the step after this long; a step's
  // longest wait is one layer of the slowest rank's chunk.
  o.timeout_ms = 30000;
  return comm::open_shm_communicator(o);
}

// One zeroed KV region per follower (rank 1..world-1), `layout` with `num_pages`.
Expected<std::vector<kv::ShmRegion>> create_follower_kv(const std::string& group, int world, kv::KvCacheLayout layout,
                                                        int32_t num_pages) {
  layout.num_pages = num_pages;
  const size_t bytes = layout.num_bytes();
  std::vector<kv::ShmRegion> regions;
  for (int rank = 1; rank < world; ++rank) {
    MOE_ASSIGN_OR_RETURN(auto region, kv::ShmRegion::create(engine::kv_region_name(group, rank), bytes));
    regions.push_back(std::move(region));
  }
  return regions;
}

// The weights this process holds on the host: a checkpoint's, or dummy ones
// (every rank draws the same, from seed 0); none for dummy weights on a GPU,
// which the GPU draws itself.
Expected<std::optional<model::ModelWeights>> host_weights(const ServeArgs& args, const ResolvedModel& resolved,
                                                          ThreadPool& pool) {
  if (!resolved.dummy) {
    MOE_ASSIGN_OR_RETURN(auto weights, model::ModelWeights::load(args.model, resolved.config, pool));
    return std::optional<model::ModelWeights>(std::move(weights));
  }
  if (args.device.cuda()) return std::optional<model::ModelWeights>();
  log_info("dummy weights ({}): {} layers drawn at random", ops::quant_format_name(resolved.dummy_format),
           resolved.config.num_layers);
  return std::optional<model::ModelWeights>(model::ModelWeights::dummy(resolved.config, 0, pool, resolved.dummy_format));
}

// Ranks 1.. of a --tp/--ep instance: the same model load, then the leader's
// step plans until it stops or goes away.
Status run_rank_follower(const ServeArgs& args, const ResolvedModel& resolved) {
  const model::ModelConfig& config = resolved.config;
  sigset_t signals;  // the leader handles Ctrl-C and stops this rank in order
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  const ParallelArgs& p = args.parallel;
  MOE_ASSIGN_OR_RETURN(auto comm, open_rank_communicator(p.internal_group, p.internal_rank, p.world()));
  ThreadPool pool(args.threads);
  MOE_ASSIGN_OR_RETURN(std::optional<model::ModelWeights> weights, host_weights(args, resolved, pool));
  const model::ParallelPlan plan{p.tp, p.tp > 1 ? p.internal_rank : 0, p.ep, p.ep > 1 ? p.internal_rank : 0, false,
                                 comm.get()};
  MOE_RETURN_IF_ERROR(model::check_parallel_plan(config, *weights, plan));
  model::Qwen3MoeModel model(*weights, plan);
  MOE_ASSIGN_OR_RETURN(DType kv_dtype, dtype_from_name(args.kv_dtype));
  const kv::KvCacheLayout layout{config.num_layers, model.shard().num_kv_heads, config.head_dim, args.page_size,
                                 p.internal_num_pages, kv_dtype};
  MOE_ASSIGN_OR_RETURN(auto kv_memory, kv::ShmRegion::open(engine::kv_region_name(p.internal_group, p.internal_rank),
                                                           layout.num_bytes()));
  // Ready: weights loaded and the KV region mapped (the leader then unlinks its name).
  MOE_RETURN_IF_ERROR(engine::signal_ready(p.internal_plan_fd));
  return engine::run_follower(model, pool, layout, kv_memory.data(), p.internal_plan_fd);
}

#ifdef MOE_WITH_CUDA
model::CudaModelOptions cuda_model_options(const ServeArgs& args, const engine::SchedulerOptions& sched, int device) {
  model::CudaModelOptions cuda;
  cuda.device = device;
  cuda.page_size = sched.page_size;
  cuda.max_num_tokens = std::max(sched.max_num_batched_tokens, sched.max_num_seqs);
  cuda.max_num_seqs = sched.max_num_seqs;
  // The logits rows a step can ask for: each sequence's sampled row and its
  // drafts' (speculative verification, and the MTP's first pass), then the
  // prompt-logprobs rows the scheduler lets into a step.
  const Expected<engine::SpeculativeConfig> spec = check_speculative(args.speculative);
  const int drafts = spec && spec->enabled() ? spec->num_speculative_tokens : 0;
  cuda.max_logits_rows = sched.max_num_seqs * (1 + drafts) + sched.max_prompt_logits_tokens;
  cuda.max_model_len = sched.max_model_len;
  cuda.gpu_memory_utilization = args.device.gpu_memory_utilization;
  cuda.kv_cache_bytes = args.kv_cache_gb * 1e9;  // 0: what --gpu-memory-utilization leaves after a warm-up pass
  cuda.use_cuda_graphs = !args.device.enforce_eager;
  return cuda;
}

model::ParallelPlan rank_plan_of(const ParallelArgs& p) {
  if (p.dp > 1) return {1, 0, p.ep, p.internal_rank, true, nullptr};
  return {p.tp, p.tp > 1 ? p.internal_rank : 0, p.ep, p.ep > 1 ? p.internal_rank : 0, false, nullptr};
}

// Ranks 1.. of a GPU instance: their share of the model, then the leader's plans.
Status run_gpu_rank_follower(const ServeArgs& args, const ResolvedModel& resolved,
                             const engine::SchedulerOptions& sched) {
  const model::ModelConfig& config = resolved.config;
  sigset_t signals;  // the leader handles Ctrl-C and stops this rank in order
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  exit_when_leader_exits(args.parallel.internal_plan_fd);
  const int max_tokens = std::max(sched.max_num_batched_tokens, sched.max_num_seqs);
  MOE_ASSIGN_OR_RETURN(GpuRanks g, meet_gpu_ranks(args, max_tokens, config));
  ThreadPool pool(args.threads);
  MOE_ASSIGN_OR_RETURN(std::optional<model::ModelWeights> weights, host_weights(args, resolved, pool));
  model::CudaModelOptions cuda = cuda_model_options(args, sched, g.device);
  cuda.plan = rank_plan_of(args.parallel);
  cuda.comm = g.comm.get();
  cuda.dummy_expert_format = resolved.dummy_format;  // dummy weights: every rank draws from seed 0
  MOE_ASSIGN_OR_RETURN(auto model, weights ? model::CudaQwen3MoeModel::create(*weights, cuda)
                                           : model::CudaQwen3MoeModel::create_dummy(config, 0, cuda));
  MOE_RETURN_IF_ERROR(agree_on_pages(*g.bootstrap, model->num_pages()).status());
  if (sends_rank_kv(args)) MOE_RETURN_IF_ERROR(share_kv_pools(*g.bootstrap, *model).status());
  MOE_RETURN_IF_ERROR(engine::signal_ready(args.parallel.internal_plan_fd));
  return engine::run_cuda_follower(*model, args.parallel.internal_plan_fd);
}
#endif

}  // namespace

namespace {

// Validates the flags that need no files and fills the defaults that depend on others.
Status check_serve_args(ServeArgs& args) {
  MOE_RETURN_IF_ERROR(check_device(args.device));
  if (!args.model_positional.empty()) {  // vLLM's `serve MODEL`
    if (!args.model.empty() && args.model != args.model_positional)
      return invalid_argument("the model is given twice: '{}' and --model '{}'", args.model_positional, args.model);
    args.model = args.model_positional;
  }
  if (args.model.empty()) args.model = find_default_model();
  if (args.page_size < 1 || args.page_size > 1024) return invalid_argument("--page-size must be in [1, 1024]");
  MOE_RETURN_IF_ERROR(check_api_args(args));
  if (args.dtype != "auto" && args.dtype != "bfloat16" && args.dtype != "bf16")
    return invalid_argument("--dtype: auto or bfloat16 (moeserve runs bf16 weights and activations on GPUs, f32 on "
                            "the CPU), got '{}'",
                            args.dtype);
  if (args.enable_expert_parallel) {  // vLLM: the experts split over every rank
    ParallelArgs& p = args.parallel;
    if (p.ep != 1 && p.ep != p.tp * p.dp)
      return invalid_argument("--enable-expert-parallel splits the experts over --tp x --dp = {} ranks, but --ep is {}",
                              p.tp * p.dp, p.ep);
    p.ep = p.tp * p.dp;
  }
  if (args.device.cuda()) args.kv_dtype = "bf16";  // the GPU's KV pages are bf16
  if (args.kv_dtype != "f32" && args.kv_dtype != "bf16") return invalid_argument("--kv-dtype must be f32 or bf16");
  if (args.served_model_name.empty()) args.served_model_name = std::filesystem::path(args.model).filename().string();
  return check_parallel_args(args);
}

}  // namespace

Status check_api_args(ServeArgs& args) {
  if (!args.reasoning_parser.empty() && args.reasoning_parser != "qwen3")
    return invalid_argument("--reasoning-parser: only qwen3 is supported, got '{}'", args.reasoning_parser);
  if (!args.tool_call_parser.empty() && args.tool_call_parser != "hermes" &&
      args.tool_call_parser != "qwen3_coder")
    return invalid_argument(
        "--tool-call-parser: hermes (Qwen2.5, Qwen3) or qwen3_coder (Qwen3-Coder, Qwen3.5), got '{}'",
        args.tool_call_parser);
  if (args.enable_auto_tool_choice && args.tool_call_parser.empty())
    return invalid_argument("--enable-auto-tool-choice needs --tool-call-parser (hermes or qwen3_coder)");
  if (!args.chat_template.empty()) {  // a file, or the template itself (as vLLM)
    const std::string& t = args.chat_template;
    std::error_code ec;
    if (std::filesystem::is_regular_file(t, ec)) {
      std::ifstream in(t, std::ios::binary);
      if (!in) return invalid_argument("--chat-template: cannot read {}", t);
      args.chat_template_text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
      if (args.chat_template_text.empty()) return invalid_argument("--chat-template: {} is empty", t);
    } else if (t.find("{{") != std::string::npos || t.find("{%") != std::string::npos) {
      args.chat_template_text = t;
    } else {
      return invalid_argument("--chat-template: no file '{}' (and no Jinja template in the text)", t);
    }
    auto compiled = tokenizer::ChatTemplate::create(args.chat_template_text);
    if (!compiled) return invalid_argument("--chat-template does not parse: {}", compiled.status().message());
  }
  return Status::ok();
}

namespace {

// This process's view of a multi-rank instance (docs/parallel.md).
struct RankGroup {
  std::unique_ptr<comm::Communicator> comm;  // null: a single rank
  std::optional<Followers> followers;        // the leader's; outlives the engine, whose runner stops them
  std::vector<kv::ShmRegion> follower_kv;    // TP/EP followers' KV caches, which the leader reads
};

// A leader starts ranks 1.. (and their KV regions); every rank joins the group.
Expected<RankGroup> join_rank_group(const ParallelArgs& par, const model::ParallelPlan& plan,
                                    const kv::KvCacheLayout& layout, int32_t num_pages) {
  RankGroup g;
  if (plan.single()) return g;
  std::string group = par.internal_group;
  if (!par.follower()) {
    group = new_group_name();
    if (!plan.dp_attention) {
      MOE_ASSIGN_OR_RETURN(g.follower_kv, create_follower_kv(group, par.world(), layout, num_pages));
    }
    MOE_ASSIGN_OR_RETURN(auto started, spawn_followers(par, group, num_pages));
    g.followers.emplace(std::move(started));
  }
  MOE_ASSIGN_OR_RETURN(g.comm, open_rank_communicator(group, par.internal_rank, par.world()));
  return g;
}

// Once this rank's model is built: a DP follower says so (and goes with its
// leader); a leader waits for every rank.
Status rank_group_ready(RankGroup& g, const ParallelArgs& par) {
  if (!g.comm) return Status::ok();
  if (par.follower()) {
    MOE_RETURN_IF_ERROR(engine::signal_ready(par.internal_plan_fd));
    stop_when_leader_exits(par.internal_plan_fd);
    return Status::ok();
  }
  MOE_RETURN_IF_ERROR(engine::wait_for_followers(g.followers->fds));  // every rank has its weights
  for (kv::ShmRegion& region : g.follower_kv) region.unlink();        // and has mapped its KV region
  log_info("{} ranks ready (tp {}, ep {}, dp {})", g.comm->world_size(), par.tp, par.ep, par.dp);
  return Status::ok();
}

struct Runner {
  std::unique_ptr<engine::ModelRunner> runner;
  // The KV the roles send: every rank's with heads split (device memory on GPUs).
  std::vector<const kv::KvCache*> rank_caches;
  std::unique_ptr<engine::MtpRunner> mtp;       // the MTP layer on the GPU (with `mtp` given to make_runner)
#ifdef MOE_WITH_CUDA
  // A GPU prefill leader's view of its ranks' KV.
  std::vector<std::unique_ptr<engine::SharedKvPool>> gpu_rank_kv;
#endif
};

// The model runner of this rank: CUDA, a DP rank's, a TP/EP leader's, or the
// single CPU rank's. Sets the page count (the GPU's comes from its memory).
// On the GPU, `mtp` (speculative decoding) runs there too.
// `gpu`: this leader's GPU ranks (--tp/--ep with --device cuda), else null.
// `weights`: null for dummy weights on the GPU; `model`: the CPU model (null on the GPU).
Expected<Runner> make_runner(const ServeArgs& args, const ResolvedModel& resolved,
                             const model::ModelWeights* weights, const model::Qwen3MoeModel* model, ThreadPool& pool,
                             kv::KvCacheLayout& layout, engine::SchedulerOptions& sched, RankGroup& group,
                             const model::MtpWeights* mtp, GpuRanks* gpu) {
  Runner r;
  (void)args, (void)resolved, (void)weights, (void)mtp, (void)gpu;
#ifdef MOE_WITH_CUDA
  if (args.device.cuda()) {
    // The KV pool takes what --gpu-memory-utilization leaves after the weights.
    model::CudaModelOptions cuda = cuda_model_options(args, sched, gpu ? gpu->device : args.device.gpu);
    cuda.mtp = mtp;
    if (gpu != nullptr) {
      cuda.plan = rank_plan_of(args.parallel);
      cuda.comm = gpu->comm.get();  // create() meets the other ranks before its first collective
      cuda.experts = gpu->experts.get();
    }
    cuda.dummy_expert_format = resolved.dummy_format;  // dummy weights only
    MOE_ASSIGN_OR_RETURN(auto cuda_runner, engine::CudaRunner::create(resolved.config, weights, 0, cuda));
    sched.num_pages = cuda_runner->num_pages();
    if (gpu != nullptr && gpu->experts) {  // a data-parallel rank: its own pages, stepping with its peers
      MOE_RETURN_IF_ERROR(gpu_ranks_ready(*gpu, args.parallel));
      cuda_runner->step_in_lockstep([bootstrap = gpu->bootstrap.get()](float ballot) -> Expected<float> {
        const auto* bytes = reinterpret_cast<const uint8_t*>(&ballot);
        MOE_ASSIGN_OR_RETURN(auto all, bootstrap->all_gather(std::span<const uint8_t>(bytes, sizeof ballot)));
        float sum = 0.0f;
        for (const auto& blob : all) {
          if (blob.size() != sizeof(float))
            return internal_error("a rank sent {} bytes for its vote", blob.size());
          float theirs = 0.0f;
          std::memcpy(&theirs, blob.data(), sizeof theirs);
          sum += theirs;
        }
        return sum;
      });
    } else if (gpu != nullptr) {
      MOE_ASSIGN_OR_RETURN(sched.num_pages, agree_on_pages(*gpu->bootstrap, sched.num_pages));
      if (sends_rank_kv(args)) {
        MOE_ASSIGN_OR_RETURN(r.gpu_rank_kv, share_kv_pools(*gpu->bootstrap, cuda_runner->model()));
      }
      MOE_RETURN_IF_ERROR(engine::wait_for_followers(gpu->followers->fds));
      log_info("{} GPU ranks ready (tp {}, ep {}), {} KV pages each", args.parallel.world(), args.parallel.tp,
               args.parallel.ep, sched.num_pages);
      cuda_runner->lead(std::exchange(gpu->followers->fds, {}));
    }
    layout.num_pages = sched.num_pages;
    r.rank_caches = {&cuda_runner->cache()};
    for (const auto& shared : r.gpu_rank_kv) r.rank_caches.push_back(&shared->cache());
    r.mtp = cuda_runner->mtp_runner();
    r.runner = std::move(cuda_runner);
    return r;
  }
#endif
  layout.num_pages = sched.num_pages;
  CHECK(model != nullptr, "the CPU runners have a CPU model");
  if (group.comm && model->plan().dp_attention) {
    auto rank_runner = std::make_unique<engine::LockstepRunner>(*model, pool, layout);
    r.rank_caches = {&rank_runner->cache()};
    r.runner = std::move(rank_runner);
  } else if (group.comm) {
    auto leader = std::make_unique<engine::LeaderRunner>(*model, pool, layout, std::exchange(group.followers->fds, {}),
                                                         std::move(group.follower_kv));
    r.rank_caches = leader->rank_caches();
    // Heads whole on every rank (--ep alone): the leader's pages are the KV to send.
    if (args.parallel.tp == 1) r.rank_caches.resize(1);
    r.runner = std::move(leader);
  } else {
    auto cpu_runner = std::make_unique<engine::Qwen3Runner>(*model, pool, layout);
    r.rank_caches = {&cpu_runner->cache()};
    r.runner = std::move(cpu_runner);
  }
  return r;
}

engine::EngineOptions engine_options(const model::ModelConfig& config, const engine::SchedulerOptions& sched,
                                     const ServeArgs& args, const tokenizer::Tokenizer* tok) {
  engine::EngineOptions o;
  o.scheduler = sched;
  o.max_waiting = args.max_waiting;
  o.log_stats = !args.disable_log_stats;
  if (tok) o.eos_token_ids.assign(tok->special_tokens().eos_ids.begin(), tok->special_tokens().eos_ids.end());
  if (tok) o.vocabulary = structured::TokenVocabulary::from_tokenizer(*tok, config.vocab_size);  // structured outputs
  if (o.eos_token_ids.empty()) o.eos_token_ids.assign(config.eos_token_ids.begin(), config.eos_token_ids.end());
  return o;
}

// The OpenAI API over `engine` until SIGINT/SIGTERM.
Status serve_api(const ServeArgs& args, engine::Engine& engine, const tokenizer::Tokenizer* tok,
                 const engine::SchedulerOptions& sched, server::HttpServer& http, const sigset_t& signals) {
  server::EngineBackend backend(engine);
  server::OpenAiApi api(backend, tok, api_options(args, sched));
  MOE_RETURN_IF_ERROR(http.start(http_options(args), [&api](server::HttpRequest r, std::shared_ptr<server::HttpExchange> e) {
    api.handle(std::move(r), std::move(e));
  }));
  std::printf("moeserve: listening on http://%s:%u (model '%s')\n", args.host.c_str(), http.port(),
              args.served_model_name.c_str());
  std::fflush(stdout);
  log_info("listening on http://{}:{}", args.host, http.port());
  int signal_number = 0;
  sigwait(&signals, &signal_number);
  log_info("signal {}: shutting down", signal_number);
  http.close_listener();
  engine.shutdown();  // fails the requests in flight: their errors go out
  http.stop(kDrainSeconds);
  return Status::ok();
}

Expected<model::ModelWeights> load_weights(const std::string& model_dir, const model::ModelConfig& config,
                                           ThreadPool& pool) {
  log_info("loading weights from {} ...", model_dir);
  const double load_start = engine::monotonic_seconds();
  prefetch_weights(model_dir);
  MOE_ASSIGN_OR_RETURN(auto weights, model::ModelWeights::load(model_dir, config, pool));
  log_info("loaded {:.1f} MB of weights in {:.2f} s ({} layers, {} experts, vocab {})",
           static_cast<double>(weights.num_bytes()) / 1e6, engine::monotonic_seconds() - load_start,
           config.num_layers, config.num_experts, config.vocab_size);
  return weights;
}

}  // namespace

Status run_serve(ServeArgs args) {
  MOE_ASSIGN_OR_RETURN(const engine::SpeculativeConfig spec,
                       check_speculative(args.speculative));
  if (args.disagg) {  // the instances load the MTP layer: refuse here what would stop them all
    if (args.model.empty()) args.model = find_default_model();
    if (spec.enabled()) MOE_RETURN_IF_ERROR(find_mtp_source(args.speculative, args.model, false).status());
    return run_cluster(std::move(args));
  }
  // A GPU rank's own GPU (rank r on --gpu + r, or --gpus[r]), made current by the device check below.
  if (args.device.cuda() && args.parallel.world() > 1) {
    MOE_ASSIGN_OR_RETURN(args.device.gpu, rank_gpu(args.device, args.parallel.internal_rank, args.parallel.world()));
    if (gpus_repeat(args.device) && args.kv_cache_gb <= 0)
      return invalid_argument("GPU ranks sharing a GPU (--gpus {}) need --kv-cache-gb (each would size its KV pool "
                              "from memory the other is about to take)", fmt::join(args.device.gpus, ","));
  } else if (!args.device.gpus.empty()) {
    return invalid_argument("--gpus names the GPUs of --tp/--ep ranks; with one rank use --gpu");
  }
  MOE_RETURN_IF_ERROR(check_serve_args(args));
  MOE_ASSIGN_OR_RETURN(DType kv_dtype, dtype_from_name(args.kv_dtype));
  MOE_ASSIGN_OR_RETURN(const ResolvedModel resolved, resolve_model(args.model, args.load));
  const model::ModelConfig& config = resolved.config;
  const ParallelArgs& par = args.parallel;
  const bool dp = par.dp > 1;  // each rank a decode instance of its own (docs/parallel.md)
  const bool gpu_ranks = args.device.cuda() && par.world() > 1;
  if (par.follower() && !dp && !gpu_ranks) return run_rank_follower(args, resolved);
  if (par.follower()) args.port = 0, args.transfer_port = 0;
  std::optional<MtpSource> mtp_source;  // found before the target loads: a missing MTP layer fails at once
  if (spec.enabled()) {
    MOE_ASSIGN_OR_RETURN(auto source, find_mtp_source(args.speculative, args.model, resolved.dummy));
    mtp_source = std::move(source);
  }
  const model::ParallelPlan plan{par.tp, 0, par.ep, dp ? par.internal_rank : 0, dp, nullptr};
#ifdef MOE_WITH_CUDA
  if (gpu_ranks && par.follower() && !dp) {
    const kv::KvCacheLayout rank_layout{config.num_layers, model::rank_shard(config, rank_plan_of(par)).num_kv_heads,
                                        config.head_dim, args.page_size, 0, kv_dtype};
    MOE_ASSIGN_OR_RETURN(auto rank_sched, scheduler_options(args, config, rank_layout.page_bytes() * config.num_layers));
    return run_gpu_rank_follower(args, resolved, rank_sched);
  }
#endif

  std::optional<tokenizer::Tokenizer> tok;
  if (std::filesystem::exists(std::filesystem::path(args.model) / "tokenizer.json")) {
    MOE_ASSIGN_OR_RETURN(auto t, tokenizer::Tokenizer::load(args.model));
    tok.emplace(std::move(t));
  } else {
    log_warn("{} has no tokenizer.json: only token-id prompts will work", args.model);
  }
  // Signals go to sigwait, not to the threads started from here on (thread
  // pool, engine, HTTP I/O), which inherit this mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  ThreadPool pool(args.threads);
  pthread_sigmask(SIG_UNBLOCK, &signals, nullptr);  // Ctrl-C still ends a long load at once
  std::optional<model::ModelWeights> weights;  // none: dummy weights drawn on the GPU
  if (resolved.dummy) {
    MOE_ASSIGN_OR_RETURN(weights, host_weights(args, resolved, pool));
  } else {
    MOE_ASSIGN_OR_RETURN(auto loaded, load_weights(args.model, config, pool));
    weights.emplace(std::move(loaded));
  }
  MOE_RETURN_IF_ERROR(weights ? model::check_parallel_plan(config, *weights, plan)
                              : model::check_parallel_layout(config, plan));
  // Rank 0's share of the heads sizes the KV pages (every rank's are alike);
  // the MTP layer's pages come out of the same budget (one more layer).
  kv::KvCacheLayout layout{config.num_layers, model::rank_shard(config, plan).num_kv_heads, config.head_dim,
                           args.page_size, 0, kv_dtype};
  const int num_kv_layers = config.num_layers + (spec.enabled() ? 1 : 0);
  MOE_ASSIGN_OR_RETURN(auto sched, scheduler_options(args, config, layout.page_bytes() * num_kv_layers));
  std::optional<model::MtpWeights> mtp_weights;
  std::optional<model::MtpModel> mtp_model;
  if (spec.enabled()) {
    MOE_ASSIGN_OR_RETURN(auto mtp, load_mtp_weights(*mtp_source, config));
    mtp_weights.emplace(std::move(mtp));
    if (!args.device.cuda()) mtp_model.emplace(*mtp_weights, *weights);
  }
  GpuRanks* gpu = nullptr;
#ifdef MOE_WITH_CUDA
  std::optional<GpuRanks> gpu_group;  // outlives the engine, whose runner stops the followers
  if (gpu_ranks) {
    const ops::QuantFormat experts = weights ? weights->quant_format() : resolved.dummy_format;
    MOE_ASSIGN_OR_RETURN(
        auto met, meet_gpu_ranks(args, std::max(sched.max_num_batched_tokens, sched.max_num_seqs), config,
                                 experts == ops::QuantFormat::kFp8Block));
    gpu_group.emplace(std::move(met));
    gpu = &*gpu_group;
  }
#endif
  // CPU ranks: the leader starts the others and every rank joins the group.
  Expected<RankGroup> joined = gpu_ranks ? Expected<RankGroup>(RankGroup{}) : join_rank_group(par, plan, layout,
                                                                                               sched.num_pages);
  if (!joined) return joined.status();
  RankGroup group = std::move(joined).value();
  model::ParallelPlan rank_plan = plan;
  rank_plan.comm = group.comm.get();
  std::optional<model::Qwen3MoeModel> cpu_model;  // the CPU runners'
  if (!args.device.cuda()) cpu_model.emplace(*weights, rank_plan);
  MOE_RETURN_IF_ERROR(rank_group_ready(group, par));
  MOE_ASSIGN_OR_RETURN(Runner runner, make_runner(args, resolved, weights ? &*weights : nullptr,
                                                  cpu_model ? &*cpu_model : nullptr, pool, layout, sched, group,
                                                  mtp_weights ? &*mtp_weights : nullptr, gpu));
  log_startup(args, sched, layout, pool.num_threads());

  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  server::HttpServer http;  // declared first: destroyed after everything that may hold a connection
  std::unique_ptr<engine::MtpDrafter> drafter;
  if (spec.enabled()) {
    CHECK(runner.runner->supports_hidden_states(), "the CPU and CUDA runners return hidden states");
    drafter = runner.mtp ? std::make_unique<engine::MtpDrafter>(std::move(runner.mtp), spec.num_speculative_tokens)
                         : std::make_unique<engine::MtpDrafter>(*mtp_model, pool, layout, spec.num_speculative_tokens);
    log_info("speculative decoding: MTP layer from {}, {} draft tokens per step", mtp_source->describe(),
             spec.num_speculative_tokens);
  }
  engine::Engine engine(std::move(runner.runner), engine_options(config, sched, args, tok ? &*tok : nullptr),
                        std::move(drafter));
  if (args.role == "colocated") return serve_api(args, engine, tok ? &*tok : nullptr, sched, http, signals);
  if (runner.rank_caches.empty()) return invalid_argument("the {} role has no KV cache to send from", args.role);
  return run_instance(args, engine, {runner.rank_caches, config.num_kv_heads}, http, signals);
}

std::string default_model_dir() { return find_default_model(); }

void add_api_options(CLI::App* cmd, ServeArgs& args) {
  cmd->add_option("--reasoning-parser", args.reasoning_parser, "qwen3: split <think> into reasoning_content");
  cmd->add_option("--tool-call-parser", args.tool_call_parser,
                  "hermes or qwen3_coder: <tool_call> blocks of chat requests with tools become tool_calls");
  cmd->add_flag("--enable-auto-tool-choice", args.enable_auto_tool_choice,
                "Accepted for vLLM's command lines (needs --tool-call-parser, which alone enables tool calls)");
  cmd->add_option("--chat-template", args.chat_template,
                  "A Jinja chat template (a file, or the template itself) in place of the model's");
}

void add_engine_options(CLI::App* cmd, ServeArgs& a) {
  ServeArgs* args = &a;
  cmd->add_option("model", args->model_positional, "Model directory, as --model (vLLM's `serve MODEL`)");
  cmd->add_option("--model", args->model, "Model directory (default: the bundled demo model)");
  cmd->add_option("--served-model-name", args->served_model_name, "Model name in the API (default: the directory name)");
  cmd->add_option("--host", args->host, "Address to bind");
  cmd->add_option("--port", args->port, "Port (0: any free port)")->check(CLI::Range(0, 65535));
  cmd->add_option("--api-key", args->api_key, "Require 'Authorization: Bearer KEY' on the API");
  cmd->add_option("--max-num-seqs", args->max_num_seqs, "Sequences in a batch at most (default 64 on the CPU, 256 on GPUs)")
      ->default_str("")
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--max-model-len", args->max_model_len,
                  "Prompt + generated tokens at most per request (default: the model's max_position_embeddings; on "
                  "the CPU at most 4096)")
      ->default_str("");
  cmd->add_option("--max-num-batched-tokens", args->max_num_batched_tokens,
                  "Tokens per step (chunked prefill budget; default 512 on the CPU, 8192 on GPUs)")
      ->default_str("")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--kv-cache-gb", args->kv_cache_gb,
                  "Memory for the KV cache in GB (per GPU rank with --device cuda; default 1 on the CPU, on GPUs what "
                  "--gpu-memory-utilization leaves)")
      ->default_str("")
      ->check(CLI::Range(0.0001, 4096.0));
  cmd->add_option("--page-size", args->page_size, "Tokens per KV page");
  cmd->add_option("--kv-dtype", args->kv_dtype, "KV cache dtype: f32 or bf16")->check(CLI::IsMember({"f32", "bf16"}));
  cmd->add_flag("--no-enable-prefix-caching", args->no_prefix_caching, "Turn prefix caching off");
  add_device_options(cmd, args->device);
  add_load_options(cmd, args->load);
  add_speculative_options(cmd, args->speculative);
  add_parallel_options(cmd, args->parallel);
  cmd->add_option("--threads", args->threads, "CPU threads for the model (0 = all cores)");
  cmd->add_option("--http-threads", args->http_threads, "HTTP I/O threads")->check(CLI::Range(1, 64));
  add_api_options(cmd, *args);
  cmd->add_flag("--enable-expert-parallel", args->enable_expert_parallel,
                "vLLM's: split the experts over every rank (--ep = --tp x --dp)");
  cmd->add_flag("--trust-remote-code", args->no_effect_flag,
                "Accepted for vLLM's command lines; no effect (moeserve runs no code from the model)");
  cmd->add_option("--dtype", args->dtype, "auto or bfloat16 (accepted for vLLM's command lines)");
  cmd->add_flag("--disable-log-stats", args->disable_log_stats, "No throughput line every 10 s");
  cmd->add_flag("--enable-prefix-caching,--enable-chunked-prefill,--disable-log-requests", args->no_effect_flag,
                "Accepted for vLLM's command lines; no effect (prefix caching and chunked prefill are on by "
                "default, requests are not logged)");
  cmd->add_option("--max-body-bytes", args->max_body_bytes, "Largest request body (413 above)");
  cmd->add_option("--read-timeout", args->read_timeout_s, "Seconds to receive a request (idle, headers and body)");
  cmd->add_option("--request-timeout", args->request_timeout_s, "Deadline of each generation in seconds (0 = none)");
  cmd->add_option("--max-waiting", args->max_waiting, "Queued requests before 503 + Retry-After");
  cmd->add_option("--max-connections", args->max_connections, "Open connections before 503 + close")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--max-n", args->max_n, "Largest n (choices per request)")->check(CLI::Range(1, 1024));
  cmd->add_option("--max-logprobs", args->max_logprobs, "Largest logprobs / top_logprobs")->check(CLI::Range(0, 1000));
}

void add_serve_command(CLI::App& app) {
  auto args = std::make_shared<ServeArgs>();
  CLI::App* cmd = app.add_subcommand("serve", "Serve the OpenAI-compatible HTTP API (default model: the bundled demo)");
  add_engine_options(cmd, *args);
  add_cluster_options(cmd, *args);
  cmd->callback([args] {
    Status status = run_serve(*args);
    if (!status.is_ok()) {
      log_error("{}", status.to_string());
      throw CLI::RuntimeError(1);
    }
  });
}

}  // namespace moe::apps
