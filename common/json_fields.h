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

// The deepest nesting of arrays and objects that JSON from outside a process may have. nlohmann's
// copy, comparison and dump recurse once per level, so a document nesting 100,000 arrays (200 KB)
// overflows the stack; every parse of untrusted text checks JsonDepthWithin first. Real job specs,
// checkpoint state and safetensors headers nest at most 4 levels.
inline constexpr int kMaxJsonDepth = 64;

// Whether no array or object in `text` opens more than `max_depth` levels deep, counting '[' and
// '{' outside strings. One pass without recursion or allocation; `text` need not be valid JSON
// (for valid JSON the count is exact, and invalid JSON is refused by the parse that follows).
bool JsonDepthWithin(std::string_view text, int max_depth = kMaxJsonDepth);

// Parses `text` as JSON. Errors start with `what` and name the problem: nesting deeper than
// kMaxJsonDepth ("job spec: nesting deeper than 64 levels"), checked before anything is parsed; a
// syntax error by its line and column ("job spec: not valid JSON: parse error at line 3, column
// 1: ..."); a key that appears twice in one object by its dotted path ("job spec: train.lr:
// appears twice"), which a plain parse would resolve by keeping the last value.
absl::StatusOr<nlohmann::json> ParseStrictJson(std::string_view text, std::string_view what);

// `v` as compact JSON for error messages, cut like ShortText (64 bytes and "..."), so an error
// never echoes a large input.
std::string DescribeJson(const nlohmann::json& v);

// `s` cut to at most 64 bytes (at a UTF-8 character boundary) with "..." appended when cut: for
// echoing a string from the input (a key, a value) in an error message.
std::string ShortText(std::string_view s);

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
  // `key` is cut with ShortText: an unknown key may be as long as the input.
  absl::Status Error(const std::string& key, const std::string& msg) const {
    std::string path = key.empty() ? prefix_ : Path(ShortText(key));
    return absl::InvalidArgumentError(path.empty() ? absl::StrCat(what_, ": ", msg)
                                                   : absl::StrCat(what_, ": ", path, ": ", msg));
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
