#include "core/cuda/device_buffer.h"

namespace moe {

Expected<DeviceBuffer> DeviceBuffer::allocate(size_t num_bytes) {
  DeviceBuffer buffer;
  if (num_bytes == 0) return buffer;
  const cudaError_t error = cudaMalloc(&buffer.data_, num_bytes);
  if (error != cudaSuccess) {
    // Reported here: cleared, so the next launch's cudaGetLastError() does
    // not report this failed allocation as its own.
    cudaGetLastError();
    return cuda_status(error, "cudaMalloc").with_context(fmt::format("allocating {} bytes on the GPU", num_bytes));
  }
  buffer.size_ = num_bytes;
  return buffer;
}

DeviceBuffer::~DeviceBuffer() {
  if (data_ != nullptr) cudaFree(data_);
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) cudaFree(data_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

Expected<DeviceTensor> DeviceTensor::allocate(DType dtype, Shape shape) {
  DeviceTensor t;
  MOE_ASSIGN_OR_RETURN(t.buffer_, DeviceBuffer::allocate(dtype_bytes(dtype, shape.num_elements())));
  int device = 0;
  cudaGetDevice(&device);
  t.view_ = TensorView(t.buffer_.data(), dtype, shape, Device::cuda(device));
  return t;
}

Expected<DeviceTensor> DeviceTensor::upload(const TensorView& host) {
  MOE_ASSIGN_OR_RETURN(DeviceTensor t, allocate(host.dtype(), host.shape()));
  if (host.num_bytes() > 0)
    MOE_CUDA_RETURN_IF_ERROR(cudaMemcpy(t.data(), host.data(), host.num_bytes(), cudaMemcpyHostToDevice));
  return t;
}

Expected<Tensor> download(const TensorView& device) {
  Tensor host(device.dtype(), device.shape());
  if (device.num_bytes() > 0)
    MOE_CUDA_RETURN_IF_ERROR(cudaMemcpy(host.data(), device.data(), device.num_bytes(), cudaMemcpyDeviceToHost));
  return host;
}

}  // namespace moe
