// Data sources: token files, text files and synthetic long-context tasks (see data.h).
#include "worker/engine/data.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "worker/engine/rng.h"

namespace spindle {
namespace {

// Stream-backed sources: sequence n is tokens [n * seq_len, (n + 1) * seq_len) of the stream,
// wrapping around at its end.
class StreamSource : public DataSource {
 public:
  StreamSource(std::vector<int32_t> stream, int64_t seq_len, int32_t eos)
      : stream_(std::move(stream)), seq_len_(seq_len), eos_(eos) {}
  std::vector<int32_t> Sequence(int64_t n) const override {
    std::vector<int32_t> out(seq_len_);
    const int64_t size = static_cast<int64_t>(stream_.size());
    int64_t pos = static_cast<int64_t>((static_cast<unsigned __int128>(n) * seq_len_) % size);
    for (int64_t i = 0; i < seq_len_; ++i) {
      out[i] = stream_[pos];
      if (++pos == size) pos = 0;
    }
    return out;
  }
  int32_t eos_id() const override { return eos_; }

 private:
  std::vector<int32_t> stream_;
  int64_t seq_len_;
  int32_t eos_;
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
// file, wrapping around at its end, decoded from the mapping on demand, so a corpus of any size
// costs page cache rather than the process's own memory. The file must not be truncated while a
// job reads it.
class TokenFileSource : public DataSource {
 public:
  TokenFileSource(const unsigned char* map, size_t map_bytes, int64_t width, int64_t tokens,
                  int64_t seq_len, int32_t eos)
      : map_(map),
        map_bytes_(map_bytes),
        width_(width),
        tokens_(tokens),
        seq_len_(seq_len),
        eos_(eos) {}
  TokenFileSource(const TokenFileSource&) = delete;
  TokenFileSource& operator=(const TokenFileSource&) = delete;
  ~TokenFileSource() override { ::munmap(const_cast<unsigned char*>(map_), map_bytes_); }

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
    const unsigned char* p = map_ + i * width_;
    return width_ == 2 ? static_cast<uint32_t>(p[0] | (p[1] << 8))
                       : (static_cast<uint32_t>(p[0]) | (p[1] << 8) | (p[2] << 16) |
                          (static_cast<uint32_t>(p[3]) << 24));
  }

 private:
  const unsigned char* const map_;
  const size_t map_bytes_;
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

// Reads a whole file; NotFound / DataLoss errors name the file.
absl::StatusOr<std::string> ReadFile(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0)
    return absl::NotFoundError(absl::StrCat("data: cannot open \"", path, "\": ", strerror(errno)));
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat("data: \"", path, "\" is not a regular file"));
  }
  std::string buf(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < buf.size()) {
    ssize_t r = ::read(fd, buf.data() + got, buf.size() - got);
    if (r <= 0) break;
    got += static_cast<size_t>(r);
  }
  ::close(fd);
  if (got != buf.size())
    return absl::DataLossError(absl::StrCat("data: short read of \"", path, "\""));
  return buf;
}

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
      auto bytes = ReadFile(spec.path);
      if (!bytes.ok()) return bytes.status();
      if (bytes->empty())
        return absl::InvalidArgumentError(absl::StrCat("data: \"", spec.path, "\" is empty"));
      std::vector<int32_t> stream;
      stream.reserve(bytes->size() + 1);
      const std::string& s = *bytes;
      for (size_t i = 0; i < s.size(); ++i) {
        if (s[i] == '\n' && i + 1 < s.size() && s[i + 1] == '\n') {  // paragraph break
          stream.push_back('\n');
          stream.push_back(kByteEos);
          while (i + 1 < s.size() && s[i + 1] == '\n') ++i;
          continue;
        }
        stream.push_back(static_cast<unsigned char>(s[i]));
      }
      if (stream.back() != kByteEos) stream.push_back(kByteEos);
      return std::make_unique<StreamSource>(std::move(stream), seq_len, kByteEos);
    }
    case DataKind::kTokens: {
      const int64_t w = spec.token_bytes;
      const int fd = ::open(spec.path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0)
        return absl::NotFoundError(
            absl::StrCat("data: cannot open \"", spec.path, "\": ", strerror(errno)));
      struct stat st;
      if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        ::close(fd);
        return absl::InvalidArgumentError(
            absl::StrCat("data: \"", spec.path, "\" is not a regular file"));
      }
      const auto size = static_cast<int64_t>(st.st_size);
      if (size % w != 0) {
        ::close(fd);
        return absl::DataLossError(absl::StrCat("data: \"", spec.path, "\" is truncated: ", size,
                                                " bytes is not a multiple of ", w, "-byte tokens"));
      }
      const int64_t n = size / w;
      if (n < 2) {
        ::close(fd);
        return absl::InvalidArgumentError(
            absl::StrCat("data: \"", spec.path, "\" holds fewer than 2 tokens"));
      }
      void* map = ::mmap(nullptr, static_cast<size_t>(size), PROT_READ, MAP_SHARED, fd, 0);
      const int map_errno = errno;
      ::close(fd);
      if (map == MAP_FAILED)
        return absl::InternalError(
            absl::StrCat("data: cannot map \"", spec.path, "\": ", strerror(map_errno)));
      auto source = std::make_unique<TokenFileSource>(static_cast<const unsigned char*>(map),
                                                      static_cast<size_t>(size), w, n, seq_len,
                                                      static_cast<int32_t>(spec.eos_id));
      // Every id is checked once here (a sequential pass over the mapping), so a bad token fails
      // the job at its start rather than hours in. 16-bit ids below a vocabulary of 65536 and up
      // are all valid.
      if (w == 4 || vocab < 65536) {
        ::madvise(map, static_cast<size_t>(size), MADV_SEQUENTIAL);
        const int64_t i = w == 2 ? FirstAtLeast(static_cast<const uint16_t*>(map), n, vocab)
                                 : FirstAtLeast(static_cast<const uint32_t*>(map), n, vocab);
        if (i >= 0)
          return absl::InvalidArgumentError(
              absl::StrCat("data: \"", spec.path, "\": token ", source->Token(i), " at index ", i,
                           " is outside the vocabulary (model.vocab = ", vocab, ")"));
        ::madvise(map, static_cast<size_t>(size), MADV_NORMAL);
      }
      return source;
    }
  }
  return absl::InternalError("data: unknown source kind");
}

}  // namespace spindle
