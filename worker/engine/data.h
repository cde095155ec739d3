// Training data: a packed token stream cut into sequences of seq_len tokens, deterministic from
// the seed. Sources (DESIGN.md section 5):
//   tokens:<path>   little-endian uint16/uint32 ids; documents end with eos_id; the file is the
//                   stream, read in order and wrapped around at its end. Mapped, not loaded:
//                   a corpus of any size costs page cache, not the trainer's memory.
//   text:<path>     UTF-8 bytes as tokens 0..255; each paragraph (text between blank lines) is a
//                   document ending with EOS = 256. Also mapped: opening walks the file once and
//                   keeps 16 bytes per 4096 tokens to find any sequence from.
//   synthetic:recall  documents of key-value pairs, filler, then queries of the same keys in a
//                   random order: each answer is predictable only from the pair thousands of
//                   tokens earlier. EOS = 256; vocab >= 257.
//   synthetic:copy  a random string, a separator, the same string again.
// Sequence n is a pure function of (source, seed, n), so the data position is one integer and
// resuming is exact. Thread-compatible: const methods may be called concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/job_spec.h"
#include "common/text_tokens.h"

namespace spindle {

class DataSource {
 public:
  virtual ~DataSource() = default;
  // Tokens of sequence n (exactly seq_len of them).
  virtual std::vector<int32_t> Sequence(int64_t n) const = 0;
  virtual int32_t eos_id() const = 0;
  // Tokens whose targets are the recall answers (synthetic:recall only): marks, for evaluation,
  // which positions can only be predicted from far-away context. Empty for other sources.
  virtual std::vector<bool> AnswerMask(int64_t n) const { return {}; }
};

// Opens and validates the job's data: a missing, empty or truncated file, or a token id outside
// [0, vocab), is an error naming the file (and the offending offset).
absl::StatusOr<std::unique_ptr<DataSource>> OpenDataSource(const DataSpec& spec, int64_t seq_len,
                                                           int64_t vocab, uint64_t seed);

}  // namespace spindle
