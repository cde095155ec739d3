// Bounded, valid UTF-8 from peers (common/text_bounds.h): cuts land on character boundaries,
// invalid bytes become U+FFFD, and what is printed holds no control characters.
#include <string>

#include "common/text_bounds.h"
#include "gtest/gtest.h"

namespace spindle {
namespace {

TEST(TextBounds, ValidShortTextIsKept) {
  EXPECT_EQ(BoundedUtf8("héllo", 100), "héllo");
  EXPECT_EQ(BoundedUtf8("", 10), "");
}

TEST(TextBounds, LongTextIsCutOnACharacterBoundary) {
  std::string wide;
  for (int i = 0; i < 100; ++i) wide += "\xC3\xA9";  // é, two bytes
  const std::string cut = BoundedUtf8(wide, 10);
  EXPECT_TRUE(IsValidUtf8(cut));
  EXPECT_LE(cut.size(), 10u);
  EXPECT_EQ(cut, "\xC3\xA9\xC3\xA9\xC3\xA9...");
  const std::string four = BoundedUtf8(std::string(50, 'a'), 12);
  EXPECT_EQ(four, "aaaaaaaaa...");
}

TEST(TextBounds, InvalidBytesBecomeReplacementCharacters) {
  EXPECT_FALSE(
      IsValidUtf8("a\xFF"
                  "b"));
  EXPECT_FALSE(IsValidUtf8("\xC3"));              // cut sequence
  EXPECT_FALSE(IsValidUtf8("\xC0\xAF"));          // overlong
  EXPECT_FALSE(IsValidUtf8("\xED\xA0\x80"));      // surrogate
  EXPECT_FALSE(IsValidUtf8("\xF4\x90\x80\x80"));  // past U+10FFFF
  EXPECT_TRUE(IsValidUtf8("\xF0\x9F\x98\x80 \xE2\x82\xAC"));
  EXPECT_EQ(BoundedUtf8("a\xFF"
                        "b",
                        100),
            "a\xEF\xBF\xBD"
            "b");
  EXPECT_EQ(BoundedUtf8("half \xC3", 100), "half \xEF\xBF\xBD");
}

TEST(TextBounds, PrintableTextHasNoControlCharacters) {
  EXPECT_EQ(PrintableText("\x1b[2J red\x07 \x7f tab\tok"), "?[2J red? ? tab\tok");
  EXPECT_EQ(PrintableText("a\nb"), "a?b");
  EXPECT_EQ(PrintableText("a\nb", /*keep_newlines=*/true), "a\nb");
  EXPECT_EQ(PrintableText("c1 \xC2\x9B"), "c1 ?");  // CSI as a C1 control
  EXPECT_EQ(PrintableText("bad \xFF"), "bad \xEF\xBF\xBD");
  EXPECT_EQ(PrintableText("é"), "é");
}

}  // namespace
}  // namespace spindle
