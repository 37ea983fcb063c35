// Safetensors checkpoints: a validating mmap reader, a sharded-checkpoint view
// over a Hugging Face model directory, and writers.
//
// File format (https://huggingface.co/docs/safetensors): an 8-byte little-endian
// u64 header length N, N bytes of JSON header (UTF-8, possibly padded with
// trailing spaces), then the data buffer. The header maps each tensor name to
// {"dtype", "shape", "data_offsets": [begin, end]} (offsets into the data buffer)
// and may hold a "__metadata__" object of string -> string.
//
// Every input is untrusted: a file that fails validation gives a Status whose
// message names the file and, where there is one, the tensor. Codes:
//   kDataLoss         the file is truncated or its framing is corrupt: shorter
//                     than 8 bytes, header length past the file or over 100 MB,
//                     a tensor's bytes past the end of the data buffer;
//   kInvalidArgument  the header is malformed: not JSON, not an object, a
//                     missing or mistyped field, an unknown dtype, bad dims,
//                     begin > end, a byte length that does not match dtype and
//                     shape, overlapping tensors, duplicate keys, JSON nested
//                     deeper than 32 levels (headers nest 3), bad metadata;
//   kNotFound         a missing file or tensor.
// Gaps between tensors are allowed (the safetensors library rejects them);
// overlaps are not. Zero-byte tensors overlap nothing.
// Duplicate keys in any JSON object of the header are rejected: JSON parsers
// disagree on which one wins, so a file with them is ambiguous.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"
#include "core/tensor.h"

namespace moe::model {

// One tensor's header entry. [begin, end) are byte offsets into the data buffer.
struct TensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  uint64_t begin = 0;
  uint64_t end = 0;
  uint64_t num_bytes() const { return end - begin; }
};

// A parsed and validated safetensors file whose bytes stay in memory: mapped
// read-only (open) or copied (parse). Views point into those bytes and stay
// valid, also across moves, until the file object is destroyed. The data of a
// view is read-only: writing through it faults for a mapped file.
//
// Alignment is the file's: the data buffer starts 8-byte aligned when the
// header is padded as the format asks (files we and the safetensors library
// write), and a view is aligned as far as its offset in the buffer is. Nothing
// is realigned here; a consumer that needs alignment checks view.data().
//
// Immutable after construction: any thread may call the const methods
// concurrently. Movable, not copyable.
class SafetensorsFile {
 public:
  // Maps `path` (MAP_PRIVATE, PROT_READ; the fd is closed once mapped) and
  // validates the header. Truncating the file while it is mapped is undefined
  // (SIGBUS on access), as for any mmap reader.
  static Expected<SafetensorsFile> open(const std::string& path);
  // Validates in-memory bytes; keeps its own 64-byte-aligned copy of them, so
  // `bytes` may be freed afterwards. `name` stands for the path in messages.
  static Expected<SafetensorsFile> parse(std::span<const uint8_t> bytes, std::string name);

  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  // Tensors in the order of their bytes in the data buffer (begin offset, ties
  // broken by name), which is deterministic whatever order the header uses.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  // Their names, in the same order.
  std::vector<std::string> tensor_names() const;
  size_t num_tensors() const { return tensors_.size(); }
  // nullptr when there is no tensor of that name.
  const TensorInfo* find(std::string_view name) const;
  // A CPU view of the tensor's bytes; kNotFound naming file and tensor.
  Expected<TensorView> view(std::string_view name) const;
  TensorView view(const TensorInfo& info) const;
  // The "__metadata__" object (empty when absent).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Bytes of the data buffer (the file minus the 8-byte length and the header).
  uint64_t data_size() const { return data_size_; }

 private:
  SafetensorsFile() = default;
  Status parse_and_validate();
  void release();

  std::string path_;
  const uint8_t* bytes_ = nullptr;  // the whole file
  uint64_t size_ = 0;
  void* mapping_ = nullptr;  // non-null when bytes_ is an mmap we must unmap
  HostBuffer owned_;         // set when parse() copied the bytes
  const uint8_t* data_ = nullptr;  // start of the data buffer
  uint64_t data_size_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> index_;  // name -> position in tensors_
  std::map<std::string, std::string> metadata_;
};

// A Hugging Face model directory's weights: DIR/model.safetensors, or else the
// shards named by DIR/model.safetensors.index.json ({"metadata": {...},
// "weight_map": {tensor: shard file}}). The single file wins when both exist,
// as in transformers.
//
// Opening checks that the index and the shards agree: every shard file exists
// (kNotFound) and parses; shard names are plain file names inside DIR (no '/',
// '\\' or "..": kInvalidArgument); every weight_map tensor is in the shard the
// map names (kNotFound, the message says where it is if elsewhere); no tensor
// is in two shards, and none is in a shard without a weight_map entry
// (kDataLoss). A directory with neither file is kNotFound naming it.
//
// Immutable after open: any thread may call the const methods concurrently.
// Movable, not copyable.
class SafetensorsCheckpoint {
 public:
  static Expected<SafetensorsCheckpoint> open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  // Shards in file-name order (one for a single-file checkpoint).
  const std::vector<SafetensorsFile>& shards() const { return shards_; }
  // Every tensor name, sorted; for reporting tensors a loader left unused.
  std::vector<std::string> tensor_names() const;
  size_t num_tensors() const { return locations_.size(); }
  const TensorInfo* find(std::string_view name) const;
  // The shard holding `name`, or nullptr.
  const SafetensorsFile* shard_of(std::string_view name) const;
  // kNotFound naming the directory and the tensor.
  Expected<TensorView> view(std::string_view name) const;

 private:
  SafetensorsCheckpoint() = default;
  Status index_tensors();
  Status check_weight_map(const std::map<std::string, std::string>& weight_map,
                          const std::string& index_path) const;

  std::string dir_;
  std::vector<SafetensorsFile> shards_;
  std::map<std::string, size_t, std::less<>> locations_;  // tensor -> shard position
};

// Writes one safetensors file: header entries in the order given, data packed
// contiguously in that order, the header padded with spaces so that the data
// buffer starts 8-byte aligned. Writes `path`.tmp, then renames it over `path`,
// so a reader never sees a half-written file. Views must be CPU views; names
// must be unique, valid UTF-8 and not "__metadata__" (kInvalidArgument).
// I/O failures name the path. Any thread may call it (distinct paths).
Status write_safetensors(const std::string& path,
                         const std::vector<std::pair<std::string, TensorView>>& tensors,
                         const std::map<std::string, std::string>& metadata = {});

// Writes DIR/model-0000X-of-0000N.safetensors and DIR/model.safetensors.index.json
// (creating DIR). Tensors go to shards in the order given; a shard is closed
// before a tensor that would take it past `max_shard_bytes` (a larger tensor
// gets a shard of its own). Always writes the sharded form with an index, also
// for one shard. Each shard carries `metadata`; the index carries
// {"total_size": bytes}. Shard files from an earlier write with another N are
// not removed. Any thread may call it (distinct directories).
Status write_sharded_safetensors(const std::string& dir,
                                 const std::vector<std::pair<std::string, TensorView>>& tensors,
                                 uint64_t max_shard_bytes,
                                 const std::map<std::string, std::string>& metadata = {});

}  // namespace moe::model
