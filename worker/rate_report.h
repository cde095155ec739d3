// What the worker tells the planner's cost model about its devices (planner/cp_cost_model.h):
// for CPU slots, the kernel rates of one rank on its threads (measured once at start by running
// the trainer binary's --probe-rates), the host's cores and the threads per rank, and the link
// between two slots ("loopback") with its rates as measured (the probe's link line: a short Gloo
// exchange between two ranks on 127.0.0.1). GPUs keep the link device discovery found; ranks that
// share one GPU ("same-device") measure theirs the same way (--probe-link); GPU kernel rates are
// the planner's built-in ones. A probe that fails leaves what it could not measure unset (the
// planner then uses its built-in rates) and says why.
// Thread-safety: a free function; call it before the session starts.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "spindle/v1/cluster.pb.h"

namespace spindle {

// Fills devices->rates (CPU), cores, threads_per_rank, link and the link's measured rates. The
// probe's failure is returned (the fields it could not measure stay zero); the worker logs it and
// runs on.
absl::Status ReportRates(const std::string& trainer_binary, int threads_per_rank,
                         v1::DeviceGroup* devices);

}  // namespace spindle
