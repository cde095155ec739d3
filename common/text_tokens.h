// The text source's tokenizer (DESIGN.md section 5, "text:<path>"): UTF-8 bytes as tokens 0..255,
// each paragraph (text between blank lines) a document ending with EOS = 256. One definition for
// the engine's text source (worker/engine/data.cc) and for the planner's sample of a text file's
// documents (common/document_span.h). Header-only; a cursor is thread-compatible.
#pragma once

#include <cstddef>
#include <cstdint>

namespace spindle {

// Token ids of the synthetic and text sources (byte vocabulary).
inline constexpr int32_t kByteEos = 256;

// The text source's tokenizer as a cursor over the file's bytes: a paragraph break (a run of two
// or more newlines) becomes '\n' then EOS, every other byte is its own token, and a file that does
// not end with a break gets a final EOS. A cursor may start at byte 0 or at any point where a
// cursor from byte 0 was clean (see Clean); Next returns -1 once the stream has ended.
class TextCursor {
 public:
  TextCursor(const unsigned char* s, size_t n, size_t at) : s_(s), n_(n), i_(at) {}
  // Whether a cursor started at byte() would give the same tokens from here: no break's EOS is
  // due and the file has not ended (Next skips a break's whole run of newlines at once, so byte()
  // is never inside one).
  bool Clean() const { return !eos_due_ && i_ < n_; }
  size_t byte() const { return i_; }
  int32_t Next() {
    if (eos_due_) {
      eos_due_ = false, last_eos_ = true;
      return kByteEos;
    }
    if (i_ == n_) {
      if (last_eos_) return -1;
      last_eos_ = true;
      return kByteEos;
    }
    last_eos_ = false;
    const unsigned char c = s_[i_++];
    if (c == '\n' && i_ < n_ && s_[i_] == '\n') {  // a paragraph break: skip its run
      while (i_ < n_ && s_[i_] == '\n') ++i_;
      eos_due_ = true;
    }
    return c;
  }

 private:
  const unsigned char* s_;
  size_t n_, i_;
  bool eos_due_ = false, last_eos_ = false;
};

}  // namespace spindle
