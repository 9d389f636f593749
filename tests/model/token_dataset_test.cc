// TokenDataset and the built-in corpus: determinism, the split, rank-disjoint stateless sampling,
// and clear errors for unusable data.
#include <filesystem>
#include <fstream>
#include <set>

#include <gtest/gtest.h>

#include <mxddp/model.h>

namespace mxddp::testing {
namespace {

TEST(BuiltinCorpus, IsDeterministicTextWithStructure) {
  const std::string a = builtin_corpus(100'000), b = builtin_corpus(100'000);
  EXPECT_EQ(a, b);
  EXPECT_EQ(a.size(), 100'000u);
  EXPECT_NE(builtin_corpus(1000, 1), builtin_corpus(1000, 2));
  for (unsigned char ch : a) EXPECT_TRUE(ch == '\n' || (ch >= 32 && ch < 127)) << int{ch};
  // Verb agreement: a singular subject takes "sees", a plural one "see".
  EXPECT_NE(a.find("The cat sees"), std::string::npos);
  EXPECT_EQ(a.find("The cat see "), std::string::npos);
  EXPECT_EQ(a.find("The cats sees"), std::string::npos);
  const TokenDataset data(a, 0.1, 16);
  EXPECT_GT(data.unigram_entropy(), 2.5);
  EXPECT_LT(data.unigram_entropy(), 3.3);
}

TEST(TokenDataset, SplitsTheLastFractionForValidation) {
  const TokenDataset data(std::string(1000, 'a'), 0.25, 8);
  EXPECT_EQ(data.train_tokens(), 750);
  EXPECT_EQ(data.valid_tokens(), 250);
  EXPECT_DOUBLE_EQ(data.unigram_entropy(), 0.0);
}

TEST(TokenDataset, SamplesAreStatelessDeterministicAndFromTheRightSplit) {
  // Train bytes are 'a'..'z' cycling, validation bytes are all '#'.
  std::string text;
  for (int i = 0; i < 900; ++i) text += static_cast<char>('a' + i % 26);
  text += std::string(100, '#');
  const TokenDataset data(text, 0.1, 8);
  constexpr int kSeq = 9;
  std::vector<int32_t> x(4 * kSeq), y(4 * kSeq), z(2 * kSeq);
  data.fill_batch(false, 42, 3, 0, 4, x.data());
  data.fill_batch(false, 42, 3, 0, 4, y.data());
  EXPECT_EQ(x, y);
  // The sequences of a global batch do not depend on how it is split into ranks or micro-batches.
  data.fill_batch(false, 42, 3, 2, 2, z.data());
  EXPECT_TRUE(std::equal(z.begin(), z.end(), x.begin() + 2 * kSeq));
  for (int k = 0; k < 4; ++k)
    for (int t = 1; t < kSeq; ++t) {
      const int32_t prev = x[static_cast<size_t>(k * kSeq + t - 1)], cur = x[static_cast<size_t>(k * kSeq + t)];
      EXPECT_EQ(cur, 'a' + (prev - 'a' + 1) % 26) << "training sequences are contiguous training text";
    }
  data.fill_batch(true, 42, 0, 0, 2, z.data());
  for (int32_t t : z) EXPECT_EQ(t, '#');
  // Another iteration or seed gives other sequences.
  data.fill_batch(false, 42, 4, 0, 4, y.data());
  EXPECT_NE(x, y);
  data.fill_batch(false, 43, 3, 0, 4, y.data());
  EXPECT_NE(x, y);
}

TEST(TokenDataset, RanksReadDisjointSequencesOfTheGlobalBatch) {
  const TokenDataset data(builtin_corpus(1 << 16), 0.1, 32);
  constexpr int kGlobal = 8, kDp = 4, kSeq = 33;
  std::set<std::vector<int32_t>> seen;
  for (int r = 0; r < kDp; ++r) {
    std::vector<int32_t> t(static_cast<size_t>(kGlobal / kDp) * kSeq);
    data.fill_batch(false, 1, 0, r * (kGlobal / kDp), kGlobal / kDp, t.data());
    for (int k = 0; k < kGlobal / kDp; ++k) seen.insert(std::vector<int32_t>(t.begin() + k * kSeq, t.begin() + (k + 1) * kSeq));
  }
  EXPECT_EQ(seen.size(), static_cast<size_t>(kGlobal));
}

TEST(TokenDataset, UnusableDataIsAClearError) {
  EXPECT_THROW(TokenDataset::from_file("/nonexistent/text.txt", 0.1, 8), Error);
  const auto empty = std::filesystem::temp_directory_path() / "mxddp_empty.txt";
  std::ofstream(empty).close();
  EXPECT_THROW(TokenDataset::from_file(empty.string(), 0.1, 8), Error);
  try {
    TokenDataset(std::string(20, 'x'), 0.1, 64);
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--seq-length 64"), std::string::npos) << e.what();
  }
  EXPECT_THROW(TokenDataset(std::string(200, 'x'), 1.0, 8), Error);
  const TokenDataset no_valid(std::string(200, 'x'), 0.0, 8);
  std::vector<int32_t> t(9);
  EXPECT_THROW(no_valid.fill_batch(true, 0, 0, 0, 1, t.data()), Error);
}

}  // namespace
}  // namespace mxddp::testing
