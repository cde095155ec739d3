// Page sizes and page tokens of JobService.List (see job_pages.h).
#include "coordinator/job_pages.h"

#include <limits>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace spindle {
namespace {

constexpr char kTokenPrefix[] = "before-";

}  // namespace

absl::StatusOr<int> ListPageSize(int page_size) {
  if (page_size < 0)
    return absl::InvalidArgumentError(
        absl::StrCat("list: page_size must not be negative, got ", page_size));
  if (page_size == 0) return kDefaultListPageSize;
  return page_size > kMaxListPageSize ? kMaxListPageSize : page_size;
}

std::string MakePageToken(int64_t before_seq) { return absl::StrCat(kTokenPrefix, before_seq); }

absl::StatusOr<int64_t> ParsePageToken(const std::string& token) {
  if (token.empty()) return std::numeric_limits<int64_t>::max();
  int64_t seq = 0;
  if (token.size() > 64 || !absl::StartsWith(token, kTokenPrefix) ||
      !absl::SimpleAtoi(token.substr(sizeof(kTokenPrefix) - 1), &seq) || seq <= 0)
    return absl::InvalidArgumentError(
        "list: page_token is not one this coordinator issued (pass a next_page_token from a "
        "previous List, or none for the first page)");
  return seq;
}

}  // namespace spindle
