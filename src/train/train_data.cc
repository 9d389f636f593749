// TrainData (train_data.h): the text or the indexed datasets a run trains on.
#include "train_data.h"

#include "../checkpoint/file_io.h"

namespace mxddp {

TrainData::TrainData(const TrainConfig& config) : config_(config) {
  const int seq_length = config.model.seq_length;
  const int64_t vocab = config.vocab_size_for_data();
  if (!config.data_blend.empty()) {
    indexed_.emplace(BlendedGptDatasetOptions{.blend = config.data_blend,
                                              .split = config.split,
                                              .seq_length = seq_length,
                                              .seed = config.seed,
                                              .vocab_size = vocab});
    if (config.eval_iters > 0 && !indexed_->has_split(DataSplit::kValid)) {
      std::vector<int32_t> probe(static_cast<size_t>(seq_length) + 1);
      indexed_->fill(DataSplit::kValid, 0, 1, probe.data());  // throws naming the dataset without samples
    }
    return;
  }
  if (config.data_path.empty())
    text_.emplace(builtin_corpus(config.corpus_bytes), config.valid_fraction, seq_length);
  else
    text_.emplace(TokenDataset::from_file(config.data_path, config.valid_fraction, seq_length));
  const std::string_view text = text_->text();
  for (size_t i = 0; i < text.size(); ++i) {
    const int id = static_cast<unsigned char>(text[i]);
    MXDDP_CHECK(id < vocab, "token id {} (the byte at offset {} of {}) is not valid: the vocabulary has {} tokens; text "
                "is read as bytes (ids 0..255), so {} must be at least 256", id, i,
                config.data_path.empty() ? std::string("the built-in corpus") : "'" + config.data_path + "'", vocab,
                config.load_hf_dir.empty() ? std::string("--vocab-size")
                                           : fmt::format("the vocabulary of --load-hf '{}'", config.load_hf_dir));
  }
}

void TrainData::fill_train(int64_t first, int count, int32_t* tokens) const {
  if (indexed_) indexed_->fill(DataSplit::kTrain, first, count, tokens);
  else text_->fill_batch(false, config_.seed, 0, first, count, tokens);
}

void TrainData::fill_valid(int64_t batch, int64_t first, int count, int32_t* tokens) const {
  if (indexed_) indexed_->fill(DataSplit::kValid, batch * config_.global_batch_size + first, count, tokens);
  else text_->fill_batch(true, config_.seed, batch, first, count, tokens);
}

void TrainData::fill_eval(const std::string& split, int64_t batch, int64_t first, int count, int32_t* tokens) const {
  if (split == "validation") return fill_valid(batch, first, count, tokens);
  MXDDP_CHECK(split == "test" && indexed_, "evaluation split '{}' is not valid here; valid: validation{}", split,
              indexed_ ? ", test" : "");
  indexed_->fill(DataSplit::kTest, batch * config_.global_batch_size + first, count, tokens);
}

std::vector<std::string> TrainData::eval_split_names() const {
  if (indexed_ && indexed_->has_split(DataSplit::kTest)) return {"validation", "test"};
  return {"validation"};
}

double TrainData::unigram_entropy() const { return indexed_ ? indexed_->unigram_entropy() : text_->unigram_entropy(); }

std::vector<JobField> TrainData::identity() const {
  if (text_) {
    const std::string_view text = text_->text();
    return {{"data bytes read", std::to_string(text.size())}, {"data crc32", fmt::format("{:08x}", ckpt::crc32_of(text))}};
  }
  std::vector<JobField> fields;
  for (int k = 0; k < indexed_->num_datasets(); ++k) {
    const IndexedDataset& d = indexed_->dataset(k);
    fields.push_back({fmt::format("'{}' crc32", d.idx_path()), fmt::format("{:08x}", ckpt::crc32_of(d.idx_bytes()))});
    fields.push_back({fmt::format("'{}' bytes", d.bin_path()), std::to_string(d.bin_bytes())});
  }
  return fields;
}

}  // namespace mxddp
