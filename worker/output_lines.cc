// LineSplitter and TailBuffer (see output_lines.h).
#include "worker/output_lines.h"

namespace spindle {

void LineSplitter::Append(std::string_view bytes,
                          const std::function<void(std::string_view)>& on_line) {
  while (!bytes.empty()) {
    const size_t nl = bytes.find('\n');
    const std::string_view piece = bytes.substr(0, nl);
    if (!discarding_) {
      const size_t room = max_line_bytes_ - partial_.size();
      if (piece.size() > room) {
        partial_.append(piece.substr(0, room));
        discarding_ = true;
      } else {
        partial_.append(piece);
      }
    }
    if (nl == std::string_view::npos) return;
    Deliver(on_line);
    bytes.remove_prefix(nl + 1);
  }
}

void LineSplitter::Flush(const std::function<void(std::string_view)>& on_line) {
  if (!partial_.empty() || discarding_) Deliver(on_line);
}

void LineSplitter::Deliver(const std::function<void(std::string_view)>& on_line) {
  std::string_view line = partial_;
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  on_line(line);
  partial_.clear();
  discarding_ = false;
}

void TailBuffer::Push(std::string_view line) {
  if (capacity_ == 0) return;
  if (lines_.size() == capacity_) lines_.pop_front();
  lines_.emplace_back(line);
}

}  // namespace spindle
