// Timing and data helpers of the GPU benchmarks (gpu_bench.cc): CUDA-event
// timing (one-shot medians, graph replays, kernels interleaved call by call),
// the copy bandwidth that memory-bound floors use, random device inputs, and
// the table / JSON-lines report.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/cuda/device_buffer.h"
#include "core/status.h"

namespace moe::bench {

extern std::FILE* json_out;  // --json: one JSON line per result (null: none)

// Exit with the error's text unless it is a success.
void check(cudaError_t e, const char* what);
void check(const Status& s);

// Median over `repeats` of the mean time of back-to-back calls spanning about
// a millisecond, after `warmup` calls.
double time_ms(const std::function<void()>& body, int warmup = 3, int repeats = 20);
// Per-call milliseconds of `body(stream)` replayed from a CUDA graph of `calls` calls.
double time_graph_ms(const std::function<void(cudaStream_t)>& body, int calls = 20);
// Kernels compared with each other, timed call by call in turn (medians; see the definition).
std::vector<double> interleaved(const char* what,
                                const std::vector<std::pair<std::string, std::function<void()>>>& kernels);
// A device-to-device copy of `bytes` (2 x bytes of traffic), for timing interleaved with a memory-bound
// kernel.
struct CopyProbe {
  size_t bytes;
  DeviceBuffer a, b;
  explicit CopyProbe(size_t n);
  void operator()();
  double gbs(double ms) const { return 2.0 * static_cast<double>(bytes) / (ms * 1e6); }
};
// Read + write bandwidth of a 4 GB device-to-device copy (printed and reported).
double copy_bandwidth_gbs();

void report(const char* bench, const std::string& shape, double ms, double floor_ms,
            const std::string& extra);

DeviceTensor alloc(DType dtype, Shape shape);
DeviceTensor random_bf16(Shape shape, uint64_t seed, float scale = 1.0f);
DeviceTensor device_ints(const std::vector<int32_t>& v);
// Random finite E4M3 weights: random bf16 rows quantized by the activation quantizer.
DeviceTensor fp8_weights(int64_t rows, int64_t cols, uint64_t seed);
// 128 x 128 block scales of `experts` experts, small positive values.
DeviceTensor block_scales(int64_t experts, int64_t block_rows, int64_t block_cols);

}  // namespace moe::bench
