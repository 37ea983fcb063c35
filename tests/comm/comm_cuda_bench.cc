// All-reduce, fused norm and dispatch/combine timings on --ranks GPUs (2 by
// default; ranks as threads of this process, one GPU each), against NCCL in
// the same run.
// Validation is comm_cuda_test's job; this only times. Each point: warm-up,
// then `reps` timings of `iters` back-to-back calls between CUDA events; the
// median per call is reported. "graph" rows capture `iters` calls in a CUDA
// graph and time its replay (what the engine will do).
//
// Output: a Markdown table on stdout and one JSON object per line in
// --json FILE. Usage: comm_cuda_bench [--json FILE] [--max-mb 256] [--ranks 2]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <string>
#include <vector>

#include "comm/cuda/kernels.h"
#include "comm/cuda/symmetric_memory.h"
#include "gpu_test_util.h"
#ifdef MOE_COMM_HAVE_NCCL
#include "comm/cuda/nccl_communicator.h"
#endif

namespace moe::comm::cuda {
namespace {

struct Row {
  std::string op, impl, mode;
  double bytes = 0, us = 0;
  int ranks = 0;
};

std::mutex g_mutex;
std::vector<Row> g_rows;

// Median per-call microseconds of fn() (which enqueues one call on stream).
template <typename Fn>
double time_calls(cudaStream_t stream, TcpBootstrap& b, int iters, bool graph, Fn fn) {
  for (int i = 0; i < 5; ++i) fn();
  cudaGraphExec_t exec = nullptr;
  if (graph) {
    cudaGraph_t g = nullptr;
    cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal);
    for (int i = 0; i < iters; ++i) fn();
    cudaStreamEndCapture(stream, &g);
    cudaGraphInstantiate(&exec, g, 0);
    cudaGraphDestroy(g);
    cudaGraphLaunch(exec, stream);
  }
  cudaStreamSynchronize(stream);
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<double> samples;
  for (int rep = 0; rep < 7; ++rep) {
    (void)b.barrier();  // both ranks start together
    cudaEventRecord(start, stream);
    if (graph) cudaGraphLaunch(exec, stream);
    else
      for (int i = 0; i < iters; ++i) fn();
    cudaEventRecord(stop, stream);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    samples.push_back(1000.0 * ms / iters);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  if (exec != nullptr) cudaGraphExecDestroy(exec);
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

void record(TcpBootstrap& b, Row row) {
  if (b.rank() != 0) return;
  row.ranks = b.world_size();
  std::lock_guard lock(g_mutex);
  g_rows.push_back(std::move(row));
}

void bench_all_reduce(TcpBootstrap& b, const SymmetricView& view, void* nccl, size_t max_bytes, cudaStream_t stream) {
  void* data = nullptr;
  cudaMalloc(&data, max_bytes);
  cudaMemset(data, 0, max_bytes);
  for (size_t bytes = 4096; bytes <= max_bytes; bytes *= 4) {
    const int64_t n = static_cast<int64_t>(bytes / 2);
    const int iters = static_cast<int>(std::clamp<size_t>((256u << 20) / bytes, 5, 200));
    AllReduceParams p{view, static_cast<const bf16*>(data), static_cast<bf16*>(data), n};
    for (bool graph : {false, true}) {
      const char* mode = graph ? "graph" : "eager";
      record(b, {"all_reduce", "ours auto", mode, double(bytes), time_calls(stream, b, iters, graph, [&] { all_reduce_auto(p, stream); })});
      if (n <= all_reduce_max_elements(view)) {
        record(b, {"all_reduce", "ours one-shot", mode, double(bytes), time_calls(stream, b, iters, graph, [&] { all_reduce_one_shot(p, stream); })});
        record(b, {"all_reduce", "ours two-shot", mode, double(bytes), time_calls(stream, b, iters, graph, [&] { all_reduce_two_shot(p, stream); })});
      }
#ifdef MOE_COMM_HAVE_NCCL
      if (nccl != nullptr && !graph)
        record(b, {"all_reduce", "nccl", mode, double(bytes), time_calls(stream, b, iters, false, [&] {
                     (void)static_cast<NcclCommunicator*>(nccl)->all_reduce(static_cast<bf16*>(data), static_cast<bf16*>(data), n, stream);
                   })});
#endif
    }
  }
  cudaFree(data);
}

void bench_fused(TcpBootstrap& b, const SymmetricView& view, cudaStream_t stream) {
  const int hidden = 4096;
  for (int rows : {1, 32, 128, 512, 2048}) {
    const size_t n = static_cast<size_t>(rows) * hidden;
    void *delta = nullptr, *residual = nullptr, *weight = nullptr, *out = nullptr;
    cudaMalloc(&delta, 2 * n);
    cudaMalloc(&residual, 4 * n);
    cudaMalloc(&weight, 2 * hidden);
    cudaMalloc(&out, 2 * n);
    cudaMemset(delta, 0, 2 * n);
    cudaMemset(residual, 0, 4 * n);
    cudaMemset(weight, 0, 2 * hidden);
    const bool two_shot = rows >= 512;
    FusedAllReduceNormParams f{view, static_cast<const bf16*>(delta), static_cast<float*>(residual),
                               static_cast<const bf16*>(weight), static_cast<bf16*>(out), rows, hidden, 1e-6f, two_shot};
    AllReduceParams p{view, static_cast<const bf16*>(delta), static_cast<bf16*>(out), static_cast<int64_t>(n)};
    record(b, {fmt::format("fused norm {}x{}", rows, hidden), two_shot ? "ours two-shot" : "ours one-shot", "graph",
               double(2 * n), time_calls(stream, b, 50, true, [&] { fused_all_reduce_add_rms_norm(f, stream); })});
    record(b, {fmt::format("plain all_reduce {}x{}", rows, hidden), two_shot ? "ours two-shot" : "ours one-shot", "graph",
               double(2 * n), time_calls(stream, b, 50, true, [&] {
                 two_shot ? all_reduce_two_shot(p, stream) : all_reduce_one_shot(p, stream);
               })});
    for (void* ptr : {delta, residual, weight, out}) cudaFree(ptr);
  }
}

void bench_expert_exchange(TcpBootstrap& b, cudaStream_t stream) {
  const int world = b.world_size(), hidden = 4096, k = 8, experts = 128, max_tokens = 256;
  const ExpertLayout layout{world, experts / world, max_tokens, k, hidden};
  SymmetricMemoryOptions options;
  options.device = b.rank();
  options.data_bytes = layout.total_bytes() - kSignalBytes;
  auto mem = CudaSymmetricMemory::create(options, b);
  if (!mem) {
    fprintf(stderr, "expert exchange memory: %s\n", mem.status().to_string().c_str());
    return;
  }
  void *x = nullptr, *ids = nullptr, *w = nullptr, *y = nullptr, *out = nullptr;
  cudaMalloc(&x, 2ull * max_tokens * hidden);
  cudaMalloc(&ids, 4ull * max_tokens * k);
  cudaMalloc(&w, 4ull * max_tokens * k);
  cudaMalloc(&y, 2ull * layout.pool_rows() * hidden);
  cudaMalloc(&out, 4ull * max_tokens * hidden);
  std::vector<int32_t> host_ids(static_cast<size_t>(max_tokens) * k);
  for (size_t i = 0; i < host_ids.size(); ++i)  // token t: experts (t * 8 + j * 16) % 128, distinct
    host_ids[i] = static_cast<int32_t>(((i / k) * 8 + (i % k) * 16) % experts);
  cudaMemcpy(ids, host_ids.data(), 4 * host_ids.size(), cudaMemcpyHostToDevice);
  cudaMemset(x, 0, 2ull * max_tokens * hidden);
  cudaMemset(w, 0, 4ull * max_tokens * k);
  for (int tokens : {1, 32, 128, 256}) {
    DispatchParams d{(*mem)->view(), layout, static_cast<const bf16*>(x), static_cast<const int32_t*>(ids), tokens};
    CombineParams c{(*mem)->view(), layout, static_cast<const bf16*>(y), static_cast<const float*>(w),
                    static_cast<float*>(out), tokens};
    // Dispatch and combine must alternate (the receive counters' parity), so
    // the pair is timed; nsys splits it when the targets need each side.
    const double pair = time_calls(stream, b, 50, true, [&] { dispatch(d, stream); combine(c, stream); });
    record(b, {fmt::format("dispatch+combine {} tok/rank top-{} of {}, hidden {}", tokens, k, experts, hidden),
               "ours", "graph", double(2.0 * tokens * k * hidden), pair});
  }
  for (void* ptr : {x, ids, w, y, out}) cudaFree(ptr);
}

}  // namespace
}  // namespace moe::comm::cuda

int main(int argc, char** argv) {
  using namespace moe::comm::cuda;
  std::string json_path;
  size_t max_mb = 256;
  int ranks = 2;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--json") == 0) json_path = argv[i + 1];
    if (std::strcmp(argv[i], "--max-mb") == 0) max_mb = std::stoul(argv[i + 1]);
    if (std::strcmp(argv[i], "--ranks") == 0) ranks = std::atoi(argv[i + 1]);
  }
  if (ranks < 2 || moe::comm::testing::gpu_count() < ranks) {
    fprintf(stderr, "comm_cuda_bench --ranks %d needs that many GPUs (at least 2), found %d\n", ranks,
            moe::comm::testing::gpu_count());
    return 2;
  }
  const std::string error = moe::comm::testing::run_gpu_ranks(ranks, [&](moe::comm::TcpBootstrap& b) {
    cudaStream_t stream;
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    SymmetricMemoryOptions options;
    options.device = b.rank();
    options.data_bytes = 2 * (max_mb << 20);  // two halves of the largest message
    auto mem = CudaSymmetricMemory::create(options, b);
    if (!mem) {
      fprintf(stderr, "rank %d: %s\n", b.rank(), mem.status().to_string().c_str());
      return;
    }
    void* nccl = nullptr;
#ifdef MOE_COMM_HAVE_NCCL
    auto comm = NcclCommunicator::create(b, b.rank());
    if (comm.has_value())
      nccl = comm->get();
    else
      fprintf(stderr, "rank %d: no NCCL baseline: %s\n", b.rank(), comm.status().to_string().c_str());
#endif
    bench_all_reduce(b, (*mem)->view(), nccl, max_mb << 20, stream);
    bench_fused(b, (*mem)->view(), stream);
    bench_expert_exchange(b, stream);
    cudaStreamSynchronize(stream);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess)
      fprintf(stderr, "rank %d: %s\n", b.rank(), cudaGetErrorString(e));
  });
  if (!error.empty()) fprintf(stderr, "%s\n", error.c_str());
  std::ofstream json;
  if (!json_path.empty()) json.open(json_path);
  printf("| op | ranks | impl | mode | bytes | us | algbw GB/s |\n|---|---|---|---|---|---|---|\n");
  for (const auto& r : moe::comm::cuda::g_rows) {
    const double gbps = r.bytes / (r.us * 1e3);
    printf("| %s | %d | %s | %s | %.0f | %.2f | %.1f |\n", r.op.c_str(), r.ranks, r.impl.c_str(),
           r.mode.c_str(), r.bytes, r.us, gbps);
    if (json.is_open())
      json
          << fmt::format(
                 R"({{"op": "{}", "ranks": {}, "impl": "{}", "mode": "{}", "bytes": {}, "us": {:.3f}, "algbw_gbps": {:.2f}}})",
                 r.op, r.ranks, r.impl, r.mode, r.bytes, r.us, gbps)
          << "\n";
  }
  return error.empty() ? 0 : 1;
}
