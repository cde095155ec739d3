// Device rates for the cost model (see rate_report.h).
#include "worker/rate_report.h"

#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/subprocess.h"
#include "nlohmann/json.hpp"

namespace spindle {

absl::Status ReportRates(const std::string& trainer_binary, int threads_per_rank,
                         v1::DeviceGroup* devices) {
  devices->set_cores(static_cast<int32_t>(std::thread::hardware_concurrency()));
  if (devices->kind() != "cpu") return absl::OkStatus();
  devices->set_link("loopback");
  devices->set_threads_per_rank(threads_per_rank);
  absl::StatusOr<CommandResult> run = RunCommand(
      {trainer_binary, "--probe-rates", "--threads", absl::StrCat(threads_per_rank)}, "",
      absl::Seconds(30));
  if (!run.ok()) return run.status();
  if (run->exit_code != 0)
    return absl::InternalError(absl::StrCat("rate probe exited with code ", run->exit_code, ": ",
                                            run->stderr_text.substr(0, 300)));
  for (absl::string_view line : absl::StrSplit(run->stdout_text, '\n')) {
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || j.value("event", "") != "rates") continue;
    v1::DeviceRates* r = devices->mutable_rates();
    r->set_gemm_flops(j.value("gemm_flops", 0.0));
    r->set_attention_flops(j.value("attention_flops", 0.0));
    r->set_lightning_flops(j.value("lightning_flops", 0.0));
    r->set_memory_bytes(j.value("memory_bytes", 0.0));
    return absl::OkStatus();
  }
  return absl::InternalError("rate probe printed no rates line");
}

}  // namespace spindle
