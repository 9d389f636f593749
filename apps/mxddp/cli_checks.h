// The checks every flag of the mxddp command goes through, so that a value is either used exactly
// as typed or refused with the flag, the value and what is valid.
//
// CLI11 2.1's own conversions are too lenient for that: integers go through strtoll/strtoull with
// base 0, so "-1" wraps to 2^64 - 1 in an unsigned flag, "010" is octal 8, and a value past
// INT64_MAX saturates to INT64_MAX without a word; reals go through strtold and are then cast, so
// 1e39 becomes inf in a float flag and "nan" passes CLI::NonNegativeNumber. The validators here
// parse the text themselves (decimal, the whole text, range checked against the type the flag is
// stored in) and give CLI11 back the canonical text of the value, so what CLI11 converts is what
// was checked. Use them with ->transform(...), which lets a validator rewrite the text.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>

#include <mxddp/core.h>

namespace mxddp::app {

// Parses all of `text` as a decimal integer in [lo, hi]: an optional '-', then digits; no '+',
// spaces or base prefix. Throws Error "{what} '{text}' is not valid: give an integer in [lo, hi]".
int64_t parse_integer(std::string_view text, std::string_view what, int64_t lo, int64_t hi);

// Splits a list flag's text at every `sep`, keeping empty fields ("5x" is "5" and ""), so that a
// stray or trailing separator is refused by the field's own check instead of silently dropped
// (std::getline drops a trailing empty field).
std::vector<std::string> split_keeping_empty(std::string_view text, char sep);

// Refuses an empty argument ('') or an option with an empty value ("--name="), naming its
// position. No flag of mxddp takes an empty value, and CLI11 2.1 mishandles empty arguments: after
// a subcommand it skips the rest of the line silently, and after a bad value it can loop forever.
// Throws Error.
void check_no_empty_arguments(int argc, const char* const* argv);

// `mxddp layout --shapes`: a comma-separated list of shapes, each 1 to Shape::kMaxDims positive
// dimensions joined by 'x' ("95x95,95,1"). Throws Error naming the list, the shape and what is
// valid; a shape whose element count overflows int64 is refused too.
std::vector<Shape> parse_shape_list(const std::string& shapes);

// `mxddp quantize --shape`: "MxN" with positive M and N, returned as {M, N}. Throws Error naming
// the text and what is valid.
std::pair<int64_t, int64_t> parse_matrix_shape(const std::string& text);

// An integer flag in [lo, hi]; the bounds should lie within the type the flag is stored in.
CLI::Validator integer_in(int64_t lo, int64_t hi);
// An unsigned 64-bit flag in [lo, hi] (--seed): a leading '-' is refused, not wrapped.
CLI::Validator unsigned_in(uint64_t lo, uint64_t hi);

// Which ends of a real range are included: [lo, hi], (lo, hi] or [lo, hi).
enum class Ends { kClosed, kOpenLow, kOpenHigh };
// Where a real flag is stored: a float flag's value must stay finite and in range once rounded
// to float (1e39 is a double but not a float; 0.999999999 is below 1 but rounds to 1.0f).
enum class Storage { kFloat, kDouble };
// A finite real flag in the range; inf and nan are refused.
CLI::Validator real_in(double lo, double hi, Storage storage, Ends ends = Ends::kClosed);

// A path flag: an empty path (--save '') names nothing and is refused instead of ignored.
CLI::Validator non_empty_path();

// Longest a local-backend rank waits for its peers (--timeout-ms): a week. A collective that takes
// longer is a hang, and bounding the flag keeps deadline arithmetic far from overflow.
inline constexpr int64_t kTimeoutMsMax = int64_t{7} * 24 * 3600 * 1000;

}  // namespace mxddp::app
