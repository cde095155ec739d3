// WorkerRegistry against the in-memory store and a FakeClock: registration checks and the one
// daemon per worker id rule, addresses (advertised or observed) and the /metrics host, sessions,
// slots released and drained, the scheduler's and `spindle workers`' views, and reload.
#include <cmath>
#include <string>

#include "coordinator/worker_registry.h"
#include "gtest/gtest.h"
#include "tests/control/memory_job_store.h"

namespace spindle {
namespace {

WorkerRegistration Reg(const std::string& id, const std::string& host, int slots = 2,
                       const std::string& instance = "a") {
  WorkerRegistration r;
  r.worker_id = id;
  r.hostname = host;
  r.instance_id = instance;
  r.observed_host = "198.18.0.7";
  r.devices.push_back({"cpu", "cpu", slots, int64_t{8} << 30, int64_t{64} << 30});
  return r;
}

class WorkerRegistryTest : public ::testing::Test {
 protected:
  testing::MemoryJobStore store_;
  FakeClock clock_;
  WorkerRegistry registry_{&store_, &clock_};
};

TEST_F(WorkerRegistryTest, RefusesBadRegistrationsByField) {
  WorkerRegistration r = Reg("", "h");
  EXPECT_EQ(registry_.Register(r).status().message(), "register: worker_id must not be empty");
  r = Reg("w1", "h");
  r.devices.clear();
  EXPECT_EQ(registry_.Register(r).status().message(),
            "register: worker w1 must advertise exactly one device group (GPUs or CPU slots), "
            "got 0");
  r = Reg("w1", "h");
  r.devices[0].kind = "tpu";
  EXPECT_EQ(registry_.Register(r).status().message(),
            "register: worker w1: device kind must be \"cuda\" or \"cpu\", got \"tpu\"");
  r = Reg("w1", "h", 0);
  EXPECT_EQ(registry_.Register(r).status().code(), absl::StatusCode::kInvalidArgument);
  for (const LinkRates& bad : {LinkRates{-1, 0}, LinkRates{1e9, 11}, LinkRates{std::nan(""), 0}}) {
    r = Reg("w1", "h");
    r.devices[0].link_rates = bad;
    EXPECT_EQ(registry_.Register(r).status().message().rfind(
                  "register: worker w1: link_bytes_per_s must be a non-negative rate below 1e18 "
                  "and link_latency_s in [0, 10] seconds, got ",
                  0),
              0u)
        << registry_.Register(r).status();
  }
  r = Reg("w1", "h");
  r.advertise_host = "a b";
  EXPECT_EQ(registry_.Register(r).status().message(),
            "register: worker w1: advertise_host must be a host name or address, got \"a b\"");
  EXPECT_TRUE(registry_.workers().empty());
  EXPECT_TRUE(store_.LoadWorkers()->empty());
}

TEST_F(WorkerRegistryTest, OneConnectedDaemonPerWorkerId) {
  ASSERT_TRUE(registry_.Register(Reg("w1", "h1")).ok());
  ASSERT_TRUE(registry_.Open("w1", "a", 1).ok());
  EXPECT_EQ(registry_.Register(Reg("w1", "h2")).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(registry_.Register(Reg("w1", "h1", 2, "b")).status().message(),
            "worker id w1 is in use by another connected worker daemon on host h1; give each "
            "worker daemon its own --worker-id");
  EXPECT_TRUE(registry_.Register(Reg("w1", "h1")).ok()) << "its own reconnect";
  registry_.Find("w1")->lost = true;
  EXPECT_TRUE(registry_.Register(Reg("w1", "h2", 2, "c")).ok()) << "a lost worker's id is free";
  EXPECT_EQ(registry_.Open("w9", "a", 2).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(WorkerRegistryTest, AddressesAndTheMetricsHost) {
  WorkerRegistration r = Reg("w1", "h1");
  r.metrics_address = ":9401";
  ASSERT_TRUE(registry_.Register(r).ok());
  r = Reg("w2", "h2");
  r.advertise_host = "fe80::1";
  r.metrics_address = ":9401";
  ASSERT_TRUE(registry_.Register(r).ok());
  const std::vector<WorkerView> views = registry_.Views();
  ASSERT_EQ(views.size(), 2u);
  EXPECT_EQ(views[0].address, "198.18.0.7");
  EXPECT_EQ(views[0].metrics_address, "198.18.0.7:9401");
  EXPECT_EQ(views[1].address, "fe80::1");
  EXPECT_EQ(views[1].metrics_address, "[fe80::1]:9401");
  EXPECT_EQ(views[0].state, "disconnected");
}

TEST_F(WorkerRegistryTest, SlotsReleaseDrainAndCount) {
  ASSERT_TRUE(registry_.Register(Reg("w1", "h1", 3)).ok());
  ASSERT_TRUE(registry_.Open("w1", "a", 1).ok());
  Worker* w = registry_.Find("w1");
  w->slots[0] = {"j-1", 1, 0, 0};
  w->slots[1] = {"j-1", 1, 1, clock_.SteadyMs() + 500};
  EXPECT_EQ(registry_.DeviceCounts(), (std::map<std::string, int64_t>{{"used", 2}, {"free", 1}}));
  registry_.Release("w1", 0, "j-1", 2);  // another attempt: kept
  EXPECT_EQ(w->slots[0].job_id, "j-1");
  registry_.Release("w1", 0, "j-1", 1);
  EXPECT_TRUE(w->slots[0].job_id.empty());
  registry_.FreeDrained(clock_.SteadyMs() + 499);
  EXPECT_EQ(w->slots[1].job_id, "j-1");
  registry_.FreeDrained(clock_.SteadyMs() + 500);
  EXPECT_TRUE(w->slots[1].job_id.empty());
  EXPECT_EQ(registry_.StateCounts()["alive"], 1);
  EXPECT_EQ(registry_.LargestDeviceMemory("cpu"), int64_t{8} << 30);
  EXPECT_EQ(registry_.LargestDeviceMemory("cuda"), 0);
  ASSERT_EQ(registry_.Registered().size(), 1u);
  EXPECT_EQ(registry_.Registered()[0].total_devices, 3);
}

TEST_F(WorkerRegistryTest, ReloadedWorkersAreLostUnlessHeardFromInTheGrace) {
  WorkerRegistration reg = Reg("w1", "h1", 2);
  reg.devices[0].link = "loopback";
  reg.devices[0].link_rates = {1.25e9, 40e-6};
  ASSERT_TRUE(registry_.Register(reg).ok());
  WorkerRegistry again(&store_, &clock_);
  ASSERT_TRUE(again.Load(/*grace_ms=*/4000).ok());
  const Worker* w = again.Find("w1");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->devices.count, 2);
  EXPECT_EQ(w->devices.link_rates.bytes_per_s, 1.25e9);  // the measured link is stored with it
  EXPECT_EQ(w->devices.link_rates.latency_s, 40e-6);
  EXPECT_EQ(w->slots.size(), 2u);
  EXPECT_EQ(w->last_seen_ms, clock_.SteadyMs() + 4000);
  EXPECT_EQ(w->State(), "disconnected");
}

}  // namespace
}  // namespace spindle
