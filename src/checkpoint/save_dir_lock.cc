// SaveDirLock: see checkpoint_history.h.
#include <mxddp/checkpoint_history.h>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include <fmt/chrono.h>

#include <mxddp/core.h>

#include "printable.h"

namespace mxddp {

namespace {

// The holder's description as the lock file holds it (its first line, escaped: anyone who can
// write the history can write the file).
std::string read_holder(int fd) {
  char text[4096];
  const ssize_t n = pread(fd, text, sizeof text - 1, 0);
  if (n <= 0) return "";
  std::string out(text, static_cast<size_t>(n));
  out = out.substr(0, out.find('\n'));
  return ckpt::printable_text(out, 200);
}

}  // namespace

SaveDirLock::SaveDirLock(const std::string& save_dir, const std::string& what) {
  std::error_code ec;
  std::filesystem::create_directories(save_dir, ec);
  MXDDP_CHECK(!ec, "{} '{}' cannot be created: {}", what, save_dir, ec.message());
  path_ = (std::filesystem::path(save_dir) / kSaveLockFile).string();
  // The holder removes the file as it ends; a run that opened it just before and locks it just
  // after would hold a lock on a file no one else sees. So the lock counts only while the path
  // still names the locked file; otherwise open the path again.
  for (int attempt = 0;; ++attempt) {
    // O_NOFOLLOW: a link planted in the history is not followed to somewhere else.
    fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
    MXDDP_CHECK(fd_ >= 0, "{} '{}': its lock file '{}' cannot be opened: {}", what, save_dir, path_, std::strerror(errno));
    if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      const std::string holder = err == EWOULDBLOCK ? read_holder(fd_) : "";
      ::close(fd_);
      fd_ = -1;
      MXDDP_CHECK(err != EWOULDBLOCK,
                  "{} '{}' is being written by another live run ({}); two runs saving into one checkpoint "
                  "history would mix their iterations. Wait for it to end, stop it, or give this run another {}. "
                  "(A run that ended or was killed leaves no lock: the lock in '{}' goes with its process)",
                  what, save_dir, holder.empty() ? "its lock file names no holder" : holder, what, path_);
      MXDDP_FAIL("{} '{}': its lock file '{}' cannot be locked: {}", what, save_dir, path_, std::strerror(err));
    }
    struct stat locked {}, named {};
    if (::fstat(fd_, &locked) == 0 && ::lstat(path_.c_str(), &named) == 0 && locked.st_dev == named.st_dev &&
        locked.st_ino == named.st_ino)
      break;
    ::close(fd_);
    fd_ = -1;
    MXDDP_CHECK(attempt < 100, "{} '{}': its lock file '{}' keeps being replaced while this run locks it",
                what, save_dir, path_);
  }
  char host[256] = "?";
  ::gethostname(host, sizeof host - 1);
  const auto now = std::chrono::floor<std::chrono::seconds>(std::chrono::system_clock::now());
  const std::string text = fmt::format("pid {} on host {}, holding it since {:%Y-%m-%dT%H:%M:%SZ}\n", ::getpid(), host, now);
  // Best effort: the text only names the holder in another run's message.
  if (::ftruncate(fd_, 0) == 0) {
    [[maybe_unused]] const ssize_t written = ::pwrite(fd_, text.data(), text.size(), 0);
  }
}

SaveDirLock::~SaveDirLock() {
  if (fd_ < 0) return;
  // Only the file this run locked, while still locked, so no other run locks the file being
  // removed: a history removed and made again under a long run (a Python run holds its lock from
  // the first save on) may hold another run's lock file by now.
  struct stat locked {}, named {};
  if (::fstat(fd_, &locked) == 0 && ::lstat(path_.c_str(), &named) == 0 && locked.st_dev == named.st_dev &&
      locked.st_ino == named.st_ino)
    ::unlink(path_.c_str());
  ::close(fd_);  // closing the last descriptor releases the flock
}

}  // namespace mxddp
