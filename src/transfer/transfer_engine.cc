// The TransferEngine facade: registration, validation of batches against both
// regions' bounds, cutting them into frames, and dispatch to the transport
// that owns the destination. See transfer_engine.h.
#include "transfer/transfer_engine.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "core/logging.h"
#include "transfer/tcp_transport.h"
#include "transfer/transport.h"
#ifdef MOE_TRANSFER_HAVE_CUDA
#include "transfer/cuda_ipc_transport.h"
#endif
#ifdef MOE_TRANSFER_HAVE_IBVERBS
#include "transfer/ibverbs_transport.h"
#endif

namespace moe::transfer {

const char* transport_name(TransportKind kind) {
  switch (kind) {
    case TransportKind::kTcp: return "tcp";
    case TransportKind::kCudaIpc: return "cuda_ipc";
    case TransportKind::kIbverbs: return "ibverbs";
  }
  return "unknown";
}

const char* memory_kind_name(MemoryKind kind) { return kind == MemoryKind::kHost ? "host" : "device"; }

namespace {

Expected<TransportKind> transport_from_name(const std::string& name) {
  for (TransportKind kind : {TransportKind::kTcp, TransportKind::kCudaIpc, TransportKind::kIbverbs}) {
    if (name == transport_name(kind)) return kind;
  }
  return invalid_argument("unknown transport '{}'", name);
}

// This machine's identity for "same host" checks: the kernel boot id.
std::string read_host_id() {
  std::ifstream file("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(file, id);
  if (id.empty()) {
    char name[256] = {};
    gethostname(name, sizeof(name) - 1);
    id = name;
  }
  return id;
}

bool fits(uint64_t offset, uint64_t length, uint64_t size) { return offset <= size && length <= size - offset; }

}  // namespace

nlohmann::json RegionDescriptor::to_json() const {
  return nlohmann::json{{"endpoint", endpoint},       {"region_id", region_id},   {"base_address", base_address},
                        {"length_bytes", length_bytes}, {"transport", transport_name(transport)},
                        {"memory", memory_kind_name(memory)}, {"device", device}, {"host_id", host_id},
                        {"export_data", export_data}};
}

Expected<RegionDescriptor> RegionDescriptor::from_json(const nlohmann::json& json) {
  if (!json.is_object()) return invalid_argument("region descriptor: not a JSON object");
  auto field = [&](const char* name, nlohmann::json::value_t type) -> Expected<const nlohmann::json*> {
    auto it = json.find(name);
    if (it == json.end()) return invalid_argument("region descriptor: field '{}' is missing", name);
    const bool ok = type == nlohmann::json::value_t::number_unsigned ? it->is_number_unsigned()
                    : type == nlohmann::json::value_t::number_integer ? it->is_number_integer()
                                                                      : it->type() == type;
    if (!ok) return invalid_argument("region descriptor: field '{}' has the wrong type", name);
    return &*it;
  };
  using T = nlohmann::json::value_t;
  RegionDescriptor d;
  MOE_ASSIGN_OR_RETURN(auto endpoint, field("endpoint", T::string));
  MOE_ASSIGN_OR_RETURN(auto region_id, field("region_id", T::number_unsigned));
  MOE_ASSIGN_OR_RETURN(auto base, field("base_address", T::number_unsigned));
  MOE_ASSIGN_OR_RETURN(auto length, field("length_bytes", T::number_unsigned));
  MOE_ASSIGN_OR_RETURN(auto transport, field("transport", T::string));
  MOE_ASSIGN_OR_RETURN(auto memory, field("memory", T::string));
  MOE_ASSIGN_OR_RETURN(auto device, field("device", T::number_integer));
  MOE_ASSIGN_OR_RETURN(auto host_id, field("host_id", T::string));
  MOE_ASSIGN_OR_RETURN(auto export_data, field("export_data", T::string));
  d.endpoint = endpoint->get<std::string>();
  if (d.endpoint.empty() || d.endpoint.size() > wire::kMaxEndpointBytes)
    return invalid_argument("region descriptor: bad endpoint");
  d.region_id = region_id->get<uint64_t>();
  d.base_address = base->get<uint64_t>();
  d.length_bytes = length->get<uint64_t>();
  MOE_ASSIGN_OR_RETURN(d.transport, transport_from_name(transport->get<std::string>()));
  const std::string memory_name = memory->get<std::string>();
  if (memory_name != "host" && memory_name != "device")
    return invalid_argument("region descriptor: unknown memory kind '{}'", memory_name);
  d.memory = memory_name == "host" ? MemoryKind::kHost : MemoryKind::kDevice;
  const int64_t device_value = device->get<int64_t>();
  if (device_value < -1 || device_value > 1024) return invalid_argument("region descriptor: bad device {}", device_value);
  d.device = static_cast<int>(device_value);
  d.host_id = host_id->get<std::string>();
  d.export_data = export_data->get<std::string>();
  if (d.host_id.size() > 256 || d.export_data.size() > 4096)
    return invalid_argument("region descriptor: host_id or export_data too long");
  return d;
}

Expected<EngineOptions> apply_env_overrides(EngineOptions options) {
  if (const char* text = std::getenv("MOE_TRANSFER_STALL_AFTER_BYTES"); text != nullptr && *text != '\0') {
    char* end = nullptr;
    errno = 0;
    const unsigned long long value = std::strtoull(text, &end, 10);
    if (errno != 0 || end == text || *end != '\0' || text[0] == '-')
      return invalid_argument("MOE_TRANSFER_STALL_AFTER_BYTES='{}' is not a byte count", text);
    options.stall_after_bytes = value;
  }
  return options;
}

namespace {

class Engine final : public TransferEngine {
 public:
  explicit Engine(const EngineOptions& options) : options_(options), host_id_(read_host_id()) {}

  ~Engine() override {
    for (auto it = transports_.rbegin(); it != transports_.rend(); ++it) (*it)->shutdown();
    tracker_.fail_all(aborted("transfer engine {} shut down", endpoint()));
  }

  Status start() {
    MOE_ASSIGN_OR_RETURN(
        auto tcp, TcpTransport::create(options_, receiver_, tracker_, counters_,
                                       [this](const std::string& peer, const Status& why) { peer_lost(peer, why); }));
    tcp_ = tcp.get();
    transports_.push_back(std::move(tcp));
#ifdef MOE_TRANSFER_HAVE_CUDA
    if (options_.enable_cuda_ipc) {
      if (auto ipc = CudaIpcTransport::create(*tcp_, tracker_, host_id_)) {
        transports_.push_back(std::move(*ipc));
      } else {
        log_debug("transfer: CUDA IPC transport off: {}", ipc.status().to_string());
      }
    }
#endif
#ifdef MOE_TRANSFER_HAVE_IBVERBS
    if (options_.enable_ibverbs) {
      if (auto verbs = IbverbsTransport::create(receiver_, tracker_, *tcp_)) {
        transports_.push_back(std::move(*verbs));
      } else {
        log_info("transfer: ibverbs transport off: {}", verbs.status().to_string());
      }
    }
#endif
    return Status::ok();
  }

  const std::string& endpoint() const override { return tcp_->endpoint(); }

  std::vector<TransportKind> transports() const override {
    std::vector<TransportKind> kinds;
    for (auto& transport : transports_) kinds.push_back(transport->kind());
    return kinds;
  }

  Transport* find_transport(TransportKind kind) const {
    for (auto& transport : transports_) {
      if (transport->kind() == kind) return transport.get();
    }
    return nullptr;
  }

  Expected<RegionId> register_region(void* base, uint64_t length_bytes, MemoryKind memory, int device,
                                     std::optional<TransportKind> transport_kind) override {
    if (base == nullptr || length_bytes == 0) return invalid_argument("register_region: empty region");
    if (reinterpret_cast<uintptr_t>(base) + length_bytes < reinterpret_cast<uintptr_t>(base))
      return invalid_argument("register_region: region wraps around the address space");
    const TransportKind host_kind =
        find_transport(TransportKind::kIbverbs) != nullptr ? TransportKind::kIbverbs : TransportKind::kTcp;
    const TransportKind kind =
        transport_kind.value_or(memory == MemoryKind::kDevice ? TransportKind::kCudaIpc : host_kind);
    Transport* transport = find_transport(kind);
    if (transport == nullptr)
      return unavailable("register_region: transport {} is not available in this engine", transport_name(kind));
    LocalRegion region{0, static_cast<uint8_t*>(base), length_bytes, memory, memory == MemoryKind::kHost ? -1 : device, kind};
    {
      std::lock_guard lock(mutex_);
      region.id = next_region_id_++;
    }
    RegionDescriptor descriptor{endpoint(), region.id, reinterpret_cast<uint64_t>(base), length_bytes, kind, memory,
                                region.device, host_id_, {}};
    MOE_RETURN_IF_ERROR(transport->export_region(region, descriptor));
    {
      std::lock_guard lock(mutex_);
      regions_.emplace(region.id, std::make_pair(region, descriptor));
    }
    receiver_.add_region(region);
    return region.id;
  }

  Status deregister_region(RegionId id) override {
    std::optional<LocalRegion> region;
    {
      std::lock_guard lock(mutex_);
      auto it = regions_.find(id);
      if (it == regions_.end()) return not_found("region {} is not registered", id);
      region = it->second.first;
      regions_.erase(it);
    }
    MOE_RETURN_IF_ERROR(receiver_.remove_region(id));
    if (Transport* transport = find_transport(region->transport)) transport->forget_region(id);
    return Status::ok();
  }

  Expected<RegionDescriptor> describe(RegionId id) const override {
    std::lock_guard lock(mutex_);
    auto it = regions_.find(id);
    if (it == regions_.end()) return not_found("region {} is not registered", id);
    return it->second.second;
  }

  Expected<TransferId> submit_write(RegionId src_region, uint64_t src_offset, const RegionDescriptor& dst,
                                    uint64_t dst_offset, uint64_t length_bytes, uint32_t imm,
                                    SubmitOptions options) override {
    RegionRuns group{src_region, dst, {Run{src_offset, dst_offset, length_bytes}}};
    return submit_scattered({&group, 1}, imm, std::move(options));
  }

  Expected<TransferId> submit_paged(const PagedWrite& write, uint32_t imm, SubmitOptions options) override {
    if (write.src_pages.size() != write.dst_pages.size())
      return invalid_argument("submit_paged: {} source pages but {} destination pages", write.src_pages.size(),
                              write.dst_pages.size());
    RegionRuns group{write.src_region, write.dst, {}};
    group.runs.reserve(write.src_pages.size());
    for (size_t i = 0; i < write.src_pages.size(); ++i) {
      if (write.src_pages[i] < 0 || write.dst_pages[i] < 0) return invalid_argument("submit_paged: negative page id");
      group.runs.push_back(Run{write.src_base_offset + static_cast<uint64_t>(write.src_pages[i]) * write.src_page_stride_bytes,
                               write.dst_base_offset + static_cast<uint64_t>(write.dst_pages[i]) * write.dst_page_stride_bytes,
                               write.page_bytes});
    }
    return submit_scattered({&group, 1}, imm, std::move(options));
  }

  Expected<TransferId> submit_scattered(std::span<const RegionRuns> groups, uint32_t imm,
                                        SubmitOptions options) override {
    if (groups.empty()) return invalid_argument("submit_scattered: no groups");
    const RegionDescriptor& first = groups.front().dst;
    OutBatch batch;
    for (const RegionRuns& group : groups) {
      if (group.dst.endpoint != first.endpoint || group.dst.transport != first.transport)
        return invalid_argument("submit_scattered: one batch goes to one peer over one transport ({} {} vs {} {})",
                                first.endpoint, transport_name(first.transport), group.dst.endpoint,
                                transport_name(group.dst.transport));
      std::optional<LocalRegion> src = receiver_.find_region(group.src_region);
      if (!src) return not_found("source region {} is not registered", group.src_region);
      // Only CUDA IPC reads device memory; the other transports would read it
      // with the CPU (no staging through host memory yet).
      if (src->memory == MemoryKind::kDevice && group.dst.transport != TransportKind::kCudaIpc)
        return unimplemented("source region {} is device memory, which only CUDA IPC sends, not {} (to {})", src->id,
                             transport_name(group.dst.transport), group.dst.endpoint);
      if (batch.dsts.empty()) {
        batch.src_memory = src->memory;
        batch.src_device = src->device;
      }
      batch.dsts.push_back(group.dst);
      const size_t dst_index = batch.dsts.size() - 1;
      for (const Run& run : group.runs) {
        if (run.length_bytes == 0) continue;
        if (!fits(run.src_offset, run.length_bytes, src->length_bytes))
          return out_of_range("write source [{}, +{}) outside region {} of {} bytes", run.src_offset, run.length_bytes,
                              src->id, src->length_bytes);
        if (!fits(run.dst_offset, run.length_bytes, group.dst.length_bytes))
          return out_of_range("write destination [{}, +{}) outside region {} of {} ({} bytes)", run.dst_offset,
                              run.length_bytes, group.dst.region_id, group.dst.endpoint, group.dst.length_bytes);
        const uint8_t* src_ptr = src->base + run.src_offset;
        // Coalesce with the previous run when both sides continue it.
        if (!batch.frames.empty()) {
          OutFrame& last = batch.frames.back();
          if (last.dst_index == dst_index && last.src + last.length_bytes == src_ptr &&
              last.dst_offset + last.length_bytes == run.dst_offset) {
            last.length_bytes += run.length_bytes;
            continue;
          }
        }
        batch.frames.push_back(OutFrame{src_ptr, dst_index, run.dst_offset, run.length_bytes});
      }
    }
    Transport* transport = find_transport(first.transport);
    if (transport == nullptr)
      return unavailable("transport {} (of {}) is not available in this engine", transport_name(first.transport),
                         first.endpoint);
    if (first.transport == TransportKind::kTcp) split_frames(batch.frames);
    // TCP finishes a batch frame by frame; the other transports with their one
    // completion notice.
    const uint64_t num_frames =
        first.transport == TransportKind::kTcp ? std::max<uint64_t>(1, batch.frames.size()) : 1;
    if (num_frames > wire::kMaxBatchFrames) return out_of_range("batch of {} frames is too big", num_frames);
    batch.state = tracker_.start(imm, first.endpoint, std::move(options), num_frames);
    const TransferId id = batch.state->id;
    auto state = batch.state;
    if (Status status = transport->submit(std::move(batch)); !status.is_ok()) {
      state->on_done = nullptr;
      tracker_.finish(state, status);
      (void)tracker_.poll(id);  // forget it: the caller gets the error here
      return status;
    }
    return id;
  }

  void split_frames(std::vector<OutFrame>& frames) const {
    const uint64_t max_bytes = options_.max_frame_bytes;
    if (std::all_of(frames.begin(), frames.end(), [&](const OutFrame& f) { return f.length_bytes <= max_bytes; })) return;
    std::vector<OutFrame> split;
    for (const OutFrame& frame : frames) {
      for (uint64_t done = 0; done < frame.length_bytes; done += max_bytes) {
        split.push_back(OutFrame{frame.src + done, frame.dst_index, frame.dst_offset + done,
                                 std::min(max_bytes, frame.length_bytes - done)});
      }
    }
    frames = std::move(split);
  }

  Expected<TransferId> submit_notify(const std::string& peer_endpoint, uint32_t imm, SubmitOptions options) override {
    auto state = tracker_.start(imm, peer_endpoint, std::move(options), 1);
    const TransferId id = state->id;
    if (Status status = tcp_->send_notify(peer_endpoint, state, 1); !status.is_ok()) {
      state->on_done = nullptr;
      tracker_.finish(state, status);
      (void)tracker_.poll(id);
      return status;
    }
    return id;
  }

  Status wait(TransferId id, std::chrono::milliseconds timeout) override { return tracker_.wait(id, timeout); }
  std::optional<Status> poll(TransferId id) override { return tracker_.poll(id); }
  void forget(TransferId id) override { tracker_.forget(id); }

  Status cancel(uint32_t imm) override {
    auto batches = tracker_.unfinished(imm);
    if (batches.empty()) return Status::ok();
    for (auto& batch : batches) tracker_.finish(batch, aborted("transfer {} (imm {}) cancelled", batch->id, imm));
    for (auto& transport : transports_) transport->cancel(batches);
    return Status::ok();
  }

  Status arm(uint32_t imm, std::optional<std::string> writer) override { return receiver_.arm(imm, std::move(writer)); }
  Status disarm(uint32_t imm) override { return receiver_.disarm(imm); }
  Status wait_for(uint32_t imm, uint64_t expected_batches, std::chrono::milliseconds timeout) override {
    return receiver_.wait_for(imm, expected_batches, timeout);
  }
  ImmState poll_imm(uint32_t imm) const override { return receiver_.poll_imm(imm); }
  void set_completion_callback(std::function<void(uint32_t, uint64_t)> callback) override {
    receiver_.set_completion_callback(std::move(callback));
  }
  void set_peer_lost_callback(std::function<void(const std::string&, const Status&)> callback) override {
    std::lock_guard lock(mutex_);
    on_peer_lost_ = std::make_shared<std::function<void(const std::string&, const Status&)>>(std::move(callback));
  }

  EngineStats stats() const override {
    EngineStats s;
    s.num_bytes_sent = counters_.num_bytes_sent.load();
    s.num_bytes_received = receiver_.num_bytes_received();
    s.num_batches_completed = receiver_.num_batches_completed();
    s.num_dropped_frames = receiver_.num_dropped_frames();
    s.num_bad_frames = counters_.num_bad_frames.load();
    s.num_connections_lost = counters_.num_connections_lost.load();
    return s;
  }

 private:
  void peer_lost(const std::string& peer, const Status& why) {
    std::shared_ptr<std::function<void(const std::string&, const Status&)>> callback;
    {
      std::lock_guard lock(mutex_);
      callback = on_peer_lost_;
    }
    log_warn("transfer: {}", why.message());
    if (callback && *callback) (*callback)(peer, why);
  }

  EngineOptions options_;
  std::string host_id_;
  // Declared before the transports: their threads use these until shutdown.
  Receiver receiver_;
  BatchTracker tracker_;
  TransportCounters counters_;
  std::vector<std::unique_ptr<Transport>> transports_;  // [0] is TCP
  TcpTransport* tcp_ = nullptr;

  mutable std::mutex mutex_;
  RegionId next_region_id_ = 1;
  std::unordered_map<RegionId, std::pair<LocalRegion, RegionDescriptor>> regions_;
  std::shared_ptr<std::function<void(const std::string&, const Status&)>> on_peer_lost_;
};

}  // namespace

Expected<std::unique_ptr<TransferEngine>> TransferEngine::create(const EngineOptions& options) {
  auto engine = std::make_unique<Engine>(options);
  MOE_RETURN_IF_ERROR(engine->start());
  return std::unique_ptr<TransferEngine>(std::move(engine));
}

}  // namespace moe::transfer
