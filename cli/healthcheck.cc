// Health probes (see healthcheck.h).
#include "cli/healthcheck.h"

#include <httplib.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/message_limits.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"

namespace spindle {
namespace {

// Reads a base-128 varint at bytes[*pos]; advances *pos.
bool ReadVarint(const std::string& bytes, size_t* pos, uint64_t* value) {
  *value = 0;
  for (int shift = 0; shift < 64 && *pos < bytes.size(); shift += 7) {
    const uint8_t b = static_cast<uint8_t>(bytes[(*pos)++]);
    *value |= static_cast<uint64_t>(b & 0x7f) << shift;
    if ((b & 0x80) == 0) return true;
  }
  return false;
}

}  // namespace

const char* ServingStatusName(ServingStatus status) {
  switch (status) {
    case ServingStatus::kServing:
      return "SERVING";
    case ServingStatus::kNotServing:
      return "NOT_SERVING";
    case ServingStatus::kServiceUnknown:
      return "SERVICE_UNKNOWN";
    case ServingStatus::kUnknown:
      break;
  }
  return "UNKNOWN";
}

std::string EncodeHealthCheckRequest(const std::string& service) {
  if (service.empty()) return "";  // proto3: a default string is not written
  std::string out = "\x0a";        // field 1, length-delimited
  for (uint64_t n = service.size(); true; n >>= 7) {
    if (n < 0x80) {
      out.push_back(static_cast<char>(n));
      break;
    }
    out.push_back(static_cast<char>((n & 0x7f) | 0x80));
  }
  return out + service;
}

absl::StatusOr<ServingStatus> DecodeHealthCheckResponse(const std::string& bytes) {
  const absl::Status malformed =
      absl::DataLossError("malformed grpc.health.v1.HealthCheckResponse");
  uint64_t status = 0;  // an absent field is UNKNOWN
  size_t pos = 0;
  while (pos < bytes.size()) {
    uint64_t key = 0;
    uint64_t value = 0;
    if (!ReadVarint(bytes, &pos, &key)) return malformed;
    switch (key & 7) {  // wire type; unknown fields are skipped
      case 0:
        if (!ReadVarint(bytes, &pos, &value)) return malformed;
        if ((key >> 3) == 1) status = value;
        break;
      case 1:
      case 5: {
        const size_t width = (key & 7) == 1 ? 8 : 4;
        if (bytes.size() - pos < width) return malformed;
        pos += width;
        break;
      }
      case 2:
        if (!ReadVarint(bytes, &pos, &value) || value > bytes.size() - pos) return malformed;
        pos += value;
        break;
      default:
        return malformed;
    }
  }
  return status <= 3 ? static_cast<ServingStatus>(status) : ServingStatus::kUnknown;
}

absl::StatusOr<ServingStatus> CheckGrpcHealth(const GrpcHealthOptions& options) {
  std::shared_ptr<grpc::ChannelCredentials> creds;
  if (options.tls_ca_pem.empty()) {
    creds = grpc::InsecureChannelCredentials();
  } else {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls_ca_pem;
    creds = grpc::SslCredentials(ssl);
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxGrpcMessageBytes);
  args.SetMaxSendMessageSize(kMaxGrpcMessageBytes);
  std::shared_ptr<grpc::Channel> channel = grpc::CreateCustomChannel(options.address, creds, args);
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(options.timeout));
  const std::string request_bytes = EncodeHealthCheckRequest(options.service);
  grpc::Slice slice(request_bytes);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;

  absl::Mutex mu;
  bool done = false;
  grpc::Status result;
  stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                 [&](grpc::Status st) {
                   absl::MutexLock lock(&mu);
                   result = std::move(st);
                   done = true;
                 });
  {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(&done));
  }
  if (!result.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(result.error_code()),
                        absl::StrCat("grpc.health.v1.Health/Check on ", options.address, ": ",
                                     result.error_message()));
  }
  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) {
    return absl::DataLossError("unreadable grpc.health.v1.HealthCheckResponse");
  }
  std::string bytes;
  for (const grpc::Slice& s : slices) {
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return DecodeHealthCheckResponse(bytes);
}

absl::Status CheckHttpHealth(const std::string& host, int port, const std::string& path,
                             absl::Duration timeout) {
  httplib::Client client(host, port);
  const int64_t usec = absl::ToInt64Microseconds(timeout);
  client.set_connection_timeout(usec / 1000000, usec % 1000000);
  client.set_read_timeout(usec / 1000000, usec % 1000000);
  httplib::Result res = client.Get(path);
  const std::string url = absl::StrCat("http://", host, ":", port, path);
  if (!res) {
    return absl::UnavailableError(absl::StrCat("GET ", url, ": ", httplib::to_string(res.error())));
  }
  if (res->status != 200) {
    return absl::UnavailableError(absl::StrCat("GET ", url, ": HTTP ", res->status));
  }
  return absl::OkStatus();
}

}  // namespace spindle
