// `mxddp train`'s data and vocabulary flags, Megatron's spellings (docs/data.md):
//   --data-path PREFIX | W1 P1 W2 P2 ... (indexed datasets; a text file still reads as bytes),
//   --split, --vocab-size, --make-vocab-size-divisible-by, --tokenizer-type, --vocab-file,
//   --merge-file, --tokenizer-model.
// Each takes effect or is refused naming the flag: none is accepted and ignored.
#pragma once

#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include <mxddp/train.h>

namespace mxddp::app {

struct DataFlags {
  std::vector<std::string> data_path;  // --data-path as given
  std::string split;                   // --split ("": Megatron's 969,30,1)
  int64_t vocab_size = 0;              // --vocab-size (0: not given)
  int64_t make_vocab_size_divisible_by = 128;
  std::string tokenizer_type, vocab_file, merge_file, tokenizer_model;
  const CLI::Option* valid_fraction_option = nullptr;  // whether --valid-fraction was given
};

// Registers the flags on cmd (its own option group).
void add_data_flags(CLI::App* cmd, DataFlags& flags);

// The tokenizer a GPT2BPETokenizer's files describe.
struct Gpt2Vocabulary {
  int64_t size = 0;     // entries of vocab.json
  int64_t eod_id = -1;  // "<|endoftext|>"
  int64_t merges = 0;   // merge rules in merges.txt
};
// Reads vocab.json (an object of token -> id, the ids 0..n-1 each once) and merges.txt (an
// optional "#version" line, then "a b" per line). Throws Error naming the file, the entry or line.
Gpt2Vocabulary read_gpt2_vocabulary(const std::string& vocab_file, const std::string& merge_file);

// After parsing, with config.model set from --model and its overrides: resolves --data /
// --data-path into config.data_path (text) or config.data_blend (indexed), --split into
// config.split, and the vocabulary into config.tokenizer_vocab_size and config.model.vocab_size
// (padded). Returns notes for the banner. Throws Error naming a flag that cannot take effect.
std::vector<std::string> apply_data_flags(const DataFlags& flags, TrainConfig& config);

}  // namespace mxddp::app
