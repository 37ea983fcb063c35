// The decode side's reservation state machine (engine/reservation.h) under a
// fake clock: the page reuse rule (pages leave the table only on activation
// after a commit, or after an abort once the writer stopped / was lost),
// lease expiry, and unknown or out-of-order messages refused.
#include "engine/reservation.h"

#include <gtest/gtest.h>

namespace moe::engine {
namespace {

TEST(ReservationTable, CommitThenActivateHandsThePagesOver) {
  ReservationTable table(7);
  const uint32_t id = table.create("req", {3, 4}, "p:1", /*now_s=*/0, /*lease_s=*/10).id;
  EXPECT_EQ(id, 7u);
  EXPECT_EQ(table.num_pages(), 2);
  EXPECT_EQ(table.activate(id).status().code(), StatusCode::kInvalidArgument);  // not committed yet
  ASSERT_TRUE(table.commit(id, 4, 42).is_ok());
  EXPECT_EQ(table.commit(id, 4, 42).code(), StatusCode::kInvalidArgument);  // twice
  auto r = table.activate(id);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->pages, (std::vector<int32_t>{3, 4}));
  EXPECT_EQ(r->first_token, 42);
  EXPECT_EQ(r->expected_batches, 4u);
  EXPECT_EQ(table.size(), 0u);
}

TEST(ReservationTable, UnknownIdsAreRefused) {
  ReservationTable table;
  EXPECT_EQ(table.commit(99, 1, 1).code(), StatusCode::kNotFound);
  EXPECT_EQ(table.abort(99, "x").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(table.release(99).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(table.activate(99).status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(table.writer_lost("nobody").empty());
}

TEST(ReservationTable, AnExpiredLeaseNeverFreesPagesWhileTheWriterMayWrite) {
  ReservationTable table;
  const uint32_t a = table.create("a", {1}, "p:1", 0, 5).id;
  const uint32_t b = table.create("b", {2}, "p:1", 0, 50).id;
  EXPECT_TRUE(table.expire(4.9).empty());
  EXPECT_EQ(table.expire(5.0), std::vector<uint32_t>{a});
  EXPECT_TRUE(table.expire(6.0).empty());  // once
  EXPECT_EQ(table.find(a)->state, ReservationState::kAborting);
  EXPECT_EQ(table.find(a)->abort_reason, "the lease expired");
  // Still held: a late commit is refused, and nothing hands the pages out.
  EXPECT_EQ(table.commit(a, 1, 1).code(), StatusCode::kAborted);
  EXPECT_EQ(table.activate(a).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(table.num_pages(), 2);
  // Only the writer's acknowledgement (release) frees them.
  auto r = table.release(a);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->pages, std::vector<int32_t>{1});
  EXPECT_EQ(table.find(b)->state, ReservationState::kReserved);
}

TEST(ReservationTable, ReleaseNeedsAnAbortFirst) {
  ReservationTable table;
  const uint32_t id = table.create("a", {1, 2, 3}, "p:1", 0, 5).id;
  EXPECT_EQ(table.release(id).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(table.abort(id, "router").value(), true);
  EXPECT_EQ(table.abort(id, "again").value(), false);  // idempotent; the first reason stays
  EXPECT_EQ(table.find(id)->abort_reason, "router");
  EXPECT_TRUE(table.release(id).has_value());
  EXPECT_EQ(table.size(), 0u);
}

TEST(ReservationTable, ACommittedReservationWhoseWritesNeverLandExpires) {
  ReservationTable table;
  const uint32_t id = table.create("a", {1}, "p:1", 0, 5).id;
  ASSERT_TRUE(table.commit(id, 4, 7).is_ok());
  EXPECT_EQ(table.expire(5), std::vector<uint32_t>{id});
  EXPECT_EQ(table.activate(id).status().code(), StatusCode::kInvalidArgument);
}

TEST(ReservationTable, ALostWriterReleasesItsUncommittedReservationsOnly) {
  ReservationTable table;
  const uint32_t reserved = table.create("a", {1}, "p:1", 0, 5).id;
  const uint32_t aborting = table.create("b", {2}, "p:1", 0, 5).id;
  const uint32_t committed = table.create("c", {3}, "p:1", 0, 5).id;
  const uint32_t other = table.create("d", {4}, "p:2", 0, 5).id;
  ASSERT_TRUE(table.abort(aborting, "x").has_value());
  ASSERT_TRUE(table.commit(committed, 1, 1).is_ok());
  auto lost = table.writer_lost("p:1");
  ASSERT_EQ(lost.size(), 2u);
  EXPECT_EQ(lost[0].id, reserved);
  EXPECT_EQ(lost[1].id, aborting);
  EXPECT_NE(table.find(committed), nullptr);  // its writes may all have landed
  EXPECT_NE(table.find(other), nullptr);
}

TEST(ReservationTable, IdsAreNeverZeroNorReusedWhileHeld) {
  ReservationTable table(0xFFFFFFFFu);
  const uint32_t a = table.create("a", {}, "w", 0, 1).id;
  const uint32_t b = table.create("b", {}, "w", 0, 1).id;
  EXPECT_EQ(a, 0xFFFFFFFFu);
  EXPECT_EQ(b, 1u);  // wraps past 0
  ReservationTable small(1);
  const uint32_t first = small.create("a", {}, "w", 0, 1).id;
  const uint32_t second = small.create("b", {}, "w", 0, 1).id;
  EXPECT_NE(first, second);
}

}  // namespace
}  // namespace moe::engine
