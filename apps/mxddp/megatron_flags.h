// The flags a Megatron user types that mxddp train has no flag of its own for (issue 14 point 6).
// Each is accepted: those that map onto mxddp are applied (--ddp-num-buckets sets the bucket size
// as Megatron computes it), those that are always on here or mean nothing
// here print a note saying so, and model-parallel sizes other than 1 are errors (mxddp is
// data-parallel only). Megatron's names that mxddp has as its own flags (--ddp-bucket-size,
// --overlap-grad-reduce, ...) are registered where those are.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace mxddp::app {

struct MegatronFlags {
  std::optional<int64_t> ddp_num_buckets;
  std::map<std::string, std::string> given;      // flag -> value ("" for a switch), for the notes
  std::map<std::string, int64_t> parallel_sizes;  // --tensor-model-parallel-size etc. as given
};

// Registers the flags on `cmd` in their own option group. The data and tokenizer flags
// (--data-path, --split, --tokenizer-type, ...) are data_flags.h's.
void add_megatron_flags(CLI::App* cmd, MegatronFlags& flags);

// After parsing: the notes to print (one per flag given that is always on or means nothing here).
// Throws Error for a model-parallel size other than 1 and for --ddp-num-buckets with
// --ddp-bucket-size. num_params: the model's, for --ddp-num-buckets; bucket_size is set from it.
std::vector<std::string> apply_megatron_flags(const MegatronFlags& flags, int64_t num_params, bool bucket_size_given,
                                              std::optional<int64_t>& bucket_size);

}  // namespace mxddp::app
