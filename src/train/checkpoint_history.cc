// checkpoint_history.h, and resolve_checkpoint_dir (train.h): Megatron's iter_/tracker layout.
#include "checkpoint_history.h"
#include "save_dir_lock.h"

#include <algorithm>
#include <filesystem>
#include <optional>
#include <vector>

#include <mxddp/input_file.h>
#include <mxddp/output_file.h>
#include <mxddp/train.h>

namespace mxddp {

namespace checkpoint_history {

namespace {

namespace fs = std::filesystem;

constexpr int64_t kIterationMax = 9'999'999'999'999;  // far beyond any run; keeps the parse in range

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

void check_save_dir(const std::string& save_dir) {
  check_output_dir_path(save_dir, "--save");  // not a file, FIFO or link, and under a directory
  std::error_code ec;
  if (!fs::exists(save_dir, ec)) return;
  MXDDP_CHECK(!fs::exists(fs::path(save_dir) / "manifest.json", ec),
              "--save '{}' is one checkpoint (manifest.json at its top, the layout before iter_ directories); saves "
              "now go to DIR/iter_NNNNNNN. Resume from it with --load '{}' and give --save a new directory",
              save_dir, save_dir);
  for (const fs::directory_entry& entry : fs::directory_iterator(save_dir, ec)) {
    const std::string name = entry.path().filename().string();
    const bool ours = name == kTrackerFile || (parse_iteration_dir(name) && entry.is_directory(ec)) ||
                      name.ends_with(".partial") || name.ends_with(".old") ||  // a save killed half-way
                      name == kSaveLockFile;
    MXDDP_CHECK(ours,
                "--save '{}' holds '{}', which is not part of an mxddp checkpoint history (iter_NNNNNNN directories "
                "and {}); saving there could mix with it. Give a new path, an empty directory or an existing history",
                save_dir, name, kTrackerFile);
  }
  MXDDP_CHECK(!ec, "--save '{}' cannot be listed: {}", save_dir, ec.message());
}

void commit(const std::string& save_dir, int64_t iteration, int keep_last) {
  write_output_file((fs::path(save_dir) / kTrackerFile).string(), fmt::format("{}\n", iteration), "--save's tracker file");
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

}  // namespace mxddp
