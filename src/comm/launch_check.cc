// check_same_job and throw_if_any_rank_failed (launch_check.h): each rank's text all-gathered as
// bytes (its length first, so that every rank issues the same sizes), then compared on every rank,
// which therefore reaches the same verdict and the same message. The bytes go through the
// communicator's memory (host_collectives.h): a device's, for a checkpoint save of a CUDA model.
#include <mxddp/launch_check.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>

#include "host_collectives.h"

namespace mxddp {

namespace {

// Every rank's `mine`, in rank order. Two all-gathers: the lengths (8 bytes each), then the texts
// padded to the longest.
std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine) {
  const auto ranks = static_cast<size_t>(comm.size());
  uint64_t length = mine.size();
  std::vector<uint64_t> lengths(ranks);  // [ranks]
  all_gather_host(comm, TensorView{&length, DType::kU8, Shape{8}, Device::cpu()},
                  TensorView{lengths.data(), DType::kU8, Shape{static_cast<int64_t>(8 * ranks)}, Device::cpu()});
  const uint64_t longest = *std::max_element(lengths.begin(), lengths.end());
  MXDDP_CHECK(longest <= (uint64_t{1} << 30), "launch check: a rank sent {} bytes of job description; at most 1 GiB",
              longest);
  if (longest == 0) return std::vector<std::string>(ranks);
  std::string padded = mine;
  padded.resize(longest, '\0');
  std::string all(longest * ranks, '\0');  // [ranks][longest]
  all_gather_host(comm, TensorView{padded.data(), DType::kU8, Shape{static_cast<int64_t>(longest)}, Device::cpu()},
                  TensorView{all.data(), DType::kU8, Shape{static_cast<int64_t>(all.size())}, Device::cpu()});
  std::vector<std::string> out(ranks);
  for (size_t r = 0; r < ranks; ++r) out[r] = all.substr(r * longest, lengths[r]);
  return out;
}

void put(std::string& out, const std::string& s) {
  const uint64_t n = s.size();
  out.append(reinterpret_cast<const char*>(&n), sizeof n);
  out += s;
}

std::string encode(const std::vector<JobField>& fields) {
  std::string out;
  for (const JobField& f : fields) {
    put(out, f.name);
    put(out, f.value);
  }
  return out;
}

// The inverse of encode, for bytes another rank of this job wrote with it.
std::vector<JobField> decode(const std::string& bytes) {
  std::vector<JobField> out;
  size_t at = 0;
  auto take = [&]() {
    uint64_t n = 0;
    MXDDP_CHECK(at + sizeof n <= bytes.size(), "launch check: a rank's job description is cut short at byte {}", at);
    std::memcpy(&n, bytes.data() + at, sizeof n);
    at += sizeof n;
    MXDDP_CHECK(n <= bytes.size() - at, "launch check: a rank's job description is cut short at byte {}", at);
    std::string s = bytes.substr(at, n);
    at += n;
    return s;
  };
  while (at < bytes.size()) {
    JobField f;
    f.name = take();
    f.value = take();
    out.push_back(std::move(f));
  }
  return out;
}

// "rank 3" or "ranks 0, 1, 2".
std::string rank_list(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out;
}

}  // namespace

void check_same_job(Communicator& comm, const std::vector<JobField>& fields, std::string_view what) {
  const std::vector<std::string> all = all_gather_strings(comm, encode(fields));
  if (std::all_of(all.begin(), all.end(), [&](const std::string& s) { return s == all.front(); })) return;
  // Field name -> each rank's value (nullopt: the rank does not have the field), names in order
  // of first appearance.
  std::vector<std::string> names;
  std::map<std::string, std::vector<std::optional<std::string>>> values;
  for (size_t r = 0; r < all.size(); ++r)
    for (JobField& f : decode(all[r])) {
      auto [it, inserted] = values.try_emplace(f.name, all.size());
      if (inserted) names.push_back(f.name);
      it->second[r] = std::move(f.value);
    }
  std::string differences;
  for (const std::string& name : names) {
    const auto& per_rank = values[name];
    if (std::all_of(per_rank.begin(), per_rank.end(), [&](const auto& v) { return v == per_rank.front(); })) continue;
    std::vector<std::pair<std::optional<std::string>, std::vector<int>>> groups;  // value -> ranks, first seen first
    for (size_t r = 0; r < per_rank.size(); ++r) {
      auto g = std::find_if(groups.begin(), groups.end(), [&](const auto& x) { return x.first == per_rank[r]; });
      if (g == groups.end()) groups.push_back({per_rank[r], {static_cast<int>(r)}});
      else g->second.push_back(static_cast<int>(r));
    }
    differences += fmt::format("\n  {}:", name);
    for (size_t i = 0; i < groups.size(); ++i)
      differences += fmt::format("{} {} on {}", i ? ";" : "",
                                 groups[i].first ? "'" + *groups[i].first + "'" : std::string("(not given)"),
                                 rank_list(groups[i].second));
  }
  MXDDP_FAIL("the {} ranks were not launched with the same job: {} differ between ranks (an mpirun MPMD line or a "
             "per-host script giving ranks different arguments?); every rank must be given the same:{}",
             all.size(), what, differences);
}

void throw_if_any_rank_failed(Communicator& comm, const std::string& error) {
  const std::vector<std::string> all = all_gather_strings(comm, error);
  std::string failures;
  for (size_t r = 0; r < all.size(); ++r)
    if (!all[r].empty()) failures += fmt::format("\n  rank {}: {}", r, all[r]);
  MXDDP_CHECK(failures.empty(), "{}", failures.substr(3));  // one failure reads as itself; several as a list
}

}  // namespace mxddp
