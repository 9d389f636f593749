// Megatron's layout of a --save directory: each save is a whole checkpoint in DIR/iter_0000100/
// (7 digits, the iteration), and DIR/latest_checkpointed_iteration.txt holds the iteration of the
// newest complete one. A save writes its iter_ directory (atomically, as save_checkpoint does),
// then rewrites the tracker file (temporary + rename), then prunes old iter_ directories down to
// --keep-last: a kill at any point leaves the tracker naming a complete checkpoint.
// resolve_checkpoint_dir (train.h) is the reading side.
#pragma once

#include <cstdint>
#include <string>

namespace mxddp::checkpoint_history {

inline constexpr const char* kTrackerFile = "latest_checkpointed_iteration.txt";

// DIR/iter_0000100 for iteration 100.
std::string iteration_dir(const std::string& save_dir, int64_t iteration);

// Throws Error unless dir is free for a history: absent, empty, or holding only a tracker file and
// iter_ directories (an mxddp history), named `what` (--save) in the message.
void check_save_dir(const std::string& save_dir);

// After iteration's checkpoint is complete: points the tracker at it, then removes the oldest
// iter_ directories below it so that keep_last remain (0: keep all). Directories of later
// iterations (left by a run that went further and was resumed from an older save) are kept.
void commit(const std::string& save_dir, int64_t iteration, int keep_last);

}  // namespace mxddp::checkpoint_history
