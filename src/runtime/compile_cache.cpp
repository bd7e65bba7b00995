#include "runtime/compile_cache.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>
#include <stdexcept>

#include "runtime/hash.h"

namespace opfuse {
namespace {

void make_dirs(const std::string& path) {
  std::string cur;
  std::stringstream ss(path);
  std::string part;
  if (!path.empty() && path[0] == '/') cur = "/";
  while (std::getline(ss, part, '/')) {
    if (part.empty()) continue;
    cur += part + "/";
    ::mkdir(cur.c_str(), 0755);
  }
}

std::string unique_suffix() {
  static thread_local std::mt19937_64 rng{std::random_device{}() ^ static_cast<uint64_t>(::getpid())};
  return ".tmp." + std::to_string(::getpid()) + "." + std::to_string(rng());
}

}  // namespace

std::string cache_dir() {
  if (const char* d = std::getenv("OPFUSE_CACHE_DIR"); d && *d) return d;
  const char* home = std::getenv("HOME");
  return std::string(home && *home ? home : "/tmp") + "/.cache/opfuse";
}

std::string read_file(const std::string& path, bool* ok) {
  std::ifstream f(path, std::ios::binary);
  if (!f) { *ok = false; return {}; }
  std::stringstream ss;
  ss << f.rdbuf();
  *ok = static_cast<bool>(f) || f.eof();
  return ss.str();
}

void write_file_atomic(const std::string& path, const std::string& data) {
  std::string tmp = path + unique_suffix();
  {
    std::ofstream f(tmp, std::ios::binary);
    f.write(data.data(), static_cast<std::streamsize>(data.size()));
    if (!f) { std::remove(tmp.c_str()); throw std::runtime_error("cannot write " + tmp); }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw std::runtime_error("cannot rename into " + path);
  }
}

void cache_evict(const std::string& path) {
  std::remove(path.c_str());
  std::remove((path + ".sum").c_str());
}

CacheLookup cache_get_or_build(const std::string& subdir, const std::string& key, const std::string& suffix,
                               const std::function<void(const std::string&)>& build) {
  std::string dir = cache_dir() + "/" + subdir;
  make_dirs(dir);
  std::string path = dir + "/" + key + suffix;
  bool ok1 = false, ok2 = false;
  std::string bytes = read_file(path, &ok1);
  std::string sum = read_file(path + ".sum", &ok2);
  if (ok1 && ok2 && !bytes.empty() && sum == content_hash(bytes)) return {path, true};
  // Miss or corrupted: build privately, then publish the artifact and its checksum.
  std::string tmp = path + unique_suffix();
  try {
    build(tmp);
  } catch (...) {
    std::remove(tmp.c_str());
    throw;
  }
  bool ok = false;
  std::string built = read_file(tmp, &ok);
  if (!ok || built.empty()) {
    std::remove(tmp.c_str());
    throw std::runtime_error("the compiler produced no output for " + path);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw std::runtime_error("cannot rename into " + path);
  }
  write_file_atomic(path + ".sum", content_hash(built));
  return {path, false};
}

}  // namespace opfuse
