// Strict JSON object reading with field-naming errors (see json_fields.h).
#include "common/json_fields.h"

#include <cmath>
#include <limits>
#include <vector>

namespace spindle {
namespace {

// A SAX pass that records the first syntax error or repeated key; the DOM is built afterwards.
class StrictChecker : public nlohmann::json_sax<nlohmann::json> {
 public:
  std::string error;  // empty while the text is acceptable

  bool null() override { return Value(); }
  bool boolean(bool) override { return Value(); }
  bool number_integer(number_integer_t) override { return Value(); }
  bool number_unsigned(number_unsigned_t) override { return Value(); }
  bool number_float(number_float_t, const string_t&) override { return Value(); }
  bool string(string_t&) override { return Value(); }
  bool binary(binary_t&) override { return Value(); }
  bool start_object(std::size_t) override {
    Value();
    frames_.push_back(Frame{});
    return true;
  }
  bool key(string_t& k) override {
    Frame& f = frames_.back();
    f.key = k;
    if (!f.keys.insert(k).second) {
      error = absl::StrCat(Path(), ": appears twice");
      return false;
    }
    return true;
  }
  bool end_object() override {
    frames_.pop_back();
    return true;
  }
  bool start_array(std::size_t) override {
    Value();
    frames_.push_back(Frame{.array = true});
    return true;
  }
  bool end_array() override {
    frames_.pop_back();
    return true;
  }
  bool parse_error(std::size_t, const std::string&,
                   const nlohmann::detail::exception& ex) override {
    // what() reads "[json.exception.parse_error.101] parse error at line 1, column 2: ...".
    std::string_view msg = ex.what();
    if (const size_t p = msg.find("] "); p != std::string_view::npos) msg.remove_prefix(p + 2);
    // "...; last read: '<token>'[; expected ...]": the token is everything read since it began
    // (an unterminated string runs to the end of the input), so it is cut like any quote.
    constexpr std::string_view kLastRead = "; last read: '";
    if (const size_t p = msg.find(kLastRead); p != std::string_view::npos) {
      const size_t begin = p + kLastRead.size();
      size_t end = msg.rfind("'; expected ");
      if (end == std::string_view::npos || end < begin) end = msg.rfind('\'');
      if (end != std::string_view::npos && end >= begin) {
        error =
            absl::StrCat("not valid JSON: ", std::string(msg.substr(0, begin)),
                         ShortText(msg.substr(begin, end - begin)), std::string(msg.substr(end)));
        return false;
      }
    }
    error = absl::StrCat("not valid JSON: ", std::string(msg));
    return false;
  }

 private:
  struct Frame {
    bool array = false;
    int64_t elements = 0;  // arrays: elements begun so far
    std::string key;       // objects: the current key
    std::set<std::string> keys;
  };
  bool Value() {
    if (!frames_.empty() && frames_.back().array) ++frames_.back().elements;
    return true;
  }
  // The dotted path of the current key ("train.lr", "a[2].b").
  std::string Path() const {
    std::string path;
    for (const Frame& f : frames_) {
      if (f.array) {
        absl::StrAppend(&path, "[", f.elements - 1, "]");
      } else {
        absl::StrAppend(&path, path.empty() ? "" : ".", ShortText(f.key));
      }
    }
    return path;
  }
  std::vector<Frame> frames_;
};

}  // namespace

bool JsonDepthWithin(std::string_view text, int max_depth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return false;
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return true;
}

std::string ShortText(std::string_view s) {
  constexpr size_t kMaxBytes = 64;
  if (s.size() <= kMaxBytes) return std::string(s);
  size_t cut = kMaxBytes;  // never inside a UTF-8 sequence: back up over continuation bytes
  while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;
  return absl::StrCat(std::string(s.substr(0, cut)), "...");
}

std::string DescribeJson(const nlohmann::json& v) {
  // Values parsed from outside nest at most kMaxJsonDepth levels, so dump's recursion is bounded;
  // its length is not, hence the cut.
  return ShortText(
      v.dump(-1, ' ', /*ensure_ascii=*/false, nlohmann::json::error_handler_t::replace));
}

absl::StatusOr<nlohmann::json> ParseStrictJson(std::string_view text, std::string_view what) {
  if (!JsonDepthWithin(text, kMaxJsonDepth)) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(what), ": nesting deeper than ", kMaxJsonDepth, " levels"));
  }
  StrictChecker checker;
  nlohmann::json::sax_parse(text, &checker, nlohmann::json::input_format_t::json,
                            /*strict=*/true, /*ignore_comments=*/false);
  if (!checker.error.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(std::string(what), ": ", checker.error));
  }
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded())
    return absl::InvalidArgumentError(absl::StrCat(std::string(what), ": not valid JSON"));
  return j;
}

absl::Status JsonFields::ReadInt(const std::string& key, int64_t* out, bool required) {
  seen_.insert(key);
  if (!Has(key)) return Missing(key, required);
  const auto& v = obj_.at(key);
  if (v.is_number_unsigned() &&
      v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
    return Error(key, absl::StrCat("must be an integer in int64's range, got ", DescribeJson(v)));
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
  return Error(key, absl::StrCat("must be an integer, got ", DescribeJson(v)));
}

absl::Status JsonFields::ReadUint(const std::string& key, uint64_t* out, bool required) {
  if (Has(key) && obj_.at(key).is_number_unsigned()) {  // all of uint64's range
    seen_.insert(key);
    *out = obj_.at(key).get<uint64_t>();
    return absl::OkStatus();
  }
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
  if (!v.is_number()) return Error(key, absl::StrCat("must be a number, got ", DescribeJson(v)));
  double d = v.get<double>();
  if (!std::isfinite(d)) return Error(key, "must be finite");
  *out = d;
  return absl::OkStatus();
}

absl::Status JsonFields::ReadString(const std::string& key, std::string* out, bool required) {
  seen_.insert(key);
  if (!Has(key)) return Missing(key, required);
  const auto& v = obj_.at(key);
  if (!v.is_string()) return Error(key, absl::StrCat("must be a string, got ", DescribeJson(v)));
  *out = v.get<std::string>();
  return absl::OkStatus();
}

absl::Status JsonFields::ReadBool(const std::string& key, bool* out, bool required) {
  seen_.insert(key);
  if (!Has(key)) return Missing(key, required);
  const auto& v = obj_.at(key);
  if (!v.is_boolean())
    return Error(key, absl::StrCat("must be true or false, got ", DescribeJson(v)));
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
