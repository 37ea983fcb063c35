#include "kv/shm_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

namespace moe::kv {

namespace {

Expected<void*> map_fd(int fd, const std::string& name, size_t num_bytes) {
  void* data = ::mmap(nullptr, num_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (data == MAP_FAILED) return resource_exhausted("mmap of shared memory {} ({} bytes): {}", name, num_bytes,
                                                    std::strerror(errno));
  return data;
}

}  // namespace

Expected<ShmRegion> ShmRegion::create(const std::string& name, size_t num_bytes) {
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return internal_error("shm_open {}: {}", name, std::strerror(errno));
  if (::ftruncate(fd, static_cast<off_t>(num_bytes)) != 0) {
    const int err = errno;
    ::close(fd);
    ::shm_unlink(name.c_str());
    return resource_exhausted("sizing shared memory {} to {} bytes: {} (is /dev/shm large enough?)", name,
                              num_bytes, std::strerror(err));
  }
  auto data = map_fd(fd, name, num_bytes);
  if (!data) {
    ::shm_unlink(name.c_str());
    return data.status();
  }
  return ShmRegion(name, *data, num_bytes, true);
}

Expected<ShmRegion> ShmRegion::open(const std::string& name, size_t num_bytes) {
  const int fd = ::shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) return not_found("shm_open {}: {}", name, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != num_bytes) {
    ::close(fd);
    return invalid_argument("shared memory {} is {} bytes, expected {}", name, st.st_size, num_bytes);
  }
  MOE_ASSIGN_OR_RETURN(void* data, map_fd(fd, name, num_bytes));
  return ShmRegion(name, data, num_bytes, false);
}

ShmRegion::ShmRegion(ShmRegion&& other) noexcept
    : name_(std::move(other.name_)),
      data_(std::exchange(other.data_, nullptr)),
      num_bytes_(std::exchange(other.num_bytes_, 0)),
      linked_(std::exchange(other.linked_, false)) {}

ShmRegion& ShmRegion::operator=(ShmRegion&& other) noexcept {
  if (this != &other) {
    this->~ShmRegion();
    new (this) ShmRegion(std::move(other));
  }
  return *this;
}

ShmRegion::~ShmRegion() {
  unlink();
  if (data_ != nullptr) ::munmap(data_, num_bytes_);
}

void ShmRegion::unlink() {
  if (linked_) ::shm_unlink(name_.c_str());
  linked_ = false;
}

}  // namespace moe::kv
