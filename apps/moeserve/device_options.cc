#include "apps/moeserve/device_options.h"

#include <charconv>
#include <set>
#include <string_view>

#ifdef MOE_WITH_CUDA
#include "engine/cuda_runner.h"
#endif

namespace moe::apps {

Expected<std::vector<int>> parse_gpu_range(std::string_view item) {
  auto number = [&](std::string_view text) -> Expected<int> {
    int value = -1;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (ec != std::errc() || end != text.data() + text.size() || value < 0 || value > 1023)
      return invalid_argument("'{}' is not a GPU ordinal (0-1023) or a range of them (0-7)", item);
    return value;
  };
  const size_t dash = item.find('-');
  MOE_ASSIGN_OR_RETURN(const int first, number(item.substr(0, dash)));
  if (dash == std::string_view::npos) return std::vector<int>{first};
  MOE_ASSIGN_OR_RETURN(const int last, number(item.substr(dash + 1)));
  if (last < first) return invalid_argument("'{}': the range ends before it starts", item);
  std::vector<int> out;
  for (int g = first; g <= last; ++g) out.push_back(g);
  return out;
}

void add_device_options(CLI::App* cmd, DeviceArgs& args) {
  cmd->add_option("--device", args.device, "cpu or cuda (one GPU)")->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--gpu", args.gpu, "With --device cuda: the GPU to run on (CUDA ordinal)")
      ->check(CLI::Range(0, 1023));
  cmd->add_option_function<std::vector<std::string>>(
         "--gpus",
         [&args](const std::vector<std::string>& items) {
           args.gpus.clear();
           for (const std::string& item : items) {
             auto range = parse_gpu_range(item);
             if (!range) throw CLI::ValidationError("--gpus", range.status().message());
             args.gpus.insert(args.gpus.end(), range->begin(), range->end());
           }
         },
         "With --device cuda and --tp/--ep (or serve --disagg): each rank's (instance's) GPU, comma-separated, "
         "ranges allowed (0-3,6; default --gpu, --gpu + 1, ...); "
         "a GPU named twice is shared, time-sliced, which only tests should do (needs --kv-cache-gb)")
      ->delimiter(',');
  cmd->add_option("--gpu-memory-utilization", args.gpu_memory_utilization,
                  "With --device cuda: share of the GPU's memory for weights, activations and the KV cache")
      ->check(CLI::Range(0.05, 0.99));
  cmd->add_flag("--enforce-eager", args.enforce_eager, "With --device cuda: no CUDA graphs for decode steps");
}

Status check_device(const DeviceArgs& args) {
  if (args.device != "cpu" && args.device != "cuda")
    return invalid_argument("--device must be cpu or cuda, got '{}'", args.device);
  if (!args.cuda()) {
    if (args.gpu != 0) return invalid_argument("--gpu {} only applies with --device cuda", args.gpu);
    if (!args.gpus.empty()) return invalid_argument("--gpus only applies with --device cuda");
    return Status::ok();
  }
#ifdef MOE_WITH_CUDA
  return engine::use_cuda_device(args.gpu);
#else
  return unimplemented("--device cuda: this build has no CUDA backend (nvcc was not found)");
#endif
}

Expected<int> rank_gpu(const DeviceArgs& args, int rank, int world, const char* unit) {
  if (args.gpus.empty()) return args.gpu + rank;
  if (static_cast<int>(args.gpus.size()) != world)
    return invalid_argument("--gpus names {} GPUs for {} {}: give one each", args.gpus.size(), world, unit);
  return args.gpus[rank];
}

bool gpus_repeat(const DeviceArgs& args) {
  return std::set<int>(args.gpus.begin(), args.gpus.end()).size() < args.gpus.size();
}

}  // namespace moe::apps
