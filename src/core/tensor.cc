#include "core/tensor.h"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

#include <fmt/format.h>

namespace moe {

std::string Device::to_string() const {
  return kind == DeviceKind::kCpu ? std::string("cpu") : fmt::format("cuda:{}", index);
}

Shape::Shape(std::initializer_list<int64_t> dims) : Shape(std::span<const int64_t>(dims.begin(), dims.size())) {}

Shape::Shape(std::span<const int64_t> dims) {
  CHECK(dims.size() <= kMaxDims, "rank {} exceeds {}", dims.size(), kMaxDims);
  rank_ = static_cast<int>(dims.size());
  for (int i = 0; i < rank_; ++i) {
    CHECK(dims[i] >= 0, "negative dimension {}", dims[i]);
    dims_[i] = dims[i];
  }
}

int64_t Shape::num_elements() const {
  int64_t n = 1;
  for (int i = 0; i < rank_; ++i) n *= dims_[i];
  return n;
}

bool Shape::operator==(const Shape& other) const {
  if (rank_ != other.rank_) return false;
  for (int i = 0; i < rank_; ++i)
    if (dims_[i] != other.dims_[i]) return false;
  return true;
}

std::string Shape::to_string() const { return fmt::format("[{}]", fmt::join(dims(), ", ")); }

TensorView TensorView::slice0(int64_t i) const {
  CHECK(rank() >= 1 && i >= 0 && i < dim(0), "slice {} of shape {}", i, shape_.to_string());
  CHECK(dtype_bits(dtype_) >= 8, "slice0 on a packed dtype");
  Shape inner(shape_.dims().subspan(1));
  auto* base = static_cast<char*>(data_) + i * static_cast<int64_t>(dtype_bytes(dtype_, inner.num_elements()));
  return {base, dtype_, inner, device_};
}

TensorView TensorView::rows(int64_t begin, int64_t end) const {
  CHECK(rank() >= 1 && 0 <= begin && begin <= end && end <= dim(0), "rows [{}, {}) of {}", begin,
        end, shape_.to_string());
  const int64_t row_elements = dim(0) == 0 ? 0 : num_elements() / dim(0);
  CHECK(dtype_bits(dtype_) >= 8, "rows on a packed dtype");
  std::array<int64_t, Shape::kMaxDims> dims{};
  for (int d = 0; d < rank(); ++d) dims[d] = shape_[d];
  dims[0] = end - begin;
  auto* base = static_cast<char*>(data_) + begin * static_cast<int64_t>(dtype_bytes(dtype_, row_elements));
  return {base, dtype_, Shape(std::span<const int64_t>(dims.data(), rank())), device_};
}

TensorView TensorView::reshaped(Shape shape) const {
  CHECK(shape.num_elements() == num_elements(), "reshape {} to {}", shape_.to_string(), shape.to_string());
  return {data_, dtype_, shape, device_};
}

void HostFree::operator()(void* p) const {
  if (mapped_bytes > 0) {
    munmap(p, mapped_bytes);
  } else {
    std::free(p);
  }
}

HostBuffer allocate_host(size_t num_bytes) {
  if (num_bytes >= kHostMapBytes) {
    void* p = mmap(nullptr, num_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p != MAP_FAILED) return HostBuffer(p, HostFree{num_bytes});
    // Out of mappings (vm.max_map_count) rather than memory, perhaps: the heap.
  }
  const size_t rounded = (num_bytes + kHostAlignment - 1) / kHostAlignment * kHostAlignment;
  void* p = std::aligned_alloc(kHostAlignment, rounded == 0 ? kHostAlignment : rounded);
  if (p == nullptr) throw std::bad_alloc();
  std::memset(p, 0, rounded == 0 ? kHostAlignment : rounded);
  return HostBuffer(p);
}

Tensor::Tensor(DType dtype, Shape shape) : buffer_(allocate_host(dtype_bytes(dtype, shape.num_elements()))) {
  view_ = TensorView(buffer_.get(), dtype, shape);
}

Tensor::Tensor(Tensor&& other) noexcept
    : buffer_(std::move(other.buffer_)), view_(std::exchange(other.view_, TensorView())) {}

Tensor& Tensor::operator=(Tensor&& other) noexcept {
  buffer_ = std::move(other.buffer_);
  view_ = std::exchange(other.view_, TensorView());
  return *this;
}

Tensor Tensor::copy_of(const TensorView& view) {
  CHECK(view.device() == Device::cpu(), "copy_of a {} view", view.device().to_string());
  Tensor t(view.dtype(), view.shape());
  if (view.num_bytes() > 0) std::memcpy(t.data(), view.data(), view.num_bytes());
  return t;
}

}  // namespace moe
