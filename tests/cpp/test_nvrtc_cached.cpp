// nvrtc_cubin_cached, which the skinny GEMM and decode MLP launchers compile
// through: a miss builds and stores, the same program again is a hit with
// the same cubin, and an entry that cannot be read back is rebuilt.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include <unistd.h>

#include "runtime/cuda_api.h"
#include "runtime/nvrtc_cached.h"

namespace opfuse {
namespace {

const char* kSource = R"(extern "C" __global__ void opfuse_cached_probe(float* p) { p[threadIdx.x] += 1.0f; })";

TEST(NvrtcCached, MissThenHitThenRebuildOfADamagedEntry) {
  if (!nvrtc().loaded) GTEST_SKIP() << "NVRTC not available: " << nvrtc().error;
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("opfuse-nvrtc-cached-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  ASSERT_EQ(setenv("OPFUSE_CACHE_DIR", dir.c_str(), 1), 0);

  CachedCubin first = nvrtc_cubin_cached(kSource, "probe.cu", 80, "probe", "probe", true);
  EXPECT_FALSE(first.cache_hit);
  EXPECT_FALSE(first.cubin.empty());
  CachedCubin second = nvrtc_cubin_cached(kSource, "probe.cu", 80, "probe", "probe", true);
  EXPECT_TRUE(second.cache_hit);
  EXPECT_EQ(second.cubin, first.cubin);

  // Damage every entry: the next call must not hand back the damaged bytes.
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) fs::resize_file(e.path(), 0);
  CachedCubin third = nvrtc_cubin_cached(kSource, "probe.cu", 80, "probe", "probe", true);
  EXPECT_EQ(third.cubin, first.cubin);

  CachedCubin uncached = nvrtc_cubin_cached(kSource, "probe.cu", 80, "probe", "probe", false);
  EXPECT_FALSE(uncached.cache_hit);
  EXPECT_EQ(uncached.cubin, first.cubin);
  unsetenv("OPFUSE_CACHE_DIR");
  fs::remove_all(dir);
}

}  // namespace
}  // namespace opfuse
