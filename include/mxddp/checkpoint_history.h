// mxddp checkpoint history: Megatron's layout of a save directory, shared by `mxddp train
// --save/--load` and the Python package's mxddp.torch.save_checkpoint / load_checkpoint.
//
//   SAVE_DIR/iter_0000100/                     one whole checkpoint per save (checkpoint.h), named
//   SAVE_DIR/iter_0000200/                     by its iteration (7 digits)
//   SAVE_DIR/latest_checkpointed_iteration.txt the iteration of the newest complete one, a line
//   SAVE_DIR/mxddp.lock                        while a run (or a save) writes the history
//
// A save writes its iter_ directory (atomically, as save_checkpoint does), then rewrites the
// tracker file (temporary + rename), then prunes old iter_ directories down to keep_last: a kill
// at any point leaves the tracker naming a complete checkpoint. resolve_checkpoint_dir is the
// reading side.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>

#include <mxddp/checkpoint.h>

namespace mxddp {

namespace checkpoint_history {

inline constexpr const char* kTrackerFile = "latest_checkpointed_iteration.txt";
inline constexpr int64_t kIterationMax = 9'999'999'999'999;  // far beyond any run; keeps parses in range

// DIR/iter_0000100 for iteration 100.
std::string iteration_dir(const std::string& save_dir, int64_t iteration);

// Throws Error unless dir is free for a history: absent, empty, or holding only a tracker file and
// iter_ directories (an mxddp history). `what` names the directory in the message ("--save").
void check_save_dir(const std::string& save_dir, const std::string& what = "--save");

// After iteration's checkpoint is complete: points the tracker at it and clears what interrupted
// saves of other iterations left (an iter_N.partial or iter_N.old that is the only complete copy
// of N becomes iter_N, as the next save of N would make it; any other is removed). The caller
// holds the history's lock (SaveDirLock), so no live writer owns those leftovers.
void commit(const std::string& save_dir, int64_t iteration);

// After commit(): removes the oldest iter_ directories below iteration so that keep_last remain
// (0: keep all). Directories of later iterations (left by a run that went further and was resumed
// from an older save) are kept. A failure here leaves the committed save complete and named.
void prune_older(const std::string& save_dir, int64_t iteration, int keep_last);

// Readers of a history that another run writes. A save with keep_last removes the checkpoint the
// tracker named a moment before, so a reader that resolved it and then finds a file missing has
// met a save, not damage. A reader tells the two apart by the history's state: the tracker's text
// and the manifest (its CRC-32) of the checkpoint that text names, with its .partial and .old
// copies; for a directory without a tracker, its own manifest. It changes with every save.
inline constexpr int kReadTries = 10;
std::string reader_state(const std::string& dir);

// Runs read, which reads the checkpoint dir means (resolving it itself) and returns whether it
// found that checkpoint sound, or throws Error. When read found problems or threw, and dir's
// reader_state changed meanwhile, read runs again (at most kReadTries times in all, after a short
// pause each); after the last, Error says that dir is being written, naming it. When the state
// did not change, read's outcome stands: a file missing while the tracker stayed is damage.
// Returns read's last result.
bool read_while_unchanged(const std::string& dir, const std::function<bool()>& read);

// Where an output must not go: the checkpoint history or checkpoint that path is, or lies inside.
// Symbolic links and '..' are resolved (realpath of path's nearest existing ancestor), then that
// directory and each above it is looked at. A history holds the tracker file or the lock file, or
// is the parent of the iter_NNNNNNN[.partial|.old] directory the path goes through; a checkpoint
// holds rank_00000.safetensors or an mxddp manifest.json.
struct CheckpointPlace {
  std::string dir;   // the directory found (resolved)
  std::string kind;  // "checkpoint history" or "checkpoint"
};
std::optional<CheckpointPlace> checkpoint_place_of(const std::string& path);

}  // namespace checkpoint_history

// The checkpoint a load of dir means: the iter_ directory dir's latest_checkpointed_iteration.txt
// names, or dir itself when it is one checkpoint (holds manifest.json). Throws Error naming dir
// and what it holds otherwise. When the named iter_ directory is gone because the tracker moved
// meanwhile (a save with keep_last), the tracker is read again (checkpoint_history::kReadTries
// times at most, then Error says that dir is being written). The tracker's text is quoted in
// errors with control characters and other non-printable bytes escaped.
std::string resolve_checkpoint_dir(const std::string& dir);

inline constexpr const char* kSaveLockFile = "mxddp.lock";

// SaveDirLock: one live writer of a save directory at a time. Two runs saving into one history
// interleave their iter_ directories and tracker updates; the second would find out midway, or
// never. The lock is an flock(2) on SAVE_DIR/mxddp.lock: the kernel releases it when the process
// ends, however it ends, so a killed run cannot leave it stale; the file's text (pid, host, start
// time) only names the holder for the refusal's message. The holder removes the file as it ends;
// a killed one leaves it, unlocked, and the next writer takes it over.
class SaveDirLock {
 public:
  // Creates save_dir if missing and takes its lock. Throws Error naming save_dir (as `what`, e.g.
  // "--save") and the run that holds it (from the lock file's text) when another live run has it.
  explicit SaveDirLock(const std::string& save_dir, const std::string& what = "--save");
  ~SaveDirLock();  // removes the file and releases the lock
  SaveDirLock(const SaveDirLock&) = delete;
  SaveDirLock& operator=(const SaveDirLock&) = delete;

 private:
  std::string path_;  // SAVE_DIR/mxddp.lock
  int fd_ = -1;
};

struct HistorySaveOptions {
  int keep_last = 0;  // iter_ directories to keep, the new one included (0: all)
  // Check save_dir (check_save_dir) and hold its lock on rank 0 for this save only. A caller that
  // holds the lock for longer (mxddp train, for the run's life) leaves it off.
  bool check_and_lock = false;
  std::string what = "--save";  // how messages name save_dir
};

// Collective: save_checkpoint into save_dir/iter_NNNNNNN (replacing an earlier save of that
// iteration), then rank 0 points the tracker at it and prunes (commit). Every rank passes the same
// iteration (checked: a different one on any rank is an Error on every rank, before anything is
// written). Every rank throws if any step fails on any rank. Returns the iter_ directory.
std::string save_checkpoint_to_history(const std::string& save_dir, int64_t iteration, DistributedOptimizer& optimizer,
                                       const SaveOptions& options, const HistorySaveOptions& history_options = {});

// Collective: the checkpoint load_dir means (resolve_checkpoint_dir, on every rank: a missing or
// unreadable one is an Error on every rank), loaded into optimizer as load_checkpoint does (every
// check first; a failure leaves the run as it was). Every rank must find the same checkpoint (its
// path and its manifest's CRC-32), or the load is refused on every rank. A failure while load_dir
// changed under any rank (another run saving into it) is retried as read_while_unchanged retries.
// Returns the directory loaded and its metadata.
struct HistoryLoadResult {
  std::string dir;
  std::map<std::string, std::string> metadata;
};
HistoryLoadResult load_checkpoint_from_history(const std::string& load_dir, DistributedOptimizer& optimizer,
                                               const LoadOptions& options = {});

}  // namespace mxddp
