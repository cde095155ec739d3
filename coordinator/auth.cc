// Bearer-token check (see auth.h).
#include "coordinator/auth.h"

#include <algorithm>

namespace spindle {

bool ConstantTimeEquals(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? a[i] : 0, y = i < b.size() ? b[i] : 0;
    diff |= x ^ y;
  }
  return diff == 0;
}

grpc::Status TokenAuth::Check(const grpc::ServerContext& ctx) const {
  if (token_.empty()) return grpc::Status::OK;
  const auto& md = ctx.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end())
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "missing authorization metadata (expected \"Bearer <token>\")");
  const std::string value(it->second.data(), it->second.size());
  static constexpr char kPrefix[] = "Bearer ";
  const std::string expected = kPrefix + token_;
  if (!ConstantTimeEquals(value, expected))
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "invalid bearer token");
  return grpc::Status::OK;
}

}  // namespace spindle
