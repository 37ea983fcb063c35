// Device bandwidth probes for gpu_bench (l2_bench.cu).
#pragma once

namespace moe {

// GB/s of 16-byte loads served by L2 (a 24 MB buffer read by every SM).
double l2_read_bandwidth_gbs();

}  // namespace moe
