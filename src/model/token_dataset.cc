// Byte-level data for the reference GPT: the built-in corpus generator and TokenDataset (split,
// stateless sampling). See model.h for the sampling contract that makes resume and any dp size
// read the same sequences.
#include <array>
#include <cctype>
#include <cmath>

#include <mxddp/input_file.h>
#include <mxddp/model.h>

#include "random.h"

namespace mxddp {

std::string builtin_corpus(int64_t bytes, uint64_t seed) {
  MXDDP_CHECK(bytes >= 1, "corpus size {} bytes is not valid: at least 1", bytes);
  // Subjects agree with their verbs (singular "sees", plural "see"), so the grammar, not only the
  // spelling, carries information a model can learn.
  static constexpr std::array<const char*, 8> kSingular = {"the cat", "a dog", "the old man", "my sister",
                                                           "the small bird", "a teacher", "the king", "our neighbor"};
  static constexpr std::array<const char*, 6> kPlural = {"the cats", "two dogs", "the children", "my friends",
                                                         "the farmers", "some birds"};
  static constexpr std::array<const char*, 8> kVerbs = {"see", "like", "find", "paint", "follow", "help", "watch", "build"};
  static constexpr std::array<const char*, 8> kObjects = {"a red house",  "the green river", "two apples",
                                                          "the tall tree", "a quiet garden",  "the blue boat",
                                                          "three stones",  "the bright moon"};
  static constexpr std::array<const char*, 5> kEndings = {".", " today.", " at night.", " in the morning.", " again."};
  model::Rng rng(model::mix_hash(seed, 0x636f72707573ull));
  std::string text;
  text.reserve(static_cast<size_t>(bytes) + 64);
  int sentences_in_line = 0;
  while (static_cast<int64_t>(text.size()) < bytes) {
    const bool plural = rng.below(2) == 1;
    std::string sentence = plural ? kPlural[rng.below(kPlural.size())] : kSingular[rng.below(kSingular.size())];
    sentence[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(sentence[0])));
    const char* verb = kVerbs[rng.below(kVerbs.size())];
    const std::string_view v(verb);
    sentence += ' ';
    sentence += verb;
    if (!plural) sentence += (v.ends_with("h") ? "es" : "s");
    sentence += ' ';
    sentence += kObjects[rng.below(kObjects.size())];
    sentence += kEndings[rng.below(kEndings.size())];
    text += sentence;
    text += ++sentences_in_line == 4 ? '\n' : ' ';
    if (sentences_in_line == 4) sentences_in_line = 0;
  }
  text.resize(static_cast<size_t>(bytes));
  return text;
}

TokenDataset::TokenDataset(std::string text, double valid_fraction, int seq_length)
    : bytes_(std::move(text)), seq_length_(seq_length) {
  MXDDP_CHECK(seq_length >= 1, "sequence length {} is not valid: at least 1", seq_length);
  MXDDP_CHECK(valid_fraction >= 0.0 && valid_fraction < 1.0, "validation fraction {} is not valid: in [0, 1)",
              valid_fraction);
  const auto total = static_cast<int64_t>(bytes_.size());
  split_ = total - static_cast<int64_t>(std::floor(valid_fraction * static_cast<double>(total)));
  const int64_t need = int64_t{seq_length} + 1;
  MXDDP_CHECK(split_ >= need, "the training split holds {} tokens but one sequence of --seq-length {} needs {}; use "
              "more text or a shorter sequence", split_, seq_length, need);
  MXDDP_CHECK(valid_fraction == 0.0 || total - split_ >= need,
              "the validation split holds {} tokens but one sequence of --seq-length {} needs {}; use more text, a "
              "larger validation fraction or a shorter sequence", total - split_, seq_length, need);
}

int64_t first_non_text_byte(std::string_view text) {
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const auto n = static_cast<int64_t>(text.size());
  for (int64_t i = 0; i < n;) {
    const unsigned char c = p[i];
    if (c == 0) return i;
    // The length of the UTF-8 sequence c starts, and the smallest second byte that is not an
    // overlong form or a surrogate.
    int extra = 0;
    if (c < 0x80) extra = 0;
    else if (c >= 0xc2 && c <= 0xdf) extra = 1;
    else if (c >= 0xe0 && c <= 0xef) extra = 2;
    else if (c >= 0xf0 && c <= 0xf4) extra = 3;
    else return i;
    if (i + extra >= n) return i;  // cut short by the end of the file
    for (int k = 1; k <= extra; ++k)
      if ((p[i + k] & 0xc0) != 0x80) return i;
    if ((c == 0xe0 && p[i + 1] < 0xa0) || (c == 0xed && p[i + 1] > 0x9f) || (c == 0xf0 && p[i + 1] < 0x90) ||
        (c == 0xf4 && p[i + 1] > 0x8f))
      return i;
    i += 1 + extra;
  }
  return -1;
}

TokenDataset TokenDataset::from_file(const std::string& path, double valid_fraction, int seq_length) {
  InputFile in(path, "--data");  // refuses a FIFO, a device or a directory instead of reading it forever
  MXDDP_CHECK(in.size_bytes() > 0, "--data '{}' is empty: give a text file", path);
  std::string text(static_cast<size_t>(in.size_bytes()), '\0');
  in.read_exact(text.data(), text.size());
  // Token ids, an index or any other binary file read as bytes would train silently on garbage.
  MXDDP_CHECK(!text.starts_with(std::string_view("MMIDIDX\0\0", 9)),
              "--data '{}' is a Megatron indexed dataset index, not text: give its prefix (without .idx) to "
              "--data-path", path);
  const int64_t bad = first_non_text_byte(text);
  MXDDP_CHECK(bad < 0,
              "--data '{}' is not text: byte {} (0x{:02x}) is {}; mxddp reads a text file as bytes (UTF-8 without "
              "NUL). Token ids belong in a Megatron indexed dataset: PREFIX.bin + PREFIX.idx, given as --data-path "
              "PREFIX (docs/data.md)", path, bad, static_cast<unsigned char>(text[static_cast<size_t>(bad)]),
              text[static_cast<size_t>(bad)] == '\0' ? "NUL" : "not valid UTF-8");
  return TokenDataset(std::move(text), valid_fraction, seq_length);
}

double TokenDataset::unigram_entropy() const {
  std::array<int64_t, 256> count{};
  for (int64_t i = 0; i < split_; ++i) ++count[static_cast<unsigned char>(bytes_[static_cast<size_t>(i)])];
  double h = 0;
  for (int64_t c : count)
    if (c > 0) {
      const double p = static_cast<double>(c) / static_cast<double>(split_);
      h -= p * std::log(p);
    }
  return h;
}

void TokenDataset::fill_batch(bool valid, uint64_t seed, int64_t round, int64_t first, int count,
                              int32_t* tokens) const {
  MXDDP_CHECK(!valid || valid_tokens() > seq_length_, "there is no validation split to sample (fraction 0)");
  const int64_t base = valid ? split_ : 0;
  const int64_t span = valid ? valid_tokens() : split_;
  const int64_t starts = span - seq_length_;  // a sequence of T + 1 tokens fits at [0, starts)
  const uint64_t domain = valid ? 0x76616c6964ull : 0x747261696eull;  // "valid", "train"
  for (int k = 0; k < count; ++k) {
    const uint64_t h = model::mix_hash(seed ^ domain, static_cast<uint64_t>(round), static_cast<uint64_t>(first + k));
    const int64_t start = base + static_cast<int64_t>(h % static_cast<uint64_t>(starts));
    for (int t = 0; t <= seq_length_; ++t)
      tokens[int64_t{k} * (seq_length_ + 1) + t] = static_cast<unsigned char>(bytes_[static_cast<size_t>(start + t)]);
  }
}

}  // namespace mxddp
