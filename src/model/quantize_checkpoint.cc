#include "model/quantize_checkpoint.h"

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/config.h"
#include "model/quant_weights.h"
#include "model/safetensors.h"

namespace moe::model {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ops::QuantFormat;

// One input tensor and the output tensors it becomes.
struct PlannedTensor {
  std::string name;
  bool quantize = false;
  uint64_t input_bytes = 0;
  uint64_t output_bytes = 0;
  std::vector<std::string> output_names;
};

bool ends_with_any(const std::string& name, std::initializer_list<std::string_view> suffixes) {
  for (std::string_view s : suffixes)
    if (name.ends_with(s)) return true;
  return false;
}

json quantization_config_json(QuantFormat format) {
  switch (format) {
    case QuantFormat::kFp8Block:  // exactly the official Qwen3-FP8 fields
      return {{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"activation_scheme", "dynamic"},
              {"weight_block_size", {128, 128}}};
    case QuantFormat::kMxfp8:
      return {{"quant_method", "mxfp8"}, {"fmt", "e4m3"}, {"scale_fmt", "e8m0"}, {"activation_scheme", "dynamic"},
              {"weight_block_size", {1, 32}}};
    case QuantFormat::kNvfp4:
      return {{"quant_method", "nvfp4"}, {"fmt", "e2m1"}, {"scale_fmt", "e4m3"}, {"global_scale", "weight_scale_2"},
              {"activation_scheme", "none"}, {"weight_block_size", {1, 16}}};
    case QuantFormat::kMxfp4:
      return {{"quant_method", "mxfp4"}, {"fmt", "e2m1"}, {"scale_fmt", "e8m0"}, {"activation_scheme", "none"},
              {"weight_block_size", {1, 32}}};
    case QuantFormat::kNone: break;
  }
  CHECK(false, "no quantization_config for format none");
  return {};
}

Expected<std::string> read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return not_found("{}: cannot read", path.string());
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

Status write_text(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) return unavailable("{}: cannot write", path.string());
  return Status::ok();
}

Status check_directories(const QuantizeOptions& options) {
  std::error_code ec;
  if (!fs::is_directory(options.model_dir, ec)) return not_found("--model {}: not a directory", options.model_dir);
  if (options.out_dir.empty()) return invalid_argument("--out: no directory given");
  if (fs::exists(options.out_dir, ec)) {
    if (!fs::is_directory(options.out_dir, ec))
      return invalid_argument("--out {}: exists and is not a directory", options.out_dir);
    if (fs::equivalent(options.out_dir, options.model_dir, ec))
      return invalid_argument("--out {} is the input directory; write the quantized model elsewhere", options.out_dir);
    if (!fs::is_empty(options.out_dir, ec) && !options.force)
      return invalid_argument("--out {}: the directory exists and is not empty (use --force to write into it)",
                              options.out_dir);
  }
  fs::create_directories(options.out_dir, ec);
  if (ec) return unavailable("--out {}: cannot create the directory: {}", options.out_dir, ec.message());
  // With --force, old weights would shadow or mix with ours (a single
  // model.safetensors wins over an index): remove them.
  for (const auto& entry : fs::directory_iterator(options.out_dir, ec)) {
    const std::string file = entry.path().filename().string();
    if (file.ends_with(".safetensors") || file == "model.safetensors.index.json") fs::remove(entry.path(), ec);
  }
  return Status::ok();
}

// The output names and sizes of every input tensor; fails before anything is
// written when a tensor cannot be stored in the format.
Expected<std::vector<PlannedTensor>> plan_tensors(const SafetensorsCheckpoint& checkpoint,
                                                  const QuantizeOptions& options) {
  std::vector<PlannedTensor> plan;
  for (const std::string& name : checkpoint.tensor_names()) {
    const TensorInfo& info = *checkpoint.find(name);
    PlannedTensor p;
    p.name = name;
    p.input_bytes = info.num_bytes();
    p.quantize = is_quantized_projection(name, options.quantize_attention);
    if (!p.quantize) {
      p.output_names = {name};
      p.output_bytes = info.num_bytes();
      plan.push_back(std::move(p));
      continue;
    }
    if (info.shape.rank() != 2 || !dtype_is_float(info.dtype) || dtype_bits(info.dtype) < 16)
      return invalid_argument("{}: tensor '{}' is {} {}; a projection to quantize must be a bf16, f16 or f32 matrix",
                              options.model_dir, name, safetensors_dtype_name(info.dtype), info.shape.to_string());
    const int64_t rows = info.shape[0], cols = info.shape[1];
    if (auto status = ops::check_quantizable(options.format, rows, cols); !status.is_ok())
      return status.with_context(fmt::format("{}: tensor '{}'", options.model_dir, name));
    const QuantTensorNames names = quant_tensor_names(options.format, name);
    const StoredTensorSpec values = stored_values_spec(options.format, rows, cols);
    const StoredTensorSpec scales = stored_scales_spec(options.format, rows, cols);
    p.output_names = {names.values, names.scales};
    p.output_bytes = dtype_bytes(values.dtype, values.shape.num_elements()) +
                     dtype_bytes(scales.dtype, scales.shape.num_elements());
    if (!names.global_scale.empty()) {
      p.output_names.push_back(names.global_scale);
      p.output_bytes += sizeof(float);
    }
    plan.push_back(std::move(p));
  }
  return plan;
}

// nvfp4: gate_proj and up_proj of one MLP share a global scale, from both.
float shared_global_amax(ThreadPool& pool, const SafetensorsCheckpoint& checkpoint, const std::string& name,
                         TensorView tensor) {
  float amax = tensor_max_abs(pool, tensor);
  for (auto [mine, sibling] : {std::pair{"gate_proj.weight", "up_proj.weight"}, {"up_proj.weight", "gate_proj.weight"}}) {
    if (!name.ends_with(mine)) continue;
    const std::string other = name.substr(0, name.size() - std::string_view(mine).size()) + sibling;
    if (auto view = checkpoint.view(other); view.has_value()) amax = std::max(amax, tensor_max_abs(pool, *view));
  }
  return amax;
}

// The outputs of one shard: owned quantized tensors and views of copied ones.
struct ShardContents {
  std::vector<OwnedQuantized> owned;
  std::vector<std::pair<std::string, TensorView>> tensors;
};

Status convert_tensor(ThreadPool& pool, const SafetensorsCheckpoint& checkpoint, const PlannedTensor& p,
                      QuantFormat format, ShardContents& shard) {
  MOE_ASSIGN_OR_RETURN(TensorView input, checkpoint.view(p.name));
  if (!p.quantize) {
    shard.tensors.emplace_back(p.name, input);
    return Status::ok();
  }
  const float global_amax =
      ops::quant_format_spec(format).has_global_scale ? shared_global_amax(pool, checkpoint, p.name, input) : 0.0f;
  MOE_ASSIGN_OR_RETURN(OwnedQuantized q, quantize_tensor(pool, format, input, global_amax));
  const int64_t rows = input.dim(0), cols = input.dim(1);
  const StoredTensorSpec values = stored_values_spec(format, rows, cols);
  const StoredTensorSpec scales = stored_scales_spec(format, rows, cols);
  shard.tensors.emplace_back(p.output_names[0], TensorView(q.values.data(), values.dtype, values.shape));
  shard.tensors.emplace_back(p.output_names[1], TensorView(q.scales.data(), scales.dtype, scales.shape));
  if (p.output_names.size() > 2)
    shard.tensors.emplace_back(p.output_names[2], TensorView(q.global_scale.data(), DType::kF32, Shape{}));
  shard.owned.push_back(std::move(q));
  return Status::ok();
}

Status write_config_and_files(const QuantizeOptions& options) {
  MOE_ASSIGN_OR_RETURN(std::string config_text, read_text(fs::path(options.model_dir) / "config.json"));
  json config;
  try {
    config = json::parse(config_text);
  } catch (const std::exception& e) {
    return invalid_argument("{}/config.json: {}", options.model_dir, e.what());
  }
  config["quantization_config"] = quantization_config_json(options.format);
  MOE_RETURN_IF_ERROR(write_text(fs::path(options.out_dir) / "config.json", config.dump(2) + "\n"));
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(options.model_dir, ec)) {
    const std::string file = entry.path().filename().string();
    if (!entry.is_regular_file() || file == "config.json" || file == "model.safetensors.index.json" ||
        file.ends_with(".safetensors"))
      continue;
    fs::copy_file(entry.path(), fs::path(options.out_dir) / file, fs::copy_options::overwrite_existing, ec);
    if (ec) return unavailable("copying {} to {}: {}", entry.path().string(), options.out_dir, ec.message());
  }
  if (ec) return unavailable("{}: {}", options.model_dir, ec.message());
  return Status::ok();
}

}  // namespace

bool is_quantized_projection(const std::string& name, bool quantize_attention) {
  if (!name.starts_with("model.layers.")) return false;
  if (ends_with_any(name, {".mlp.gate_proj.weight", ".mlp.up_proj.weight", ".mlp.down_proj.weight"})) return true;
  if (name.find(".mlp.experts.") != std::string::npos &&
      ends_with_any(name, {".gate_proj.weight", ".up_proj.weight", ".down_proj.weight"}))
    return true;
  return quantize_attention && ends_with_any(name, {".self_attn.q_proj.weight", ".self_attn.k_proj.weight",
                                                    ".self_attn.v_proj.weight", ".self_attn.o_proj.weight"});
}

Expected<QuantizeSummary> quantize_checkpoint(const QuantizeOptions& options,
                                              const std::function<void(const QuantizeProgress&)>& progress) {
  if (options.format == QuantFormat::kNone) return invalid_argument("--format: choose a quantized format");
  MOE_ASSIGN_OR_RETURN(ModelConfig config, load_model_config(options.model_dir));
  if (config.quantization.format != QuantFormat::kNone || !config.quantization.method.empty())
    return invalid_argument("{}: the checkpoint is already quantized ('{}'); convert a bf16 or f32 one",
                            options.model_dir, config.quantization.method);
  MOE_ASSIGN_OR_RETURN(SafetensorsCheckpoint checkpoint, SafetensorsCheckpoint::open(options.model_dir));
  MOE_ASSIGN_OR_RETURN(std::vector<PlannedTensor> plan, plan_tensors(checkpoint, options));
  MOE_RETURN_IF_ERROR(check_directories(options));

  // Shards: consecutive tensors, closed before one that would overflow.
  std::vector<std::vector<const PlannedTensor*>> shards(1);
  uint64_t shard_bytes = 0;
  QuantizeSummary summary;
  QuantizeProgress state;
  for (const PlannedTensor& p : plan) {
    if (!shards.back().empty() && shard_bytes + p.output_bytes > options.max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(&p);
    shard_bytes += p.output_bytes;
    summary.output_bytes += p.output_bytes;
    summary.input_bytes += p.input_bytes;
    summary.num_quantized += p.quantize ? 1 : 0;
  }
  summary.num_tensors = static_cast<int64_t>(plan.size());
  summary.num_shards = static_cast<int>(shards.size());
  state.num_tensors = summary.num_tensors;
  state.input_bytes = summary.input_bytes;

  ThreadPool pool(options.num_threads);
  const auto start = std::chrono::steady_clock::now();
  json weight_map = json::object();
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string shard_name = fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, shards.size());
    ShardContents contents;
    for (const PlannedTensor* p : shards[s]) {
      if (auto status = convert_tensor(pool, checkpoint, *p, options.format, contents); !status.is_ok())
        return status.with_context(p->name);
      for (const auto& name : p->output_names) weight_map[name] = shard_name;
      state.num_tensors_done += 1;
      state.input_bytes_done += p->input_bytes;
      state.output_bytes_done += p->output_bytes;
      state.elapsed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (progress) progress(state);
    }
    MOE_RETURN_IF_ERROR(write_safetensors((fs::path(options.out_dir) / shard_name).string(), contents.tensors, metadata));
  }
  json index = {{"metadata", {{"total_size", summary.output_bytes}}}, {"weight_map", std::move(weight_map)}};
  MOE_RETURN_IF_ERROR(write_text(fs::path(options.out_dir) / "model.safetensors.index.json", index.dump(2) + "\n"));
  MOE_RETURN_IF_ERROR(write_config_and_files(options));
  return summary;
}

}  // namespace moe::model
