// Model-level GPU benchmarks of gpu_bench (model_bench.cc), on dummy
// Qwen3-235B-A22B layers cut from the config at `config_path`:
//   bench_model     decoder layers at decode batch 64 / 128 / 256 against the bytes floor;
//   bench_verify    a step verifying k MTP drafts per sequence against a plain step;
//   bench_sampling  a step's sampling on the GPU against the host path it replaced, and
//                   structured outputs' token masks as bitmasks against sparse entries.
#pragma once

#include <string>

#include "ops/quant.h"

namespace moe::bench {

// only_batch (0: all): one batch size, e.g. for a profiler.
void bench_model(const std::string& config_path, int num_layers, double copy_gbs, ops::QuantFormat experts,
                 int only_batch);
void bench_verify(const std::string& config_path, int num_layers);
void bench_sampling(const std::string& config_path, int num_layers);

}  // namespace moe::bench
