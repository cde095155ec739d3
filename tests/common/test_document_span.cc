// data.doc_span measured from a sample of a data file (common/document_span.h): documents as the
// job's sequences cut them, in token and text files, the sequences the job reads, and the errors
// that leave the span unknown; the spec field's parsing and round trip.
#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/document_span.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"

namespace spindle {
namespace {

class DocumentSpanTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/spindle-docspan-XXXXXX";
    dir_ = ::mkdtemp(tmpl);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // A uint16 token file of `tokens`.
  std::string Tokens(const std::string& name, const std::vector<uint16_t>& tokens) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path, std::ios::binary)
        .write(reinterpret_cast<const char*>(tokens.data()),
               static_cast<std::streamsize>(tokens.size() * 2));
    return path;
  }
  std::string Text(const std::string& name, const std::string& text) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path, std::ios::binary) << text;
    return path;
  }
  static JobSpec Spec(const std::string& source, int64_t seq_len, int64_t steps) {
    std::string json =
        R"({"name": "d", "model": {"preset": "tiny"}, "data": {"source": ")" + source + "\"";
    if (source.rfind("tokens:", 0) == 0) json += R"(, "eos_id": 0)";
    json += R"(}, "seq_len": )" + std::to_string(seq_len) + R"(, "train": {"steps": )" +
            std::to_string(steps) + "}}";
    absl::StatusOr<JobSpec> s = ParseJobSpec(json);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : JobSpec{};
  }

  std::string dir_;
};

// Documents of 3 and 5 tokens (EOS = 0 ends each) in sequences of 8: sum L^2 / sum L = 34 / 8.
TEST_F(DocumentSpanTest, TokenFileDocumentsAsTheSequencesHoldThem) {
  const std::string path = Tokens("a.bin", {7, 7, 0, 9, 9, 9, 9, 0, 7, 7, 0, 9, 9, 9, 9, 0});
  absl::StatusOr<double> span = SampleDocumentSpan(Spec("tokens:" + path, 8, 2));
  ASSERT_TRUE(span.ok()) << span.status();
  EXPECT_DOUBLE_EQ(*span, 34.0 / 8.0);
}

// Documents of 12 tokens in sequences of 8 are cut by the sequence boundaries: sequence 0 holds 8
// of the first, sequence 1 its last 4 and 4 of the next, sequence 2 (wrapping around the 24-token
// file) 8 again: (64 + 16 + 16 + 64) / 24. Sequences the job never reads are not sampled: a
// one-step job reads sequence 0 alone (span 8).
TEST_F(DocumentSpanTest, SequenceBoundariesCutDocumentsAndOnlyReadSequencesCount) {
  std::vector<uint16_t> tokens;
  for (int d = 0; d < 2; ++d) {
    for (int i = 0; i < 11; ++i) tokens.push_back(5);
    tokens.push_back(0);
  }
  const std::string path = Tokens("b.bin", tokens);
  absl::StatusOr<double> three = SampleDocumentSpan(Spec("tokens:" + path, 8, 3));
  ASSERT_TRUE(three.ok()) << three.status();
  EXPECT_DOUBLE_EQ(*three, 160.0 / 24.0);
  absl::StatusOr<double> one = SampleDocumentSpan(Spec("tokens:" + path, 8, 1));
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_DOUBLE_EQ(*one, 8.0);
}

// Text: paragraphs end at blank lines with EOS after their '\n' (common/text_tokens.h): "ab\n\n"
// is a, b, '\n', EOS, so two paragraphs of two letters are two documents of 4 tokens.
TEST_F(DocumentSpanTest, TextParagraphsAreDocuments) {
  const std::string path = Text("c.txt", "ab\n\ncd\n\n");
  absl::StatusOr<double> span = SampleDocumentSpan(Spec("text:" + path, 8, 1));
  ASSERT_TRUE(span.ok()) << span.status();
  EXPECT_DOUBLE_EQ(*span, 4.0);
}

TEST_F(DocumentSpanTest, UnreadableFilesNameTheProblemAndLeaveTheSpanUnknown) {
  const JobSpec missing = Spec("tokens:" + dir_ + "/none.bin", 8, 1);
  absl::StatusOr<double> span = SampleDocumentSpan(missing);
  EXPECT_EQ(span.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(span.status().message().find(dir_ + "/none.bin"), std::string::npos);
  std::string note;
  EXPECT_EQ(WithDocumentSpan(missing, &note).data.doc_span, 0.0);
  EXPECT_NE(note.find("documents not measured"), std::string::npos) << note;
  EXPECT_NE(note.find("data.doc_span"), std::string::npos) << note;

  const std::string odd = Text("odd.bin", "abc");  // 3 bytes: not uint16 tokens
  EXPECT_EQ(SampleDocumentSpan(Spec("tokens:" + odd, 8, 1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  const std::string empty = Text("empty.txt", "");
  EXPECT_EQ(SampleDocumentSpan(Spec("text:" + empty, 8, 1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SampleDocumentSpan(Spec("synthetic:copy", 8, 1)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// WithDocumentSpan measures what the spec leaves out and keeps what it gives; the field parses,
// round-trips, and is refused where it means nothing or is no length.
TEST_F(DocumentSpanTest, TheSpecFieldIsMeasuredOnlyWhereLeftOut) {
  const std::string path = Text("e.txt", "ab\n\ncd\n\n");
  JobSpec spec = Spec("text:" + path, 8, 1);
  std::string note = "x";
  EXPECT_EQ(WithDocumentSpan(spec, &note).data.doc_span, 4.0);
  EXPECT_EQ(note, "");
  spec.data.doc_span = 100;
  EXPECT_EQ(WithDocumentSpan(spec).data.doc_span, 100.0);
  absl::StatusOr<JobSpec> again = ParseJobSpec(spec.ToJson().dump());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->data.doc_span, 100.0);
  EXPECT_EQ(AttentionSpan(again->data), 100.0);

  const std::string base = R"({"name": "d", "model": {"preset": "tiny"}, "data": {"source": )";
  EXPECT_EQ(ParseJobSpec(base + R"("synthetic:copy", "doc_span": 10}})").status().message(),
            "job spec: data.doc_span: is for tokens: and text: sources (a synthetic source's "
            "documents are known)");
  EXPECT_EQ(ParseJobSpec(base + R"("text:/x", "doc_span": 0.5}})").status().message(),
            "job spec: data.doc_span: must be a document length in [1, 1e15] tokens, got 0.5");
}

}  // namespace
}  // namespace spindle
