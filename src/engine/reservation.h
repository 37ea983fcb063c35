// The decode instance's KV reservations in disaggregated serving
// (docs/disagg.md, DESIGN section 2): pages held for one request while a
// prefill instance (the writer) writes the prompt's KV into them.
//
//   kReserved --commit--> kCommitted --writes landed--> (activated: handed to the engine, forgotten)
//       |                     |
//       +--abort / lease------+--> kAborting --writer stopped / writer lost--> (released: pages free)
//
// The page reuse rule: a reservation's pages are released only once its writer
// has provably stopped writing: the writer acknowledged the abort (or the
// lease expiry), or its connection was torn down (writer_lost). An expired
// lease alone never frees pages. Ids double as the TransferEngine imm value
// of the reservation's writes: never reused while the table lives, never 0.
//
// Pure bookkeeping with time passed in (tests drive it with a fake clock). Not
// thread-safe: the owner locks.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/status.h"

namespace moe::engine {

enum class ReservationState { kReserved, kCommitted, kAborting };
const char* reservation_state_name(ReservationState state);

struct Reservation {
  uint32_t id = 0;
  std::string request_id;  // the router's X-Request-Id, for logs
  std::vector<int32_t> pages;
  std::string writer;  // the prefill instance's control URL
  double lease_deadline_s = 0;
  ReservationState state = ReservationState::kReserved;
  uint64_t expected_batches = 0;  // from the commit
  int32_t first_token = -1;       // from the commit
  std::vector<float> last_hidden;  // from the commit: the MTP state (speculative decoding), or empty
  std::string abort_reason;       // why it is aborting
};

class ReservationTable {
 public:
  // First id handed out; ids then increase by one (skipping 0 on wrap).
  explicit ReservationTable(uint32_t first_id = 1) : next_id_(first_id == 0 ? 1 : first_id) {}

  // Records pages reserved for `request_id`, written by `writer`, until
  // now_s + lease_s unless committed before.
  const Reservation& create(std::string request_id, std::vector<int32_t> pages, std::string writer,
                            double now_s, double lease_s);
  // The writer says every write is submitted: `expected_batches` completions
  // of the imm, and the first token. kNotFound: unknown id; kAborted: it is
  // aborting (lease expired or aborted); kInvalidArgument: committed twice.
  // `last_hidden`: the MTP state that came with the commit (may be empty).
  Status commit(uint32_t id, uint64_t expected_batches, int32_t first_token, std::vector<float> last_hidden = {});
  // A committed reservation whose writes all landed leaves the table: its pages
  // go to the engine (the returned record). kNotFound / kInvalidArgument when
  // it is not committed.
  Expected<Reservation> activate(uint32_t id);
  // Starts aborting (idempotent). Returns true when this call started it: the
  // caller then tells the writer and waits for its acknowledgement.
  // kNotFound for an unknown id.
  Expected<bool> abort(uint32_t id, std::string reason);
  // The writer acknowledged the abort (or is gone): the reservation leaves the
  // table and its pages may be freed. Only an aborting reservation can be
  // released (kInvalidArgument otherwise: its writer may still write).
  Expected<Reservation> release(uint32_t id);
  // Reservations of `writer` still uncommitted or aborting, all released at
  // once: its connection is gone, so no write of it can land any more.
  // Committed ones stay (their writes may all have landed).
  std::vector<Reservation> writer_lost(const std::string& writer);
  // Reserved or committed reservations past their lease turn to kAborting;
  // returns their ids (the caller tells each writer).
  std::vector<uint32_t> expire(double now_s);

  const Reservation* find(uint32_t id) const;
  size_t size() const { return table_.size(); }
  int64_t num_pages() const;
  std::vector<uint32_t> ids() const;

 private:
  uint32_t next_id_;
  std::map<uint32_t, Reservation> table_;
};

}  // namespace moe::engine
