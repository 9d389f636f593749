// Output paths and replacing writes: see output_file.h.
#include <mxddp/output_file.h>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include <mxddp/core.h>

namespace mxddp {

namespace {

namespace fs = std::filesystem;

// What a name is, for messages, without following a symbolic link.
const char* kind_of(fs::file_type type) {
  switch (type) {
    case fs::file_type::regular: return "a regular file";
    case fs::file_type::directory: return "a directory";
    case fs::file_type::symlink: return "a symbolic link";
    case fs::file_type::fifo: return "a FIFO";
    case fs::file_type::character: return "a character device";
    case fs::file_type::block: return "a block device";
    case fs::file_type::socket: return "a socket";
    default: return "not a regular file";
  }
}

// The nearest ancestor of path's parent that exists (the parent itself when it does).
fs::path nearest_existing_parent(const fs::path& path) {
  fs::path ancestor = fs::absolute(path).parent_path();
  std::error_code ec;
  while (!fs::exists(fs::symlink_status(ancestor, ec)) && ancestor.has_relative_path())
    ancestor = ancestor.parent_path();
  return ancestor;
}

// Removes the directories between path's parent and `existing` (exclusive) that a write created,
// deepest first; one that is not empty (someone else wrote into it meanwhile) stays.
void remove_created_parents(const fs::path& path, const fs::path& existing) {
  std::error_code ec;
  for (fs::path dir = fs::absolute(path).parent_path(); dir != existing && dir.has_relative_path();
       dir = dir.parent_path())
    if (!fs::remove(dir, ec)) break;
}

// The path's parent directories either exist as directories or can be created: the nearest
// ancestor that exists must be a directory (a regular file there would make every save fail).
void check_parent(const fs::path& path, const std::string& shown, std::string_view what) {
  const fs::path ancestor = nearest_existing_parent(path);
  std::error_code ec;
  MXDDP_CHECK(fs::is_directory(ancestor, ec), "{} '{}': {} is {}, not a directory, so the path cannot be created "
              "under it: give a path under a directory", what, shown, ancestor.string(),
              kind_of(fs::symlink_status(ancestor, ec).type()));
}

}  // namespace

void check_output_file_path(const std::string& path, std::string_view what) {
  MXDDP_CHECK(!path.empty(), "{} is an empty path: give a file name", what);
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(path, ec);
  if (fs::exists(st))
    MXDDP_CHECK(fs::is_regular_file(st), "{} '{}' is {}; writing would replace it: give a regular file or a new name",
                what, path, kind_of(st.type()));
  check_parent(path, path, what);
}

void check_output_dir_path(const std::string& path, std::string_view what) {
  MXDDP_CHECK(!path.empty(), "{} is an empty path: give a directory name", what);
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(path, ec);
  if (fs::exists(st))
    MXDDP_CHECK(fs::is_directory(st), "{} '{}' is {}; saving would replace it: give a directory or a new name", what,
                path, kind_of(st.type()));
  check_parent(path, path, what);
}

void write_output_file(const std::string& path, std::string_view bytes, std::string_view what) {
  check_output_file_path(path, what);
  const fs::path target(path);
  const fs::path existing = nearest_existing_parent(target);
  std::error_code ec;
  if (target.has_parent_path()) fs::create_directories(target.parent_path(), ec);
  const std::string tmp = (target.parent_path() / fmt::format(".{}.partial", target.filename().string())).string();
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int err = errno;
    remove_created_parents(target, existing);
    MXDDP_FAIL("{} '{}': cannot create '{}': {}", what, path, tmp, std::strerror(err));
  }
  // Any failure from here on removes the temporary and the directories made for it, and names the
  // step and errno.
  const auto fail = [&](const char* step, int err) {
    ::close(fd);
    ::unlink(tmp.c_str());
    remove_created_parents(target, existing);
    MXDDP_FAIL("{} '{}': {} '{}' failed: {}", what, path, step, tmp, write_error_text(err));
  };
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail("writing", n < 0 ? errno : ENOSPC);
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) fail("fsync of", errno);
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    remove_created_parents(target, existing);
    MXDDP_FAIL("{} '{}': closing '{}' failed: {}", what, path, tmp, write_error_text(err));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    remove_created_parents(target, existing);
    MXDDP_FAIL("{} '{}': renaming '{}' into place failed: {}", what, path, tmp, std::strerror(err));
  }
}

std::string write_error_text(int err) {
  std::string text = std::strerror(err);
  rlimit limit{};
  if (err == EFBIG && ::getrlimit(RLIMIT_FSIZE, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY)
    text += fmt::format(": past the file size limit (ulimit -f) of {} bytes", static_cast<uint64_t>(limit.rlim_cur));
  return text;
}

}  // namespace mxddp
