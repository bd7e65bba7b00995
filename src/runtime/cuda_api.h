// libcuda and libnvrtc loaded at run time with dlopen: no link-time CUDA
// dependency, so import and CPU use work on machines without CUDA. The
// copies a process already loaded (PyTorch's) are preferred; then the
// directories in OPFUSE_CUDA_LIB_DIRS (':'-separated, set by the Python
// package to PyTorch's pip-wheel library folders); then the system's.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace opfuse {

using CUresult = int;
using CUdevice = int;
using CUcontext = void*;
using CUmodule = void*;
using CUfunction = void*;
using CUstream = void*;
using CUevent = void*;
using nvrtcResult = int;
using nvrtcProgram = void*;

struct NvrtcApi {
  bool loaded = false;
  std::string path, error;
  nvrtcResult (*Version)(int*, int*) = nullptr;
  const char* (*GetErrorString)(nvrtcResult) = nullptr;
  nvrtcResult (*CreateProgram)(nvrtcProgram*, const char*, const char*, int, const char* const*, const char* const*) = nullptr;
  nvrtcResult (*DestroyProgram)(nvrtcProgram*) = nullptr;
  nvrtcResult (*CompileProgram)(nvrtcProgram, int, const char* const*) = nullptr;
  nvrtcResult (*GetProgramLogSize)(nvrtcProgram, size_t*) = nullptr;
  nvrtcResult (*GetProgramLog)(nvrtcProgram, char*) = nullptr;
  nvrtcResult (*GetCUBINSize)(nvrtcProgram, size_t*) = nullptr;
  nvrtcResult (*GetCUBIN)(nvrtcProgram, char*) = nullptr;
  nvrtcResult (*GetPTXSize)(nvrtcProgram, size_t*) = nullptr;
  nvrtcResult (*GetPTX)(nvrtcProgram, char*) = nullptr;
  int major = 0, minor = 0;
};

struct CudaApi {
  bool loaded = false;
  std::string path, error;
  CUresult (*Init)(unsigned) = nullptr;
  CUresult (*GetErrorString)(CUresult, const char**) = nullptr;
  CUresult (*CtxGetCurrent)(CUcontext*) = nullptr;
  CUresult (*CtxGetDevice)(CUdevice*) = nullptr;
  CUresult (*CtxSetCurrent)(CUcontext) = nullptr;
  CUresult (*DeviceGet)(CUdevice*, int) = nullptr;
  CUresult (*DevicePrimaryCtxRetain)(CUcontext*, CUdevice) = nullptr;
  // Events and capture status: timing cuBLASLt's candidate algorithms once.
  CUresult (*EventCreate)(CUevent*, unsigned) = nullptr;
  CUresult (*EventRecord)(CUevent, CUstream) = nullptr;
  CUresult (*EventSynchronize)(CUevent) = nullptr;
  CUresult (*EventElapsedTime)(float*, CUevent, CUevent) = nullptr;
  CUresult (*EventDestroy)(CUevent) = nullptr;
  CUresult (*StreamIsCapturing)(CUstream, int*) = nullptr;
  CUresult (*DeviceGetAttribute)(int*, int, CUdevice) = nullptr;
  CUresult (*ModuleLoadData)(CUmodule*, const void*) = nullptr;
  CUresult (*ModuleGetFunction)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*FuncSetAttribute)(CUfunction, int, int) = nullptr;
  CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                           void**, void**) = nullptr;
  // Optional: a launch whose CTAs are all resident at once or not started
  // (the decode MLP kernel's grid barrier).
  CUresult (*LaunchCooperativeKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                      CUstream, void**) = nullptr;
  // Optional (CUDA 12+; null on older drivers): TMA tensor maps for the
  // Hopper attention kernel. Arguments as cuTensorMapEncodeTiled's, with the
  // enums as int and the CUtensorMap as 128 bytes at `tensor_map`.
  CUresult (*TensorMapEncodeTiled)(void* tensor_map, int dtype, uint32_t rank, void* global_address,
                                   const uint64_t* global_dim, const uint64_t* global_strides, const uint32_t* box_dim,
                                   const uint32_t* element_strides, int interleave, int swizzle, int l2_promotion,
                                   int oob_fill) = nullptr;
  // Optional: the decode MLP kernel's persistent workspace (counters that
  // must start at zero) and its co-residency check.
  CUresult (*MemAlloc)(unsigned long long* dptr, size_t bytes) = nullptr;
  CUresult (*MemsetD32Async)(unsigned long long dptr, unsigned value, size_t count, CUstream) = nullptr;
  CUresult (*OccupancyMaxActiveBlocksPerMultiprocessor)(int* blocks, CUfunction, int block_size, size_t dynamic_smem) = nullptr;
  // Optional (CUDA 12+): clusters of a kernel resident at once (the staged
  // ring's grid); `config` as CuLaunchConfig below.
  CUresult (*OccupancyMaxActiveClusters)(int* clusters, CUfunction, const void* config) = nullptr;
  // Optional (CUDA 12+): a launch with attributes (`config` as CuLaunchConfig
  // below): the skinny GEMM's programmatic dependent launch.
  CUresult (*LaunchKernelEx)(const void* config, CUfunction, void** params, void** extra) = nullptr;
};

// cuda.h's CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value union.
struct CuLaunchAttribute {
  int id = 0;
  char pad[4] = {};
  union {
    char bytes[64];
    int value;  // e.g. programmaticStreamSerializationAllowed
  } val = {};
};
static_assert(sizeof(CuLaunchAttribute) == 72, "CUlaunchAttribute's layout");
// CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION: the grid may start
// before the previous kernel of its stream ends, once every CTA of that
// kernel has exited or run griddepcontrol.launch_dependents; it must then
// run griddepcontrol.wait before it reads what that kernel wrote.
inline constexpr int kLaunchAttrProgrammaticSerialization = 6;

// cuda.h's CUlaunchConfig (CUDA 12+), for OccupancyMaxActiveClusters (the
// kernel's own __cluster_dims__ stand, so no attributes are passed) and
// LaunchKernelEx (attrs: CuLaunchAttribute[num_attrs]).
struct CuLaunchConfig {
  unsigned grid_x = 1, grid_y = 1, grid_z = 1;
  unsigned block_x = 1, block_y = 1, block_z = 1;
  unsigned shared_bytes = 0;
  CUstream stream = nullptr;
  void* attrs = nullptr;
  unsigned num_attrs = 0;
};

// cuLaunchKernel of a 1-D grid, or with `programmatic` (the kernel runs
// griddepcontrol.wait before it reads anything) cuLaunchKernelEx with the
// programmatic serialization attribute, where the driver has it. Throws
// with `what` on failure.
void launch_1d(CUfunction f, unsigned grid, unsigned block, unsigned shared_bytes, CUstream stream, void** params,
               bool programmatic, const char* what);

// How many row groups of a persistent kernel the current context's device
// holds at once: clusters of `cluster` blocks (cluster > 1, when the driver
// can say) or blocks; at least 1.
int resident_groups(CUfunction f, int threads, int dynamic_smem, int cluster);

const NvrtcApi& nvrtc();  // loads on first use; .loaded false with .error when absent
const CudaApi& cuda();

// Throws std::runtime_error naming the call when r != 0.
void check_cuda(CUresult r, const char* what);

// Compute capability of the current context's device, e.g. 90; throws
// when there is no CUDA context.
int current_device_arch();

// Makes device's primary context (the one PyTorch uses) current on this
// thread if no context is. Threads PyTorch starts, such as autograd's
// backward workers, may have none: PyTorch skips cudaSetDevice when the
// device index already matches.
void ensure_cuda_context(int device);

struct NvrtcOutput {
  std::string cubin, ptx, log;
};
// The options nvrtc_compile passes (part of every compiled kernel's cache key).
std::vector<std::string> nvrtc_options(int arch, bool arch_specific);
// Compiles for sm_<arch> (arch 90 with `arch_specific` gives sm_90a);
// throws with NVRTC's log on failure.
NvrtcOutput nvrtc_compile(const std::string& source, const std::string& name, int arch, bool arch_specific = false,
                          bool want_ptx = false);

}  // namespace opfuse
