// TransferEngine faults: hostile and truncated frames on a raw socket, a
// writer process killed with SIGKILL, a receiver that goes away, a refused
// connection, a stalled writer (fault injection) fenced by disarm(), and
// sender-side cancel().
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>

#include "tests/transfer/transfer_test_util.h"
#include "transfer/wire.h"

namespace moe::transfer {
namespace {

using namespace moe::transfer::testing;

// ----------------------------------------------------------- raw connections

int raw_connect(const std::string& endpoint) {
  const size_t colon = endpoint.rfind(':');
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(std::stoi(endpoint.substr(colon + 1))));
  inet_pton(AF_INET, endpoint.substr(0, colon).c_str(), &address.sin_addr);
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  timeval timeout{20, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  return fd;
}

std::vector<uint8_t> frame(const wire::FrameHeader& header, const std::string& payload = {}) {
  std::vector<uint8_t> bytes(wire::kHeaderBytes + payload.size());
  wire::encode(header, bytes.data());
  if (!payload.empty()) std::memcpy(bytes.data() + wire::kHeaderBytes, payload.data(), payload.size());
  return bytes;
}

std::vector<uint8_t> hello(const std::string& endpoint = "evil:1") {
  wire::FrameHeader h;
  h.type = static_cast<uint16_t>(wire::FrameType::kHello);
  h.offset = 42;
  h.length = endpoint.size();
  return frame(h, endpoint);
}

wire::FrameHeader write_header(RegionId region, uint64_t offset, uint64_t length, uint32_t imm) {
  wire::FrameHeader h;
  h.type = static_cast<uint16_t>(wire::FrameType::kWrite);
  h.imm = imm;
  h.batch_num_frames = 1;
  h.batch_id = 1;
  h.region_id = region;
  h.offset = offset;
  h.length = length;
  return h;
}

// Sends `bytes`, half-closes, and returns true once the receiver has closed
// the connection (recv sees EOF or a reset), i.e. it finished with it.
bool send_and_see_close(const std::string& endpoint, const std::vector<uint8_t>& bytes) {
  const int fd = raw_connect(endpoint);
  send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
  shutdown(fd, SHUT_WR);
  char sink[256];
  ssize_t n;
  while ((n = recv(fd, sink, sizeof(sink), 0)) > 0) {
  }
  close(fd);
  return n == 0 || errno == ECONNRESET;
}

TEST(TransferFault, HostileFramesAreCountedAndStoreNothing) {
  auto receiver = make_engine();
  Buffer dst = registered(*receiver, random_bytes(4096, 1));
  const auto before = dst.bytes;
  ASSERT_TRUE(receiver->arm(7, std::string("evil:1")).is_ok());
  const std::string at = receiver->endpoint();
  const RegionId region = dst.id;

  auto with_hello = [](std::vector<uint8_t> tail) {
    auto bytes = hello();
    bytes.insert(bytes.end(), tail.begin(), tail.end());
    return bytes;
  };
  std::vector<std::vector<uint8_t>> bad = {
      std::vector<uint8_t>(64, 0xAB),                                           // bad magic
      frame(write_header(region, 0, 16, 7), std::string(16, 'x')),             // write before hello
      with_hello(frame(write_header(999, 0, 16, 7), std::string(16, 'x'))),    // unknown region
      with_hello(frame(write_header(region, 4090, 100, 7), std::string(100, 'x'))),  // past the end
      with_hello(frame(write_header(region, UINT64_MAX - 5, 10, 7))),          // offset overflow
      with_hello(frame(write_header(region, 0, 1ull << 40, 7))),               // oversized payload
      with_hello(hello()),                                                      // second hello
  };
  {
    wire::FrameHeader h = write_header(region, 0, 16, 7);
    h.batch_num_frames = 0;
    bad.push_back(with_hello(frame(h, std::string(16, 'x'))));  // zero-frame batch
    h = write_header(region, 0, 16, 7);
    h.version = 99;
    bad.push_back(with_hello(frame(h, std::string(16, 'x'))));  // unknown version
    h = write_header(region, 0, 16, 7);
    h.reserved1 = 1;
    bad.push_back(with_hello(frame(h, std::string(16, 'x'))));  // reserved field set
    h = write_header(region, 0, 0, 7);
    h.type = 77;
    bad.push_back(with_hello(frame(h)));  // unknown type
  }
  bad.push_back(hello(std::string("bad\nname")));  // unprintable endpoint
  for (size_t i = 0; i < bad.size(); ++i) {
    EXPECT_TRUE(send_and_see_close(at, bad[i])) << "case " << i;
    EXPECT_TRUE(eventually([&] { return receiver->stats().num_bad_frames == i + 1; })) << "case " << i;
  }
  // Truncated input is a lost connection, not a bad frame: half a header, and a
  // write whose payload stops early (its first bytes may land, in bounds).
  EXPECT_TRUE(send_and_see_close(at, with_hello(std::vector<uint8_t>(30, 0x4D))));
  auto truncated = with_hello(frame(write_header(region, 100, 1000, 7), std::string(10, 'y')));
  EXPECT_TRUE(send_and_see_close(at, truncated));
  EXPECT_EQ(receiver->stats().num_bad_frames, bad.size());
  EXPECT_TRUE(eventually([&] { return receiver->stats().num_connections_lost >= 2; }));
  EXPECT_EQ(receiver->poll_imm(7).num_completed, 0u);
  EXPECT_TRUE(std::equal(dst.bytes.begin(), dst.bytes.begin() + 100, before.begin()));
  EXPECT_TRUE(std::equal(dst.bytes.begin() + 110, dst.bytes.end(), before.begin() + 110));
  // The "evil:1" writer was lost, so its armed imm fails rather than hangs.
  const Status lost = receiver->wait_for(7, 1, kTimeout);
  EXPECT_EQ(lost.code(), StatusCode::kUnavailable) << lost.to_string();
  EXPECT_NE(lost.message().find("evil:1"), std::string::npos) << lost.message();

  // Still serving honest peers.
  auto sender = make_engine();
  Buffer src = registered(*sender, random_bytes(4096, 2));
  ASSERT_TRUE(receiver->arm(8).is_ok());
  auto honest = sender->submit_write(src.id, 0, dst.descriptor, 0, 4096, 8);
  ASSERT_TRUE(honest.has_value());
  ASSERT_TRUE(receiver->wait_for(8, 1, kTimeout).is_ok());
  EXPECT_TRUE(sender->wait(*honest, kTimeout).is_ok());
  EXPECT_EQ(dst.bytes, src.bytes);
}

// ------------------------------------------------------------- peer loss

void write_all_fd(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n <= 0) _exit(3);
    done += static_cast<size_t>(n);
  }
}

std::string read_line_fd(int fd) {
  std::string line;
  char c;
  while (read(fd, &c, 1) == 1 && c != '\n') line.push_back(c);
  return line;
}

// The child: an engine that stalls after 64 KB, writes 1 MB into the
// descriptor it is given, and waits to be killed. Only async-signal-safe
// habits matter before its engine starts: the parent forks while it has no
// threads of its own.
[[noreturn]] void run_stalled_writer(int from_parent, int to_parent) {
  EngineOptions options;
  options.stall_after_bytes = 64 << 10;
  auto engine = TransferEngine::create(options);
  if (!engine) _exit(2);
  write_all_fd(to_parent, (*engine)->endpoint() + "\n");
  auto descriptor = RegionDescriptor::from_json(nlohmann::json::parse(read_line_fd(from_parent)));
  if (!descriptor) _exit(4);
  static std::vector<uint8_t> src(1 << 20, 0x5A);
  auto region = (*engine)->register_region(src.data(), src.size());
  if (!region || !(*engine)->submit_write(*region, 0, *descriptor, 0, src.size(), 31)) _exit(5);
  write_all_fd(to_parent, "submitted\n");
  for (;;) pause();
}

TEST(TransferFault, KilledWriterFailsItsArmedImm) {
  int to_child[2], to_parent[2];
  ASSERT_EQ(pipe(to_child), 0);
  ASSERT_EQ(pipe(to_parent), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) run_stalled_writer(to_child[0], to_parent[1]);
  close(to_child[0]);
  close(to_parent[1]);
  const std::string writer = read_line_fd(to_parent[0]);
  ASSERT_FALSE(writer.empty());

  std::mutex mutex;  // declared before the engine, whose I/O threads use them until it is gone
  std::vector<std::string> lost_peers;
  auto receiver = make_engine();
  receiver->set_peer_lost_callback([&](const std::string& peer, const Status&) {
    std::lock_guard lock(mutex);
    lost_peers.push_back(peer);
  });
  Buffer dst = registered(*receiver, std::vector<uint8_t>(1 << 20, 0));
  ASSERT_TRUE(receiver->arm(31, writer).is_ok());
  write_all_fd(to_child[1], dst.descriptor.to_json().dump() + "\n");
  ASSERT_EQ(read_line_fd(to_parent[0]), "submitted");
  kill(child, SIGKILL);
  int wstatus = 0;
  waitpid(child, &wstatus, 0);
  EXPECT_TRUE(WIFSIGNALED(wstatus));
  const Status waited = receiver->wait_for(31, 1, kTimeout);
  EXPECT_EQ(waited.code(), StatusCode::kUnavailable) << waited.to_string();
  EXPECT_NE(waited.message().find(writer), std::string::npos) << waited.message();
  EXPECT_EQ(receiver->poll_imm(31).num_completed, 0u);
  {
    std::lock_guard lock(mutex);
    EXPECT_NE(std::find(lost_peers.begin(), lost_peers.end(), writer), lost_peers.end());
  }
  // The failed wait is no fence: the first of the writer's connections to see
  // EOF reports the loss while another may still be storing what the writer
  // sent before it died. disarm() is the fence (TCP), as on the decode side
  // before it reuses pages; without it that store could still run after dst is
  // freed below (a use-after-free, seen as a segfault under load).
  ASSERT_TRUE(receiver->disarm(31).is_ok());
  // Whatever the child managed to send before stalling is at most 64 KB.
  EXPECT_TRUE(std::all_of(dst.bytes.begin() + (64 << 10), dst.bytes.end(), [](uint8_t b) { return b == 0; }));
  close(to_child[1]);
  close(to_parent[0]);
}

TEST(TransferFault, ReceiverLossFailsPendingBatchesNamingThePeer) {
  auto sender = make_engine();
  Buffer src = registered(*sender, std::vector<uint8_t>(64 << 20, 0x33));
  std::string peer;
  RegionDescriptor gone;
  {
    auto receiver = make_engine();
    Buffer dst = registered(*receiver, std::vector<uint8_t>(64 << 20, 0));
    peer = receiver->endpoint();
    gone = dst.descriptor;
    ASSERT_TRUE(receiver->arm(1).is_ok());
    auto id = sender->submit_write(src.id, 0, dst.descriptor, 0, 4096, 1);  // connects
    ASSERT_TRUE(id.has_value());
    ASSERT_TRUE(receiver->wait_for(1, 1, kTimeout).is_ok());
  }
  // The connections are still open at the sender; 64 MB cannot all fit in
  // socket buffers, so the writes meet the reset.
  auto id = sender->submit_write(src.id, 0, gone, 0, 64 << 20, 1);
  Status status = id ? sender->wait(*id, kTimeout) : id.status();
  EXPECT_EQ(status.code(), StatusCode::kUnavailable) << status.to_string();
  EXPECT_NE(status.message().find(peer), std::string::npos) << status.message();
  // A later submit reconnects and is refused: also kUnavailable naming the peer.
  auto again = sender->submit_write(src.id, 0, gone, 0, 16, 1);
  status = again ? sender->wait(*again, kTimeout) : again.status();
  EXPECT_EQ(status.code(), StatusCode::kUnavailable) << status.to_string();
  EXPECT_NE(status.message().find(peer), std::string::npos) << status.message();
}

// ----------------------------------------------------- stall and the fence

TEST(TransferFault, DisarmFencesAStalledWriterSoPagesCanBeReused) {
  EngineOptions stalling;
  stalling.stall_after_bytes = 100000;  // inside the first 1 MiB frame
  stalling.num_connections_per_peer = 1;
  auto sender = make_engine(stalling);
  auto receiver = make_engine();
  Buffer src = registered(*sender, std::vector<uint8_t>(4 << 20, 0x11));
  Buffer dst = registered(*receiver, std::vector<uint8_t>(4 << 20, 0));
  ASSERT_TRUE(receiver->arm(40, sender->endpoint()).is_ok());
  auto id = sender->submit_write(src.id, 0, dst.descriptor, 0, 4 << 20, 40);
  ASSERT_TRUE(id.has_value());
  // The lease expires: the decode side gives up on it...
  const Status expired = receiver->wait_for(40, 1, std::chrono::milliseconds(50));
  EXPECT_EQ(expired.code(), StatusCode::kDeadlineExceeded) << expired.to_string();
  EXPECT_EQ(sender->wait(*id, std::chrono::milliseconds(1)).code(), StatusCode::kDeadlineExceeded);
  // ...disarms (after which nothing of imm 40 may land) and reuses the pages.
  ASSERT_TRUE(receiver->disarm(40).is_ok());
  std::fill(dst.bytes.begin(), dst.bytes.end(), 0xEE);
  // The writer is cancelled and goes away; none of its bytes appear.
  ASSERT_TRUE(sender->cancel(40).is_ok());
  EXPECT_EQ(sender->wait(*id, kTimeout).code(), StatusCode::kAborted);
  sender.reset();
  // A barrier: another writer's batch completes after all that.
  auto other = make_engine();
  Buffer other_src = registered(*other, std::vector<uint8_t>(16, 0xEE));
  ASSERT_TRUE(receiver->arm(41).is_ok());
  auto barrier = other->submit_write(other_src.id, 0, dst.descriptor, 0, 16, 41);
  ASSERT_TRUE(barrier.has_value());
  ASSERT_TRUE(receiver->wait_for(41, 1, kTimeout).is_ok());
  EXPECT_TRUE(other->wait(*barrier, kTimeout).is_ok());
  EXPECT_TRUE(std::all_of(dst.bytes.begin(), dst.bytes.end(), [](uint8_t b) { return b == 0xEE; }));
  EXPECT_FALSE(receiver->poll_imm(40).armed);
}

TEST(TransferFault, CancelFailsOnlyThatImmsBatches) {
  EngineOptions stalling;
  stalling.stall_after_bytes = 1;
  stalling.num_connections_per_peer = 1;
  auto sender = make_engine(stalling);
  auto receiver = make_engine();
  Buffer src = registered(*sender, random_bytes(8192, 4));
  Buffer dst = registered(*receiver, std::vector<uint8_t>(8192, 0));
  ASSERT_TRUE(receiver->arm(1).is_ok());
  ASSERT_TRUE(receiver->arm(2).is_ok());
  auto first = sender->submit_write(src.id, 0, dst.descriptor, 0, 4096, 1);   // stalls after 1 byte
  auto second = sender->submit_write(src.id, 4096, dst.descriptor, 4096, 4096, 2);  // queued behind it
  ASSERT_TRUE(first.has_value() && second.has_value());
  ASSERT_TRUE(sender->cancel(2).is_ok());
  EXPECT_EQ(sender->wait(*second, kTimeout).code(), StatusCode::kAborted);
  EXPECT_EQ(sender->wait(*first, std::chrono::milliseconds(10)).code(), StatusCode::kDeadlineExceeded);
  ASSERT_TRUE(sender->cancel(1).is_ok());
  EXPECT_EQ(sender->wait(*first, kTimeout).code(), StatusCode::kAborted);
  EXPECT_TRUE(std::all_of(dst.bytes.begin() + 1, dst.bytes.end(), [](uint8_t b) { return b == 0; }));
  // The stalled write's first byte may still be on its way into dst (seen
  // under ASan on a loaded machine): the engines stop before the buffers go.
  receiver.reset();
  sender.reset();
}

TEST(TransferFault, ConnectRefusedNamesThePeer) {
  std::string closed_endpoint;
  RegionDescriptor descriptor;
  {
    auto gone = make_engine();
    Buffer dst = registered(*gone, std::vector<uint8_t>(16, 0));
    descriptor = dst.descriptor;
    closed_endpoint = gone->endpoint();
  }
  auto sender = make_engine();
  Buffer src = registered(*sender, std::vector<uint8_t>(16, 1));
  auto id = sender->submit_write(src.id, 0, descriptor, 0, 16, 1);
  ASSERT_FALSE(id.has_value());
  EXPECT_EQ(id.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(id.status().message().find(closed_endpoint), std::string::npos) << id.status().message();
  EXPECT_EQ(sender->submit_notify(closed_endpoint, 1).status().code(), StatusCode::kUnavailable);
}

TEST(TransferFault, StallAfterBytesFromTheEnvironment) {
  setenv("MOE_TRANSFER_STALL_AFTER_BYTES", "12345", 1);
  auto options = apply_env_overrides({});
  ASSERT_TRUE(options.has_value());
  EXPECT_EQ(options->stall_after_bytes, 12345u);
  setenv("MOE_TRANSFER_STALL_AFTER_BYTES", "12k", 1);
  EXPECT_EQ(apply_env_overrides({}).status().code(), StatusCode::kInvalidArgument);
  setenv("MOE_TRANSFER_STALL_AFTER_BYTES", "-1", 1);
  EXPECT_EQ(apply_env_overrides({}).status().code(), StatusCode::kInvalidArgument);
  unsetenv("MOE_TRANSFER_STALL_AFTER_BYTES");
  EXPECT_EQ(apply_env_overrides({}).value().stall_after_bytes, 0u);
}

}  // namespace
}  // namespace moe::transfer
