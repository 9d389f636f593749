// File helpers for checkpoints: whole-file reads, durable atomic writes (temporary name, fsync,
// rename, fsync of the directory) and CRC-32 (zlib's).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace mxddp::ckpt {

// The whole file, through InputFile: throws Error naming the path when it cannot be opened or is
// not a regular file (a FIFO or a directory in place of a manifest or rank file).
std::vector<char> read_file(const std::string& path);
// Writes bytes to path via path's directory's ".<name>.tmp", fsyncs, renames into place, and
// fsyncs the directory. Throws Error naming the path and errno (for EFBIG, the file-size limit) on
// failure, having removed the temporary.
void write_file_atomic(const std::string& path, const std::vector<char>& bytes);
void fsync_directory(const std::string& dir);
uint32_t crc32_of(std::span<const char> bytes);

}  // namespace mxddp::ckpt
