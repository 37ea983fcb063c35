// Tensor (owning, movable, never copied) and TensorView (non-owning).
//
// Both are dense row-major: the last dimension is contiguous. A tensor lives
// on one device; host memory is 64-byte aligned. Not thread-safe: a tensor is
// owned by one thread at a time, views may be read from many threads.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>

#include "core/check.h"
#include "core/dtype.h"

namespace moe {

enum class DeviceKind : uint8_t { kCpu, kCuda };

struct Device {
  DeviceKind kind = DeviceKind::kCpu;
  int index = 0;
  static Device cpu() { return {}; }
  static Device cuda(int index) { return {DeviceKind::kCuda, index}; }
  bool operator==(const Device&) const = default;
  std::string to_string() const;
};

// Up to kMaxDims dimensions, stored inline.
class Shape {
 public:
  static constexpr int kMaxDims = 6;
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  explicit Shape(std::span<const int64_t> dims);

  int rank() const { return rank_; }
  int64_t operator[](int i) const {
    CHECK(i >= 0 && i < rank_, "dim {} of a rank-{} shape", i, rank_);
    return dims_[i];
  }
  int64_t num_elements() const;
  std::span<const int64_t> dims() const { return {dims_.data(), static_cast<size_t>(rank_)}; }
  bool operator==(const Shape& other) const;
  std::string to_string() const;  // "[4, 128]"

 private:
  std::array<int64_t, kMaxDims> dims_{};
  int rank_ = 0;
};

class TensorView {
 public:
  TensorView() = default;
  TensorView(void* data, DType dtype, Shape shape, Device device = Device::cpu())
      : data_(data), dtype_(dtype), shape_(shape), device_(device) {}

  void* data() const { return data_; }
  template <typename T>
  T* data_as() const {
    return static_cast<T*>(data_);
  }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int rank() const { return shape_.rank(); }
  int64_t dim(int i) const { return shape_[i]; }
  int64_t num_elements() const { return shape_.num_elements(); }
  size_t num_bytes() const { return dtype_bytes(dtype_, num_elements()); }
  Device device() const { return device_; }
  bool empty() const { return data_ == nullptr; }

  // The i-th slice along dimension 0 (rank drops by one). Not for packed dtypes.
  TensorView slice0(int64_t i) const;
  // Rows [begin, end) along dimension 0.
  TensorView rows(int64_t begin, int64_t end) const;
  TensorView reshaped(Shape shape) const;

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::kF32;
  Shape shape_;
  Device device_;
};

// Host memory aligned to kHostAlignment bytes, zero-initialised. From
// kHostMapBytes up it is a private anonymous mapping, whose pages the kernel
// zeroes when first touched: no pass over the memory at allocation, and the
// threads that fill a large tensor fault its pages in in parallel (the heap
// when no mapping is left).
inline constexpr size_t kHostAlignment = 64;
inline constexpr size_t kHostMapBytes = size_t{1} << 20;
struct HostFree {
  size_t mapped_bytes = 0;  // non-zero: the length to munmap; else free()
  void operator()(void* p) const;
};
using HostBuffer = std::unique_ptr<void, HostFree>;
HostBuffer allocate_host(size_t num_bytes);

class Tensor {
 public:
  Tensor() = default;
  // Allocates zeroed host memory.
  Tensor(DType dtype, Shape shape);
  // A moved-from tensor is empty (a defaulted move would leave its view
  // pointing at the memory it gave away).
  Tensor(Tensor&& other) noexcept;
  Tensor& operator=(Tensor&& other) noexcept;
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;

  // An explicit deep copy of a host view.
  static Tensor copy_of(const TensorView& view);

  TensorView view() const { return view_; }
  operator TensorView() const { return view_; }  // NOLINT: a tensor is usable as its view
  void* data() const { return view_.data(); }
  template <typename T>
  T* data_as() const {
    return view_.data_as<T>();
  }
  DType dtype() const { return view_.dtype(); }
  const Shape& shape() const { return view_.shape(); }
  int64_t dim(int i) const { return view_.dim(i); }
  int64_t num_elements() const { return view_.num_elements(); }
  size_t num_bytes() const { return view_.num_bytes(); }
  bool empty() const { return view_.empty(); }

 private:
  HostBuffer buffer_;
  TensorView view_;
};

}  // namespace moe
