#include "runtime/nvrtc_named.h"

#include <dlfcn.h>

#include <mutex>
#include <stdexcept>

namespace opfuse {
namespace {

// NVRTC's name-expression API is not in runtime/cuda_api.h's table: look it
// up in the library that table loaded (it was opened RTLD_GLOBAL).
struct NameApi {
  nvrtcResult (*AddNameExpression)(nvrtcProgram, const char*) = nullptr;
  nvrtcResult (*GetLoweredName)(nvrtcProgram, const char*, const char**) = nullptr;
};

const NameApi& name_api() {
  static NameApi api;
  static std::once_flag once;
  std::call_once(once, [] {
    const NvrtcApi& n = nvrtc();
    if (!n.loaded) return;
    std::string path = n.path;
    if (auto p = path.find(" (already loaded)"); p != std::string::npos) path = path.substr(0, p);
    void* h = path.empty() ? nullptr : dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
    void* from = h ? h : RTLD_DEFAULT;
    api.AddNameExpression = reinterpret_cast<decltype(api.AddNameExpression)>(dlsym(from, "nvrtcAddNameExpression"));
    api.GetLoweredName = reinterpret_cast<decltype(api.GetLoweredName)>(dlsym(from, "nvrtcGetLoweredName"));
  });
  return api;
}

}  // namespace

std::vector<std::string> nvrtc_named_options(const std::string& gpu_arch) {
  return {"--gpu-architecture=" + gpu_arch, "-std=c++17", "--ptxas-options=-v", "-lineinfo"};
}

NvrtcNamed nvrtc_compile_named(const char* source, const char* file, const std::vector<std::string>& expressions,
                               const std::string& gpu_arch, const std::string& what) {
  const NvrtcApi& n = nvrtc();
  if (!n.loaded) throw std::runtime_error("NVRTC not available: " + n.error);
  const NameApi& na = name_api();
  if (!na.AddNameExpression || !na.GetLoweredName)
    throw std::runtime_error("NVRTC at " + n.path + " lacks nvrtcAddNameExpression/nvrtcGetLoweredName");
  nvrtcProgram prog = nullptr;
  if (int r = n.CreateProgram(&prog, source, file, 0, nullptr, nullptr))
    throw std::runtime_error(std::string("nvrtcCreateProgram: ") + n.GetErrorString(r));
  struct Guard {
    const NvrtcApi& n;
    nvrtcProgram& p;
    ~Guard() { n.DestroyProgram(&p); }
  } guard{n, prog};
  for (const std::string& e : expressions)
    if (int r = na.AddNameExpression(prog, e.c_str()))
      throw std::runtime_error(std::string("nvrtcAddNameExpression: ") + n.GetErrorString(r));
  const std::vector<std::string> opts = nvrtc_named_options(gpu_arch);
  std::vector<const char*> copts;
  for (const auto& o : opts) copts.push_back(o.c_str());
  const int rc = n.CompileProgram(prog, static_cast<int>(copts.size()), copts.data());
  NvrtcNamed out;
  size_t log_size = 0;
  n.GetProgramLogSize(prog, &log_size);
  out.log.resize(log_size);
  if (log_size) n.GetProgramLog(prog, out.log.data());
  while (!out.log.empty() && out.log.back() == '\0') out.log.pop_back();
  if (rc != 0) throw std::runtime_error("NVRTC failed to compile " + what + " for " + gpu_arch + ":\n" + out.log.substr(0, 8000));
  for (const std::string& e : expressions) {
    const char* lowered = nullptr;
    if (int r = na.GetLoweredName(prog, e.c_str(), &lowered); r || !lowered)
      throw std::runtime_error("nvrtcGetLoweredName failed for " + e);
    out.lowered.push_back(lowered);
  }
  size_t size = 0;
  n.GetCUBINSize(prog, &size);
  out.cubin.resize(size);
  n.GetCUBIN(prog, out.cubin.data());
  if (out.cubin.empty()) throw std::runtime_error("NVRTC produced no cubin for " + what);
  return out;
}

std::string pack_named_cubin(const char* magic, const std::vector<std::string>& lowered, const std::string& cubin) {
  std::string s = magic;
  for (const auto& l : lowered) s += l + "\n";
  return s + cubin;
}

bool unpack_named_cubin(const std::string& bytes, const char* magic, size_t names, std::vector<std::string>* lowered,
                        std::string* cubin) {
  const std::string m = magic;
  if (bytes.compare(0, m.size(), m) != 0) return false;
  size_t pos = m.size();
  lowered->clear();
  for (size_t i = 0; i < names; ++i) {
    const size_t nl = bytes.find('\n', pos);
    if (nl == std::string::npos || nl == pos) return false;
    lowered->push_back(bytes.substr(pos, nl - pos));
    pos = nl + 1;
  }
  *cubin = bytes.substr(pos);
  return !cubin->empty();
}

CUcontext current_context_for(int device) {
  const CudaApi& c = cuda();
  CUcontext ctx = nullptr;
  check_cuda(c.CtxGetCurrent(&ctx), "cuCtxGetCurrent");
  if (device < 0) return ctx;
  CUdevice cur = -1;
  if (ctx) check_cuda(c.CtxGetDevice(&cur), "cuCtxGetDevice");
  if (ctx && cur == device) return ctx;
  if (!c.DevicePrimaryCtxRetain || !c.CtxSetCurrent) return ctx;
  CUcontext primary = nullptr;
  check_cuda(c.DevicePrimaryCtxRetain(&primary, device), "cuDevicePrimaryCtxRetain");
  check_cuda(c.CtxSetCurrent(primary), "cuCtxSetCurrent");
  return primary;
}

CUcontext launcher_context(int device, CUdevice* dev) {
  const CudaApi& c = cuda();
  if (!c.loaded) throw std::runtime_error("CUDA driver not available: " + c.error);
  CUcontext ctx = current_context_for(device);
  if (!ctx) throw std::runtime_error("no current CUDA context (initialise CUDA through PyTorch first)");
  check_cuda(c.CtxGetDevice(dev), "cuCtxGetDevice");
  return ctx;
}

}  // namespace opfuse
