// ParseTrainerEvent (see trainer_event.h).
#include "worker/trainer_event.h"

#include "absl/strings/str_cat.h"
#include "common/json_fields.h"
#include "nlohmann/json.hpp"

namespace spindle {
namespace {

using Json = nlohmann::json;

absl::Status NumberField(const Json& obj, const char* name, std::optional<double>* out) {
  auto it = obj.find(name);
  if (it == obj.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_number()) {
    return absl::InvalidArgumentError(absl::StrCat("trainer event: ", name, ": not a number"));
  }
  *out = it->get<double>();
  return absl::OkStatus();
}

absl::Status IntField(const Json& obj, const char* name, std::optional<int64_t>* out) {
  auto it = obj.find(name);
  if (it == obj.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_number()) {
    return absl::InvalidArgumentError(absl::StrCat("trainer event: ", name, ": not a number"));
  }
  *out = it->is_number_integer() ? it->get<int64_t>() : static_cast<int64_t>(it->get<double>());
  return absl::OkStatus();
}

absl::Status BoolField(const Json& obj, const char* name, std::optional<bool>* out) {
  auto it = obj.find(name);
  if (it == obj.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_boolean()) {
    return absl::InvalidArgumentError(absl::StrCat("trainer event: ", name, ": not a boolean"));
  }
  *out = it->get<bool>();
  return absl::OkStatus();
}

// A parity event's fields (trainer_event.h).
absl::Status ParityFields(const Json& obj, TrainerEvent* event);

absl::Status StringField(const Json& obj, const char* name, std::string* out) {
  auto it = obj.find(name);
  if (it == obj.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_string()) {
    return absl::InvalidArgumentError(absl::StrCat("trainer event: ", name, ": not a string"));
  }
  *out = it->get<std::string>();
  return absl::OkStatus();
}

absl::Status ParityFields(const Json& obj, TrainerEvent* event) {
  absl::Status s;
  std::optional<bool> skipped;
  if (!(s = BoolField(obj, "passed", &event->passed)).ok()) return s;
  if (!(s = BoolField(obj, "skipped", &skipped)).ok()) return s;
  event->skipped = skipped.value_or(false);
  for (const auto& [name, out] :
       {std::pair<const char*, std::optional<double>*>{"max_rel_error", &event->max_rel_error},
        {"max_excess", &event->max_excess},
        {"tolerance", &event->tolerance}}) {
    if (!(s = NumberField(obj, name, out)).ok()) return s;
  }
  for (const auto& [name, out] : {std::pair<const char*, std::string*>{"layout", &event->layout},
                                  {"reference", &event->reference},
                                  {"reason", &event->reason}}) {
    if (!(s = StringField(obj, name, out)).ok()) return s;
  }
  auto worst = obj.find("worst");
  if (worst == obj.end() || worst->is_null()) return absl::OkStatus();
  if (!worst->is_array()) return absl::InvalidArgumentError("trainer event: worst: not an array");
  for (size_t i = 0; i < worst->size(); ++i) {
    const Json& row = (*worst)[i];
    const std::string where = absl::StrCat("trainer event: worst[", i, "]");
    if (!row.is_object()) return absl::InvalidArgumentError(where + ": not an object");
    ParityTensorStat stat;
    std::optional<double> rel, excess;
    if (!StringField(row, "tensor", &stat.tensor).ok() ||
        !NumberField(row, "rel_error", &rel).ok() || !NumberField(row, "excess", &excess).ok()) {
      return absl::InvalidArgumentError(where + ": bad field type");
    }
    stat.rel_error = rel.value_or(0.0);
    stat.excess = excess.value_or(0.0);
    event->worst.push_back(std::move(stat));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<TrainerEvent> ParseTrainerEvent(std::string_view line) {
  const size_t first = line.find_first_not_of(" \t");
  if (first == std::string_view::npos || line[first] != '{') {
    return absl::InvalidArgumentError("trainer event: not a JSON object");
  }
  // The trainer prints flat objects; a line nesting deeper is refused before it is parsed.
  if (!JsonDepthWithin(line)) {
    return absl::InvalidArgumentError(
        absl::StrCat("trainer event: nesting deeper than ", kMaxJsonDepth, " levels"));
  }
  Json obj = Json::parse(line.begin(), line.end(), nullptr, /*allow_exceptions=*/false);
  if (obj.is_discarded() || !obj.is_object()) {
    return absl::InvalidArgumentError("trainer event: not a JSON object");
  }
  auto ev = obj.find("event");
  if (ev == obj.end() || !ev->is_string()) {
    return absl::InvalidArgumentError("trainer event: event: missing or not a string");
  }
  TrainerEvent event;
  event.name = ev->get<std::string>();
  if (event.name == "start") {
    event.kind = TrainerEventKind::kStart;
  } else if (event.name == "step") {
    event.kind = TrainerEventKind::kStep;
  } else if (event.name == "checkpoint") {
    event.kind = TrainerEventKind::kCheckpoint;
  } else if (event.name == "done") {
    event.kind = TrainerEventKind::kDone;
  } else if (event.name == "note") {
    event.kind = TrainerEventKind::kNote;
  } else if (event.name == "pulse") {
    event.kind = TrainerEventKind::kPulse;
  } else if (event.name == "parity") {
    event.kind = TrainerEventKind::kParity;
  }
  absl::Status s;
  if (!(s = IntField(obj, "step", &event.step)).ok()) return s;
  if (!(s = IntField(obj, "total_steps", &event.total_steps)).ok()) return s;
  if (!(s = IntField(obj, "resumed_from_step", &event.resumed_from_step)).ok()) return s;
  const std::pair<const char*, std::optional<double>*> numbers[] = {
      {"loss", &event.loss},
      {"tokens_per_s", &event.tokens_per_s},
      {"lr", &event.lr},
      {"grad_norm", &event.grad_norm},
      {"elapsed_s", &event.elapsed_s},
      {"step_time_s", &event.step_time_s},
      {"mfu", &event.mfu},
      {"mem_allocated_bytes", &event.mem_allocated_bytes},
      {"mem_reserved_bytes", &event.mem_reserved_bytes},
      {"mem_peak_bytes", &event.mem_peak_bytes},
      {"host_rss_bytes", &event.host_rss_bytes},
      {"host_pinned_bytes", &event.host_pinned_bytes},
  };
  for (const auto& [name, out] : numbers) {
    if (!(s = NumberField(obj, name, out)).ok()) return s;
  }
  // spindle-train spells the step time "step_s".
  if (!event.step_time_s && !(s = NumberField(obj, "step_s", &event.step_time_s)).ok()) return s;
  if (!(s = StringField(obj, "path", &event.path)).ok()) return s;
  if (!(s = StringField(obj, "message", &event.message)).ok()) return s;
  if (event.kind == TrainerEventKind::kParity && !(s = ParityFields(obj, &event)).ok()) return s;
  auto comm = obj.find("comm");
  if (comm != obj.end() && !comm->is_null()) {
    if (!comm->is_array()) return absl::InvalidArgumentError("trainer event: comm: not an array");
    for (size_t i = 0; i < comm->size(); ++i) {
      const Json& entry = (*comm)[i];
      const std::string where = absl::StrCat("trainer event: comm[", i, "]");
      if (!entry.is_object()) return absl::InvalidArgumentError(where + ": not an object");
      CommStat stat;
      std::optional<double> seconds, bytes;
      if (!StringField(entry, "collective", &stat.collective).ok() ||
          !StringField(entry, "layer_type", &stat.layer_type).ok() ||
          !NumberField(entry, "seconds", &seconds).ok() ||
          !NumberField(entry, "bytes", &bytes).ok()) {
        return absl::InvalidArgumentError(where + ": bad field type");
      }
      if (stat.collective.empty()) {
        return absl::InvalidArgumentError(where + ": collective: missing");
      }
      if (stat.layer_type.empty()) stat.layer_type = "other";
      stat.seconds = seconds.value_or(0.0);
      stat.bytes = bytes.value_or(0.0);
      event.comm.push_back(std::move(stat));
    }
  }
  auto moe = obj.find("moe");
  if (moe != obj.end() && !moe->is_null()) {
    if (!moe->is_object()) return absl::InvalidArgumentError("trainer event: moe: not an object");
    const char* keys[] = {"layers", "load_max_over_mean", "bias_min", "bias_max", "router_lse_sq"};
    size_t n = 0;
    for (const char* k : keys) {
      auto a = moe->find(k);
      if (a == moe->end() || !a->is_array())
        return absl::InvalidArgumentError(absl::StrCat("trainer event: moe.", k, ": not an array"));
      if (k == keys[0]) n = a->size();
      if (a->size() != n)
        return absl::InvalidArgumentError(
            absl::StrCat("trainer event: moe.", k, ": ", a->size(), " entries, not ", n));
      for (const Json& v : *a)
        if (!v.is_number())
          return absl::InvalidArgumentError(absl::StrCat("trainer event: moe.", k, ": not numbers"));
    }
    for (size_t i = 0; i < n; ++i)
      event.moe.push_back({(*moe)["layers"][i].get<int64_t>(),
                           (*moe)["load_max_over_mean"][i].get<double>(),
                           (*moe)["bias_min"][i].get<double>(), (*moe)["bias_max"][i].get<double>(),
                           (*moe)["router_lse_sq"][i].get<double>()});
  }
  return event;
}

}  // namespace spindle
