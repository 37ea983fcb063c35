// libFuzzer target for the safetensors header parser.
//
// Contract checked: SafetensorsFile::parse returns a Status on any bytes and
// never crashes, throws or reads outside its input; on success every tensor's
// view lies inside the data buffer and holds the input's bytes at
// 8 + header_length + begin (an independent oracle read from the input buffer,
// which ASan bounds exactly), and lookups by name agree with tensors().
//
// Each input is parsed twice: as is, and reframed with a correct length
// prefix (the header is the input up to its last '}', the rest is data), so
// that mutations of the JSON are not all lost to a stale header length.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "core/check.h"
#include "model/safetensors.h"

namespace {

void check_parse(std::span<const uint8_t> input) {
  moe::Expected<moe::model::SafetensorsFile> file = moe::model::SafetensorsFile::parse(input, "fuzz.safetensors");
  if (!file) {
    CHECK(!file.status().message().empty());
    return;
  }
  uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | input[i];
  const uint64_t data_start = 8 + header_size;
  CHECK_EQ(data_start + file->data_size(), input.size());

  for (const moe::model::TensorInfo& info : file->tensors()) {
    CHECK(file->find(info.name) == &info, "find('{}')", info.name);
    const moe::TensorView view = file->view(info);
    const size_t num_bytes = view.num_bytes();
    CHECK_EQ(num_bytes, info.end - info.begin);
    CHECK_LE(info.end, file->data_size());
    if (num_bytes == 0) continue;
    const auto* bytes = static_cast<const uint8_t*>(view.data());
    CHECK_EQ(bytes[0], input[data_start + info.begin]);
    CHECK_EQ(bytes[num_bytes - 1], input[data_start + info.end - 1]);
  }
  for (const auto& [key, value] : file->metadata()) CHECK(key.size() + value.size() < input.size());
  CHECK(file->view("\xff not a tensor name").status().code() == moe::StatusCode::kNotFound);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  check_parse(std::span<const uint8_t>(data, size));

  size_t header_size = size;
  while (header_size > 0 && data[header_size - 1] != '}') --header_size;
  std::vector<uint8_t> framed(8 + size);
  for (int i = 0; i < 8; ++i) framed[i] = static_cast<uint8_t>(static_cast<uint64_t>(header_size) >> (8 * i));
  if (size > 0) std::memcpy(framed.data() + 8, data, size);
  check_parse(framed);
  return 0;
}
