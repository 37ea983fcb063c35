// TransferEngine over TCP between two engines of this process: every write
// is compared byte for byte with a reference applied independently to a copy
// of the destination, and completions are counted per imm.
#include <gtest/gtest.h>

#include <atomic>
#include <nlohmann/json.hpp>
#include <numeric>
#include <thread>

#include "tests/transfer/transfer_test_util.h"

namespace moe::transfer {
namespace {

using namespace moe::transfer::testing;

TEST(RegionDescriptor, JsonRoundTripAndValidation) {
  RegionDescriptor d{"127.0.0.1:4242", 7, 0x7f0012340000ull, 1 << 20, TransportKind::kCudaIpc, MemoryKind::kDevice, 1,
                     "boot-id", "abcd:0:12"};
  const nlohmann::json json = d.to_json();
  auto back = RegionDescriptor::from_json(nlohmann::json::parse(json.dump()));
  ASSERT_TRUE(back.has_value()) << back.status().to_string();
  EXPECT_EQ(back->endpoint, d.endpoint);
  EXPECT_EQ(back->region_id, d.region_id);
  EXPECT_EQ(back->base_address, d.base_address);
  EXPECT_EQ(back->length_bytes, d.length_bytes);
  EXPECT_EQ(back->transport, d.transport);
  EXPECT_EQ(back->memory, d.memory);
  EXPECT_EQ(back->device, d.device);
  EXPECT_EQ(back->host_id, d.host_id);
  EXPECT_EQ(back->export_data, d.export_data);

  auto broken = [&](auto edit) {
    nlohmann::json j = json;
    edit(j);
    return RegionDescriptor::from_json(j).status().code();
  };
  EXPECT_EQ(broken([](auto& j) { j.erase("length_bytes"); }), StatusCode::kInvalidArgument);
  EXPECT_EQ(broken([](auto& j) { j["region_id"] = "7"; }), StatusCode::kInvalidArgument);
  EXPECT_EQ(broken([](auto& j) { j["region_id"] = -7; }), StatusCode::kInvalidArgument);
  EXPECT_EQ(broken([](auto& j) { j["transport"] = "pigeon"; }), StatusCode::kInvalidArgument);
  EXPECT_EQ(broken([](auto& j) { j["memory"] = "disk"; }), StatusCode::kInvalidArgument);
  EXPECT_EQ(broken([](auto& j) { j["endpoint"] = ""; }), StatusCode::kInvalidArgument);
  EXPECT_EQ(broken([](auto& j) { j = nlohmann::json::array(); }), StatusCode::kInvalidArgument);
}

TEST(TransferEngine, ListensOnLoopbackPortZero) {
  auto engine = make_engine();
  EXPECT_EQ(engine->endpoint().rfind("127.0.0.1:", 0), 0u) << engine->endpoint();
  EXPECT_NE(engine->endpoint(), "127.0.0.1:0");
  EXPECT_EQ(engine->transports().front(), TransportKind::kTcp);
}

TEST(TransferEngine, SingleWriteLandsExactlyAndCountsOnce) {
  auto sender = make_engine();
  auto receiver = make_engine();
  Buffer src = registered(*sender, random_bytes(1 << 20, 1));
  Buffer dst = registered(*receiver, random_bytes(1 << 20, 2));
  const auto reference = expected_after(dst.bytes, src.bytes, {transfer::Run{1000, 5000, 300000}});
  ASSERT_TRUE(receiver->arm(11).is_ok());
  auto id = sender->submit_write(src.id, 1000, dst.descriptor, 5000, 300000, 11);
  ASSERT_TRUE(id.has_value()) << id.status().to_string();
  EXPECT_TRUE(sender->wait(*id, kTimeout).is_ok());
  ASSERT_TRUE(receiver->wait_for(11, 1, kTimeout).is_ok());
  EXPECT_EQ(dst.bytes, reference);
  const ImmState state = receiver->poll_imm(11);
  EXPECT_TRUE(state.armed);
  EXPECT_EQ(state.num_completed, 1u);
  EXPECT_EQ(state.num_bytes, 300000u);
  EXPECT_EQ(sender->wait(*id, kTimeout).code(), StatusCode::kNotFound);  // result handed out once
}

TEST(TransferEngine, LargeBatchesSplitOverConnectionsCountOncePerBatch) {
  EngineOptions options;
  options.max_frame_bytes = 64 << 10;  // many frames per batch, dealt over 4 connections
  options.num_connections_per_peer = 4;
  auto sender = make_engine(options);
  auto receiver = make_engine();
  const size_t n = 24 << 20;
  Buffer src = registered(*sender, random_bytes(n, 3));
  Buffer dst = registered(*receiver, std::vector<uint8_t>(n, 0));
  ASSERT_TRUE(receiver->arm(5).is_ok());
  const int num_batches = 3;
  std::vector<TransferId> ids;
  for (int i = 0; i < num_batches; ++i) {
    const uint64_t part = n / num_batches;
    auto id = sender->submit_write(src.id, i * part, dst.descriptor, i * part, part, 5);
    ASSERT_TRUE(id.has_value()) << id.status().to_string();
    ids.push_back(*id);
  }
  ASSERT_TRUE(receiver->wait_for(5, num_batches, kTimeout).is_ok());
  for (TransferId id : ids) EXPECT_TRUE(sender->wait(id, kTimeout).is_ok());
  EXPECT_EQ(dst.bytes, src.bytes);
  EXPECT_EQ(receiver->poll_imm(5).num_completed, static_cast<uint64_t>(num_batches));
  EXPECT_EQ(sender->stats().num_bytes_sent, n);
  EXPECT_EQ(receiver->stats().num_bytes_received, n);
}

TEST(TransferEngine, PagedWriteMatchesReferenceGather) {
  auto sender = make_engine();
  auto receiver = make_engine();
  const uint64_t page_bytes = 3000, src_stride = 4096, dst_stride = 3072;
  const int num_src_pages = 40, num_dst_pages = 64;
  Buffer src = registered(*sender, random_bytes(128 + num_src_pages * src_stride, 4));
  Buffer dst = registered(*receiver, random_bytes(64 + num_dst_pages * dst_stride, 5));
  std::vector<int32_t> src_pages(num_src_pages), dst_pages(num_src_pages);
  std::iota(src_pages.begin(), src_pages.end(), 0);
  std::mt19937 rng(6);
  std::vector<int32_t> all_dst(num_dst_pages);
  std::iota(all_dst.begin(), all_dst.end(), 0);
  std::shuffle(all_dst.begin(), all_dst.end(), rng);
  std::copy_n(all_dst.begin(), num_src_pages, dst_pages.begin());
  std::vector<transfer::Run> reference_runs;
  for (int i = 0; i < num_src_pages; ++i)
    reference_runs.push_back(transfer::Run{128 + src_pages[i] * src_stride, 64 + dst_pages[i] * dst_stride, page_bytes});
  const auto reference = expected_after(dst.bytes, src.bytes, reference_runs);

  PagedWrite write{src.id, dst.descriptor, src_pages, dst_pages, 128, src_stride, 64, dst_stride, page_bytes};
  ASSERT_TRUE(receiver->arm(9).is_ok());
  auto id = sender->submit_paged(write, 9);
  ASSERT_TRUE(id.has_value()) << id.status().to_string();
  ASSERT_TRUE(receiver->wait_for(9, 1, kTimeout).is_ok());
  EXPECT_EQ(dst.bytes, reference);
  EXPECT_TRUE(sender->wait(*id, kTimeout).is_ok());
}

TEST(TransferEngine, ScatteredBatchOverTwoRegionsIsOneCompletion) {
  std::atomic<int> callbacks{0};  // outlives the engines, whose threads call back
  auto sender = make_engine();
  auto receiver = make_engine();
  Buffer src_k = registered(*sender, random_bytes(50000, 7));
  Buffer src_v = registered(*sender, random_bytes(50000, 8));
  Buffer dst_k = registered(*receiver, random_bytes(80000, 9));
  Buffer dst_v = registered(*receiver, random_bytes(80000, 10));
  std::vector<transfer::Run> k_runs = {{0, 100, 10}, {10, 110, 20}, {5000, 70000, 9999}, {40000, 0, 1}};
  std::vector<transfer::Run> v_runs = {{49000, 79000, 1000}, {0, 0, 0}, {123, 456, 7890}};
  const auto want_k = expected_after(dst_k.bytes, src_k.bytes, k_runs);
  const auto want_v = expected_after(dst_v.bytes, src_v.bytes, v_runs);
  std::vector<RegionRuns> groups = {{src_k.id, dst_k.descriptor, k_runs}, {src_v.id, dst_v.descriptor, v_runs}};
  receiver->set_completion_callback([&](uint32_t imm, uint64_t num_completed) {
    if (imm == 21 && num_completed == 1) callbacks.fetch_add(1);
  });
  ASSERT_TRUE(receiver->arm(21).is_ok());
  auto id = sender->submit_scattered(groups, 21);
  ASSERT_TRUE(id.has_value()) << id.status().to_string();
  ASSERT_TRUE(receiver->wait_for(21, 1, kTimeout).is_ok());
  EXPECT_EQ(dst_k.bytes, want_k);
  EXPECT_EQ(dst_v.bytes, want_v);
  EXPECT_EQ(receiver->poll_imm(21).num_completed, 1u);
  // The callback runs on the I/O thread after the counter moved, so it may
  // trail wait_for() a little.
  EXPECT_TRUE(eventually([&] { return callbacks.load() == 1; }));
  EXPECT_TRUE(sender->wait(*id, kTimeout).is_ok());
}

TEST(TransferEngine, OutOfBoundsWritesAreRejectedBeforeSending) {
  auto sender = make_engine();
  auto receiver = make_engine();
  Buffer src = registered(*sender, random_bytes(4096, 11));
  Buffer dst = registered(*receiver, random_bytes(4096, 12));
  const auto before = dst.bytes;
  ASSERT_TRUE(receiver->arm(1).is_ok());
  EXPECT_EQ(sender->submit_write(src.id, 4000, dst.descriptor, 0, 97, 1).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(sender->submit_write(src.id, 0, dst.descriptor, 4095, 2, 1).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(sender->submit_write(src.id, UINT64_MAX, dst.descriptor, 0, 2, 1).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(sender->submit_write(src.id, 0, dst.descriptor, UINT64_MAX - 1, 8, 1).status().code(),
            StatusCode::kOutOfRange);
  EXPECT_EQ(sender->submit_write(999, 0, dst.descriptor, 0, 8, 1).status().code(), StatusCode::kNotFound);
  // A descriptor that lies about its length is caught by the receiver instead:
  // the frame is rejected and nothing is stored. A later honest write on a new
  // connection still lands.
  RegionDescriptor lying = dst.descriptor;
  lying.length_bytes = 1 << 20;
  auto id = sender->submit_write(src.id, 0, lying, 8192, 16, 1);
  ASSERT_TRUE(id.has_value());
  (void)sender->wait(*id, kTimeout);  // sent, or failed when the receiver closed the connection
  EXPECT_TRUE(eventually([&] { return receiver->stats().num_bad_frames == 1; }));
  EXPECT_EQ(dst.bytes, before);
  EXPECT_EQ(receiver->poll_imm(1).num_completed, 0u);
}

TEST(TransferEngine, FramesForUnarmedImmsAreDropped) {
  EngineOptions one_connection;
  one_connection.num_connections_per_peer = 1;  // frames arrive in submission order
  auto sender = make_engine(one_connection);
  auto receiver = make_engine();
  Buffer src = registered(*sender, random_bytes(8192, 13));
  Buffer dst = registered(*receiver, std::vector<uint8_t>(8192, 0));
  auto dropped = sender->submit_write(src.id, 0, dst.descriptor, 0, 4096, 77);  // 77 never armed
  ASSERT_TRUE(dropped.has_value());
  ASSERT_TRUE(receiver->arm(78).is_ok());
  auto kept = sender->submit_write(src.id, 4096, dst.descriptor, 4096, 4096, 78);
  ASSERT_TRUE(kept.has_value());
  ASSERT_TRUE(receiver->wait_for(78, 1, kTimeout).is_ok());  // so the first frame was read too
  EXPECT_TRUE(sender->wait(*dropped, kTimeout).is_ok());
  EXPECT_TRUE(sender->wait(*kept, kTimeout).is_ok());
  EXPECT_EQ(receiver->stats().num_dropped_frames, 1u);
  EXPECT_TRUE(std::all_of(dst.bytes.begin(), dst.bytes.begin() + 4096, [](uint8_t b) { return b == 0; }));
  EXPECT_TRUE(std::equal(dst.bytes.begin() + 4096, dst.bytes.end(), src.bytes.begin() + 4096));
  EXPECT_FALSE(receiver->poll_imm(77).armed);
}

TEST(TransferEngine, NotifyBatchesCountWithoutBytes) {
  auto sender = make_engine();
  auto receiver = make_engine();
  ASSERT_TRUE(receiver->arm(3).is_ok());
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(sender->submit_notify(receiver->endpoint(), 3).has_value());
  ASSERT_TRUE(receiver->wait_for(3, 5, kTimeout).is_ok());
  EXPECT_EQ(receiver->poll_imm(3).num_completed, 5u);
  EXPECT_EQ(receiver->poll_imm(3).num_bytes, 0u);
}

TEST(TransferEngine, WaitErrors) {
  auto sender = make_engine();
  auto receiver = make_engine();
  EXPECT_EQ(receiver->wait_for(1, 1, std::chrono::milliseconds(1)).code(), StatusCode::kNotFound);
  ASSERT_TRUE(receiver->arm(1).is_ok());
  ASSERT_TRUE(sender->submit_notify(receiver->endpoint(), 1).has_value());
  EXPECT_TRUE(receiver->wait_for(1, 1, kTimeout).is_ok());
  const Status late = receiver->wait_for(1, 2, std::chrono::milliseconds(20));
  EXPECT_EQ(late.code(), StatusCode::kDeadlineExceeded) << late.to_string();
  // Disarming wakes a waiter with kAborted.
  Status waited;
  std::thread waiter([&] { waited = receiver->wait_for(1, 100, kTimeout); });
  ASSERT_TRUE(receiver->disarm(1).is_ok());  // before or during the wait: either way it ends
  waiter.join();
  EXPECT_TRUE(waited.code() == StatusCode::kAborted || waited.code() == StatusCode::kNotFound) << waited.to_string();
  EXPECT_TRUE(receiver->disarm(1).is_ok());  // idempotent
}

TEST(TransferEngine, ForgottenBatchesAreDropped) {
  auto sender = make_engine();
  auto receiver = make_engine();
  ASSERT_TRUE(receiver->arm(6).is_ok());
  auto pending = sender->submit_notify(receiver->endpoint(), 6);
  ASSERT_TRUE(pending.has_value());
  sender->forget(*pending);  // done or not yet: either way nobody will ask
  ASSERT_TRUE(receiver->wait_for(6, 1, kTimeout).is_ok());
  EXPECT_TRUE(eventually([&] { return sender->poll(*pending).has_value(); }));
  EXPECT_EQ(sender->poll(*pending)->code(), StatusCode::kNotFound);
}

TEST(TransferEngine, ConcurrentSubmittersToOnePeer) {
  auto sender = make_engine();
  auto receiver = make_engine();
  const int num_threads = 4, num_batches = 50;
  const size_t chunk = 3000;
  Buffer src = registered(*sender, random_bytes(num_threads * num_batches * chunk, 14));
  Buffer dst = registered(*receiver, std::vector<uint8_t>(src.bytes.size(), 0));
  for (int t = 0; t < num_threads; ++t) ASSERT_TRUE(receiver->arm(100 + t).is_ok());
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < num_threads; ++t) {
    threads.emplace_back([&, t] {
      for (int b = 0; b < num_batches; ++b) {
        const uint64_t offset = (t * num_batches + b) * chunk;
        auto id = sender->submit_write(src.id, offset, dst.descriptor, offset, chunk, 100 + t);
        if (!id || !sender->wait(*id, kTimeout).is_ok()) failures.fetch_add(1);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
  for (int t = 0; t < num_threads; ++t) ASSERT_TRUE(receiver->wait_for(100 + t, num_batches, kTimeout).is_ok());
  EXPECT_EQ(dst.bytes, src.bytes);
}

TEST(TransferEngine, CompletionCallbackOnSender) {
  std::mutex mutex;  // outlive the engines, whose threads call back
  std::condition_variable cv;
  std::optional<Status> result;
  auto sender = make_engine();
  auto receiver = make_engine();
  Buffer src = registered(*sender, random_bytes(100000, 15));
  Buffer dst = registered(*receiver, std::vector<uint8_t>(100000, 0));
  ASSERT_TRUE(receiver->arm(4).is_ok());
  SubmitOptions options;
  options.on_done = [&](TransferId, const Status& status) {
    std::lock_guard lock(mutex);
    result = status;
    cv.notify_all();
  };
  auto id = sender->submit_write(src.id, 0, dst.descriptor, 0, 100000, 4, options);
  ASSERT_TRUE(id.has_value());
  {
    std::unique_lock lock(mutex);
    ASSERT_TRUE(cv.wait_for(lock, kTimeout, [&] { return result.has_value(); }));
    EXPECT_TRUE(result->is_ok()) << result->to_string();
  }
  ASSERT_TRUE(receiver->wait_for(4, 1, kTimeout).is_ok());
  EXPECT_EQ(dst.bytes, src.bytes);
}

TEST(TransferEngine, DeregisteredRegionsRejectWrites) {
  auto sender = make_engine();
  auto receiver = make_engine();
  Buffer src = registered(*sender, random_bytes(4096, 16));
  Buffer dst = registered(*receiver, std::vector<uint8_t>(4096, 0));
  ASSERT_TRUE(receiver->deregister_region(dst.id).is_ok());
  EXPECT_EQ(receiver->deregister_region(dst.id).code(), StatusCode::kNotFound);
  EXPECT_EQ(receiver->describe(dst.id).status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(receiver->arm(2).is_ok());
  auto id = sender->submit_write(src.id, 0, dst.descriptor, 0, 4096, 2);
  ASSERT_TRUE(id.has_value());
  (void)sender->wait(*id, kTimeout);
  // The frame was refused (bad frame, connection closed): nothing stored.
  EXPECT_EQ(receiver->wait_for(2, 1, std::chrono::milliseconds(50)).code(), StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(std::all_of(dst.bytes.begin(), dst.bytes.end(), [](uint8_t b) { return b == 0; }));
}

}  // namespace
}  // namespace moe::transfer
