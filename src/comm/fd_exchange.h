// Passing file descriptors between the ranks of one host (SCM_RIGHTS over
// Unix-domain sockets in the abstract namespace, so nothing is left on disk).
// Used to share cuMemCreate allocations exported as POSIX file descriptors
// (comm/cuda/symmetric_memory.h); plain CPU code, tested with memfds.
//
// Only peers of the same user are accepted (SO_PEERCRED), and each claims a
// distinct rank of the group.
//
// Threads: a pure function; each rank calls it from its own thread or process.
#pragma once

#include <string>
#include <vector>

#include "core/status.h"

namespace moe::comm {

// Every rank of `group` (a name unique to the group, e.g. from
// TcpBootstrap::agree_on_name) passes its `fd`; returns fds[r] = a new
// descriptor for rank r's object (fds[rank] = -1). The caller owns and closes
// them. Fails within timeout_ms, naming the ranks that did not take part.
Expected<std::vector<int>> exchange_fds(const std::string& group, int rank, int world_size, int fd, int timeout_ms);

}  // namespace moe::comm
