// Users own their jobs: --users-file parsing, the owner a job records (in SQLite, with the
// migration of a database from before owners), who may cancel, `list --mine`, the user's name
// in the events of every change they caused, and request ids that answer only their own user;
// over real gRPC on 127.0.0.1 and in the CLI.
#include <sqlite3.h>

#include <memory>
#include <sstream>

#include "cli/cli.h"
#include "coordinator/coordinator_server.h"
#include "coordinator/sqlite_job_store.h"
#include "coordinator/users.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "spindle/v1/job.grpc.pb.h"
#include "tests/control/test_util.h"

namespace spindle {
namespace {

using testing::SpecJson;
using testing::TempDir;
using testing::WithCheckpointDir;

TEST(UsersFileTest, ParsesUsersAndNamesTheBadLine) {
  absl::StatusOr<std::vector<UserToken>> u =
      ParseUsersFile("# who\nt-alice alice\n\nt-root root admin\n");
  ASSERT_TRUE(u.ok()) << u.status();
  ASSERT_EQ(u->size(), 2u);
  EXPECT_EQ((*u)[0].user.name, "alice");
  EXPECT_FALSE((*u)[0].user.admin);
  EXPECT_TRUE((*u)[1].user.admin);
  EXPECT_EQ(ParseUsersFile("t alice root\n").status().message(),
            "line 1: expected TOKEN NAME or TOKEN NAME admin");
  EXPECT_EQ(ParseUsersFile("t1 alice\nt1 bob\n").status().message(),
            "line 2 repeats a token of an earlier line");
  EXPECT_EQ(ParseUsersFile("t1 alice\nt2 alice\n").status().message(),
            "line 2 repeats the user alice");
  EXPECT_EQ(ParseUsersFile("t1 al/ice\n").status().message(),
            "line 1: a user name is 1 to 64 characters of A-Z, a-z, 0-9, '.', '_', '@' and '-'");
  EXPECT_EQ(ParseUsersFile("").status().message(), "no user in it");
}

// A database of schema 3 (before owners) with one job opens, migrates and keeps the job.
TEST(JobOwnerStoreTest, ADatabaseFromBeforeOwnersMigrates) {
  TempDir dir;
  const std::string path = dir.File("old.db");
  {
    auto store = SqliteJobStore::Open(path);
    ASSERT_TRUE(store.ok()) << store.status();
    JobRecord j;
    j.name = "old";
    j.spec_json = "{}";
    ASSERT_TRUE((*store)->CreateJob(&j, {"", 0, 1, JobState::kQueued, "submitted"}).ok());
  }
  {  // back to schema 3
    sqlite3* db = nullptr;
    ASSERT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
    char* err = nullptr;
    const int rc =
        sqlite3_exec(db,
                     "ALTER TABLE jobs DROP COLUMN owner; DROP TABLE worker_certificates;"
                     "DROP TABLE bootstrap_joins;"
                     "DELETE FROM schema_migrations WHERE version = 4;",
                     nullptr, nullptr, &err);
    EXPECT_EQ(rc, SQLITE_OK) << (err ? err : "");
    sqlite3_free(err);
    sqlite3_close(db);
  }
  auto store = SqliteJobStore::Open(path);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ(*(*store)->SchemaVersion(), 4);
  auto jobs = (*store)->LoadJobs();
  ASSERT_TRUE(jobs.ok());
  ASSERT_EQ(jobs->size(), 1u);
  EXPECT_EQ((*jobs)[0].name, "old");
  EXPECT_EQ((*jobs)[0].owner, "");
  JobRecord j = (*jobs)[0];
  j.owner = "alice";
  ASSERT_TRUE((*store)->SaveJob(j).ok());
  EXPECT_EQ((*(*store)->LoadJobs())[0].owner, "alice");
}

class JobOwnersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    CoordinatorConfig cfg;
    cfg.listen = "127.0.0.1:0";
    cfg.db_path = dir_.File("owners.db");
    cfg.users = {
        {"t-alice", {"alice", false}}, {"t-bob", {"bob", false}}, {"t-root", {"root", true}}};
    auto s = CoordinatorServer::Start(cfg);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    stub_ = v1::JobService::NewStub(grpc::CreateChannel(
        absl::StrCat("127.0.0.1:", server_->client_port()), grpc::InsecureChannelCredentials()));
  }
  std::string Submit(const std::string& token) {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer " + token);
    v1::SubmitJobRequest req;
    req.set_spec_json(WithCheckpointDir(SpecJson(), dir_.File(absl::StrCat("ck-", ++jobs_))));
    v1::SubmitJobResponse resp;
    grpc::Status st = stub_->Submit(&ctx, req, &resp);
    EXPECT_TRUE(st.ok()) << st.error_message();
    return resp.job_id();
  }
  grpc::Status Cancel(const std::string& token, const std::string& id, const std::string& reason,
                      v1::Job* job = nullptr) {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer " + token);
    v1::CancelJobRequest req;
    req.set_job_id(id);
    req.set_reason(reason);
    v1::CancelJobResponse resp;
    grpc::Status st = stub_->Cancel(&ctx, req, &resp);
    if (job != nullptr) *job = resp.job();
    return st;
  }
  std::vector<std::string> List(const std::string& token, bool mine) {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer " + token);
    v1::ListJobsRequest req;
    req.set_mine(mine);
    v1::ListJobsResponse resp;
    EXPECT_TRUE(stub_->List(&ctx, req, &resp).ok());
    std::vector<std::string> ids;
    for (const v1::Job& j : resp.jobs()) ids.push_back(j.job_id() + ":" + j.owner());
    return ids;
  }
  int Cli(const std::vector<std::string>& args, const std::string& token, std::string* out,
          std::string* err) {
    std::ostringstream o, e;
    std::vector<std::string> a = args;
    a.push_back("--coordinator");
    a.push_back(absl::StrCat("127.0.0.1:", server_->client_port()));
    const int code = RunCli(a, {{"SPINDLE_TOKEN", token}}, o, e, false);
    *out = o.str();
    *err = e.str();
    return code;
  }

  TempDir dir_;
  int jobs_ = 0;
  std::unique_ptr<CoordinatorServer> server_;
  std::unique_ptr<v1::JobService::Stub> stub_;
};

TEST_F(JobOwnersTest, OnlyTheOwnerOrAnAdminCancelsAndEveryEventNamesTheUser) {
  const std::string a1 = Submit("t-alice");
  const std::string a2 = Submit("t-alice");
  const std::string b1 = Submit("t-bob");

  grpc::Status denied = Cancel("t-bob", a1, "mine now");
  EXPECT_EQ(denied.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(denied.error_message(), "job " + a1 +
                                        " belongs to alice; only its owner or an admin may "
                                        "cancel it");
  v1::Job job;
  ASSERT_TRUE(Cancel("t-alice", a1, "done with it", &job).ok());
  EXPECT_EQ(job.state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(job.owner(), "alice");
  ASSERT_EQ(job.events_size(), 2);
  EXPECT_EQ(job.events(0).message(), "submitted by alice");
  EXPECT_EQ(job.events(1).message(), "cancelled by alice: done with it");
  ASSERT_TRUE(Cancel("t-root", b1, "", &job).ok());
  EXPECT_EQ(job.owner(), "bob");
  EXPECT_EQ(job.events(1).message(), "cancelled by root");

  EXPECT_EQ(List("t-alice", true), (std::vector<std::string>{a2 + ":alice", a1 + ":alice"}));
  EXPECT_EQ(List("t-bob", true), (std::vector<std::string>{b1 + ":bob"}));
  EXPECT_EQ(List("t-bob", false).size(), 3u);

  // The same through the CLI.
  std::string out, err;
  EXPECT_EQ(Cli({"cancel", a2}, "t-bob", &out, &err), 4);
  EXPECT_EQ(err, "spindle: cancel: job " + a2 +
                     " belongs to alice; only its owner or an admin may cancel it\n");
  EXPECT_EQ(Cli({"list", "--mine", "--output", "json"}, "t-bob", &out, &err), 0) << err;
  EXPECT_NE(out.find("\"job_id\":\"" + b1 + "\""), std::string::npos) << out;
  EXPECT_EQ(out.find(a1), std::string::npos) << out;
  EXPECT_EQ(Cli({"status", a2}, "t-alice", &out, &err), 0) << err;
  EXPECT_NE(out.find("  owner alice\n"), std::string::npos) << out;
  EXPECT_NE(out.find(" queued: submitted by alice\n"), std::string::npos) << out;
}

// A request id makes a submit idempotent for the user who sent it only: the same id from another
// user gets neither that job nor a new one.
TEST_F(JobOwnersTest, ARequestIdOfAnotherUsersJobIsRefused) {
  const std::string spec = WithCheckpointDir(SpecJson(), dir_.File("ck-request"));
  auto submit = [&](const std::string& token, std::string* id) {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer " + token);
    v1::SubmitJobRequest req;
    req.set_spec_json(spec);
    req.set_request_id("req-1");
    v1::SubmitJobResponse resp;
    grpc::Status st = stub_->Submit(&ctx, req, &resp);
    *id = resp.job_id();
    return st;
  };
  std::string first, again, bob;
  ASSERT_TRUE(submit("t-alice", &first).ok());
  ASSERT_TRUE(submit("t-alice", &again).ok());
  EXPECT_EQ(again, first);
  const grpc::Status st = submit("t-bob", &bob);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_EQ(st.error_message(),
            "submit: request id \"req-1\" was already used by another user; a new job needs a new "
            "request id");
  EXPECT_EQ(bob, "");
  EXPECT_EQ(List("t-bob", true), std::vector<std::string>{});
  EXPECT_EQ(List("t-alice", true), std::vector<std::string>{first + ":alice"});
}

}  // namespace
}  // namespace spindle
