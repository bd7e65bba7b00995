// One NVRTC program compiled to a cubin through the disk cache
// (compile_cache.h): the kernels opfuse ships whole (skinny GEMM, decode
// MLP), keyed by their source, NVRTC's options and NVRTC's version.
#pragma once
#include <string>

namespace opfuse {

struct CachedCubin {
  std::string cubin;
  std::string log;  // NVRTC / ptxas -v (empty on a cache hit)
  bool cache_hit = false;
};

// Compiles `src` (named `file` in NVRTC's messages) for sm_<arch>; with
// use_cache, through the cache folder `subdir` (an entry that cannot be read
// back is evicted and rebuilt). `what` names the kernel in the error thrown
// when NVRTC gives no cubin; NVRTC's own failures throw with its log.
CachedCubin nvrtc_cubin_cached(const std::string& src, const char* file, int arch, const std::string& subdir,
                               const char* what, bool use_cache);

}  // namespace opfuse
