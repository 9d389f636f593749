// Reading a file a user named (--data, --input, a checkpoint's manifest and rank files).
//
// A name can point at anything: a FIFO or a terminal blocks the reader forever, /dev/zero never
// ends, a directory "opens" and then reads as garbage or an absurd size. InputFile is the one way
// mxddp opens such a name: it opens without blocking (O_NONBLOCK, so a FIFO with no writer does
// not hang the open itself), then asks fstat what the name is and refuses everything but a regular
// file. The size is known before anything is read or allocated, so a caller can check it against
// what it expects first.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace mxddp {

class InputFile {
 public:
  // `what` says where the name came from ("--data", "checkpoint file") and starts every error,
  // e.g. "--data '/tmp/fifo' is a FIFO, not a regular file". Throws Error when the name cannot be
  // opened or is not a regular file.
  InputFile(std::string path, std::string_view what);
  ~InputFile();
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;

  const std::string& path() const { return path_; }
  // The size fstat reported at open.
  int64_t size_bytes() const { return size_bytes_; }
  // The open descriptor (read-only), e.g. to memory-map the file; owned by this object.
  int fd() const { return fd_; }
  // Reads exactly `bytes` bytes at the current position; throws naming the file if it ends first
  // (it shrank after open) or a read fails.
  void read_exact(void* dst, size_t bytes);
  // The whole file: size_bytes() bytes from the start.
  std::vector<char> read_all();
  // Up to `bytes` bytes at byte `offset` (pread: the position is untouched, so threads may share
  // the file). Returns how many were read: fewer only where the file ends. Throws naming the file
  // if a read fails.
  size_t read_at(int64_t offset, void* dst, size_t bytes) const;
  // How the file differs from what fstat said at open: "" when its size and modification time are
  // the same, else e.g. "it had 1600 bytes when it was opened and has 800 now". The check a
  // reader makes between reads of a file it keeps open (a dataset read through a whole run).
  std::string change_since_open() const;

 private:
  std::string path_;
  std::string what_;
  int fd_ = -1;
  int64_t size_bytes_ = 0;
  int64_t modified_ns_ = 0;  // st_mtim at open
};

}  // namespace mxddp
