// The moeserve binary as a user runs it: outputs, exit codes, messages.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sys/wait.h>
#include <unistd.h>

#include "model/safetensors.h"

namespace {

struct CliRun {
  int exit_code;
  std::string output;  // stdout and stderr together
  std::string stdout_only;
};

CliRun run(const std::string& args) {
  const std::string out_file = testing::TempDir() + "/cli_stdout.txt";
  const std::string command = std::string(MOESERVE_BIN) + " " + args + " 2>&1 >" + out_file;
  FILE* pipe = popen(command.c_str(), "r");
  EXPECT_NE(pipe, nullptr);
  std::string err;
  std::array<char, 4096> buffer{};
  size_t n;
  while ((n = fread(buffer.data(), 1, buffer.size(), pipe)) > 0) err.append(buffer.data(), n);
  const int status = pclose(pipe);
  std::ifstream in(out_file);
  std::string out((std::istreambuf_iterator<char>(in)), {});
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, err + out, out};
}

const std::string kGolden = std::string(MOE_SOURCE_DIR) + "/tests/data/golden/moe_basic";
const std::string kMtp = std::string(MOE_SOURCE_DIR) + "/tests/data/mtp_golden";  // its MTP layer

TEST(Cli, GenerateJsonMatchesTheGoldenGreedyTokens) {
  std::ifstream in(kGolden + "/golden.json");
  auto golden = nlohmann::json::parse(in);
  const auto& prompt = golden["prompts"][2];
  std::string ids;
  for (const auto& id : prompt["ids"]) {
    if (!ids.empty()) ids += ',';
    ids += std::to_string(id.get<int>());
  }
  CliRun r = run("generate --model " + kGolden + " --prompt-ids " + ids + " --max-tokens 24 --ignore-eos --output json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto result = nlohmann::json::parse(r.stdout_only);
  EXPECT_EQ(result["token_ids"], prompt["greedy"]);
  EXPECT_EQ(result["finish_reason"], "length");
}

// Text prompts go through the model's tokenizer: the demo model's texts give
// transformers' ids and greedy tokens (models/moeserve-demo/golden.json).
TEST(Cli, GenerateTextPromptsMatchTheDemoGoldens) {
  const std::string demo = std::string(MOE_SOURCE_DIR) + "/models/moeserve-demo";
  std::ifstream in(demo + "/golden.json");
  auto golden = nlohmann::json::parse(in);
  const auto& text = golden["texts"][0];
  const int n = golden["n_greedy"].get<int>();
  CliRun r = run("generate --model " + demo + " --prompt '" + text["text"].get<std::string>() + "' --max-tokens " +
                 std::to_string(n) + " --ignore-eos --output json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto result = nlohmann::json::parse(r.stdout_only);
  EXPECT_EQ(result["prompt_tokens"], text["ids"].size());
  EXPECT_EQ(result["token_ids"], text["greedy"]);
  EXPECT_TRUE(result["text"].is_string() && !result["text"].get<std::string>().empty());
  CliRun both = run("generate --model " + demo + " --prompt Hi --prompt-ids 1,2");
  EXPECT_EQ(both.exit_code, 1);
  EXPECT_NE(both.output.find("one of them"), std::string::npos) << both.output;
  // The demo model's context is max_position_embeddings = 1024 (config.json): past it, a clear error.
  CliRun too_long = run("generate --model " + demo + " --prompt Hi --max-tokens 5000");
  EXPECT_EQ(too_long.exit_code, 1);
  EXPECT_NE(too_long.output.find("over the model's context of 1024 tokens"), std::string::npos) << too_long.output;
  CliRun no_tokenizer = run("generate --model " + kGolden + " --prompt Hi");
  EXPECT_EQ(no_tokenizer.exit_code, 1);
  EXPECT_NE(no_tokenizer.output.find("--prompt needs the model's tokenizer.json"), std::string::npos)
      << no_tokenizer.output;
}

// Speculative decoding (docs/speculative.md): the same greedy tokens with
// MTP drafts (the golden model with a random MTP layer from its golden
// checkpoint), and clear start-up errors for what is not supported.
TEST(Cli, SpeculativeGenerateAndItsErrors) {
  const std::string& mtp = kMtp;
  const std::string base = "generate --model " + kGolden + " --prompt-ids 1,17,99,250 --max-tokens 12 --ignore-eos ";
  CliRun plain = run(base);
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  CliRun spec = run(base + "--speculative-config '{\"method\":\"mtp\",\"num_speculative_tokens\":3}' "
                           "--speculative-model " + mtp);
  ASSERT_EQ(spec.exit_code, 0) << spec.output;
  EXPECT_EQ(spec.stdout_only, plain.stdout_only);
  EXPECT_NE(spec.output.find("speculative: "), std::string::npos) << spec.output;
  const std::vector<std::pair<std::string, std::string>> errors = {
      {base + "--speculative-config '{\"method\":\"mtp\",\"num_speculative_tokens\":9}' --speculative-model " + mtp,
       "num_speculative_tokens must be in 1..8"},
      {base + "--speculative-config '{\"method\":\"ngram\",\"num_speculative_tokens\":2}'", "not supported"},
      {base + "--speculative-config 'mtp'", "must be a JSON object"},
      {base + "--speculative-config '{\"method\":\"mtp\",\"num_speculative_tokens\":2}'",
       "has no mtp.* tensors either"},
      {"serve --disagg --model " + kGolden + " --speculative-config '{\"method\":\"mtp\",\"num_speculative_tokens\":2}'",
       "needs --speculative-model"},
  };
  for (const auto& [args, message] : errors) {
    CliRun r = run(args);
    EXPECT_EQ(r.exit_code, 1) << args << "\n" << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << args << "\n" << r.output;
  }
}

// The golden model with the golden MTP layer inside its own checkpoint, as
// Qwen3.5 ships it (a second shard of mtp.* tensors behind
// model.safetensors.index.json), in a directory removed at the end.
class ModelWithMtpLayer {
 public:
  ModelWithMtpLayer() {
    namespace fs = std::filesystem;
    dir_ = fs::path(testing::TempDir()) / ("cli_mtp_in_model_" + std::to_string(getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    for (const char* file : {"config.json", "generation_config.json"})
      fs::copy_file(kGolden + "/" + file, dir_ / file);
    auto target = moe::model::SafetensorsFile::open(kGolden + "/model.safetensors");
    auto mtp = moe::model::SafetensorsFile::open(kMtp + "/model.safetensors");
    EXPECT_TRUE(target.has_value() && mtp.has_value());
    std::vector<std::pair<std::string, moe::TensorView>> tensors;
    for (const auto* file : {&*target, &*mtp})
      for (const auto& info : file->tensors()) tensors.emplace_back(info.name, file->view(info));
    // A shard as large as the target's data: the first MTP tensor opens the second.
    EXPECT_TRUE(moe::model::write_sharded_safetensors(dir_.string(), tensors, target->data_size()).is_ok());
  }
  ~ModelWithMtpLayer() { std::filesystem::remove_all(dir_); }
  std::string dir() const { return dir_.string(); }

 private:
  std::filesystem::path dir_;
};

// Without --speculative-model, the mtp.* tensors of the model directory are
// the MTP layer: the same greedy tokens, drafts verified, and the start-up
// log says where the layer came from; --speculative-model still wins.
TEST(Cli, SpeculativeGenerateWithTheMtpLayerInTheModelDirectory) {
  const ModelWithMtpLayer model;
  const std::string prompt = " --prompt-ids 1,17,99,250 --max-tokens 12 --ignore-eos ";
  const std::string speculate = "--speculative-config '{\"method\":\"mtp\",\"num_speculative_tokens\":3}' ";
  CliRun plain = run("generate --model " + kGolden + prompt);
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  CliRun target_only = run("generate --model " + model.dir() + prompt);  // the target leaves mtp.* alone
  ASSERT_EQ(target_only.exit_code, 0) << target_only.output;
  EXPECT_EQ(target_only.stdout_only, plain.stdout_only);
  CliRun spec = run("generate --model " + model.dir() + prompt + speculate);
  ASSERT_EQ(spec.exit_code, 0) << spec.output;
  EXPECT_EQ(spec.stdout_only, plain.stdout_only);
  EXPECT_NE(spec.output.find("speculative: "), std::string::npos) << spec.output;
  EXPECT_NE(spec.output.find("MTP layer from the mtp.* tensors of the model checkpoint " + model.dir()),
            std::string::npos)
      << spec.output;
  CliRun side = run("generate --model " + model.dir() + prompt + speculate + "--speculative-model " + kMtp);
  ASSERT_EQ(side.exit_code, 0) << side.output;
  EXPECT_EQ(side.stdout_only, plain.stdout_only);
  EXPECT_NE(side.output.find("MTP layer from " + kMtp + " (--speculative-model)"), std::string::npos)
      << side.output;

  // `serve` and the prefill and decode roles (what `serve --disagg` starts)
  // load it too: they log where it came from, then fail on the host given to
  // stop them there. `serve --disagg` checks before starting any instance;
  // its refusal of two GPU instances sharing a GPU without --kv-cache-gb
  // comes after that check.
  const std::string stop = " --host 256.0.0.1 --port 0 --threads 1 --kv-cache-gb 0.01 ";
  for (const char* role : {"serve", "prefill", "decode"}) {
    CliRun r = run(std::string(role) + " --model " + model.dir() + stop + speculate);
    EXPECT_EQ(r.exit_code, 1) << role << "\n" << r.output;
    EXPECT_NE(r.output.find("MTP layer from the mtp.* tensors of the model checkpoint"), std::string::npos)
        << role << "\n" << r.output;
    EXPECT_NE(r.output.find("256.0.0.1: not an IP address"), std::string::npos) << role << "\n" << r.output;
  }
  CliRun cluster = run("serve --disagg --device cuda --gpus 0,0 --model " + model.dir() + " " + speculate);
  EXPECT_EQ(cluster.exit_code, 1) << cluster.output;
  EXPECT_NE(cluster.output.find("instances sharing GPU 0 need --kv-cache-gb"), std::string::npos) << cluster.output;
}

// --gpu and the GPU disaggregated roles (docs/gpu.md, docs/disagg.md): clear
// errors, whether or not this machine has a GPU.
TEST(Cli, GpuSelectionErrors) {
  CliRun cpu_gpu = run("generate --model " + kGolden + " --prompt-ids 1 --gpu 1");
  EXPECT_EQ(cpu_gpu.exit_code, 1) << cpu_gpu.output;
  EXPECT_NE(cpu_gpu.output.find("--gpu 1 only applies with --device cuda"), std::string::npos) << cpu_gpu.output;
  CliRun cluster = run("serve --disagg --device cuda --gpus 0,1,2 --model " + kGolden);
  EXPECT_EQ(cluster.exit_code, 1) << cluster.output;
  EXPECT_NE(cluster.output.find("--gpus names 3 GPUs for 2 instances"), std::string::npos) << cluster.output;
  CliRun cluster_cpu = run("serve --disagg --gpu 1 --model " + kGolden);
  EXPECT_EQ(cluster_cpu.exit_code, 1) << cluster_cpu.output;
  EXPECT_NE(cluster_cpu.output.find("only apply with --device cuda"), std::string::npos) << cluster_cpu.output;
  CliRun gpus_cpu = run("generate --model " + kGolden + " --prompt-ids 1 --gpus 0,1");
  EXPECT_EQ(gpus_cpu.exit_code, 1) << gpus_cpu.output;
  EXPECT_NE(gpus_cpu.output.find("--gpus only applies with --device cuda"), std::string::npos) << gpus_cpu.output;
  // Ranges expand in place: 0-1,1 is three GPUs.
  CliRun gpus_range = run("serve --disagg --device cuda --gpus 0-1,1 --model " + kGolden);
  EXPECT_EQ(gpus_range.exit_code, 1) << gpus_range.output;
  EXPECT_NE(gpus_range.output.find("--gpus names 3 GPUs for 2 instances"), std::string::npos) << gpus_range.output;
  for (const std::string bad : {"3-1", "x", "0-", "1024", "-2"}) {
    CliRun r = run("generate --model " + kGolden + " --prompt-ids 1 --gpus " + bad);
    EXPECT_EQ(r.exit_code, 2) << bad << ": " << r.output;
    EXPECT_NE(r.output.find("--gpus"), std::string::npos) << r.output;
  }
  CliRun gpus_count = run("serve --model " + kGolden + " --device cuda --tp 2 --gpus 0,0,1 --port 0");
  EXPECT_EQ(gpus_count.exit_code, 1) << gpus_count.output;
  EXPECT_NE(gpus_count.output.find("--gpus names 3 GPUs for 2 ranks"), std::string::npos) << gpus_count.output;
  CliRun shared = run("serve --model " + kGolden + " --device cuda --tp 2 --gpus 0,0 --port 0");
  EXPECT_EQ(shared.exit_code, 1) << shared.output;
  EXPECT_NE(shared.output.find("GPU ranks sharing a GPU (--gpus 0,0) need --kv-cache-gb"), std::string::npos)
      << shared.output;
  CliRun gpus_one = run("serve --model " + kGolden + " --device cuda --gpus 0 --port 0");
  EXPECT_EQ(gpus_one.exit_code, 1) << gpus_one.output;
  EXPECT_NE(gpus_one.output.find("with one rank use --gpu"), std::string::npos) << gpus_one.output;
  // No machine here has 1000 GPUs: refused before any model is loaded.
  CliRun far = run("prefill --model " + kGolden + " --device cuda --gpu 1000 --port 0");
  EXPECT_EQ(far.exit_code, 1) << far.output;
  EXPECT_TRUE(far.output.find("no usable GPU") != std::string::npos ||
              far.output.find("no CUDA backend") != std::string::npos ||
              far.output.find("--gpu 1000: ") != std::string::npos)
      << far.output;
}

TEST(Cli, BadArgumentsGiveAUsageErrorAndNonZeroExit) {
  CliRun missing_model = run("generate --prompt-ids 1,2");
  EXPECT_EQ(missing_model.exit_code, 2);
  EXPECT_NE(missing_model.output.find("--model is required"), std::string::npos) << missing_model.output;

  CliRun unknown_flag = run("generate --model " + kGolden + " --prompt-ids 1 --bogus");
  EXPECT_EQ(unknown_flag.exit_code, 2);
  EXPECT_NE(unknown_flag.output.find("--bogus"), std::string::npos) << unknown_flag.output;

  CliRun no_command = run("");
  EXPECT_EQ(no_command.exit_code, 2);

  CliRun bad_ids = run("generate --model " + kGolden + " --prompt-ids 1,two,3");
  EXPECT_EQ(bad_ids.exit_code, 1);
  EXPECT_NE(bad_ids.output.find("'two' is not a token id"), std::string::npos) << bad_ids.output;

  CliRun out_of_vocab = run("generate --model " + kGolden + " --prompt-ids 1,512");
  EXPECT_EQ(out_of_vocab.exit_code, 1);
  EXPECT_NE(out_of_vocab.output.find("outside the vocabulary"), std::string::npos) << out_of_vocab.output;

  CliRun no_model = run("generate --model /nonexistent/dir --prompt-ids 1");
  EXPECT_EQ(no_model.exit_code, 1);
  EXPECT_NE(no_model.output.find("/nonexistent/dir/config.json"), std::string::npos) << no_model.output;

  CliRun bad_range = run("generate --model " + kGolden + " --prompt-ids 1 --top-p 1.5");
  EXPECT_EQ(bad_range.exit_code, 2);

  CliRun threads = run("quantize --model " + kGolden + " --out /nonexistent/out --format fp8-block --threads -1");
  EXPECT_EQ(threads.exit_code, 1);
  EXPECT_NE(threads.output.find("--threads must be 0 (one per hardware thread) or more"), std::string::npos)
      << threads.output;

  // The load flags are shared by generate and the engine commands (apps/moeserve/load_options.h).
  for (const std::string command : {"generate --prompt-ids 1", "serve --port 0"}) {
    CliRun layers = run(command + " --model " + kGolden + " --num-layers 1");
    EXPECT_EQ(layers.exit_code, 1) << command;
    EXPECT_NE(layers.output.find("--num-layers only applies with --load-format dummy"), std::string::npos)
        << layers.output;
    CliRun too_many = run(command + " --model " + kGolden + " --load-format dummy --num-layers 99");
    EXPECT_EQ(too_many.exit_code, 1) << command;
    EXPECT_NE(too_many.output.find("--num-layers 99 exceeds the model's"), std::string::npos) << too_many.output;
    CliRun quantized = run(command + " --model " + kGolden + " --quantization fp8-block");
    EXPECT_EQ(quantized.exit_code, 1) << command;
    EXPECT_NE(quantized.output.find("--quantization only applies with --load-format dummy"), std::string::npos)
        << quantized.output;
  }
}

// --help shows each option's default where one is fixed, and none where it
// is decided at run time (the text says how), for every command.
TEST(Cli, HelpShowsTheDefaults) {
  CliRun serve = run("serve --help");
  EXPECT_EQ(serve.exit_code, 0);
  for (const char* shown : {"=8000", "--page-size INT=16", "--max-n INT:INT in [1 - 1024]=16", "=0.9", "=auto"})
    EXPECT_NE(serve.output.find(shown), std::string::npos) << shown << "\n" << serve.output;
  for (const char* option : {"--max-num-seqs", "--max-model-len", "--max-num-batched-tokens", "--kv-cache-gb"}) {
    const size_t at = serve.output.find(std::string("  ") + option + " ");
    ASSERT_NE(at, std::string::npos) << option;
    const std::string line = serve.output.substr(at, serve.output.find('\n', at) - at);
    EXPECT_EQ(line.find('='), std::string::npos) << line;  // no "=0": the default is the machine's
  }
  for (const std::string command : {"generate", "bench serve", "quantize", "router", "prefill", "decode"}) {
    CliRun help = run(command + " --help");
    EXPECT_EQ(help.exit_code, 0) << command;
    EXPECT_EQ(help.output.find("=[]"), std::string::npos) << command << ": an empty list shown\n" << help.output;
  }
  EXPECT_NE(run("generate --help").output.find("--max-tokens INT:INT in [1 - 1048576]=16"), std::string::npos);
  EXPECT_NE(run("bench serve --help").output.find("--num-prompts INT:INT in [1 - 1048576]=100"), std::string::npos);
}

TEST(Cli, SeededSamplingIsReproducible) {
  const std::string args = "generate --model " + kGolden + " --prompt-ids 3,4,5 --max-tokens 12 --temperature 1 " +
                           "--top-k 50 --top-p 0.9 --seed 11 --ignore-eos --output json";
  CliRun a = run(args), b = run(args);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  EXPECT_EQ(a.stdout_only, b.stdout_only);
}

}  // namespace
