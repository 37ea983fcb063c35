#include "apps/moeserve/device_options.h"

#ifdef MOE_WITH_CUDA
#include "engine/cuda_runner.h"
#endif

namespace moe::apps {

void add_device_options(CLI::App* cmd, DeviceArgs& args) {
  cmd->add_option("--device", args.device, "cpu or cuda (one GPU)")->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--gpu", args.gpu, "With --device cuda: the GPU to run on (CUDA ordinal, default 0)")
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
    return Status::ok();
  }
#ifdef MOE_WITH_CUDA
  return engine::use_cuda_device(args.gpu);
#else
  return unimplemented("--device cuda: this build has no CUDA backend (nvcc was not found)");
#endif
}

}  // namespace moe::apps
