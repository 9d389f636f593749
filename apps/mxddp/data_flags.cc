// data_flags.h: the data and vocabulary flags of `mxddp train`, resolved into a TrainConfig.
#include "data_flags.h"

#include <climits>
#include <cmath>
#include <filesystem>
#include <sstream>

#include <nlohmann/json.hpp>

#include <mxddp/core.h>
#include <mxddp/input_file.h>

#include "cli_checks.h"

namespace mxddp::app {

namespace {

namespace fs = std::filesystem;

bool is_file(const std::string& path) {
  std::error_code ec;
  return fs::exists(path, ec);
}

// An indexed dataset's prefix from what the user typed (PREFIX, PREFIX.bin or PREFIX.idx), or ""
// when the name is not one; throws when it names half of a pair.
std::string indexed_prefix(const std::string& name, const std::string& flag) {
  std::string prefix = name;
  const bool with_extension = name.ends_with(".bin") || name.ends_with(".idx");
  if (with_extension) prefix = name.substr(0, name.size() - 4);
  const bool bin = is_file(prefix + ".bin"), idx = is_file(prefix + ".idx");
  if (bin && idx) return prefix;
  if (with_extension || ((bin || idx) && !is_file(name)))
    MXDDP_FAIL("{} '{}' names half of a Megatron indexed dataset: '{}' is missing (a dataset is PREFIX.bin + "
               "PREFIX.idx, given as its PREFIX)", flag, name, prefix + (bin ? ".idx" : ".bin"));
  return "";
}

double parse_weight(const std::string& text) {
  size_t used = 0;
  double w = -1;
  try {
    w = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  MXDDP_CHECK(used > 0 && used == text.size() && std::isfinite(w) && w > 0,
              "--data-path weight '{}' is not valid: a blend is given as weight-prefix pairs W1 PREFIX1 W2 PREFIX2 "
              "..., each weight a positive number", text);
  return w;
}

// Megatron's padding: the smallest multiple of divisible_by at or above vocab.
int64_t padded_vocab_size(int64_t vocab, int64_t divisible_by) {
  const int64_t padded = checked_mul((vocab + divisible_by - 1) / divisible_by, divisible_by, "the padded vocabulary");
  MXDDP_CHECK(padded <= INT_MAX, "the padded vocabulary {} (--vocab-size {} to a multiple of "
              "--make-vocab-size-divisible-by {}) is not valid: at most {}", padded, vocab, divisible_by, INT_MAX);
  return padded;
}

}  // namespace

void add_data_flags(CLI::App* cmd, DataFlags& f) {
  auto* group = cmd->add_option_group("data and vocabulary (Megatron's flags; docs/data.md)");
  group
      ->add_option("--data-path", f.data_path,
                   "A Megatron indexed dataset PREFIX (PREFIX.bin + PREFIX.idx), a blend W1 PREFIX1 W2 PREFIX2 ..., "
                   "or a text file (read as bytes, = --data)")
      ->expected(1, -1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)
      ->trigger_on_parse()
      ->transform(non_empty_path());
  group->add_option("--split", f.split,
                    "Train/valid/test weights over each indexed dataset's documents (Megatron's default 969,30,1)");
  group->add_option("--vocab-size", f.vocab_size, "The tokenizer's vocabulary (token ids below it; default 256: bytes)")
      ->transform(integer_in(1, INT_MAX));
  group->add_option("--make-vocab-size-divisible-by", f.make_vocab_size_divisible_by,
                    "Pad the model's vocabulary (embedding rows) up to a multiple of this, as Megatron")
      ->transform(integer_in(1, INT_MAX));
  group->add_option("--tokenizer-type", f.tokenizer_type,
                    "GPT2BPETokenizer (with --vocab-file, --merge-file: the vocabulary and end-of-document id from "
                    "vocab.json) or NullTokenizer (with --vocab-size); others are refused");
  group->add_option("--vocab-file", f.vocab_file, "GPT2BPETokenizer's vocab.json")->transform(non_empty_path());
  group->add_option("--merge-file", f.merge_file, "GPT2BPETokenizer's merges.txt")->transform(non_empty_path());
  group->add_option("--tokenizer-model", f.tokenizer_model,
                    "Refused: mxddp reads no SentencePiece or Hugging Face tokenizer model (give --vocab-size)");
}

Gpt2Vocabulary read_gpt2_vocabulary(const std::string& vocab_file, const std::string& merge_file) {
  Gpt2Vocabulary v;
  const std::vector<char> vocab_bytes = InputFile(vocab_file, "--vocab-file").read_all();
  nlohmann::json vocab;
  try {
    vocab = nlohmann::json::parse(vocab_bytes.begin(), vocab_bytes.end());
  } catch (const nlohmann::json::exception& e) {
    MXDDP_FAIL("--vocab-file '{}' is not JSON: {}", vocab_file, e.what());
  }
  MXDDP_CHECK(vocab.is_object() && !vocab.empty(),
              "--vocab-file '{}' is not a GPT-2 vocab.json: expected a non-empty JSON object of token -> id", vocab_file);
  v.size = static_cast<int64_t>(vocab.size());
  std::vector<bool> seen(static_cast<size_t>(v.size), false);
  for (const auto& [token, id] : vocab.items()) {
    MXDDP_CHECK(id.is_number_integer() && id.get<int64_t>() >= 0 && id.get<int64_t>() < v.size &&
                    !seen[static_cast<size_t>(id.get<int64_t>())],
                "--vocab-file '{}': token {} has id {}; valid: the ids 0..{} each once (the file has {} entries)",
                vocab_file, nlohmann::json(token).dump(), id.dump(), v.size - 1, v.size);
    seen[static_cast<size_t>(id.get<int64_t>())] = true;
  }
  const auto eod = vocab.find("<|endoftext|>");
  MXDDP_CHECK(eod != vocab.end(), "--vocab-file '{}' has no \"<|endoftext|>\": GPT2BPETokenizer's end-of-document token",
              vocab_file);
  v.eod_id = eod->get<int64_t>();
  const std::vector<char> merge_bytes = InputFile(merge_file, "--merge-file").read_all();
  std::istringstream lines(std::string(merge_bytes.begin(), merge_bytes.end()));
  std::string line;
  for (int64_t number = 1; std::getline(lines, line); ++number) {
    if (number == 1 && line.starts_with("#version")) continue;
    if (line.empty()) continue;
    const size_t space = line.find(' ');
    MXDDP_CHECK(space != std::string::npos && space > 0 && space + 1 < line.size() &&
                    line.find(' ', space + 1) == std::string::npos,
                "--merge-file '{}' line {} is not a merge rule: expected two pieces separated by one space", merge_file,
                number);
    ++v.merges;
  }
  return v;
}

std::vector<std::string> apply_data_flags(const DataFlags& f, TrainConfig& c) {
  std::vector<std::string> notes;
  // ---- The data: text, or indexed datasets (one, or a weighted blend).
  const auto& dp = f.data_path;
  if (dp.size() > 1) {
    MXDDP_CHECK(c.data_path.empty(), "--data '{}' and a --data-path blend are both given; give one", c.data_path);
    MXDDP_CHECK(dp.size() % 2 == 0,
                "--data-path has {} values: a blend is weight-prefix pairs W1 PREFIX1 W2 PREFIX2 ... (one value: a "
                "single dataset or text file)", dp.size());
    for (size_t i = 0; i < dp.size(); i += 2) {
      const double weight = parse_weight(dp[i]);
      const std::string prefix = indexed_prefix(dp[i + 1], "--data-path");
      MXDDP_CHECK(!prefix.empty(),
                  "--data-path '{}' is not a Megatron indexed dataset ({}.bin and {}.idx do not exist): a blend is of "
                  "indexed datasets", dp[i + 1], dp[i + 1], dp[i + 1]);
      c.data_blend.push_back({weight, prefix});
    }
  } else {
    std::string name = c.data_path;
    const char* flag = "--data";
    if (dp.size() == 1) {
      MXDDP_CHECK(name.empty() || name == dp[0], "--data '{}' and --data-path '{}' name two files; give one", name, dp[0]);
      name = dp[0];
      flag = "--data-path";
    }
    if (!name.empty()) {
      const std::string prefix = indexed_prefix(name, flag);
      if (!prefix.empty()) {
        c.data_path.clear();
        c.data_blend.push_back({1.0, prefix});
        if (prefix != name)
          notes.push_back(fmt::format("{} {}: the indexed dataset {}.bin + {}.idx (Megatron names it by its prefix)",
                                      flag, name, prefix, prefix));
      } else {
        c.data_path = name;  // text: TokenDataset::from_file refuses what is not text
      }
    }
  }
  if (!f.split.empty()) {
    MXDDP_CHECK(!c.data_blend.empty(),
                "--split {} applies to Megatron indexed datasets (--data-path PREFIX); text and the built-in corpus "
                "keep the last --valid-fraction for validation", f.split);
    c.split = parse_split(f.split);
  }
  MXDDP_CHECK(c.data_blend.empty() || f.valid_fraction_option == nullptr || f.valid_fraction_option->count() == 0,
              "--valid-fraction applies to text; indexed datasets are split by --split (default 969,30,1)");

  // ---- The vocabulary: the tokenizer's, padded for the model.
  MXDDP_CHECK(f.tokenizer_model.empty(),
              "--tokenizer-model '{}' is not supported: mxddp reads no SentencePiece or Hugging Face tokenizer model. "
              "Give the data as token ids (--data-path PREFIX) and the vocabulary's size (--vocab-size N)",
              f.tokenizer_model);
  int64_t tokenizer_vocab = f.vocab_size;
  if (f.tokenizer_type.empty()) {
    MXDDP_CHECK(f.vocab_file.empty() && f.merge_file.empty(), "--{} needs --tokenizer-type GPT2BPETokenizer",
                f.vocab_file.empty() ? "merge-file" : "vocab-file");
  } else if (f.tokenizer_type == "GPT2BPETokenizer") {
    MXDDP_CHECK(!f.vocab_file.empty() && !f.merge_file.empty(),
                "--tokenizer-type GPT2BPETokenizer needs --{} (its vocab.json and merges.txt)",
                f.vocab_file.empty() ? "vocab-file" : "merge-file");
    const Gpt2Vocabulary v = read_gpt2_vocabulary(f.vocab_file, f.merge_file);
    MXDDP_CHECK(f.vocab_size == 0 || f.vocab_size == v.size,
                "--vocab-size {} contradicts --vocab-file '{}', which has {} entries; give one", f.vocab_size,
                f.vocab_file, v.size);
    tokenizer_vocab = v.size;
    c.eod_id = v.eod_id;
    notes.push_back(fmt::format("--tokenizer-type GPT2BPETokenizer: vocabulary {} (--vocab-file), end of document id {} "
                                "(<|endoftext|>), {} merges read; the data must already be token ids (mxddp tokenizes "
                                "no text)", v.size, v.eod_id, v.merges));
  } else if (f.tokenizer_type == "NullTokenizer") {
    MXDDP_CHECK(f.vocab_size > 0 && f.vocab_size < INT_MAX,
                "--tokenizer-type NullTokenizer needs --vocab-size N (ids 0..N-1, and N the end-of-document id)");
    MXDDP_CHECK(f.vocab_file.empty() && f.merge_file.empty(), "--{} is not read by --tokenizer-type NullTokenizer",
                f.vocab_file.empty() ? "merge-file" : "vocab-file");
    tokenizer_vocab = f.vocab_size + 1;  // Megatron's NullTokenizer adds the end-of-document id N
    c.eod_id = f.vocab_size;
    notes.push_back(fmt::format("--tokenizer-type NullTokenizer: vocabulary {} + 1 (end of document id {}), as Megatron",
                                f.vocab_size, f.vocab_size));
  } else {
    MXDDP_FAIL("--tokenizer-type '{}' is not supported; valid: GPT2BPETokenizer (with --vocab-file and "
               "--merge-file) or NullTokenizer (with --vocab-size). For another tokenizer give its vocabulary's size "
               "with --vocab-size N and the data as token ids", f.tokenizer_type);
  }
  const int64_t base = tokenizer_vocab > 0 ? tokenizer_vocab : c.model.vocab_size;
  const int64_t padded = padded_vocab_size(base, f.make_vocab_size_divisible_by);
  if (padded != base)
    notes.push_back(fmt::format("vocabulary {} padded to {} (--make-vocab-size-divisible-by {}: {} rows no token uses)",
                                base, padded, f.make_vocab_size_divisible_by, padded - base));
  c.tokenizer_vocab_size = base;
  c.model.vocab_size = static_cast<int>(padded);
  return notes;
}

}  // namespace mxddp::app
