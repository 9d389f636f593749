// InputFile refuses every name that is not a regular file, without blocking on a FIFO, and reads
// exactly the size fstat reported.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <limits>
#include <fstream>

#include <mxddp/core.h>

#include <mxddp/input_file.h>

#include "core/error_of.h"

namespace mxddp {
namespace {

namespace fs = std::filesystem;

// A fresh directory per test, removed afterwards.
class InputFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / fmt::format("mxddp_input_file_{}_{}", ::getpid(),
                                                   ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const char* name) const { return (dir_ / name).string(); }

  fs::path dir_;
};

using mxddp::testing::error_of;

TEST_F(InputFileTest, ReadsARegularFileWhole) {
  std::ofstream(path("f"), std::ios::binary) << "hello";
  InputFile in(path("f"), "--data");
  EXPECT_EQ(in.size_bytes(), 5);
  const std::vector<char> bytes = in.read_all();
  EXPECT_EQ(std::string(bytes.begin(), bytes.end()), "hello");
}

// Opening a FIFO that has no writer would block a plain open() for ever; this must return at once
// with an error naming the flag, the path and what is valid.
TEST_F(InputFileTest, RefusesAFifoWithoutBlocking) {
  ASSERT_EQ(::mkfifo(path("fifo").c_str(), 0600), 0);
  const auto start = std::chrono::steady_clock::now();
  const std::string e = error_of([&] { InputFile(path("fifo"), "--input"); });
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_EQ(e, fmt::format("--input '{}' is a FIFO, not a regular file: give a regular file", path("fifo")));
}

TEST_F(InputFileTest, RefusesADirectory) {
  fs::create_directories(path("d"));
  EXPECT_EQ(error_of([&] { InputFile(path("d"), "checkpoint file"); }),
            fmt::format("checkpoint file '{}' is a directory, not a regular file: give a regular file", path("d")));
}

// /dev/zero never ends: reading it whole would run until memory is gone.
TEST_F(InputFileTest, RefusesADeviceThatNeverEnds) {
  EXPECT_EQ(error_of([&] { InputFile("/dev/zero", "--data"); }),
            "--data '/dev/zero' is a character device, not a regular file: give a regular file");
}

TEST_F(InputFileTest, NamesAMissingFileAndAnEmptyPath) {
  EXPECT_EQ(error_of([&] { InputFile(path("missing"), "--data"); }),
            fmt::format("--data '{}' cannot be opened: No such file or directory", path("missing")));
  EXPECT_EQ(error_of([] { InputFile("", "--data"); }), "--data is an empty path: give a regular file");
}

// A file that shrinks after open is an error naming it, not a short buffer.
TEST_F(InputFileTest, FileThatShrankAfterOpenIsAnError) {
  std::ofstream(path("f"), std::ios::binary) << "0123456789";
  InputFile in(path("f"), "--input");
  ASSERT_EQ(::truncate(path("f").c_str(), 4), 0);
  const std::string e = error_of([&] { in.read_all(); });
  EXPECT_NE(e.find("ended after 4 of 10 bytes"), std::string::npos) << e;
}

}  // namespace
}  // namespace mxddp
