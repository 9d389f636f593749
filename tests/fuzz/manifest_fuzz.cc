// Fuzz target: the checkpoint manifest parser, reached the way `mxddp ckpt inspect` reaches it,
// through the public inspect_checkpoint(dir): each input becomes DIR/manifest.json in a directory of
// this process's own (under $TMPDIR), which also holds one small fixed file, rank_00000.safetensors,
// so a manifest that names it exercises the size and checksum checks.
//
// The manifest is checksummed, so almost every mutation would stop at the checksum. An input that
// starts with '!' is resealed instead: the rest is parsed as JSON and written back with its
// manifest_crc32 recomputed as docs/optim.md documents, so the field checks behind the checksum
// see the mutations too (a forger's manifest).
//
// inspect_checkpoint promises Error for a missing or unreadable manifest and a per-file status for
// everything else; a crash, a sanitizer report or any other exception fails.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>
#include <zlib.h>

#include <mxddp/checkpoint.h>

#include "fuzz_check.h"

namespace {

// The same content as tests/fuzz/corpus/manifest's seeds assume (its size and CRC-32 are in them).
constexpr char kFixedFile[] = "mxddp fuzz: a file a manifest may name\n";
constexpr char kFixedFileName[] = "rank_00000.safetensors";

std::string make_dir() {
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/mxddp_fuzz_manifest_XXXXXX";
  MXDDP_FUZZ_ASSERT(::mkdtemp(pattern.data()) != nullptr, "cannot create a directory from '%s'", pattern.c_str());
  std::ofstream(pattern + "/" + kFixedFileName, std::ios::binary) << kFixedFile;
  return pattern;
}

const std::string& fuzz_dir() {
  static const std::string dir = make_dir();
  // Removed at a normal exit (libFuzzer's -max_total_time or -runs); a crash leaves it for a look.
  static const bool cleanup = std::atexit([] { std::filesystem::remove_all(fuzz_dir()); }) == 0;
  static_cast<void>(cleanup);
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& dir = fuzz_dir();
  std::string text(reinterpret_cast<const char*>(data), size);
  if (!text.empty() && text[0] == '!') {
    nlohmann::json m = nlohmann::json::parse(text.begin() + 1, text.end(), nullptr, /*allow_exceptions=*/false);
    if (!m.is_object()) return 0;
    m.erase("manifest_crc32");
    const std::string canonical = m.dump();
    m["manifest_crc32"] = ::crc32(::crc32(0L, Z_NULL, 0), reinterpret_cast<const Bytef*>(canonical.data()),
                                  static_cast<uInt>(canonical.size()));
    text = m.dump(1);
  }
  {
    std::ofstream out(dir + "/manifest.json", std::ios::binary | std::ios::trunc);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    MXDDP_FUZZ_ASSERT(out.good(), "cannot write %s/manifest.json", dir.c_str());
  }
  try {
    const mxddp::CheckpointInfo info = mxddp::inspect_checkpoint(dir);
    bool all_ok = true;
    for (const mxddp::CheckpointFileInfo& f : info.files) {
      MXDDP_FUZZ_ASSERT(!f.status.empty(), "file '%s' has an empty status", f.name.c_str());
      all_ok = all_ok && f.status == "ok";
    }
    // ok() also needs every other check to pass, so it can be false with every file ok.
    MXDDP_FUZZ_ASSERT(!info.ok() || all_ok, "ok() is true but a file's status is not ok");
  } catch (const mxddp::Error&) {
    // refused, with a message: what a damaged manifest should get
  }
  return 0;
}
