// checkpoint_history.h: Megatron's iter_/tracker layout of a save directory, its reading side
// (resolve_checkpoint_dir) and a save into it (save_checkpoint_to_history).
#include <mxddp/checkpoint_history.h>

#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <optional>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <mxddp/comm.h>
#include <mxddp/input_file.h>
#include <mxddp/output_file.h>

#include "agreed.h"
#include "file_io.h"
#include "manifest.h"
#include "printable.h"

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

// The iteration of an interrupted save's leftover, "iter_0000100.partial" or "iter_0000100.old".
std::optional<int64_t> parse_interrupted_save(const std::string& name) {
  for (const std::string_view suffix : {std::string_view(".partial"), std::string_view(".old")})
    if (name.ends_with(suffix)) return parse_iteration_dir(name.substr(0, name.size() - suffix.size()));
  return std::nullopt;
}

// The tracker's text without trailing whitespace. Throws Error naming the file when it cannot be
// read or is longer than any iteration (a file that large is not a tracker).
std::string read_tracker_text(const fs::path& tracker) {
  InputFile file(tracker.string(), "checkpoint tracker file");
  MXDDP_CHECK(file.size_bytes() <= 64, "checkpoint tracker file '{}' holds {} bytes; expected an iteration number",
              tracker.string(), file.size_bytes());
  std::vector<char> bytes = file.read_all();
  std::string text(bytes.begin(), bytes.end());
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ' || text.back() == '\r')) text.pop_back();
  return text;
}

// The iteration a tracker's text names, or -1 when it names none.
int64_t tracker_iteration(const std::string& text) {
  if (text.empty() || text.size() > 13 || !std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return -1;
  return std::stoll(text);
}

// What interrupted saves of other iterations left: a complete copy that is the only one of its
// iteration takes that iteration's name (as the next save of it would do first); any other is
// removed. Best effort: the save that calls it is complete, and a leftover that cannot be removed
// (permissions) stays as it was for the next save to try again.
void clear_interrupted_saves(const std::string& save_dir) {
  std::vector<std::pair<int64_t, fs::path>> leftovers;
  std::error_code ec;
  for (const fs::directory_entry& entry : fs::directory_iterator(save_dir, ec))
    if (const auto it = parse_interrupted_save(entry.path().filename().string()); it && entry.is_directory(ec))
      leftovers.emplace_back(*it, entry.path());
  for (const auto& [iteration, path] : leftovers) {
    try {
      ckpt::recover_interrupted_publish(iteration_dir(save_dir, iteration));
    } catch (const fs::filesystem_error&) {
      continue;  // not renamed: keep both copies rather than remove a complete one
    }
    fs::remove_all(path, ec);
  }
}

// The manifest's CRC-32 as text, or "-" when there is none to read.
std::string manifest_state(const fs::path& dir) {
  try {
    const fs::path manifest = dir / "manifest.json";
    std::error_code ec;
    if (!fs::exists(manifest, ec)) return "-";
    return fmt::format("{:08x}", ckpt::crc32_of(ckpt::read_file(manifest.string())));
  } catch (const Error&) {
    return "-";
  }
}

// "'DIR' is being written ...": the message once a reader has seen the history change kReadTries times.
std::string being_written_message(const std::string& dir) {
  std::string holder;
  try {
    const fs::path lock = fs::path(dir) / kSaveLockFile;
    std::error_code ec;
    if (fs::exists(lock, ec)) {
      std::vector<char> text = InputFile(lock.string(), "lock file").read_all();
      std::string line(text.begin(), text.end());
      holder = line.substr(0, line.find('\n'));
    }
  } catch (const Error&) {
    holder.clear();
  }
  return fmt::format("checkpoint history '{}' is being written: the checkpoint its {} names changed during each of "
                     "{} reads{}. Another run is saving into it (with --keep-last each save removes an older "
                     "checkpoint), which is not damage. Read it again when that run's saves pause, or read an "
                     "iter_NNNNNNN directory the run keeps",
                     dir, kTrackerFile, kReadTries,
                     holder.empty() ? "" : fmt::format(" (its lock file names the writer: {})", ckpt::printable_text(holder, 200)));
}

// A directory that holds an mxddp checkpoint manifest (not some other program's manifest.json).
bool holds_mxddp_manifest(const fs::path& dir) {
  try {
    std::error_code ec;
    if (!fs::is_regular_file(dir / "manifest.json", ec)) return false;
    const std::vector<char> bytes = ckpt::read_file((dir / "manifest.json").string());
    const nlohmann::json j = nlohmann::json::parse(bytes.begin(), bytes.end(), nullptr, /*allow_exceptions=*/false);
    return j.is_object() && j.contains("format") && j["format"] == ckpt::kManifestFormat;
  } catch (const Error&) {
    return false;
  }
}

// What dir is, when it is part of the checkpoint layout (see checkpoint_place_of); child is the
// name under dir that the path goes through ("" at the path's end).
std::optional<std::string> checkpoint_kind(const fs::path& dir, const std::string& child) {
  std::error_code ec;
  if (fs::exists(fs::symlink_status(dir / kTrackerFile, ec)) || fs::exists(fs::symlink_status(dir / kSaveLockFile, ec)))
    return "checkpoint history";
  if (!child.empty() && (parse_iteration_dir(child) || parse_interrupted_save(child)) && fs::is_directory(dir / child, ec))
    return "checkpoint history";
  if (fs::exists(fs::symlink_status(dir / ckpt::rank_file_name(0), ec)) || holds_mxddp_manifest(dir))
    return "checkpoint";
  return std::nullopt;
}

}  // namespace

std::string iteration_dir(const std::string& save_dir, int64_t iteration) {
  return (fs::path(save_dir) / fmt::format("iter_{:07d}", iteration)).string();
}

void check_save_dir(const std::string& save_dir, const std::string& what) {
  check_output_dir_path(save_dir, what);  // not a file, FIFO or link, and under a directory
  std::error_code ec;
  const bool exists = fs::exists(save_dir, ec);
  MXDDP_CHECK(!exists || !fs::exists(fs::path(save_dir) / "manifest.json", ec),
              "{} '{}' is one checkpoint (manifest.json at its top, the layout before iter_ directories); saves "
              "now go to DIR/iter_NNNNNNN. Load from it ('{}') and save to a new directory",
              what, save_dir, save_dir);
  // A history inside another history or checkpoint (DIR/iter_0000002/best) would be deleted by
  // that history's next prune or re-save of the iteration. Whether save_dir is that history itself
  // is asked now, not from `exists` above: another rank may have created it (and its lock) since.
  if (const auto place = checkpoint_place_of(save_dir); place && !fs::equivalent(save_dir, place->dir, ec))
    MXDDP_FAIL("{} '{}' is inside the {} '{}', which saves replace or prune as a whole: this history would go with "
               "it. Give a path outside every checkpoint and checkpoint history",
               what, save_dir, place->kind, place->dir);
  if (!exists) return;
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

void commit(const std::string& save_dir, int64_t iteration) {
  write_output_file((fs::path(save_dir) / kTrackerFile).string(), fmt::format("{}\n", iteration),
                    "the checkpoint history's tracker file");
  clear_interrupted_saves(save_dir);  // the caller's lock: none is a live save's
}

void prune_older(const std::string& save_dir, int64_t iteration, int keep_last) {
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

std::string reader_state(const std::string& dir) {
  const fs::path tracker = fs::path(dir) / kTrackerFile;
  std::error_code ec;
  if (!fs::exists(tracker, ec)) return "manifest " + manifest_state(dir);
  std::string text;
  try {
    text = read_tracker_text(tracker);
  } catch (const Error& e) {
    return "tracker unreadable: " + e.message();
  }
  const int64_t iteration = tracker_iteration(text);
  std::string state = "tracker " + text;
  if (iteration < 0) return state;
  const std::string named = iteration_dir(dir, iteration);
  for (const char* suffix : {"", ".partial", ".old"}) state += fmt::format(" {}", manifest_state(named + suffix));
  return state;
}

bool read_while_unchanged(const std::string& dir, const std::function<bool()>& read) {
  for (int attempt = 1;; ++attempt) {
    const std::string before = reader_state(dir);
    bool sound = false;
    try {
      sound = read();
    } catch (const Error&) {
      if (reader_state(dir) == before) throw;  // the history stood still: the failure is real
      MXDDP_CHECK(attempt < kReadTries, "{}", being_written_message(dir));
      std::this_thread::sleep_for(std::chrono::milliseconds(10 * attempt));
      continue;
    }
    if (sound || reader_state(dir) == before) return sound;
    MXDDP_CHECK(attempt < kReadTries, "{}", being_written_message(dir));
    std::this_thread::sleep_for(std::chrono::milliseconds(10 * attempt));
  }
}

std::optional<CheckpointPlace> checkpoint_place_of(const std::string& path) {
  if (path.empty()) return std::nullopt;
  std::error_code ec;
  // The path as the kernel will resolve it once its missing directories are created: the existing
  // part by realpath (links and '..'), the missing part lexically (it will be plain directories).
  // Normalizing the missing part can lead back into existing directories (missing/../h), so repeat.
  fs::path resolved = fs::absolute(path, ec);
  fs::path existing;
  std::string child;  // the name under `existing` that the path goes through
  for (int round = 0; round < 40; ++round) {
    existing = resolved;
    fs::path missing;
    while (!fs::exists(fs::symlink_status(existing, ec)) && existing.has_relative_path()) {
      missing = existing.filename() / missing;
      existing = existing.parent_path();
    }
    char* real = ::realpath(existing.c_str(), nullptr);
    if (real == nullptr) return std::nullopt;  // a dangling link or a loop: nothing can be written there
    existing = fs::path(real);
    ::free(real);
    child = missing.empty() ? "" : missing.begin()->string();
    const fs::path next = (existing / missing).lexically_normal();
    if (next == resolved) break;
    resolved = next;
  }
  if (!fs::is_directory(existing, ec)) {  // the path names an existing file: look from its directory
    child = existing.filename().string();
    existing = existing.parent_path();
  }
  for (fs::path dir = existing;; child = dir.filename().string(), dir = dir.parent_path()) {
    if (const auto kind = checkpoint_kind(dir, child)) return CheckpointPlace{dir.string(), *kind};
    if (!dir.has_relative_path()) return std::nullopt;  // "/" looked at
  }
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
    for (int attempt = 1;; ++attempt) {
      const std::string text = checkpoint_history::read_tracker_text(tracker);
      const int64_t iteration = checkpoint_history::tracker_iteration(text);
      MXDDP_CHECK(iteration >= 0, "checkpoint tracker file '{}' holds '{}'; expected the iteration of the newest save",
                  tracker.string(), ckpt::printable_text(text, 32));
      const std::string resolved = checkpoint_history::iteration_dir(dir, iteration);
      if (fs::exists(fs::path(resolved) / "manifest.json", ec)) return resolved;
      // Re-saving an iteration that exists moves the old copy to .old and the new one from .partial
      // into place; a kill between the two renames leaves both complete and neither in place (the
      // next save finishes the move). The new one is the one the tracker was about to name again.
      for (const char* suffix : {".partial", ".old"})
        if (fs::exists(fs::path(resolved + suffix) / "manifest.json", ec)) return resolved + suffix;
      // A save with keep_last removes the named checkpoint once the tracker names the next one.
      const bool moved = checkpoint_history::read_tracker_text(tracker) != text;
      MXDDP_CHECK(moved, "checkpoint tracker file '{}' names iteration {}, but {} holds no checkpoint{}", tracker.string(),
                  iteration, resolved, interrupted_saves_note(dir));
      MXDDP_CHECK(attempt < checkpoint_history::kReadTries, "{}", checkpoint_history::being_written_message(dir));
    }
  }
  if (fs::exists(fs::path(dir) / "manifest.json", ec)) return dir;  // a checkpoint itself (an iter_ directory)
  // One checkpoint whose re-save was killed between its two renames: DIR gone, the intact copy in
  // DIR.partial or DIR.old, which its readers take (ckpt::checkpoint_to_read), as inspect does.
  if (!fs::exists(fs::symlink_status(dir, ec)) && ckpt::checkpoint_to_read(dir) != dir) return ckpt::checkpoint_to_read(dir);
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
  all_gather_host(comm, TensorView{&mine, DType::kU8, Shape{8}, Device::cpu()},
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
  // Rank 0 points the tracker at the complete checkpoint, then prunes; every rank learns whether
  // it could (1: the tracker, 2: the pruning, after which the save is complete and named).
  std::string error;
  uint8_t failed = 0;
  if (comm.rank() == 0) {
    try {
      checkpoint_history::commit(save_dir, iteration);
      failed = 2;
      checkpoint_history::prune_older(save_dir, iteration, history_options.keep_last);
      failed = 0;
    } catch (const std::exception& e) {
      error = e.what();
      failed = failed == 0 ? 1 : failed;
    }
  }
  all_reduce_host(comm, TensorView{&failed, DType::kU8, Shape{1}, Device::cpu()}, {.op = ReduceOp::kMax});
  const std::string why = error.empty() ? " (on rank 0)" : ": " + error;
  MXDDP_CHECK(failed != 1, "iteration {}: the checkpoint was saved to {} but the tracker file could not be updated{}",
              iteration, dir, why);
  MXDDP_CHECK(failed != 2, "iteration {}: the checkpoint was saved to {} and the tracker names it (the save is "
              "complete), but removing the older saves beyond keep_last={} failed{}", iteration, dir,
              history_options.keep_last, why);
  return dir;
}

namespace {

// Collective, after every rank resolved a checkpoint: throws Error on every rank unless each found
// the same one (its path and manifest). Ranks that read the tracker at different moments of
// another run's save, or hosts that see different copies, would otherwise load different states.
void check_same_checkpoint(Communicator& comm, const std::string& load_dir, const std::string& dir) {
  const std::string manifest = checkpoint_history::manifest_state(ckpt::checkpoint_to_read(dir));
  const uint32_t crc_dir = ckpt::crc32_of(dir), crc_manifest = ckpt::crc32_of(manifest);
  uint64_t mine = (uint64_t{crc_dir} << 32) | crc_manifest;
  std::vector<uint64_t> all(static_cast<size_t>(comm.size()));
  all_gather_host(comm, TensorView{&mine, DType::kU8, Shape{8}, Device::cpu()},
                        TensorView{all.data(), DType::kU8, Shape{8 * int64_t{comm.size()}}, Device::cpu()});
  for (int r = 0; r < comm.size(); ++r) {
    const uint64_t theirs = all[static_cast<size_t>(r)];
    MXDDP_CHECK(theirs == mine, "checkpoint load: rank {} finds '{}' (manifest CRC-32 {}) in '{}', but rank {} finds "
                "{} there; every rank must load the same checkpoint (do the ranks see one shared copy of '{}'?)",
                comm.rank(), dir, manifest, load_dir, r, (theirs >> 32) == crc_dir ? "another copy of it" : "another checkpoint",
                load_dir);
  }
}

}  // namespace

HistoryLoadResult load_checkpoint_from_history(const std::string& load_dir, DistributedOptimizer& optimizer,
                                               const LoadOptions& options) {
  Communicator& comm = optimizer.data_parallel().communicator();
  for (int attempt = 1;; ++attempt) {
    const std::string before = checkpoint_history::reader_state(load_dir);
    try {
      HistoryLoadResult result;
      ckpt::agreed(comm, "checkpoint load (finding the checkpoint)", [&] { result.dir = resolve_checkpoint_dir(load_dir); });
      check_same_checkpoint(comm, load_dir, result.dir);
      result.metadata = load_checkpoint(result.dir, optimizer, options);
      return result;
    } catch (const std::exception&) {  // (agreed() gives the failing rank its own exception, the others Error)
      // Every rank threw (each step above fails on all ranks together); they retry together when
      // the history changed under any of them.
      uint8_t changed = checkpoint_history::reader_state(load_dir) != before ? 1 : 0;
      all_reduce_host(comm, TensorView{&changed, DType::kU8, Shape{1}, Device::cpu()}, {.op = ReduceOp::kMax});
      if (changed == 0) throw;
      MXDDP_CHECK(attempt < checkpoint_history::kReadTries, "{}", checkpoint_history::being_written_message(load_dir));
      std::this_thread::sleep_for(std::chrono::milliseconds(10 * attempt));
    }
  }
}

}  // namespace mxddp
