// Bounds on the text a peer sends (users, workers, trainers): every string kept or passed on is
// valid UTF-8 of a bounded length, cut on a character boundary, so that no peer can make a later
// reply oversized, or one that a protobuf parser refuses (proto3 strings must be UTF-8). Also the
// form in which such text is printed on a terminal (no control characters).
// Thread-safety: plain functions.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace spindle {

// The length limits, in bytes, of the strings users and workers send.
inline constexpr size_t kMaxIdBytes = 128;          // worker, instance and job ids
inline constexpr size_t kMaxHostBytes = 255;        // host names and addresses
inline constexpr size_t kMaxReasonBytes = 1024;     // cancel reasons, a worker's leaving reason
inline constexpr size_t kMaxNoteBytes = 2000;       // a rank's note; one line of a stderr tail
inline constexpr size_t kMaxPathBytes = 4096;       // checkpoint and data paths
inline constexpr size_t kMaxStderrTailLines = 20;   // lines of a rank's stderr tail kept
inline constexpr size_t kMaxDeviceNameBytes = 256;  // a device's name

// `s` as valid UTF-8 of at most `max_bytes` bytes: each byte that does not start a valid UTF-8
// sequence becomes U+FFFD, and a longer text is cut at the last character boundary that leaves
// room for "..." (appended). `max_bytes` >= 3.
std::string BoundedUtf8(std::string_view s, size_t max_bytes);

// True when `s` is valid UTF-8 (no overlong forms, surrogates or code points past U+10FFFF).
bool IsValidUtf8(std::string_view s);

// `s` for a terminal: control characters (C0 but tab and newline when `keep_newlines`, DEL, C1)
// become "?", invalid UTF-8 becomes U+FFFD. Escape sequences a peer put into a job name, a
// reason or a trainer's stderr are then printed, never obeyed.
std::string PrintableText(std::string_view s, bool keep_newlines = false);

}  // namespace spindle
