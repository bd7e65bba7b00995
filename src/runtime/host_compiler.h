// Compiling generated C++ into a shared object with the host compiler
// (OPFUSE_CXX, else c++), and loading it.
#pragma once
#include <string>
#include <vector>

namespace opfuse {

struct HostCompiler {
  std::string command;             // the compiler to run
  std::vector<std::string> flags;  // -O3 -march=native -fopenmp ...
  std::string identity;            // version and target, part of cache keys
};

const HostCompiler& host_compiler();

// Compiles `source` to the shared object `out_path`; throws with the
// compiler's messages on failure.
void compile_shared_object(const std::string& source, const std::string& out_path);

struct LoadedLibrary {
  void* handle = nullptr;
  void* symbol(const std::string& name) const;  // throws if missing
};
LoadedLibrary load_library(const std::string& path);  // throws with dlerror()

}  // namespace opfuse
