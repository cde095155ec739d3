// MoeSummary: a mixture-of-experts rank's routing as of its last step, as its worker reports it
// (spindle.v1.MoeStatus) and the job views show it. Plain data.
#pragma once

namespace spindle {

struct MoeSummary {
  bool present = false;  // false: a dense job, or no step reported yet
  double load_max_over_mean = 0, bias_min = 0, bias_max = 0, router_z_loss = 0;
  double dispatch_bytes = 0, dispatch_s = 0;
};

}  // namespace spindle
