// release_free_heap_pages: free blocks in the middle of the heap stay resident until it runs, and
// leave the RSS when it does (what the Python optimizer's step relies on; mxddp/memory.h).
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <vector>

#include <gtest/gtest.h>

#include <mxddp/memory.h>

namespace mxddp {
namespace {

#if defined(__has_feature)
#define MXDDP_TEST_HAS_FEATURE(x) __has_feature(x)
#else
#define MXDDP_TEST_HAS_FEATURE(x) 0
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__) || MXDDP_TEST_HAS_FEATURE(address_sanitizer) || \
    MXDDP_TEST_HAS_FEATURE(thread_sanitizer)
constexpr bool kSanitizedMalloc = true;  // the sanitizer's allocator serves malloc, not glibc's heap
#else
constexpr bool kSanitizedMalloc = false;
#endif

double resident_mib() {
  double size_pages = 0, resident_pages = 0;
  std::ifstream("/proc/self/statm") >> size_pages >> resident_pages;
  return resident_pages * static_cast<double>(::sysconf(_SC_PAGESIZE)) / (1 << 20);
}

TEST(ReleaseFreeHeapPages, ReturnsTheHolesBetweenLiveBlocks) {
#if !defined(__GLIBC__)
  GTEST_SKIP() << "only glibc's heap keeps freed pages resident (malloc_trim)";
#endif
  if (kSanitizedMalloc) GTEST_SKIP() << "a sanitizer's allocator serves malloc here, not glibc's heap";
  // 512 blocks of 64 KiB (below glibc's mmap threshold, so in the heap), every page written; the
  // odd ones freed leave 256 holes of 64 KiB between live blocks, which free() cannot trim.
  constexpr size_t kBlockBytes = 64 << 10;
  std::vector<char*> blocks(512);
  for (char*& b : blocks) {
    b = static_cast<char*>(std::malloc(kBlockBytes));
    ASSERT_NE(b, nullptr);
    std::memset(b, 1, kBlockBytes);
  }
  for (size_t i = 1; i < blocks.size(); i += 2) std::free(blocks[i]);
  const double before_mib = resident_mib();
  EXPECT_TRUE(release_free_heap_pages());
  const double after_mib = resident_mib();
  // 16 MiB of holes, each keeping a page or so for its chunk header: at least 12 MiB must go.
  EXPECT_GE(before_mib - after_mib, 12.0) << "RSS " << before_mib << " MiB before, " << after_mib << " after";
  // The live blocks kept their contents.
  for (size_t i = 0; i < blocks.size(); i += 2) {
    EXPECT_EQ(blocks[i][0], 1);
    EXPECT_EQ(blocks[i][kBlockBytes - 1], 1);
    std::free(blocks[i]);
  }
}

}  // namespace
}  // namespace mxddp
