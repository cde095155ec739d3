// Strict JSON object reading with field-naming errors (see json_fields.h).
#include "common/json_fields.h"

#include <cmath>

namespace spindle {

absl::Status JsonFields::ReadInt(const std::string& key, int64_t* out, bool required) {
  seen_.insert(key);
  if (!Has(key)) return Missing(key, required);
  const auto& v = obj_.at(key);
  if (v.is_number_integer()) {
    *out = v.get<int64_t>();
    return absl::OkStatus();
  }
  if (v.is_number_float()) {
    double d = v.get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9e15) {
      *out = static_cast<int64_t>(d);
      return absl::OkStatus();
    }
  }
  return Error(key, absl::StrCat("must be an integer, got ", v.dump()));
}

absl::Status JsonFields::ReadUint(const std::string& key, uint64_t* out, bool required) {
  int64_t v = static_cast<int64_t>(*out);
  if (absl::Status s = ReadInt(key, &v, required); !s.ok()) return s;
  if (v < 0) return Error(key, absl::StrCat("must be >= 0, got ", v));
  *out = static_cast<uint64_t>(v);
  return absl::OkStatus();
}

absl::Status JsonFields::ReadDouble(const std::string& key, double* out, bool required) {
  seen_.insert(key);
  if (!Has(key)) return Missing(key, required);
  const auto& v = obj_.at(key);
  if (!v.is_number()) return Error(key, absl::StrCat("must be a number, got ", v.dump()));
  double d = v.get<double>();
  if (!std::isfinite(d)) return Error(key, "must be finite");
  *out = d;
  return absl::OkStatus();
}

absl::Status JsonFields::ReadString(const std::string& key, std::string* out, bool required) {
  seen_.insert(key);
  if (!Has(key)) return Missing(key, required);
  const auto& v = obj_.at(key);
  if (!v.is_string()) return Error(key, absl::StrCat("must be a string, got ", v.dump()));
  *out = v.get<std::string>();
  return absl::OkStatus();
}

absl::Status JsonFields::ReadBool(const std::string& key, bool* out, bool required) {
  seen_.insert(key);
  if (!Has(key)) return Missing(key, required);
  const auto& v = obj_.at(key);
  if (!v.is_boolean()) return Error(key, absl::StrCat("must be true or false, got ", v.dump()));
  *out = v.get<bool>();
  return absl::OkStatus();
}

const nlohmann::json* JsonFields::Sub(const std::string& key) {
  seen_.insert(key);
  if (!Has(key)) return nullptr;
  return &obj_.at(key);
}

absl::Status JsonFields::Finish() const {
  if (!obj_.is_object()) return absl::OkStatus();
  for (auto it = obj_.begin(); it != obj_.end(); ++it) {
    if (!seen_.count(it.key())) return Error(it.key(), "unknown field");
  }
  return absl::OkStatus();
}

}  // namespace spindle
