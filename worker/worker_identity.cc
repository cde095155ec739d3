// The worker's key and certificate, from its identity directory or by Join (see
// worker_identity.h).
#include "worker/worker_identity.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/pem.h"
#include "common/status.h"
#include "common/x509.h"
#include "spindle/v1/cluster.grpc.pb.h"
#include "worker/grpc_client.h"

namespace spindle {
namespace {

std::string ReadText(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return "";
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Replaces `path` with `text` atomically (a temporary file renamed over it), with `mode`.
absl::Status WriteFileAtomically(const std::filesystem::path& path, const std::string& text,
                                 mode_t mode) {
  const std::string tmp = path.string() + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
  if (fd < 0)
    return absl::FailedPreconditionError(
        absl::StrCat("cannot write ", tmp, ": ", std::strerror(errno)));
  const bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()) &&
                  ::fsync(fd) == 0;
  ::close(fd);
  if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    return absl::FailedPreconditionError(absl::StrCat("cannot write ", path.string()));
  }
  return absl::OkStatus();
}

// Why the stored certificate cannot serve `worker_id`; "" when it can.
std::string StoredProblem(const std::string& key, const std::string& cert, const std::string& ca,
                          const std::string& worker_id) {
  if (key.empty() || cert.empty()) return "no certificate yet";
  absl::StatusOr<CertificateInfo> info = ParseCertificate(cert);
  if (!info.ok()) return "the stored certificate cannot be read";
  if (info->common_names.size() != 1 || info->common_names[0] != worker_id)
    return "the stored certificate is for another worker id";
  if (absl::Status st = CheckCertificate(cert, ca, key); !st.ok()) return std::string(st.message());
  return "";
}

}  // namespace

absl::StatusOr<WorkerIdentity> ObtainWorkerIdentity(const WorkerIdentityOptions& o) {
  ASSIGN_OR_RETURN(std::string ca,
                   ReadPemFile(o.tls_ca_file, PemKind::kCertificate, "--tls-ca-file"));
  const std::filesystem::path dir(o.identity_dir);
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec)
    return absl::FailedPreconditionError(
        absl::StrCat("--identity-dir ", o.identity_dir, ": ", ec.message()));
  std::filesystem::permissions(dir, std::filesystem::perms::owner_all, ec);
  WorkerIdentity id;
  id.key_pem = ReadText(dir / "key.pem");
  id.cert_pem = ReadText(dir / "cert.pem");
  const std::string problem = StoredProblem(id.key_pem, id.cert_pem, ca, o.worker_id);
  if (problem.empty()) return id;
  if (o.bootstrap_token_file.empty())
    return absl::FailedPreconditionError(
        absl::StrCat("no usable certificate in ", o.identity_dir, " (", problem,
                     ") and no --bootstrap-token-file to join with"));
  ASSIGN_OR_RETURN(std::string token, ReadTokenFile(o.bootstrap_token_file));

  // A new key for every join: a key that may have leaked with an old certificate is not reused.
  ASSIGN_OR_RETURN(id.key_pem, GeneratePrivateKey());
  ASSIGN_OR_RETURN(std::string csr, MakeCertificateRequest(id.key_pem, o.worker_id));
  ChannelOptions channel_options;
  channel_options.address = o.coordinator_address;
  channel_options.tls_ca_file = o.tls_ca_file;
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel, MakeCoordinatorChannel(channel_options));
  auto stub = v1::ClusterService::NewStub(channel);
  v1::JoinRequest req;
  req.set_bootstrap_token(token);
  req.set_csr_pem(csr);
  v1::JoinResponse resp;
  const absl::Time give_up = absl::Now() + o.join_timeout;
  grpc::Status st;
  for (;;) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    ctx.set_wait_for_ready(true);
    st = stub->Join(&ctx, req, &resp);
    const bool retry = st.error_code() == grpc::StatusCode::UNAVAILABLE ||
                       st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
    if (!retry || absl::Now() >= give_up) break;
    absl::SleepFor(absl::Milliseconds(500));
  }
  if (!st.ok()) return FromGrpcStatus(st, "coordinator");
  id.cert_pem = resp.certificate_pem();
  id.joined = true;
  // The key first: a certificate beside an older key is what the next start would refuse.
  RETURN_IF_ERROR(WriteFileAtomically(dir / "key.pem", id.key_pem, 0600));
  RETURN_IF_ERROR(WriteFileAtomically(dir / "cert.pem", id.cert_pem, 0644));
  return id;
}

}  // namespace spindle
