// InputFile: see input_file.h.
#include <mxddp/input_file.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <mxddp/core.h>

namespace mxddp {

namespace {

// What st_mode says a name is, in the words of ls -l's file types.
const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

int64_t modified_ns(const struct stat& st) {
  return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

}  // namespace

InputFile::InputFile(std::string path, std::string_view what) : path_(std::move(path)), what_(what) {
  MXDDP_CHECK(!path_.empty(), "{} is an empty path: give a regular file", what_);
  // O_NONBLOCK only matters for the open of a FIFO or a device (it returns at once instead of
  // waiting for a writer); such a file is refused below before anything is read from it.
  fd_ = ::open(path_.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  MXDDP_CHECK(fd_ >= 0, "{} '{}' cannot be opened: {}", what_, path_, std::strerror(errno));
  struct stat st {};
  const bool stat_ok = ::fstat(fd_, &st) == 0;
  const int err = errno;
  if (!stat_ok || !S_ISREG(st.st_mode)) {
    ::close(fd_);
    fd_ = -1;
    MXDDP_CHECK(stat_ok, "{} '{}': fstat failed: {}", what_, path_, std::strerror(err));
    MXDDP_FAIL("{} '{}' is {}, not a regular file: give a regular file", what_, path_, file_kind(st.st_mode));
  }
  size_bytes_ = static_cast<int64_t>(st.st_size);
  modified_ns_ = modified_ns(st);
}

InputFile::~InputFile() {
  if (fd_ >= 0) ::close(fd_);
}

void InputFile::read_exact(void* dst, size_t bytes) {
  auto* out = static_cast<char*>(dst);
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::read(fd_, out + done, bytes - done);
    if (n < 0 && errno == EINTR) continue;
    MXDDP_CHECK(n >= 0, "{} '{}': read failed after {} bytes: {}", what_, path_, done, std::strerror(errno));
    MXDDP_CHECK(n > 0, "{} '{}' ended after {} of {} bytes (did it change while being read?)", what_, path_, done,
                bytes);
    done += static_cast<size_t>(n);
  }
}

std::vector<char> InputFile::read_all() {
  MXDDP_CHECK(::lseek(fd_, 0, SEEK_SET) == 0, "{} '{}': seek failed: {}", what_, path_, std::strerror(errno));
  std::vector<char> bytes(static_cast<size_t>(size_bytes_));
  read_exact(bytes.data(), bytes.size());
  return bytes;
}

size_t InputFile::read_at(int64_t offset, void* dst, size_t bytes) const {
  auto* out = static_cast<char*>(dst);
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pread(fd_, out + done, bytes - done, static_cast<off_t>(offset) + static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    MXDDP_CHECK(n >= 0, "{} '{}': reading {} bytes at byte {} failed: {}", what_, path_, bytes, offset,
                std::strerror(errno));
    if (n == 0) break;  // the end of the file
    done += static_cast<size_t>(n);
  }
  return done;
}

std::string InputFile::change_since_open() const {
  struct stat st {};
  if (::fstat(fd_, &st) != 0) return fmt::format("fstat failed: {}", std::strerror(errno));
  const auto size = static_cast<int64_t>(st.st_size);
  if (size != size_bytes_) return fmt::format("it had {} bytes when it was opened and has {} now", size_bytes_, size);
  if (modified_ns(st) != modified_ns_)
    return fmt::format("it was modified after it was opened (same size, {} bytes)", size);
  return "";
}

}  // namespace mxddp
