// Sequence batches: targets, RoPE positions, document ids and segments of DESIGN.md section 2,
// the attention pairs model FLOPs count, the zigzag share of each CP rank, and synthetic data
// that is a pure function of (seed, index) and whose documents are as long as the planner's cost
// model assumes, and a data file's sampled document span (common/document_span.h) that is the
// engine's own count of its attention.
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "common/document_span.h"
#include "common/job_spec.h"
#include "common/model_config.h"
#include "gtest/gtest.h"
#include "worker/engine/batch.h"
#include "worker/engine/data.h"

namespace spindle {
namespace {

TEST(BatchTest, TargetsPositionsAndDocumentsFollowTheDesign) {
  // Documents: [5 6 E] [7 E] [8 9 ... cut by the sequence end; E = 0.
  Batch b = MakeSequenceBatch({5, 6, 0, 7, 0, 8, 9}, 0);
  EXPECT_EQ(b.targets, (std::vector<int32_t>{6, 0, -1, 0, -1, 9, -1}));
  EXPECT_EQ(b.pos, (std::vector<int32_t>{0, 1, 2, 0, 1, 0, 1}));
  EXPECT_EQ(b.doc, (std::vector<int32_t>{0, 0, 0, 1, 1, 2, 2}));
  ASSERT_EQ(b.pieces.size(), 1u);
  EXPECT_EQ(b.pieces[0].cu_seqlens, (std::vector<int32_t>{0, 3, 5, 7}));
  EXPECT_FALSE(b.pieces[0].continues);
  EXPECT_EQ(b.NumValidTargets(), 4);
}

// Model FLOPs count causal attention within documents: L^2 / 2 pairs each, so a sequence cut into
// k equal documents has 1/k of one document's attention FLOPs and the same matmul FLOPs.
TEST(BatchTest, AttentionPairsAndTrainFlopsFollowTheDocuments) {
  EXPECT_EQ(AttentionPairs(MakeSequenceBatch({5, 6, 0, 7, 0, 8, 9}, 0)), (9 + 4 + 4) / 2.0);
  std::vector<int32_t> one(4096, 3), four(4096, 3);
  for (int d = 1; d <= 4; ++d) four[d * 1024 - 1] = 0;  // each document ends with its eos
  const Batch b1 = MakeSequenceBatch(one, 0), b4 = MakeSequenceBatch(four, 0);
  EXPECT_EQ(AttentionPairs(b1), 4096.0 * 4096.0 / 2.0);
  EXPECT_EQ(AttentionPairs(b4), 4 * 1024.0 * 1024.0 / 2.0);
  const ModelConfig c = *ModelPreset("1b");
  EXPECT_DOUBLE_EQ(c.TrainFlops(4096, AttentionPairs(b1)), c.TrainFlopsPerToken(4096) * 4096);
  const double matmuls = c.TrainFlops(4096, 0.0);
  EXPECT_GT(matmuls, 0.0);
  EXPECT_NEAR(c.TrainFlops(4096, AttentionPairs(b4)) - matmuls,
              (c.TrainFlops(4096, AttentionPairs(b1)) - matmuls) / 4, 1e-6 * matmuls);
}

TEST(BatchTest, ZigzagSharesCoverTheSequenceOnceWithContinuations) {
  // 16 tokens, cp = 2: chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
  std::vector<int32_t> t = {1, 2, 3, 4, 5, 0, 6, 7, 8, 9, 10, 11, 12, 0, 13, 14};
  Batch full = MakeSequenceBatch(t, 0);
  Batch r0 = ShardZigzag(full, 2, 0), r1 = ShardZigzag(full, 2, 1);
  EXPECT_EQ(r0.idx, (std::vector<int32_t>{0, 1, 2, 3, 12, 13, 14, 15}));
  EXPECT_EQ(r1.idx, (std::vector<int32_t>{4, 5, 6, 7, 8, 9, 10, 11}));
  ASSERT_EQ(r0.pieces.size(), 2u);
  EXPECT_FALSE(r0.pieces[0].continues);
  EXPECT_TRUE(r0.pieces[1].continues);  // token 12 continues the document begun at 6
  EXPECT_EQ(r0.pieces[1].begin, 4);
  EXPECT_EQ(r0.pieces[1].cu_seqlens, (std::vector<int32_t>{0, 2, 4}));  // a start at 14
  EXPECT_TRUE(r1.pieces[0].continues);   // token 4 continues the first document
  EXPECT_EQ(r1.pieces[0].cu_seqlens, (std::vector<int32_t>{0, 2, 4}));   // a start at 6
  EXPECT_TRUE(r1.pieces[1].continues);
  for (const Batch* r : {&r0, &r1})
    for (int64_t i = 0; i < r->T; ++i) {
      EXPECT_EQ(r->ids[i], t[r->idx[i]]);
      EXPECT_EQ(r->targets[i], full.targets[r->idx[i]]);
      EXPECT_EQ(r->pos[i], full.pos[r->idx[i]]);
    }
}

TEST(BatchTest, SyntheticDataIsAFunctionOfSeedAndIndex) {
  DataSpec d;
  d.task = "recall";
  d.recall_pairs = 4;
  d.recall_gap = 100;
  auto a = OpenDataSource(d, 512, 257, 3), b = OpenDataSource(d, 512, 257, 3),
       c = OpenDataSource(d, 512, 257, 4);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ((*a)->Sequence(7), (*b)->Sequence(7));
  EXPECT_NE((*a)->Sequence(7), (*a)->Sequence(8));
  EXPECT_NE((*a)->Sequence(7), (*c)->Sequence(7));
  // Every answer follows its key, whose pair appeared more than recall_gap tokens earlier.
  std::vector<int32_t> s = (*a)->Sequence(0);
  std::vector<bool> ans = (*a)->AnswerMask(0);
  int answers = 0;
  for (size_t i = 1; i < s.size(); ++i) {
    if (!ans[i]) continue;
    ++answers;
    bool found = false;
    for (size_t j = 0; j + 100 < i && !found; ++j)
      found = s[j] == s[i - 1] && s[j + 1] == s[i];
    EXPECT_TRUE(found) << "answer at " << i;
  }
  EXPECT_GE(answers, 4);
}

// The cost model counts a synthetic source's attention as T span / 2 pairs
// (SyntheticAttentionSpan, common/job_spec.h); the generator's documents must agree.
TEST(BatchTest, SyntheticDocumentsSpanWhatThePlannerCounts) {
  struct Case {
    std::string task;
    int64_t pairs, gap;
  };
  for (const Case& c : {Case{"recall", 8, 1024}, Case{"recall", 3, 40}, Case{"copy", 0, 1024},
                        Case{"copy", 0, 9}}) {
    DataSpec d;
    d.task = c.task;
    if (c.pairs > 0) d.recall_pairs = c.pairs;
    d.recall_gap = c.gap;
    const int64_t T = 65536;
    auto src = OpenDataSource(d, T, 257, 11);
    ASSERT_TRUE(src.ok()) << src.status();
    double pairs = 0;
    const int n = 4;
    for (int i = 0; i < n; ++i)
      pairs += AttentionPairs(MakeSequenceBatch((*src)->Sequence(i), (*src)->eos_id()));
    const double counted = n * T * SyntheticAttentionSpan(d) / 2.0;
    // The last document of each sequence is cut, and copy lengths are random: 3%.
    EXPECT_NEAR(pairs / counted, 1.0, 0.03) << c.task << " gap " << c.gap;
  }
  DataSpec file;
  file.kind = DataKind::kTokens;
  EXPECT_EQ(SyntheticAttentionSpan(file), 0.0);
}

// A file's data.doc_span, as the sample measures it over every sequence a job reads, is what the
// engine's attention spans over those sequences: T doc_span / 2 pairs each, for token files
// (documents of random lengths, some longer than a sequence) and text files.
TEST(BatchTest, SampledFileDocumentsSpanWhatTheEngineAttends) {
  char tmpl[] = "/tmp/spindle-batch-docs-XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  std::mt19937 rng(3);
  std::vector<uint16_t> tokens;
  std::string text;
  while (tokens.size() < 4096) {
    const int len = 1 + static_cast<int>(rng() % 400);
    for (int i = 0; i + 1 < len; ++i) tokens.push_back(static_cast<uint16_t>(5 + rng() % 50));
    tokens.push_back(2);  // EOS
    text += std::string(static_cast<size_t>(len), 'x') + "\n\n";
  }
  tokens.resize(4096);
  std::ofstream(dir + "/t.bin", std::ios::binary)
      .write(reinterpret_cast<const char*>(tokens.data()), 4096 * 2);
  std::ofstream(dir + "/t.txt", std::ios::binary) << text;
  const int64_t T = 256, n = 12;  // fewer sequences than the files hold
  for (const std::string& source : {"tokens:" + dir + "/t.bin", "text:" + dir + "/t.txt"}) {
    SCOPED_TRACE(source);
    JobSpec spec;
    spec.data.source = source;
    spec.data.kind = source[0] == 't' && source[1] == 'o' ? DataKind::kTokens : DataKind::kText;
    spec.data.path = source.substr(source.find(':') + 1);
    spec.data.eos_id = 2;
    spec.seq_len = T;
    spec.train.steps = n;
    absl::StatusOr<double> span = SampleDocumentSpan(spec);
    ASSERT_TRUE(span.ok()) << span.status();
    auto src = OpenDataSource(spec.data, T, 300, 1);
    ASSERT_TRUE(src.ok()) << src.status();
    double pairs = 0;
    for (int64_t i = 0; i < n; ++i)
      pairs += AttentionPairs(MakeSequenceBatch((*src)->Sequence(i), (*src)->eos_id()));
    if (spec.data.kind == DataKind::kTokens) {
      EXPECT_DOUBLE_EQ(pairs, n * T * *span / 2.0);
    } else {  // a text sequence is sampled at byte n T, its tokens a little later in the stream
      EXPECT_NEAR(pairs / (n * T * *span / 2.0), 1.0, 0.1);
    }
    EXPECT_LT(*span, static_cast<double>(T));
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace spindle
