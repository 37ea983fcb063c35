#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <new>
#include <set>
#include <system_error>

#include <nlohmann/json.hpp>

namespace moe::model {
namespace {

using nlohmann::json;

// A header this large is corruption, not a checkpoint (real ones are < 10 MB).
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;
// Same bound for model.safetensors.index.json.
constexpr uint64_t kMaxIndexBytes = 100ull << 20;
// Bound on elements so that dtype_bytes (elements * bits) cannot overflow.
constexpr int64_t kMaxElements = std::numeric_limits<int64_t>::max() / 64;
constexpr const char* kSingleFileName = "model.safetensors";
constexpr const char* kIndexFileName = "model.safetensors.index.json";

std::string errno_message(int error) { return std::error_code(error, std::generic_category()).message(); }

Status status_from_errno(int error, const std::string& what) {
  if (error == ENOENT || error == ENOTDIR) return not_found("{}: {}", what, errno_message(error));
  if (error == EIO) return data_loss("{}: {}", what, errno_message(error));
  return invalid_argument("{}: {}", what, errno_message(error));
}

// Printable ASCII only, at most `max_chars`: safe to put any input in a message.
std::string sanitized(std::string_view text, size_t max_chars = 160) {
  std::string out;
  for (char c : text.substr(0, max_chars)) out += (c >= 0x20 && c < 0x7f) ? c : '?';
  if (text.size() > max_chars) out += "...";
  return out;
}

// A JSON value for an error message: compact, cut short at a UTF-8 boundary.
std::string brief(const json& value) {
  std::string text = value.dump(-1, ' ', false, json::error_handler_t::replace);
  constexpr size_t kMax = 64;
  if (text.size() <= kMax) return text;
  size_t n = kMax;
  while (n > 0 && (static_cast<uint8_t>(text[n]) & 0xc0) == 0x80) --n;
  return text.substr(0, n) + "...";
}

// First pass over JSON text: finds syntax errors (with their byte position),
// duplicate keys in any object, which the DOM parser would silently merge, and
// nesting deeper than any checkpoint needs (headers and indexes nest 3 deep),
// which would let a small file allocate gigabytes of DOM.
class JsonChecker : public nlohmann::json_sax<json> {
 public:
  static constexpr int kMaxDepth = 32;
  std::string error;

  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override {
    keys_.emplace_back();
    return enter();
  }
  bool key(string_t& key) override {
    if (keys_.empty() || keys_.back().insert(key).second) return true;
    error = "duplicate key \"" + sanitized(key) + "\"";
    return false;
  }
  bool end_object() override {
    if (!keys_.empty()) keys_.pop_back();
    --depth_;
    return true;
  }
  bool start_array(std::size_t) override { return enter(); }
  bool end_array() override {
    --depth_;
    return true;
  }
  bool parse_error(std::size_t position, const std::string&, const nlohmann::detail::exception& ex) override {
    // ex.what() quotes the offending input; keep only the part before it.
    std::string_view what = ex.what();
    what = what.substr(0, what.find("; last read"));
    if (const size_t tag_end = what.find("] "); tag_end != std::string_view::npos) what.remove_prefix(tag_end + 2);
    error = "not valid JSON at byte " + std::to_string(position) + " (" + sanitized(what) + ")";
    return false;
  }

 private:
  bool enter() {
    if (++depth_ <= kMaxDepth) return true;
    error = "JSON nested deeper than " + std::to_string(kMaxDepth) + " levels";
    return false;
  }

  int depth_ = 0;
  std::vector<std::set<std::string>> keys_;  // one per open object
};

// Parses untrusted JSON text that must be an object. Never throws.
Expected<json> parse_json_object(std::string_view text, const std::string& what) {
  // nlohmann's lexer takes a NUL byte for the end of input; JSON has no raw NULs.
  if (const size_t nul = text.find('\0'); nul != std::string_view::npos) {
    return invalid_argument("{}: not valid JSON (a NUL byte at byte {})", what, nul);
  }
  try {
    JsonChecker checker;
    if (!json::sax_parse(text.begin(), text.end(), &checker)) {
      return invalid_argument("{}: {}", what, checker.error.empty() ? "not valid JSON" : checker.error);
    }
    json value = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
    if (value.is_discarded()) return invalid_argument("{}: not valid JSON", what);
    if (!value.is_object()) return invalid_argument("{}: must be a JSON object, got {}", what, brief(value));
    return value;
  } catch (const std::bad_alloc&) {
    return resource_exhausted("{}: out of memory parsing JSON", what);
  } catch (const std::exception& e) {
    return invalid_argument("{}: {}", what, sanitized(e.what()));
  }
}

Expected<Shape> parse_shape(const json& shape, const std::string& where) {
  if (!shape.is_array()) return invalid_argument("{}: 'shape' must be a list of integers, got {}", where, brief(shape));
  if (shape.size() > static_cast<size_t>(Shape::kMaxDims)) {
    return invalid_argument("{}: shape {} has {} dims, more than the {} supported", where, brief(shape), shape.size(),
                            Shape::kMaxDims);
  }
  std::array<int64_t, Shape::kMaxDims> dims{};
  int64_t num_elements = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    const json& value = shape[i];
    if (!value.is_number_integer()) {
      return invalid_argument("{}: shape {} has a dim that is not an integer", where, brief(shape));
    }
    if (!value.is_number_unsigned() && value.get<int64_t>() < 0) {
      return invalid_argument("{}: shape {} has a negative dim", where, brief(shape));
    }
    const uint64_t dim = value.get<uint64_t>();
    if (dim > static_cast<uint64_t>(kMaxElements) ||
        __builtin_mul_overflow(num_elements, static_cast<int64_t>(dim), &num_elements) ||
        num_elements > kMaxElements) {
      return invalid_argument("{}: shape {} has too many elements (overflow)", where, brief(shape));
    }
    dims[i] = static_cast<int64_t>(dim);
  }
  return Shape(std::span<const int64_t>(dims.data(), shape.size()));
}

// Validates one tensor entry of the header against a data buffer of
// `data_size` bytes. `where` is "FILE: tensor 'NAME'".
Status parse_tensor_entry(const json& entry, const std::string& where, uint64_t data_size, TensorInfo* info) {
  if (!entry.is_object()) return invalid_argument("{}: entry must be an object, got {}", where, brief(entry));
  const auto dtype_it = entry.find("dtype");
  const auto shape_it = entry.find("shape");
  const auto offsets_it = entry.find("data_offsets");
  if (dtype_it == entry.end()) return invalid_argument("{}: 'dtype' is missing", where);
  if (shape_it == entry.end()) return invalid_argument("{}: 'shape' is missing", where);
  if (offsets_it == entry.end()) return invalid_argument("{}: 'data_offsets' is missing", where);

  if (!dtype_it->is_string()) return invalid_argument("{}: 'dtype' must be a string, got {}", where, brief(*dtype_it));
  Expected<DType> dtype = dtype_from_safetensors_name(dtype_it->get_ref<const std::string&>());
  if (!dtype) return dtype.status().with_context(where);
  info->dtype = *dtype;
  MOE_ASSIGN_OR_RETURN(info->shape, parse_shape(*shape_it, where));

  const json& offsets = *offsets_it;
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned()) {
    return invalid_argument("{}: 'data_offsets' must be two non-negative integers, got {}", where, brief(offsets));
  }
  info->begin = offsets[0].get<uint64_t>();
  info->end = offsets[1].get<uint64_t>();
  if (info->begin > info->end) {
    return invalid_argument("{}: data_offsets [{}, {}] begin after they end", where, info->begin, info->end);
  }
  if (info->end > data_size) {
    return data_loss("{}: data_offsets [{}, {}] run past the end of the {}-byte data buffer (truncated file?)",
                     where, info->begin, info->end, data_size);
  }
  const uint64_t expected = dtype_bytes(info->dtype, info->shape.num_elements());
  if (info->end - info->begin != expected) {
    return invalid_argument("{}: data_offsets [{}, {}] hold {} bytes, but {} {} needs {}", where, info->begin,
                            info->end, info->end - info->begin, safetensors_dtype_name(info->dtype),
                            info->shape.to_string(), expected);
  }
  return Status::ok();
}

Status parse_metadata(const json& value, const std::string& path, std::map<std::string, std::string>* metadata) {
  if (!value.is_object()) {
    return invalid_argument("{}: '__metadata__' must be an object of strings, got {}", path, brief(value));
  }
  for (const auto& [key, item] : value.items()) {
    if (!item.is_string()) {
      return invalid_argument("{}: '__metadata__' value of '{}' must be a string, got {}", path, sanitized(key),
                              brief(item));
    }
    (*metadata)[key] = item.get<std::string>();
  }
  return Status::ok();
}

// `tensors` sorted by begin. Zero-byte tensors overlap nothing.
Status check_no_overlap(const std::vector<TensorInfo>& tensors, const std::string& path) {
  const TensorInfo* furthest = nullptr;  // the non-empty tensor seen so far that ends last
  for (const TensorInfo& info : tensors) {
    if (info.begin == info.end) continue;
    if (furthest != nullptr && info.begin < furthest->end) {
      return invalid_argument("{}: tensor '{}' bytes [{}, {}) overlap tensor '{}' bytes [{}, {})", path, info.name,
                              info.begin, info.end, furthest->name, furthest->begin, furthest->end);
    }
    if (furthest == nullptr || info.end > furthest->end) furthest = &info;
  }
  return Status::ok();
}

uint64_t read_le_u64(const uint8_t* p) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | p[i];
  return value;
}

Expected<std::string> read_small_file(const std::string& path, uint64_t max_bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return status_from_errno(errno, path);
  std::string text;
  char buffer[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int error = errno;
      ::close(fd);
      return status_from_errno(error, path);
    }
    if (n == 0) break;
    if (text.size() + static_cast<size_t>(n) > max_bytes) {
      ::close(fd);
      return data_loss("{}: larger than the {}-byte limit", path, max_bytes);
    }
    text.append(buffer, static_cast<size_t>(n));
  }
  ::close(fd);
  return text;
}

std::string file_name_of(const std::string& path) { return std::filesystem::path(path).filename().string(); }

}  // namespace

// --- SafetensorsFile ------------------------------------------------------

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept { *this = std::move(other); }

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this == &other) return *this;
  release();
  path_ = std::move(other.path_);
  bytes_ = std::exchange(other.bytes_, nullptr);
  size_ = std::exchange(other.size_, 0);
  mapping_ = std::exchange(other.mapping_, nullptr);
  owned_ = std::move(other.owned_);
  data_ = std::exchange(other.data_, nullptr);
  data_size_ = std::exchange(other.data_size_, 0);
  tensors_ = std::move(other.tensors_);
  index_ = std::move(other.index_);
  metadata_ = std::move(other.metadata_);
  return *this;
}

SafetensorsFile::~SafetensorsFile() { release(); }

void SafetensorsFile::release() {
  if (mapping_ != nullptr) ::munmap(mapping_, size_);
  mapping_ = nullptr;
  owned_.reset();
  bytes_ = nullptr;
  data_ = nullptr;
  size_ = 0;
  data_size_ = 0;
}

Expected<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return status_from_errno(errno, path);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int error = errno;
    ::close(fd);
    return status_from_errno(error, path);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return invalid_argument("{}: not a regular file", path);
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    return data_loss("{}: file is {} bytes, shorter than the 8-byte header length", path, size);
  }
  void* mapping = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_error = errno;
  ::close(fd);  // the mapping keeps the file open
  if (mapping == MAP_FAILED) return status_from_errno(map_error, path + ": mmap");

  SafetensorsFile file;
  file.path_ = path;
  file.mapping_ = mapping;
  file.bytes_ = static_cast<const uint8_t*>(mapping);
  file.size_ = size;
  MOE_RETURN_IF_ERROR(file.parse_and_validate());
  return file;
}

Expected<SafetensorsFile> SafetensorsFile::parse(std::span<const uint8_t> bytes, std::string name) {
  SafetensorsFile file;
  file.path_ = std::move(name);
  try {
    file.owned_ = allocate_host(bytes.size());
  } catch (const std::bad_alloc&) {
    return resource_exhausted("{}: cannot allocate {} bytes", file.path_, bytes.size());
  }
  if (!bytes.empty()) std::memcpy(file.owned_.get(), bytes.data(), bytes.size());
  file.bytes_ = static_cast<const uint8_t*>(file.owned_.get());
  file.size_ = bytes.size();
  MOE_RETURN_IF_ERROR(file.parse_and_validate());
  return file;
}

Status SafetensorsFile::parse_and_validate() {
  if (size_ < 8) return data_loss("{}: file is {} bytes, shorter than the 8-byte header length", path_, size_);
  const uint64_t header_size = read_le_u64(bytes_);
  if (header_size > kMaxHeaderBytes) {
    return data_loss("{}: header length {} is over the {}-byte limit (corrupt file?)", path_, header_size,
                     kMaxHeaderBytes);
  }
  if (header_size > size_ - 8) {
    return data_loss("{}: header length {} runs past the end of the {}-byte file (truncated?)", path_, header_size,
                     size_);
  }
  data_ = bytes_ + 8 + header_size;
  data_size_ = size_ - 8 - header_size;
  const std::string_view text(reinterpret_cast<const char*>(bytes_ + 8), header_size);
  try {
    MOE_ASSIGN_OR_RETURN(json header, parse_json_object(text, path_ + ": header"));
    tensors_.reserve(header.size());
    for (const auto& [name, entry] : header.items()) {
      if (name == "__metadata__") {
        MOE_RETURN_IF_ERROR(parse_metadata(entry, path_, &metadata_));
        continue;
      }
      TensorInfo info;
      info.name = name;
      MOE_RETURN_IF_ERROR(parse_tensor_entry(entry, fmt::format("{}: tensor '{}'", path_, name), data_size_, &info));
      tensors_.push_back(std::move(info));
    }
    std::sort(tensors_.begin(), tensors_.end(), [](const TensorInfo& a, const TensorInfo& b) {
      return a.begin != b.begin ? a.begin < b.begin : a.name < b.name;
    });
    MOE_RETURN_IF_ERROR(check_no_overlap(tensors_, path_));
    for (size_t i = 0; i < tensors_.size(); ++i) index_.emplace(tensors_[i].name, i);
  } catch (const std::bad_alloc&) {
    return resource_exhausted("{}: out of memory reading the header", path_);
  } catch (const std::exception& e) {
    return internal_error("{}: unexpected error reading the header: {}", path_, sanitized(e.what()));
  }
  return Status::ok();
}

std::vector<std::string> SafetensorsFile::tensor_names() const {
  std::vector<std::string> names;
  names.reserve(tensors_.size());
  for (const TensorInfo& info : tensors_) names.push_back(info.name);
  return names;
}

const TensorInfo* SafetensorsFile::find(std::string_view name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

Expected<TensorView> SafetensorsFile::view(std::string_view name) const {
  const TensorInfo* info = find(name);
  if (info == nullptr) return not_found("{}: no tensor '{}'", path_, name);
  return view(*info);
}

TensorView SafetensorsFile::view(const TensorInfo& info) const {
  CHECK(info.end <= data_size_, "tensor '{}' is not from {}", info.name, path_);
  // const_cast: TensorView has no const flavour; the mapping is PROT_READ.
  return TensorView(const_cast<uint8_t*>(data_ + info.begin), info.dtype, info.shape);
}

// --- SafetensorsCheckpoint ------------------------------------------------

namespace {

// A shard name from the index must name a file directly inside the directory.
bool is_plain_file_name(const std::string& name) {
  if (name.empty() || name.find("..") != std::string::npos) return false;
  return name.find_first_of(std::string_view("/\\\0", 3)) == std::string::npos;
}

// Reads the index: the weight_map, checked for shape and for safe shard names.
Expected<std::map<std::string, std::string>> read_weight_map(const std::string& index_path) {
  MOE_ASSIGN_OR_RETURN(std::string text, read_small_file(index_path, kMaxIndexBytes));
  MOE_ASSIGN_OR_RETURN(json index, parse_json_object(text, index_path));
  const auto metadata_it = index.find("metadata");
  if (metadata_it != index.end() && !metadata_it->is_object() && !metadata_it->is_null()) {
    return invalid_argument("{}: 'metadata' must be an object, got {}", index_path, brief(*metadata_it));
  }
  const auto map_it = index.find("weight_map");
  if (map_it == index.end()) return invalid_argument("{}: 'weight_map' is missing", index_path);
  if (!map_it->is_object()) {
    return invalid_argument("{}: 'weight_map' must be an object, got {}", index_path, brief(*map_it));
  }
  std::map<std::string, std::string> weight_map;
  for (const auto& [tensor, shard] : map_it->items()) {
    if (!shard.is_string()) {
      return invalid_argument("{}: weight_map entry for tensor '{}' must be a file name, got {}", index_path, tensor,
                              brief(shard));
    }
    const std::string& shard_name = shard.get_ref<const std::string&>();
    if (!is_plain_file_name(shard_name)) {
      return invalid_argument("{}: weight_map entry for tensor '{}' names shard '{}', which is not a plain file name "
                              "inside the model directory",
                              index_path, tensor, sanitized(shard_name));
    }
    weight_map.emplace(tensor, shard_name);
  }
  return weight_map;
}

}  // namespace

Expected<SafetensorsCheckpoint> SafetensorsCheckpoint::open(const std::string& dir) {
  namespace fs = std::filesystem;
  SafetensorsCheckpoint checkpoint;
  checkpoint.dir_ = dir;
  std::error_code ec;
  const std::string single_path = (fs::path(dir) / kSingleFileName).string();
  const std::string index_path = (fs::path(dir) / kIndexFileName).string();
  try {
    if (fs::exists(single_path, ec)) {
      MOE_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::open(single_path));
      checkpoint.shards_.push_back(std::move(file));
      MOE_RETURN_IF_ERROR(checkpoint.index_tensors());
      return checkpoint;
    }
    if (!fs::exists(index_path, ec)) {
      return not_found("{}: no {} or {} in the model directory", dir, kSingleFileName, kIndexFileName);
    }
    MOE_ASSIGN_OR_RETURN(auto weight_map, read_weight_map(index_path));
    std::set<std::string> shard_names;
    for (const auto& [tensor, shard] : weight_map) shard_names.insert(shard);
    for (const std::string& shard : shard_names) {
      const std::string shard_path = (fs::path(dir) / shard).string();
      Expected<SafetensorsFile> file = SafetensorsFile::open(shard_path);
      if (!file && file.status().code() == StatusCode::kNotFound) {
        return not_found("{}: shard file {} named by the weight_map does not exist", index_path, shard_path);
      }
      if (!file) return file.status();
      checkpoint.shards_.push_back(std::move(file).value());
    }
    MOE_RETURN_IF_ERROR(checkpoint.index_tensors());
    MOE_RETURN_IF_ERROR(checkpoint.check_weight_map(weight_map, index_path));
  } catch (const std::bad_alloc&) {
    return resource_exhausted("{}: out of memory opening the checkpoint", dir);
  } catch (const std::exception& e) {
    return internal_error("{}: unexpected error opening the checkpoint: {}", dir, sanitized(e.what()));
  }
  return checkpoint;
}

Status SafetensorsCheckpoint::index_tensors() {
  for (size_t s = 0; s < shards_.size(); ++s) {
    for (const TensorInfo& info : shards_[s].tensors()) {
      const auto [it, inserted] = locations_.emplace(info.name, s);
      if (!inserted) {
        return data_loss("{}: tensor '{}' is in two shards, {} and {}", dir_, info.name,
                         file_name_of(shards_[it->second].path()), file_name_of(shards_[s].path()));
      }
    }
  }
  return Status::ok();
}

Status SafetensorsCheckpoint::check_weight_map(const std::map<std::string, std::string>& weight_map,
                                               const std::string& index_path) const {
  for (const auto& [tensor, shard] : weight_map) {
    const auto it = locations_.find(tensor);
    if (it == locations_.end()) {
      return not_found("{}: tensor '{}' is listed in the weight_map for {} but is not in it", index_path, tensor,
                       shard);
    }
    const std::string actual = file_name_of(shards_[it->second].path());
    if (actual != shard) {
      return not_found("{}: the weight_map puts tensor '{}' in {}, but it is in {}", index_path, tensor, shard,
                       actual);
    }
  }
  for (const auto& [tensor, shard_index] : locations_) {
    if (!weight_map.contains(tensor)) {
      return data_loss("{}: tensor '{}' is in shard {} but not in the weight_map", index_path, tensor,
                       file_name_of(shards_[shard_index].path()));
    }
  }
  return Status::ok();
}

std::vector<std::string> SafetensorsCheckpoint::tensor_names() const {
  std::vector<std::string> names;
  names.reserve(locations_.size());
  for (const auto& [name, shard] : locations_) names.push_back(name);
  return names;
}

const SafetensorsFile* SafetensorsCheckpoint::shard_of(std::string_view name) const {
  const auto it = locations_.find(name);
  return it == locations_.end() ? nullptr : &shards_[it->second];
}

const TensorInfo* SafetensorsCheckpoint::find(std::string_view name) const {
  const SafetensorsFile* shard = shard_of(name);
  return shard == nullptr ? nullptr : shard->find(name);
}

Expected<TensorView> SafetensorsCheckpoint::view(std::string_view name) const {
  const SafetensorsFile* shard = shard_of(name);
  if (shard == nullptr) return not_found("{}: no tensor '{}' in the checkpoint", dir_, name);
  return shard->view(*shard->find(name));
}

// --- Writers ----------------------------------------------------------------

namespace {

// `text` as a JSON string literal; kInvalidArgument when it is not valid UTF-8.
Expected<std::string> json_quote(const std::string& text, const std::string& path) {
  try {
    return json(text).dump();
  } catch (const std::exception&) {
    return invalid_argument("{}: name '{}' is not valid UTF-8", path, sanitized(text));
  }
}

Status write_all(int fd, const void* data, size_t num_bytes, const std::string& path) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (num_bytes > 0) {
    const ssize_t n = ::write(fd, p, num_bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return status_from_errno(errno, path + ": write");
    p += n;
    num_bytes -= static_cast<size_t>(n);
  }
  return Status::ok();
}

// Writes `pieces` to path.tmp, syncs it and renames it to path. On failure the
// temporary file is removed and `path` is untouched.
Status write_atomically(const std::string& path, const std::vector<std::span<const uint8_t>>& pieces) {
  const std::string tmp_path = path + ".tmp";
  const int fd = ::open(tmp_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return status_from_errno(errno, tmp_path);
  Status status;
  for (const auto& piece : pieces) {
    status = write_all(fd, piece.data(), piece.size(), tmp_path);
    if (!status) break;
  }
  if (status && ::fsync(fd) != 0) status = status_from_errno(errno, tmp_path + ": fsync");
  if (::close(fd) != 0 && status) status = status_from_errno(errno, tmp_path + ": close");
  if (status && ::rename(tmp_path.c_str(), path.c_str()) != 0) status = status_from_errno(errno, path + ": rename");
  if (!status) ::unlink(tmp_path.c_str());
  return status;
}

// Names must be unique, not "__metadata__", and views CPU views with data.
Status check_tensors_to_write(const std::vector<std::pair<std::string, TensorView>>& tensors,
                              const std::string& path) {
  std::set<std::string_view> names;
  for (const auto& [name, view] : tensors) {
    if (name == "__metadata__") return invalid_argument("{}: '__metadata__' cannot name a tensor", path);
    if (!names.insert(name).second) return invalid_argument("{}: tensor '{}' is given twice", path, name);
    if (view.device().kind != DeviceKind::kCpu) {
      return invalid_argument("{}: tensor '{}' is on {}, not the CPU", path, name, view.device().to_string());
    }
    if (view.data() == nullptr && view.num_bytes() > 0) {
      return invalid_argument("{}: tensor '{}' has no data", path, name);
    }
  }
  return Status::ok();
}

// The header JSON with entries in the order given, padded with spaces to a
// multiple of 8 bytes so the data buffer starts 8-byte aligned.
Expected<std::string> build_header(const std::vector<std::pair<std::string, TensorView>>& tensors,
                                   const std::map<std::string, std::string>& metadata, const std::string& path) {
  std::string header = "{";
  if (!metadata.empty()) {
    header += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [key, value] : metadata) {
      MOE_ASSIGN_OR_RETURN(std::string quoted_key, json_quote(key, path));
      MOE_ASSIGN_OR_RETURN(std::string quoted_value, json_quote(value, path));
      header += fmt::format("{}{}:{}", first ? "" : ",", quoted_key, quoted_value);
      first = false;
    }
    header += "}";
  }
  uint64_t offset = 0;
  for (const auto& [name, view] : tensors) {
    MOE_ASSIGN_OR_RETURN(std::string quoted_name, json_quote(name, path));
    const uint64_t num_bytes = view.num_bytes();
    header += fmt::format("{}{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{},{}]}}",
                          header.size() > 1 ? "," : "", quoted_name, safetensors_dtype_name(view.dtype()),
                          fmt::join(view.shape().dims(), ","), offset, offset + num_bytes);
    offset += num_bytes;
  }
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');
  return header;
}

}  // namespace

Status write_safetensors(const std::string& path, const std::vector<std::pair<std::string, TensorView>>& tensors,
                         const std::map<std::string, std::string>& metadata) {
  try {
    MOE_RETURN_IF_ERROR(check_tensors_to_write(tensors, path));
    MOE_ASSIGN_OR_RETURN(std::string header, build_header(tensors, metadata, path));
    uint8_t length[8];
    for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(static_cast<uint64_t>(header.size()) >> (8 * i));
    std::vector<std::span<const uint8_t>> pieces;
    pieces.reserve(tensors.size() + 2);
    pieces.emplace_back(length, sizeof length);
    pieces.emplace_back(reinterpret_cast<const uint8_t*>(header.data()), header.size());
    for (const auto& [name, view] : tensors) {
      if (view.num_bytes() > 0) pieces.emplace_back(static_cast<const uint8_t*>(view.data()), view.num_bytes());
    }
    return write_atomically(path, pieces);
  } catch (const std::bad_alloc&) {
    return resource_exhausted("{}: out of memory writing the file", path);
  }
}

Status write_sharded_safetensors(const std::string& dir,
                                 const std::vector<std::pair<std::string, TensorView>>& tensors,
                                 uint64_t max_shard_bytes, const std::map<std::string, std::string>& metadata) {
  namespace fs = std::filesystem;
  try {
    MOE_RETURN_IF_ERROR(check_tensors_to_write(tensors, dir));
    // Greedy packing in the order given.
    std::vector<std::vector<std::pair<std::string, TensorView>>> shards(1);
    uint64_t shard_bytes = 0;
    uint64_t total_bytes = 0;
    for (const auto& tensor : tensors) {
      const uint64_t num_bytes = tensor.second.num_bytes();
      if (!shards.back().empty() && shard_bytes + num_bytes > max_shard_bytes) {
        shards.emplace_back();
        shard_bytes = 0;
      }
      shards.back().push_back(tensor);
      shard_bytes += num_bytes;
      total_bytes += num_bytes;
    }
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) return invalid_argument("{}: cannot create the directory: {}", dir, ec.message());

    json weight_map = json::object();
    for (size_t s = 0; s < shards.size(); ++s) {
      const std::string shard_name = fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, shards.size());
      MOE_RETURN_IF_ERROR(write_safetensors((fs::path(dir) / shard_name).string(), shards[s], metadata));
      for (const auto& [name, view] : shards[s]) weight_map[name] = shard_name;
    }
    json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", std::move(weight_map)}};
    const std::string text = index.dump(2) + "\n";
    return write_atomically((fs::path(dir) / kIndexFileName).string(),
                            {std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size())});
  } catch (const std::bad_alloc&) {
    return resource_exhausted("{}: out of memory writing the checkpoint", dir);
  } catch (const std::exception& e) {
    return internal_error("{}: unexpected error writing the checkpoint: {}", dir, sanitized(e.what()));
  }
}

}  // namespace moe::model
