// Device rates for the cost model (see rate_report.h).
#include "worker/rate_report.h"

#include <functional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/host_cores.h"
#include "common/status.h"
#include "common/subprocess.h"
#include "nlohmann/json.hpp"

namespace spindle {
namespace {

// Runs the trainer binary's probe `args` and hands each JSON line of its output to `line`.
absl::Status RunProbe(const std::vector<std::string>& args,
                      const std::function<void(const nlohmann::json&)>& line) {
  absl::StatusOr<CommandResult> run = RunCommand(args, "", absl::Seconds(30));
  if (!run.ok()) return run.status();
  if (run->exit_code != 0)
    return absl::InternalError(absl::StrCat(args[1].substr(2), " exited with code ", run->exit_code,
                                            ": ", run->stderr_text.substr(0, 300)));
  for (absl::string_view text : absl::StrSplit(run->stdout_text, '\n')) {
    nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (j.is_object()) line(j);
  }
  return absl::OkStatus();
}

// j[key] when it is a number, else 0 (a line of another shape measures nothing).
double Number(const nlohmann::json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : 0.0;
}

// A {"event": "link"} line into the group's measured link rates.
void TakeLink(const nlohmann::json& j, v1::DeviceGroup* devices) {
  if (j.value("event", nlohmann::json()) != "link") return;
  devices->set_link_bytes_per_s(Number(j, "bytes_per_s"));
  devices->set_link_latency_s(Number(j, "latency_s"));
}

}  // namespace

absl::Status ReportRates(const std::string& trainer_binary, int threads_per_rank,
                         v1::DeviceGroup* devices) {
  devices->set_cores(static_cast<int32_t>(HostCores()));
  if (devices->kind() != "cpu") {
    // Ranks sharing one GPU exchange over Gloo on this host: their link is measured; GPUs that
    // reach each other directly keep the planner's nominal rates.
    if (devices->link() != "same-device") return absl::OkStatus();
    absl::Status probed = RunProbe({trainer_binary, "--probe-link"},
                                   [devices](const nlohmann::json& j) { TakeLink(j, devices); });
    if (probed.ok() && devices->link_bytes_per_s() <= 0)
      return absl::InternalError("link probe printed no link line");
    return probed;
  }
  devices->set_link("loopback");
  devices->set_threads_per_rank(threads_per_rank);
  bool rates = false;
  RETURN_IF_ERROR(
      RunProbe({trainer_binary, "--probe-rates", "--threads", absl::StrCat(threads_per_rank)},
               [devices, &rates](const nlohmann::json& j) {
                 TakeLink(j, devices);
                 if (j.value("event", nlohmann::json()) != "rates") return;
                 v1::DeviceRates* r = devices->mutable_rates();
                 r->set_gemm_flops(Number(j, "gemm_flops"));
                 r->set_attention_flops(Number(j, "attention_flops"));
                 r->set_lightning_flops(Number(j, "lightning_flops"));
                 r->set_memory_bytes(Number(j, "memory_bytes"));
                 r->set_copy_bytes(Number(j, "copy_bytes"));
                 rates = true;
               }));
  if (!rates) return absl::InternalError("rate probe printed no rates line");
  if (devices->link_bytes_per_s() <= 0)
    return absl::InternalError("rate probe printed no link line");
  return absl::OkStatus();
}

}  // namespace spindle
