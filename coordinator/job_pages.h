// Paging of JobService.List: the page size a request gets and the page tokens. A token names a
// position in submission order (the next page holds jobs submitted before it), not an offset,
// so pages neither repeat nor skip jobs while others are submitted or pruned.
// Thread-safety: stateless functions.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace spindle {

inline constexpr int kDefaultListPageSize = 100;
inline constexpr int kMaxListPageSize = 1000;

// The page size for a request's `page_size`: 0 the default, above the maximum the maximum.
// InvalidArgument for a negative size.
absl::StatusOr<int> ListPageSize(int page_size);

// The token of a page that starts below sequence number `before_seq` (> 0).
std::string MakePageToken(int64_t before_seq);

// The sequence number a token starts below; INT64_MAX for "" (the first page). InvalidArgument
// for a token MakePageToken did not make.
absl::StatusOr<int64_t> ParsePageToken(const std::string& token);

}  // namespace spindle
