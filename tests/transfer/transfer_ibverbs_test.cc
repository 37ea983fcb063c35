// The ibverbs transport (RC WRITE_WITH_IMM) between two engines of this
// process. Needs an RDMA device: when there is none the test tries to add a
// soft-RoCE device on loopback (`rdma link add moe_rxe0 type rxe netdev lo`,
// removed again afterwards) and, if the kernel refuses, skips printing why.
#include <gtest/gtest.h>

#include <cstdio>
#include <numeric>

#include "tests/transfer/transfer_test_util.h"
#include "transfer/ibverbs_transport.h"

namespace moe::transfer {
namespace {

using namespace moe::transfer::testing;

std::string run_command(const std::string& command) {
  std::string output;
  if (FILE* pipe = popen((command + " 2>&1").c_str(), "r")) {
    char buffer[512];
    while (std::fgets(buffer, sizeof(buffer), pipe) != nullptr) output += buffer;
    pclose(pipe);
  }
  while (!output.empty() && output.back() == '\n') output.pop_back();
  return output;
}

class Ibverbs : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!IbverbsTransport::list_devices().empty()) return;
    const std::string added = run_command("rdma link add moe_rxe0 type rxe netdev lo");
    if (IbverbsTransport::list_devices().empty()) {
      GTEST_SKIP() << "no RDMA device, and soft-RoCE could not be added (`rdma link add moe_rxe0 type rxe netdev lo`: "
                   << (added.empty() ? "no output" : added) << ")";
    }
    added_rxe_ = true;
  }
  void TearDown() override {
    if (added_rxe_) run_command("rdma link delete moe_rxe0");
  }
  bool added_rxe_ = false;
};

TEST_F(Ibverbs, WriteWithImmLandsAndCountsOncePerBatch) {
  EngineOptions options;
  options.enable_ibverbs = true;
  auto sender = make_engine(options);
  auto receiver = make_engine(options);
  const auto& kinds = receiver->transports();
  if (std::find(kinds.begin(), kinds.end(), TransportKind::kIbverbs) == kinds.end())
    GTEST_SKIP() << "RDMA device " << IbverbsTransport::list_devices() << " present but the transport did not start "
                 << "(see the log line above)";
  Buffer src = registered(*sender, random_bytes(1 << 20, 1));
  Buffer dst = registered(*receiver, random_bytes(1 << 20, 2));
  EXPECT_EQ(dst.descriptor.transport, TransportKind::kIbverbs);
  ASSERT_TRUE(receiver->arm(3).is_ok());
  std::vector<transfer::Run> runs = {{0, 4096, 100000}, {200000, 0, 10}, {500000, 600000, 300000}};
  const auto want = expected_after(dst.bytes, src.bytes, runs);
  RegionRuns group{src.id, dst.descriptor, runs};
  auto first = sender->submit_scattered({&group, 1}, 3);
  ASSERT_TRUE(first.has_value()) << first.status().to_string();
  std::vector<int32_t> pages(8);
  std::iota(pages.begin(), pages.end(), 0);
  std::vector<int32_t> dst_pages = {9, 3, 7, 1, 5, 11, 13, 15};
  auto want_paged = want;
  for (int i = 0; i < 8; ++i)
    for (int b = 0; b < 1000; ++b) want_paged[900000 + dst_pages[i] * 1024 + b] = src.bytes[pages[i] * 2048 + b];
  PagedWrite paged{src.id, dst.descriptor, pages, dst_pages, 0, 2048, 900000, 1024, 1000};
  auto second = sender->submit_paged(paged, 3);
  ASSERT_TRUE(second.has_value()) << second.status().to_string();
  ASSERT_TRUE(receiver->wait_for(3, 2, kTimeout).is_ok());
  EXPECT_TRUE(sender->wait(*first, kTimeout).is_ok());
  EXPECT_TRUE(sender->wait(*second, kTimeout).is_ok());
  EXPECT_EQ(dst.bytes, want_paged);
  EXPECT_EQ(receiver->poll_imm(3).num_completed, 2u);
}

}  // namespace
}  // namespace moe::transfer
