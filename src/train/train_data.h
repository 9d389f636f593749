// The data one rank of a training run reads (trainer.h): byte-level text (TokenDataset: a --data
// file or the built-in corpus) or Megatron's indexed datasets (BlendedGptDataset, data.h), behind
// the calls the training loop makes. Either way a training sample is named by its consumed-sample
// number and a validation sample by (evaluation batch, position), so every data-parallel size and
// every resume reads the same tokens.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <mxddp/data.h>
#include <mxddp/launch_check.h>
#include <mxddp/train.h>

namespace mxddp {

class TrainData {
 public:
  // Reads or maps the data the config names and checks every token id against the vocabulary;
  // throws Error naming the file (and for a bad token the id, its document or offset).
  explicit TrainData(const TrainConfig& config);

  // tokens [count, T + 1] <- training samples [first, first + count).
  void fill_train(int64_t first, int count, int32_t* tokens) const;
  // tokens [count, T + 1] <- sequences [first, first + count) of validation batch `batch`
  // (global_batch_size sequences each).
  void fill_valid(int64_t batch, int64_t first, int count, int32_t* tokens) const;
  // The same for a held-out split by name: "validation", or "test" (indexed data only).
  void fill_eval(const std::string& split, int64_t batch, int64_t first, int count, int32_t* tokens) const;
  // The held-out splits an evaluation-only run evaluates, in order: "validation", then "test"
  // where indexed data's --split gives it documents (text has no test split).
  std::vector<std::string> eval_split_names() const;
  double unigram_entropy() const;
  // What every rank must have read alike (sizes and checksums), for check_same_job.
  std::vector<JobField> identity() const;

 private:
  const TrainConfig& config_;
  std::optional<TokenDataset> text_;
  std::optional<BlendedGptDataset> indexed_;
};

}  // namespace mxddp
