// Loading the CUDA libraries at run time (dlopen): the copy a process already
// holds (PyTorch's) first, then OPFUSE_CUDA_LIB_DIRS, then the loader's path.
#pragma once
#include <dlfcn.h>

#include <string>
#include <vector>

namespace opfuse {

// The first of `names` found that way; nullptr with *error set otherwise.
void* open_library(const std::vector<std::string>& names, std::string* path, std::string* error);

// Binds fn to symbol `name` of h; records the first missing symbol in *error.
template <class F>
bool bind(void* h, F*& fn, const char* name, std::string* error) {
  fn = reinterpret_cast<F*>(dlsym(h, name));
  if (!fn && error->empty()) *error = std::string("missing symbol ") + name;
  return fn != nullptr;
}

}  // namespace opfuse
