// Writing a file or directory a user named (--report, --save, quantize's --out-data and
// --out-scales).
//
// Outputs are written under a temporary name and renamed into place, and a rename replaces
// whatever the name held: as root, --report /dev/full turned the device node into a regular file,
// and a FIFO or a symbolic link was replaced the same way. So an existing target must be what the
// output will be (a regular file, or a directory for --save), and that is checked before any
// work starts, together with the parent directory, so that a bad path fails at once and not after
// the training. Write errors (a full disk, a file-size limit) are errors naming the file.
#pragma once

#include <string>
#include <string_view>

namespace mxddp {

// Throws Error, naming `what` ("--report") and the path, unless path is free for a file written
// by replacement: it does not exist or is a regular file (not a symbolic link), and the nearest
// existing ancestor of its parent is a directory (missing ones are created when written).
void check_output_file_path(const std::string& path, std::string_view what);
// The same for a directory replaced as a whole (--save): an existing target must be a directory
// (not a symbolic link).
void check_output_dir_path(const std::string& path, std::string_view what);

// Writes bytes to path: checks it (check_output_file_path), creates missing parent directories,
// writes "<dir>/.<name>.partial", fsyncs it and renames it into place. Throws Error naming `what`,
// the file and errno on any failure, and leaves nothing behind: no temporary, and none of the
// directories it created.
void write_output_file(const std::string& path, std::string_view bytes, std::string_view what);

// A failed write's errno as text for a message: strerror(err), and for EFBIG the file-size limit
// the write went past, "File too large: past the file size limit (ulimit -f) of 102400 bytes".
// (The process must ignore SIGXFSZ for a write to fail with EFBIG rather than kill it.)
std::string write_error_text(int err);

}  // namespace mxddp
