// Batch: one training sequence (or this rank's share of it) in the engine's single layout.
// Tokens are token-major; every per-token attribute (RoPE position, document id, stream index,
// target) travels with its token, so context parallelism can reorder tokens freely.
// Plain data; no thread-safety concerns.
#pragma once

#include <cstdint>
#include <vector>

namespace spindle {

// A contiguous run of the packed stream held locally (cp = 1: the whole sequence; zigzag CP:
// two chunks per rank).
struct Piece {
  int64_t begin = 0;  // first local token index
  int64_t len = 0;
  // Document starts inside the piece, relative to `begin`: cu_seqlens[0] = 0, ..., back() = len.
  std::vector<int32_t> cu_seqlens;
  // True when the piece's first token continues a document begun in an earlier piece.
  bool continues = false;
  int64_t n_segments() const { return static_cast<int64_t>(cu_seqlens.size()) - 1; }
};

struct Batch {
  int64_t T = 0;                 // local tokens
  std::vector<int32_t> ids;      // [T] token ids
  std::vector<int32_t> targets;  // [T] next token of the same document, -1 = ignored
  std::vector<int32_t> pos;      // [T] RoPE position (restarts at each document start)
  std::vector<int32_t> doc;      // [T] document id (non-decreasing in stream order)
  std::vector<int32_t> idx;      // [T] index in the packed sequence (stream order)
  std::vector<Piece> pieces;     // contiguous runs, in local order

  int64_t NumValidTargets() const {
    int64_t n = 0;
    for (int32_t t : targets) n += t >= 0;
    return n;
  }
};

// Builds the batch of one whole sequence of tokens: a new document begins after every `eos_id`
// (and at token 0); targets are the next token of the same document inside the sequence.
Batch MakeSequenceBatch(const std::vector<int32_t>& tokens, int32_t eos_id);

// The query-key pairs causal attention within each document of a whole-sequence batch spans, by
// the convention of ModelConfig::TrainFlops: the sum over documents of L^2 / 2.
double AttentionPairs(const Batch& full);

// Zigzag: the sequence is cut into 2*cp equal chunks and rank r holds chunks r (its slot 0) and
// 2cp-1-r (slot 1), in that order.
inline int64_t ZigzagChunk(int64_t cp, int64_t rank, int64_t slot) {
  return slot == 0 ? rank : 2 * cp - 1 - rank;
}
inline int64_t ZigzagRank(int64_t cp, int64_t chunk) {
  return chunk < cp ? chunk : 2 * cp - 1 - chunk;
}
inline int64_t ZigzagSlot(int64_t cp, int64_t chunk) { return chunk < cp ? 0 : 1; }

// This rank's zigzag share of a whole-sequence batch. seq T must be divisible by 2*cp.
Batch ShardZigzag(const Batch& full, int64_t cp, int64_t rank);

}  // namespace spindle
