// The users of a coordinator: each bearer token of --users-file names one user, some of them
// admins. A job records the user who submitted it (its owner); only the owner or an admin may
// cancel it, and only an admin may revoke a worker. Plain data and the file's parser.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace spindle {

struct User {
  std::string name;  // "" when the coordinator does not authenticate users
  bool admin = false;
};

struct UserToken {
  std::string token;
  User user;
};

// A --users-file: one user a line, "TOKEN NAME" or "TOKEN NAME admin"; blank lines and lines
// starting with '#' are skipped. NAME is 1 to 64 characters of [A-Za-z0-9._@-]. InvalidArgument
// naming the line for another shape, a repeated token or name, or a file without a user.
absl::StatusOr<std::vector<UserToken>> ParseUsersFile(const std::string& text);

}  // namespace spindle
