// `moeserve quantize`: offline conversion of a bf16/f32 checkpoint into
// fp8-block, mxfp8, nvfp4 or mxfp4 (model/quantize_checkpoint.h,
// docs/quantization.md).
#pragma once

#include <CLI/CLI.hpp>

namespace moe::apps {
void add_quantize_command(CLI::App& app);
}  // namespace moe::apps
