#include "apps/moeserve/device_options.h"

#include <set>

#ifdef MOE_WITH_CUDA
#include "engine/cuda_runner.h"
#endif

namespace moe::apps {

void add_device_options(CLI::App* cmd, DeviceArgs& args) {
  cmd->add_option("--device", args.device, "cpu or cuda (one GPU)")->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--gpu", args.gpu, "With --device cuda: the GPU to run on (CUDA ordinal, default 0)")
      ->check(CLI::Range(0, 1023));
  cmd->add_option("--gpus", args.gpus,
                  "With --device cuda and --tp/--ep (or serve --disagg): each rank's (instance's) GPU, comma-separated "
                  "(default --gpu, --gpu + 1, ...); "
                  "a GPU named twice is shared, time-sliced, which only tests should do (needs --kv-cache-gb)")
      ->delimiter(',')
      ->check(CLI::Range(0, 1023));
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
