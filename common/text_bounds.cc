// Bounded, valid UTF-8 text from peers (see text_bounds.h).
#include "common/text_bounds.h"

#include <cstdint>

namespace spindle {
namespace {

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD
constexpr std::string_view kEllipsis = "...";

// The length of the valid UTF-8 sequence at s[i], or 0 when none starts there; `cp` gets its
// code point.
size_t SequenceAt(std::string_view s, size_t i, uint32_t* cp) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const unsigned char c = b(0);
  if (c < 0x80) {
    *cp = c;
    return 1;
  }
  size_t n;
  uint32_t v, min;
  if ((c & 0xE0) == 0xC0) {
    n = 2, v = c & 0x1F, min = 0x80;
  } else if ((c & 0xF0) == 0xE0) {
    n = 3, v = c & 0x0F, min = 0x800;
  } else if ((c & 0xF8) == 0xF0) {
    n = 4, v = c & 0x07, min = 0x10000;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((b(k) & 0xC0) != 0x80) return 0;
    v = (v << 6) | (b(k) & 0x3F);
  }
  if (v < min || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) return 0;
  *cp = v;
  return n;
}

}  // namespace

bool IsValidUtf8(std::string_view s) {
  uint32_t cp;
  for (size_t i = 0; i < s.size();) {
    const size_t n = SequenceAt(s, i, &cp);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

std::string BoundedUtf8(std::string_view s, size_t max_bytes) {
  if (s.size() <= max_bytes && IsValidUtf8(s)) return std::string(s);
  const size_t room = max_bytes < kEllipsis.size() ? 0 : max_bytes - kEllipsis.size();
  std::string out;
  out.reserve(std::min(s.size(), max_bytes));
  uint32_t cp;
  size_t i = 0;
  for (; i < s.size();) {
    const size_t n = SequenceAt(s, i, &cp);
    const std::string_view piece = n == 0 ? kReplacement : s.substr(i, n);
    // Room for the ellipsis stays while more may follow.
    if (out.size() + piece.size() > room) break;
    out.append(piece);
    i += n == 0 ? 1 : n;
  }
  if (i < s.size()) {
    // What is left may still fit whole (the input was only invalid, not long).
    std::string rest;
    for (size_t k = i; k < s.size();) {
      const size_t n = SequenceAt(s, k, &cp);
      rest.append(n == 0 ? kReplacement : s.substr(k, n));
      k += n == 0 ? 1 : n;
      if (out.size() + rest.size() > max_bytes) break;
    }
    if (out.size() + rest.size() <= max_bytes) {
      out.append(rest);
    } else {
      out.append(kEllipsis.substr(0, std::min(kEllipsis.size(), max_bytes - out.size())));
    }
  }
  return out;
}

std::string PrintableText(std::string_view s, bool keep_newlines) {
  std::string out;
  out.reserve(s.size());
  uint32_t cp;
  for (size_t i = 0; i < s.size();) {
    const size_t n = SequenceAt(s, i, &cp);
    if (n == 0) {
      out.append(kReplacement);
      ++i;
      continue;
    }
    const bool control = cp < 0x20 || cp == 0x7F || (cp >= 0x80 && cp < 0xA0);
    if (control && !(cp == '\t' || (keep_newlines && cp == '\n')))
      out.push_back('?');
    else
      out.append(s.substr(i, n));
    i += n;
  }
  return out;
}

}  // namespace spindle
