// A data file's document span from a bounded sample of its sequences (see document_span.h).
#include "common/document_span.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/text_tokens.h"

namespace spindle {
namespace {

constexpr int64_t kMaxSampledSequences = 64;

// Sums over the segments of sampled sequences: sum(L^2) and sum(L).
struct SpanSums {
  double squares = 0, tokens = 0;
  // One sequence's tokens: a document starts at its first token and after each `eos`.
  template <typename Next>
  void AddSequence(int64_t seq_len, int64_t eos, Next next) {
    double run = 0;
    for (int64_t i = 0; i < seq_len; ++i) {
      const int64_t t = next();
      if (t < 0) break;  // the sample's bytes ran out (a text file's last sequence)
      run += 1;
      if (t == eos) squares += run * run, tokens += run, run = 0;
    }
    squares += run * run, tokens += run;
  }
  double Span() const { return tokens > 0 ? squares / tokens : 0; }
};

// Reads `n` bytes at `offset` of `f` into `out` (fewer at the file's end).
void ReadAt(std::ifstream& f, int64_t offset, int64_t n, std::vector<unsigned char>* out) {
  out->resize(static_cast<size_t>(n));
  f.clear();
  f.seekg(offset);
  f.read(reinterpret_cast<char*>(out->data()), n);
  out->resize(static_cast<size_t>(std::max<std::streamsize>(0, f.gcount())));
}

}  // namespace

absl::StatusOr<double> SampleDocumentSpan(const JobSpec& spec) {
  const DataSpec& d = spec.data;
  if (d.kind == DataKind::kSynthetic)
    return absl::InvalidArgumentError(
        absl::StrCat("data: ", d.source, " is synthetic; its documents are known"));
  std::ifstream f(d.path, std::ios::binary | std::ios::ate);
  if (!f)
    return absl::NotFoundError(
        absl::StrCat("data: cannot open \"", d.path, "\": ", std::strerror(errno)));
  const auto size = static_cast<int64_t>(f.tellg());
  const int64_t width = d.kind == DataKind::kTokens ? d.token_bytes : 1;
  if (size <= 0) return absl::InvalidArgumentError(absl::StrCat("data: \"", d.path, "\" is empty"));
  if (size % width != 0)
    return absl::InvalidArgumentError(absl::StrCat("data: \"", d.path, "\" is truncated: ", size,
                                                   " bytes is not a multiple of ", width,
                                                   "-byte tokens"));
  const int64_t T = std::max<int64_t>(1, spec.seq_len);
  const int64_t stream = size / width;  // tokens (text: about)
  // The sequences the job reads, as far as they differ: the file holds ceil(stream / T).
  const int64_t job_sequences = std::max<int64_t>(
      1, spec.train.steps * spec.parallel.dp * std::max<int64_t>(1, spec.train.micro_batches));
  const int64_t distinct = std::min(job_sequences, (stream + T - 1) / T);
  const int64_t k =
      std::clamp<int64_t>(kMaxSampledTokens / T, 1, std::min(kMaxSampledSequences, distinct));
  SpanSums sums;
  std::vector<unsigned char> buf;
  for (int64_t i = 0; i < k; ++i) {
    const int64_t n = static_cast<int64_t>(static_cast<double>(i) * static_cast<double>(distinct) /
                                           static_cast<double>(k));
    const int64_t start = static_cast<int64_t>(
        (static_cast<unsigned __int128>(n) * static_cast<uint64_t>(T)) % stream);
    if (d.kind == DataKind::kTokens) {
      // T tokens from `start`, wrapping around the file's end like the data source.
      std::vector<unsigned char> head;
      ReadAt(f, start * width, std::min(T, stream - start) * width, &buf);
      if (start + T > stream) ReadAt(f, 0, std::min(stream, start + T - stream) * width, &head);
      buf.insert(buf.end(), head.begin(), head.end());
      int64_t at = 0;
      const int64_t have = static_cast<int64_t>(buf.size()) / width;
      sums.AddSequence(T, d.eos_id, [&]() -> int64_t {
        if (at >= have) at = 0;  // a file shorter than a sequence repeats
        const unsigned char* p = buf.data() + at++ * width;
        return width == 2 ? int64_t{p[0]} | (int64_t{p[1]} << 8)
                          : int64_t{p[0]} | (int64_t{p[1]} << 8) | (int64_t{p[2]} << 16) |
                                (int64_t{p[3]} << 24);
      });
    } else {
      // About T tokens from byte `start`, begun after the newlines there (so that the cursor
      // starts where one from byte 0 could be); a break's run takes more bytes than tokens.
      ReadAt(f, start, std::min<int64_t>(2 * T + 2, size - start), &buf);
      size_t from = 0;
      while (from < buf.size() && buf[from] == '\n') ++from;
      const bool whole_rest = start + static_cast<int64_t>(buf.size()) >= size;
      TextCursor c(buf.data(), buf.size(), from);
      sums.AddSequence(T, kByteEos, [&]() -> int64_t {
        // Past the sample's bytes the stream goes on unless they reach the file's end: stop
        // there rather than count the cursor's closing EOS as a document end.
        if (!whole_rest && c.byte() >= buf.size()) return -1;
        return c.Next();
      });
    }
  }
  if (sums.tokens <= 0)
    return absl::InvalidArgumentError(absl::StrCat("data: \"", d.path, "\" gave no tokens"));
  return sums.Span();
}

JobSpec WithDocumentSpan(JobSpec spec, std::string* note) {
  if (note) note->clear();
  if (spec.data.kind == DataKind::kSynthetic || spec.data.doc_span > 0) return spec;
  absl::StatusOr<double> span = SampleDocumentSpan(spec);
  if (span.ok()) {
    spec.data.doc_span = std::max(1.0, *span);
  } else if (note) {
    *note = absl::StrCat("documents not measured (", span.status().message(),
                         "): attention counted as one document a sequence; data.doc_span gives "
                         "their span");
  }
  return spec;
}

}  // namespace spindle
