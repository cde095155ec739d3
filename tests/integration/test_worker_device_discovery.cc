// What a worker offers the coordinator (worker/device_discovery.h), on this machine's real
// devices: CPU slots when asked for, the GPUs when there are any this build runs on, else one CPU
// slot with the reason GPUs that are present were passed over.
#include <string>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/device_discovery.h"

namespace spindle {
namespace {

TEST(DeviceDiscovery, RefusesANegativeSlotCount) {
  const absl::StatusOr<v1::DeviceGroup> got = DiscoverDevices(-1);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(got.status().message(), ::testing::HasSubstr("--slots must be >= 0, got -1"));
}

TEST(DeviceDiscovery, OffersTheCpuSlotsAskedForWithAShareOfMemoryEach) {
  std::string note = "stale";
  const absl::StatusOr<v1::DeviceGroup> one = DiscoverDevices(1, &note);
  const absl::StatusOr<v1::DeviceGroup> three = DiscoverDevices(3, &note);
  ASSERT_TRUE(one.ok() && three.ok());
  EXPECT_EQ(note, "");
  EXPECT_EQ(three->kind(), "cpu");
  EXPECT_EQ(three->count(), 3);
  EXPECT_FALSE(three->name().empty());
  EXPECT_GT(three->memory_bytes(), 0);
  EXPECT_EQ(three->memory_bytes(), one->memory_bytes() / 3);
  EXPECT_EQ(three->host_memory_bytes(), one->host_memory_bytes());
  EXPECT_GE(three->host_memory_bytes(), 3 * three->memory_bytes());
}

TEST(DeviceDiscovery, OffersUsableGpusElseOneCpuSlotSayingWhy) {
  const absl::StatusOr<v1::DeviceGroup> gpus = DiscoverCudaDevices();
  std::string note;
  const absl::StatusOr<v1::DeviceGroup> got = DiscoverDevices(0, &note);
  ASSERT_TRUE(got.ok()) << got.status();
  if (gpus.ok()) {
    EXPECT_EQ(got->kind(), "cuda");
    EXPECT_EQ(got->count(), gpus->count());
    EXPECT_GT(got->memory_bytes(), 0);
    EXPECT_GT(got->host_memory_bytes(), 0);  // what train.offload pins comes out of it
    EXPECT_EQ(note, "");
    return;
  }
  EXPECT_EQ(got->kind(), "cpu");
  EXPECT_EQ(got->count(), 1);
  if (absl::IsNotFound(gpus.status())) {
    EXPECT_EQ(note, "");  // no GPU, or a build without CUDA: nothing to explain
  } else {
    EXPECT_EQ(note, gpus.status().message());
  }
}

}  // namespace
}  // namespace spindle
