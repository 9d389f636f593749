// SaveDirLock: one live run writes a --save directory at a time.
//
// Two runs saving into one checkpoint history interleave their iter_ directories and tracker
// updates; the second would find out midway, or never. The lock is an flock(2) on
// SAVE_DIR/mxddp.lock held for the run's life: the kernel releases it when the process ends,
// however it ends, so a killed run cannot leave it stale; the file's text (pid, host, start time)
// only names the holder for the refusal's message. A run that ends removes the file; one that is
// killed leaves it, unlocked, and the next run takes it over.
#pragma once

#include <string>

namespace mxddp {

inline constexpr const char* kSaveLockFile = "mxddp.lock";

class SaveDirLock {
 public:
  // Creates save_dir if missing and takes its lock. Throws Error naming save_dir and the run that
  // holds it (from the lock file's text) when another live run has it.
  explicit SaveDirLock(const std::string& save_dir);
  ~SaveDirLock();  // removes the file and releases the lock
  SaveDirLock(const SaveDirLock&) = delete;
  SaveDirLock& operator=(const SaveDirLock&) = delete;

 private:
  std::string path_;  // SAVE_DIR/mxddp.lock
  int fd_ = -1;
};

}  // namespace mxddp
