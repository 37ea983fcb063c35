// The device flags shared by `generate` and `serve`: --device,
// --gpu-memory-utilization and --enforce-eager, and the check that the
// chosen device can be used.
#pragma once

#include <string>

#include <CLI/CLI.hpp>

#include "core/status.h"

namespace moe::apps {

struct DeviceArgs {
  std::string device = "cpu";
  double gpu_memory_utilization = 0.9;
  bool enforce_eager = false;
  bool cuda() const { return device == "cuda"; }
};

void add_device_options(CLI::App* cmd, DeviceArgs& args);

// Ok for cpu, and for cuda when this build has the CUDA backend and a GPU is
// usable; else an error naming the reason.
Status check_device(const DeviceArgs& args);

}  // namespace moe::apps
