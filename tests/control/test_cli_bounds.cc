// The `spindle` CLI against the coordinator's bounds: `spindle list` pages through more jobs
// than one page holds (an in-process coordinator on 127.0.0.1), and `spindle submit` sends a
// fresh request id per invocation and retries an unreachable coordinator with the same id (a
// JobService that drops the first call).
#include <algorithm>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "cli/cli.h"
#include "coordinator/coordinator_server.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "spindle/v1/job.grpc.pb.h"
#include "tests/control/test_util.h"

namespace spindle {
namespace {

using testing::SpecJson;
using testing::WithCheckpointDir;

struct Result {
  int code;
  std::string out, err;
};

Result RunSpindle(const std::vector<std::string>& args) {
  std::ostringstream out, err;
  int code = RunCli(args, {}, out, err, false);
  return {code, out.str(), err.str()};
}

size_t Lines(const std::string& s) { return std::count(s.begin(), s.end(), '\n'); }

TEST(CliBoundsTest, ListPagesThroughEveryJob) {
  testing::TempDir dir;
  CoordinatorConfig cfg;
  cfg.listen = "127.0.0.1:0";
  cfg.db_path = dir.File("c.db");
  auto server = CoordinatorServer::Start(cfg);
  ASSERT_TRUE(server.ok()) << server.status();
  for (int i = 0; i < 230; ++i)  // more than two pages of the default 100
    ASSERT_TRUE((*server)
                    ->manager()
                    ->Submit(WithCheckpointDir(SpecJson(), absl::StrCat("/tmp/ck-", i)), nullptr)
                    .ok());
  const std::string address = absl::StrCat("127.0.0.1:", (*server)->client_port());

  Result r = RunSpindle({"list", "--coordinator", address});
  ASSERT_EQ(r.code, kExitOk) << r.err;
  EXPECT_EQ(Lines(r.out), 231u);  // the header and every job
  std::vector<std::string> lines = absl::StrSplit(r.out, '\n');
  EXPECT_EQ(lines[1].substr(0, 8), "j-000230");
  EXPECT_EQ(lines[230].substr(0, 8), "j-000001");

  r = RunSpindle({"list", "--limit", "150", "--coordinator", address});
  ASSERT_EQ(r.code, kExitOk) << r.err;
  EXPECT_EQ(Lines(r.out), 151u);

  r = RunSpindle({"list", "--state", "queued", "--output", "json", "--coordinator", address});
  ASSERT_EQ(r.code, kExitOk) << r.err;
  EXPECT_EQ(Lines(r.out), 1u);
  size_t jobs = 0;
  for (size_t p = r.out.find("\"job_id\""); p != std::string::npos;
       p = r.out.find("\"job_id\"", p + 1))
    ++jobs;
  EXPECT_EQ(jobs, 230u);
}

// Drops the first Submit (as a reply lost on the way back would look), answers the others.
class DroppingJobService final : public v1::JobService::Service {
 public:
  grpc::Status Submit(grpc::ServerContext*, const v1::SubmitJobRequest* req,
                      v1::SubmitJobResponse* resp) override {
    absl::MutexLock l(&mu_);
    request_ids_.push_back(req->request_id());
    if (request_ids_.size() % 2 == 1)
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "connection reset");
    resp->set_job_id("j-000007");
    resp->set_state(v1::JOB_STATE_QUEUED);
    return grpc::Status::OK;
  }
  std::vector<std::string> request_ids() {
    absl::MutexLock l(&mu_);
    return request_ids_;
  }

 private:
  absl::Mutex mu_;
  std::vector<std::string> request_ids_ ABSL_GUARDED_BY(mu_);
};

TEST(CliBoundsTest, SubmitRetriesWithTheSameRequestId) {
  testing::TempDir dir;
  const std::string spec = dir.File("job.json");
  std::ofstream(spec) << SpecJson();
  DroppingJobService service;
  grpc::ServerBuilder b;
  int port = 0;
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  b.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = b.BuildAndStart();
  ASSERT_NE(port, 0);
  const std::string address = absl::StrCat("127.0.0.1:", port);

  Result r = RunSpindle({"submit", spec, "--coordinator", address});
  EXPECT_EQ(r.code, kExitOk) << r.err;
  EXPECT_EQ(r.out, "submitted j-000007 (queued)\n");
  EXPECT_EQ(r.err, "spindle: submit: cannot reach the coordinator at " + address +
                       "; retrying (attempt 2 of 4)\n");
  r = RunSpindle({"submit", spec, "--coordinator", address});
  EXPECT_EQ(r.code, kExitOk) << r.err;

  std::vector<std::string> ids = service.request_ids();
  ASSERT_EQ(ids.size(), 4u);
  EXPECT_EQ(ids[0], ids[1]);  // the retry carries the first call's id
  EXPECT_EQ(ids[2], ids[3]);
  EXPECT_NE(ids[0], ids[2]);  // each invocation its own
  EXPECT_EQ(ids[0].substr(0, 4), "cli-");
  EXPECT_EQ(ids[0].size(), 36u);
  server->Shutdown();
}

}  // namespace
}  // namespace spindle
