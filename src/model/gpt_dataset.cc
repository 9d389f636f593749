// The GPT sample index of one split of an indexed dataset, and the weighted blend of several
// (data.h): which tokens sample s of a split is, from s alone, so every rank and every resume
// reads the same samples whatever the data-parallel size.
#include <algorithm>
#include <cmath>
#include <numeric>

#include <mxddp/core.h>
#include <mxddp/data.h>

#include "random.h"

namespace mxddp {

namespace {

// Seeds of the two shuffles of an epoch, apart from each other and from the text sampler's.
constexpr uint64_t kDocumentShuffle = 0x646f63756d656e74ull;  // "document"
constexpr uint64_t kWindowShuffle = 0x77696e646f77ull;        // "window"

template <typename T>
void seeded_shuffle(std::vector<T>& v, uint64_t seed) {
  model::Rng rng(seed);
  for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[static_cast<size_t>(rng.below(i))]);
}

}  // namespace

// ---- GptSampleIndex

GptSampleIndex::GptSampleIndex(const IndexedDataset& data, int64_t doc_first, int64_t doc_last, int seq_length,
                               int64_t vocab_size, uint64_t seed, const std::string& what)
    : data_(data), doc_first_(doc_first), doc_last_(doc_last), seq_length_(seq_length), vocab_size_(vocab_size),
      seed_(seed) {
  MXDDP_CHECK(seq_length >= 1, "--seq-length {} is not valid: at least 1", seq_length);
  // The model takes int32 ids: a larger vocabulary could not be told apart from a cut-off id.
  MXDDP_CHECK(vocab_size >= 1 && vocab_size <= INT32_MAX, "vocabulary size {} is not valid: 1..{}", vocab_size,
              INT32_MAX);
  MXDDP_CHECK(0 <= doc_first && doc_first <= doc_last && doc_last <= data.num_documents(),
              "{}: documents [{}, {}) are not in the dataset's {}", what, doc_first, doc_last, data.num_documents());
  for (int64_t d = doc_first; d < doc_last; ++d) tokens_ += data.document_tokens(d);
  MXDDP_CHECK(tokens_ >= int64_t{seq_length} + 1,
              "{} holds {} tokens (documents {}..{}), but one sample of --seq-length {} needs {}; use more data, "
              "another --split or a shorter sequence", what, tokens_, doc_first, doc_last, seq_length,
              int64_t{seq_length} + 1);
  samples_per_epoch_ = (tokens_ - 1) / seq_length;
}

const GptSampleIndex::Epoch& GptSampleIndex::epoch(int64_t number) const {
  for (const Epoch& e : cache_)
    if (e.number == number) return e;
  Epoch& e = cache_[static_cast<size_t>(next_slot_)];
  next_slot_ = 1 - next_slot_;
  e.number = -1;  // invalid until built (an allocation failure leaves no half-built epoch)
  e.documents.resize(static_cast<size_t>(doc_last_ - doc_first_));
  std::iota(e.documents.begin(), e.documents.end(), doc_first_);
  seeded_shuffle(e.documents, model::mix_hash(seed_, kDocumentShuffle, static_cast<uint64_t>(number)));
  e.token_starts.assign(e.documents.size() + 1, 0);
  for (size_t i = 0; i < e.documents.size(); ++i)
    e.token_starts[i + 1] = e.token_starts[i] + data_.document_tokens(e.documents[i]);
  e.windows.resize(static_cast<size_t>(samples_per_epoch_));
  std::iota(e.windows.begin(), e.windows.end(), int64_t{0});
  seeded_shuffle(e.windows, model::mix_hash(seed_, kWindowShuffle, static_cast<uint64_t>(number)));
  e.number = number;
  return e;
}

void GptSampleIndex::fill(int64_t sample, int32_t* tokens) const {
  MXDDP_CHECK(sample >= 0, "sample {} is not valid: 0 or more", sample);
  const Epoch& e = epoch(sample / samples_per_epoch_);
  int64_t start = e.windows[static_cast<size_t>(sample % samples_per_epoch_)] * seq_length_;
  int64_t need = int64_t{seq_length_} + 1;
  // The document holding token `start` of the concatenation, then on through the next ones.
  size_t doc = static_cast<size_t>(std::upper_bound(e.token_starts.begin(), e.token_starts.end(), start) -
                                   e.token_starts.begin()) - 1;
  int64_t offset = start - e.token_starts[doc];  // in the document
  std::vector<int64_t> buffer;
  while (need > 0) {
    MXDDP_ASSERT(doc < e.documents.size());
    const int64_t d = e.documents[doc];
    int64_t sequence_start = 0;  // in the document
    for (int64_t s = data_.document_first_sequence(d); s < data_.document_end_sequence(d) && need > 0; ++s) {
      const int64_t length = data_.sequence_length(s);
      if (offset >= length) {
        offset -= length;
        sequence_start += length;
        continue;
      }
      const int64_t take = std::min(length - offset, need);
      buffer.resize(static_cast<size_t>(take));
      data_.read_sequence(s, offset, take, buffer.data());
      // Every id was checked when the dataset was opened; this compare per token catches a file
      // changed under the run since, before the id indexes the embedding.
      for (int64_t i = 0; i < take; ++i) {
        const int64_t id = buffer[static_cast<size_t>(i)];
        if (id < 0 || id >= vocab_size_) [[unlikely]]
          refuse_token(id, d, sequence_start + offset + i, s, offset + i);
        *tokens++ = static_cast<int32_t>(id);
      }
      need -= take;
      sequence_start += length;
      offset = 0;
    }
    ++doc;
  }
}

void GptSampleIndex::refuse_token(int64_t id, int64_t document, int64_t position, int64_t sequence,
                                  int64_t in_sequence) const {
  const std::string change = data_.change_since_open();
  MXDDP_FAIL("token id {} (token {} of document {}, sequence {}, byte {} of '{}') is not valid: the vocabulary has {} "
             "tokens (ids 0..{}){}", id, position, document, sequence,
             data_.sequence_pointer(sequence) + in_sequence * data_.dtype().bytes, data_.bin_path(), vocab_size_,
             vocab_size_ - 1, change.empty() ? "" : "; the file changed under the run: " + change);
}

// ---- BlendedGptDataset

BlendedGptDataset::BlendedGptDataset(BlendedGptDatasetOptions options) : options_(std::move(options)) {
  const auto& blend = options_.blend;
  MXDDP_CHECK(!blend.empty(), "--data-path: no dataset given");
  MXDDP_CHECK(options_.vocab_size >= 1, "vocabulary size {} is not valid: at least 1", options_.vocab_size);
  double weight_sum = 0;
  for (const DataBlendEntry& e : blend) {
    MXDDP_CHECK(std::isfinite(e.weight) && e.weight > 0,
                "--data-path weight {} of '{}' is not valid: a positive number", e.weight, e.prefix);
    weight_sum += e.weight;
  }
  // Token frequencies of the training splits, for the unigram entropy; a vocabulary too large to
  // count in memory is not counted (the entropy is then reported as 0).
  const bool count_tokens = options_.vocab_size <= (int64_t{1} << 22);
  std::vector<double> probability(count_tokens ? static_cast<size_t>(options_.vocab_size) : 0, 0.0);
  std::vector<int64_t> counts;
  for (size_t k = 0; k < blend.size(); ++k) {
    datasets_.push_back(std::make_unique<IndexedDataset>(blend[k].prefix));
    const IndexedDataset& data = *datasets_.back();
    weights_.push_back(blend[k].weight / weight_sum);
    ranges_.push_back(split_document_ranges(options_.split, data.num_documents()));
    const auto& r = ranges_.back();
    counts.assign(probability.size(), 0);
    data.check_token_ids(r[0], r[1], options_.vocab_size, count_tokens ? &counts : nullptr);
    data.check_token_ids(r[1], r[3], options_.vocab_size, nullptr);
    const double train_tokens = static_cast<double>(std::accumulate(counts.begin(), counts.end(), int64_t{0}));
    for (size_t t = 0; t < counts.size() && train_tokens > 0; ++t)
      probability[t] += weights_.back() * static_cast<double>(counts[t]) / train_tokens;
    auto& indexes = indexes_.emplace_back();
    for (int s = 0; s < 3; ++s) {
      const auto split = static_cast<DataSplit>(s);
      const int64_t first = r[static_cast<size_t>(s)], last = r[static_cast<size_t>(s + 1)];
      const std::string what = fmt::format("the {} split of '{}' (--split weights {}, {}, {} over {} documents)",
                                           data_split_name(split), blend[k].prefix, options_.split[0],
                                           options_.split[1], options_.split[2], data.num_documents());
      if (split == DataSplit::kTrain) {  // training needs every dataset's samples: an error now
        indexes[0] = std::make_unique<GptSampleIndex>(data, first, last, options_.seq_length, options_.vocab_size,
                                                      model::mix_hash(options_.seed, k, 0), what);
        continue;
      }
      try {  // evaluation's splits may be empty: an error only when read (has_split says)
        indexes[static_cast<size_t>(s)] = std::make_unique<GptSampleIndex>(
            data, first, last, options_.seq_length, options_.vocab_size,
            model::mix_hash(options_.seed, k, static_cast<uint64_t>(s)), what);
      } catch (const Error&) {
      }
    }
  }
  for (double p : probability)
    if (p > 0) unigram_entropy_ -= p * std::log(p);
  for (Cursor& c : cursors_) c.taken.assign(datasets_.size(), 0);
}

BlendedGptDataset::~BlendedGptDataset() = default;

std::pair<int64_t, int64_t> BlendedGptDataset::documents(int k, DataSplit s) const {
  const auto& r = ranges_[static_cast<size_t>(k)];
  return {r[static_cast<size_t>(s)], r[static_cast<size_t>(s) + 1]};
}

bool BlendedGptDataset::has_split(DataSplit s) const {
  for (const auto& indexes : indexes_)
    if (indexes[static_cast<size_t>(s)] == nullptr) return false;
  return true;
}

std::pair<int, int64_t> BlendedGptDataset::locate(DataSplit s, int64_t sample) const {
  MXDDP_CHECK(sample >= 0, "sample {} is not valid: 0 or more", sample);
  if (datasets_.size() == 1) return {0, sample};
  Cursor& c = cursors_[static_cast<size_t>(s)];
  if (sample < c.next) {  // backwards: replay from the start
    c.next = 0;
    std::fill(c.taken.begin(), c.taken.end(), 0);
  }
  while (true) {
    const double x = std::max(static_cast<double>(c.next), 1.0);
    size_t best = 0;
    double best_error = weights_[0] * x - static_cast<double>(c.taken[0]);
    for (size_t k = 1; k < weights_.size(); ++k) {
      const double error = weights_[k] * x - static_cast<double>(c.taken[k]);
      if (error > best_error) {
        best = k;
        best_error = error;
      }
    }
    const int64_t local = c.taken[best]++;
    if (c.next++ == sample) return {static_cast<int>(best), local};
  }
}

void BlendedGptDataset::fill(DataSplit s, int64_t first, int count, int32_t* tokens) const {
  fill_samples(s, first, count, tokens);
  // After the reads (data.h, indexed_dataset.cc): a change that began before now is seen.
  for (const auto& data : datasets_) data->check_unchanged();
}

void BlendedGptDataset::fill_samples(DataSplit s, int64_t first, int count, int32_t* tokens) const {
  const int64_t row = int64_t{options_.seq_length} + 1;
  for (int i = 0; i < count; ++i) {
    const auto [k, local] = locate(s, first + i);
    const auto& index = indexes_[static_cast<size_t>(k)][static_cast<size_t>(s)];
    if (index == nullptr) {
      // Rebuilding it throws the error that says why the split has no samples.
      const auto [a, b] = documents(k, s);
      GptSampleIndex(*datasets_[static_cast<size_t>(k)], a, b, options_.seq_length, options_.vocab_size, 0,
                     fmt::format("the {} split of '{}' (--split weights {}, {}, {})", data_split_name(s),
                                 options_.blend[static_cast<size_t>(k)].prefix, options_.split[0], options_.split[1],
                                 options_.split[2]));
      MXDDP_ASSERT(false);
    }
    index->fill(local, tokens + i * row);
  }
}

std::string BlendedGptDataset::describe() const {
  int64_t documents = 0, tokens = 0;
  for (const auto& d : datasets_) {
    documents += d->num_documents();
    for (int64_t doc = 0; doc < d->num_documents(); ++doc) tokens += d->document_tokens(doc);
  }
  return fmt::format("{} indexed dataset{}, {} documents, {} tokens ({}); split train/valid/test {:.4g}/{:.4g}/{:.4g}",
                     datasets_.size(), datasets_.size() == 1 ? "" : "s", documents, tokens,
                     datasets_.front()->dtype().name, options_.split[0], options_.split[1], options_.split[2]);
}

}  // namespace mxddp
