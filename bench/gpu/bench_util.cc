#include "bench/gpu/bench_util.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "ops/cuda/kernels.h"

namespace moe::bench {

namespace k = ops::cuda;
using bf16 = __nv_bfloat16;

std::FILE* json_out = nullptr;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}
void check(const Status& s) {
  if (!s.is_ok()) {
    std::fprintf(stderr, "%s\n", s.to_string().c_str());
    std::exit(1);
  }
}

// Median over `repeats` of the mean time of `inner` back-to-back calls, inner
// chosen so a measurement spans about a millisecond: a lone call of a short
// kernel would otherwise count the host's launch latency while the GPU idles.
double time_ms(const std::function<void()>& body, int warmup, int repeats) {
  for (int i = 0; i < warmup; ++i) body();
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  auto measure = [&](int inner) {
    cudaEventRecord(start);
    for (int i = 0; i < inner; ++i) body();
    cudaEventRecord(stop);
    check(cudaEventSynchronize(stop), "timing");
    float t = 0;
    cudaEventElapsedTime(&t, start, stop);
    return static_cast<double>(t) / inner;
  };
  const int inner = std::clamp(static_cast<int>(1.0 / std::max(measure(1), 1e-3)), 1, 100);
  std::vector<double> ms;
  for (int i = 0; i < repeats; ++i) ms.push_back(measure(inner));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Per-call milliseconds of `body(stream)` replayed from a CUDA graph of
// `calls` calls: no host launch cost, as in the model's decode graphs.
double time_graph_ms(const std::function<void(cudaStream_t)>& body, int calls) {
  cudaStream_t stream;
  check(cudaStreamCreate(&stream), "stream");
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "capture");
  for (int i = 0; i < calls; ++i) body(stream);
  check(cudaStreamEndCapture(stream, &graph), "end capture");
  check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  const double ms = time_ms([&] { cudaGraphLaunch(exec, stream); }) / calls;
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  return ms;
}

DeviceTensor random_bf16(Shape shape, uint64_t seed, float scale) {
  auto t = DeviceTensor::allocate(DType::kBF16, shape);
  check(t.status());
  check(k::fill_random({t->data_as<bf16>(), shape.num_elements(), seed, 0.0f, scale}, nullptr), "fill");
  return std::move(t).value();
}

DeviceTensor device_ints(const std::vector<int32_t>& v) {
  auto t = DeviceTensor::upload(
      TensorView(const_cast<int32_t*>(v.data()), DType::kI32, {static_cast<int64_t>(v.size())}));
  check(t.status());
  return std::move(t).value();
}

void report(const char* bench, const std::string& shape, double ms, double floor_ms,
            const std::string& extra) {
  std::printf("%-22s %-34s %10.3f ms  floor %8.3f ms  %5.1f%% of floor  %s\n", bench, shape.c_str(), ms,
              floor_ms, 100.0 * floor_ms / ms, extra.c_str());
  if (json_out)
    std::fprintf(json_out,
                 "{\"bench\":\"%s\",\"shape\":\"%s\",\"ms\":%.6f,\"floor_ms\":%.6f,\"extra\":\"%s\"}\n",
                 bench, shape.c_str(), ms, floor_ms, extra.c_str());
}

double copy_bandwidth_gbs() {
  const size_t bytes = size_t{4} << 30;
  auto a = DeviceBuffer::allocate(bytes), b = DeviceBuffer::allocate(bytes);
  check(a.status());
  check(b.status());
  check(cudaMemset(a->data(), 1, bytes), "memset");
  const double ms =
      time_ms([&] { cudaMemcpyAsync(b->data(), a->data(), bytes, cudaMemcpyDeviceToDevice); }, 2, 10);
  const double gbs = 2.0 * bytes / (ms * 1e6);
  std::printf("copy bandwidth (read + write): %.0f GB/s\n", gbs);
  if (json_out) std::fprintf(json_out, "{\"bench\":\"copy\",\"gbs\":%.1f}\n", gbs);
  return gbs;
}

// The SM clock moves with power and heat from call to call, so kernels
// compared with each other are timed interleaved: call by call in turn, each
// call between its own CUDA events, MOE_BENCH_CALLS rounds (default 30) after
// three warm-up rounds; the median per kernel, and the first kernel's median
// against each other's.
std::vector<double> interleaved(const char* what,
                                const std::vector<std::pair<std::string, std::function<void()>>>& kernels) {
  const char* env = std::getenv("MOE_BENCH_CALLS");
  const int calls = env != nullptr ? std::max(1, std::atoi(env)) : 30;
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<std::vector<double>> ms(kernels.size());
  for (int c = -3; c < calls; ++c) {
    for (size_t i = 0; i < kernels.size(); ++i) {
      cudaEventRecord(start);
      kernels[i].second();
      cudaEventRecord(stop);
      check(cudaEventSynchronize(stop), "timing");
      float t = 0;
      cudaEventElapsedTime(&t, start, stop);
      if (c >= 0) ms[i].push_back(t);
    }
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::vector<double> medians;
  for (auto& m : ms) {
    std::sort(m.begin(), m.end());
    medians.push_back(m[m.size() / 2]);
  }
  std::printf("%s, interleaved, %d calls each: median (p10 .. p90) ms:\n", what, calls);
  for (size_t i = 0; i < kernels.size(); ++i) {
    std::printf("  %-24s %.3f (%.3f .. %.3f)", kernels[i].first.c_str(), medians[i], ms[i][ms[i].size() / 10],
                ms[i][ms[i].size() * 9 / 10]);
    if (i > 0) std::printf("  %s / this = %.3fx", kernels[0].first.c_str(), medians[i] / medians[0]);
    std::printf("\n");
    if (json_out)
      std::fprintf(json_out,
                   "{\"bench\":\"interleaved\",\"what\":\"%s\",\"kernel\":\"%s\",\"calls\":%d,"
                   "\"median_ms\":%.4f}\n",
                   what, kernels[i].first.c_str(), calls, medians[i]);
  }
  return medians;
}

CopyProbe::CopyProbe(size_t n)
    : bytes(n),
      a(std::move(DeviceBuffer::allocate(n)).value()),
      b(std::move(DeviceBuffer::allocate(n)).value()) {
  check(cudaMemset(a.data(), 1, n), "memset");
}

void CopyProbe::operator()() {
  cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice);
}

DeviceTensor alloc(DType dtype, Shape shape) {
  auto t = DeviceTensor::allocate(dtype, shape);
  check(t.status());
  return std::move(t).value();
}

// Random finite E4M3 weights: random bf16 rows quantized by the activation quantizer.
DeviceTensor fp8_weights(int64_t rows, int64_t cols, uint64_t seed) {
  DeviceTensor values = alloc(DType::kF8E4M3, {rows, cols});
  DeviceTensor row_scales = alloc(DType::kF32, {rows, cols / 128});
  DeviceTensor source = random_bf16({rows, cols}, seed, 0.02f);
  check(k::quantize_fp8_groups({source.data_as<bf16>(), values.data_as<uint8_t>(),
                                row_scales.data_as<float>(), static_cast<int>(rows), static_cast<int>(cols)},
                               nullptr),
        "quantize weights");
  return values;
}

// 128 x 128 block scales of `experts` experts, small positive values.
DeviceTensor block_scales(int64_t experts, int64_t block_rows, int64_t block_cols) {
  std::vector<float> host(static_cast<size_t>(experts * block_rows * block_cols));
  for (size_t i = 0; i < host.size(); ++i) host[i] = 1e-3f * (1.0f + static_cast<float>(i % 7));
  auto t = DeviceTensor::upload(TensorView(host.data(), DType::kF32, {experts, block_rows, block_cols}));
  check(t.status());
  return std::move(t).value();
}

}  // namespace moe::bench
