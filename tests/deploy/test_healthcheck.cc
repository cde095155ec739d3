// Tests for cli/healthcheck.h: the hand-encoded grpc.health.v1 messages, and the probes against
// an in-process gRPC server with the default health service and an HTTP server on 127.0.0.1.
#include <httplib.h>

#include <thread>

#include "absl/strings/str_cat.h"
#include "cli/healthcheck.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "gtest/gtest.h"

namespace spindle {
namespace {

TEST(HealthMessagesTest, EncodesTheRequest) {
  EXPECT_EQ(EncodeHealthCheckRequest(""), "");
  EXPECT_EQ(EncodeHealthCheckRequest("svc"), std::string("\x0a\x03svc", 5));
  const std::string long_name(200, 'x');
  EXPECT_EQ(EncodeHealthCheckRequest(long_name), std::string("\x0a\xc8\x01", 3) + long_name);
}

TEST(HealthMessagesTest, DecodesTheResponse) {
  EXPECT_EQ(*DecodeHealthCheckResponse(""), ServingStatus::kUnknown);
  EXPECT_EQ(*DecodeHealthCheckResponse(std::string("\x08\x01", 2)), ServingStatus::kServing);
  EXPECT_EQ(*DecodeHealthCheckResponse(std::string("\x08\x02", 2)), ServingStatus::kNotServing);
  EXPECT_EQ(*DecodeHealthCheckResponse(std::string("\x08\x03", 2)), ServingStatus::kServiceUnknown);
  EXPECT_EQ(*DecodeHealthCheckResponse(std::string("\x08\x07", 2)), ServingStatus::kUnknown);
  // Unknown fields of every wire type are skipped.
  EXPECT_EQ(*DecodeHealthCheckResponse(std::string("\x12\x02hi\x08\x01\x19", 7) +
                                       std::string(8, '\0') + std::string("\x25\0\0\0\0", 5)),
            ServingStatus::kServing);
  EXPECT_EQ(DecodeHealthCheckResponse(std::string("\x08", 1)).status(),
            absl::DataLossError("malformed grpc.health.v1.HealthCheckResponse"));
  EXPECT_EQ(DecodeHealthCheckResponse(std::string("\x12\x05hi", 4)).status().code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(DecodeHealthCheckResponse(std::string("\x0f", 1)).status().code(),
            absl::StatusCode::kDataLoss);
}

TEST(GrpcHealthTest, ReportsServingNotServingUnknownAndUnreachable) {
  grpc::EnableDefaultHealthCheckService(true);
  int port = 0;
  grpc::CallbackGenericService nothing;  // a server needs a service besides health
  grpc::ServerBuilder builder;
  builder.RegisterCallbackGenericService(&nothing);
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  server->GetHealthCheckService()->SetServingStatus("spindle.v1.JobService", false);

  GrpcHealthOptions o;
  o.address = "127.0.0.1:" + std::to_string(port);
  EXPECT_EQ(*CheckGrpcHealth(o), ServingStatus::kServing);
  o.service = "spindle.v1.JobService";
  EXPECT_EQ(*CheckGrpcHealth(o), ServingStatus::kNotServing);
  o.service = "no.such.Service";
  EXPECT_EQ(CheckGrpcHealth(o).status().code(), absl::StatusCode::kNotFound);
  server->Shutdown();
  server.reset();

  o.service = "";
  o.timeout = absl::Milliseconds(500);
  const absl::StatusCode code = CheckGrpcHealth(o).status().code();
  EXPECT_TRUE(code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kDeadlineExceeded)
      << code;
}

TEST(HttpHealthTest, OkOn200AndUnavailableOtherwise) {
  httplib::Server http;
  http.Get("/healthz", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("ok", "text/plain");
  });
  const int port = http.bind_to_any_port("127.0.0.1");
  ASSERT_GT(port, 0);
  std::thread serve([&] { http.listen_after_bind(); });
  while (!http.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_TRUE(CheckHttpHealth("127.0.0.1", port, "/healthz", absl::Seconds(2)).ok());
  EXPECT_EQ(
      CheckHttpHealth("127.0.0.1", port, "/missing", absl::Seconds(2)),
      absl::UnavailableError(absl::StrCat("GET http://127.0.0.1:", port, "/missing: HTTP 404")));
  http.stop();
  serve.join();
  EXPECT_EQ(CheckHttpHealth("127.0.0.1", port, "/healthz", absl::Seconds(1)).code(),
            absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace spindle
