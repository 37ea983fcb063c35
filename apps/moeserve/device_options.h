// The device flags shared by `generate`, `serve`, `prefill` and `decode`:
// --device, --gpu, --gpu-memory-utilization and --enforce-eager, and the
// check that the chosen device can be used.
#pragma once

#include <string>

#include <CLI/CLI.hpp>

#include "core/status.h"

namespace moe::apps {

struct DeviceArgs {
  std::string device = "cpu";
  int gpu = 0;  // CUDA ordinal (--gpu), as the driver numbers them (CUDA_VISIBLE_DEVICES applies)
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

}  // namespace moe::apps
