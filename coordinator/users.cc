// --users-file parsing (see users.h).
#include "coordinator/users.h"

#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "coordinator/credential_lines.h"

namespace spindle {

absl::StatusOr<std::vector<UserToken>> ParseUsersFile(const std::string& text) {
  std::vector<UserToken> out;
  std::set<std::string> tokens, names;
  for (const CredentialLine& l : CredentialLines(text)) {
    const int line_no = l.number;
    const std::vector<std::string>& fields = l.fields;
    if (fields.size() < 2 || fields.size() > 3 || (fields.size() == 3 && fields[2] != "admin"))
      return absl::InvalidArgumentError(
          absl::StrCat("line ", line_no, ": expected TOKEN NAME or TOKEN NAME admin"));
    UserToken u;
    u.token = fields[0];
    u.user.name = fields[1];
    u.user.admin = fields.size() == 3;
    bool name_ok = !u.user.name.empty() && u.user.name.size() <= 64;
    for (char c : u.user.name)
      name_ok &= absl::ascii_isalnum(c) || c == '.' || c == '_' || c == '@' || c == '-';
    if (!name_ok)
      return absl::InvalidArgumentError(
          absl::StrCat("line ", line_no,
                       ": a user name is 1 to 64 characters of A-Z, a-z, 0-9, '.', '_', '@' "
                       "and '-'"));
    if (!tokens.insert(u.token).second)
      return absl::InvalidArgumentError(
          absl::StrCat("line ", line_no, " repeats a token of an earlier line"));
    if (!names.insert(u.user.name).second)
      return absl::InvalidArgumentError(
          absl::StrCat("line ", line_no, " repeats the user ", u.user.name));
    out.push_back(std::move(u));
  }
  if (out.empty()) return absl::InvalidArgumentError("no user in it");
  return out;
}

}  // namespace spindle
