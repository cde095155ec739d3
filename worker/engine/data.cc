// Data sources: token files, text files and synthetic long-context tasks (see data.h).
#include "worker/engine/data.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/text_tokens.h"
#include "worker/engine/rng.h"

namespace spindle {
namespace {

// A file mapped read-only for the object's life: the file-backed sources decode from it on
// demand, so a corpus of any size costs page cache rather than the process's own memory. The file
// must not be truncated while a job reads it.
class MappedFile {
 public:
  // NotFound for a file that cannot be opened, InvalidArgument for one that is not a regular file;
  // both name it. An empty file maps to no bytes.
  static absl::StatusOr<MappedFile> Open(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0)
      return absl::NotFoundError(
          absl::StrCat("data: cannot open \"", path, "\": ", strerror(errno)));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      return absl::InvalidArgumentError(absl::StrCat("data: \"", path, "\" is not a regular file"));
    }
    const auto size = static_cast<size_t>(st.st_size);
    void* map = size == 0 ? nullptr : ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
    const int map_errno = errno;
    ::close(fd);
    if (map == MAP_FAILED)
      return absl::InternalError(
          absl::StrCat("data: cannot map \"", path, "\": ", strerror(map_errno)));
    return MappedFile(static_cast<const unsigned char*>(map), size);
  }
  MappedFile(MappedFile&& o) noexcept : data_(std::exchange(o.data_, nullptr)), size_(o.size_) {}
  MappedFile& operator=(MappedFile&&) = delete;
  ~MappedFile() {
    if (data_ != nullptr) ::munmap(const_cast<unsigned char*>(data_), size_);
  }
  const unsigned char* data() const { return data_; }
  size_t size() const { return size_; }
  // Access hints around a sequential pass over the whole file.
  void Sequential(bool on) const {
    if (data_ != nullptr)
      ::madvise(const_cast<unsigned char*>(data_), size_, on ? MADV_SEQUENTIAL : MADV_NORMAL);
  }

 private:
  MappedFile(const unsigned char* data, size_t size) : data_(data), size_(size) {}
  const unsigned char* data_;
  size_t size_;
};

// A text file mapped read-only: sequence n is tokens [n * seq_len, (n + 1) * seq_len) of its
// token stream (TextCursor), wrapping around at its end. Opening walks the file once to count the
// stream and to keep a clean point about every kStride tokens (16 bytes each), from which a
// sequence is decoded on demand.
class TextFileSource : public DataSource {
 public:
  static constexpr int64_t kStride = 4096;

  TextFileSource(MappedFile file, int64_t seq_len) : file_(std::move(file)), seq_len_(seq_len) {
    file_.Sequential(true);
    TextCursor c = Cursor(0);
    index_.push_back({0, 0});
    int64_t pos = 0;
    for (;;) {
      if (pos >= index_.back().pos + kStride && c.Clean()) index_.push_back({pos, c.byte()});
      if (c.Next() < 0) break;
      ++pos;
    }
    tokens_ = pos;
    file_.Sequential(false);
  }

  std::vector<int32_t> Sequence(int64_t n) const override {
    const int64_t pos =
        static_cast<int64_t>((static_cast<unsigned __int128>(n) * seq_len_) % tokens_);
    const auto mark = std::prev(std::upper_bound(
        index_.begin(), index_.end(), pos, [](int64_t p, const Mark& m) { return p < m.pos; }));
    TextCursor c = Cursor(mark->byte);
    for (int64_t at = mark->pos; at < pos; ++at) c.Next();
    std::vector<int32_t> out(seq_len_);
    for (int32_t& t : out) {
      t = c.Next();
      if (t < 0) {  // the stream's end: wrap around
        c = Cursor(0);
        t = c.Next();
      }
    }
    return out;
  }
  int32_t eos_id() const override { return kByteEos; }

 private:
  struct Mark {
    int64_t pos;  // the stream position of the token decoded from `byte`
    size_t byte;
  };
  TextCursor Cursor(size_t byte) const { return TextCursor(file_.data(), file_.size(), byte); }

  MappedFile file_;
  int64_t seq_len_, tokens_ = 0;
  std::vector<Mark> index_;
};

// Index of the first of ids[0, n) that is >= limit, or -1: blocks are checked by their maximum
// (a loop the compiler vectorises) and only a failing block is searched. The ids are read in the
// host's byte order, which the token files' little-endian order must be.
template <typename T>
int64_t FirstAtLeast(const T* ids, int64_t n, int64_t limit) {
  static_assert(std::endian::native == std::endian::little);
  constexpr int64_t kBlock = int64_t{1} << 16;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t e = std::min(n, b + kBlock);
    T m = 0;
    for (int64_t i = b; i < e; ++i) m = std::max(m, ids[i]);
    if (static_cast<int64_t>(m) < limit) continue;
    for (int64_t i = b; i < e; ++i)
      if (static_cast<int64_t>(ids[i]) >= limit) return i;
  }
  return -1;
}

// A token file mapped read-only: sequence n is tokens [n * seq_len, (n + 1) * seq_len) of the
// file, wrapping around at its end, decoded from the mapping on demand.
class TokenFileSource : public DataSource {
 public:
  TokenFileSource(MappedFile file, int64_t width, int64_t seq_len, int32_t eos)
      : file_(std::move(file)),
        width_(width),
        tokens_(static_cast<int64_t>(file_.size()) / width),
        seq_len_(seq_len),
        eos_(eos) {}

  std::vector<int32_t> Sequence(int64_t n) const override {
    std::vector<int32_t> out(seq_len_);
    int64_t pos = static_cast<int64_t>((static_cast<unsigned __int128>(n) * seq_len_) % tokens_);
    for (int64_t i = 0; i < seq_len_; ++i) {
      out[i] = static_cast<int32_t>(Token(pos));
      if (++pos == tokens_) pos = 0;
    }
    return out;
  }
  int32_t eos_id() const override { return eos_; }

  uint32_t Token(int64_t i) const {
    const unsigned char* p = file_.data() + i * width_;
    return width_ == 2 ? static_cast<uint32_t>(p[0] | (p[1] << 8))
                       : (static_cast<uint32_t>(p[0]) | (p[1] << 8) | (p[2] << 16) |
                          (static_cast<uint32_t>(p[3]) << 24));
  }
  // The first token id >= vocab, or -1 (see FirstAtLeast).
  int64_t FirstOutside(int64_t vocab) const {
    const void* ids = file_.data();
    file_.Sequential(true);
    const int64_t i = width_ == 2 ? FirstAtLeast(static_cast<const uint16_t*>(ids), tokens_, vocab)
                                  : FirstAtLeast(static_cast<const uint32_t*>(ids), tokens_, vocab);
    file_.Sequential(false);
    return i;
  }

 private:
  const MappedFile file_;
  const int64_t width_, tokens_, seq_len_;
  const int32_t eos_;
};

// Token symbols of the synthetic tasks, all inside the byte vocabulary.
constexpr int32_t kFillerBase = 32, kFillerCount = 32;  // filler counts through 32..63
constexpr int32_t kKeyBase = 64, kKeyCount = 64;        // keys 64..127
constexpr int32_t kValBase = 128, kValCount = 64;       // values 128..191
constexpr int32_t kPairsEnd = 10, kQueryStart = 11, kCopySep = 12;

// Synthetic sources: sequence n is the first seq_len tokens of whole documents drawn from the
// stream keyed by (seed, n); the last document is cut by the sequence boundary.
class SyntheticSource : public DataSource {
 public:
  SyntheticSource(std::string task, int64_t seq_len, uint64_t seed, int64_t pairs, int64_t gap)
      : task_(std::move(task)), seq_len_(seq_len), seed_(seed), pairs_(pairs), gap_(gap) {}

  std::vector<int32_t> Sequence(int64_t n) const override {
    std::vector<int32_t> out;
    std::vector<bool> answers;
    Generate(n, &out, &answers);
    return out;
  }
  std::vector<bool> AnswerMask(int64_t n) const override {
    std::vector<int32_t> out;
    std::vector<bool> answers;
    Generate(n, &out, &answers);
    return answers;
  }
  int32_t eos_id() const override { return kByteEos; }

 private:
  void Generate(int64_t n, std::vector<int32_t>* out, std::vector<bool>* answers) const {
    Rng rng(HashCombine(seed_, static_cast<uint64_t>(n)));
    out->reserve(seq_len_ + 4096);
    while (static_cast<int64_t>(out->size()) < seq_len_) {
      if (task_ == "recall") Recall(rng, out, answers);
      else Copy(rng, out, answers);
    }
    out->resize(seq_len_);
    answers->resize(seq_len_);
  }
  static void Push(std::vector<int32_t>* out, std::vector<bool>* answers, int32_t t, bool ans) {
    out->push_back(t);
    answers->push_back(ans);
  }
  // [k1 v1 ... kn vn] PAIRS_END [filler x gap] QUERY_START [k_p(1) v_p(1) ...] EOS
  void Recall(Rng& rng, std::vector<int32_t>* out, std::vector<bool>* answers) const {
    const int64_t n = pairs_;
    std::vector<int32_t> keys, vals;
    while (static_cast<int64_t>(keys.size()) < n) {  // distinct keys
      int32_t k = kKeyBase + static_cast<int32_t>(rng.Below(kKeyCount));
      if (std::find(keys.begin(), keys.end(), k) == keys.end()) keys.push_back(k);
    }
    for (int64_t i = 0; i < n; ++i) vals.push_back(kValBase + static_cast<int32_t>(rng.Below(kValCount)));
    for (int64_t i = 0; i < n; ++i) {
      Push(out, answers, keys[i], false);
      Push(out, answers, vals[i], false);
    }
    Push(out, answers, kPairsEnd, false);
    int32_t f = static_cast<int32_t>(rng.Below(kFillerCount));
    for (int64_t i = 0; i < gap_; ++i) Push(out, answers, kFillerBase + (f++ % kFillerCount), false);
    Push(out, answers, kQueryStart, false);
    std::vector<int64_t> order(n);
    for (int64_t i = 0; i < n; ++i) order[i] = i;
    for (int64_t i = n - 1; i > 0; --i) std::swap(order[i], order[rng.Below(i + 1)]);
    for (int64_t i : order) {
      Push(out, answers, keys[i], false);
      Push(out, answers, vals[i], true);  // predictable only by recalling the pair
    }
    Push(out, answers, kByteEos, false);
  }
  // [s1 .. sm] SEP [s1 .. sm] EOS with m drawn around the gap length.
  void Copy(Rng& rng, std::vector<int32_t>* out, std::vector<bool>* answers) const {
    const int64_t m = std::max<int64_t>(8, gap_ / 2 + static_cast<int64_t>(rng.Below(gap_ / 2 + 1)));
    std::vector<int32_t> s(m);
    for (auto& t : s) t = kKeyBase + static_cast<int32_t>(rng.Below(kKeyCount));
    for (int32_t t : s) Push(out, answers, t, false);
    Push(out, answers, kCopySep, false);
    for (int32_t t : s) Push(out, answers, t, true);
    Push(out, answers, kByteEos, false);
  }

  std::string task_;
  int64_t seq_len_;
  uint64_t seed_;
  int64_t pairs_, gap_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DataSource>> OpenDataSource(const DataSpec& spec, int64_t seq_len,
                                                           int64_t vocab, uint64_t seed) {
  switch (spec.kind) {
    case DataKind::kSynthetic: {
      if (vocab < 257)
        return absl::InvalidArgumentError(absl::StrCat(
            "data: synthetic:", spec.task, " needs a vocabulary of at least 257, got ", vocab));
      return std::make_unique<SyntheticSource>(spec.task, seq_len, seed, spec.recall_pairs,
                                               spec.recall_gap);
    }
    case DataKind::kText: {
      if (vocab < 257)
        return absl::InvalidArgumentError(
            absl::StrCat("data: text needs a vocabulary of at least 257, got ", vocab));
      auto file = MappedFile::Open(spec.path);
      if (!file.ok()) return file.status();
      if (file->size() == 0)
        return absl::InvalidArgumentError(absl::StrCat("data: \"", spec.path, "\" is empty"));
      return std::make_unique<TextFileSource>(*std::move(file), seq_len);
    }
    case DataKind::kTokens: {
      const int64_t w = spec.token_bytes;
      auto file = MappedFile::Open(spec.path);
      if (!file.ok()) return file.status();
      const auto size = static_cast<int64_t>(file->size());
      if (size % w != 0)
        return absl::DataLossError(absl::StrCat("data: \"", spec.path, "\" is truncated: ", size,
                                                " bytes is not a multiple of ", w, "-byte tokens"));
      if (size / w < 2)
        return absl::InvalidArgumentError(
            absl::StrCat("data: \"", spec.path, "\" holds fewer than 2 tokens"));
      auto source = std::make_unique<TokenFileSource>(*std::move(file), w, seq_len,
                                                      static_cast<int32_t>(spec.eos_id));
      // Every id is checked once here (a sequential pass over the mapping), so a bad token fails
      // the job at its start rather than hours in. 16-bit ids below a vocabulary of 65536 and up
      // are all valid.
      if (w == 4 || vocab < 65536) {
        const int64_t i = source->FirstOutside(vocab);
        if (i >= 0)
          return absl::InvalidArgumentError(
              absl::StrCat("data: \"", spec.path, "\": token ", source->Token(i), " at index ", i,
                           " is outside the vocabulary (model.vocab = ", vocab, ")"));
      }
      return source;
    }
  }
  return absl::InternalError("data: unknown source kind");
}

}  // namespace spindle
