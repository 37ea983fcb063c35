// Helpers of the TransferEngine tests: engines on 127.0.0.1 port 0, random
// byte buffers, and a byte-exact reference of what a batch must leave behind.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "transfer/transfer_engine.h"

namespace moe::transfer::testing {

inline constexpr std::chrono::milliseconds kTimeout{20000};

// Polls `condition` until it holds or the timeout passes. For counters that
// change on an I/O thread with no event to wait on; not a sleep-as-sync.
template <typename Condition>
bool eventually(Condition condition, std::chrono::milliseconds timeout = kTimeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!condition()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

inline std::unique_ptr<TransferEngine> make_engine(EngineOptions options = {}) {
  auto engine = TransferEngine::create(options);
  EXPECT_TRUE(engine.has_value()) << engine.status().to_string();
  return std::move(engine).value();
}

inline std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::vector<uint8_t> bytes(n);
  std::mt19937 rng(seed);
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  return bytes;
}

// A registered host buffer.
struct Buffer {
  std::vector<uint8_t> bytes;
  RegionId id = 0;
  RegionDescriptor descriptor;
};

inline Buffer registered(TransferEngine& engine, std::vector<uint8_t> bytes) {
  Buffer buffer{std::move(bytes), 0, {}};
  auto id = engine.register_region(buffer.bytes.data(), buffer.bytes.size());
  EXPECT_TRUE(id.has_value()) << id.status().to_string();
  buffer.id = *id;
  buffer.descriptor = *engine.describe(buffer.id);
  return buffer;
}

// Applies runs to a copy of dst, the way the receiver must.
inline std::vector<uint8_t> expected_after(std::vector<uint8_t> dst, const std::vector<uint8_t>& src,
                                           const std::vector<Run>& runs) {
  for (const Run& run : runs) {
    for (uint64_t i = 0; i < run.length_bytes; ++i) dst[run.dst_offset + i] = src[run.src_offset + i];
  }
  return dst;
}

}  // namespace moe::transfer::testing
