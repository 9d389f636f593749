// Checkpoint file helpers: see file_io.h.
#include "file_io.h"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include <mxddp/core.h>
#include <mxddp/input_file.h>
#include <mxddp/output_file.h>

namespace mxddp::ckpt {

std::vector<char> read_file(const std::string& path) { return InputFile(path, "checkpoint file").read_all(); }

void fsync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  MXDDP_CHECK(fd >= 0, "cannot open directory '{}' to sync it: {}", dir, std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  MXDDP_CHECK(rc == 0, "fsync of directory '{}' failed: {}", dir, std::strerror(err));
}

void write_file_atomic(const std::string& path, const std::vector<char>& bytes) {
  const std::filesystem::path target(path);
  const std::string tmp = (target.parent_path() / fmt::format(".{}.tmp", target.filename().string())).string();
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  MXDDP_CHECK(fd >= 0, "cannot create '{}': {}", tmp, std::strerror(errno));
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      MXDDP_FAIL("writing '{}' failed after {} of {} bytes: {}", tmp, done, bytes.size(), write_error_text(err));
    }
    done += static_cast<size_t>(n);
  }
  const bool synced = ::fsync(fd) == 0;
  const int err = errno;
  ::close(fd);
  if (!synced) {
    ::unlink(tmp.c_str());
    MXDDP_FAIL("fsync of '{}' failed: {}", tmp, write_error_text(err));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int rename_err = errno;
    ::unlink(tmp.c_str());
    MXDDP_FAIL("renaming '{}' to '{}' failed: {}", tmp, path, std::strerror(rename_err));
  }
  fsync_directory(target.parent_path().string());
}

uint32_t crc32_of(std::span<const char> bytes) {
  uLong crc = ::crc32(0L, Z_NULL, 0);
  size_t done = 0;
  while (done < bytes.size()) {  // zlib takes uInt lengths
    const auto chunk = static_cast<uInt>(std::min<size_t>(bytes.size() - done, 1u << 30));
    crc = ::crc32(crc, reinterpret_cast<const Bytef*>(bytes.data() + done), chunk);
    done += chunk;
  }
  return static_cast<uint32_t>(crc);
}

}  // namespace mxddp::ckpt
