// The NVLS safety rule (DESIGN section 3): the NVLink SHARP multicast path
// (multimem.ld_reduce / multimem.st over cuMulticastCreate objects) is off by
// default, taken only when asked for (--all-reduce nvls), and refused outright
// when the host says multicast must not be used: on shared GPU hosts that
// disable it, creating a multicast object can take the host's GPUs down.
//
// Pure functions of the environment: any thread may call them.
#pragma once

#include <string_view>

#include "core/status.h"

namespace moe::comm {

// OK when no environment variable forbids multicast; otherwise an error naming
// the variable. Checked before any CUDA driver call of the NVLS setup.
// Forbidding settings: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
// NVSHMEM_DISABLE_NVLS=1 (also "true"/"yes"/"on" for the last two,
// "false"/"no"/"off" for the first).
Status check_nvls_allowed();

// What the NVLS setup checks first, before any driver call: the user asked
// for it (`requested`, i.e. --all-reduce nvls), and check_nvls_allowed().
Status nvls_preflight(bool requested);

// --all-reduce: auto (one-shot below the crossover, two-shot above), oneshot,
// twoshot, nvls (never by default), nccl.
enum class AllReduceAlgorithm { kAuto, kOneShot, kTwoShot, kNvls, kNccl };
Expected<AllReduceAlgorithm> parse_all_reduce_algorithm(std::string_view name);

}  // namespace moe::comm
