// The documents of a job's data file as its attention sees them, measured from a bounded sample of
// the file: data.doc_span (common/job_spec.h), sum(L^2) / sum(L) over the documents L as the job's
// sequences cut them (a document starts at a sequence's first token and after each EOS; the
// sequence boundary cuts the last). The engine's attention works within documents only, so this is
// what the planner's cost model counts causal attention with (T doc_span / 2 query-key pairs a
// sequence of T tokens).
//
// The formats have no header or index of their documents, so rather than reading a corpus whole
// the sample reads whole sequences of the file, spread evenly over the ones the job reads (steps x
// dp x micro-batches of them, wrapping around the file like the data source): up to 64 sequences
// and kMaxSampledTokens tokens in all (16 MiB of a 4-byte token file), so the cost does not grow
// with the file. A token file's sequence n is its tokens [n T, (n + 1) T); a text file's is taken
// at byte n T (its tokens are its bytes but for paragraph breaks, common/text_tokens.h).
//
// Thread-safety: free functions; they read the file and keep nothing.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "common/job_spec.h"

namespace spindle {

inline constexpr int64_t kMaxSampledTokens = int64_t{1} << 22;

// The sample's doc_span of `spec`'s data file. NotFound for a file that cannot be opened,
// InvalidArgument for a synthetic source, an empty file, or a token file whose size is not a
// multiple of its tokens' width; each names the file.
absl::StatusOr<double> SampleDocumentSpan(const JobSpec& spec);

// `spec` with data.doc_span measured (SampleDocumentSpan) when it is a file source whose doc_span
// the spec leaves out and the file can be read here; otherwise `spec` as it is. `note` (nullable)
// gets why it was not measured ("" when it was, or when nothing was to measure).
JobSpec WithDocumentSpan(JobSpec spec, std::string* note = nullptr);

}  // namespace spindle
