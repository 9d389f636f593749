// checkpoint_history.h: Megatron's iter_/tracker layout of a save directory, its reading side
// (resolve_checkpoint_dir) and a save into it (save_checkpoint_to_history).
#include <mxddp/checkpoint_history.h>

#include <algorithm>
#include <filesystem>
#include <optional>
#include <vector>

#include <fmt/format.h>

#include <mxddp/comm.h>
#include <mxddp/input_file.h>
#include <mxddp/output_file.h>

#include "agreed.h"

namespace mxddp {

namespace checkpoint_history {

namespace {

namespace fs = std::filesystem;

// The iteration of an "iter_0000100" directory name, or nullopt for any other name.
std::optional<int64_t> parse_iteration_dir(const std::string& name) {
  constexpr std::string_view kPrefix = "iter_";
  if (name.size() < kPrefix.size() + 7 || !name.starts_with(kPrefix)) return std::nullopt;
  int64_t value = 0;
  for (size_t i = kPrefix.size(); i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || value > kIterationMax / 10) return std::nullopt;
    value = value * 10 + (name[i] - '0');
  }
  return value;
}

}  // namespace

std::string iteration_dir(const std::string& save_dir, int64_t iteration) {
  return (fs::path(save_dir) / fmt::format("iter_{:07d}", iteration)).string();
}

void check_save_dir(const std::string& save_dir, const std::string& what) {
  check_output_dir_path(save_dir, what);  // not a file, FIFO or link, and under a directory
  std::error_code ec;
  if (!fs::exists(save_dir, ec)) return;
  MXDDP_CHECK(!fs::exists(fs::path(save_dir) / "manifest.json", ec),
              "{} '{}' is one checkpoint (manifest.json at its top, the layout before iter_ directories); saves "
              "now go to DIR/iter_NNNNNNN. Load from it ('{}') and save to a new directory",
              what, save_dir, save_dir);
  for (const fs::directory_entry& entry : fs::directory_iterator(save_dir, ec)) {
    const std::string name = entry.path().filename().string();
    const bool ours = name == kTrackerFile || (parse_iteration_dir(name) && entry.is_directory(ec)) ||
                      name.ends_with(".partial") || name.ends_with(".old") ||  // a save killed half-way
                      name == kSaveLockFile;
    MXDDP_CHECK(ours,
                "{} '{}' holds '{}', which is not part of an mxddp checkpoint history (iter_NNNNNNN directories "
                "and {}); saving there could mix with it. Give a new path, an empty directory or an existing history",
                what, save_dir, name, kTrackerFile);
  }
  MXDDP_CHECK(!ec, "{} '{}' cannot be listed: {}", what, save_dir, ec.message());
}

void commit(const std::string& save_dir, int64_t iteration, int keep_last) {
  write_output_file((fs::path(save_dir) / kTrackerFile).string(), fmt::format("{}\n", iteration),
                    "the checkpoint history's tracker file");
  if (keep_last <= 0) return;
  std::vector<std::pair<int64_t, fs::path>> older;  // iter_ directories below this iteration
  for (const fs::directory_entry& entry : fs::directory_iterator(save_dir)) {
    const auto it = parse_iteration_dir(entry.path().filename().string());
    if (it && *it < iteration && entry.is_directory()) older.emplace_back(*it, entry.path());
  }
  std::sort(older.begin(), older.end());
  const size_t keep_older = static_cast<size_t>(keep_last - 1);
  for (size_t i = 0; i + keep_older < older.size(); ++i) fs::remove_all(older[i].second);
}

}  // namespace checkpoint_history

namespace {

// " (iter_0000002.partial: a save that was interrupted before it completed; it is never loaded)",
// or "" when dir holds no interrupted save.
std::string interrupted_saves_note(const std::string& dir) {
  namespace fs = std::filesystem;
  std::vector<std::string> partial;
  std::error_code ec;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir, ec))
    if (entry.path().filename().string().ends_with(".partial")) partial.push_back(entry.path().filename().string());
  if (partial.empty()) return "";
  std::sort(partial.begin(), partial.end());
  std::string names;
  for (const std::string& p : partial) names += (names.empty() ? "" : ", ") + p;
  return fmt::format(" ({}: {} interrupted before {} completed; never loaded, and the next save to this --save replaces "
                     "{})", names, partial.size() == 1 ? "a save" : "saves", partial.size() == 1 ? "it" : "they",
                     partial.size() == 1 ? "it" : "them");
}

}  // namespace

std::string resolve_checkpoint_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path tracker = fs::path(dir) / checkpoint_history::kTrackerFile;
  std::error_code ec;
  if (fs::exists(tracker, ec)) {
    InputFile file(tracker.string(), "checkpoint tracker file");
    MXDDP_CHECK(file.size_bytes() <= 64, "checkpoint tracker file '{}' holds {} bytes; expected an iteration number",
                tracker.string(), file.size_bytes());
    std::vector<char> bytes = file.read_all();
    std::string text(bytes.begin(), bytes.end());
    while (!text.empty() && (text.back() == '\n' || text.back() == ' ' || text.back() == '\r')) text.pop_back();
    int64_t iteration = -1;
    if (!text.empty() && text.size() <= 13 && std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; }))
      iteration = std::stoll(text);
    MXDDP_CHECK(iteration >= 0, "checkpoint tracker file '{}' holds '{}'; expected the iteration of the newest save",
                tracker.string(), text.substr(0, 32));
    const std::string resolved = checkpoint_history::iteration_dir(dir, iteration);
    if (fs::exists(fs::path(resolved) / "manifest.json", ec)) return resolved;
    // Re-saving an iteration that exists moves the old copy to .old and the new one from .partial
    // into place; a kill between the two renames leaves both complete and neither in place (the
    // next save finishes the move). The new one is the one the tracker was about to name again.
    for (const char* suffix : {".partial", ".old"})
      if (fs::exists(fs::path(resolved + suffix) / "manifest.json", ec)) return resolved + suffix;
    MXDDP_FAIL("checkpoint tracker file '{}' names iteration {}, but {} holds no checkpoint{}", tracker.string(), iteration,
               resolved, interrupted_saves_note(dir));
  }
  if (fs::exists(fs::path(dir) / "manifest.json", ec)) return dir;  // a checkpoint itself (an iter_ directory)
  MXDDP_CHECK(fs::is_directory(dir, ec), "checkpoint '{}' is not a directory", dir);
  MXDDP_FAIL("'{}' holds neither {} (a --save history) nor manifest.json (one checkpoint){}", dir,
             checkpoint_history::kTrackerFile, interrupted_saves_note(dir));
}

std::string save_checkpoint_to_history(const std::string& save_dir, int64_t iteration, DistributedOptimizer& optimizer,
                                       const SaveOptions& options, const HistorySaveOptions& history_options) {
  Communicator& comm = optimizer.data_parallel().communicator();
  // The same iteration on every rank, or each would write (and the tracker name) another directory.
  int64_t mine = iteration;
  std::vector<int64_t> all(static_cast<size_t>(comm.size()));
  comm.all_gather(TensorView{&mine, DType::kU8, Shape{8}, Device::cpu()},
                  TensorView{all.data(), DType::kU8, Shape{8 * int64_t{comm.size()}}, Device::cpu()});
  for (int r = 0; r < comm.size(); ++r)
    MXDDP_CHECK(all[static_cast<size_t>(r)] == iteration, "checkpoint save: rank {} saves iteration {} but rank {} "
                "iteration {}; every rank must save the same iteration", comm.rank(), iteration, r,
                all[static_cast<size_t>(r)]);
  MXDDP_CHECK(iteration >= 0 && iteration <= checkpoint_history::kIterationMax,
              "checkpoint iteration {} is not valid: in [0, {}]", iteration, checkpoint_history::kIterationMax);
  MXDDP_CHECK(history_options.keep_last >= 0, "keep_last {} is not valid: 0 (keep every save) or more",
              history_options.keep_last);
  std::optional<SaveDirLock> lock;
  if (history_options.check_and_lock)
    ckpt::agreed(comm, "checkpoint save (checking the save directory)", [&] {
      checkpoint_history::check_save_dir(save_dir, history_options.what);
      if (comm.rank() == 0) lock.emplace(save_dir, history_options.what);
    });
  const std::string dir = checkpoint_history::iteration_dir(save_dir, iteration);
  SaveOptions save_options = options;
  save_options.overwrite = true;  // a history's iteration saved again replaces the earlier save
  save_checkpoint(dir, optimizer, save_options);
  // Rank 0 points the tracker at the complete checkpoint; every rank learns whether it could.
  std::string error;
  if (comm.rank() == 0) {
    try {
      checkpoint_history::commit(save_dir, iteration, history_options.keep_last);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  uint8_t failed = error.empty() ? 0 : 1;
  comm.all_reduce(TensorView{&failed, DType::kU8, Shape{1}, Device::cpu()}, {.op = ReduceOp::kMax});
  MXDDP_CHECK(failed == 0, "iteration {}: the checkpoint was saved to {} but the tracker file could not be updated{}",
              iteration, dir, error.empty() ? " (on rank 0)" : ": " + error);
  return dir;
}

HistoryLoadResult load_checkpoint_from_history(const std::string& load_dir, DistributedOptimizer& optimizer,
                                               const LoadOptions& options) {
  HistoryLoadResult result;
  ckpt::agreed(optimizer.data_parallel().communicator(), "checkpoint load (finding the checkpoint)",
               [&] { result.dir = resolve_checkpoint_dir(load_dir); });
  result.metadata = load_checkpoint(result.dir, optimizer, options);
  return result;
}

}  // namespace mxddp
