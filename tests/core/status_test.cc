#include "core/status.h"

#include <gtest/gtest.h>

namespace moe {
namespace {

Expected<int> parse_positive(int v) {
  if (v <= 0) return invalid_argument("value {} is not positive", v);
  return v;
}

Expected<int> doubled(int v) {
  MOE_ASSIGN_OR_RETURN(int x, parse_positive(v));
  return 2 * x;
}

Status check_both(int a, int b) {
  MOE_RETURN_IF_ERROR(parse_positive(a).status());
  MOE_RETURN_IF_ERROR(parse_positive(b).status());
  return Status::ok();
}

TEST(Status, CarriesCodeAndMessage) {
  Status s = not_found("tensor '{}' missing", "lm_head.weight");
  EXPECT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_EQ(s.to_string(), "NotFound: tensor 'lm_head.weight' missing");
  EXPECT_EQ(s.with_context("model.safetensors").message(), "model.safetensors: tensor 'lm_head.weight' missing");
  EXPECT_TRUE(Status::ok().is_ok());
}

TEST(Expected, PropagatesErrorsThroughMacros) {
  EXPECT_EQ(*doubled(4), 8);
  auto bad = doubled(-1);
  ASSERT_FALSE(bad.has_value());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "value -1 is not positive");
  EXPECT_TRUE(check_both(1, 2).is_ok());
  EXPECT_EQ(check_both(1, 0).message(), "value 0 is not positive");
}

TEST(Expected, HoldsMoveOnlyValues) {
  Expected<std::unique_ptr<int>> p = std::make_unique<int>(7);
  ASSERT_TRUE(p);
  std::unique_ptr<int> owned = std::move(p).value();
  EXPECT_EQ(*owned, 7);
}

}  // namespace
}  // namespace moe
