// IndexedDataset (data.h): megatron-core's MMIDIDX .bin/.idx pair, checked field by field before
// use, and Megatron's --split over its documents.
//
// Neither file is memory-mapped, because a run reads them for hours and someone may rewrite them
// in place meanwhile (preprocessing again into the same PREFIX): a mapped file that shrinks makes
// the next read of a page past its end a SIGBUS, and one rewritten at the same size feeds the run
// another dataset's tokens without a word. Instead:
//   - the .idx is read whole at open (20 bytes a sequence: typically a few percent of the .bin,
//     and every byte of it is checked and checksummed at open anyway), so what was checked is
//     what is used;
//   - the .bin stays open and each piece of a sequence is read with pread into the caller's
//     buffer: the copy a map would make anyway, and a file that has become shorter gives a short
//     read, which is an error naming it, never a fault. (Catching SIGBUS around reads of a map
//     would need a per-thread sigsetjmp region, with ranks as threads; pread needs nothing.)
//   - after each batch (BlendedGptDataset::fill, a micro-batch), fstat: a .bin whose size or
//     modification time is not what it was at open changed under the run, which ends with an
//     error naming it. Checked after the reads, it sees any write that began before it (Linux's
//     local file systems set the time before a write changes the data); a same-size rewrite in
//     the clock tick of the file's previous write is the one change it can miss, and even then
//     every token id is checked where it is copied. A .bin replaced by a rename is no change for
//     the run: its descriptor still reads the old, intact file.
//   One fstat per batch and a compare per token cost nothing next to a training step.
//
// The .idx layout (little-endian), as megatron-core's _IndexWriter writes it:
//   magic        9 bytes  "MMIDIDX\0\0"
//   version      u64      1
//   dtype code   u8       the token width of .bin (data.h)
//   S            u64      sequence count
//   D            u64      document count (entries of the document indices: documents + 1)
//   lengths      i32[S]   tokens per sequence
//   pointers     i64[S]   byte offset of each sequence in .bin
//   documents    i64[D]   sequence index where each document starts; the last is S
//   (modes       i8[S]    only in multimodal indexes: accepted and not read)
#include <mxddp/data.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include <mxddp/core.h>
#include <mxddp/input_file.h>

namespace mxddp {

namespace {

constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr int64_t kHeaderBytes = 9 + 8 + 1 + 8 + 8;

template <typename T>
T load(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));  // the arrays need not be aligned in a hostile file
  return v;
}

}  // namespace

TokenDType token_dtype_of_code(int code, const std::string& where) {
  switch (code) {
    case 1: return {1, 1, false, "uint8"};
    case 2: return {2, 1, true, "int8"};
    case 3: return {3, 2, true, "int16"};
    case 4: return {4, 4, true, "int32"};
    case 5: return {5, 8, true, "int64"};
    case 8: return {8, 2, false, "uint16"};
    case 6:
    case 7:
      MXDDP_FAIL("{}: dtype code {} ({}) holds floats, not token ids; valid: 1 uint8, 2 int8, 3 int16, 4 int32, "
                 "5 int64, 8 uint16", where, code, code == 6 ? "float64" : "float32");
    default:
      MXDDP_FAIL("{}: dtype code {} does not exist in the MMIDIDX format; valid: 1 uint8, 2 int8, 3 int16, 4 int32, "
                 "5 int64, 8 uint16", where, code);
  }
}

IndexedDataset::IndexedDataset(const std::string& prefix) : prefix_(prefix) {
  const std::string idx_name = idx_path(), bin_name = bin_path();
  InputFile idx_file(idx_name, "--data-path index");
  bin_ = std::make_unique<InputFile>(bin_name, "--data-path data");
  const int64_t idx_bytes = idx_file.size_bytes();
  bin_bytes_ = bin_->size_bytes();
  const std::string at = fmt::format("'{}'", idx_name);
  MXDDP_CHECK(idx_bytes >= kHeaderBytes, "{} is truncated: {} bytes, but the MMIDIDX header alone is {}", at,
              idx_bytes, kHeaderBytes);
  idx_ = idx_file.read_all();
  const char* idx = idx_.data();
  MXDDP_CHECK(std::memcmp(idx, kMagic, sizeof kMagic) == 0,
              "{} is not a Megatron indexed dataset index: its magic (first 9 bytes) is not \"MMIDIDX\\0\\0\"", at);
  const auto version = load<uint64_t>(idx + 9);
  MXDDP_CHECK(version == 1, "{}: version {} is not supported; valid: 1", at, version);
  dtype_ = token_dtype_of_code(static_cast<unsigned char>(idx[17]), at);
  const auto sequences = load<uint64_t>(idx + 18);
  const auto documents = load<uint64_t>(idx + 26);
  // Each count is bounded by the file before any product is formed: no product overflows then.
  MXDDP_CHECK(sequences <= static_cast<uint64_t>(idx_bytes) / 12,
              "{}: sequence count {} does not fit the file's {} bytes (12 bytes per sequence)", at, sequences,
              idx_bytes);
  MXDDP_CHECK(documents >= 1 && documents <= static_cast<uint64_t>(idx_bytes) / 8,
              "{}: document count {} is not valid: at least 1 (the first document index, 0) and it must fit the "
              "file's {} bytes", at, documents, idx_bytes);
  num_sequences_ = static_cast<int64_t>(sequences);
  num_documents_ = static_cast<int64_t>(documents) - 1;
  lengths_at_ = kHeaderBytes;
  pointers_at_ = lengths_at_ + 4 * num_sequences_;
  documents_at_ = pointers_at_ + 8 * num_sequences_;
  const int64_t end = documents_at_ + 8 * (num_documents_ + 1);
  MXDDP_CHECK(end == idx_bytes || end + num_sequences_ == idx_bytes,
              "{} has {} bytes but its counts (sequence count {}, document count {}) say {} (or {} with sequence "
              "modes): the file is truncated or the counts are wrong", at, idx_bytes, num_sequences_,
              num_documents_ + 1, end, end + num_sequences_);

  // Document indices: from 0, non-decreasing, ending at the sequence count.
  MXDDP_CHECK(load<int64_t>(idx + documents_at_) == 0, "{}: document index 0 is {}; valid: 0", at,
              load<int64_t>(idx + documents_at_));
  for (int64_t d = 1; d <= num_documents_; ++d) {
    const auto prev = load<int64_t>(idx + documents_at_ + 8 * (d - 1));
    const auto cur = load<int64_t>(idx + documents_at_ + 8 * d);
    MXDDP_CHECK(cur >= prev && cur <= num_sequences_,
                "{}: document index {} is {} (the previous is {}); valid: non-decreasing, at most the sequence "
                "count {}", at, d, cur, prev, num_sequences_);
  }
  MXDDP_CHECK(load<int64_t>(idx + documents_at_ + 8 * num_documents_) == num_sequences_,
              "{}: the last document index is {} but the sequence count is {}; they must be equal", at,
              load<int64_t>(idx + documents_at_ + 8 * num_documents_), num_sequences_);

  // Sequences: lengths >= 0, pointers aligned, in order, not overlapping, inside .bin.
  const int64_t width = dtype_.bytes;
  int64_t previous_end = 0;
  for (int64_t s = 0; s < num_sequences_; ++s) {
    const auto length = load<int32_t>(idx + lengths_at_ + 4 * s);
    const auto pointer = load<int64_t>(idx + pointers_at_ + 8 * s);
    MXDDP_CHECK(length >= 0, "{}: sequence length {} is {}; valid: 0 or more", at, s, length);
    MXDDP_CHECK(pointer >= previous_end && pointer % width == 0,
                "{}: sequence pointer {} is {}; valid: a multiple of the token width {} ({}) at or after the "
                "previous sequence's end {} (pointers in order, not overlapping)", at, s, pointer, width,
                dtype_.name, previous_end);
    // length < 2^31 and width <= 8, so the product fits; the sum is checked against the file.
    const int64_t seq_end = pointer <= bin_bytes_ ? pointer + length * width : -1;
    MXDDP_CHECK(seq_end >= 0 && seq_end <= bin_bytes_,
                "{}: sequence {} ({} tokens of {} at byte {}) ends past '{}', which has {} bytes", at, s, length,
                dtype_.name, pointer, bin_name, bin_bytes_);
    previous_end = seq_end;
  }
}

IndexedDataset::~IndexedDataset() = default;

int64_t IndexedDataset::document_first_sequence(int64_t d) const {
  MXDDP_ASSERT(d >= 0 && d <= num_documents_);
  return load<int64_t>(idx_.data() + documents_at_ + 8 * d);
}
int64_t IndexedDataset::document_end_sequence(int64_t d) const { return document_first_sequence(d + 1); }
int64_t IndexedDataset::sequence_length(int64_t s) const {
  MXDDP_ASSERT(s >= 0 && s < num_sequences_);
  return load<int32_t>(idx_.data() + lengths_at_ + 4 * s);
}
int64_t IndexedDataset::sequence_pointer(int64_t s) const {
  MXDDP_ASSERT(s >= 0 && s < num_sequences_);
  return load<int64_t>(idx_.data() + pointers_at_ + 8 * s);
}

int64_t IndexedDataset::document_tokens(int64_t d) const {
  int64_t n = 0;
  for (int64_t s = document_first_sequence(d); s < document_end_sequence(d); ++s) n += sequence_length(s);
  return n;
}

void IndexedDataset::read_sequence(int64_t s, int64_t offset, int64_t count, int64_t* tokens) const {
  MXDDP_ASSERT(offset >= 0 && count >= 0 && offset + count <= sequence_length(s));
  // The file's bytes go into the front of `tokens` (count x width <= count x 8 bytes) and are
  // widened in place from the last token back: token i's bytes lie at or before its int64 slot,
  // and the slots written so far lie after every token not yet widened.
  const auto bytes = static_cast<size_t>(count * dtype_.bytes);
  const int64_t at = sequence_pointer(s) + offset * dtype_.bytes;
  const size_t got = bin_->read_at(at, tokens, bytes);
  if (got < bytes) {
    check_unchanged();  // says how it changed
    MXDDP_FAIL("'{}' ended at byte {} while sequence {} needs bytes [{}, {}); it had {} bytes when opened", bin_path(),
               at + static_cast<int64_t>(got), s, at, at + static_cast<int64_t>(bytes), bin_bytes_);
  }
  const char* raw = reinterpret_cast<const char*>(tokens);
  for (int64_t i = count - 1; i >= 0; --i) {
    const char* p = raw + i * dtype_.bytes;
    int64_t v = 0;
    switch (dtype_.code) {
      case 1: v = load<uint8_t>(p); break;
      case 2: v = load<int8_t>(p); break;
      case 3: v = load<int16_t>(p); break;
      case 4: v = load<int32_t>(p); break;
      case 5: v = load<int64_t>(p); break;
      case 8: v = load<uint16_t>(p); break;
      default: MXDDP_ASSERT(false);
    }
    tokens[i] = v;
  }
}

std::string IndexedDataset::change_since_open() const { return bin_->change_since_open(); }

void IndexedDataset::check_unchanged() const {
  const std::string change = change_since_open();
  MXDDP_CHECK(change.empty(), "'{}' changed under the run: {}; a dataset must not be rewritten while a run reads it "
              "(write the new one under another PREFIX, and resume from the last checkpoint)", bin_path(), change);
}

void IndexedDataset::check_token_ids(int64_t first, int64_t last, int64_t vocab_size,
                                     std::vector<int64_t>* counts) const {
  constexpr int64_t kChunkTokens = int64_t{1} << 16;  // a sequence can be as long as .bin: read it in pieces
  std::vector<int64_t> chunk(static_cast<size_t>(kChunkTokens));
  for (int64_t d = first; d < last; ++d) {
    int64_t position = 0;  // in the document
    for (int64_t s = document_first_sequence(d); s < document_end_sequence(d); ++s) {
      const int64_t n = sequence_length(s);
      for (int64_t at = 0; at < n; at += kChunkTokens) {
        const int64_t piece = std::min(kChunkTokens, n - at);
        read_sequence(s, at, piece, chunk.data());
        for (int64_t i = 0; i < piece; ++i) {
          const int64_t id = chunk[static_cast<size_t>(i)];
          MXDDP_CHECK(id >= 0 && id < vocab_size,
                      "token id {} in document {} (token {} of it, sequence {}) of '{}' is not valid: the vocabulary "
                      "has {} tokens (ids 0..{}); give the tokenizer's size (--vocab-size, or --tokenizer-type with "
                      "--vocab-file)", id, d, position + at + i, s, bin_path(), vocab_size, vocab_size - 1);
          if (counts != nullptr) ++(*counts)[static_cast<size_t>(id)];
        }
      }
      position += n;
    }
  }
}

// ---- --split

const char* data_split_name(DataSplit split) {
  switch (split) {
    case DataSplit::kTrain: return "train";
    case DataSplit::kValid: return "valid";
    case DataSplit::kTest: return "test";
  }
  return "?";
}

std::array<double, 3> parse_split(const std::string& text) {
  std::array<double, 3> w{0, 0, 0};
  size_t part = 0, at = 0;
  const auto bad = [&text](const std::string& why) {
    MXDDP_FAIL("--split '{}' is not valid: {}; give up to 3 non-negative numbers separated by ',' or '/' "
               "(train, valid, test), e.g. 969,30,1", text, why);
  };
  while (at <= text.size()) {
    size_t end = text.find_first_of(",/", at);
    if (end == std::string::npos) end = text.size();
    std::string piece = text.substr(at, end - at);
    piece.erase(0, piece.find_first_not_of(' '));
    piece.erase(piece.find_last_not_of(' ') + 1);
    if (part >= 3) bad("more than 3 parts");
    size_t used = 0;
    double v = -1;
    try {
      v = std::stod(piece, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (piece.empty() || used != piece.size() || !std::isfinite(v) || v < 0) bad(fmt::format("part '{}'", piece));
    w[part++] = v;
    at = end + 1;
  }
  const double sum = w[0] + w[1] + w[2];
  if (!(sum > 0)) bad("the parts sum to 0");
  for (double& x : w) x /= sum;
  return w;
}

std::array<int64_t, 4> split_document_ranges(const std::array<double, 3>& weights, int64_t num_documents) {
  // megatron-core's split matrix: each split is the book-ends [cumulative start, cumulative end)
  // of the normalized weights, and its elements are [round(start x n), round(end x n)).
  std::array<int64_t, 4> b{0, 0, 0, num_documents};
  double cumulative = 0;
  for (size_t k = 1; k < 3; ++k) {
    cumulative += weights[k - 1];
    b[k] = std::clamp<int64_t>(static_cast<int64_t>(std::nearbyint(cumulative * static_cast<double>(num_documents))), 0,
                               num_documents);
  }
  b[2] = std::max(b[2], b[1]);
  return b;
}

}  // namespace mxddp
