// Bootstrap of an instance's ranks (DESIGN section 3): who am I (rank, world
// size, local rank) and a TCP rendezvous through rank 0 that lets every rank
// send every other rank a small blob: the names of shared-memory segments,
// CUDA memory handles, the NCCL unique id.
//
// Where rank and world come from, first match wins:
//   1. mpirun: OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK / _LOCAL_SIZE (Open MPI),
//      PMI_RANK / PMI_SIZE (+ MPI_LOCALRANKID) (MPICH, Intel MPI);
//   2. torchrun-style variables: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE;
//   3. flags: --nnodes, --node-rank and the processes per node with this
//      process's local rank (rank = node_rank * nproc_per_node + local_rank).
// The rendezvous address: --master-addr / --master-port, else MASTER_ADDR /
// MASTER_PORT, else 127.0.0.1:29500.
//
// The wire: fixed binary headers and length-prefixed byte blobs, each capped
// (kMaxBlobBytes); nothing is deserialised beyond that. Every wait has a
// deadline; a peer that closes or stays silent is a Status naming its rank.
//
// Threads: resolve_launch is a pure function of its inputs. A TcpBootstrap is
// used by one thread at a time (its rank's setup thread).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/status.h"

namespace moe::comm {

// Launch flags as parsed by the CLI; -1 / empty: not given.
struct LaunchFlags {
  std::string master_addr;
  int master_port = -1;
  int nnodes = -1, node_rank = -1;
  int nproc_per_node = -1, local_rank = -1;
};

struct LaunchConfig {
  int rank = 0, world_size = 1;
  int local_rank = 0, local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string source;  // "mpi (Open MPI)", "torchrun env", "flags", "single process"
};

// Looks up an environment variable; the default reads the process's.
using EnvLookup = std::function<std::optional<std::string>(const char*)>;
std::optional<std::string> process_env(const char* name);

Expected<LaunchConfig> resolve_launch(const LaunchFlags& flags, const EnvLookup& env = process_env);

inline constexpr uint64_t kMaxBlobBytes = 64ull << 20;

// Rank 0's listening socket, bound before anyone connects (port 0 picks a
// free port, which port() then tells; for tests).
class BootstrapListener {
 public:
  static Expected<BootstrapListener> bind(const std::string& addr, int port);
  BootstrapListener(BootstrapListener&& other) noexcept;
  BootstrapListener& operator=(BootstrapListener&& other) noexcept;
  ~BootstrapListener();
  int port() const { return port_; }

 private:
  friend class TcpBootstrap;
  BootstrapListener() = default;
  int fd_ = -1;
  int port_ = 0;
};

// A star of TCP connections through rank 0, kept open for the collectives
// below. Every rank calls the same collectives in the same order.
class TcpBootstrap {
 public:
  // Rank 0: accepts world_size - 1 peers on `listener`.
  static Expected<std::unique_ptr<TcpBootstrap>> accept(BootstrapListener listener, int world_size, int timeout_ms);
  // Ranks 1..N-1: connects to rank 0 (retrying until it listens).
  static Expected<std::unique_ptr<TcpBootstrap>> connect(const std::string& addr, int port, int rank, int world_size,
                                                        int timeout_ms);
  // Either of the above, from a resolved launch.
  static Expected<std::unique_ptr<TcpBootstrap>> open(const LaunchConfig& launch, int timeout_ms);
  ~TcpBootstrap();
  TcpBootstrap(const TcpBootstrap&) = delete;
  TcpBootstrap& operator=(const TcpBootstrap&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }

  // result[r] = rank r's blob, on every rank.
  Expected<std::vector<std::vector<uint8_t>>> all_gather(std::span<const uint8_t> blob);
  // Rank 0's blob on every rank (`blob` is ignored elsewhere).
  Expected<std::vector<uint8_t>> broadcast_from_root(std::span<const uint8_t> blob);
  Status barrier();
  // A name every rank agrees on, unique to this group (rank 0 draws it):
  // "<prefix><random hex>". For shared-memory segments.
  Expected<std::string> agree_on_name(const std::string& prefix);

 private:
  TcpBootstrap(int rank, int world_size, int timeout_ms) : rank_(rank), world_size_(world_size), timeout_ms_(timeout_ms) {}
  int64_t deadline_ns() const;

  int rank_, world_size_, timeout_ms_;
  std::vector<int> peer_fds_;  // rank 0: [world_size], fd of rank r (-1 for itself); others: [1], rank 0's
};

}  // namespace moe::comm
