// POSIX shared-memory symmetric buffers: see shm_symmetric_memory.h.
#include "comm/cpu/shm_symmetric_memory.h"

#include "core/check.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace moe::comm {
namespace {

constexpr uint64_t kMagic = 0x6d6f655f73686d31ull;  // "moe_shm1"
constexpr size_t kPageBytes = 4096;
constexpr int kControlWords = ShmSymmetricMemory::kControlWords;

// The first bytes of a segment. Zero-filled by ftruncate; the owner writes the
// geometry, then the magic with release, so a peer that sees the magic sees
// the rest.
struct SegmentHeader {
  uint64_t magic;
  uint64_t world_size;
  uint64_t rank;
  uint64_t buffer_bytes;
  uint64_t pid;          // the owner process and its start time (/proc/<pid>/stat
  uint64_t start_ticks;  // field 22), so a peer can tell it has exited
  alignas(64) uint64_t mapped_all;  // 1 once the owner has mapped every segment
  alignas(64) uint64_t control[kControlWords];
};
static_assert(sizeof(SegmentHeader) <= 4096);

SegmentHeader* header_of(std::byte* segment) { return reinterpret_cast<SegmentHeader*>(segment); }

uint64_t load_acquire(uint64_t& word) { return std::atomic_ref<uint64_t>(word).load(std::memory_order_acquire); }
void store_release(uint64_t& word, uint64_t value) {
  std::atomic_ref<uint64_t>(word).store(value, std::memory_order_release);
}

bool valid_name(const std::string& name) {
  if (name.empty() || name.size() > 200) return false;
  for (char c : name)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.')) return false;
  return true;
}

std::string errno_text() { return std::strerror(errno); }

// The state letter and start time of a process from /proc/<pid>/stat; state
// 0 when there is no such process. The command name (field 2) may hold spaces
// and parentheses, so the fields are counted after its last ')'.
struct ProcStat {
  char state = 0;
  uint64_t start_ticks = 0;
};
ProcStat read_proc_stat(uint64_t pid) {
  ProcStat out;
  const std::string path = fmt::format("/proc/{}/stat", pid);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return out;
  char text[1024];
  const ssize_t n = ::read(fd, text, sizeof(text) - 1);
  ::close(fd);
  if (n <= 0) return out;
  text[n] = 0;
  const char* p = std::strrchr(text, ')');
  if (p == nullptr || p[1] != ' ') return out;
  p += 2;  // field 3, the state
  out.state = *p;
  for (int field = 3; field < 22 && *p != 0; ++p)
    if (*p == ' ') ++field;
  out.start_ticks = std::strtoull(p, nullptr, 10);
  return out;
}

// A rank's process is gone: no such pid, a zombie (exited, not yet reaped by
// its parent), or the pid reused by a process started later.
bool process_exited(uint64_t pid, uint64_t start_ticks) {
  const ProcStat now = read_proc_stat(pid);
  return now.state == 0 || now.state == 'Z' || now.state == 'X' || now.start_ticks != start_ticks;
}

// How often a waiting rank looks whether the ranks it waits for still live.
constexpr int64_t kLivenessCheckNs = 20'000'000;

}  // namespace

int64_t monotonic_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

void yield_thread() { sched_yield(); }

std::string ShmSymmetricMemory::segment_name(int r) const { return fmt::format("/moe_{}_{}", name_, r); }

uint64_t* ShmSymmetricMemory::flag_slot(int owner, int writer) const {
  return reinterpret_cast<uint64_t*>(segments_[owner] + kHeaderBytes + 64 * static_cast<size_t>(writer));
}

Expected<std::unique_ptr<ShmSymmetricMemory>> ShmSymmetricMemory::open(const std::string& name, int rank,
                                                                        int world_size, size_t buffer_bytes,
                                                                        int timeout_ms) {
  if (world_size < 1 || world_size > kMaxRanks)
    return invalid_argument("shm group '{}': world_size {} is not in [1, {}]", name, world_size, kMaxRanks);
  if (rank < 0 || rank >= world_size)
    return invalid_argument("shm group '{}': rank {} is not in [0, {})", name, rank, world_size);
  if (!valid_name(name))
    return invalid_argument("shm group name '{}' must be 1-200 characters of [A-Za-z0-9_.-]", name);
  if (buffer_bytes < 4096 || buffer_bytes % 64 != 0)
    return invalid_argument("shm group '{}': buffer_bytes {} must be a multiple of 64, at least 4096", name,
                            buffer_bytes);
  if (timeout_ms <= 0) return invalid_argument("shm group '{}': timeout_ms must be positive", name);

  std::unique_ptr<ShmSymmetricMemory> mem(new ShmSymmetricMemory());
  mem->name_ = name;
  mem->rank_ = rank;
  mem->world_size_ = world_size;
  mem->buffer_bytes_ = buffer_bytes;
  mem->segment_bytes_ = (kDataOffset + buffer_bytes + kPageBytes - 1) / kPageBytes * kPageBytes;
  mem->timeout_ms_ = timeout_ms;
  mem->segments_.assign(world_size, nullptr);

  if (world_size == 1) {
    // No peers: private memory, pages only materialise when touched.
    void* p = mmap(nullptr, mem->segment_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (p == MAP_FAILED) return resource_exhausted("mmap of {} bytes: {}", mem->segment_bytes_, errno_text());
    mem->segments_[0] = static_cast<std::byte*>(p);
    return mem;
  }
  // On any error below, the destructor unlinks our name and unmaps.
  MOE_RETURN_IF_ERROR(mem->create_local());
  const int64_t deadline_ns = monotonic_ns() + static_cast<int64_t>(timeout_ms) * 1'000'000;
  for (int r = 0; r < world_size; ++r)
    if (r != rank) MOE_RETURN_IF_ERROR(mem->map_peer(r, deadline_ns));
  store_release(header_of(mem->segments_[rank])->mapped_all, 1);
  MOE_RETURN_IF_ERROR(mem->wait_all_mapped(deadline_ns));
  mem->unlink_own_name();
  return mem;
}

Status ShmSymmetricMemory::create_local() {
  const std::string path = segment_name(rank_);
  const int fd = shm_open(path.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    if (errno == EEXIST)
      return invalid_argument(
          "shared memory segment {} exists: another group uses the name '{}', or a killed run left it behind "
          "(remove /dev/shm{})",
          path, name_, path);
    return unavailable("shm_open({}): {}", path, errno_text());
  }
  own_name_linked_ = true;
  if (ftruncate(fd, static_cast<off_t>(segment_bytes_)) != 0) {
    const std::string error = errno_text();
    close(fd);
    return resource_exhausted("ftruncate({}, {} bytes): {}", path, segment_bytes_, error);
  }
  void* p = mmap(nullptr, segment_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return resource_exhausted("mmap({}, {} bytes): {}", path, segment_bytes_, errno_text());
  segments_[rank_] = static_cast<std::byte*>(p);
  SegmentHeader* header = header_of(segments_[rank_]);
  header->world_size = static_cast<uint64_t>(world_size_);
  header->rank = static_cast<uint64_t>(rank_);
  header->buffer_bytes = buffer_bytes_;
  header->pid = static_cast<uint64_t>(getpid());
  header->start_ticks = read_proc_stat(header->pid).start_ticks;
  store_release(header->magic, kMagic);
  return Status::ok();
}

Status ShmSymmetricMemory::map_peer(int r, int64_t deadline_ns) {
  const std::string path = segment_name(r);
  int fd = -1;
  struct stat st {};
  // The peer may not have created or sized its segment yet (ftruncate makes
  // the size appear at once, so a non-zero size is final). Polled with short
  // sleeps: setup is not latency-critical.
  for (;;) {
    if (fd < 0) fd = shm_open(path.c_str(), O_RDWR, 0);
    if (fd >= 0 && fstat(fd, &st) == 0 && st.st_size > 0) break;
    if (fd < 0 && errno != ENOENT) return unavailable("shm_open({}): {}", path, errno_text());
    if (monotonic_ns() > deadline_ns) {
      if (fd >= 0) close(fd);
      return deadline_exceeded(
          "shm group '{}': rank {} did not create its segment {} within {} ms (this is rank {})", name_, r, path,
          timeout_ms_, rank_);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  if (static_cast<size_t>(st.st_size) != segment_bytes_) {
    close(fd);
    return invalid_argument("shm group '{}': rank {} has a {}-byte segment, this rank {} bytes: buffer_bytes differ",
                            name_, r, st.st_size, segment_bytes_);
  }
  void* p = mmap(nullptr, segment_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return resource_exhausted("mmap({}, {} bytes): {}", path, segment_bytes_, errno_text());
  segments_[r] = static_cast<std::byte*>(p);
  SegmentHeader* header = header_of(segments_[r]);
  if (!wait_until([&] { return load_acquire(header->magic) == kMagic; }, deadline_ns))
    return deadline_exceeded("shm group '{}': rank {} did not initialise its segment within {} ms", name_, r,
                             timeout_ms_);
  if (header->world_size != static_cast<uint64_t>(world_size_) || header->rank != static_cast<uint64_t>(r) ||
      header->buffer_bytes != buffer_bytes_)
    return invalid_argument("shm group '{}': segment {} says rank {} of {} with {} bytes; expected rank {} of {} with {}",
                            name_, path, header->rank, header->world_size, header->buffer_bytes, r, world_size_,
                            buffer_bytes_);
  return Status::ok();
}

Status ShmSymmetricMemory::wait_all_mapped(int64_t deadline_ns) {
  std::string missing;
  for (int r = 0; r < world_size_; ++r) {
    uint64_t& flag = header_of(segments_[r])->mapped_all;
    if (!wait_until([&] { return load_acquire(flag) == 1; }, deadline_ns))
      missing += fmt::format("{}{}", missing.empty() ? "" : ", ", r);
  }
  if (missing.empty()) return Status::ok();
  return deadline_exceeded("shm group '{}': rank(s) {} did not map every segment within {} ms (this is rank {})",
                           name_, missing, timeout_ms_, rank_);
}

void ShmSymmetricMemory::unlink_own_name() {
  if (!own_name_linked_) return;
  shm_unlink(segment_name(rank_).c_str());
  own_name_linked_ = false;
}

ShmSymmetricMemory::~ShmSymmetricMemory() {
  unlink_own_name();
  for (std::byte* segment : segments_)
    if (segment != nullptr) munmap(segment, segment_bytes_);
}

void ShmSymmetricMemory::set_control(int word, uint64_t value) {
  CHECK(word >= 0 && word < kControlWords, "control word {}", word);
  std::atomic_ref<uint64_t>(header_of(segments_[rank_])->control[word]).store(value, std::memory_order_relaxed);
}

uint64_t ShmSymmetricMemory::control(int r, int word) const {
  CHECK(r >= 0 && r < world_size_ && word >= 0 && word < kControlWords, "control({}, {})", r, word);
  return std::atomic_ref<uint64_t>(header_of(segments_[r])->control[word]).load(std::memory_order_relaxed);
}

Status ShmSymmetricMemory::barrier(std::string_view what) {
  if (broken_)
    return aborted("shm group '{}' rank {}: an earlier collective failed; the group is out of step", name_, rank_);
  if (world_size_ == 1) return Status::ok();
  ++sequence_;
  for (int r = 0; r < world_size_; ++r) store_release(*flag_slot(r, rank_), sequence_);
  const int64_t deadline_ns = monotonic_ns() + static_cast<int64_t>(timeout_ms_) * 1'000'000;
  // Wait in slices; between slices, a peer whose process has exited fails the
  // barrier at once instead of at the deadline.
  std::string missing, exited;
  for (int r = 0; r < world_size_; ++r) {
    uint64_t& flag = *flag_slot(rank_, r);
    const auto arrived = [&] { return load_acquire(flag) >= sequence_; };
    for (;;) {
      const int64_t slice_end = std::min(deadline_ns, monotonic_ns() + kLivenessCheckNs);
      if (wait_until(arrived, slice_end)) break;
      if (peer_exited(r)) {
        exited += fmt::format("{}{} (pid {})", exited.empty() ? "" : ", ", r, header_of(segments_[r])->pid);
        break;
      }
      if (monotonic_ns() > deadline_ns) {
        missing += fmt::format("{}{}", missing.empty() ? "" : ", ", r);
        break;
      }
    }
  }
  if (missing.empty() && exited.empty()) return Status::ok();
  broken_ = true;
  if (!exited.empty())
    return unavailable("shm group '{}' rank {}: rank(s) {} exited before arriving at {} (barrier #{})", name_,
                       rank_, exited, what, sequence_);
  return deadline_exceeded("shm group '{}' rank {}: rank(s) {} did not arrive at {} (barrier #{}) within {} ms", name_,
                           rank_, missing, what, sequence_, timeout_ms_);
}

bool ShmSymmetricMemory::peer_exited(int r) const {
  const SegmentHeader* header = header_of(segments_[r]);
  if (header->pid == static_cast<uint64_t>(getpid())) return false;  // ranks as threads of this process
  return process_exited(header->pid, header->start_ticks);
}

}  // namespace moe::comm
