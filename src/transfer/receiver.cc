// BatchTracker (sender-side batch results) and Receiver (regions, armed imms,
// completion counting, the disarm fence). See transport.h.
#include <algorithm>

#include "core/logging.h"
#include "transfer/transport.h"

namespace moe::transfer {
namespace {

// Partial batches the receiver tracks at once, over all peers; a sender that
// opens more is hostile or broken, and its connection is closed.
constexpr size_t kMaxPartialBatches = 1 << 20;
// How long disarm()/remove_region() let a frame being stored finish before they
// tear its connection down (a stalled or very slow writer).
constexpr auto kFenceGrace = std::chrono::milliseconds(100);

}  // namespace

// ------------------------------------------------------------------ BatchTracker

std::shared_ptr<BatchState> BatchTracker::start(uint32_t imm, std::string peer, SubmitOptions options,
                                                uint64_t num_frames) {
  auto batch = std::make_shared<BatchState>();
  batch->imm = imm;
  batch->peer = std::move(peer);
  batch->on_done = std::move(options.on_done);
  batch->num_frames_left.store(num_frames);
  std::lock_guard lock(mutex_);
  batch->id = next_id_++;
  entries_.emplace(batch->id, Entry{batch, std::nullopt});
  return batch;
}

void BatchTracker::finish(const std::shared_ptr<BatchState>& batch, const Status& status) {
  if (batch->finished.exchange(true)) return;
  std::function<void(TransferId, const Status&)> on_done;
  {
    std::lock_guard lock(mutex_);
    auto it = entries_.find(batch->id);
    if (it == entries_.end()) return;
    if (batch->on_done) {
      on_done = std::move(batch->on_done);
      entries_.erase(it);
    } else if (it->second.forgotten) {
      entries_.erase(it);
    } else {
      it->second.result = status;
    }
  }
  done_cv_.notify_all();
  if (on_done) on_done(batch->id, status);
}

void BatchTracker::frame_sent(const std::shared_ptr<BatchState>& batch) {
  if (batch->num_frames_left.fetch_sub(1) == 1) finish(batch, Status::ok());
}

Status BatchTracker::wait(TransferId id, std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return not_found("transfer {} is unknown or its result was already taken", id);
  const bool done = done_cv_.wait_for(lock, timeout, [&] {
    it = entries_.find(id);
    return it == entries_.end() || it->second.result.has_value();
  });
  if (it == entries_.end()) return not_found("transfer {} result was taken by another caller", id);
  if (!done) return deadline_exceeded("transfer {} to {} not done after {} ms", id, it->second.batch->peer, timeout.count());
  Status result = *it->second.result;
  entries_.erase(it);
  return result;
}

std::optional<Status> BatchTracker::poll(TransferId id) {
  std::lock_guard lock(mutex_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return not_found("transfer {} is unknown or its result was already taken", id);
  if (!it->second.result) return std::nullopt;
  Status result = *it->second.result;
  entries_.erase(it);
  return result;
}

void BatchTracker::forget(TransferId id) {
  std::lock_guard lock(mutex_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  if (it->second.result) {
    entries_.erase(it);
  } else {
    it->second.forgotten = true;
  }
}

std::vector<std::shared_ptr<BatchState>> BatchTracker::unfinished(uint32_t imm) {
  std::vector<std::shared_ptr<BatchState>> out;
  std::lock_guard lock(mutex_);
  for (auto& [id, entry] : entries_) {
    if (entry.batch->imm == imm && !entry.batch->finished.load()) out.push_back(entry.batch);
  }
  return out;
}

void BatchTracker::fail_all(const Status& status) {
  std::vector<std::shared_ptr<BatchState>> pending;
  {
    std::lock_guard lock(mutex_);
    for (auto& [id, entry] : entries_) {
      if (!entry.batch->finished.load()) pending.push_back(entry.batch);
    }
  }
  for (auto& batch : pending) finish(batch, status);
}

// ---------------------------------------------------------------------- Receiver

void Receiver::add_region(const LocalRegion& region) {
  std::lock_guard lock(mutex_);
  regions_[region.id] = RegionEntry{region, {}, false};
}

Status Receiver::remove_region(RegionId id) {
  std::unique_lock lock(mutex_);
  auto it = regions_.find(id);
  if (it == regions_.end()) return not_found("region {} is not registered", id);
  it->second.removing = true;
  auto idle = [&] { return regions_.at(id).storing.empty(); };
  if (!cv_.wait_for(lock, kFenceGrace, idle)) {
    for (Fenceable* connection : regions_.at(id).storing) connection->abort_connection();
    cv_.wait(lock, idle);
  }
  regions_.erase(id);
  return Status::ok();
}

std::optional<LocalRegion> Receiver::find_region(RegionId id) const {
  std::lock_guard lock(mutex_);
  auto it = regions_.find(id);
  if (it == regions_.end() || it->second.removing) return std::nullopt;
  return it->second.region;
}

Status Receiver::arm(uint32_t imm, std::optional<std::string> writer) {
  std::lock_guard lock(mutex_);
  auto [it, inserted] = imms_.try_emplace(imm);
  Imm& entry = it->second;
  if (!inserted && (entry.disarming || !entry.storing.empty()))
    return invalid_argument("imm {} is being disarmed or stored into; arm a fresh imm", imm);
  entry = Imm{};
  entry.writer = std::move(writer);
  entry.generation = next_generation_++;
  return Status::ok();
}

Status Receiver::disarm(uint32_t imm) {
  std::unique_lock lock(mutex_);
  auto it = imms_.find(imm);
  if (it == imms_.end() || it->second.disarming) return Status::ok();
  it->second.disarming = true;
  auto idle = [&] { return imms_.at(imm).storing.empty(); };
  if (!cv_.wait_for(lock, kFenceGrace, idle)) {
    log_warn("transfer: disarm({}) tears down {} connection(s) still storing into it", imm,
             imms_.at(imm).storing.size());
    for (Fenceable* connection : imms_.at(imm).storing) connection->abort_connection();
    cv_.wait(lock, idle);
  }
  std::erase_if(partial_, [&](const auto& kv) { return kv.second.first == imm; });
  imms_.erase(imm);
  cv_.notify_all();
  return Status::ok();
}

Status Receiver::wait_for(uint32_t imm, uint64_t expected_batches, std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  auto it = imms_.find(imm);
  if (it == imms_.end() || it->second.disarming) return not_found("imm {} is not armed", imm);
  const uint64_t generation = it->second.generation;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    it = imms_.find(imm);
    if (it == imms_.end() || it->second.generation != generation || it->second.disarming)
      return aborted("imm {} was disarmed while waiting", imm);
    const Imm& entry = it->second;
    if (!entry.error.is_ok()) return entry.error;
    if (entry.num_completed >= expected_batches) return Status::ok();
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout) {
      it = imms_.find(imm);
      if (it != imms_.end() && it->second.generation == generation && it->second.num_completed >= expected_batches)
        return Status::ok();
      const uint64_t done = it == imms_.end() ? 0 : it->second.num_completed;
      return deadline_exceeded("imm {}: {} of {} batches stored after {} ms", imm, done, expected_batches,
                               timeout.count());
    }
  }
}

ImmState Receiver::poll_imm(uint32_t imm) const {
  std::lock_guard lock(mutex_);
  auto it = imms_.find(imm);
  if (it == imms_.end() || it->second.disarming) return ImmState{};
  return ImmState{true, it->second.num_completed, it->second.num_bytes, it->second.error};
}

void Receiver::set_completion_callback(std::function<void(uint32_t, uint64_t)> callback) {
  std::lock_guard lock(mutex_);
  on_complete_ = std::make_shared<std::function<void(uint32_t, uint64_t)>>(std::move(callback));
}

Receiver::StoreTicket Receiver::begin_store(const wire::FrameHeader& header, Fenceable* connection) {
  std::lock_guard lock(mutex_);
  auto region_it = regions_.find(header.region_id);
  if (region_it == regions_.end() || region_it->second.removing)
    return {StoreTicket::Kind::kReject, nullptr, fmt::format("unknown region {}", header.region_id)};
  RegionEntry& region = region_it->second;
  if (region.region.memory != MemoryKind::kHost)
    return {StoreTicket::Kind::kReject, nullptr, fmt::format("region {} is not host memory", header.region_id)};
  // validate_header() ruled out offset + length overflowing.
  if (header.offset + header.length > region.region.length_bytes)
    return {StoreTicket::Kind::kReject, nullptr,
            fmt::format("write [{}, {}) outside region {} of {} bytes", header.offset, header.offset + header.length,
                        header.region_id, region.region.length_bytes)};
  auto imm_it = imms_.find(header.imm);
  if (imm_it == imms_.end() || imm_it->second.disarming) return {StoreTicket::Kind::kDrop, nullptr, {}};
  imm_it->second.storing.push_back(connection);
  region.storing.push_back(connection);
  return {StoreTicket::Kind::kStore, region.region.base + header.offset, {}};
}

bool Receiver::count_frame_locked(uint64_t sender_nonce, const wire::FrameHeader& header, bool& limit_hit) {
  const auto key = std::make_pair(sender_nonce, header.batch_id);
  auto it = partial_.find(key);
  if (it == partial_.end()) {
    if (header.batch_num_frames == 1) return true;
    if (partial_.size() >= kMaxPartialBatches) {
      limit_hit = true;
      return false;
    }
    it = partial_.emplace(key, std::make_pair(header.imm, header.batch_num_frames)).first;
  } else if (it->second.first != header.imm) {
    limit_hit = true;  // one batch, two imms: a broken sender
    return false;
  }
  if (--it->second.second > 0) return false;
  partial_.erase(it);
  return true;
}

bool Receiver::end_store(const wire::FrameHeader& header, uint64_t sender_nonce, Fenceable* connection, bool ok) {
  bool limit_hit = false;
  std::shared_ptr<std::function<void(uint32_t, uint64_t)>> callback;
  uint64_t num_completed = 0;
  {
    std::lock_guard lock(mutex_);
    auto region_it = regions_.find(header.region_id);
    if (region_it != regions_.end()) {
      auto& storing = region_it->second.storing;
      if (auto pos = std::find(storing.begin(), storing.end(), connection); pos != storing.end()) storing.erase(pos);
    }
    auto imm_it = imms_.find(header.imm);
    if (imm_it != imms_.end()) {
      Imm& entry = imm_it->second;
      if (auto pos = std::find(entry.storing.begin(), entry.storing.end(), connection); pos != entry.storing.end())
        entry.storing.erase(pos);
      if (ok && !entry.disarming) {
        entry.num_bytes += header.length;
        num_bytes_received_.fetch_add(header.length);
        if (count_frame_locked(sender_nonce, header, limit_hit)) {
          num_completed = ++entry.num_completed;
          num_batches_completed_.fetch_add(1);
          callback = on_complete_;
        }
      }
    }
  }
  cv_.notify_all();
  if (callback && *callback) (*callback)(header.imm, num_completed);
  return !limit_hit;
}

bool Receiver::notify_frame(const wire::FrameHeader& header, uint64_t sender_nonce) {
  bool limit_hit = false;
  std::shared_ptr<std::function<void(uint32_t, uint64_t)>> callback;
  uint64_t num_completed = 0;
  {
    std::lock_guard lock(mutex_);
    auto imm_it = imms_.find(header.imm);
    if (imm_it == imms_.end() || imm_it->second.disarming) {
      num_dropped_frames_.fetch_add(1);
      return true;
    }
    if (count_frame_locked(sender_nonce, header, limit_hit)) {
      num_completed = ++imm_it->second.num_completed;
      num_batches_completed_.fetch_add(1);
      callback = on_complete_;
    }
  }
  cv_.notify_all();
  if (callback && *callback) (*callback)(header.imm, num_completed);
  return !limit_hit;
}

void Receiver::peer_lost(const std::string& peer, uint64_t sender_nonce, const Status& why) {
  {
    std::lock_guard lock(mutex_);
    std::erase_if(partial_, [&](const auto& kv) { return kv.first.first == sender_nonce; });
    for (auto& [imm, entry] : imms_) {
      if (entry.writer && *entry.writer == peer && entry.error.is_ok()) entry.error = why;
    }
  }
  cv_.notify_all();
}

}  // namespace moe::transfer
