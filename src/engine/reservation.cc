#include "engine/reservation.h"

namespace moe::engine {

const char* reservation_state_name(ReservationState state) {
  switch (state) {
    case ReservationState::kReserved:
      return "reserved";
    case ReservationState::kCommitted:
      return "committed";
    case ReservationState::kAborting:
      return "aborting";
  }
  return "";
}

const Reservation& ReservationTable::create(std::string request_id, std::vector<int32_t> pages,
                                            std::string writer, double now_s, double lease_s) {
  uint32_t id = next_id_;
  while (id == 0 || table_.count(id)) ++id;
  next_id_ = id + 1;
  Reservation r;
  r.id = id;
  r.request_id = std::move(request_id);
  r.pages = std::move(pages);
  r.writer = std::move(writer);
  r.lease_deadline_s = now_s + lease_s;
  return table_.emplace(id, std::move(r)).first->second;
}

Status ReservationTable::commit(uint32_t id, uint64_t expected_batches, int32_t first_token,
                                std::vector<float> last_hidden) {
  auto it = table_.find(id);
  if (it == table_.end()) return not_found("no reservation {}", id);
  Reservation& r = it->second;
  if (r.state == ReservationState::kAborting)
    return aborted("reservation {} is aborting: {}", id, r.abort_reason);
  if (r.state == ReservationState::kCommitted)
    return invalid_argument("reservation {} is already committed", id);
  r.state = ReservationState::kCommitted;
  r.expected_batches = expected_batches;
  r.first_token = first_token;
  r.last_hidden = std::move(last_hidden);
  return Status::ok();
}

Expected<Reservation> ReservationTable::activate(uint32_t id) {
  auto it = table_.find(id);
  if (it == table_.end()) return not_found("no reservation {}", id);
  if (it->second.state != ReservationState::kCommitted)
    return invalid_argument("reservation {} is {}, not committed", id,
                            reservation_state_name(it->second.state));
  Reservation r = std::move(it->second);
  table_.erase(it);
  return r;
}

Expected<bool> ReservationTable::abort(uint32_t id, std::string reason) {
  auto it = table_.find(id);
  if (it == table_.end()) return not_found("no reservation {}", id);
  if (it->second.state == ReservationState::kAborting) return false;
  it->second.state = ReservationState::kAborting;
  it->second.abort_reason = std::move(reason);
  return true;
}

Expected<Reservation> ReservationTable::release(uint32_t id) {
  auto it = table_.find(id);
  if (it == table_.end()) return not_found("no reservation {}", id);
  if (it->second.state != ReservationState::kAborting)
    return invalid_argument("reservation {} is {}: abort it first", id,
                            reservation_state_name(it->second.state));
  Reservation r = std::move(it->second);
  table_.erase(it);
  return r;
}

std::vector<Reservation> ReservationTable::writer_lost(const std::string& writer) {
  std::vector<Reservation> out;
  for (auto it = table_.begin(); it != table_.end();) {
    if (it->second.writer == writer && it->second.state != ReservationState::kCommitted) {
      out.push_back(std::move(it->second));
      it = table_.erase(it);
    } else {
      ++it;
    }
  }
  return out;
}

std::vector<uint32_t> ReservationTable::expire(double now_s) {
  std::vector<uint32_t> out;
  for (auto& [id, r] : table_) {
    if (r.state == ReservationState::kAborting || now_s < r.lease_deadline_s) continue;
    r.state = ReservationState::kAborting;
    r.abort_reason = "the lease expired";
    out.push_back(id);
  }
  return out;
}

const Reservation* ReservationTable::find(uint32_t id) const {
  auto it = table_.find(id);
  return it == table_.end() ? nullptr : &it->second;
}

int64_t ReservationTable::num_pages() const {
  int64_t n = 0;
  for (const auto& [id, r] : table_) n += static_cast<int64_t>(r.pages.size());
  return n;
}

std::vector<uint32_t> ReservationTable::ids() const {
  std::vector<uint32_t> out;
  for (const auto& [id, r] : table_) out.push_back(id);
  return out;
}

}  // namespace moe::engine
