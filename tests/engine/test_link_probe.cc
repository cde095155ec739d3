// The link probe (worker/engine/link_probe.h): two ranks over real Gloo on 127.0.0.1 measure a
// latency and a bandwidth, and options out of range are refused by name.
#include <cmath>

#include "gtest/gtest.h"
#include "worker/engine/link_probe.h"

namespace spindle {
namespace {

TEST(LinkProbeTest, TwoGlooRanksMeasureTheLoopbackLink) {
  LinkProbeOptions o;
  o.bytes = 256 << 10;
  o.rounds = 2;
  o.pings = 4;
  absl::StatusOr<MeasuredLink> link = MeasureLoopbackLink(o);
  ASSERT_TRUE(link.ok()) << link.status();
  // Real numbers: positive and finite; a message takes time, and 256 KiB moves in less than the
  // probe's 5 s bound.
  EXPECT_TRUE(std::isfinite(link->bytes_per_s));
  EXPECT_GT(link->bytes_per_s, 256e3 / 5.0);
  EXPECT_GT(link->latency_s, 0.0);
  EXPECT_LT(link->latency_s, 5.0);
  const nlohmann::json j = link->ToJson();
  EXPECT_EQ(j["bytes_per_s"].get<double>(), link->bytes_per_s);
  EXPECT_EQ(j["latency_s"].get<double>(), link->latency_s);
}

TEST(LinkProbeTest, OptionsOutOfRangeAreRefused) {
  LinkProbeOptions o;
  o.bytes = 10;
  absl::StatusOr<MeasuredLink> link = MeasureLoopbackLink(o);
  EXPECT_EQ(link.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(link.status().message(),
            "link probe: bytes must be in [1 KiB, 256 MiB] and rounds and pings in [1, 1000], got "
            "10, 4 and 32");
}

}  // namespace
}  // namespace spindle
