// Line handling for a child process's output pipes: LineSplitter turns a byte stream into lines
// (bounded length, so a runaway writer cannot grow the daemon without limit) and TailBuffer keeps
// the last N lines of a stream (the stderr tail reported when a trainer exits).
//
// Thread-safety: neither class is thread-safe; each is owned by the thread that reads the pipe.
#pragma once

#include <cstddef>
#include <deque>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace spindle {

// Splits appended bytes at '\n'. A trailing '\r' is dropped. Lines longer than `max_line_bytes`
// are cut there and the rest of that line is discarded (the kept prefix is still delivered).
class LineSplitter {
 public:
  explicit LineSplitter(size_t max_line_bytes = 64 * 1024) : max_line_bytes_(max_line_bytes) {}

  // Feeds `bytes`; calls `on_line` once per completed line (without the newline).
  void Append(std::string_view bytes, const std::function<void(std::string_view)>& on_line);
  // Delivers a final line that had no newline (at end of stream), if any.
  void Flush(const std::function<void(std::string_view)>& on_line);

 private:
  void Deliver(const std::function<void(std::string_view)>& on_line);

  const size_t max_line_bytes_;
  std::string partial_;
  bool discarding_ = false;  // the current line overflowed; drop bytes until its newline
};

// The last `capacity` lines pushed, oldest first.
class TailBuffer {
 public:
  explicit TailBuffer(size_t capacity) : capacity_(capacity) {}
  void Push(std::string_view line);
  std::vector<std::string> Lines() const { return {lines_.begin(), lines_.end()}; }

 private:
  const size_t capacity_;
  std::deque<std::string> lines_;
};

}  // namespace spindle
