// Owning device memory (cudaMalloc), movable, never copied. Any thread may
// use a buffer it owns; freeing synchronises with nothing, so the owner must
// know no kernel still uses it (streams are synchronised before teardown).
#pragma once

#include <cstddef>
#include <utility>

#include "core/cuda/cuda_check.h"
#include "core/tensor.h"

namespace moe {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  static Expected<DeviceBuffer> allocate(size_t num_bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return data_; }
  template <typename T>
  T* data_as() const {
    return static_cast<T*>(data_);
  }
  size_t size() const { return size_; }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
};

// A device tensor: a DeviceBuffer with a dtype and shape (dense row-major).
class DeviceTensor {
 public:
  DeviceTensor() = default;
  static Expected<DeviceTensor> allocate(DType dtype, Shape shape);
  // Allocates and copies a host view.
  static Expected<DeviceTensor> upload(const TensorView& host);

  TensorView view() const { return view_; }
  void* data() const { return view_.data(); }
  template <typename T>
  T* data_as() const {
    return view_.data_as<T>();
  }
  const Shape& shape() const { return view_.shape(); }
  DType dtype() const { return view_.dtype(); }
  size_t num_bytes() const { return view_.num_bytes(); }

 private:
  DeviceBuffer buffer_;
  TensorView view_;
};

// Copies a device view to a new host tensor (synchronous).
Expected<Tensor> download(const TensorView& device);

}  // namespace moe
