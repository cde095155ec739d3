// JsonFields: strict reading of one JSON object for config parsing. Every read names the field
// by its dotted path in errors ("train.lr: must be a number"), and Finish() reports the first key
// that was never read as an unknown field. ParseStrictJson parses the text those objects come
// from, refusing what a lenient parser would let through silently. Not thread-safe; one reader
// per object.
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "nlohmann/json.hpp"

namespace spindle {

// Parses `text` as JSON. Errors start with `what` and name the problem: a syntax error by its
// line and column ("job spec: not valid JSON: parse error at line 3, column 1: ..."), a key that
// appears twice in one object by its dotted path ("job spec: train.lr: appears twice"), which a
// plain parse would resolve by keeping the last value.
absl::StatusOr<nlohmann::json> ParseStrictJson(std::string_view text, std::string_view what);

class JsonFields {
 public:
  // `prefix` is the dotted path of the object ("train"), empty for the root; `what` prefixes
  // every message ("job spec").
  JsonFields(const nlohmann::json& obj, std::string what, std::string prefix)
      : obj_(obj), what_(std::move(what)), prefix_(std::move(prefix)) {}

  absl::Status CheckObject() const {
    if (!obj_.is_object()) return Error("", "must be a JSON object");
    return absl::OkStatus();
  }
  bool Has(const std::string& key) const { return obj_.is_object() && obj_.contains(key); }
  std::string Path(const std::string& key) const {
    return prefix_.empty() ? key : absl::StrCat(prefix_, ".", key);
  }
  absl::Status Error(const std::string& key, const std::string& msg) const {
    std::string path = key.empty() ? prefix_ : Path(key);
    return absl::InvalidArgumentError(
        path.empty() ? absl::StrCat(what_, ": ", msg) : absl::StrCat(what_, ": ", path, ": ", msg));
  }

  // Each Read leaves *out unchanged when the key is absent (optional) or fails when required.
  absl::Status ReadInt(const std::string& key, int64_t* out, bool required = false);
  absl::Status ReadDouble(const std::string& key, double* out, bool required = false);
  absl::Status ReadString(const std::string& key, std::string* out, bool required = false);
  absl::Status ReadBool(const std::string& key, bool* out, bool required = false);
  absl::Status ReadUint(const std::string& key, uint64_t* out, bool required = false);
  // Marks a key as known without reading it (the caller reads the sub-object itself).
  const nlohmann::json* Sub(const std::string& key);

  // Fails on the first key that no Read/Sub call consumed.
  absl::Status Finish() const;

 private:
  absl::Status Missing(const std::string& key, bool required) const {
    return required ? Error(key, "is required") : absl::OkStatus();
  }
  const nlohmann::json& obj_;
  std::string what_;
  std::string prefix_;
  std::set<std::string> seen_;
};

}  // namespace spindle
