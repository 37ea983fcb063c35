#include "engine/rank_group.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "comm/communicator.h"
#include "core/logging.h"

namespace moe::engine {

namespace {

constexpr int32_t kPlanMagic = 0x4d535450;  // "MSTP"
constexpr int32_t kPlanVersion = 1;
constexpr int kHeaderWords = 8;
constexpr int64_t kMaxPlanWords = int64_t{1} << 26;  // 256 MB: far above any step

// Header: magic, version, num_tokens, num_query_start, page_table size,
// max_pages_per_seq, num_logits_rows, reserved; then token_ids, positions,
// query_start, page_table, logits_rows.
void append(std::vector<int32_t>& out, const std::vector<int32_t>& v) { out.insert(out.end(), v.begin(), v.end()); }

bool write_all(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w, n -= static_cast<size_t>(w);
  }
  return true;
}

// false: the peer closed (or the socket failed) before n bytes came.
bool read_all(int fd, void* data, size_t n) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = ::read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r, n -= static_cast<size_t>(r);
  }
  return true;
}

// One message: u32 byte length, then the bytes; length 0 means stop.
bool send_message(int fd, std::span<const uint8_t> bytes) {
  const auto n = static_cast<uint32_t>(bytes.size());
  return write_all(fd, &n, sizeof n) && write_all(fd, bytes.data(), bytes.size());
}

}  // namespace

std::vector<uint8_t> encode_step_plan(const model::ForwardBatch& b) {
  std::vector<int32_t> words = {kPlanMagic,
                                kPlanVersion,
                                b.num_tokens(),
                                static_cast<int32_t>(b.query_start.size()),
                                static_cast<int32_t>(b.page_table.size()),
                                b.max_pages_per_seq,
                                static_cast<int32_t>(b.logits_rows.size()),
                                0};
  append(words, b.token_ids);
  append(words, b.positions);
  append(words, b.query_start);
  append(words, b.page_table);
  append(words, b.logits_rows);
  std::vector<uint8_t> bytes(words.size() * sizeof(int32_t));
  std::memcpy(bytes.data(), words.data(), bytes.size());
  return bytes;
}

Expected<model::ForwardBatch> decode_step_plan(std::span<const uint8_t> bytes) {
  if (bytes.size() % sizeof(int32_t) != 0 || bytes.size() < kHeaderWords * sizeof(int32_t))
    return invalid_argument("step plan of {} bytes", bytes.size());
  std::vector<int32_t> w(bytes.size() / sizeof(int32_t));
  std::memcpy(w.data(), bytes.data(), bytes.size());
  if (w[0] != kPlanMagic || w[1] != kPlanVersion) return invalid_argument("not a version-{} step plan", kPlanVersion);
  const int64_t n = w[2], num_qs = w[3], num_pt = w[4], max_pages = w[5], num_rows = w[6];
  if (n < 0 || num_qs < 1 || num_pt < 0 || max_pages < 0 || num_rows < 0 ||
      kHeaderWords + 2 * n + num_qs + num_pt + num_rows != static_cast<int64_t>(w.size()) ||
      static_cast<int64_t>(w.size()) > kMaxPlanWords)
    return invalid_argument("step plan sizes do not add up");
  model::ForwardBatch b;
  auto take = [&, at = int64_t{kHeaderWords}](int64_t count) mutable {
    std::vector<int32_t> v(w.begin() + at, w.begin() + at + count);
    at += count;
    return v;
  };
  b.token_ids = take(n);
  b.positions = take(n);
  b.query_start = take(num_qs);
  b.page_table = take(num_pt);
  b.logits_rows = take(num_rows);
  b.max_pages_per_seq = static_cast<int>(max_pages);
  if (b.query_start.front() != 0 || b.query_start.back() != n || num_pt != (num_qs - 1) * max_pages)
    return invalid_argument("step plan: query starts or page table inconsistent");
  for (size_t i = 1; i < b.query_start.size(); ++i)
    if (b.query_start[i] < b.query_start[i - 1]) return invalid_argument("step plan: query starts decrease");
  for (int32_t r : b.logits_rows)
    if (r < 0 || r >= n) return invalid_argument("step plan: logits row {} of {} tokens", r, n);
  for (int32_t p : b.positions)
    if (p < 0) return invalid_argument("step plan: negative position");
  return b;
}

Status signal_ready(int plan_fd) {
  const uint8_t ready = 1;
  if (!write_all(plan_fd, &ready, 1)) return unavailable("the leader went away during start-up");
  return Status::ok();
}

Status wait_for_followers(std::span<const int> follower_fds) {
  for (size_t i = 0; i < follower_fds.size(); ++i) {
    uint8_t ready = 0;
    if (!read_all(follower_fds[i], &ready, 1) || ready != 1)
      return unavailable("rank {} exited during start-up (its log says why)", i + 1);
  }
  return Status::ok();
}

std::string kv_region_name(const std::string& group, int rank) { return fmt::format("/{}-kv-{}", group, rank); }

LeaderRunner::LeaderRunner(const model::Qwen3MoeModel& model, ThreadPool& pool, const kv::KvCacheLayout& layout,
                           std::vector<int> follower_fds, std::vector<kv::ShmRegion> follower_kv)
    : model_(model), pool_(pool), cache_(layout), follower_kv_(std::move(follower_kv)), fds_(std::move(follower_fds)) {
  for (int l = 0; l < layout.num_layers; ++l) layers_.push_back(cache_.layer(l));
  for (const kv::ShmRegion& region : follower_kv_)
    follower_caches_.push_back(std::make_unique<kv::KvCache>(layout, region.data()));
}

std::vector<const kv::KvCache*> LeaderRunner::rank_caches() const {
  std::vector<const kv::KvCache*> caches = {&cache_};
  for (const auto& c : follower_caches_) caches.push_back(c.get());
  return caches;
}

Status send_step_plan(std::span<const int> follower_fds, const model::ForwardBatch& batch) {
  const std::vector<uint8_t> plan = encode_step_plan(batch);
  for (size_t i = 0; i < follower_fds.size(); ++i)
    if (!send_message(follower_fds[i], plan))
      return unavailable("rank {} of this instance is gone (its step-plan socket closed)", i + 1);
  return Status::ok();
}

void send_stop(std::span<const int> follower_fds) {
  for (int fd : follower_fds) {
    send_message(fd, {});
    ::close(fd);
  }
}

Expected<std::optional<model::ForwardBatch>> receive_step_plan(int plan_fd) {
  uint32_t n = 0;
  if (!read_all(plan_fd, &n, sizeof n) || n == 0) return std::optional<model::ForwardBatch>();
  if (n > kMaxPlanWords * sizeof(int32_t)) return invalid_argument("step plan of {} bytes", n);
  std::vector<uint8_t> bytes(n);
  if (!read_all(plan_fd, bytes.data(), n)) return unavailable("the leader went away inside a step plan");
  MOE_ASSIGN_OR_RETURN(model::ForwardBatch batch, decode_step_plan(bytes));
  return std::optional<model::ForwardBatch>(std::move(batch));
}

LeaderRunner::~LeaderRunner() { send_stop(fds_); }

Expected<Tensor> LeaderRunner::run(const model::ForwardBatch& batch, std::span<const int32_t> hidden_rows,
                                   Tensor* hidden) {
  if (failed_) return unavailable("a rank of this instance is gone");
  if (Status sent = send_step_plan(fds_, batch); !sent) {
    failed_ = true;
    return sent;
  }
  auto logits = model_.try_forward(pool_, batch, layers_, hook_, hidden_rows, hidden);
  if (!logits) failed_ = true;
  return logits;
}

namespace {
constexpr float kLeaveBallot = -1e6f;  // outweighs any number of "have a batch" (1) ballots
}  // namespace

Expected<bool> LockstepVote::vote(bool have_batch) {
  if (failed_) return unavailable("a rank of this instance failed or left");
  Expected<float> votes = sum_(have_batch ? 1.0f : 0.0f);
  if (!votes) {
    failed_ = true;
    return votes.status();
  }
  if (*votes < 0) {
    failed_ = true;
    return unavailable("a data-parallel peer rank stopped: this rank cannot run its experts alone");
  }
  return *votes > 0.5f;
}

void LockstepVote::leave() {
  if (failed_) return;
  (void)sum_(kLeaveBallot);
  failed_ = true;
}

LockstepRunner::LockstepRunner(const model::Qwen3MoeModel& model, ThreadPool& pool,
                               const kv::KvCacheLayout& layout)
    : model_(model), pool_(pool), cache_(layout), vote_([&model](float ballot) -> Expected<float> {
        float votes = ballot;
        MOE_RETURN_IF_ERROR(model.plan().comm->all_reduce_sum({&votes, 1}));
        return votes;
      }) {
  CHECK(model.plan().dp_attention && model.plan().comm != nullptr,
        "a lockstep runner needs a data-parallel plan");
  for (int l = 0; l < layout.num_layers; ++l) layers_.push_back(cache_.layer(l));
}

void LockstepRunner::leave() {
  vote_.leave();
}

Expected<Tensor> LockstepRunner::run(const model::ForwardBatch& batch, std::span<const int32_t> hidden_rows,
                                     Tensor* hidden) {
  MOE_RETURN_IF_ERROR(vote_.vote(true).status());
  auto logits = model_.try_forward(pool_, batch, layers_, {}, hidden_rows, hidden);
  if (!logits) vote_.fail();
  return logits;
}

Status LockstepRunner::idle_step() {
  MOE_ASSIGN_OR_RETURN(bool anyone, vote_.vote(false));
  if (!anyone) return Status::ok();
  const model::ForwardBatch empty{{}, {}, {0}, {}, 0, {}};
  ++num_idle_forwards_;
  auto logits = model_.try_forward(pool_, empty, layers_);
  if (!logits) vote_.fail();
  return logits.status();
}

Status run_follower(const model::Qwen3MoeModel& model, ThreadPool& pool, const kv::KvCacheLayout& layout,
                    void* kv_memory, int plan_fd) {
  kv::KvCache cache(layout, kv_memory);
  std::vector<ops::PagedKv> layers;
  for (int l = 0; l < layout.num_layers; ++l) layers.push_back(cache.layer(l));
  for (int64_t step = 0;; ++step) {
    MOE_ASSIGN_OR_RETURN(std::optional<model::ForwardBatch> batch, receive_step_plan(plan_fd));
    if (!batch) {
      log_info("rank {}: the leader stopped or went away after {} steps; stopping",
               std::max(model.plan().tp_rank, model.plan().ep_rank), step);
      return Status::ok();
    }
    auto logits = model.try_forward(pool, *batch, layers);
    if (!logits) return logits.status();
  }
}

}  // namespace moe::engine
