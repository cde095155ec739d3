// Sequence batches and their zigzag sharding (see batch.h).
#include "worker/engine/batch.h"

namespace spindle {
namespace {

// Appends the piece covering [begin, begin + len) of `src`'s stream order to `out`.
void AppendPiece(const Batch& src, int64_t begin, int64_t len, Batch* out) {
  Piece p;
  p.begin = out->T;
  p.len = len;
  p.continues = begin > 0 && src.doc[begin] == src.doc[begin - 1];
  p.cu_seqlens.push_back(0);
  for (int64_t i = 1; i < len; ++i)
    if (src.doc[begin + i] != src.doc[begin + i - 1]) p.cu_seqlens.push_back(static_cast<int32_t>(i));
  p.cu_seqlens.push_back(static_cast<int32_t>(len));
  for (int64_t i = begin; i < begin + len; ++i) {
    out->ids.push_back(src.ids[i]);
    out->targets.push_back(src.targets[i]);
    out->pos.push_back(src.pos[i]);
    out->doc.push_back(src.doc[i]);
    out->idx.push_back(src.idx[i]);
  }
  out->T += len;
  out->pieces.push_back(std::move(p));
}

}  // namespace

double AttentionPairs(const Batch& full) {
  double pairs = 0.0;
  int64_t run = 0;
  for (int64_t t = 0; t < full.T; ++t) {
    ++run;
    if (t + 1 == full.T || full.doc[t + 1] != full.doc[t]) {
      pairs += static_cast<double>(run) * static_cast<double>(run) / 2.0;
      run = 0;
    }
  }
  return pairs;
}

Batch MakeSequenceBatch(const std::vector<int32_t>& tokens, int32_t eos_id) {
  Batch b;
  const int64_t T = static_cast<int64_t>(tokens.size());
  b.T = T;
  b.ids = tokens;
  b.targets.assign(T, -1);
  b.pos.resize(T);
  b.doc.resize(T);
  b.idx.resize(T);
  int32_t doc = 0, pos = 0;
  for (int64_t i = 0; i < T; ++i) {
    if (i > 0 && tokens[i - 1] == eos_id) {
      ++doc;
      pos = 0;
    }
    b.doc[i] = doc;
    b.pos[i] = pos++;
    b.idx[i] = static_cast<int32_t>(i);
    if (i + 1 < T && tokens[i] != eos_id) b.targets[i] = tokens[i + 1];
  }
  Batch whole;
  AppendPiece(b, 0, T, &whole);
  return whole;
}

Batch ShardZigzag(const Batch& full, int64_t cp, int64_t rank) {
  const int64_t chunk = full.T / (2 * cp);
  Batch out;
  for (int64_t slot = 0; slot < 2; ++slot)
    AppendPiece(full, ZigzagChunk(cp, rank, slot) * chunk, chunk, &out);
  return out;
}

}  // namespace spindle
