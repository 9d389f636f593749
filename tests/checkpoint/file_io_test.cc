// write_file_atomic's promise: a write that fails at any point (the temporary cannot be created,
// the disk refuses bytes half-way) throws naming the file and leaves the old file as it was, with
// no temporary behind; one that succeeds replaces it whole.
#include <signal.h>
#include <sys/resource.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>

#include <mxddp/core.h>

#include "checkpoint/file_io.h"

namespace mxddp::testing {
namespace {

namespace fs = std::filesystem;

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

struct Scratch {
  fs::path dir = fs::temp_directory_path() / ("mxddp_file_io_" + std::to_string(::getpid()));
  Scratch() {
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  ~Scratch() { fs::remove_all(dir); }
};

TEST(WriteFileAtomic, ReplacesTheFileWhole) {
  Scratch s;
  const fs::path target = s.dir / "f.bin";
  { std::ofstream(target) << "old contents"; }
  ckpt::write_file_atomic(target.string(), std::vector<char>{'n', 'e', 'w'});
  EXPECT_EQ(slurp(target), "new");
  EXPECT_EQ(std::distance(fs::directory_iterator(s.dir), fs::directory_iterator{}), 1) << "a temporary was left";
}

TEST(WriteFileAtomic, FailureToCreateTheTemporaryKeepsTheOldFile) {
  Scratch s;
  const fs::path target = s.dir / "f.bin";
  { std::ofstream(target) << "old contents"; }
  fs::create_directories(s.dir / ".f.bin.tmp" / "occupied");  // the temporary's name, taken by a directory
  try {
    ckpt::write_file_atomic(target.string(), std::vector<char>(100, 'x'));
    FAIL() << "the write should have failed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(".f.bin.tmp"), std::string::npos) << e.what();
  }
  EXPECT_EQ(slurp(target), "old contents");
}

// The file-size limit makes write() refuse bytes part-way (EFBIG), as a full disk would.
TEST(WriteFileAtomic, FailureHalfWayKeepsTheOldFileAndLeavesNoTemporary) {
  Scratch s;
  const fs::path target = s.dir / "f.bin";
  { std::ofstream(target) << "old contents"; }
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  const auto previous_handler = ::signal(SIGXFSZ, SIG_IGN);  // get EFBIG instead of the signal
  rlimit small = saved;
  small.rlim_cur = 4096;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  std::string error;
  try {
    ckpt::write_file_atomic(target.string(), std::vector<char>(1 << 20, 'x'));
  } catch (const Error& e) {
    error = e.what();
  }
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &saved), 0);
  ::signal(SIGXFSZ, previous_handler);
  EXPECT_NE(error.find("failed after 4096 of 1048576 bytes"), std::string::npos) << "error: '" << error << "'";
  EXPECT_EQ(slurp(target), "old contents");
  EXPECT_EQ(std::distance(fs::directory_iterator(s.dir), fs::directory_iterator{}), 1) << "a temporary was left";
}

}  // namespace
}  // namespace mxddp::testing
