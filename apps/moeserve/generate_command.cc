#include "apps/moeserve/generate_command.h"
#include "apps/moeserve/device_options.h"
#include "apps/moeserve/load_options.h"
#include "apps/moeserve/speculative_options.h"

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/logging.h"
#include "engine/generator.h"
#ifdef MOE_WITH_CUDA
#include "engine/cuda_runner.h"
#endif
#include "model/config.h"
#include "model/qwen3_moe.h"
#include "model/weights.h"
#include "tokenizer/tokenizer.h"

namespace moe::apps {
namespace {

struct GenerateArgs {
  std::string model;
  std::vector<std::string> prompt_ids;  // each "1,2,3"; repeat the flag for a batch
  std::vector<std::string> prompts;     // or text, encoded with the model's tokenizer
  int max_tokens = 16;
  float temperature = 0.0f;
  int top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  int64_t seed = -1;
  bool ignore_eos = false;
  std::string output = "text";
  LoadArgs load;
  int threads = 0;
  std::string kv_dtype = "f32";
  int page_size = 16;
  int max_tokens_per_step = 0;
  DeviceArgs device;
  SpeculativeArgs speculative;
};

Expected<std::vector<int32_t>> parse_ids(const std::string& text) {
  std::vector<int32_t> ids;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    size_t used = 0;
    long long value = 0;
    try {
      value = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size() || value < 0 || value > INT32_MAX)
      return invalid_argument("--prompt-ids: '{}' is not a token id", item);
    ids.push_back(static_cast<int32_t>(value));
  }
  if (ids.empty()) return invalid_argument("--prompt-ids: no token ids given");
  return ids;
}

Status run_generate(const GenerateArgs& args) {
  // Before the device check: a bad config is refused the same way with or without a GPU.
  MOE_ASSIGN_OR_RETURN(const engine::SpeculativeConfig spec, check_speculative(args.speculative));
  MOE_RETURN_IF_ERROR(check_device(args.device));
  MOE_ASSIGN_OR_RETURN(const ResolvedModel resolved, resolve_model(args.model, args.load));
  const model::ModelConfig& config = resolved.config;
  const bool dummy = resolved.dummy;
  const ops::QuantFormat dummy_format = resolved.dummy_format;
  MOE_ASSIGN_OR_RETURN(DType kv_dtype, dtype_from_name(args.kv_dtype));
  if (kv_dtype != DType::kF32 && kv_dtype != DType::kBF16) return invalid_argument("--kv-dtype must be f32 or bf16");
  if (args.page_size < 1 || args.page_size > 1024) return invalid_argument("--page-size must be in [1, 1024]");
  std::optional<MtpSource> mtp_source;  // found before the target loads: a missing MTP layer fails at once
  if (spec.enabled()) {
    MOE_ASSIGN_OR_RETURN(auto source, find_mtp_source(args.speculative, args.model, dummy));
    mtp_source = std::move(source);
  }

  if (args.prompts.empty() == args.prompt_ids.empty())
    return invalid_argument("give the prompts as --prompt TEXT or as --prompt-ids IDS (one of them, repeatable)");
  std::optional<tokenizer::Tokenizer> tok;  // text prompts and text output
  if (!args.prompts.empty()) {
    if (dummy || !std::filesystem::exists(std::filesystem::path(args.model) / "tokenizer.json"))
      return invalid_argument("--prompt needs the model's tokenizer.json ({} has none): use --prompt-ids", args.model);
    MOE_ASSIGN_OR_RETURN(auto t, tokenizer::Tokenizer::load(args.model));
    tok.emplace(std::move(t));
  }
  std::vector<std::vector<int32_t>> prompt_tokens;
  for (const auto& text : args.prompt_ids) {
    MOE_ASSIGN_OR_RETURN(auto ids, parse_ids(text));
    prompt_tokens.push_back(std::move(ids));
  }
  for (const auto& text : args.prompts) {
    prompt_tokens.push_back(tok->encode(text, /*parse_special=*/true));
    if (prompt_tokens.back().empty()) return invalid_argument("--prompt '{}' encodes to no tokens", text);
  }
  // As the server's context check (a position past the model's rotary range is not the model any more).
  if (config.max_position_embeddings > 0)
    for (size_t p = 0; p < prompt_tokens.size(); ++p) {
      const int64_t needed = static_cast<int64_t>(prompt_tokens[p].size()) + args.max_tokens;
      if (needed > config.max_position_embeddings)
        return invalid_argument("prompt {}: {} tokens + --max-tokens {} = {} is over the model's context of {} tokens "
                                "(max_position_embeddings)",
                                p, prompt_tokens[p].size(), args.max_tokens, needed, config.max_position_embeddings);
    }
  std::vector<engine::GenerationRequest> requests;
  for (auto& ids : prompt_tokens) {
    engine::GenerationRequest r;
    r.prompt = std::move(ids);
    r.max_tokens = args.max_tokens;
    r.sampling.temperature = args.temperature;
    r.sampling.top_k = args.top_k;
    r.sampling.top_p = args.top_p;
    r.sampling.min_p = args.min_p;
    if (args.seed >= 0) r.sampling.seed = static_cast<uint64_t>(args.seed);
    r.ignore_eos = args.ignore_eos;
    requests.push_back(std::move(r));
  }

  engine::GeneratorOptions options;
  options.page_size = args.page_size;
  options.kv_dtype = kv_dtype;
  options.max_tokens_per_step = args.max_tokens_per_step;
  options.eos_token_ids.assign(config.eos_token_ids.begin(), config.eos_token_ids.end());
  if (!dummy && std::filesystem::is_directory(args.model)) {
    MOE_ASSIGN_OR_RETURN(auto eos, model::load_generation_eos_ids(args.model));
    if (!eos.empty()) options.eos_token_ids.assign(eos.begin(), eos.end());
  }

  ThreadPool pool(args.threads);
  const auto load_start = std::chrono::steady_clock::now();
  std::optional<model::ModelWeights> weights;
  // On the GPU, dummy weights are generated there; real ones are read here first.
  if (!(dummy && args.device.cuda())) {
    if (dummy) {
      weights.emplace(model::ModelWeights::dummy(config, 0, pool, dummy_format));
    } else {
      MOE_ASSIGN_OR_RETURN(auto loaded, model::ModelWeights::load(args.model, config, pool));
      weights.emplace(std::move(loaded));
    }
    const double load_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count();
    log_info("loaded {} ({} layers, {:.1f} MB of weights{}) in {:.2f} s, {} threads", args.model, config.num_layers,
             static_cast<double>(weights->num_bytes()) / 1e6, dummy ? ", dummy" : "", load_seconds, pool.num_threads());
  }

  std::optional<model::Qwen3MoeModel> cpu_model;
  std::optional<model::MtpWeights> mtp_weights;
  std::optional<model::MtpModel> mtp_model;
  std::unique_ptr<engine::ModelRunner> runner;
  std::optional<engine::Generator> generator;
  if (spec.enabled()) {  // on the device the target runs on
    MOE_ASSIGN_OR_RETURN(auto mtp, load_mtp_weights(*mtp_source, config));
    mtp_weights.emplace(std::move(mtp));
    options.num_speculative_tokens = spec.num_speculative_tokens;
    log_info("speculative decoding: MTP layer from {}, {} draft tokens per step ({} MLP)", mtp_source->describe(),
             spec.num_speculative_tokens, mtp_weights->layer().is_moe ? "MoE" : "dense");
  }
  if (!args.device.cuda()) {
    cpu_model.emplace(*weights);
    if (mtp_weights) {
      mtp_model.emplace(*mtp_weights, *weights);
      options.mtp = &*mtp_model;
    }
    generator.emplace(*cpu_model, pool, options);
  } else {
#ifdef MOE_WITH_CUDA
    if (options.max_tokens_per_step <= 0) options.max_tokens_per_step = 2048;
    model::CudaModelOptions cuda;
    cuda.device = args.device.gpu;
    cuda.page_size = args.page_size;
    cuda.max_num_tokens = options.max_tokens_per_step;
    cuda.max_num_seqs = static_cast<int>(requests.size());
    cuda.gpu_memory_utilization = args.device.gpu_memory_utilization;
    cuda.use_cuda_graphs = !args.device.enforce_eager;
    cuda.dummy_expert_format = dummy_format;  // used by dummy weights only
    cuda.mtp = mtp_weights ? &*mtp_weights : nullptr;
    MOE_ASSIGN_OR_RETURN(auto cuda_runner,
                         engine::CudaRunner::create(config, weights ? &*weights : nullptr, 0, cuda));
    const int32_t num_pages = cuda_runner->num_pages();
    if (mtp_weights) options.make_mtp_runner = [gpu = cuda_runner.get()] { return gpu->mtp_runner(); };
    runner = std::move(cuda_runner);
    generator.emplace(*runner, num_pages, options);
#endif
  }
  MOE_ASSIGN_OR_RETURN(auto results, generator->generate(requests));
  const auto& stats = generator->stats();
  const double decode_tps = stats.decode_seconds > 0 ? static_cast<double>(stats.num_generated_tokens - static_cast<int64_t>(results.size())) / stats.decode_seconds : 0.0;
  log_info("{} prompt tokens in {:.3f} s, {} generated tokens, decode {:.1f} tokens/s", stats.num_prompt_tokens,
           stats.prefill_seconds, stats.num_generated_tokens, decode_tps);
  if (spec.enabled() && stats.num_verifications > 0)
    log_info("speculative: {} draft tokens, {} accepted ({:.1f}%), {:.2f} tokens per verification, {} decode steps",
             stats.num_draft_tokens, stats.num_accepted_tokens,
             100.0 * static_cast<double>(stats.num_accepted_tokens) / static_cast<double>(stats.num_draft_tokens),
             1.0 + static_cast<double>(stats.num_accepted_tokens) / static_cast<double>(stats.num_verifications),
             stats.num_decode_steps);

  for (size_t i = 0; i < results.size(); ++i) {
    if (args.output == "json") {
      nlohmann::json j;
      j["token_ids"] = results[i].token_ids;
      if (tok) j["text"] = tok->decode(results[i].token_ids, /*skip_special_tokens=*/true);
      j["finish_reason"] = results[i].finish_reason;
      j["prompt_tokens"] = requests[i].prompt.size();
      j["completion_tokens"] = results[i].token_ids.size();
      if (spec.enabled()) {
        j["num_draft_tokens"] = results[i].num_draft_tokens;
        j["num_accepted_draft_tokens"] = results[i].num_accepted_draft_tokens;
      }
      std::printf("%s\n", j.dump().c_str());
    } else if (tok) {  // text prompts: the text that follows each
      std::printf("%s\n", tok->decode(results[i].token_ids, /*skip_special_tokens=*/true).c_str());
    } else {
      std::printf("%s\n", fmt::format("{}", fmt::join(results[i].token_ids, " ")).c_str());
    }
  }
  return Status::ok();
}

}  // namespace

void add_generate_command(CLI::App& app) {
  auto args = std::make_shared<GenerateArgs>();
  CLI::App* cmd = app.add_subcommand("generate", "Generate offline from text or token-id prompts (no server)");
  cmd->add_option("--model", args->model, "Model directory (or a config.json with --load-format dummy)")->required();
  cmd->add_option("--prompt", args->prompts,
                  "Prompt text, encoded with the model's tokenizer (no chat template); repeat for a batch. "
                  "Prints the generated text")
      ->default_str("")
      ->allow_extra_args(false);
  cmd->add_option("--prompt-ids", args->prompt_ids, "Comma-separated prompt token ids; repeat for a batch")
      ->default_str("")
      ->allow_extra_args(false);
  cmd->add_option("--max-tokens", args->max_tokens, "Tokens to generate per prompt")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--temperature", args->temperature, "0 = greedy")->check(CLI::Range(0.0f, 100.0f));
  cmd->add_option("--top-k", args->top_k, "Keep the k most likely tokens (0 = off)");
  cmd->add_option("--top-p", args->top_p, "Nucleus sampling mass")->check(CLI::Range(0.0f, 1.0f));
  cmd->add_option("--min-p", args->min_p, "Drop tokens below min_p * the top probability")->check(CLI::Range(0.0f, 1.0f));
  cmd->add_option("--seed", args->seed, "Sampling seed (reproducible draws; default: a random one)")->default_str("");
  cmd->add_flag("--ignore-eos", args->ignore_eos, "Keep generating past end-of-sequence tokens");
  cmd->add_option("--output", args->output, "text or json")->check(CLI::IsMember({"text", "json"}));
  add_load_options(cmd, args->load);
  cmd->add_option("--threads", args->threads, "CPU threads (0 = all cores)");
  cmd->add_option("--kv-dtype", args->kv_dtype, "KV cache dtype: f32 or bf16")->check(CLI::IsMember({"f32", "bf16"}));
  cmd->add_option("--page-size", args->page_size, "Tokens per KV page");
  cmd->add_option("--max-tokens-per-step", args->max_tokens_per_step, "Prefill chunk budget per step (0 = unlimited)")
      ->check(CLI::Range(0, 1 << 24));
  add_device_options(cmd, args->device);
  add_speculative_options(cmd, args->speculative);
  cmd->callback([args] {
    Status status = run_generate(*args);
    if (!status.is_ok()) {
      log_error("{}", status.to_string());
      throw CLI::RuntimeError(1);
    }
  });
}

}  // namespace moe::apps
