// The device flags shared by `generate`, `serve`, `prefill` and `decode`:
// --device, --gpu, --gpus, --gpu-memory-utilization and --enforce-eager, and the
// check that the chosen device can be used.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include <CLI/CLI.hpp>

#include "core/status.h"

namespace moe::apps {

struct DeviceArgs {
  std::string device = "cpu";
  int gpu = 0;  // CUDA ordinal (--gpu), as the driver numbers them (CUDA_VISIBLE_DEVICES applies)
  std::vector<int> gpus;  // --gpus: GPU ranks' ordinals, one per rank (empty: --gpu, --gpu + 1, ...)
  double gpu_memory_utilization = 0.9;
  bool enforce_eager = false;
  bool cuda() const { return device == "cuda"; }
};

void add_device_options(CLI::App* cmd, DeviceArgs& args);

// Ok for cpu, and for cuda when this build has the CUDA backend and GPU
// --gpu is usable, which it then makes the calling thread's current device
// (before anything is allocated, so no context is created on another GPU);
// else an error naming the reason.
Status check_device(const DeviceArgs& args);

// The GPU of rank `rank` of `world` GPU ranks (or instance of `serve
// --disagg`'s instances: `unit` names them in errors): --gpus[rank] when given
// (its length must be `world`), else --gpu + rank.
Expected<int> rank_gpu(const DeviceArgs& args, int rank, int world, const char* unit = "ranks");

// One item of --gpus: an ordinal ("3") or an inclusive range ("0-7").
Expected<std::vector<int>> parse_gpu_range(std::string_view item);

// Whether --gpus names a GPU more than once (processes sharing it).
bool gpus_repeat(const DeviceArgs& args);

}  // namespace moe::apps
