// Shape, TensorView and Tensor: ownership (move-only, moved-from is empty),
// host allocation (64-byte aligned, zeroed), views (slice0, rows, reshaped)
// and the CHECKs that guard their invariants.

#include "core/tensor.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace moe {
namespace {

bool is_aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kHostAlignment == 0; }

bool all_zero(const void* p, size_t num_bytes) {
  const auto* bytes = static_cast<const uint8_t*>(p);
  for (size_t i = 0; i < num_bytes; ++i)
    if (bytes[i] != 0) return false;
  return true;
}

char* byte_ptr(const TensorView& v) { return static_cast<char*>(v.data()); }

// --- Shape ----------------------------------------------------------------------

TEST(Shape, RankDimsAndElements) {
  const Shape s{4, 128, 3};
  EXPECT_EQ(s.rank(), 3);
  EXPECT_EQ(s[0], 4);
  EXPECT_EQ(s[2], 3);
  EXPECT_EQ(s.num_elements(), 4 * 128 * 3);
  EXPECT_EQ(s.dims().size(), 3u);
  EXPECT_EQ(s.to_string(), "[4, 128, 3]");
  EXPECT_EQ(Shape({4, 128}).to_string(), "[4, 128]");

  const Shape scalar;
  EXPECT_EQ(scalar.rank(), 0);
  EXPECT_EQ(scalar.num_elements(), 1);  // the empty product
  EXPECT_EQ(scalar.to_string(), "[]");
  EXPECT_EQ(Shape({3, 0, 5}).num_elements(), 0);

  const int64_t dims[] = {2, 3, 4, 5, 6, 7};
  const Shape full{std::span<const int64_t>(dims)};
  EXPECT_EQ(full.rank(), Shape::kMaxDims);
  EXPECT_EQ(full.num_elements(), 2 * 3 * 4 * 5 * 6 * 7);
}

TEST(Shape, Equality) {
  EXPECT_EQ(Shape({2, 3}), Shape({2, 3}));
  EXPECT_FALSE(Shape({2, 3}) == Shape({3, 2}));
  EXPECT_FALSE(Shape({2, 3}) == Shape({2, 3, 1}));
  EXPECT_FALSE(Shape({6}) == Shape({2, 3}));
  EXPECT_EQ(Shape(), Shape());
}

TEST(ShapeDeathTest, BrokenInvariants) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(Shape({1, 2, 3, 4, 5, 6, 7}), "CHECK failed.*rank 7 exceeds 6");
  EXPECT_DEATH(Shape({2, -1}), "CHECK failed.*negative dimension -1");
  const Shape s{2, 3};
  EXPECT_DEATH(s[2], "CHECK failed.*dim 2 of a rank-2 shape");
  EXPECT_DEATH(s[-1], "CHECK failed.*dim -1");
}

// --- Device ------------------------------------------------------------------------

TEST(Device, NamesAndEquality) {
  EXPECT_EQ(Device::cpu().to_string(), "cpu");
  EXPECT_EQ(Device::cuda(3).to_string(), "cuda:3");
  EXPECT_EQ(Device(), Device::cpu());
  EXPECT_FALSE(Device::cuda(0) == Device::cuda(1));
  EXPECT_FALSE(Device::cuda(0) == Device::cpu());
}

// --- Host allocation -------------------------------------------------------------

TEST(AllocateHost, AlignedAndZeroedForAnySize) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{63}, size_t{64}, size_t{65}, size_t{1000}, size_t{4096},
                   size_t{100003}, kHostMapBytes - 1, kHostMapBytes, 3 * kHostMapBytes + 5}) {
    HostBuffer buffer = allocate_host(n);
    ASSERT_NE(buffer.get(), nullptr) << n;
    EXPECT_TRUE(is_aligned(buffer.get())) << n;
    // The whole rounded-up allocation is zeroed, not only the n bytes asked for.
    const size_t rounded = std::max<size_t>(kHostAlignment, (n + kHostAlignment - 1) / kHostAlignment * kHostAlignment);
    EXPECT_TRUE(all_zero(buffer.get(), rounded)) << n;
  }
}

TEST(AllocateHost, ReusedMemoryIsZeroedAgain) {
  // Dirty a block, free it, then allocate the same size: malloc is likely to
  // hand the same memory back, which must come back zeroed.
  for (size_t bytes : {size_t{1} << 16, kHostMapBytes, 2 * kHostMapBytes + 64}) {
    for (int round = 0; round < 8; ++round) {
      HostBuffer dirty = allocate_host(bytes);
      std::memset(dirty.get(), 0xab, bytes);
      dirty.reset();
      HostBuffer clean = allocate_host(bytes);
      EXPECT_TRUE(all_zero(clean.get(), bytes)) << bytes << " round " << round;
    }
  }
}

// --- Tensor ----------------------------------------------------------------------

static_assert(!std::is_copy_constructible_v<Tensor>);
static_assert(!std::is_copy_assignable_v<Tensor>);
static_assert(std::is_nothrow_move_constructible_v<Tensor>);
static_assert(std::is_nothrow_move_assignable_v<Tensor>);
static_assert(std::is_trivially_copyable_v<TensorView>);  // views are cheap to pass by value

TEST(Tensor, DefaultIsEmpty) {
  const Tensor t;
  EXPECT_TRUE(t.empty());
  EXPECT_EQ(t.data(), nullptr);
  EXPECT_TRUE(t.view().empty());
}

TEST(Tensor, AllocatesZeroedAlignedHostMemory) {
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF8E4M3, DType::kF4E2M1, DType::kI64, DType::kBool}) {
    const Tensor t(dtype, {3, 5, 7});
    EXPECT_FALSE(t.empty());
    EXPECT_TRUE(is_aligned(t.data())) << dtype_name(dtype);
    EXPECT_EQ(t.dtype(), dtype);
    EXPECT_EQ(t.shape(), Shape({3, 5, 7}));
    EXPECT_EQ(t.dim(1), 5);
    EXPECT_EQ(t.num_elements(), 105);
    EXPECT_EQ(t.num_bytes(), dtype_bytes(dtype, 105));
    EXPECT_TRUE(all_zero(t.data(), t.num_bytes())) << dtype_name(dtype);
    EXPECT_EQ(t.view().device(), Device::cpu());
  }
}

TEST(Tensor, NumBytesOfPackedFp4RoundsUp) {
  EXPECT_EQ(Tensor(DType::kF4E2M1, {1}).num_bytes(), 1u);
  EXPECT_EQ(Tensor(DType::kF4E2M1, {2}).num_bytes(), 1u);
  EXPECT_EQ(Tensor(DType::kF4E2M1, {3}).num_bytes(), 2u);
  EXPECT_EQ(Tensor(DType::kF4E2M1, {3, 5}).num_bytes(), 8u);  // 15 nibbles
  EXPECT_EQ(Tensor(DType::kF4E2M1, {4, 32}).num_bytes(), 64u);
  EXPECT_EQ(Tensor(DType::kF4E2M1, {0, 32}).num_bytes(), 0u);
}

TEST(Tensor, ZeroElementsStillOwnsMemory) {
  const Tensor t(DType::kF32, {0, 4});
  EXPECT_FALSE(t.empty());
  EXPECT_EQ(t.num_elements(), 0);
  EXPECT_EQ(t.num_bytes(), 0u);
}

TEST(Tensor, MoveConstructionTransfersOwnership) {
  Tensor a(DType::kF32, {2, 3});
  a.data_as<float>()[5] = 42.0f;
  void* data = a.data();
  Tensor b(std::move(a));
  EXPECT_EQ(b.data(), data);
  EXPECT_EQ(b.shape(), Shape({2, 3}));
  EXPECT_EQ(b.data_as<float>()[5], 42.0f);
  // NOLINTBEGIN(bugprone-use-after-move): the moved-from state is the subject.
  EXPECT_TRUE(a.empty());
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_EQ(a.view().data(), nullptr);
  EXPECT_EQ(a.shape().rank(), 0);
  // NOLINTEND(bugprone-use-after-move)
}

TEST(Tensor, MoveAssignmentReleasesTheOldBufferAndEmptiesTheSource) {
  Tensor a(DType::kBF16, {8});
  Tensor b(DType::kF32, {1000});  // its buffer is freed by the assignment (ASan checks for a leak)
  void* data = a.data();
  b = std::move(a);
  EXPECT_EQ(b.data(), data);
  EXPECT_EQ(b.dtype(), DType::kBF16);
  EXPECT_EQ(b.num_elements(), 8);
  EXPECT_TRUE(a.empty());  // NOLINT(bugprone-use-after-move)
  // A moved-from tensor can be assigned again.
  a = Tensor(DType::kI32, {2});
  EXPECT_FALSE(a.empty());
  EXPECT_EQ(a.num_elements(), 2);
}

TEST(Tensor, MovesThroughAVector) {
  std::vector<Tensor> tensors;
  for (int i = 0; i < 50; ++i) {
    tensors.emplace_back(DType::kI32, Shape{i + 1});
    tensors.back().data_as<int32_t>()[i] = i;
  }
  for (int i = 0; i < 50; ++i) {
    EXPECT_EQ(tensors[i].num_elements(), i + 1);
    EXPECT_EQ(tensors[i].data_as<int32_t>()[i], i);
  }
}

TEST(Tensor, CopyOfIsDeep) {
  Tensor a(DType::kF16, {3, 4});
  for (int i = 0; i < 12; ++i) a.data_as<uint16_t>()[i] = static_cast<uint16_t>(i * 257);
  Tensor b = Tensor::copy_of(a);
  EXPECT_NE(b.data(), a.data());
  EXPECT_TRUE(is_aligned(b.data()));
  EXPECT_EQ(b.shape(), a.shape());
  EXPECT_EQ(b.dtype(), a.dtype());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.num_bytes()), 0);
  a.data_as<uint16_t>()[0] = 7;
  EXPECT_EQ(b.data_as<uint16_t>()[0], 0);

  // A view of part of a tensor, and a packed fp4 tensor with an odd count.
  Tensor rows = Tensor::copy_of(a.view().rows(1, 3));
  EXPECT_EQ(rows.shape(), Shape({2, 4}));
  EXPECT_EQ(rows.data_as<uint16_t>()[0], 4 * 257);
  Tensor fp4(DType::kF4E2M1, {5});
  std::memset(fp4.data(), 0x5a, fp4.num_bytes());
  Tensor fp4_copy = Tensor::copy_of(fp4);
  EXPECT_EQ(fp4_copy.num_bytes(), 3u);
  EXPECT_EQ(std::memcmp(fp4.data(), fp4_copy.data(), 3), 0);
}

TEST(Tensor, ConvertsToItsView) {
  const Tensor t(DType::kF32, {2, 2});
  const TensorView v = t;
  EXPECT_EQ(v.data(), t.data());
  EXPECT_EQ(v.shape(), t.shape());
  EXPECT_EQ(v.dtype(), t.dtype());
}

TEST(TensorDeathTest, CopyOfADeviceViewIsABug) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  float dummy[4] = {};
  const TensorView device_view(dummy, DType::kF32, {4}, Device::cuda(0));
  EXPECT_DEATH(Tensor::copy_of(device_view), "CHECK failed.*copy_of a cuda:0 view");
}

// --- TensorView ----------------------------------------------------------------

TEST(TensorView, Slice0) {
  const Tensor t(DType::kF32, {3, 4, 5});
  for (int64_t i = 0; i < 3; ++i) {
    const TensorView s = t.view().slice0(i);
    EXPECT_EQ(s.shape(), Shape({4, 5}));
    EXPECT_EQ(byte_ptr(s), byte_ptr(t) + i * 4 * 5 * 4);
    EXPECT_EQ(s.dtype(), DType::kF32);
  }
  // Rank 1 gives a scalar view of element i.
  const Tensor v(DType::kBF16, {6});
  const TensorView e = v.view().slice0(5);
  EXPECT_EQ(e.rank(), 0);
  EXPECT_EQ(e.num_elements(), 1);
  EXPECT_EQ(byte_ptr(e), byte_ptr(v) + 10);
  // Slices keep the device.
  float dummy[6] = {};
  const TensorView on_gpu(dummy, DType::kF32, {2, 3}, Device::cuda(1));
  EXPECT_EQ(on_gpu.slice0(1).device(), Device::cuda(1));
}

TEST(TensorView, Rows) {
  const Tensor t(DType::kI16, {5, 2, 3});
  const TensorView r = t.view().rows(1, 4);
  EXPECT_EQ(r.shape(), Shape({3, 2, 3}));
  EXPECT_EQ(byte_ptr(r), byte_ptr(t) + 1 * 2 * 3 * 2);
  EXPECT_EQ(r.num_bytes(), 3u * 2 * 3 * 2);

  const TensorView all = t.view().rows(0, 5);
  EXPECT_EQ(all.shape(), t.shape());
  EXPECT_EQ(all.data(), t.data());

  const TensorView none = t.view().rows(5, 5);
  EXPECT_EQ(none.shape(), Shape({0, 2, 3}));
  EXPECT_EQ(none.num_bytes(), 0u);

  const Tensor empty_rows(DType::kF32, {0, 4});
  EXPECT_EQ(empty_rows.view().rows(0, 0).shape(), Shape({0, 4}));

  // Rows of rows compose.
  const TensorView inner = r.rows(1, 2);
  EXPECT_EQ(byte_ptr(inner), byte_ptr(t) + 2 * 2 * 3 * 2);
  EXPECT_EQ(inner.dim(0), 1);
}

TEST(TensorView, Reshaped) {
  const Tensor t(DType::kF32, {4, 6});
  const TensorView r = t.view().reshaped({2, 3, 4});
  EXPECT_EQ(r.shape(), Shape({2, 3, 4}));
  EXPECT_EQ(r.data(), t.data());
  EXPECT_EQ(r.num_bytes(), t.num_bytes());
  EXPECT_EQ(t.view().reshaped({24}).rank(), 1);
  // Packed fp4 may be reshaped (only slicing needs whole bytes per element).
  const Tensor fp4(DType::kF4E2M1, {4, 8});
  EXPECT_EQ(fp4.view().reshaped({32}).num_bytes(), 16u);
}

TEST(TensorView, DefaultIsEmpty) {
  const TensorView v;
  EXPECT_TRUE(v.empty());
  EXPECT_EQ(v.device(), Device::cpu());
}

TEST(TensorViewDeathTest, BrokenInvariants) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const Tensor t(DType::kF32, {3, 4});
  const TensorView v = t;
  EXPECT_DEATH(v.slice0(3), "CHECK failed.*slice 3 of shape \\[3, 4\\]");
  EXPECT_DEATH(v.slice0(-1), "CHECK failed.*slice -1");
  EXPECT_DEATH(v.slice0(0).slice0(0).slice0(0), "CHECK failed.*slice 0 of shape \\[\\]");
  EXPECT_DEATH(v.rows(2, 1), "CHECK failed.*rows \\[2, 1\\)");
  EXPECT_DEATH(v.rows(-1, 2), "CHECK failed.*rows \\[-1, 2\\)");
  EXPECT_DEATH(v.rows(0, 4), "CHECK failed.*rows \\[0, 4\\) of \\[3, 4\\]");
  EXPECT_DEATH(v.reshaped({5, 2}), "CHECK failed.*reshape \\[3, 4\\] to \\[5, 2\\]");
  EXPECT_DEATH(v.dim(2), "CHECK failed.*dim 2 of a rank-2 shape");
  const Tensor fp4(DType::kF4E2M1, {4, 8});
  EXPECT_DEATH(fp4.view().slice0(1), "CHECK failed.*slice0 on a packed dtype");
  EXPECT_DEATH(fp4.view().rows(0, 2), "CHECK failed.*rows on a packed dtype");
}

}  // namespace
}  // namespace moe
