// The on-disk cache of compiled kernels (OPFUSE_CACHE_DIR, default
// ~/.cache/opfuse). An entry is named by the hash of (source, flags,
// compiler identity); it is written to a private temporary file and renamed
// into place, so concurrent writers never expose a partial file, and a
// sidecar checksum written the same way detects corrupted entries, which
// are rebuilt rather than loaded.
#pragma once
#include <functional>
#include <string>

namespace opfuse {

std::string cache_dir();

struct CacheLookup {
  std::string path;  // the cached artifact
  bool hit = false;
};

// Returns the path of the artifact for `key`, calling build(tmp_path) to
// produce it on a miss (build writes the file or throws).
CacheLookup cache_get_or_build(const std::string& subdir, const std::string& key, const std::string& suffix,
                               const std::function<void(const std::string&)>& build);

// Drops an entry (after it failed to load).
void cache_evict(const std::string& path);

std::string read_file(const std::string& path, bool* ok);
void write_file_atomic(const std::string& path, const std::string& data);

}  // namespace opfuse
