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

// pread at an offset: the bytes there, fewer only where the file ends (a dataset that shrank under
// the run gives a short read, not the SIGBUS a memory map would).
TEST_F(InputFileTest, ReadAtStopsShortWhereTheFileEnds) {
  std::ofstream(path("f"), std::ios::binary) << "0123456789";
  const InputFile in(path("f"), "--data-path data");
  char buf[4] = {};
  ASSERT_EQ(in.read_at(3, buf, 4), 4u);
  EXPECT_EQ(std::string(buf, 4), "3456");
  ASSERT_EQ(::truncate(path("f").c_str(), 5), 0);
  ASSERT_EQ(in.read_at(3, buf, 4), 2u);
  EXPECT_EQ(std::string(buf, 2), "34");
  EXPECT_EQ(in.read_at(9, buf, 4), 0u);
}

// A file kept open through a run: a rewrite of the same size is seen by its modification time, a
// truncation by its size. (The time is set back first: the file system's clock is coarse, and the
// test's rewrite could otherwise fall in the tick of the first write.)
TEST_F(InputFileTest, ChangeSinceOpenSeesARewriteAndATruncation) {
  std::ofstream(path("f"), std::ios::binary) << "0123456789";
  fs::last_write_time(path("f"), fs::last_write_time(path("f")) - std::chrono::hours(1));
  const InputFile in(path("f"), "--data-path data");
  EXPECT_EQ(in.change_since_open(), "");
  std::fstream(path("f"), std::ios::in | std::ios::out | std::ios::binary) << "abc";
  EXPECT_EQ(in.change_since_open(), "it was modified after it was opened (same size, 10 bytes)");
  ASSERT_EQ(::truncate(path("f").c_str(), 4), 0);
  EXPECT_EQ(in.change_since_open(), "it had 10 bytes when it was opened and has 4 now");
}

}  // namespace
}  // namespace mxddp
