// mxddp data: Megatron's preprocessed token data for the reference GPT (docs/data.md).
//
// Owns:
//   IndexedDataset: one PREFIX.bin + PREFIX.idx pair in megatron-core's MMIDIDX layout, the index
//   read whole and every field of it checked against the two files' sizes before it is used, the
//   tokens read from .bin as they are needed, and a .bin that changes under the run refused;
//   parse_split / split_document_ranges: Megatron's --split "969,30,1" (train/valid/test by
//   documents, with Megatron's rounding);
//   GptSampleIndex: the GPT samples of one split of one dataset: documents concatenated in a
//   seeded shuffled order per epoch, cut into windows of seq_length + 1 tokens, as many epochs as
//   asked for;
//   BlendedGptDataset: one or more weighted datasets (--data-path W1 P1 W2 P2 ...) blended sample
//   by sample with Megatron's greedy rule, and the token-id check against the vocabulary (at open,
//   and again on every token a batch reads).
//
// A sample is named by its number in the split's stream only (the same number gives the same
// tokens on every rank, at any data-parallel size and after a resume), so the trainer's consumed
// sample count is all the state a run needs.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace mxddp {

class InputFile;

// ----------------------------------------------------------------------------------------------
// One .bin/.idx pair
// ----------------------------------------------------------------------------------------------

// The .idx header's dtype codes (megatron-core's DType): the width of a token in .bin.
//   1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16.
// Float codes exist in the format but cannot hold token ids; they are refused.
struct TokenDType {
  int code = 0;
  int bytes = 0;
  bool is_signed = false;
  const char* name = "";
};
// Throws Error naming the code and the valid ones (floats refused: token ids are integers).
TokenDType token_dtype_of_code(int code, const std::string& where);

class IndexedDataset {
 public:
  // Reads PREFIX.idx whole, opens PREFIX.bin (kept open, read as needed) and checks the index:
  // magic, version, dtype code, counts that fit the .idx size (overflow-checked), document indices
  // from 0, non-decreasing, ending at the sequence count, sequence lengths >= 0, pointers aligned,
  // in order, not overlapping and inside .bin. Throws Error naming the file and the field.
  explicit IndexedDataset(const std::string& prefix);
  ~IndexedDataset();
  IndexedDataset(const IndexedDataset&) = delete;
  IndexedDataset& operator=(const IndexedDataset&) = delete;

  const std::string& prefix() const { return prefix_; }
  std::string bin_path() const { return prefix_ + ".bin"; }
  std::string idx_path() const { return prefix_ + ".idx"; }
  const TokenDType& dtype() const { return dtype_; }
  int64_t num_sequences() const { return num_sequences_; }
  int64_t num_documents() const { return num_documents_; }
  int64_t bin_bytes() const { return bin_bytes_; }  // at open
  std::span<const char> idx_bytes() const { return {idx_.data(), idx_.size()}; }

  // Sequences [first, last) of document d (the .idx "document indices").
  int64_t document_first_sequence(int64_t d) const;
  int64_t document_end_sequence(int64_t d) const;
  int64_t sequence_length(int64_t s) const;   // tokens
  int64_t sequence_pointer(int64_t s) const;  // byte offset in .bin
  int64_t document_tokens(int64_t d) const;   // the sum of its sequences' lengths

  // tokens [count] <- tokens [offset, offset + count) of sequence s, widened to int64. Throws Error
  // naming .bin when it has become too short for them (it shrank under the run).
  void read_sequence(int64_t s, int64_t offset, int64_t count, int64_t* tokens) const;
  // "" while .bin's size and modification time are what they were at open, else how they differ.
  std::string change_since_open() const;
  // Throws Error naming .bin when change_since_open() is not "": the file changed under the run
  // (the tokens read since may be another dataset's).
  void check_unchanged() const;

  // Every token of documents [first, last): throws Error naming the first id < 0 or >= vocab_size,
  // its document and the file; adds each token's count to counts (sized vocab_size) when given.
  void check_token_ids(int64_t first, int64_t last, int64_t vocab_size, std::vector<int64_t>* counts) const;

 private:
  std::string prefix_;
  TokenDType dtype_;
  std::vector<char> idx_;           // the whole .idx, as read at open
  std::unique_ptr<InputFile> bin_;  // .bin, open for the dataset's life
  int64_t bin_bytes_ = 0;
  int64_t num_sequences_ = 0;
  int64_t num_documents_ = 0;  // the index's document count - 1
  int64_t lengths_at_ = 0, pointers_at_ = 0, documents_at_ = 0;  // byte offsets of the arrays in .idx
};

// ----------------------------------------------------------------------------------------------
// --split
// ----------------------------------------------------------------------------------------------

enum class DataSplit : int { kTrain = 0, kValid = 1, kTest = 2 };
const char* data_split_name(DataSplit split);  // "train", "valid", "test"

// "969,30,1" (or "969/30/1"; fewer than 3 parts mean 0 for the rest) -> weights normalized to sum
// 1. Throws Error naming the text otherwise.
std::array<double, 3> parse_split(const std::string& text);

// megatron-core's boundaries of the three splits over num_documents: [0, b1, b2, num_documents]
// with b_k = round((w_0 + ... + w_{k-1}) x num_documents), round half to even as Python's round.
std::array<int64_t, 4> split_document_ranges(const std::array<double, 3>& weights, int64_t num_documents);

// ----------------------------------------------------------------------------------------------
// The GPT sample index of one split of one dataset
// ----------------------------------------------------------------------------------------------

class GptSampleIndex {
 public:
  // Documents [doc_first, doc_last) of data; token ids must be below vocab_size; seed names the
  // shuffles (the trainer derives it from --seed, the dataset's place in the blend and the split).
  // Throws Error naming the dataset and split when its tokens cannot make one sample of
  // seq_length + 1.
  GptSampleIndex(const IndexedDataset& data, int64_t doc_first, int64_t doc_last, int seq_length, int64_t vocab_size,
                 uint64_t seed, const std::string& what);

  int64_t samples_per_epoch() const { return samples_per_epoch_; }
  int64_t tokens() const { return tokens_; }
  // tokens [seq_length + 1] <- sample `sample` (any number >= 0; sample / samples_per_epoch is its
  // epoch). Epoch e orders the documents by a shuffle seeded with (seed, e), concatenates them and
  // cuts samples_per_epoch windows, window w starting at token w x seq_length (consecutive windows
  // share one token, as Megatron's); the samples of the epoch are those windows in a second seeded
  // shuffle. Every token id is checked as it is copied: one outside [0, vocab_size) throws Error
  // naming it, its document and byte and the file. Not thread-safe: the index keeps the last
  // epochs it built.
  void fill(int64_t sample, int32_t* tokens) const;

 private:
  struct Epoch {
    int64_t number = -1;
    std::vector<int64_t> documents;     // [docs] in this epoch's order
    std::vector<int64_t> token_starts;  // [docs + 1]: where each starts in the concatenation
    std::vector<int64_t> windows;       // [samples_per_epoch]: the window of each sample
  };
  const Epoch& epoch(int64_t number) const;
  // Throws the Error for token `id`, token `position` of `document` (`in_sequence` of `sequence`).
  [[noreturn]] void refuse_token(int64_t id, int64_t document, int64_t position, int64_t sequence,
                                 int64_t in_sequence) const;

  const IndexedDataset& data_;
  int64_t doc_first_, doc_last_;
  int seq_length_;
  int64_t vocab_size_;
  uint64_t seed_;
  int64_t tokens_ = 0;
  int64_t samples_per_epoch_ = 0;
  mutable std::array<Epoch, 2> cache_;  // the two most recent epochs (a batch can straddle two)
  mutable int next_slot_ = 0;
};

// ----------------------------------------------------------------------------------------------
// The blend
// ----------------------------------------------------------------------------------------------

struct DataBlendEntry {
  double weight = 1.0;
  std::string prefix;  // PREFIX of PREFIX.bin + PREFIX.idx
};

struct BlendedGptDatasetOptions {
  std::vector<DataBlendEntry> blend;      // at least one; weights > 0 (normalized here)
  std::array<double, 3> split{0.969, 0.030, 0.001};
  int seq_length = 0;
  uint64_t seed = 0;
  int64_t vocab_size = 0;  // token ids must be below it (the tokenizer's size, not the padded one)
};

class BlendedGptDataset {
 public:
  // Opens every dataset, splits it, checks every token id of every split, counts the training
  // split's tokens (for the unigram entropy) and builds the sample index of each non-empty split.
  // Throws Error naming the file, field, split or token.
  explicit BlendedGptDataset(BlendedGptDatasetOptions options);
  ~BlendedGptDataset();

  int num_datasets() const { return static_cast<int>(datasets_.size()); }
  const IndexedDataset& dataset(int k) const { return *datasets_[static_cast<size_t>(k)]; }
  double weight(int k) const { return weights_[static_cast<size_t>(k)]; }  // normalized
  // Documents [first, last) of split s in dataset k.
  std::pair<int64_t, int64_t> documents(int k, DataSplit s) const;
  // Whether every dataset of positive weight has samples in the split.
  bool has_split(DataSplit s) const;

  // Which dataset blended sample `sample` of the split reads, and its sample number there:
  // Megatron's greedy blend (sample i goes to the dataset whose weight x max(i, 1) most exceeds
  // the samples it has had so far; ties to the first). Stateful but deterministic: reading forward
  // is O(datasets) a sample, going back restarts from 0.
  std::pair<int, int64_t> locate(DataSplit s, int64_t sample) const;

  // tokens [count, seq_length + 1] <- blended samples [first, first + count) of the split (a
  // batch). Then every dataset's .bin is checked to be unchanged since open, so a file rewritten
  // under the run ends it at the next batch with an Error naming the file.
  void fill(DataSplit s, int64_t first, int count, int32_t* tokens) const;

  // Entropy of the training split's token frequencies over every dataset, weighted by the blend,
  // in nats.
  double unigram_entropy() const { return unigram_entropy_; }
  std::string describe() const;  // "2 datasets, 1200 documents, 310000 tokens (uint16)"

 private:
  struct Cursor {
    int64_t next = 0;
    std::vector<int64_t> taken;  // [datasets]: samples each has had before `next`
  };
  void fill_samples(DataSplit s, int64_t first, int count, int32_t* tokens) const;  // fill's reads

  BlendedGptDatasetOptions options_;
  std::vector<std::unique_ptr<IndexedDataset>> datasets_;
  std::vector<double> weights_;
  std::vector<std::array<int64_t, 4>> ranges_;  // [datasets]: split_document_ranges
  std::vector<std::array<std::unique_ptr<GptSampleIndex>, 3>> indexes_;  // [datasets][split]
  mutable std::array<Cursor, 3> cursors_;
  double unigram_entropy_ = 0;
};

}  // namespace mxddp
