// Fuzz target: the token file and text file readers (OpenDataSource with tokens:<path> and
// text:<path>), on the input written to a temporary file. Opening must give a source or an
// error status; every sequence a source gives has exactly seq_len tokens, each inside the
// vocabulary, for any sequence number (the data position is a user-visible integer).
//
// Input: 4 header bytes, then the file. Byte 0 picks the source (0: uint16 tokens, 1: uint32
// tokens, 2: text), byte 1 the sequence length (2 + byte % 64), byte 2 the vocabulary (one of
// kVocabs), byte 3 the EOS id of a token file (below the vocabulary).
// Seeds: corpus/fuzz_data/ (small token and text files).
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "common/job_spec.h"
#include "worker/engine/data.h"

namespace {

constexpr int64_t kVocabs[] = {257, 300, 1000, 65535, 65536, 70000, int64_t{1} << 31};

std::string g_file;

void RemoveFile() { ::unlink(g_file.c_str()); }

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  std::string tmpl =
      (std::filesystem::exists("/dev/shm") ? std::string("/dev/shm") : std::string("/tmp")) +
      "/spindle-fuzz-data-XXXXXX";
  const int fd = mkstemp(tmpl.data());
  if (fd < 0) std::abort();
  ::close(fd);
  g_file = tmpl;
  std::atexit(RemoveFile);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  spindle::DataSpec spec;
  const int kind = data[0] % 3;
  const int64_t seq_len = 2 + data[1] % 64;
  const int64_t vocab = kVocabs[data[2] % (sizeof(kVocabs) / sizeof(kVocabs[0]))];
  spec.path = g_file;
  if (kind == 2) {
    spec.kind = spindle::DataKind::kText;
    spec.source = "text:" + g_file;
  } else {
    spec.kind = spindle::DataKind::kTokens;
    spec.source = "tokens:" + g_file;
    spec.token_bytes = kind == 0 ? 2 : 4;
    spec.eos_id = data[3] % vocab;
  }
  {
    std::ofstream out(g_file, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data) + 4, static_cast<std::streamsize>(size - 4));
  }
  auto source = spindle::OpenDataSource(spec, seq_len, vocab, /*seed=*/1);
  if (!source.ok()) return 0;
  for (const int64_t n : {int64_t{0}, int64_t{1}, static_cast<int64_t>(size), int64_t{1} << 40,
                          std::numeric_limits<int64_t>::max()}) {
    const std::vector<int32_t> seq = (*source)->Sequence(n);
    if (static_cast<int64_t>(seq.size()) != seq_len) std::abort();
    for (const int32_t t : seq)
      if (t < 0 || t >= vocab) std::abort();
  }
  return 0;
}
