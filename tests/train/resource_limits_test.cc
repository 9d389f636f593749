// Resource limits a run is refused by or reports (issue 40 items 10, 11, 13): the cgroup memory
// limit found from the process's own cgroup (v1 and v2, nested, walked up to the root) in a fake
// cgroup tree; the out-of-memory error naming the request; a write past the file-size limit
// naming the limit.
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include <mxddp/memory.h>
#include <mxddp/output_file.h>

#include "plan/memory_floor.h"

// Sanitizer builds: a failed allocation is an error to return (the tests below make some on
// purpose), not a report that ends the process.
extern "C" const char* __asan_default_options() { return "allocator_may_return_null=1"; }

namespace mxddp::testing {
namespace {

namespace fs = std::filesystem;

constexpr double kMiB = 1024.0 * 1024.0;

// A fake cgroup file system under a temporary directory, removed at the end.
struct FakeCgroups {
  fs::path root = fs::temp_directory_path() / ("mxddp_cgroups_" + std::to_string(::getpid()));
  FakeCgroups() {
    fs::remove_all(root);
    fs::create_directories(root);
  }
  ~FakeCgroups() { fs::remove_all(root); }
  // Writes text to root/relative, making its directories.
  void write(const std::string& relative, const std::string& text) const {
    fs::create_directories((root / relative).parent_path());
    std::ofstream(root / relative) << text;
  }
  // A mountinfo line mounting `hierarchy_root` of a cgroup2 (or v1 memory) hierarchy at
  // root/mount_dir, with the optional fields real lines carry.
  std::string mount_line(const std::string& mount_dir, bool v2, const std::string& hierarchy_root = "/") const {
    const std::string at = (root / mount_dir).string();
    return v2 ? "41 31 0:38 " + hierarchy_root + " " + at + " rw,relatime shared:9 - cgroup2 cgroup2 rw\n"
              : "35 31 0:32 " + hierarchy_root + " " + at + " rw,relatime shared:5 - cgroup cgroup rw,memory\n";
  }
};

const std::string kOtherMounts =
    "23 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n"
    "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n";

TEST(CgroupMembership, ReadsTheV2LineAndV1MemoryLines) {
  const auto groups = memory_cgroups_of(
      "9:name=systemd:/\n8:pids:/x\n5:cpu,memory:/slurm/uid_0/job_7\n4:memory:/a/b\n0::/user.slice/x.scope\n"
      "garbage\n3:cpuset\n2:memory:relative\n");
  ASSERT_EQ(groups.size(), 3u);
  EXPECT_FALSE(groups[0].v2);
  EXPECT_EQ(groups[0].path, "/slurm/uid_0/job_7");
  EXPECT_EQ(groups[1].path, "/a/b");
  EXPECT_TRUE(groups[2].v2);
  EXPECT_EQ(groups[2].path, "/user.slice/x.scope");
}

TEST(CgroupMounts, FindsCgroup2AndV1MemoryMountsOnly) {
  const auto mounts = memory_cgroup_mounts(kOtherMounts +
                                           "35 31 0:32 /docker/abc /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
                                           "41 31 0:38 / /mnt/with\\040space rw shared:1 master:2 - cgroup2 cgroup2 rw\n"
                                           "short line - cgroup2\n");
  ASSERT_EQ(mounts.size(), 2u);
  EXPECT_FALSE(mounts[0].v2);
  EXPECT_EQ(mounts[0].root, "/docker/abc");
  EXPECT_EQ(mounts[0].mount_point, "/sys/fs/cgroup/memory");
  EXPECT_TRUE(mounts[1].v2);
  EXPECT_EQ(mounts[1].mount_point, "/mnt/with space");
}

// systemd-run, Slurm and Kubernetes put the limit on the process's own cgroup or a parent of it,
// never at the root: the walk from the process's cgroup up finds the tightest, and names its file.
TEST(CgroupMemoryLimit, V2NestedTakesTheTightestLevelAndNamesItsFile) {
  FakeCgroups fake;
  fake.write("cg/memory.max", "max\n");  // the root has no limit
  fake.write("cg/user.slice/memory.max", "4294967296\n");
  fake.write("cg/user.slice/memory.current", "1073741824\n");
  fake.write("cg/user.slice/x.scope/memory.max", "1073741824\n");
  fake.write("cg/user.slice/x.scope/memory.current", "314572800\n");
  fake.write("cg/user.slice/x.scope/memory.stat", "anon 100\ninactive_file 104857600\nactive_file 5\n");
  fake.write("cg/user.slice/x.scope/run/memory.max", "max\n");
  const MemoryLimit limit = cgroup_memory_limit("0::/user.slice/x.scope/run\n", kOtherMounts + fake.mount_line("cg", true));
  // 1 GiB less 300 MiB in use, of which 100 MiB is page cache the kernel can reclaim.
  EXPECT_DOUBLE_EQ(limit.available_bytes, 1024 * kMiB - 200 * kMiB);
  EXPECT_NE(limit.source.find("'" + (fake.root / "cg/user.slice/x.scope/memory.max").string() + "'"), std::string::npos)
      << limit.source;
  EXPECT_NE(limit.source.find("1 GiB, of which 200 MiB is in use"), std::string::npos) << limit.source;
}

TEST(CgroupMemoryLimit, AParentsLimitBindsAChild) {
  FakeCgroups fake;
  fake.write("cg/job/memory.max", "536870912");
  fake.write("cg/job/memory.current", "0");
  fake.write("cg/job/step/memory.max", "max");
  const MemoryLimit limit = cgroup_memory_limit("0::/job/step\n", fake.mount_line("cg", true));
  EXPECT_DOUBLE_EQ(limit.available_bytes, 512 * kMiB);
  EXPECT_NE(limit.source.find("cg/job/memory.max"), std::string::npos) << limit.source;
}

// v1: memory.limit_in_bytes, where "no limit" is a number near 2^63.
TEST(CgroupMemoryLimit, V1ReadsLimitInBytesAndTreatsTheHugeValueAsUnlimited) {
  FakeCgroups fake;
  fake.write("memory/memory.limit_in_bytes", "9223372036854771712\n");
  fake.write("memory/slurm/memory.limit_in_bytes", "2147483648\n");
  fake.write("memory/slurm/memory.usage_in_bytes", "1073741824\n");
  fake.write("memory/slurm/memory.stat", "cache 5\ninactive_file 9999\ntotal_inactive_file 536870912\n");
  fake.write("memory/slurm/job/memory.limit_in_bytes", "9223372036854771712\n");
  fake.write("memory/slurm/job/memory.usage_in_bytes", "1000\n");
  const MemoryLimit limit = cgroup_memory_limit("4:memory:/slurm/job\n0::/\n", fake.mount_line("memory", false));
  EXPECT_DOUBLE_EQ(limit.available_bytes, 2048 * kMiB - 512 * kMiB);
  EXPECT_NE(limit.source.find("memory/slurm/memory.limit_in_bytes"), std::string::npos) << limit.source;
}

// A container's view without a cgroup namespace: /proc/self/cgroup names the full path, the
// mount shows the hierarchy from the container's own cgroup.
TEST(CgroupMemoryLimit, MapsThePathUnderTheMountsRoot) {
  FakeCgroups fake;
  fake.write("memory/memory.limit_in_bytes", "268435456");
  fake.write("memory/memory.usage_in_bytes", "0");
  EXPECT_DOUBLE_EQ(
      cgroup_memory_limit("4:memory:/docker/abc\n", fake.mount_line("memory", false, "/docker/abc")).available_bytes,
      256 * kMiB);
  // A cgroup outside what is mounted (another namespace's view) is not guessed at.
  EXPECT_LT(cgroup_memory_limit("4:memory:/elsewhere\n", fake.mount_line("memory", false, "/docker/abc")).available_bytes,
            0);
}

TEST(CgroupMemoryLimit, NoLimitMissingFilesAndGarbageSetNone) {
  FakeCgroups fake;
  fake.write("cg/a/memory.max", "max\n");
  fake.write("cg/a/b/memory.max", "12abc\n");
  fake.write("cg/a/b/c/memory.max", "-5\n");
  fake.write("cg/a/b/c/d/memory.max", "");
  fake.write("cg/a/b/c/d/e/memory.max", "99999999999999999999999999\n");
  // f has no files at all.
  fs::create_directories(fake.root / "cg/a/b/c/d/e/f");
  const std::string mounts = fake.mount_line("cg", true);
  EXPECT_LT(cgroup_memory_limit("0::/a/b/c/d/e/f\n", mounts).available_bytes, 0);
  EXPECT_LT(cgroup_memory_limit("0::/not/there\n", mounts).available_bytes, 0);
  EXPECT_LT(cgroup_memory_limit("", mounts).available_bytes, 0);
  EXPECT_LT(cgroup_memory_limit("0::/a\n", kOtherMounts).available_bytes, 0) << "no cgroup2 mount";
  // A v1 membership is not looked up in a v2 mount.
  EXPECT_LT(cgroup_memory_limit("4:memory:/a\n", mounts).available_bytes, 0);
}

// Usage above the limit (a cgroup that has just been lowered) leaves nothing, not a negative.
TEST(CgroupMemoryLimit, UsageAboveTheLimitLeavesZero) {
  FakeCgroups fake;
  fake.write("cg/memory.max", "1048576");
  fake.write("cg/memory.current", "5242880");
  const MemoryLimit limit = cgroup_memory_limit("0::/\n", fake.mount_line("cg", true));
  EXPECT_DOUBLE_EQ(limit.available_bytes, 0);
}

TEST(AvailableMemory, NamesItsSource) {
  const MemoryLimit limit = available_memory();
  ASSERT_GT(limit.available_bytes, 0) << "/proc/meminfo has MemAvailable on Linux";
  EXPECT_FALSE(limit.source.empty());
}

TEST(OutOfMemory, NamesTheRequest) {
  EXPECT_STREQ(OutOfMemory(1073741824, "params").what(), "out of memory: could not allocate 1073741824 bytes for params");
  EXPECT_STREQ(OutOfMemory(12).what(), "out of memory: could not allocate 12 bytes");
  const std::bad_alloc& as_bad_alloc = OutOfMemory(7, "grads");
  EXPECT_NE(std::string(as_bad_alloc.what()).find("7 bytes for grads"), std::string::npos);
}

// A HostBuffer that cannot be allocated throws a std::bad_alloc that names its bytes and category.
TEST(OutOfMemory, AHostBufferThatCannotBeAllocatedNamesItsBytesAndCategory) {
  MemoryTracker tracker;
  const size_t bytes = size_t{1} << 60;  // an exbibyte: no machine maps it
  try {
    HostBuffer buffer(bytes, MemoryCategory::kOptimizerState, tracker);
    FAIL() << "an exbibyte was allocated";
  } catch (const std::bad_alloc& e) {
    EXPECT_EQ(std::string(e.what()),
              "out of memory: could not allocate " + std::to_string(bytes) + " bytes for optimizer_state");
  }
  EXPECT_EQ(tracker.usage().total_live_bytes, 0) << "nothing charged for a failed allocation";
}

// A write past the file-size limit fails with EFBIG (SIGXFSZ ignored), and the error names the limit.
TEST(WriteErrorText, NamesTheFileSizeLimit) {
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  rlimit small = saved;
  small.rlim_cur = 4096;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  const std::string text = write_error_text(EFBIG);
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &saved), 0);
  EXPECT_EQ(text, std::string(std::strerror(EFBIG)) + ": past the file size limit (ulimit -f) of 4096 bytes");
  EXPECT_EQ(write_error_text(ENOSPC), std::strerror(ENOSPC));
}

TEST(WriteOutputFile, AFailedWriteLeavesNeitherTemporaryNorTheDirectoriesItMade) {
  FakeCgroups scratch;  // (only for its temporary directory)
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  const auto previous_handler = ::signal(SIGXFSZ, SIG_IGN);
  rlimit small = saved;
  small.rlim_cur = 4096;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  std::string error;
  try {
    write_output_file((scratch.root / "new/sub/out.bin").string(), std::string(1 << 20, 'x'), "--out");
  } catch (const Error& e) {
    error = e.what();
  }
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &saved), 0);
  ::signal(SIGXFSZ, previous_handler);
  EXPECT_NE(error.find("new/sub/.out.bin.partial' failed: "), std::string::npos) << error;
  EXPECT_NE(error.find("past the file size limit (ulimit -f) of 4096 bytes"), std::string::npos) << error;
  EXPECT_FALSE(fs::exists(scratch.root / "new")) << "the directories made for the file were left";
}

}  // namespace
}  // namespace mxddp::testing
