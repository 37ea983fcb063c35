// ibverbs transport: see ibverbs_transport.h. Never run on real hardware yet
// (the development machine's kernel refuses RDMA, soft-RoCE included); the
// test skips there, printing why.
#include "transfer/ibverbs_transport.h"

#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <poll.h>

#include <algorithm>
#include <charconv>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "core/logging.h"

namespace moe::transfer {
namespace {

constexpr uint8_t kPort = 1;
constexpr int kGidIndex = 0;
constexpr uint32_t kSendDepth = 4096;
constexpr uint32_t kRecvDepth = 1024;
constexpr int kCqDepth = 16384;

// kQpConnect payload: qpn, psn, lid, mtu, gid.
struct QpInfo {
  uint32_t qpn = 0;
  uint32_t psn = 0;
  uint16_t lid = 0;
  uint8_t mtu = 0;
  ibv_gid gid{};
};

TcpTransport::QpInfo encode(const QpInfo& info) {
  TcpTransport::QpInfo raw{};
  std::memcpy(raw.data(), &info.qpn, 4);
  std::memcpy(raw.data() + 4, &info.psn, 4);
  std::memcpy(raw.data() + 8, &info.lid, 2);
  raw[10] = info.mtu;
  std::memcpy(raw.data() + 12, info.gid.raw, 16);
  return raw;
}

QpInfo decode(const TcpTransport::QpInfo& raw) {
  QpInfo info;
  std::memcpy(&info.qpn, raw.data(), 4);
  std::memcpy(&info.psn, raw.data() + 4, 4);
  std::memcpy(&info.lid, raw.data() + 8, 2);
  info.mtu = raw[10];
  std::memcpy(info.gid.raw, raw.data() + 12, 16);
  return info;
}

Status verbs_error(const char* what, int error) {
  return unavailable("ibverbs: {}: {}", what, std::strerror(error != 0 ? error : errno));
}

}  // namespace

struct IbverbsTransport::State {
  State(Receiver& r, BatchTracker& t, TcpTransport& c) : receiver(r), tracker(t), control(c) {}

  struct Peer {
    ibv_qp* qp = nullptr;
    uint32_t num_outstanding = 0;  // posted work requests not yet completed
    Status failure;
  };
  struct InFlight {
    std::shared_ptr<BatchState> batch;
    std::string peer;
    uint32_t num_requests = 0;
  };

  Receiver& receiver;
  BatchTracker& tracker;
  TcpTransport& control;
  ibv_context* context = nullptr;
  ibv_pd* pd = nullptr;
  ibv_comp_channel* channel = nullptr;
  ibv_cq* cq = nullptr;
  ibv_port_attr port{};
  ibv_gid gid{};
  std::mt19937 psn_rng{std::random_device{}()};

  std::mutex mutex;
  std::condition_variable cv;
  std::map<RegionId, ibv_mr*> mrs;
  std::map<std::string, Peer> peers;
  std::map<uint32_t, ibv_qp*> inbound;  // qp_num -> queue pair accepted from a peer
  std::map<TransferId, InFlight> in_flight;
  std::thread poller;
  std::atomic<bool> stopping{false};

  Expected<ibv_qp*> create_qp() {
    ibv_qp_init_attr init{};
    init.send_cq = cq;
    init.recv_cq = cq;
    init.cap.max_send_wr = kSendDepth;
    init.cap.max_recv_wr = kRecvDepth;
    init.cap.max_send_sge = 1;
    init.cap.max_recv_sge = 1;
    init.qp_type = IBV_QPT_RC;
    ibv_qp* qp = ibv_create_qp(pd, &init);
    if (qp == nullptr) return verbs_error("ibv_create_qp", 0);
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_INIT;
    attr.pkey_index = 0;
    attr.port_num = kPort;
    attr.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE;
    if (int rc = ibv_modify_qp(qp, &attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) {
      ibv_destroy_qp(qp);
      return verbs_error("queue pair to INIT", rc);
    }
    return qp;
  }

  QpInfo local_info(ibv_qp* qp) {
    QpInfo info;
    info.qpn = qp->qp_num;
    {
      std::lock_guard lock(mutex);
      info.psn = psn_rng() & 0xffffff;
    }
    info.lid = port.lid;
    info.mtu = static_cast<uint8_t>(port.active_mtu);
    info.gid = gid;
    return info;
  }

  Status connect_qp(ibv_qp* qp, const QpInfo& local, const QpInfo& remote) {
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_RTR;
    attr.path_mtu = static_cast<ibv_mtu>(std::min(local.mtu, remote.mtu));
    attr.dest_qp_num = remote.qpn;
    attr.rq_psn = remote.psn;
    attr.max_dest_rd_atomic = 1;
    attr.min_rnr_timer = 12;
    attr.ah_attr.is_global = 1;
    attr.ah_attr.grh.dgid = remote.gid;
    attr.ah_attr.grh.sgid_index = kGidIndex;
    attr.ah_attr.grh.hop_limit = 1;
    attr.ah_attr.dlid = remote.lid;
    attr.ah_attr.port_num = kPort;
    if (int rc = ibv_modify_qp(qp, &attr,
                               IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                   IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
      return verbs_error("queue pair to RTR", rc);
    attr = {};
    attr.qp_state = IBV_QPS_RTS;
    attr.timeout = 14;
    attr.retry_cnt = 7;
    attr.rnr_retry = 7;
    attr.sq_psn = local.psn;
    attr.max_rd_atomic = 1;
    if (int rc = ibv_modify_qp(qp, &attr,
                               IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                                   IBV_QP_MAX_QP_RD_ATOMIC))
      return verbs_error("queue pair to RTS", rc);
    return Status::ok();
  }

  Status post_receive(ibv_qp* qp) {
    ibv_recv_wr wr{};
    ibv_recv_wr* bad = nullptr;
    wr.wr_id = qp->qp_num;
    wr.num_sge = 0;  // WRITE_WITH_IMM consumes a receive but carries no data into it
    if (int rc = ibv_post_recv(qp, &wr, &bad)) return verbs_error("ibv_post_recv", rc);
    return Status::ok();
  }

  // The receiving side of a queue-pair set-up (runs on a TCP I/O thread).
  Expected<TcpTransport::QpInfo> accept(const std::string& peer, const TcpTransport::QpInfo& raw_remote) {
    MOE_ASSIGN_OR_RETURN(ibv_qp* qp, create_qp());
    const QpInfo local = local_info(qp);
    Status status = connect_qp(qp, local, decode(raw_remote));
    for (uint32_t i = 0; status.is_ok() && i < kRecvDepth; ++i) status = post_receive(qp);
    if (!status.is_ok()) {
      ibv_destroy_qp(qp);
      return status.with_context(fmt::format("accepting queue pair from {}", peer));
    }
    std::lock_guard lock(mutex);
    inbound[qp->qp_num] = qp;
    return encode(local);
  }

  // The sending side: a connected queue pair to `endpoint` (mutex held).
  Expected<Peer*> peer_locked(const std::string& endpoint, std::unique_lock<std::mutex>& lock) {
    auto it = peers.find(endpoint);
    if (it != peers.end() && it->second.failure.is_ok()) return &it->second;
    if (it != peers.end()) {
      ibv_destroy_qp(it->second.qp);
      peers.erase(it);
    }
    lock.unlock();
    auto qp = create_qp();
    Status status = qp.status();
    if (qp) {
      const QpInfo local = local_info(*qp);
      auto remote = control.exchange_qp_info(endpoint, encode(local));
      status = remote ? connect_qp(*qp, local, decode(*remote)) : remote.status();
      if (!status.is_ok()) ibv_destroy_qp(*qp);
    }
    lock.lock();
    if (!status.is_ok()) return status.with_context(fmt::format("ibverbs peer {}", endpoint));
    Peer& peer = peers[endpoint];
    peer.qp = *qp;
    return &peer;
  }

  void poll_loop() {
    ibv_wc wcs[32];
    while (!stopping.load()) {
      const int n = ibv_poll_cq(cq, 32, wcs);
      if (n < 0) {
        log_error("ibverbs: ibv_poll_cq failed");
        return;
      }
      if (n == 0) {
        // Sleep on the completion channel; re-poll after arming to close the race.
        ibv_req_notify_cq(cq, 0);
        if (ibv_poll_cq(cq, 0, wcs) == 0) {
          pollfd p{channel->fd, POLLIN, 0};
          if (poll(&p, 1, 20) > 0) {
            ibv_cq* event_cq = nullptr;
            void* context_ptr = nullptr;
            if (ibv_get_cq_event(channel, &event_cq, &context_ptr) == 0) ibv_ack_cq_events(event_cq, 1);
          }
        }
        continue;
      }
      for (int i = 0; i < n; ++i) handle(wcs[i]);
    }
  }

  void handle(const ibv_wc& wc) {
    if (wc.opcode & IBV_WC_RECV) {
      if (wc.status != IBV_WC_SUCCESS) return;  // flushed at teardown
      wire::FrameHeader header;
      header.type = static_cast<uint16_t>(wire::FrameType::kNotify);
      header.imm = ntohl(wc.imm_data);
      header.batch_num_frames = 1;
      receiver.notify_frame(header, wc.qp_num);
      std::lock_guard lock(mutex);
      if (auto it = inbound.find(wc.qp_num); it != inbound.end()) (void)post_receive(it->second);
      return;
    }
    InFlight done;
    {
      std::lock_guard lock(mutex);
      auto it = in_flight.find(wc.wr_id);
      if (it == in_flight.end()) return;
      done = std::move(it->second);
      in_flight.erase(it);
      auto peer = peers.find(done.peer);
      if (peer != peers.end()) {
        peer->second.num_outstanding -= std::min(peer->second.num_outstanding, done.num_requests);
        if (wc.status != IBV_WC_SUCCESS && peer->second.failure.is_ok())
          peer->second.failure = unavailable("peer {} lost: RDMA write failed: {}", done.peer, ibv_wc_status_str(wc.status));
      }
    }
    cv.notify_all();
    if (wc.status == IBV_WC_SUCCESS) {
      tracker.frame_sent(done.batch);
    } else {
      tracker.finish(done.batch,
                     unavailable("peer {} lost: RDMA write failed: {}", done.peer, ibv_wc_status_str(wc.status)));
    }
  }
};

std::string IbverbsTransport::list_devices() {
  int n = 0;
  ibv_device** devices = ibv_get_device_list(&n);
  std::string names;
  for (int i = 0; devices != nullptr && i < n; ++i) {
    if (!names.empty()) names.push_back(',');
    names.append(ibv_get_device_name(devices[i]));
  }
  if (devices != nullptr) ibv_free_device_list(devices);
  return names;
}

IbverbsTransport::IbverbsTransport(std::unique_ptr<State> state) : state_(std::move(state)) {}

Expected<std::unique_ptr<IbverbsTransport>> IbverbsTransport::create(Receiver& receiver, BatchTracker& tracker,
                                                                     TcpTransport& control) {
  auto state = std::make_unique<State>(receiver, tracker, control);
  int n = 0;
  ibv_device** devices = ibv_get_device_list(&n);
  if (devices == nullptr || n == 0) {
    if (devices != nullptr) ibv_free_device_list(devices);
    return unavailable("no RDMA device (ibv_get_device_list found none)");
  }
  state->context = ibv_open_device(devices[0]);
  const std::string name = ibv_get_device_name(devices[0]);
  ibv_free_device_list(devices);
  if (state->context == nullptr) return verbs_error("ibv_open_device", 0);
  std::unique_ptr<IbverbsTransport> transport(new IbverbsTransport(std::move(state)));  // cleans up from here
  State& s = *transport->state_;
  if (int rc = ibv_query_port(s.context, kPort, &s.port)) return verbs_error("ibv_query_port", rc);
  if (s.port.state != IBV_PORT_ACTIVE) return unavailable("ibverbs: port {} of {} is not active", kPort, name);
  if (int rc = ibv_query_gid(s.context, kPort, kGidIndex, &s.gid)) return verbs_error("ibv_query_gid", rc);
  s.pd = ibv_alloc_pd(s.context);
  if (s.pd == nullptr) return verbs_error("ibv_alloc_pd", 0);
  s.channel = ibv_create_comp_channel(s.context);
  if (s.channel == nullptr) return verbs_error("ibv_create_comp_channel", 0);
  s.cq = ibv_create_cq(s.context, kCqDepth, nullptr, s.channel, 0);
  if (s.cq == nullptr) return verbs_error("ibv_create_cq", 0);
  control.set_qp_acceptor([&s](const std::string& peer, const TcpTransport::QpInfo& remote) { return s.accept(peer, remote); });
  s.poller = std::thread([&s] { s.poll_loop(); });
  log_info("transfer: ibverbs transport on {} port {}", name, kPort);
  return transport;
}

IbverbsTransport::~IbverbsTransport() { shutdown(); }

void IbverbsTransport::shutdown() {
  State& s = *state_;
  if (s.stopping.exchange(true) && !s.poller.joinable() && s.context == nullptr) return;
  s.control.set_qp_acceptor(nullptr);
  if (s.poller.joinable()) s.poller.join();
  std::lock_guard lock(s.mutex);
  for (auto& [name, peer] : s.peers) ibv_destroy_qp(peer.qp);
  for (auto& [qpn, qp] : s.inbound) ibv_destroy_qp(qp);
  for (auto& [id, mr] : s.mrs) ibv_dereg_mr(mr);
  s.peers.clear();
  s.inbound.clear();
  s.mrs.clear();
  if (s.cq != nullptr) ibv_destroy_cq(s.cq);
  if (s.channel != nullptr) ibv_destroy_comp_channel(s.channel);
  if (s.pd != nullptr) ibv_dealloc_pd(s.pd);
  if (s.context != nullptr) ibv_close_device(s.context);
  s.cq = nullptr;
  s.channel = nullptr;
  s.pd = nullptr;
  s.context = nullptr;
}

Status IbverbsTransport::export_region(const LocalRegion& region, RegionDescriptor& descriptor) {
  if (region.memory != MemoryKind::kHost)
    return unimplemented("the ibverbs transport takes host memory only (GPU memory via dma-buf is not done)");
  ibv_mr* mr = ibv_reg_mr(state_->pd, region.base, region.length_bytes, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  if (mr == nullptr) return verbs_error("ibv_reg_mr", 0);
  descriptor.export_data = std::to_string(mr->rkey);
  std::lock_guard lock(state_->mutex);
  state_->mrs[region.id] = mr;
  return Status::ok();
}

void IbverbsTransport::forget_region(RegionId id) {
  std::lock_guard lock(state_->mutex);
  if (auto it = state_->mrs.find(id); it != state_->mrs.end()) {
    ibv_dereg_mr(it->second);
    state_->mrs.erase(it);
  }
}

Status IbverbsTransport::submit(OutBatch batch) {
  State& s = *state_;
  const std::string& endpoint = batch.dsts.front().endpoint;
  std::vector<uint32_t> rkeys;
  for (const RegionDescriptor& dst : batch.dsts) {
    uint32_t rkey = 0;
    const auto& text = dst.export_data;
    auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), rkey);
    if (error != std::errc() || end != text.data() + text.size())
      return invalid_argument("ibverbs: region {} of {} has no rkey", dst.region_id, endpoint);
    rkeys.push_back(rkey);
  }
  std::unique_lock lock(s.mutex);
  MOE_ASSIGN_OR_RETURN(State::Peer * peer, s.peer_locked(endpoint, lock));
  // Every source byte must lie in one registered memory region (its lkey).
  std::vector<uint32_t> lkeys;
  for (const OutFrame& frame : batch.frames) {
    const ibv_mr* found = nullptr;
    for (auto& [id, mr] : s.mrs) {
      const auto* base = static_cast<const uint8_t*>(mr->addr);
      if (frame.src >= base && frame.src + frame.length_bytes <= base + mr->length) found = mr;
    }
    if (found == nullptr) return invalid_argument("ibverbs: a source run is not in a region registered for ibverbs");
    lkeys.push_back(found->lkey);
  }
  const uint32_t num_requests = std::max<uint32_t>(1, static_cast<uint32_t>(batch.frames.size()));
  if (peer->num_outstanding + num_requests > kSendDepth)
    return resource_exhausted("ibverbs: batch of {} runs does not fit the send queue ({} of {} in use)", num_requests,
                              peer->num_outstanding, kSendDepth);
  std::vector<ibv_send_wr> wrs(num_requests);
  std::vector<ibv_sge> sges(num_requests);
  for (uint32_t i = 0; i < num_requests; ++i) {
    ibv_send_wr& wr = wrs[i];
    wr = {};
    if (!batch.frames.empty()) {
      const OutFrame& frame = batch.frames[i];
      sges[i] = ibv_sge{reinterpret_cast<uint64_t>(frame.src), static_cast<uint32_t>(frame.length_bytes), lkeys[i]};
      wr.sg_list = &sges[i];
      wr.num_sge = 1;
      wr.wr.rdma.remote_addr = batch.dsts[frame.dst_index].base_address + frame.dst_offset;
      wr.wr.rdma.rkey = rkeys[frame.dst_index];
    } else {
      wr.wr.rdma.remote_addr = batch.dsts.front().base_address;
      wr.wr.rdma.rkey = rkeys.front();
    }
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.next = i + 1 < num_requests ? &wrs[i + 1] : nullptr;
  }
  ibv_send_wr& last = wrs.back();
  last.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
  last.imm_data = htonl(batch.state->imm);
  last.send_flags = IBV_SEND_SIGNALED;
  last.wr_id = batch.state->id;
  for (const OutFrame& frame : batch.frames) {
    if (frame.length_bytes > UINT32_MAX) return out_of_range("ibverbs: a run of {} bytes is too long", frame.length_bytes);
  }
  s.in_flight[batch.state->id] = State::InFlight{batch.state, endpoint, num_requests};
  peer->num_outstanding += num_requests;
  ibv_send_wr* bad = nullptr;
  if (int rc = ibv_post_send(peer->qp, wrs.data(), &bad)) {
    s.in_flight.erase(batch.state->id);
    peer->num_outstanding -= num_requests;
    return verbs_error("ibv_post_send", rc);
  }
  return Status::ok();
}

void IbverbsTransport::cancel(const std::vector<std::shared_ptr<BatchState>>& batches) {
  // Posted writes cannot be recalled: wait for their completions.
  std::unique_lock lock(state_->mutex);
  state_->cv.wait(lock, [&] {
    return std::none_of(batches.begin(), batches.end(),
                        [&](const auto& batch) { return state_->in_flight.count(batch->id) > 0; });
  });
}

}  // namespace moe::transfer
