// Helpers of the comm GPU test and benchmark: ranks as threads of one
// process, one GPU each, bootstrapped over 127.0.0.1.
#pragma once

#include <cuda_runtime.h>

#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "comm/bootstrap.h"

namespace moe::comm::testing {

inline int gpu_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

// Runs body(bootstrap) for ranks 0..world-1 on threads (rank r on GPU r);
// returns the first error any rank's bootstrap met ("" when none).
inline std::string run_gpu_ranks(int world, const std::function<void(TcpBootstrap&)>& body) {
  auto listener = BootstrapListener::bind("127.0.0.1", 0);
  if (!listener) return listener.status().to_string();
  const int port = listener->port();
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      cudaSetDevice(r);
      auto b = r == 0 ? TcpBootstrap::accept(std::move(listener).value(), world, 30000)
                      : TcpBootstrap::connect("127.0.0.1", port, r, world, 30000);
      if (!b) {
        errors[r] = b.status().to_string();
        return;
      }
      body(**b);
    });
  for (auto& t : threads) t.join();
  for (const auto& e : errors)
    if (!e.empty()) return e;
  return "";
}

}  // namespace moe::comm::testing
