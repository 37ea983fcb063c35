// `moeserve serve`: the OpenAI-compatible server on one process (colocated
// prefill and decode), or with --disagg a local cluster (router + prefill and
// decode instances, apps/moeserve/disagg_command.h). With no --model it serves
// the bundled demo model.
//
// The engine flags and start-up are shared with the disaggregated roles
// (`moeserve prefill`, `moeserve decode`): run_serve() with args.role set runs
// the engine behind that role's internal endpoint instead of the API.
#pragma once

#include <csignal>
#include <string>

#include <CLI/CLI.hpp>

#include "apps/moeserve/device_options.h"
#include "apps/moeserve/load_options.h"
#include "apps/moeserve/rank_launch.h"
#include "apps/moeserve/speculative_options.h"
#include "core/status.h"
#include "engine/engine.h"
#include "engine/sampler.h"
#include "kv/kv_cache.h"
#include "model/config.h"
#include "server/http_server.h"
#include "server/openai_api.h"

namespace moe::apps {

inline constexpr double kDefaultCpuKvCacheGb = 1.0;
inline constexpr int kDefaultCpuMaxModelLen = 4096;  // GPUs: the model's max_position_embeddings
// Batch limits by device, where the flags are not given. GPUs: batches that
// fill the tensor cores (at 8192 tokens a step, Qwen3-235B's experts get 512
// rows each on average; at 512 tokens 32, where the MoE GEMMs stream their
// weights for a few rows each: docs/performance.md, "Step budget").
inline constexpr int kDefaultCpuMaxNumSeqs = 64, kDefaultCpuMaxNumBatchedTokens = 512;
inline constexpr int kDefaultGpuMaxNumSeqs = 256, kDefaultGpuMaxNumBatchedTokens = 8192;
// On SIGINT/SIGTERM a server stops accepting, ends what is in flight (an
// error, or finish_reason "abort" at the router), and waits up to this long
// for those answers to be written before it closes the connections.
inline constexpr double kDrainSeconds = 2.0;

struct ServeArgs {
  std::string model;
  std::string served_model_name;
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string api_key;
  int max_num_seqs = 0;  // 0: kDefault{Cpu,Gpu}MaxNumSeqs
  int max_model_len = 0;  // 0: the model's max_position_embeddings (CPU: at most kDefaultCpuMaxModelLen)
  int max_num_batched_tokens = 0;  // 0: kDefault{Cpu,Gpu}MaxNumBatchedTokens
  double kv_cache_gb = 0;  // 0: kDefaultCpuKvCacheGb on the CPU; on GPUs what --gpu-memory-utilization leaves
  int page_size = 16;
  std::string kv_dtype = "f32";
  bool no_prefix_caching = false;
  DeviceArgs device;
  LoadArgs load;                // --load-format / --num-layers / --quantization
  ParallelArgs parallel;        // --tp / --ep / --dp (docs/parallel.md)
  SpeculativeArgs speculative;  // --speculative-config / --speculative-model (docs/speculative.md)
  int threads = 0;
  int http_threads = 2;
  std::string reasoning_parser;
  std::string tool_call_parser;
  // vLLM's launch flags, so that its command lines run unchanged (docs/server.md):
  std::string model_positional;      // `serve MODEL`
  std::string chat_template;         // --chat-template FILE or Jinja text; replaces the model's
  std::string chat_template_text;    // its text (check_api_args)
  bool enable_auto_tool_choice = false;  // needs --tool-call-parser (as vLLM); tools parse with the parser alone
  bool enable_expert_parallel = false;   // --ep = --tp x --dp
  std::string dtype = "auto";            // auto or bfloat16 (what the engine runs)
  bool disable_log_stats = false;        // no throughput line every 10 s
  bool no_effect_flag = false;           // --trust-remote-code and the others accepted with no effect
  size_t max_body_bytes = size_t{1} << 20;
  double read_timeout_s = 15;
  double request_timeout_s = 600;
  int max_waiting = 1024;
  size_t max_connections = 1024;
  int max_n = 16;
  int max_logprobs = 20;
  // Disaggregated serving (docs/disagg.md).
  std::string role = "colocated";  // or "prefill", "decode"
  bool disagg = false;             // serve --disagg: a local cluster
  int prefill_instances = 1, decode_instances = 1;
  int decode_batch_threshold = 32;
  int max_prefill_retries = 2;
  double lease_s = 0;  // decode reservations' lease (0: 60 s, or the decode instance's when sent by the router)
  std::string transfer_host = "127.0.0.1";  // the TransferEngine listener of an instance
  int transfer_port = 0;
  std::string router_url;  // an instance registers itself there when set
  double fault_abort_ack_delay_s = 0;  // prefill: fault injection (tests)
};

void add_serve_command(CLI::App& app);
// The flags of the engine (serve, prefill, decode).
void add_engine_options(CLI::App* cmd, ServeArgs& args);
// The API flags the router shares with serve: --chat-template, --enable-auto-tool-choice.
void add_api_options(CLI::App* cmd, ServeArgs& args);
// Checks the parser flags and reads --chat-template into chat_template_text.
Status check_api_args(ServeArgs& args);
Status run_serve(ServeArgs args);
// The bundled demo model's directory (models/moeserve-demo in the source tree,
// or next to the installed binary).
std::string default_model_dir();
std::string find_default_model();
engine::SamplingParams generation_defaults(const std::string& model_dir);
Expected<engine::SchedulerOptions> scheduler_options(const ServeArgs& args, const model::ModelConfig& config,
                                                     size_t page_bytes_all_layers);
server::ApiOptions api_options(const ServeArgs& args, const engine::SchedulerOptions& sched);
server::HttpServerOptions http_options(const ServeArgs& args);

// apps/moeserve/disagg_command.cc
void add_cluster_options(CLI::App* cmd, ServeArgs& args);
void add_disagg_commands(CLI::App& app);  // prefill, decode, router
Status run_cluster(ServeArgs args);
// The KV an instance serves from: its ranks' caches (rank order; one for a
// single rank or a data-parallel rank) and the model's k/v head count.
struct InstanceKv {
  std::vector<const kv::KvCache*> rank_caches;
  int num_kv_heads = 0;
};
// Runs a prefill or decode instance's control endpoint over `engine` until SIGINT/SIGTERM.
Status run_instance(const ServeArgs& args, engine::Engine& engine, const InstanceKv& kv, server::HttpServer& http,
                    const sigset_t& signals);
}  // namespace moe::apps
