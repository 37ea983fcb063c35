// The TCP wire format of the TransferEngine: every frame is one fixed 64-byte
// little-endian header, followed by `length` payload bytes for kHello (the
// sender's endpoint) and kWrite (the bytes to store). Nothing else is ever
// parsed. validate_header() is the single gate: a frame it rejects closes its
// connection and is counted as a bad frame.
//
// Stream of one connection: kHello, then any number of kWrite / kNotify,
// then kGoodbye on an orderly close (EOF without it means the peer was lost).
// A kQpConnect (ibverbs set-up) is the one frame that gets an answer: the
// receiver writes back a kQpConnect with its own queue-pair info.
//
// Plain functions on plain data; any thread may call them.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <string>

namespace moe::transfer::wire {

static_assert(std::endian::native == std::endian::little, "the wire format is little-endian");

inline constexpr uint32_t kMagic = 0x54454F4Du;  // "MOET"
inline constexpr uint16_t kVersion = 1;
inline constexpr size_t kHeaderBytes = 64;
inline constexpr uint64_t kMaxEndpointBytes = 255;
// Receivers reject payloads above this, whatever the sender's max_frame_bytes.
inline constexpr uint64_t kMaxPayloadBytes = 64ull << 20;
inline constexpr uint32_t kMaxBatchFrames = 1u << 30;

enum class FrameType : uint16_t {
  kHello = 1,    // offset = sender nonce (names the sender engine's run), payload = endpoint
  kWrite = 2,    // store payload at region_id + offset; one frame of batch batch_id
  kNotify = 3,   // no payload; one frame of batch batch_id (imm-only batches, CUDA IPC completions)
  kGoodbye = 4,  // orderly close
  kQpConnect = 5,  // ibverbs connection set-up: kQpInfoBytes of queue-pair info; the receiver answers in kind
};

// ibverbs queue-pair info carried by kQpConnect (see ibverbs_transport.cc).
inline constexpr uint64_t kQpInfoBytes = 32;

struct FrameHeader {
  uint32_t magic = kMagic;
  uint16_t version = kVersion;
  uint16_t type = 0;
  uint32_t imm = 0;
  uint32_t batch_num_frames = 0;  // frames in the batch, over all connections
  uint64_t batch_id = 0;          // unique per sender nonce
  uint64_t region_id = 0;
  uint64_t offset = 0;
  uint64_t length = 0;            // payload bytes after the header
  uint64_t reserved0 = 0;         // must be 0
  uint64_t reserved1 = 0;         // must be 0
};
static_assert(sizeof(FrameHeader) == kHeaderBytes);

inline void encode(const FrameHeader& header, uint8_t* out) { std::memcpy(out, &header, kHeaderBytes); }
inline FrameHeader decode(const uint8_t* in) {
  FrameHeader header;
  std::memcpy(&header, in, kHeaderBytes);
  return header;
}

// Checks everything that does not need the receiver's tables: magic, version,
// type, reserved fields, lengths. Returns "" when valid, else why not.
inline std::string validate_header(const FrameHeader& h) {
  if (h.magic != kMagic) return "bad magic";
  if (h.version != kVersion) return "unsupported version " + std::to_string(h.version);
  if (h.reserved0 != 0 || h.reserved1 != 0) return "reserved fields not zero";
  switch (static_cast<FrameType>(h.type)) {
    case FrameType::kHello:
      if (h.length == 0 || h.length > kMaxEndpointBytes) return "bad hello length";
      return "";
    case FrameType::kWrite:
      if (h.length == 0 || h.length > kMaxPayloadBytes) return "bad write length " + std::to_string(h.length);
      if (h.batch_num_frames == 0 || h.batch_num_frames > kMaxBatchFrames) return "bad batch frame count";
      if (h.offset + h.length < h.offset) return "offset overflow";
      return "";
    case FrameType::kNotify:
      if (h.length != 0) return "notify with payload";
      if (h.batch_num_frames == 0 || h.batch_num_frames > kMaxBatchFrames) return "bad batch frame count";
      return "";
    case FrameType::kGoodbye:
      if (h.length != 0) return "goodbye with payload";
      return "";
    case FrameType::kQpConnect:
      if (h.length != kQpInfoBytes) return "bad queue-pair info length";
      return "";
  }
  return "unknown frame type " + std::to_string(h.type);
}

}  // namespace moe::transfer::wire
