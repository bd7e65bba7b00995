// NVRTC programs compiled for named template instantiations (the
// hand-written kernels in src/kernels/: attention forward, its Hopper
// variant, the backward), and the CUDA context their launchers run in.
#pragma once
#include <string>
#include <vector>

#include "runtime/cuda_api.h"

namespace opfuse {

struct NvrtcNamed {
  std::vector<std::string> lowered;  // mangled entry point per name expression, in order
  std::string cubin;
  std::string log;                   // NVRTC/ptxas log
};

// The options: -std=c++17, ptxas -v and -lineinfo for `gpu_arch` (the
// options the kernels were measured with; also part of their cache keys).
std::vector<std::string> nvrtc_named_options(const std::string& gpu_arch);

// Compiles `source` (named `file` in messages) with the name expressions
// (e.g. "ns::kernel<bf16, 128>") for `gpu_arch` ("sm_90", "sm_90a") with
// nvrtc_named_options. `what` names the program in errors. Throws std::runtime_error with
// NVRTC's log when compilation fails.
NvrtcNamed nvrtc_compile_named(const char* source, const char* file, const std::vector<std::string>& expressions,
                               const std::string& gpu_arch, const std::string& what);

// A compiled program in the disk cache: `magic` (a line naming the kind of
// entry), one lowered name a line, then the cubin. unpack_named_cubin is
// false for anything else (another kind, a truncated or damaged file), so
// the caller rebuilds.
std::string pack_named_cubin(const char* magic, const std::vector<std::string>& lowered, const std::string& cubin);
bool unpack_named_cubin(const std::string& bytes, const char* magic, size_t names, std::vector<std::string>* lowered,
                        std::string* cubin);

// The current context, after binding `device`'s primary context when the
// thread has none or one of another device (autograd's backward threads may
// have none); device < 0: whatever is current.
CUcontext current_context_for(int device);

// What a hand-written kernel's launcher needs first: the driver loaded, the
// context of `device` current (current_context_for), and its CUdevice.
// Throws a clear error when either is missing.
CUcontext launcher_context(int device, CUdevice* dev);

}  // namespace opfuse
