// ParityNoteText (see parity_note.h).
#include "worker/parity_note.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace spindle {

std::optional<std::string> ParityNoteText(const TrainerEvent& event, int64_t rank) {
  if (event.kind != TrainerEventKind::kParity || rank != 0) return std::nullopt;
  const std::string before =
      event.step ? absl::StrCat(" before step ", *event.step) : std::string();
  if (event.skipped)
    return absl::StrCat("parity: skipped", before, ": ", event.layout, ": ", event.reason);
  const double rel = event.max_rel_error.value_or(0.0), excess = event.max_excess.value_or(0.0);
  if (event.passed.value_or(false))
    return absl::StrFormat(
        "parity: passed%s: %s computes what %s computes (max relative gradient error %.3g, "
        "%.3g of its bound)",
        before, event.layout, event.reference, rel, excess);
  std::string worst;
  for (const ParityTensorStat& t : event.worst)
    if (t.excess > 1.0)
      absl::StrAppend(&worst, worst.empty() ? "" : ", ", t.tensor,
                      absl::StrFormat(" %.3g", t.rel_error));
  return absl::StrFormat(
      "parity: FAILED%s: %s does not compute what %s computes (max relative gradient error %.3g, "
      "%.3g times its bound); worst tensors: %s",
      before, event.layout, event.reference, rel, excess, worst.empty() ? "-" : worst);
}

}  // namespace spindle
