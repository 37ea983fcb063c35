#include "model/safetensors.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace moe::model {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const std::string kGoldenDir = std::string(MOE_SOURCE_DIR) + "/tests/data/golden";

std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::string read_text(const std::string& path) {
  const std::vector<uint8_t> bytes = read_bytes(path);
  return {bytes.begin(), bytes.end()};
}

void write_text(const std::string& path, const std::string& text) {
  write_bytes(path, std::vector<uint8_t>(text.begin(), text.end()));
}

// Asserts `status` has `code` and its message contains every needle.
void expect_error(const Status& status, StatusCode code, std::initializer_list<std::string> needles) {
  EXPECT_EQ(status.code(), code) << status.to_string();
  for (const std::string& needle : needles) {
    EXPECT_NE(status.message().find(needle), std::string::npos)
        << "message lacks '" << needle << "': " << status.message();
  }
}

// A fresh directory per test, removed afterwards.
class TempDirTest : public testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "moe_safetensors_test_XXXXXX").string();
    ASSERT_NE(mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string path(const std::string& name) const { return (fs::path(dir_) / name).string(); }

  std::string dir_;
};

// A host tensor whose bytes are a recognisable pattern.
Tensor patterned(DType dtype, Shape shape, uint8_t seed) {
  Tensor t(dtype, shape);
  auto* bytes = static_cast<uint8_t*>(t.data());
  for (size_t i = 0; i < t.num_bytes(); ++i) bytes[i] = static_cast<uint8_t>(seed + 31 * i);
  return t;
}

bool same_bytes(const TensorView& a, const TensorView& b) {
  return a.num_bytes() == b.num_bytes() && std::memcmp(a.data(), b.data(), a.num_bytes()) == 0;
}

// --- Round trips -----------------------------------------------------------

class SafetensorsRoundTrip : public TempDirTest {
 protected:
  void SetUp() override {
    TempDirTest::SetUp();
    owned_.push_back(patterned(DType::kBF16, {3, 5}, 1));
    owned_.push_back(patterned(DType::kF32, {2, 3, 4}, 2));
    owned_.push_back(patterned(DType::kF8E4M3, {7}, 3));
    owned_.push_back(patterned(DType::kI64, {4}, 4));
    owned_.push_back(patterned(DType::kF32, {0, 3}, 5));
    owned_.push_back(patterned(DType::kF32, {}, 6));
    owned_.push_back(patterned(DType::kF4E2M1, {3, 3}, 7));  // 9 nibbles -> 5 bytes
    const char* names[] = {"w.bf16", "w.f32", "w.f8", "w.i64", "w.empty", "w.scalar", "w.fp4"};
    for (size_t i = 0; i < owned_.size(); ++i) tensors_.emplace_back(names[i], owned_[i].view());
  }

  void expect_contents(const SafetensorsFile& file) {
    ASSERT_EQ(file.num_tensors(), tensors_.size());
    for (const auto& [name, expected] : tensors_) {
      const TensorInfo* info = file.find(name);
      ASSERT_NE(info, nullptr) << name;
      EXPECT_EQ(info->dtype, expected.dtype()) << name;
      EXPECT_EQ(info->shape, expected.shape()) << name;
      Expected<TensorView> view = file.view(name);
      ASSERT_TRUE(view.has_value()) << view.status().to_string();
      EXPECT_EQ(view->device(), Device::cpu());
      EXPECT_TRUE(same_bytes(*view, expected)) << name;
    }
  }

  std::vector<Tensor> owned_;
  std::vector<std::pair<std::string, TensorView>> tensors_;
};

TEST_F(SafetensorsRoundTrip, SingleFileKeepsBytesDtypesShapesAndMetadata) {
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"note", "h\u00e9llo \"quoted\""}};
  ASSERT_TRUE(write_safetensors(path("m.safetensors"), tensors_, metadata).is_ok());
  EXPECT_FALSE(fs::exists(path("m.safetensors.tmp")));

  Expected<SafetensorsFile> file = SafetensorsFile::open(path("m.safetensors"));
  ASSERT_TRUE(file.has_value()) << file.status().to_string();
  expect_contents(*file);
  EXPECT_EQ(file->metadata(), metadata);
  EXPECT_EQ(file->path(), path("m.safetensors"));

  // Header padded to 8 bytes, tensors packed in the order given, every view aligned.
  const std::vector<uint8_t> bytes = read_bytes(path("m.safetensors"));
  uint64_t header_size = 0;
  std::memcpy(&header_size, bytes.data(), 8);
  EXPECT_EQ(header_size % 8, 0u);
  uint64_t offset = 0;
  for (const auto& [name, view] : tensors_) {
    EXPECT_EQ(file->find(name)->begin, offset) << name;
    offset += view.num_bytes();
  }
  EXPECT_EQ(file->data_size(), offset);
  EXPECT_EQ(bytes.size(), 8 + header_size + offset);
  // The data buffer starts 8-byte aligned (offsets inside it are packed).
  EXPECT_EQ(reinterpret_cast<uintptr_t>(file->view("w.bf16")->data()) % 8, 0u);

  // Header order is the order given.
  const std::string header(bytes.begin() + 8, bytes.begin() + 8 + static_cast<long>(header_size));
  EXPECT_LT(header.find("w.bf16"), header.find("w.f32"));
  EXPECT_LT(header.find("w.empty"), header.find("w.scalar"));

  // tensors() is in data order, ties (zero-byte tensors) broken by name.
  std::vector<std::string> names = file->tensor_names();
  EXPECT_EQ(names, (std::vector<std::string>{"w.bf16", "w.f32", "w.f8", "w.i64", "w.empty", "w.scalar", "w.fp4"}));
}

TEST_F(SafetensorsRoundTrip, ParseOfBytesEqualsOpen) {
  ASSERT_TRUE(write_safetensors(path("m.safetensors"), tensors_).is_ok());
  std::vector<uint8_t> bytes = read_bytes(path("m.safetensors"));
  Expected<SafetensorsFile> file = SafetensorsFile::parse(bytes, "in-memory");
  bytes.assign(bytes.size(), 0);  // parse keeps its own copy
  ASSERT_TRUE(file.has_value()) << file.status().to_string();
  expect_contents(*file);
  EXPECT_TRUE(file->metadata().empty());
  EXPECT_EQ(file->path(), "in-memory");

  // Views survive moving the file object.
  const void* before = file->view("w.f32")->data();
  SafetensorsFile moved = std::move(file).value();
  EXPECT_EQ(moved.view("w.f32")->data(), before);
  expect_contents(moved);
}

TEST_F(SafetensorsRoundTrip, NoTensorsIsAValidFile) {
  ASSERT_TRUE(write_safetensors(path("none.safetensors"), {}).is_ok());
  Expected<SafetensorsFile> file = SafetensorsFile::open(path("none.safetensors"));
  ASSERT_TRUE(file.has_value()) << file.status().to_string();
  EXPECT_EQ(file->num_tensors(), 0u);
}

TEST_F(SafetensorsRoundTrip, OverwritesAtomically) {
  ASSERT_TRUE(write_safetensors(path("m.safetensors"), {tensors_[0]}).is_ok());
  ASSERT_TRUE(write_safetensors(path("m.safetensors"), tensors_).is_ok());
  Expected<SafetensorsFile> file = SafetensorsFile::open(path("m.safetensors"));
  ASSERT_TRUE(file.has_value()) << file.status().to_string();
  expect_contents(*file);
  EXPECT_FALSE(fs::exists(path("m.safetensors.tmp")));
}

TEST_F(SafetensorsRoundTrip, WriterRejectsBadInput) {
  expect_error(write_safetensors(path("dup.safetensors"), {tensors_[0], tensors_[0]}), StatusCode::kInvalidArgument,
               {path("dup.safetensors"), "w.bf16"});
  expect_error(write_safetensors(path("meta.safetensors"), {{"__metadata__", tensors_[0].second}}),
               StatusCode::kInvalidArgument, {"__metadata__"});
  expect_error(write_safetensors(path("utf8.safetensors"), {{"bad\xff", tensors_[0].second}}),
               StatusCode::kInvalidArgument, {"UTF-8"});
  TensorView on_gpu(owned_[0].data(), DType::kBF16, {3, 5}, Device::cuda(0));
  expect_error(write_safetensors(path("gpu.safetensors"), {{"g", on_gpu}}), StatusCode::kInvalidArgument,
               {"'g'", "cuda:0"});
  const std::string missing_dir = path("no/such/dir/m.safetensors");
  expect_error(write_safetensors(missing_dir, tensors_), StatusCode::kNotFound, {missing_dir});
  for (const char* name : {"dup", "meta", "utf8", "gpu"}) {
    EXPECT_FALSE(fs::exists(path(std::string(name) + ".safetensors"))) << name;
    EXPECT_FALSE(fs::exists(path(std::string(name) + ".safetensors.tmp"))) << name;
  }
}

TEST_F(SafetensorsRoundTrip, ShardedWriteAndRead) {
  // 30 + 96 + 7 + 32 + 0 + 4 + 5 bytes; at most 100 per shard -> [bf16], [f32], [f8 i64 empty scalar fp4].
  ASSERT_TRUE(write_sharded_safetensors(path("ckpt"), tensors_, 100, {{"format", "pt"}}).is_ok());
  for (const char* name : {"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                           "model-00003-of-00003.safetensors", "model.safetensors.index.json"})
    EXPECT_TRUE(fs::exists(path("ckpt/") + name)) << name;
  const json index = json::parse(read_text(path("ckpt/model.safetensors.index.json")));
  EXPECT_EQ(index["metadata"]["total_size"], 30 + 96 + 7 + 32 + 0 + 4 + 5);
  EXPECT_EQ(index["weight_map"]["w.f8"], "model-00003-of-00003.safetensors");

  Expected<SafetensorsCheckpoint> checkpoint = SafetensorsCheckpoint::open(path("ckpt"));
  ASSERT_TRUE(checkpoint.has_value()) << checkpoint.status().to_string();
  EXPECT_EQ(checkpoint->shards().size(), 3u);
  EXPECT_EQ(checkpoint->num_tensors(), tensors_.size());
  EXPECT_EQ(checkpoint->shards()[0].metadata().at("format"), "pt");
  for (const auto& [name, expected] : tensors_) {
    Expected<TensorView> view = checkpoint->view(name);
    ASSERT_TRUE(view.has_value()) << view.status().to_string();
    EXPECT_EQ(view->shape(), expected.shape());
    EXPECT_TRUE(same_bytes(*view, expected)) << name;
    ASSERT_NE(checkpoint->find(name), nullptr);
  }
  EXPECT_EQ(checkpoint->tensor_names(),
            (std::vector<std::string>{"w.bf16", "w.empty", "w.f32", "w.f8", "w.fp4", "w.i64", "w.scalar"}));
  expect_error(checkpoint->view("nope").status(), StatusCode::kNotFound, {path("ckpt"), "nope"});
  EXPECT_EQ(checkpoint->find("nope"), nullptr);
}

// --- The real checkpoints from transformers --------------------------------

struct ManifestEntry {
  std::vector<int64_t> shape;
  std::string dtype;
  std::string file;
};

std::map<std::string, ManifestEntry> read_manifest(const std::string& model) {
  const json golden = json::parse(read_text(kGoldenDir + "/" + model + "/golden.json"));
  std::map<std::string, ManifestEntry> manifest;
  for (const auto& [name, entry] : golden.at("tensors").items())
    manifest[name] = {entry.at("shape").get<std::vector<int64_t>>(), entry.at("dtype"), entry.at("file")};
  return manifest;
}

void expect_matches_manifest(const SafetensorsCheckpoint& checkpoint, const std::string& model) {
  const auto manifest = read_manifest(model);
  ASSERT_FALSE(manifest.empty());
  EXPECT_EQ(checkpoint.num_tensors(), manifest.size());
  for (const auto& [name, entry] : manifest) {
    const TensorInfo* info = checkpoint.find(name);
    ASSERT_NE(info, nullptr) << name;
    EXPECT_EQ(info->shape, Shape(std::span<const int64_t>(entry.shape))) << name;
    EXPECT_EQ(safetensors_dtype_name(info->dtype), entry.dtype) << name;
    EXPECT_EQ(fs::path(checkpoint.shard_of(name)->path()).filename().string(), entry.file) << name;
    Expected<TensorView> view = checkpoint.view(name);
    ASSERT_TRUE(view.has_value()) << view.status().to_string();
    EXPECT_EQ(view->num_bytes(), info->num_bytes());
  }
}

TEST(SafetensorsGolden, SingleFileMoeBasic) {
  Expected<SafetensorsCheckpoint> checkpoint = SafetensorsCheckpoint::open(kGoldenDir + "/moe_basic");
  ASSERT_TRUE(checkpoint.has_value()) << checkpoint.status().to_string();
  EXPECT_EQ(checkpoint->shards().size(), 1u);
  EXPECT_EQ(checkpoint->shards()[0].metadata().at("format"), "pt");
  expect_matches_manifest(*checkpoint, "moe_basic");
  EXPECT_EQ(checkpoint->find("model.embed_tokens.weight")->shape, Shape({512, 64}));
}

TEST(SafetensorsGolden, ShardedMoeSparseStep) {
  Expected<SafetensorsCheckpoint> checkpoint = SafetensorsCheckpoint::open(kGoldenDir + "/moe_sparse_step");
  ASSERT_TRUE(checkpoint.has_value()) << checkpoint.status().to_string();
  EXPECT_EQ(checkpoint->shards().size(), 7u);
  expect_matches_manifest(*checkpoint, "moe_sparse_step");
}

// --- Corrupt single files --------------------------------------------------

// A valid two-tensor header; the corruption cases edit its text.
const std::string kValidHeader =
    R"({"__metadata__":{"format":"pt"},)"
    R"("alpha":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]},)"
    R"("beta":{"dtype":"F32","shape":[4],"data_offsets":[12,28]}})";
constexpr size_t kValidDataSize = 28;

std::vector<uint8_t> file_bytes(const std::string& header, size_t data_size) {
  std::vector<uint8_t> bytes(8 + header.size() + data_size);
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<uint8_t>(n >> (8 * i));
  std::memcpy(bytes.data() + 8, header.data(), header.size());
  for (size_t i = 0; i < data_size; ++i) bytes[8 + header.size() + i] = static_cast<uint8_t>(i);
  return bytes;
}

std::string replaced(std::string text, const std::string& from, const std::string& to) {
  const size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  if (at != std::string::npos) text.replace(at, from.size(), to);
  return text;
}

class SafetensorsCorrupt : public TempDirTest {
 protected:
  // Writes `bytes`, opens them both from disk and from memory, and expects the
  // same error from both, naming the file and the needles.
  void expect_rejected(const std::vector<uint8_t>& bytes, StatusCode code, std::initializer_list<std::string> needles) {
    const std::string file = path("bad.safetensors");
    write_bytes(file, bytes);
    Expected<SafetensorsFile> opened = SafetensorsFile::open(file);
    ASSERT_FALSE(opened.has_value());
    expect_error(opened.status(), code, {file});
    expect_error(opened.status(), code, needles);
    Expected<SafetensorsFile> parsed = SafetensorsFile::parse(bytes, "mem.safetensors");
    ASSERT_FALSE(parsed.has_value());
    expect_error(parsed.status(), code, {"mem.safetensors"});
    expect_error(parsed.status(), code, needles);
  }
  void expect_header_rejected(const std::string& header, StatusCode code, std::initializer_list<std::string> needles,
                              size_t data_size = kValidDataSize) {
    SCOPED_TRACE(header);
    expect_rejected(file_bytes(header, data_size), code, needles);
  }
};

TEST_F(SafetensorsCorrupt, TheValidBaseIsValid) {
  Expected<SafetensorsFile> file = SafetensorsFile::parse(file_bytes(kValidHeader, kValidDataSize), "ok");
  ASSERT_TRUE(file.has_value()) << file.status().to_string();
  EXPECT_EQ(file->num_tensors(), 2u);
  // Trailing spaces and a gap between tensors are fine.
  const std::string gap = replaced(replaced(kValidHeader, "[12,28]", "[16,32]"), "}}", "}}    ");
  EXPECT_TRUE(SafetensorsFile::parse(file_bytes(gap, 40), "gap").has_value());
}

TEST_F(SafetensorsCorrupt, FileFraming) {
  const std::vector<uint8_t> valid = file_bytes(kValidHeader, kValidDataSize);
  expect_rejected({valid.begin(), valid.begin() + 5}, StatusCode::kDataLoss, {"shorter than"});
  expect_rejected({}, StatusCode::kDataLoss, {"0 bytes"});
  std::vector<uint8_t> bytes = valid;
  bytes[0] = static_cast<uint8_t>(valid.size());  // header length = file size
  bytes[1] = static_cast<uint8_t>(valid.size() >> 8);
  expect_rejected(bytes, StatusCode::kDataLoss, {"runs past the end"});
  bytes = valid;
  bytes[5] = 1;  // 2^40 + ...
  expect_rejected(bytes, StatusCode::kDataLoss, {"limit"});
  // Cut inside the data: the last tensor runs past the buffer.
  expect_rejected({valid.begin(), valid.end() - 1}, StatusCode::kDataLoss, {"'beta'", "past the end"});
  // Cut inside the header.
  expect_rejected({valid.begin(), valid.begin() + 40}, StatusCode::kDataLoss, {"header length"});
}

TEST_F(SafetensorsCorrupt, HeaderNotAJsonObject) {
  expect_header_rejected("", StatusCode::kInvalidArgument, {"not valid JSON"});
  expect_header_rejected(kValidHeader.substr(0, kValidHeader.size() - 1), StatusCode::kInvalidArgument,
                         {"not valid JSON"});
  expect_header_rejected(replaced(kValidHeader, "\"alpha\":", "alpha:"), StatusCode::kInvalidArgument,
                         {"not valid JSON at byte"});
  expect_header_rejected(replaced(kValidHeader, "}}", std::string("}}\0", 3)), StatusCode::kInvalidArgument,
                         {"not valid JSON"});
  expect_header_rejected(replaced(kValidHeader, "alpha", "al\xff"), StatusCode::kInvalidArgument,
                         {"not valid JSON"});
  expect_header_rejected("[1, 2]", StatusCode::kInvalidArgument, {"must be a JSON object"});
  expect_header_rejected(std::string(40, '[') + std::string(40, ']'), StatusCode::kInvalidArgument,
                         {"nested deeper than"});
  expect_header_rejected(replaced(kValidHeader, "[2,3]", "[2,3,[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]"),
                         StatusCode::kInvalidArgument, {"nested deeper than"});
  expect_header_rejected("\"text\"", StatusCode::kInvalidArgument, {"must be a JSON object"});
}

TEST_F(SafetensorsCorrupt, TensorEntryFields) {
  const auto rejected = [&](const std::string& from, const std::string& to, std::initializer_list<std::string> needles,
                            StatusCode code = StatusCode::kInvalidArgument) {
    std::vector<std::string> all(needles);
    all.push_back("'alpha'");
    SCOPED_TRACE(to);
    const std::string header = replaced(kValidHeader, from, to);
    const std::vector<uint8_t> bytes = file_bytes(header, kValidDataSize);
    Expected<SafetensorsFile> parsed = SafetensorsFile::parse(bytes, "mem.safetensors");
    ASSERT_FALSE(parsed.has_value());
    EXPECT_EQ(parsed.status().code(), code) << parsed.status().to_string();
    for (const std::string& needle : all) EXPECT_NE(parsed.status().message().find(needle), std::string::npos)
        << needle << " not in " << parsed.status().message();
    expect_header_rejected(header, code, {"'alpha'"});
  };
  const std::string entry = R"({"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]})";
  rejected(entry, "5", {"must be an object"});
  rejected(entry, "[1]", {"must be an object"});
  rejected(R"("dtype":"BF16",)", "", {"'dtype' is missing"});
  rejected(R"("shape":[2,3],)", "", {"'shape' is missing"});
  rejected(R"(,"data_offsets":[0,12])", "", {"'data_offsets' is missing"});
  rejected(R"("dtype":"BF16")", R"("dtype":16)", {"'dtype' must be a string"});
  rejected(R"("dtype":"BF16")", R"("dtype":"Q7")", {"unsupported safetensors dtype 'Q7'"});
  rejected(R"("shape":[2,3])", R"("shape":"2x3")", {"'shape' must be a list"});
  rejected(R"("shape":[2,3])", R"("shape":[2,-3])", {"negative dim"});
  rejected(R"("shape":[2,3])", R"("shape":[2,3.0])", {"not an integer"});
  rejected(R"("shape":[2,3])", R"("shape":[2,"3"])", {"not an integer"});
  rejected(R"("shape":[2,3])", R"("shape":[2,true])", {"not an integer"});
  rejected(R"("shape":[2,3])", R"("shape":[2,18446744073709551615])", {"overflow"});
  rejected(R"("shape":[2,3])", R"("shape":[1152921504606846976])", {"overflow"});
  rejected(R"("shape":[2,3])", R"("shape":[1,1,1,1,1,2,3])", {"7 dims"});
  rejected(R"("shape":[2,3])", R"("shape":[4294967296,4294967296])", {"overflow"});
  rejected(R"("shape":[2,3])", R"("shape":[1099511627776,1099511627776,1099511627776])", {"overflow"});
  rejected("[0,12]", R"({"begin":0})", {"two non-negative integers"});
  rejected("[0,12]", "[0]", {"two non-negative integers"});
  rejected("[0,12]", "[0,12,24]", {"two non-negative integers"});
  rejected("[0,12]", R"([0,"12"])", {"two non-negative integers"});
  rejected("[0,12]", "[-1,11]", {"two non-negative integers"});
  rejected("[0,12]", "[0,12.0]", {"two non-negative integers"});
  rejected("[0,12]", "[12,0]", {"begin after they end"});
  rejected("[0,12]", "[0,10]", {"hold 10 bytes", "needs 12"});
  rejected("[0,12]", "[0,29]", {"past the end"}, StatusCode::kDataLoss);
  rejected("[0,12]", "[18446744073709551604,18446744073709551615]", {"past the end"}, StatusCode::kDataLoss);
}

TEST_F(SafetensorsCorrupt, OverlapsAndDuplicates) {
  expect_header_rejected(replaced(kValidHeader, "[12,28]", "[8,24]"), StatusCode::kInvalidArgument,
                         {"overlap", "'alpha'", "'beta'"});
  // Identical ranges overlap too.
  expect_header_rejected(replaced(replaced(kValidHeader, R"("shape":[4])", R"("shape":[3])"), "[12,28]", "[0,12]"),
                         StatusCode::kInvalidArgument, {"overlap", "'alpha'", "'beta'"});
  // A zero-byte tensor inside another's range overlaps nothing.
  const std::string empty_inside =
      replaced(kValidHeader, "}}", R"(},"gamma":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})");
  EXPECT_TRUE(SafetensorsFile::parse(file_bytes(empty_inside, kValidDataSize), "ok").has_value());
  // Duplicate tensor names, and duplicate keys inside an entry.
  expect_header_rejected(replaced(kValidHeader, "\"beta\"", "\"alpha\""), StatusCode::kInvalidArgument,
                         {"duplicate key \"alpha\""});
  expect_header_rejected(replaced(kValidHeader, R"("dtype":"F32")", R"("dtype":"F32","dtype":"F32")"),
                         StatusCode::kInvalidArgument, {"duplicate key \"dtype\""});
}

TEST_F(SafetensorsCorrupt, Metadata) {
  expect_header_rejected(replaced(kValidHeader, R"({"format":"pt"})", R"("pt")"), StatusCode::kInvalidArgument,
                         {"'__metadata__' must be an object"});
  expect_header_rejected(replaced(kValidHeader, R"({"format":"pt"})", R"({"format":1})"),
                         StatusCode::kInvalidArgument, {"'format' must be a string"});
}

TEST_F(SafetensorsCorrupt, MissingFileAndTensor) {
  expect_error(SafetensorsFile::open(path("absent.safetensors")).status(), StatusCode::kNotFound,
               {path("absent.safetensors")});
  expect_error(SafetensorsFile::open(dir_).status(), StatusCode::kInvalidArgument, {dir_, "not a regular file"});
  Expected<SafetensorsFile> file = SafetensorsFile::parse(file_bytes(kValidHeader, kValidDataSize), "ok.st");
  ASSERT_TRUE(file.has_value());
  expect_error(file->view("gamma").status(), StatusCode::kNotFound, {"ok.st", "'gamma'"});
  EXPECT_EQ(file->find("gamma"), nullptr);
}

// --- Corrupt sharded checkpoints -------------------------------------------

class SafetensorsShardedCorrupt : public TempDirTest {
 protected:
  void SetUp() override {
    TempDirTest::SetUp();
    for (int i = 0; i < 4; ++i) owned_.push_back(patterned(DType::kBF16, {4, 4}, static_cast<uint8_t>(i)));
    for (int i = 0; i < 4; ++i) tensors_.emplace_back(fmt::format("t{}", i), owned_[i].view());
    // 32 bytes each, 64 per shard: t0 t1 | t2 t3.
    ASSERT_TRUE(write_sharded_safetensors(dir_, tensors_, 64).is_ok());
    ASSERT_TRUE(SafetensorsCheckpoint::open(dir_).has_value());
    index_ = json::parse(read_text(index_path()));
  }
  std::string index_path() const { return path("model.safetensors.index.json"); }
  std::string shard(int i) const { return fmt::format("model-{:05d}-of-00002.safetensors", i); }
  void write_index() { write_text(index_path(), index_.dump(2)); }
  Status open_status() { return SafetensorsCheckpoint::open(dir_).status(); }

  std::vector<Tensor> owned_;
  std::vector<std::pair<std::string, TensorView>> tensors_;
  json index_;
};

TEST_F(SafetensorsShardedCorrupt, MissingShardFile) {
  fs::remove(path(shard(2)));
  expect_error(open_status(), StatusCode::kNotFound, {index_path(), path(shard(2))});
}

TEST_F(SafetensorsShardedCorrupt, CorruptShardNamesTheShard) {
  std::vector<uint8_t> bytes = read_bytes(path(shard(2)));
  ASSERT_GT(bytes.size(), 3u);
  bytes.erase(bytes.end() - 3, bytes.end());
  write_bytes(path(shard(2)), bytes);
  expect_error(open_status(), StatusCode::kDataLoss, {path(shard(2)), "'t3'"});
}

TEST_F(SafetensorsShardedCorrupt, TensorInTwoShards) {
  ASSERT_TRUE(write_safetensors(path(shard(2)), {tensors_[1], tensors_[2], tensors_[3]}).is_ok());
  expect_error(open_status(), StatusCode::kDataLoss, {dir_, "'t1'", "two shards", shard(1), shard(2)});
}

TEST_F(SafetensorsShardedCorrupt, ShardNameOutsideTheDirectory) {
  for (const std::string bad : {"../model-00001-of-00002.safetensors", "sub/x.safetensors", "..", "",
                                "/etc/passwd", "a\\b.safetensors"}) {
    SCOPED_TRACE(bad);
    index_["weight_map"]["t0"] = bad;
    write_index();
    expect_error(open_status(), StatusCode::kInvalidArgument, {index_path(), "'t0'", "not a plain file name"});
  }
}

TEST_F(SafetensorsShardedCorrupt, WeightMapPointsAtTheWrongShard) {
  index_["weight_map"]["t0"] = shard(2);
  write_index();
  expect_error(open_status(), StatusCode::kNotFound, {index_path(), "'t0'", shard(1), shard(2)});
}

TEST_F(SafetensorsShardedCorrupt, WeightMapTensorInNoShard) {
  index_["weight_map"]["ghost"] = shard(1);
  write_index();
  expect_error(open_status(), StatusCode::kNotFound, {index_path(), "'ghost'", shard(1)});
}

TEST_F(SafetensorsShardedCorrupt, ShardTensorMissingFromWeightMap) {
  index_["weight_map"].erase("t3");
  write_index();
  expect_error(open_status(), StatusCode::kDataLoss, {index_path(), "'t3'", shard(2), "not in the weight_map"});
}

TEST_F(SafetensorsShardedCorrupt, MalformedIndex) {
  write_text(index_path(), "{\"weight_map\": ");
  expect_error(open_status(), StatusCode::kInvalidArgument, {index_path(), "not valid JSON"});
  write_text(index_path(), "[]");
  expect_error(open_status(), StatusCode::kInvalidArgument, {index_path(), "JSON object"});
  write_text(index_path(), R"({"metadata": {}})");
  expect_error(open_status(), StatusCode::kInvalidArgument, {index_path(), "'weight_map' is missing"});
  write_text(index_path(), R"({"weight_map": []})");
  expect_error(open_status(), StatusCode::kInvalidArgument, {index_path(), "'weight_map' must be an object"});
  write_text(index_path(), R"({"weight_map": {"t0": 1}})");
  expect_error(open_status(), StatusCode::kInvalidArgument, {index_path(), "'t0'", "must be a file name"});
  write_text(index_path(), R"({"weight_map": {"t0": "a", "t0": "b"}})");
  expect_error(open_status(), StatusCode::kInvalidArgument, {index_path(), "duplicate key \"t0\""});
}

TEST_F(SafetensorsShardedCorrupt, EmptyDirectoryAndSingleFilePreference) {
  const std::string empty = path("empty");
  fs::create_directory(empty);
  expect_error(SafetensorsCheckpoint::open(empty).status(), StatusCode::kNotFound, {empty, "model.safetensors"});
  expect_error(SafetensorsCheckpoint::open(path("absent")).status(), StatusCode::kNotFound, {path("absent")});
  // With both files, model.safetensors wins (as in transformers), index and all.
  ASSERT_TRUE(write_safetensors(path("model.safetensors"), {tensors_[0]}).is_ok());
  Expected<SafetensorsCheckpoint> checkpoint = SafetensorsCheckpoint::open(dir_);
  ASSERT_TRUE(checkpoint.has_value()) << checkpoint.status().to_string();
  EXPECT_EQ(checkpoint->tensor_names(), std::vector<std::string>{"t0"});
}

}  // namespace
}  // namespace moe::model
