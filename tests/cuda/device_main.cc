// main() of the tests that need a CUDA device: exits 77 (CTest's skip) saying why when none is
// usable here, else runs every test.
#include <cstdio>
#include <string>

#include <gtest/gtest.h>

#include <mxddp/cuda.h>

int main(int argc, char** argv) {
  std::string why;
  if (mxddp::cuda_device_count(&why) == 0) {
    std::printf("SKIP: %s\n", why.c_str());
    return 77;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
