#include "runtime/cuda_api.h"
#include "runtime/dynamic_library.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <vector>

namespace opfuse {
namespace {

std::vector<std::string> search_dirs() {
  std::vector<std::string> dirs;
  if (const char* env = std::getenv("OPFUSE_CUDA_LIB_DIRS")) {
    std::stringstream ss(env);
    std::string d;
    while (std::getline(ss, d, ':'))
      if (!d.empty()) dirs.push_back(d);
  }
  return dirs;
}

}  // namespace

// The first of `names` already in the process, else in the search dirs,
// else wherever the dynamic loader finds it.
void* open_library(const std::vector<std::string>& names, std::string* path, std::string* error) {
  for (auto& n : names)
    if (void* h = dlopen(n.c_str(), RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD)) { *path = n + " (already loaded)"; return h; }
  for (auto& d : search_dirs())
    for (auto& n : names) {
      std::string p = d + "/" + n;
      if (void* h = dlopen(p.c_str(), RTLD_NOW | RTLD_GLOBAL)) { *path = p; return h; }
    }
  for (auto& n : names)
    if (void* h = dlopen(n.c_str(), RTLD_NOW | RTLD_GLOBAL)) { *path = n; return h; }
  const char* e = dlerror();
  *error = "cannot load " + names.front() + (e ? std::string(": ") + e : "");
  return nullptr;
}


const NvrtcApi& nvrtc() {
  static NvrtcApi api;
  static std::once_flag once;
  std::call_once(once, [] {
    void* h = open_library({"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"}, &api.path, &api.error);
    if (!h) return;
    bool ok = bind(h, api.Version, "nvrtcVersion", &api.error) & bind(h, api.GetErrorString, "nvrtcGetErrorString", &api.error) &
              bind(h, api.CreateProgram, "nvrtcCreateProgram", &api.error) &
              bind(h, api.DestroyProgram, "nvrtcDestroyProgram", &api.error) &
              bind(h, api.CompileProgram, "nvrtcCompileProgram", &api.error) &
              bind(h, api.GetProgramLogSize, "nvrtcGetProgramLogSize", &api.error) &
              bind(h, api.GetProgramLog, "nvrtcGetProgramLog", &api.error) &
              bind(h, api.GetCUBINSize, "nvrtcGetCUBINSize", &api.error) & bind(h, api.GetCUBIN, "nvrtcGetCUBIN", &api.error) &
              bind(h, api.GetPTXSize, "nvrtcGetPTXSize", &api.error) & bind(h, api.GetPTX, "nvrtcGetPTX", &api.error);
    if (ok) {
      api.Version(&api.major, &api.minor);
      api.loaded = true;
    }
  });
  return api;
}

const CudaApi& cuda() {
  static CudaApi api;
  static std::once_flag once;
  std::call_once(once, [] {
    void* h = open_library({"libcuda.so.1", "libcuda.so"}, &api.path, &api.error);
    if (!h) return;
    bool ok = bind(h, api.Init, "cuInit", &api.error) & bind(h, api.GetErrorString, "cuGetErrorString", &api.error) &
              bind(h, api.CtxGetCurrent, "cuCtxGetCurrent", &api.error) & bind(h, api.CtxGetDevice, "cuCtxGetDevice", &api.error) &
              bind(h, api.DeviceGetAttribute, "cuDeviceGetAttribute", &api.error) &
              bind(h, api.ModuleLoadData, "cuModuleLoadData", &api.error) &
              bind(h, api.ModuleGetFunction, "cuModuleGetFunction", &api.error) &
              bind(h, api.FuncSetAttribute, "cuFuncSetAttribute", &api.error) &
              bind(h, api.LaunchKernel, "cuLaunchKernel", &api.error) &
              bind(h, api.CtxSetCurrent, "cuCtxSetCurrent", &api.error) & bind(h, api.DeviceGet, "cuDeviceGet", &api.error) &
              bind(h, api.DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", &api.error);
    // Optional (GEMM autotuning): a missing one disables it, not CUDA.
    std::string ignore;
    bind(h, api.EventCreate, "cuEventCreate", &ignore);
    bind(h, api.EventRecord, "cuEventRecord", &ignore);
    bind(h, api.EventSynchronize, "cuEventSynchronize", &ignore);
    if (!bind(h, api.EventElapsedTime, "cuEventElapsedTime_v2", &ignore)) bind(h, api.EventElapsedTime, "cuEventElapsedTime", &ignore);
    bind(h, api.EventDestroy, "cuEventDestroy_v2", &ignore);
    bind(h, api.StreamIsCapturing, "cuStreamIsCapturing", &ignore);
    bind(h, api.TensorMapEncodeTiled, "cuTensorMapEncodeTiled", &ignore);
    bind(h, api.LaunchCooperativeKernel, "cuLaunchCooperativeKernel", &ignore);
    bind(h, api.MemAlloc, "cuMemAlloc_v2", &ignore);
    bind(h, api.MemsetD32Async, "cuMemsetD32Async", &ignore);
    bind(h, api.OccupancyMaxActiveBlocksPerMultiprocessor, "cuOccupancyMaxActiveBlocksPerMultiprocessor", &ignore);
    bind(h, api.OccupancyMaxActiveClusters, "cuOccupancyMaxActiveClusters", &ignore);
    bind(h, api.LaunchKernelEx, "cuLaunchKernelEx", &ignore);
    if (ok && api.Init(0) == 0) api.loaded = true;
    else if (ok) api.error = "cuInit failed (no usable GPU or driver)";
  });
  return api;
}

void launch_1d(CUfunction f, unsigned grid, unsigned block, unsigned shared_bytes, CUstream stream, void** params,
               bool programmatic, const char* what) {
  const CudaApi& c = cuda();
  if (programmatic && c.LaunchKernelEx) {
    CuLaunchAttribute attr;
    attr.id = kLaunchAttrProgrammaticSerialization;
    attr.val.value = 1;
    CuLaunchConfig lc;
    lc.grid_x = grid;
    lc.block_x = block;
    lc.shared_bytes = shared_bytes;
    lc.stream = stream;
    lc.attrs = &attr;
    lc.num_attrs = 1;
    check_cuda(c.LaunchKernelEx(&lc, f, params, nullptr), what);
  } else {
    check_cuda(c.LaunchKernel(f, grid, 1, 1, block, 1, 1, shared_bytes, stream, params, nullptr), what);
  }
}

void check_cuda(CUresult r, const char* what) {
  if (r == 0) return;
  const char* s = nullptr;
  if (cuda().GetErrorString) cuda().GetErrorString(r, &s);
  throw std::runtime_error(std::string(what) + " failed: " + (s ? s : "error " + std::to_string(r)));
}

void ensure_cuda_context(int device) {
  const CudaApi& c = cuda();
  if (!c.loaded) throw std::runtime_error("CUDA driver not available: " + c.error);
  CUcontext ctx = nullptr;
  check_cuda(c.CtxGetCurrent(&ctx), "cuCtxGetCurrent");
  if (ctx) return;
  if (!c.DeviceGet || !c.DevicePrimaryCtxRetain || !c.CtxSetCurrent)
    throw std::runtime_error("no current CUDA context and the driver calls to make one are not loaded");
  CUdevice dev = 0;
  check_cuda(c.DeviceGet(&dev, device), "cuDeviceGet");
  check_cuda(c.DevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  check_cuda(c.CtxSetCurrent(ctx), "cuCtxSetCurrent");
}

int current_device_arch() {
  const CudaApi& c = cuda();
  if (!c.loaded) throw std::runtime_error("CUDA driver not available: " + c.error);
  CUcontext ctx = nullptr;
  check_cuda(c.CtxGetCurrent(&ctx), "cuCtxGetCurrent");
  if (!ctx) throw std::runtime_error("no current CUDA context (initialise CUDA through PyTorch first)");
  CUdevice dev = 0;
  check_cuda(c.CtxGetDevice(&dev), "cuCtxGetDevice");
  int major = 0, minor = 0;
  check_cuda(c.DeviceGetAttribute(&major, 75, dev), "cuDeviceGetAttribute(major)");  // COMPUTE_CAPABILITY_MAJOR
  check_cuda(c.DeviceGetAttribute(&minor, 76, dev), "cuDeviceGetAttribute(minor)");
  return major * 10 + minor;
}

int resident_groups(CUfunction f, int threads, int dynamic_smem, int cluster) {
  const CudaApi& c = cuda();
  if (cluster > 1 && c.OccupancyMaxActiveClusters) {
    // The driver knows how clusters pack into the GPCs (on the H200 not
    // every GPC takes a whole number of 8-SM clusters: 45 clusters of three
    // 64 KB blocks an SM were resident, not 132 * 3 / 8 = 49).
    CuLaunchConfig config;
    config.grid_x = static_cast<unsigned>(cluster);
    config.block_x = static_cast<unsigned>(threads);
    config.shared_bytes = static_cast<unsigned>(dynamic_smem);
    int n = 0;
    if (c.OccupancyMaxActiveClusters(&n, f, &config) == 0 && n > 0) return n;
  }
  CUdevice dev = 0;
  int sms = 0, per_sm = 0;
  check_cuda(c.CtxGetDevice(&dev), "cuCtxGetDevice");
  check_cuda(c.DeviceGetAttribute(&sms, 16, dev), "cuDeviceGetAttribute(multiprocessor count)");  // MULTIPROCESSOR_COUNT
  if (!c.OccupancyMaxActiveBlocksPerMultiprocessor ||
      c.OccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, f, threads, static_cast<size_t>(dynamic_smem)) != 0 || per_sm < 1)
    per_sm = 1;
  // Without the cluster query: whole clusters of SMs, a GPC's leftover SMs
  // not counted (an underestimate costs a little parallelism; an
  // overestimate would leave a group waiting for a whole group's rows).
  return std::max(1, sms / std::max(1, cluster) * per_sm - (cluster > 1 ? per_sm : 0));
}

std::vector<std::string> nvrtc_options(int arch, bool arch_specific) {
  // IEEE math (no --use_fast_math): results must match PyTorch's.
  return {"--gpu-architecture=sm_" + std::to_string(arch) + (arch_specific ? "a" : ""), "-std=c++17", "-default-device", "-w",
          "--ptxas-options=-v"};
}

NvrtcOutput nvrtc_compile(const std::string& source, const std::string& name, int arch, bool arch_specific, bool want_ptx) {
  const NvrtcApi& n = nvrtc();
  if (!n.loaded) throw std::runtime_error("NVRTC not available: " + n.error);
  nvrtcProgram prog = nullptr;
  if (int r = n.CreateProgram(&prog, source.c_str(), name.c_str(), 0, nullptr, nullptr))
    throw std::runtime_error(std::string("nvrtcCreateProgram: ") + n.GetErrorString(r));
  std::vector<std::string> options = nvrtc_options(arch, arch_specific);
  std::vector<const char*> opts;
  for (const std::string& o : options) opts.push_back(o.c_str());
  int rc = n.CompileProgram(prog, static_cast<int>(opts.size()), opts.data());
  NvrtcOutput out;
  size_t log_size = 0;
  n.GetProgramLogSize(prog, &log_size);
  out.log.resize(log_size);
  if (log_size) n.GetProgramLog(prog, out.log.data());
  if (rc != 0) {
    n.DestroyProgram(&prog);
    throw std::runtime_error("NVRTC failed to compile " + name + ":\n" + out.log.substr(0, 8000));
  }
  size_t size = 0;
  n.GetCUBINSize(prog, &size);
  out.cubin.resize(size);
  n.GetCUBIN(prog, out.cubin.data());
  if (want_ptx) {
    n.GetPTXSize(prog, &size);
    out.ptx.resize(size);
    n.GetPTX(prog, out.ptx.data());
  }
  n.DestroyProgram(&prog);
  return out;
}

}  // namespace opfuse
