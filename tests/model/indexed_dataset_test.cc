// Megatron's indexed datasets (data.h): the reader against .bin/.idx files this test writes by the
// MMIDIDX format's own rules, hostile files refused naming the field, --split's boundaries, the
// GPT sample index (contiguous windows, whole epochs, seeded, the same samples whoever reads them
// in whatever pieces) and the blend's proportions; and the text check of --data files.
#include <sys/stat.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include <gtest/gtest.h>

#include <mxddp/data.h>
#include <mxddp/model.h>

#include "../core/error_of.h"

namespace mxddp::testing {
namespace {

namespace fs = std::filesystem;

// A document is a list of sequences, each a list of token ids.
using Document = std::vector<std::vector<int64_t>>;

struct Files {
  std::string idx, bin;
};

template <typename T>
void put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof v);  // x86-64: little-endian, as the format
}

// The two files' bytes for `docs`, written as the format's writer does: header, then lengths
// (int32), pointers (int64, each sequence right after the previous), document indices (int64,
// from 0, the sequence where each document starts, the sequence count last).
Files encode(const std::vector<Document>& docs, int code) {
  const std::map<int, int> width = {{1, 1}, {2, 1}, {3, 2}, {4, 4}, {5, 8}, {8, 2}};
  Files f;
  std::vector<int32_t> lengths;
  std::vector<int64_t> pointers, doc_index{0};
  for (const Document& d : docs) {
    for (const auto& seq : d) {
      pointers.push_back(static_cast<int64_t>(f.bin.size()));
      lengths.push_back(static_cast<int32_t>(seq.size()));
      for (int64_t t : seq) switch (code) {
          case 1: put(f.bin, static_cast<uint8_t>(t)); break;
          case 2: put(f.bin, static_cast<int8_t>(t)); break;
          case 3: put(f.bin, static_cast<int16_t>(t)); break;
          case 4: put(f.bin, static_cast<int32_t>(t)); break;
          case 5: put(f.bin, t); break;
          case 8: put(f.bin, static_cast<uint16_t>(t)); break;
        }
    }
    doc_index.push_back(static_cast<int64_t>(lengths.size()));
  }
  EXPECT_EQ(f.bin.size(), pointers.empty() ? 0 : pointers.back() + lengths.back() * width.at(code));
  f.idx.append("MMIDIDX\0\0", 9);
  put(f.idx, uint64_t{1});
  put(f.idx, static_cast<uint8_t>(code));
  put(f.idx, static_cast<uint64_t>(lengths.size()));
  put(f.idx, static_cast<uint64_t>(doc_index.size()));
  for (int32_t n : lengths) put(f.idx, n);
  for (int64_t p : pointers) put(f.idx, p);
  for (int64_t d : doc_index) put(f.idx, d);
  return f;
}

class IndexedDatasetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("mxddp_indexed_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string write(const std::string& name, const Files& f) {
    const std::string prefix = (dir_ / name).string();
    std::ofstream(prefix + ".idx", std::ios::binary).write(f.idx.data(), static_cast<std::streamsize>(f.idx.size()));
    std::ofstream(prefix + ".bin", std::ios::binary).write(f.bin.data(), static_cast<std::streamsize>(f.bin.size()));
    return prefix;
  }
  // The error opening `f` (written under `name`) gives.
  std::string open_error(const Files& f) {
    const std::string prefix = write("hostile", f);
    return error_of([&] { IndexedDataset d(prefix); });
  }

  fs::path dir_;
};

// Documents whose tokens say where they are: token = 1000 x document + position in it.
std::vector<Document> numbered_documents(int count, int min_tokens, int sequences_per_doc = 1) {
  std::vector<Document> docs;
  for (int d = 0; d < count; ++d) {
    Document doc;
    const int tokens = min_tokens + (d * 7) % 13;
    int position = 0;
    for (int s = 0; s < sequences_per_doc; ++s) {
      std::vector<int64_t> seq;
      const int n = tokens / sequences_per_doc + (s == 0 ? tokens % sequences_per_doc : 0);
      for (int i = 0; i < n; ++i) seq.push_back(1000 * d + position++);
      doc.push_back(seq);
    }
    docs.push_back(doc);
  }
  return docs;
}

TEST_F(IndexedDatasetTest, ReadsWhatTheFormatsRulesWriteInEveryIntegerDtype) {
  const std::vector<Document> docs = {{{1, 2, 3}, {4}}, {{}}, {{200, 7}}, {}};
  for (int code : {1, 2, 3, 4, 5, 8}) {
    const std::string prefix = write(fmt::format("dtype{}", code), encode(docs, code));
    const IndexedDataset d(prefix);
    EXPECT_EQ(d.dtype().code, code);
    EXPECT_EQ(d.num_documents(), 4);
    EXPECT_EQ(d.num_sequences(), 4);
    EXPECT_EQ(d.document_tokens(0), 4);
    EXPECT_EQ(d.document_tokens(1), 0);
    EXPECT_EQ(d.document_tokens(3), 0);  // a document of no sequences
    EXPECT_EQ(d.document_first_sequence(2), 3);
    std::vector<int64_t> t(2);
    d.read_sequence(0, 1, 2, t.data());
    EXPECT_EQ(t, (std::vector<int64_t>{2, 3}));
    d.read_sequence(3, 0, 2, t.data());
    const int64_t expected = code == 2 ? static_cast<int8_t>(200) : 200;  // int8 wraps as the writer stores it
    EXPECT_EQ(t, (std::vector<int64_t>{expected, 7}));
  }
}

TEST_F(IndexedDatasetTest, HostileIndexesAreRefusedNamingTheField) {
  const Files good = encode({{{1, 2, 3}}, {{4, 5}}, {{6}}}, 8);  // 3 sequences, 4 document indices
  const int64_t lengths_at = 34, pointers_at = 34 + 3 * 4, documents_at = pointers_at + 3 * 8;
  auto with = [&](int64_t at, auto value) {
    Files f = good;
    std::memcpy(f.idx.data() + at, &value, sizeof value);
    return f;
  };
  EXPECT_EQ(open_error(good), "(no error)");
  Files f = good;
  f.idx.resize(20);
  EXPECT_NE(open_error(f).find("is truncated: 20 bytes, but the MMIDIDX header alone is 34"), std::string::npos) << open_error(f);
  f = good;
  f.idx[0] = 'X';
  EXPECT_NE(open_error(f).find("its magic (first 9 bytes) is not"), std::string::npos);
  EXPECT_NE(open_error(with(9, uint64_t{2})).find("version 2 is not supported"), std::string::npos);
  EXPECT_NE(open_error(with(17, uint8_t{9})).find("dtype code 9 does not exist"), std::string::npos);
  EXPECT_NE(open_error(with(17, uint8_t{7})).find("dtype code 7 (float32) holds floats"), std::string::npos);
  EXPECT_NE(open_error(with(18, uint64_t{1} << 62)).find("sequence count 4611686018427387904 does not fit"),
            std::string::npos);
  EXPECT_NE(open_error(with(26, ~uint64_t{0})).find("document count 18446744073709551615 is not valid"),
            std::string::npos);
  EXPECT_NE(open_error(with(26, uint64_t{0})).find("document count 0 is not valid"), std::string::npos);
  f = good;
  f.idx.resize(f.idx.size() - 8);  // the last document index cut off
  EXPECT_NE(open_error(f).find("the file is truncated or the counts are wrong"), std::string::npos) << open_error(f);
  EXPECT_NE(open_error(with(18, uint64_t{4})).find("the file is truncated or the counts are wrong"), std::string::npos);
  EXPECT_NE(open_error(with(lengths_at + 4, int32_t{-1})).find("sequence length 1 is -1"), std::string::npos);
  // Pointers: past .bin, out of order (overlapping the previous sequence), not aligned.
  EXPECT_NE(open_error(with(pointers_at + 16, int64_t{1} << 40)).find("sequence 2 (1 tokens of uint16 at byte 1099511627776) ends past"),
            std::string::npos) << open_error(with(pointers_at + 16, int64_t{1} << 40));
  EXPECT_NE(open_error(with(pointers_at + 8, int64_t{0})).find("sequence pointer 1 is 0"), std::string::npos);
  EXPECT_NE(open_error(with(pointers_at + 8, int64_t{7})).find("sequence pointer 1 is 7; valid: a multiple of the token width 2"),
            std::string::npos);
  EXPECT_NE(open_error(with(lengths_at + 8, int32_t{1} << 30)).find("ends past"), std::string::npos);
  // Document indices: from 0, non-decreasing, ending at the sequence count.
  EXPECT_NE(open_error(with(documents_at, int64_t{1})).find("document index 0 is 1"), std::string::npos);
  EXPECT_NE(open_error(with(documents_at + 16, int64_t{0})).find("document index 2 is 0 (the previous is 1)"),
            std::string::npos);
  EXPECT_NE(open_error(with(documents_at + 24, int64_t{2})).find("the last document index is 2 but the sequence count is 3"),
            std::string::npos);
  // Not regular files, or missing.
  const std::string prefix = write("fifo", good);
  fs::remove(prefix + ".bin");
  EXPECT_NE(error_of([&] { IndexedDataset d(prefix); }).find("cannot be opened"), std::string::npos);
  ASSERT_EQ(::mkfifo((prefix + ".bin").c_str(), 0600), 0);
  EXPECT_NE(error_of([&] { IndexedDataset d(prefix); }).find("is a FIFO"), std::string::npos);
}

TEST_F(IndexedDatasetTest, TokenIdsOutsideTheVocabularyAreRefusedNamingIdDocumentAndFile) {
  const std::string prefix = write("ids", encode({{{1, 2}}, {{3, 4}, {5, 300}}}, 8));
  const IndexedDataset d(prefix);
  std::vector<int64_t> counts(301, 0);
  EXPECT_EQ(error_of([&] { d.check_token_ids(0, 2, 301, &counts); }), "(no error)");
  EXPECT_EQ(counts[300], 1);
  const std::string e = error_of([&] { d.check_token_ids(0, 2, 300, nullptr); });
  EXPECT_NE(e.find("token id 300 in document 1 (token 3 of it, sequence 2) of '" + prefix + ".bin'"), std::string::npos) << e;
  const std::string negative = write("negative", encode({{{1, -5}}}, 4));
  const IndexedDataset n(negative);
  EXPECT_NE(error_of([&] { n.check_token_ids(0, 1, 10, nullptr); }).find("token id -5 in document 0"), std::string::npos);
}

TEST(DataSplit, BoundariesAreMegatronsRoundedPartsOverTheDocuments) {
  const auto w = parse_split("969,30,1");
  EXPECT_NEAR(w[0], 0.969, 1e-12);
  EXPECT_EQ(split_document_ranges(w, 1000), (std::array<int64_t, 4>{0, 969, 999, 1000}));
  // round(9.69) + round(0.3) + round(0.01) = 10: everything trains.
  EXPECT_EQ(split_document_ranges(w, 10), (std::array<int64_t, 4>{0, 10, 10, 10}));
  // 2/3 and 1/3 of 10: 7 and 3.
  EXPECT_EQ(split_document_ranges(parse_split("2,1"), 10), (std::array<int64_t, 4>{0, 7, 10, 10}));
  // The cumulative book-ends are rounded half to even, as Python's round: 0.5 -> 0, 1.5 -> 2,
  // 2.5 -> 2.
  EXPECT_EQ(split_document_ranges(parse_split("1/1"), 1), (std::array<int64_t, 4>{0, 0, 1, 1}));
  EXPECT_EQ(split_document_ranges(parse_split("1,1"), 3), (std::array<int64_t, 4>{0, 2, 3, 3}));
  EXPECT_EQ(split_document_ranges(parse_split("1,1,2"), 10), (std::array<int64_t, 4>{0, 2, 5, 10}));
  EXPECT_EQ(split_document_ranges(parse_split("969,30,1"), 0), (std::array<int64_t, 4>{0, 0, 0, 0}));
  EXPECT_EQ(split_document_ranges(parse_split("1,1,1"), 3), (std::array<int64_t, 4>{0, 1, 2, 3}));
  for (const char* bad : {"", "1,2,3,4", "a,1", "-1,2", "0,0,0", "1,,2", "inf,1"})
    EXPECT_NE(error_of([&] { parse_split(bad); }).find("--split '" + std::string(bad) + "' is not valid"),
              std::string::npos) << bad;
}

TEST_F(IndexedDatasetTest, EachEpochCutsTheShuffledDocumentsIntoContiguousWindows) {
  const std::vector<Document> docs = numbered_documents(20, 10, 2);
  const IndexedDataset d(write("epochs", encode(docs, 4)));
  const int seq = 8;
  const GptSampleIndex index(d, 5, 15, seq, 100000, 42, "test");  // documents 5..14
  int64_t tokens = 0;
  for (int k = 5; k < 15; ++k) tokens += d.document_tokens(k);
  EXPECT_EQ(index.tokens(), tokens);
  ASSERT_EQ(index.samples_per_epoch(), (tokens - 1) / seq);
  std::vector<int32_t> t(seq + 1);
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    std::set<int32_t> seen;  // each window's first `seq` tokens: every token of the split once
    for (int64_t s = 0; s < index.samples_per_epoch(); ++s) {
      index.fill(epoch * index.samples_per_epoch() + s, t.data());
      for (int i = 0; i <= seq; ++i) {
        const int doc = t[static_cast<size_t>(i)] / 1000;
        EXPECT_TRUE(doc >= 5 && doc < 15) << "a token of document " << doc << " outside the split";
        // Consecutive tokens: the next position of the same document, or a document's start.
        if (i > 0 && t[static_cast<size_t>(i)] != t[static_cast<size_t>(i - 1)] + 1) {
          EXPECT_EQ(t[static_cast<size_t>(i)] % 1000, 0) << "sample " << s << " token " << i;
        }
        if (i < seq) {
          EXPECT_TRUE(seen.insert(t[static_cast<size_t>(i)]).second) << "token read twice in an epoch";
        }
      }
    }
    EXPECT_EQ(static_cast<int64_t>(seen.size()), index.samples_per_epoch() * seq);
  }
}

TEST_F(IndexedDatasetTest, SamplesAreSeededAndTheSameInAnyReadingOrder) {
  const IndexedDataset d(write("order", encode(numbered_documents(30, 5), 4)));
  const int seq = 6;
  const GptSampleIndex a(d, 0, 30, seq, 100000, 7, "a"), b(d, 0, 30, seq, 100000, 7, "b"),
      other(d, 0, 30, seq, 100000, 8, "other");
  const int64_t per_epoch = a.samples_per_epoch();
  auto sample = [&](const GptSampleIndex& index, int64_t s) {
    std::vector<int32_t> t(seq + 1);
    index.fill(s, t.data());
    return t;
  };
  std::vector<std::vector<int32_t>> forward;
  for (int64_t s = 0; s < 3 * per_epoch; ++s) forward.push_back(sample(a, s));
  // Backwards and jumping between epochs (the cache holds two): the same tokens.
  for (int64_t s = 3 * per_epoch - 1; s >= 0; s -= 5) EXPECT_EQ(sample(b, s), forward[static_cast<size_t>(s)]) << s;
  EXPECT_EQ(sample(b, 2 * per_epoch + 1), forward[static_cast<size_t>(2 * per_epoch + 1)]);
  EXPECT_EQ(sample(b, 3), forward[3]);
  // Another seed, another order; and each epoch is its own shuffle.
  int same_seed_other = 0, same_epoch_next = 0;
  for (int64_t s = 0; s < per_epoch; ++s) {
    same_seed_other += sample(other, s) == forward[static_cast<size_t>(s)];
    same_epoch_next += forward[static_cast<size_t>(per_epoch + s)] == forward[static_cast<size_t>(s)];
  }
  EXPECT_LT(same_seed_other, per_epoch / 2);
  EXPECT_LT(same_epoch_next, per_epoch / 2);
}

TEST_F(IndexedDatasetTest, TooFewTokensForOneSampleIsAnErrorNamingTheSplit) {
  const IndexedDataset d(write("short", encode({{{1, 2, 3}}}, 4)));
  EXPECT_NE(error_of([&] { GptSampleIndex(d, 0, 1, 3, 10, 0, "the train split of 'x'"); })
                .find("the train split of 'x' holds 3 tokens (documents 0..1), but one sample of --seq-length 3 needs 4"),
            std::string::npos);
}

TEST_F(IndexedDatasetTest, BlendsFollowTheirWeightsAndReadTheSameSamplesOnAnyDp) {
  const std::string a = write("a", encode(numbered_documents(40, 12), 4));
  std::vector<Document> b_docs = numbered_documents(40, 12);
  for (Document& doc : b_docs)
    for (auto& seq : doc)
      for (int64_t& t : seq) t += 500;  // dataset b's tokens: position 500 and up
  const std::string b = write("b", encode(b_docs, 4));
  const BlendedGptDatasetOptions options{
      .blend = {{1.0, a}, {3.0, b}}, .split = parse_split("8,1,1"), .seq_length = 8, .seed = 3, .vocab_size = 50000};
  const BlendedGptDataset blend(options);
  EXPECT_DOUBLE_EQ(blend.weight(0), 0.25);
  EXPECT_EQ(blend.documents(0, DataSplit::kValid), (std::pair<int64_t, int64_t>{32, 36}));
  // Greedy blending: after n samples each dataset has had its share within one sample, and its own
  // samples in order 0, 1, 2, ...
  std::vector<int64_t> next(2, 0);
  for (int64_t s = 0; s < 4000; ++s) {
    const auto [k, local] = blend.locate(DataSplit::kTrain, s);
    EXPECT_EQ(local, next[static_cast<size_t>(k)]++);
    const double expected = blend.weight(k) * static_cast<double>(s + 1);
    EXPECT_LE(std::abs(static_cast<double>(next[static_cast<size_t>(k)]) - expected), 1.0) << s;
  }
  EXPECT_EQ(next[0], 1000);
  EXPECT_EQ(next[1], 3000);
  EXPECT_EQ(blend.locate(DataSplit::kTrain, 5), (std::pair<int, int64_t>{1, 3}));  // going back replays
  // The same 64 samples read by 1 rank at once, by 4 ranks in micro-batches of 2 (each a fresh
  // object, as each rank's own), and resumed at sample 40.
  const int row = 9;
  std::vector<int32_t> whole(64 * row), pieces(64 * row);
  BlendedGptDataset(options).fill(DataSplit::kTrain, 0, 64, whole.data());
  for (int rank = 0; rank < 4; ++rank) {
    const BlendedGptDataset mine(options);
    for (int it = 0; it < 2; ++it)
      for (int m = 0; m < 4; ++m) {
        const int64_t first = it * 32 + rank * 8 + m * 2;
        mine.fill(DataSplit::kTrain, first, 2, pieces.data() + first * row);
      }
  }
  EXPECT_EQ(pieces, whole);
  std::vector<int32_t> resumed(24 * row);
  BlendedGptDataset(options).fill(DataSplit::kTrain, 40, 24, resumed.data());
  EXPECT_TRUE(std::equal(resumed.begin(), resumed.end(), whole.begin() + 40 * row));
  // Validation reads only validation documents (a: 32..35, b: 32..35), from both datasets.
  std::vector<int32_t> valid(40 * row);
  blend.fill(DataSplit::kValid, 0, 40, valid.data());
  std::set<int> datasets;
  for (int32_t t : valid) {
    EXPECT_GE(t / 1000, 32);
    EXPECT_LT(t / 1000, 36);
    datasets.insert(t % 1000 >= 500);
  }
  EXPECT_EQ(datasets.size(), 2u);
  // Tokens past the vocabulary, in any split, are refused when the blend is built.
  BlendedGptDatasetOptions small = options;
  small.vocab_size = 35000;  // dataset a's document 35, a validation one, holds ids 35000 and up
  EXPECT_NE(error_of([&] { BlendedGptDataset x(small); }).find("token id 35000 in document 35"), std::string::npos);
  // Weights must be positive.
  BlendedGptDatasetOptions zero = options;
  zero.blend[1].weight = 0;
  EXPECT_NE(error_of([&] { BlendedGptDataset x(zero); }).find("--data-path weight 0"), std::string::npos);
}

// ---- A .bin (or .idx) that changes while a run reads it (issue 40, item 4)

// 20 documents of 400 tokens, ids (7d + i) % 256, uint16: byte 2 x (400d + i) of .bin is token i
// of document d; the .bin's 16000 bytes span 4 pages, so a truncated map faults (SIGBUS). The
// .bin's time is set an hour back, so a rewrite always gives it another mtime (the file system's
// clock is coarse: a rewrite in the same tick as the write would keep it).
class DataChangedUnderTheRun : public IndexedDatasetTest {
 protected:
  static constexpr int kDocs = 20, kTokens = 400, kSeq = 16, kVocab = 300;

  std::string write_dataset(const std::string& name) {
    std::vector<Document> docs;
    for (int d = 0; d < kDocs; ++d) {
      std::vector<int64_t> seq;
      for (int i = 0; i < kTokens; ++i) seq.push_back((7 * d + i) % 256);
      docs.push_back({seq});
    }
    const std::string prefix = write(name, encode(docs, 8));
    fs::last_write_time(prefix + ".bin", fs::last_write_time(prefix + ".bin") - std::chrono::hours(1));
    return prefix;
  }
  static BlendedGptDatasetOptions options(const std::string& prefix) {
    return {.blend = {{1.0, prefix}}, .split = parse_split("1,0,0"), .seq_length = kSeq, .seed = 5, .vocab_size = kVocab};
  }
  // Every training sample of the first epoch, so every token of the file is read: "(no error)" or
  // the error.
  static std::string read_epoch(const BlendedGptDataset& data) {
    const int samples = (kDocs * kTokens - 1) / kSeq;
    std::vector<int32_t> tokens(static_cast<size_t>(samples) * (kSeq + 1));
    return error_of([&] { data.fill(DataSplit::kTrain, 0, samples, tokens.data()); });
  }
  // Writes `bytes` over the .bin at `offset`, in place (the same inode, as `dd conv=notrunc`).
  static void overwrite(const std::string& path, int64_t offset, const std::string& bytes) {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(offset);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
};

TEST_F(DataChangedUnderTheRun, ABinTruncatedUnderTheRunEndsItNamingTheFileNotWithSigbus) {
  const std::string prefix = write_dataset("shrinks");
  const BlendedGptDataset data(options(prefix));
  ASSERT_EQ(read_epoch(data), "(no error)");
  fs::resize_file(prefix + ".bin", kDocs * kTokens);  // half of its 16000 bytes
  const std::string e = read_epoch(data);
  EXPECT_NE(e.find("'" + prefix + ".bin' changed under the run: it had 16000 bytes when it was opened and has 8000 "
                   "now"), std::string::npos) << e;
}

TEST_F(DataChangedUnderTheRun, IdsPastTheVocabularyWrittenUnderTheRunAreRefusedWhereRead) {
  const std::string prefix = write_dataset("ids");
  const BlendedGptDataset data(options(prefix));
  ASSERT_EQ(read_epoch(data), "(no error)");
  // Token 5 of document 3 becomes 4112 (0x1010), and the file's time is put back: the batch fill's
  // per-token check alone can see it.
  const auto mtime = fs::last_write_time(prefix + ".bin");
  overwrite(prefix + ".bin", 2 * (kTokens * 3 + 5), std::string("\x10\x10", 2));
  fs::last_write_time(prefix + ".bin", mtime);
  const std::string e = read_epoch(data);
  EXPECT_NE(e.find("token id 4112 (token 5 of document 3, sequence 3, byte 2410 of '" + prefix + ".bin') is not valid: "
                   "the vocabulary has 300 tokens (ids 0..299)"), std::string::npos) << e;
}

TEST_F(DataChangedUnderTheRun, ASameSizeRewriteEndsTheRunAtTheNextBatch) {
  const std::string prefix = write_dataset("rewritten");
  const BlendedGptDataset data(options(prefix));
  ASSERT_EQ(read_epoch(data), "(no error)");
  overwrite(prefix + ".bin", 0, std::string(2 * kTokens, '\x01'));  // document 0 all 257: ids still valid
  const std::string e = read_epoch(data);
  EXPECT_NE(e.find("'" + prefix + ".bin' changed under the run: it was modified after it was opened (same size, "
                   "16000 bytes)"), std::string::npos) << e;
}

TEST_F(DataChangedUnderTheRun, TheIndexIsReadWholeAtOpenSoItsChangesCannotReachTheRun) {
  const std::string prefix = write_dataset("index");
  const BlendedGptDataset data(options(prefix));
  const int row = kSeq + 1;
  std::vector<int32_t> before(8 * row), after(8 * row);
  data.fill(DataSplit::kTrain, 0, 8, before.data());
  fs::resize_file(prefix + ".idx", 0);  // was memory-mapped: the next read of it faulted (SIGBUS)
  EXPECT_EQ(error_of([&] { data.fill(DataSplit::kTrain, 0, 8, after.data()); }), "(no error)");
  EXPECT_EQ(after, before);
}

TEST(TextCheck, OnlyUtf8WithoutNulIsText) {
  EXPECT_EQ(first_non_text_byte("plain ASCII\n"), -1);
  EXPECT_EQ(first_non_text_byte("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x99\x82"), -1);  // 2-, 3- and 4-byte forms
  EXPECT_EQ(first_non_text_byte(std::string("ab\0c", 4)), 2);
  EXPECT_EQ(first_non_text_byte("ab\xff"), 2);
  EXPECT_EQ(first_non_text_byte("a\xc0\xaf"), 1);      // overlong
  EXPECT_EQ(first_non_text_byte("a\xed\xa0\x80"), 1);  // a surrogate
  EXPECT_EQ(first_non_text_byte("ab\xe2\x82"), 2);     // cut short by the end
  EXPECT_EQ(first_non_text_byte("a\xc3z"), 1);         // a continuation missing
}

TEST_F(IndexedDatasetTest, AnIndexOrBinaryFileIsNotReadAsText) {
  const std::string prefix = write("pair", encode({{{1, 2, 3}}}, 8));
  EXPECT_NE(error_of([&] { TokenDataset::from_file(prefix + ".idx", 0.1, 4); })
                .find("is a Megatron indexed dataset index, not text: give its prefix"),
            std::string::npos);
  EXPECT_NE(error_of([&] { TokenDataset::from_file(prefix + ".bin", 0.1, 4); }).find("is not text: byte 1 (0x00) is NUL"),
            std::string::npos);
}

}  // namespace
}  // namespace mxddp::testing
