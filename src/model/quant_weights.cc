#include "model/quant_weights.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "ops/linear.h"

namespace moe::model {

using ops::QuantFormat;
using ops::QuantizedTensor;

QuantTensorNames quant_tensor_names(QuantFormat format, const std::string& weight_name) {
  constexpr std::string_view kSuffix = ".weight";
  CHECK(weight_name.size() > kSuffix.size() && weight_name.ends_with(kSuffix), "'{}' is not a weight name",
        weight_name);
  const std::string base = weight_name.substr(0, weight_name.size() - kSuffix.size());
  QuantTensorNames names;
  names.values = weight_name;
  names.scales = base + (format == QuantFormat::kFp8Block ? ".weight_scale_inv" : ".weight_scale");
  if (ops::quant_format_spec(format).has_global_scale) names.global_scale = base + ".weight_scale_2";
  return names;
}

StoredTensorSpec stored_values_spec(QuantFormat format, int64_t rows, int64_t cols) {
  if (ops::quant_format_spec(format).element == DType::kF4E2M1) return {DType::kU8, Shape{rows, cols / 2}};
  return {DType::kF8E4M3, Shape{rows, cols}};
}

StoredTensorSpec stored_scales_spec(QuantFormat format, int64_t rows, int64_t cols) {
  return {ops::quant_format_spec(format).scale, ops::quant_scale_shape(format, rows, cols)};
}

QuantizedTensor OwnedQuantized::view() const {
  QuantizedTensor q;
  q.format = format;
  q.values = values.view();
  q.scales = scales.view();
  q.global_scale = global_scale.view();
  q.scale_row_period = scale_row_period;
  return q;
}

OwnedQuantized allocate_quantized(QuantFormat format, int64_t num_groups, int64_t rows, int64_t cols,
                                  int64_t row_period) {
  const ops::QuantFormatSpec& spec = ops::quant_format_spec(format);
  const Shape scale_shape = ops::quant_scale_shape(format, rows, cols, row_period);
  OwnedQuantized out;
  out.format = format;
  out.scale_row_period = format == QuantFormat::kFp8Block ? row_period : 0;
  if (num_groups == 0) {
    out.values = Tensor(spec.element, {rows, cols});
    out.scales = Tensor(spec.scale, scale_shape);
  } else {
    out.values = Tensor(spec.element, {num_groups, rows, cols});
    out.scales = Tensor(spec.scale, {num_groups, scale_shape[0], scale_shape[1]});
  }
  if (spec.has_global_scale) {
    out.global_scale = Tensor(DType::kF32, {std::max<int64_t>(num_groups, 1)});
    std::fill_n(out.global_scale.data_as<float>(), out.global_scale.num_elements(), 1.0f);
  }
  ops::check_quantized(out.view());
  return out;
}

float tensor_max_abs(ThreadPool& pool, TensorView src) {
  constexpr int64_t kChunk = int64_t{1} << 16;
  const int64_t n = src.num_elements(), num_chunks = (n + kChunk - 1) / kChunk;
  std::vector<float> chunk_max(static_cast<size_t>(num_chunks));
  pool.parallel_for(0, num_chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> values(static_cast<size_t>(kChunk));
    for (int64_t c = begin; c < end; ++c) {
      const int64_t first = c * kChunk, count = std::min(kChunk, n - first);
      ops::cpu::to_f32(src.dtype(), static_cast<const char*>(src.data()) + dtype_bytes(src.dtype(), first),
                       values.data(), count);
      chunk_max[c] = ops::max_abs(values.data(), count);
    }
  });
  return ops::max_abs(chunk_max.data(), num_chunks);
}

Expected<OwnedQuantized> quantize_tensor(ThreadPool& pool, QuantFormat format, TensorView src, float global_amax) {
  if (src.rank() != 2) return invalid_argument("cannot quantize a rank-{} tensor", src.rank());
  const int64_t rows = src.dim(0), cols = src.dim(1);
  MOE_RETURN_IF_ERROR(ops::check_quantizable(format, rows, cols));
  OwnedQuantized out = allocate_quantized(format, 0, rows, cols);
  if (ops::quant_format_spec(format).has_global_scale) {
    const float amax = global_amax > 0.0f ? global_amax : tensor_max_abs(pool, src);
    out.global_scale.data_as<float>()[0] = ops::nvfp4_global_scale(amax);
  }
  // A task converts 128 rows (one fp8-block scale block row) to f32 and
  // quantizes them: the tasks write disjoint values and scales.
  constexpr int64_t kTaskRows = 128;
  const ops::QuantizedTensor to = out.view();
  pool.parallel_for(0, (rows + kTaskRows - 1) / kTaskRows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> f32(static_cast<size_t>(kTaskRows * cols));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t first = task * kTaskRows, count = std::min(kTaskRows, rows - first);
      ops::cpu::to_f32(src.dtype(), static_cast<const char*>(src.data()) + dtype_bytes(src.dtype(), first * cols),
                       f32.data(), count * cols);
      ops::quantize_rows(f32.data(), first, count, to);
    }
  });
  return out;
}

Expected<QuantizedTensor> read_quantized(TensorFetcher& fetch, QuantFormat format, const std::string& weight_name,
                                         int64_t rows, int64_t cols) {
  if (auto status = ops::check_quantizable(format, rows, cols); !status.is_ok())
    return status.with_context(weight_name);
  const ops::QuantFormatSpec& spec = ops::quant_format_spec(format);
  const QuantTensorNames names = quant_tensor_names(format, weight_name);
  const StoredTensorSpec values_spec = stored_values_spec(format, rows, cols);
  const StoredTensorSpec scales_spec = stored_scales_spec(format, rows, cols);
  MOE_ASSIGN_OR_RETURN(TensorView values, fetch.get_exact(names.values, values_spec.dtype, values_spec.dtype,
                                                          values_spec.shape));
  const DType alt_scale = spec.scale == DType::kE8M0 ? DType::kU8 : spec.scale;
  MOE_ASSIGN_OR_RETURN(TensorView scales, fetch.get_exact(names.scales, spec.scale, alt_scale, scales_spec.shape));
  QuantizedTensor q;
  q.format = format;
  q.values = TensorView(values.data(), spec.element, {rows, cols});
  q.scales = TensorView(scales.data(), spec.scale, scales_spec.shape);
  if (spec.has_global_scale) {
    // ModelOpt writes a 0-dim tensor; a [1] one is accepted too.
    auto global = fetch.get_exact(names.global_scale, DType::kF32, DType::kF32, Shape{});
    if (!global && fetch.has(names.global_scale)) {
      auto as_vector = fetch.get_exact(names.global_scale, DType::kF32, DType::kF32, Shape{1});
      if (as_vector) global = as_vector;
    }
    if (!global) return global.status();
    q.global_scale = TensorView(global->data(), DType::kF32, {1});
  }
  return q;
}

Status copy_quantized_rows(const QuantizedTensor& src, const OwnedQuantized& dst, int64_t group, int64_t row_offset,
                           const std::string& what) {
  const QuantizedTensor to = group < 0 ? dst.view() : dst.view().slice0(group);
  CHECK(src.format == to.format && src.cols() == to.cols() && row_offset + src.rows() <= to.rows(),
        "copy_quantized_rows: {} rows at {} into {}", src.rows(), row_offset, to.values.shape().to_string());
  const int64_t cols = to.cols();
  const DType element = to.values.dtype();
  std::memcpy(static_cast<char*>(to.values.data()) + dtype_bytes(element, row_offset * cols), src.values.data(),
              dtype_bytes(element, src.rows() * cols));
  const int64_t scale_cols = to.scales.dim(1);
  int64_t scale_row = row_offset;
  if (to.format == QuantFormat::kFp8Block) {
    const int64_t period = to.scale_row_period > 0 ? to.scale_row_period : to.rows();
    CHECK(row_offset % period == 0 && src.rows() % period == 0, "rows {} at {} vs period {}", src.rows(), row_offset,
          period);
    scale_row = (row_offset / period) * ((period + 127) / 128);
  }
  const size_t scale_bytes = dtype_bytes(to.scales.dtype(), 1);
  std::memcpy(static_cast<char*>(to.scales.data()) + static_cast<size_t>(scale_row * scale_cols) * scale_bytes,
              src.scales.data(), src.scales.num_bytes());
  if (!to.global_scale.empty()) {
    float global;
    std::memcpy(&global, src.global_scale.data(), sizeof global);
    float* slot = to.global_scale.data_as<float>();
    if (row_offset == 0) {
      *slot = global;
    } else if (*slot != global) {
      return invalid_argument("{}: the fused parts have different global scales ({} and {}); requantize them with "
                              "one shared weight_scale_2 (moeserve quantize does)",
                              what, *slot, global);
    }
  }
  return Status::ok();
}

void fill_random_quantized(OwnedQuantized& dst, float scale, uint64_t seed, uint64_t stream, ThreadPool& pool) {
  const QuantizedTensor all = dst.view();
  const bool stacked = all.rank() == 3;
  const int64_t num_groups = stacked ? all.values.dim(0) : 1, rows = all.rows(), cols = all.cols();
  pool.parallel_for(0, num_groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> matrix(static_cast<size_t>(rows * cols));
    for (int64_t g = begin; g < end; ++g) {
      uint64_t state = seed * 0x9E3779B97F4A7C15ull ^ (stream << 40) ^ static_cast<uint64_t>(g) << 20;
      for (float& v : matrix) {  // splitmix64
        uint64_t z = (state += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        v = scale * (static_cast<float>(z >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f);
      }
      const QuantizedTensor to = stacked ? all.slice0(g) : all;
      if (!to.global_scale.empty())
        to.global_scale.data_as<float>()[0] = ops::nvfp4_global_scale(ops::max_abs(matrix.data(), rows * cols));
      ops::quantize_matrix(matrix.data(), to);
    }
  });
}

}  // namespace moe::model
