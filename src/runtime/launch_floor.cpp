#include "runtime/launch_floor.h"

#include <chrono>
#include <mutex>
#include <stdexcept>

#include "runtime/cuda_api.h"

namespace opfuse {

namespace {

// The argument block the seed chain's kernel takes (cuda_emitter.cpp's
// header): four buffer pointers, one size symbol, one stride. The driver
// copies the block per launch, so the floor is measured with the same size.
struct FloorArgs {
  const void* b[4];
  int64_t s[1];
  int64_t st[1];
};

struct FloorKernel {
  CUcontext ctx = nullptr;
  CUmodule module = nullptr;
  CUfunction fn = nullptr;
};

}  // namespace

const std::string& launch_floor_source() {
  // The branch on an argument keeps the body from being empty in a way the
  // compiler could treat specially; it is never taken (s[0] is 0).
  static const std::string src =
      "typedef long long int64_t;\n"
      "struct opfuse_floor_args { const void* b[4]; int64_t s[1]; int64_t st[1]; };\n"
      "extern \"C\" __global__ void opfuse_launch_floor(const opfuse_floor_args a) {\n"
      "  if (a.s[0] == -1) asm volatile(\"trap;\");\n"
      "}\n";
  return src;
}

int64_t time_empty_launches(uintptr_t stream, int launches) {
  const CudaApi& c = cuda();
  if (!c.loaded) throw std::runtime_error("the CUDA driver is not available: " + c.error);
  CUcontext ctx = nullptr;
  check_cuda(c.CtxGetCurrent(&ctx), "cuCtxGetCurrent");
  if (!ctx) throw std::runtime_error("time_empty_launches: no current CUDA context (use a CUDA tensor first)");
  // One kernel per process, reloaded if the context changed (another device).
  static std::mutex mu;
  static FloorKernel k;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (k.ctx != ctx) {
      NvrtcOutput out = nvrtc_compile(launch_floor_source(), "opfuse_launch_floor.cu", current_device_arch());
      check_cuda(c.ModuleLoadData(&k.module, out.cubin.data()), "cuModuleLoadData(launch floor)");
      check_cuda(c.ModuleGetFunction(&k.fn, k.module, "opfuse_launch_floor"), "cuModuleGetFunction(launch floor)");
      k.ctx = ctx;
    }
  }
  FloorArgs args{};
  void* params[] = {&args};
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < launches; ++i)
    check_cuda(c.LaunchKernel(k.fn, 1, 1, 1, 32, 1, 1, 0, reinterpret_cast<CUstream>(stream), params, nullptr),
               "cuLaunchKernel(launch floor)");
  auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count();
}

}  // namespace opfuse
