// Trainer-level behaviour: the tiny model learns the recall task far below the loss of
// predicting token frequencies; resuming from a checkpoint is exact; recompute follows the
// options or the spec without changing the result; bad data and checkpoints give one clear error
// and change nothing.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/engine/train_test_util.h"
#include "worker/engine/batch.h"
#include "worker/engine/checkpoint.h"
#include "worker/engine/trainer.h"

namespace spindle {
namespace {

std::string TempDir(const std::string& tag) {
  char tmpl[] = "/tmp/spindle-test-XXXXXX";
  std::string d = mkdtemp(tmpl);
  return d + "/" + tag;
}

JobSpec TinyJob(int64_t steps, int64_t seq_len, int64_t gap) {
  auto spec = ParseJobSpec(R"({"name": "t", "model": {"preset": "tiny"},
      "data": {"source": "synthetic:recall", "recall_pairs": 6, "recall_gap": )" +
                           std::to_string(gap) + R"(}, "seq_len": )" + std::to_string(seq_len) +
                           R"(, "train": {"steps": )" + std::to_string(steps) +
                           R"(, "lr": 3e-3, "warmup_steps": 5, "seed": 7}})");
  EXPECT_TRUE(spec.ok()) << spec.status();
  return *spec;
}

using testing::UnigramLoss;

TEST(TrainerTest, TinyRecallLearnsFarBelowTokenFrequencies) {
  JobSpec spec = TinyJob(/*steps=*/60, /*seq_len=*/1024, /*gap=*/256);
  std::vector<double> losses;
  TrainerOptions o;
  o.spec = spec;
  auto t = Trainer::Create(std::move(o));
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_TRUE((*t)->Run().ok());
  auto data = OpenDataSource(spec.data, spec.seq_len, spec.model.vocab, spec.train.seed);
  ASSERT_TRUE(data.ok());
  const double unigram = UnigramLoss(**data, 8);
  const auto& l = (*t)->losses();
  ASSERT_EQ(l.size(), 60u);
  double last = 0;
  for (int i = 55; i < 60; ++i) last += l[i] / 5;
  EXPECT_GT(unigram, 2.5);
  EXPECT_LT(last, 0.35 * unigram) << "first loss " << l[0] << ", unigram " << unigram;
  EXPECT_LT(last, 0.5 * l[0]);
}

TEST(TrainerTest, ResumeIsExact) {
  JobSpec spec = TinyJob(/*steps=*/6, /*seq_len=*/256, /*gap=*/64);
  spec.checkpoint.every = 3;
  // One run of 6 steps.
  TrainerOptions a;
  a.spec = spec;
  a.checkpoint_dir = TempDir("a");
  auto ta = Trainer::Create(a);
  ASSERT_TRUE(ta.ok());
  ASSERT_TRUE((*ta)->Run().ok());
  // 3 steps, stop, a new trainer resumes from the checkpoint and runs the other 3.
  TrainerOptions b = a;
  b.checkpoint_dir = TempDir("b");
  b.stop_at_step = 3;
  auto tb = Trainer::Create(b);
  ASSERT_TRUE(tb.ok());
  ASSERT_TRUE((*tb)->Run().ok());
  ASSERT_EQ((*tb)->losses().size(), 3u);
  b.stop_at_step = -1;
  auto tc = Trainer::Create(b);
  ASSERT_TRUE(tc.ok());
  EXPECT_EQ((*tc)->state().step, 3);
  ASSERT_TRUE((*tc)->Run().ok());
  ASSERT_EQ((*tc)->losses().size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ((*ta)->losses()[i], (*tb)->losses()[i]) << "step " << i + 1;
    EXPECT_EQ((*ta)->losses()[3 + i], (*tc)->losses()[i]) << "step " << i + 4;
  }
  ParamSet& pa = (*ta)->backend().host_params();
  ParamSet& pc = (*tc)->backend().host_params();
  for (int64_t j = 0; j < pa.numel(); ++j)
    ASSERT_EQ(pa.flat_data().f32()[j], pc.flat_data().f32()[j]) << "parameter element " << j;
}

// A job whose train.steps is below its checkpoint's step is refused at Create (it would report
// success without training), and the checkpoint stays; at exactly its step there is nothing left.
TEST(TrainerTest, CheckpointPastTheJobsStepsIsRefused) {
  JobSpec spec = TinyJob(/*steps=*/4, /*seq_len=*/256, /*gap=*/64);
  spec.checkpoint.every = 4;
  TrainerOptions o;
  o.spec = spec;
  o.checkpoint_dir = TempDir("past");
  auto first = Trainer::Create(o);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE((*first)->Run().ok());
  o.spec.train.steps = 3;
  auto refused = Trainer::Create(o);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("is at step 4, past the job's train.steps = 3"),
            std::string::npos)
      << refused.status();
  o.spec.train.steps = 4;
  auto done = Trainer::Create(o);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ((*done)->state().step, 4);
  ASSERT_TRUE((*done)->Run().ok());
  EXPECT_TRUE((*done)->losses().empty());
}

// The trainer takes its spec parsed (spindle-train's ReadPlannedJob or LoadJobSpec parsed it, the
// one time in that process): creating and running it parses no spec again.
TEST(TrainerTest, TheEngineNeverParsesTheSpecAgain) {
  JobSpec spec = TinyJob(/*steps=*/1, /*seq_len=*/128, /*gap=*/32);
  const int64_t before = JobSpecParsesForTesting();
  TrainerOptions o;
  o.spec = spec;
  int64_t steps = 0;
  o.on_event = [&](const nlohmann::json& e) { steps += e["event"] == "step"; };
  auto t = Trainer::Create(std::move(o));
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_TRUE((*t)->Run().ok());
  EXPECT_EQ(steps, 1);
  EXPECT_EQ(JobSpecParsesForTesting() - before, 0);
}

// How many layers recompute: the planned spec's count, reported in the start event; the CPU
// engine's losses and weights do not depend on it; an undecided "auto" (the planner's to decide)
// and an impossible count are refused at Create.
TEST(TrainerTest, RecomputeLayersComeFromThePlannedSpec) {
  JobSpec spec = TinyJob(/*steps=*/3, /*seq_len=*/256, /*gap=*/64);
  std::vector<std::unique_ptr<Trainer>> runs;
  for (int64_t layers : {0, 4, 2, 3}) {
    SCOPED_TRACE(::testing::Message() << "recompute " << layers);
    spec.train.recompute_layers = layers;
    TrainerOptions o;
    o.spec = spec;
    int64_t reported = -1;
    o.on_event = [&](const nlohmann::json& e) {
      if (e["event"] == "start") reported = e["recompute_layers"].get<int64_t>();
    };
    auto t = Trainer::Create(std::move(o));
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ((*t)->recompute().layers, layers);
    ASSERT_TRUE((*t)->Run().ok());
    EXPECT_EQ(reported, layers);
    runs.push_back(std::move(*t));
  }
  for (size_t r = 1; r < runs.size(); ++r) {
    EXPECT_EQ(runs[r]->losses(), runs[0]->losses()) << "run " << r;
    ParamSet& a = runs[0]->backend().host_params();
    ParamSet& b = runs[r]->backend().host_params();
    for (int64_t j = 0; j < a.numel(); ++j)
      ASSERT_EQ(a.flat_data().f32()[j], b.flat_data().f32()[j]) << "run " << r << " element " << j;
  }
  TrainerOptions bad;
  bad.spec = spec;
  bad.spec.train.recompute_layers = 5;
  auto refused = Trainer::Create(std::move(bad));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().message(), "trainer: recompute_layers must be in [0, 4], got 5");
  TrainerOptions open;
  open.spec = spec;
  open.spec.train.recompute_layers = TrainSpec::kRecomputeAuto;
  auto undecided = Trainer::Create(std::move(open));
  ASSERT_FALSE(undecided.ok());
  EXPECT_EQ(undecided.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(undecided.status().message().find("train.recompute is \"auto\""), std::string::npos)
      << undecided.status();
}

TEST(TrainerTest, CheckpointEvaluatesToTheTrainedModelsLoss) {
  JobSpec spec = TinyJob(/*steps=*/3, /*seq_len=*/256, /*gap=*/64);
  TrainerOptions o;
  o.spec = spec;
  o.checkpoint_dir = TempDir("eval");
  auto t = Trainer::Create(o);
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*t)->Run().ok());
  auto ckpt = LatestCheckpoint(o.checkpoint_dir);
  ASSERT_TRUE(ckpt.ok());
  auto r = EvaluateCheckpoint(spec, *ckpt, spec.data, 2);
  ASSERT_TRUE(r.ok()) << r.status();
  auto data = OpenDataSource(spec.data, spec.seq_len, spec.model.vocab, spec.train.seed);
  double sum = 0;
  int64_t n = 0;
  for (int i = 0; i < 2; ++i) {
    auto s = (*t)->backend().Forward(MakeSequenceBatch((*data)->Sequence(i), (*data)->eos_id()));
    ASSERT_TRUE(s.ok()) << s.status();
    sum += s->loss_sum;
    n += s->n_valid;
  }
  EXPECT_EQ(r->n_valid, n);
  EXPECT_NEAR(r->loss, sum / n, 1e-9);
  EXPECT_GT(r->n_answers, 0);
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

TEST(DataErrorsTest, MissingTruncatedAndOutOfVocabularyFiles) {
  const std::string dir = TempDir("");
  DataSpec d;
  d.kind = DataKind::kTokens;
  d.token_bytes = 2;
  d.eos_id = 0;
  d.path = dir + "missing.bin";
  auto s = OpenDataSource(d, 16, 100, 1);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(s.status().message().find("missing.bin"), std::string::npos) << s.status();
  d.path = dir + "odd.bin";
  WriteBytes(d.path, std::string("\x01\x00\x02", 3));
  s = OpenDataSource(d, 16, 100, 1);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(s.status().message().find("truncated"), std::string::npos) << s.status();
  d.path = dir + "oov.bin";
  WriteBytes(d.path, std::string("\x01\x00\x02\x00\xc8\x00\x00\x00", 8));  // 200 at index 2
  s = OpenDataSource(d, 16, 100, 1);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.status().message(),
            "data: \"" + d.path + "\": token 200 at index 2 is outside the vocabulary (model.vocab = 100)");
  d.path = dir + "good.bin";
  WriteBytes(d.path, std::string("\x01\x00\x02\x00\x00\x00\x05\x00", 8));
  s = OpenDataSource(d, 3, 100, 1);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ((*s)->Sequence(0), (std::vector<int32_t>{1, 2, 0}));
  EXPECT_EQ((*s)->Sequence(1), (std::vector<int32_t>{5, 1, 2}));  // wraps around
}

// The process's anonymous resident memory (RssAnon of /proc/self/status), in bytes.
int64_t AnonymousResidentBytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("RssAnon:", 0) == 0) return std::stoll(line.substr(8)) * 1024;
  return -1;
}

// A token file of fresh random ids (both widths) reads back as the stream it holds, sequence by
// sequence with the wrap at its end, and a 64 MB file costs the process no memory of its own: it
// is mapped, not loaded. An id past the vocabulary deep inside the file is still found at open.
TEST(DataTokensTest, LargeFilesAreMappedAndReadBackExactly) {
  const std::string dir = TempDir("");
  std::mt19937_64 rng(std::random_device{}());
  for (const int64_t width : {2, 4}) {
    const int64_t vocab = width == 2 ? 50000 : 150000, n = (int64_t{64} << 20) / width + 5;
    std::vector<uint32_t> ids(n);
    std::string bytes(n * width, '\0');
    for (int64_t i = 0; i < n; ++i) {
      ids[i] = static_cast<uint32_t>(rng() % vocab);
      for (int64_t b = 0; b < width; ++b)
        bytes[i * width + b] = static_cast<char>(ids[i] >> (8 * b));
    }
    DataSpec d;
    d.kind = DataKind::kTokens;
    d.token_bytes = width;
    d.eos_id = 0;
    d.path = dir + "ids" + std::to_string(width) + ".bin";
    WriteBytes(d.path, bytes);
    bytes = std::string();
    const int64_t seq_len = 4093, before = AnonymousResidentBytes();
    auto s = OpenDataSource(d, seq_len, vocab, 1);
    ASSERT_TRUE(s.ok()) << s.status();
    const int64_t last = n / seq_len;  // the sequence that wraps around the end
    for (const int64_t k : {int64_t{0}, int64_t{1}, last - 1, last, last + 1, 3 * last + 7}) {
      const std::vector<int32_t> got = (*s)->Sequence(k);
      ASSERT_EQ(static_cast<int64_t>(got.size()), seq_len);
      for (int64_t i = 0; i < seq_len; ++i)
        ASSERT_EQ(static_cast<uint32_t>(got[i]), ids[(k * seq_len + i) % n])
            << "width " << width << " sequence " << k << " token " << i;
    }
    EXPECT_LT(AnonymousResidentBytes() - before, int64_t{8} << 20) << "width " << width;
    s = absl::InternalError("closed");
    // One id past the vocabulary, three quarters of the way in.
    const int64_t bad = 3 * n / 4;
    {
      std::fstream f(d.path, std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(bad * width);
      for (int64_t b = 0; b < width; ++b) f.put(static_cast<char>(vocab >> (8 * b)));
    }
    s = OpenDataSource(d, seq_len, vocab, 1);
    EXPECT_EQ(s.status().message(),
              absl::StrCat("data: \"", d.path, "\": token ", vocab, " at index ", bad,
                           " is outside the vocabulary (model.vocab = ", vocab, ")"));
    std::remove(d.path.c_str());
  }
}

// The text source's tokens, by its definition in data.h, from the whole file in memory: the
// reference the mapped source must match.
std::vector<int32_t> TextTokens(const std::string& s) {
  std::vector<int32_t> out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\n' && i + 1 < s.size() && s[i + 1] == '\n') {  // a paragraph break
      out.push_back('\n');
      out.push_back(kByteEos);
      while (i + 1 < s.size() && s[i + 1] == '\n') ++i;
      continue;
    }
    out.push_back(static_cast<unsigned char>(s[i]));
  }
  if (out.back() != kByteEos) out.push_back(kByteEos);
  return out;
}

absl::StatusOr<std::unique_ptr<DataSource>> OpenText(const std::string& path, int64_t seq_len) {
  DataSpec d;
  d.kind = DataKind::kText;
  d.path = path;
  return OpenDataSource(d, seq_len, 300, 1);
}

// Text files, from a few hand-written edge cases to fresh random ones full of newline runs and
// to a 64 MB one, read back as the reference tokenization (TextTokens) does, sequence by sequence
// across the wrap at the end; the 64 MB file costs the process no memory of its own.
TEST(DataTextTest, TextFilesReadBackAsParagraphsOfBytes) {
  const std::string dir = TempDir("");
  const std::string path = dir + "corpus.txt";
  const std::vector<std::pair<std::string, std::vector<int32_t>>> cases = {
      {"a", {'a', kByteEos}},
      {"a\n", {'a', '\n', kByteEos}},
      {"\n\n", {'\n', kByteEos}},
      {"\n", {'\n', kByteEos}},
      {"\n\n\nab\n\n", {'\n', kByteEos, 'a', 'b', '\n', kByteEos}},
      {"x\ny\n\n\n\nz", {'x', '\n', 'y', '\n', kByteEos, 'z', kByteEos}},
      {"\xc3\xa9\n\n", {0xc3, 0xa9, '\n', kByteEos}},
  };
  for (const auto& [text, want] : cases) {
    WriteBytes(path, text);
    const auto n = static_cast<int64_t>(want.size());
    auto s = OpenText(path, n);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ((*s)->Sequence(0), want) << ::testing::PrintToString(text);
    EXPECT_EQ((*s)->Sequence(5), want) << ::testing::PrintToString(text);
    EXPECT_EQ((*s)->eos_id(), kByteEos);
  }

  std::mt19937_64 rng(std::random_device{}());
  const uint64_t seed = rng();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  rng.seed(seed);
  // Random files of 'a', 'b' and newlines (runs of every length, at both ends or not), every
  // sequence of three lengths compared whole.
  for (int file = 0; file < 6; ++file) {
    std::string text(20000 + rng() % 20000, 'a');
    for (char& c : text) c = "ab\n\n"[rng() % 4];
    WriteBytes(path, text);
    const std::vector<int32_t> want = TextTokens(text);
    const auto total = static_cast<int64_t>(want.size());
    for (const int64_t seq_len : {int64_t{7}, int64_t{4093}, total + 3}) {
      auto s = OpenText(path, seq_len);
      ASSERT_TRUE(s.ok()) << s.status();
      for (int64_t k = 0; k * seq_len < 2 * total; ++k) {
        const std::vector<int32_t> got = (*s)->Sequence(k);
        ASSERT_EQ(static_cast<int64_t>(got.size()), seq_len);
        for (int64_t i = 0; i < seq_len; ++i)
          ASSERT_EQ(got[i], want[(k * seq_len + i) % total])
              << "file " << file << " seq_len " << seq_len << " sequence " << k << " token " << i;
      }
    }
  }

  // 64 MB of words and paragraphs.
  std::string text;
  text.reserve(size_t{64} << 20);
  while (text.size() < (size_t{64} << 20)) {
    text.append("word");
    text.push_back(static_cast<char>('a' + rng() % 26));
    text.append(rng() % 40 == 0 ? std::string(1 + rng() % 3, '\n') : " ");
  }
  WriteBytes(path, text);
  const std::vector<int32_t> want = TextTokens(text);
  text = std::string();
  const auto total = static_cast<int64_t>(want.size());
  const int64_t seq_len = 32768, last = total / seq_len, before = AnonymousResidentBytes();
  auto s = OpenText(path, seq_len);
  ASSERT_TRUE(s.ok()) << s.status();
  for (const int64_t k : {int64_t{0}, int64_t{1}, last / 2, last, last + 1, 5 * last + 3}) {
    const std::vector<int32_t> got = (*s)->Sequence(k);
    for (int64_t i = 0; i < seq_len; ++i)
      ASSERT_EQ(got[i], want[(k * seq_len + i) % total]) << "sequence " << k << " token " << i;
  }
  EXPECT_LT(AnonymousResidentBytes() - before, int64_t{8} << 20);
  s = absl::InternalError("closed");
  std::remove(path.c_str());

  // Missing and empty files.
  s = OpenText(dir + "missing.txt", 16);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(s.status().message().find("missing.txt"), std::string::npos) << s.status();
  WriteBytes(path, "");
  s = OpenText(path, 16);
  EXPECT_EQ(s.status().message(), "data: \"" + path + "\" is empty");
  std::remove(path.c_str());
}

// A full volume (a write to /dev/full fails as one does) fails the job without restarts, naming
// the remedy; other I/O failures are runtime failures (the gang restarts).
TEST(CheckpointErrorsTest, AFullVolumeIsNotRetried) {
  const int fd = ::open("/dev/full", O_WRONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  const char byte = 1;
  const ssize_t w = ::write(fd, &byte, 1);
  const int err = errno;
  ::close(fd);
  ASSERT_EQ(w, -1);
  ASSERT_EQ(err, ENOSPC);
  const absl::Status full = CheckpointIoError("cannot write", "/ck/step_00000004", err);
  EXPECT_EQ(full.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(full.message(),
            "checkpoint: cannot write \"/ck/step_00000004\": No space left on device (free space "
            "on the checkpoint volume, or lower checkpoint.keep; the job resumes from its last "
            "complete checkpoint when submitted again)");
  EXPECT_EQ(CheckpointIoError("cannot write", "/ck", EDQUOT).code(),
            absl::StatusCode::kFailedPrecondition);
  const absl::Status io = CheckpointIoError("cannot write", "/ck", EIO);
  EXPECT_EQ(io.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(io.message(),
            "checkpoint: cannot write \"/ck\": Input/output error (transient: the gang restarts)");
  EXPECT_EQ(CheckpointIoError("cannot write", "/ck", EROFS).code(), absl::StatusCode::kInternal);
}

TEST(CheckpointErrorsTest, CorruptTruncatedAndMismatchedChangeNothing) {
  JobSpec spec = TinyJob(2, 128, 32);
  TrainerOptions o;
  o.spec = spec;
  o.checkpoint_dir = TempDir("ck");
  auto t = Trainer::Create(o);
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*t)->Run().ok());
  auto dir = LatestCheckpoint(o.checkpoint_dir);
  ASSERT_TRUE(dir.ok());
  auto fresh = Model::Create(spec.model, 99);
  ASSERT_TRUE(fresh.ok());
  ParamSet& P = (*fresh)->params();
  std::vector<float> before(P.flat_data().f32(), P.flat_data().f32() + P.numel());
  auto unchanged = [&] {
    for (int64_t j = 0; j < P.numel(); ++j)
      if (P.flat_data().f32()[j] != before[j]) return false;
    return true;
  };
  // A model of another size.
  ModelConfig other = spec.model;
  other.ffn_dim = 128;
  auto wrong = Model::Create(other, 1);
  auto r = LoadCheckpoint(*dir, (*wrong)->params(), nullptr, other);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("model.ffn_dim is 176, the job has 128"), std::string::npos)
      << r.status();
  // One flipped byte.
  const std::string model_file = *dir + "/model.safetensors";
  std::fstream f(model_file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(200);
  char c;
  f.seekg(200);
  f.get(c);
  f.seekp(200);
  f.put(static_cast<char>(c ^ 0x40));
  f.close();
  r = LoadCheckpoint(*dir, P, nullptr, spec.model);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(r.status().message(),
            "checkpoint: \"" + model_file + "\" is corrupt: checksum mismatch");
  EXPECT_TRUE(unchanged());
  // Truncated.
  ASSERT_EQ(truncate(model_file.c_str(), 100), 0);
  r = LoadCheckpoint(*dir, P, nullptr, spec.model);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(r.status().message().find("truncated"), std::string::npos) << r.status();
  EXPECT_TRUE(unchanged());
}

}  // namespace
}  // namespace spindle
