#include "runtime/nvrtc_cached.h"

#include <stdexcept>

#include "runtime/compile_cache.h"
#include "runtime/cuda_api.h"
#include "runtime/hash.h"

namespace opfuse {
namespace {

CachedCubin build_cubin(const std::string& src, const char* file, int arch, const char* what) {
  NvrtcOutput o = nvrtc_compile(src, file, arch, false, false);
  if (o.cubin.empty()) throw std::runtime_error(std::string("NVRTC produced no cubin for the ") + what);
  CachedCubin out;
  out.cubin = std::move(o.cubin);
  out.log = std::move(o.log);
  while (!out.log.empty() && out.log.back() == '\0') out.log.pop_back();
  return out;
}

}  // namespace

CachedCubin nvrtc_cubin_cached(const std::string& src, const char* file, int arch, const std::string& subdir,
                               const char* what, bool use_cache) {
  if (!use_cache) return build_cubin(src, file, arch, what);
  const NvrtcApi& n = nvrtc();
  if (!n.loaded) throw std::runtime_error("NVRTC not available: " + n.error);
  std::string opts;
  for (auto& o : nvrtc_options(arch, false)) opts += o + " ";
  const std::string key = content_hash(src + "\n" + opts + "\nnvrtc " + std::to_string(n.major) + "." + std::to_string(n.minor));
  CachedCubin fresh;
  bool built = false;
  auto build = [&](const std::string& out) {
    fresh = build_cubin(src, file, arch, what);
    built = true;
    write_file_atomic(out, fresh.cubin);
  };
  CacheLookup found = cache_get_or_build(subdir, key, ".cubin", build);
  if (built) return fresh;
  bool ok = false;
  CachedCubin hit;
  hit.cubin = read_file(found.path, &ok);
  if (ok && !hit.cubin.empty()) {
    hit.cache_hit = true;
    return hit;
  }
  cache_evict(found.path);  // unreadable: rebuilt in place
  cache_get_or_build(subdir, key, ".cubin", build);
  return fresh;
}

}  // namespace opfuse
