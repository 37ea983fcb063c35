// TransferEngine bandwidth: TCP loopback between two engines of this process
// (4 KB .. 256 MB writes, and paged KV-like layer writes from a KV plan), and,
// when built with CUDA and two GPUs are visible, the CUDA IPC transport
// against a plain cudaMemcpyPeerAsync measured in the same run.
//
// Each sample submits a train of batches back to back (enough to move at
// least --min-sample-mb) and times until the receiver's counter reaches them;
// the table shows the median over --repeats samples, plus the median latency
// of one lone batch (submit -> receiver counted it). Bytes are validated after
// the timed runs.
//
//   transfer_bench [--repeats 5] [--connections 4] [--max-mb 256] [--no-tcp] [--no-kv] [--cuda]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "transfer/kv_plan.h"
#include "transfer/transfer_engine.h"
#ifdef MOE_TRANSFER_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace moe::transfer {
namespace {

using Clock = std::chrono::steady_clock;
constexpr std::chrono::milliseconds kTimeout{120000};

struct Args {
  int repeats = 5;
  int connections = 4;
  uint64_t max_bytes = 256ull << 20;
  uint64_t min_sample_bytes = 256ull << 20;
  bool tcp = true, kv = true, cuda = false;
};

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

std::string size_name(uint64_t bytes) {
  if (bytes >= (1ull << 20)) return fmt::format("{} MB", bytes >> 20);
  return fmt::format("{} KB", bytes >> 10);
}

void die_if(const Status& status, const char* what) {
  if (!status.is_ok()) {
    std::fprintf(stderr, "transfer_bench: %s: %s\n", what, status.to_string().c_str());
    std::exit(1);  // a benchmark binary, not library code
  }
}

uint32_t next_imm = 1;

// Times `num_batches` calls of submit (each one batch) until the receiver has
// counted them all.
template <typename Submit>
double time_train(TransferEngine& sender, TransferEngine& receiver, int num_batches, Submit submit) {
  const uint32_t imm = next_imm++;
  die_if(receiver.arm(imm, sender.endpoint()), "arm");
  const auto start = Clock::now();
  for (int i = 0; i < num_batches; ++i) {
    auto id = submit(i, imm);
    die_if(id.status(), "submit");
  }
  die_if(receiver.wait_for(imm, num_batches, kTimeout), "wait_for");
  const double elapsed = seconds_since(start);
  die_if(receiver.disarm(imm), "disarm");
  return elapsed;
}

void tcp_sizes(const Args& args) {
  EngineOptions options;
  options.num_connections_per_peer = args.connections;
  auto sender = std::move(TransferEngine::create(options).value());
  auto receiver = std::move(TransferEngine::create(options).value());
  std::vector<uint8_t> src(args.max_bytes), dst(args.max_bytes, 0);
  std::mt19937 rng(1);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  const RegionId src_id = sender->register_region(src.data(), src.size()).value();
  const RegionDescriptor dst_desc = *receiver->describe(receiver->register_region(dst.data(), dst.size()).value());

  fmt::print("\nTCP loopback, {} connections per peer, median of {} samples\n", args.connections, args.repeats);
  fmt::print("| size | batches/sample | GB/s (median) | GB/s (min..max) | one-batch latency (us) |\n");
  fmt::print("|---:|---:|---:|---:|---:|\n");
  for (uint64_t size = 4 << 10; size <= args.max_bytes; size *= 4) {
    const int num_batches = static_cast<int>(std::clamp<uint64_t>(args.min_sample_bytes / size, 1, 4096));
    const uint64_t span = std::min<uint64_t>(args.max_bytes / size, num_batches);  // distinct slots
    auto submit = [&](int i, uint32_t imm) {
      const uint64_t offset = (i % span) * size;
      return sender->submit_write(src_id, offset, dst_desc, offset, size, imm);
    };
    time_train(*sender, *receiver, std::min(num_batches, 8), submit);  // warm-up
    std::vector<double> gbps, latency_us;
    for (int r = 0; r < args.repeats; ++r) {
      gbps.push_back(static_cast<double>(size) * num_batches / time_train(*sender, *receiver, num_batches, submit) / 1e9);
      latency_us.push_back(1e6 * time_train(*sender, *receiver, 1, submit));
    }
    const bool valid = std::memcmp(src.data(), dst.data(), span * size) == 0;
    fmt::print("| {} | {} | {:.2f} | {:.2f}..{:.2f} | {:.0f} |{}\n", size_name(size), num_batches, median(gbps),
               *std::min_element(gbps.begin(), gbps.end()), *std::max_element(gbps.begin(), gbps.end()),
               median(latency_us), valid ? "" : " INVALID BYTES");
    if (!valid) std::exit(1);
  }
}

// Paged KV-like writes: one batch per layer (K and V groups) from a KV plan.
void tcp_kv(const Args& args) {
  EngineOptions options;
  options.num_connections_per_peer = args.connections;
  auto sender = std::move(TransferEngine::create(options).value());
  auto receiver = std::move(TransferEngine::create(options).value());
  fmt::print("\nTCP loopback, paged KV writes (bf16, head_dim 128, 4 kv heads, 4096 tokens, 8 layers, "
             "shuffled decode pages), median of {} samples\n",
             args.repeats);
  fmt::print("| prefill tp (rank 0) | pages src->dst | runs/layer | avg run | MB/layer | GB/s (median) | layer latency (us) |\n");
  fmt::print("|---:|---:|---:|---:|---:|---:|---:|\n");
  const int num_layers = 8, num_tokens = 4096;
  struct KvCase {
    int tp, src_page, dst_page;
  };
  for (KvCase c : {KvCase{1, 16, 16}, KvCase{4, 16, 16}, KvCase{1, 16, 32}, KvCase{4, 32, 16}}) {
    KvSideLayout src{4, 128, c.src_page, DType::kBF16, c.tp, 0};
    KvSideLayout dst{4, 128, c.dst_page, DType::kBF16, 1, 0};
    const int num_src_pages = num_tokens / c.src_page, num_dst_pages = 2 * num_tokens / c.dst_page;
    std::vector<int32_t> src_pages(num_src_pages), dst_pages(num_dst_pages);
    std::iota(src_pages.begin(), src_pages.end(), 0);
    std::iota(dst_pages.begin(), dst_pages.end(), 0);
    std::mt19937 rng(2);
    std::shuffle(dst_pages.begin(), dst_pages.end(), rng);
    dst_pages.resize(num_tokens / c.dst_page);
    auto plan = KvTransferPlan::build(src, 0, dst, src_pages, dst_pages, num_tokens).value();
    const uint64_t src_pool = static_cast<uint64_t>(num_src_pages) * c.src_page * 128 * 2 * (4 / std::min(c.tp, 4));
    const uint64_t dst_pool = static_cast<uint64_t>(num_dst_pages) * c.dst_page * 128 * 2 * 4;
    std::vector<std::vector<uint8_t>> src_mem, dst_mem;
    std::vector<KvLayerRegions> local;
    std::vector<KvLayerRemote> remote;
    for (int l = 0; l < num_layers; ++l) {
      src_mem.emplace_back(2 * src_pool, static_cast<uint8_t>(l + 1));
      dst_mem.emplace_back(2 * dst_pool, 0);
      const RegionId s = sender->register_region(src_mem.back().data(), src_mem.back().size()).value();
      const RegionId d = receiver->register_region(dst_mem.back().data(), dst_mem.back().size()).value();
      local.push_back(KvLayerRegions{s, 0, s, src_pool});
      const RegionDescriptor desc = *receiver->describe(d);
      remote.push_back(KvLayerRemote{desc, 0, desc, dst_pool});
    }
    std::vector<std::vector<RegionRuns>> writes;
    for (int l = 0; l < num_layers; ++l) writes.push_back(plan.layer_writes(local[l], remote[l]));
    auto submit = [&](int i, uint32_t imm) { return sender->submit_scattered(writes[i % num_layers], imm); };
    time_train(*sender, *receiver, num_layers, submit);  // warm-up
    std::vector<double> gbps, latency_us;
    for (int r = 0; r < args.repeats; ++r) {
      gbps.push_back(static_cast<double>(plan.bytes_per_layer()) * num_layers /
                     time_train(*sender, *receiver, num_layers, submit) / 1e9);
      latency_us.push_back(1e6 * time_train(*sender, *receiver, 1, submit));
    }
    fmt::print("| {} | {}->{} | {} | {} KB | {:.2f} | {:.2f} | {:.0f} |\n", c.tp, c.src_page, c.dst_page,
               2 * plan.runs().size(), plan.bytes_per_layer() / (2 * plan.runs().size()) >> 10,
               plan.bytes_per_layer() / 1e6, median(gbps), median(latency_us));
  }
}

#ifdef MOE_TRANSFER_HAVE_CUDA
void check_cuda(cudaError_t error, const char* what) {
  if (error != cudaSuccess) {
    std::fprintf(stderr, "transfer_bench: %s: %s\n", what, cudaGetErrorString(error));
    std::exit(1);
  }
}

void cuda_ipc(const Args& args) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count < 2) {
    fmt::print("\nCUDA IPC: skipped, needs 2 GPUs (found {})\n", count);
    return;
  }
  const uint64_t max_bytes = args.max_bytes;
  void *src = nullptr, *dst = nullptr;
  check_cuda(cudaSetDevice(1), "set device");
  check_cuda(cudaMalloc(&dst, max_bytes), "malloc dst");
  check_cuda(cudaSetDevice(0), "set device");
  check_cuda(cudaMalloc(&src, max_bytes), "malloc src");
  check_cuda(cudaMemset(src, 0x3C, max_bytes), "memset");
  const cudaError_t peer = cudaDeviceEnablePeerAccess(1, 0);
  if (peer != cudaSuccess && peer != cudaErrorPeerAccessAlreadyEnabled) check_cuda(peer, "enable peer access");
  cudaGetLastError();
  cudaStream_t stream;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");

  auto sender = std::move(TransferEngine::create({}).value());
  auto receiver = std::move(TransferEngine::create({}).value());
  const RegionId src_id = sender->register_region(src, max_bytes, MemoryKind::kDevice, 0).value();
  const RegionDescriptor dst_desc =
      *receiver->describe(receiver->register_region(dst, max_bytes, MemoryKind::kDevice, 1).value());

  fmt::print("\nCUDA IPC GPU0 -> GPU1 against cudaMemcpyPeerAsync in the same run, median of {} samples\n",
             args.repeats);
  fmt::print("| size | batches/sample | engine GB/s | cudaMemcpyPeer GB/s | ratio |\n|---:|---:|---:|---:|---:|\n");
  for (uint64_t size = 1 << 20; size <= max_bytes; size *= 4) {
    const int num_batches = static_cast<int>(std::clamp<uint64_t>((4ull << 30) / size, 4, 1024));
    auto submit = [&](int, uint32_t imm) { return sender->submit_write(src_id, 0, dst_desc, 0, size, imm); };
    time_train(*sender, *receiver, 4, submit);  // warm-up
    std::vector<double> engine_gbps, peer_gbps;
    for (int r = 0; r < args.repeats; ++r) {
      engine_gbps.push_back(static_cast<double>(size) * num_batches /
                            time_train(*sender, *receiver, num_batches, submit) / 1e9);
      const auto start = Clock::now();
      for (int i = 0; i < num_batches; ++i) check_cuda(cudaMemcpyPeerAsync(dst, 1, src, 0, size, stream), "peer copy");
      check_cuda(cudaStreamSynchronize(stream), "sync");
      peer_gbps.push_back(static_cast<double>(size) * num_batches / seconds_since(start) / 1e9);
    }
    fmt::print("| {} | {} | {:.1f} | {:.1f} | {:.1f}% |\n", size_name(size), num_batches, median(engine_gbps),
               median(peer_gbps), 100 * median(engine_gbps) / median(peer_gbps));
  }
  // Paged KV layers from a plan (one cudaMemcpyAsync per run), against one
  // contiguous peer copy of the same bytes.
  fmt::print("\nCUDA IPC paged KV layers (bf16, head_dim 128, 4 kv heads, 4096 tokens, shuffled decode pages)\n");
  fmt::print("| prefill tp (rank 0) | runs/layer | MB/layer | engine GB/s | contiguous peer copy GB/s |\n"
             "|---:|---:|---:|---:|---:|\n");
  for (int tp : {1, 4}) {
    KvSideLayout src_layout{4, 128, 16, DType::kBF16, tp, 0};
    KvSideLayout dst_layout{4, 128, 16, DType::kBF16, 1, 0};
    std::vector<int32_t> src_pages(256), dst_pages(512);
    std::iota(src_pages.begin(), src_pages.end(), 0);
    std::iota(dst_pages.begin(), dst_pages.end(), 0);
    std::mt19937 rng(3);
    std::shuffle(dst_pages.begin(), dst_pages.end(), rng);
    dst_pages.resize(256);
    auto plan = KvTransferPlan::build(src_layout, 0, dst_layout, src_pages, dst_pages, 4096).value();
    const uint64_t dst_pool = 512ull * 16 * 128 * 2 * 4;  // all heads, 512 pages
    const uint64_t src_pool = 256ull * 16 * 128 * 2 * (4 / tp);
    auto writes = plan.layer_writes(KvLayerRegions{src_id, 0, src_id, src_pool},
                                    KvLayerRemote{dst_desc, 0, dst_desc, dst_pool});
    auto submit = [&](int, uint32_t imm) { return sender->submit_scattered(writes, imm); };
    const int num_layers = 64;
    time_train(*sender, *receiver, 4, submit);
    std::vector<double> engine_gbps, peer_gbps;
    for (int r = 0; r < args.repeats; ++r) {
      engine_gbps.push_back(static_cast<double>(plan.bytes_per_layer()) * num_layers /
                            time_train(*sender, *receiver, num_layers, submit) / 1e9);
      const auto start = Clock::now();
      for (int i = 0; i < num_layers; ++i)
        check_cuda(cudaMemcpyPeerAsync(dst, 1, src, 0, plan.bytes_per_layer(), stream), "peer copy");
      check_cuda(cudaStreamSynchronize(stream), "sync");
      peer_gbps.push_back(static_cast<double>(plan.bytes_per_layer()) * num_layers / seconds_since(start) / 1e9);
    }
    fmt::print("| {} | {} | {:.2f} | {:.1f} | {:.1f} |\n", tp, 2 * plan.runs().size(), plan.bytes_per_layer() / 1e6,
               median(engine_gbps), median(peer_gbps));
  }
  check_cuda(cudaSetDevice(1), "set device");
  check_cuda(cudaMemset(dst, 0, max_bytes), "clear");
  check_cuda(cudaDeviceSynchronize(), "clear");
  check_cuda(cudaSetDevice(0), "set device");
  time_train(*sender, *receiver, 1,
             [&](int, uint32_t imm) { return sender->submit_write(src_id, 0, dst_desc, 0, 1 << 20, imm); });
  std::vector<uint8_t> host(1 << 20);
  check_cuda(cudaMemcpy(host.data(), dst, host.size(), cudaMemcpyDeviceToHost), "download");
  if (std::any_of(host.begin(), host.end(), [](uint8_t b) { return b != 0x3C; })) {
    std::fprintf(stderr, "transfer_bench: CUDA IPC bytes INVALID\n");
    std::exit(1);
  }
  sender.reset();
  receiver.reset();
  cudaStreamDestroy(stream);
  cudaFree(src);
  cudaSetDevice(1);
  cudaFree(dst);
}
#endif

}  // namespace
}  // namespace moe::transfer

int main(int argc, char** argv) {
  moe::transfer::Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> long long {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "transfer_bench: %s needs a value\n", arg.c_str());
        std::exit(2);
      }
      return std::atoll(argv[++i]);
    };
    if (arg == "--repeats") args.repeats = std::max(1LL, value());
    else if (arg == "--connections") args.connections = static_cast<int>(value());
    else if (arg == "--max-mb") args.max_bytes = static_cast<uint64_t>(value()) << 20;
    else if (arg == "--min-sample-mb") args.min_sample_bytes = static_cast<uint64_t>(value()) << 20;
    else if (arg == "--no-tcp") args.tcp = false;
    else if (arg == "--no-kv") args.kv = false;
    else if (arg == "--cuda") args.cuda = true;
    else {
      std::fprintf(stderr, "usage: transfer_bench [--repeats N] [--connections N] [--max-mb N] [--min-sample-mb N] "
                           "[--no-tcp] [--no-kv] [--cuda]\n");
      return 2;
    }
  }
  if (args.tcp) moe::transfer::tcp_sizes(args);
  if (args.kv) moe::transfer::tcp_kv(args);
  if (args.cuda) {
#ifdef MOE_TRANSFER_HAVE_CUDA
    moe::transfer::cuda_ipc(args);
#else
    std::printf("\nCUDA IPC: not compiled (no CUDA)\n");
#endif
  }
  return 0;
}
