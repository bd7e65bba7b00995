#include "runtime/small_m_launch.h"

#include <stdexcept>

#include "runtime/cuda_api.h"

namespace opfuse {

const char* small_m_elem_name(DType t, const char* what) {
  switch (t) {
    case DType::BFloat16: return "bf16";
    case DType::Float16: return "f16";
    default: throw std::invalid_argument(std::string(what) + ": no kernel for dtype " + dtype_name(t));
  }
}

DType small_m_parse_elem(const std::string& name, const char* what) {
  if (name == "bf16") return DType::BFloat16;
  if (name == "f16") return DType::Float16;
  throw std::invalid_argument(std::string(what) + " dtype must be bf16 or f16, not " + name);
}

int small_m_act_code(const std::string& a) {
  if (a.empty()) return 0;
  if (a == "relu") return 1;
  if (a == "gelu_tanh") return 2;
  return -1;
}

SmallMDevice small_m_current_device() {
  constexpr int kDevAttrMultiprocessorCount = 16;  // CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
  const CudaApi& c = cuda();
  SmallMDevice info;
  CUdevice dev = 0;
  check_cuda(c.CtxGetDevice(&dev), "cuCtxGetDevice");
  info.arch = current_device_arch();
  if (c.DeviceGetAttribute(&info.sms, kDevAttrMultiprocessorCount, dev) != 0 || info.sms <= 0) info.sms = 1;
  constexpr int kDevAttrMemoryClockKhz = 36, kDevAttrBusWidthBits = 37;  // CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE, _GLOBAL_MEMORY_BUS_WIDTH
  int khz = 0, bits = 0;
  if (c.DeviceGetAttribute(&khz, kDevAttrMemoryClockKhz, dev) == 0 && c.DeviceGetAttribute(&bits, kDevAttrBusWidthBits, dev) == 0 &&
      khz > 0 && bits > 0)
    info.dram_tbps = 2.0 * khz * 1e3 * (bits / 8.0) / 1e12;  // double data rate
  return info;
}

}  // namespace opfuse
