// Constant-time comparison of secrets, for the coordinator's bearer tokens (credentials.h).
#pragma once

#include <string>

namespace spindle {

// Constant-time equality (time depends only on the lengths).
bool ConstantTimeEquals(const std::string& a, const std::string& b);

}  // namespace spindle
