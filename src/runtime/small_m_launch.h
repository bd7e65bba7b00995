// What the launchers of the small-M kernels opfuse ships whole (skinny GEMM,
// decode MLP) share: the element and activation names their entry points
// take, the alignment their 16-byte loads need, and the device facts they
// size grids with.
#pragma once
#include <cstdint>
#include <string>

#include "ir/dtype.h"

namespace opfuse {

// The kernels' element type name (bf16, f16); throws "<what>: no kernel for
// dtype ..." for any other.
const char* small_m_elem_name(DType t, const char* what);

// Its inverse, for the bindings: bf16 or f16; throws "<what> dtype must be
// bf16 or f16, not ..." for any other name.
DType small_m_parse_elem(const std::string& name, const char* what);

// The epilogue's activation code: 0 none (""), 1 relu, 2 gelu_tanh; -1 for
// any other name.
int small_m_act_code(const std::string& activation);

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The current context's device: its sm_XY as XY, and its SM count (1 where
// the driver does not say).
struct SmallMDevice {
  int arch = 0, sms = 0;
  // Peak DRAM bandwidth in TB/s from the memory clock and bus width (0:
  // unknown): H100 SXM 3.35, H200 4.8. The skinny GEMM sizes its loads in
  // flight by it.
  double dram_tbps = 0;
};
SmallMDevice small_m_current_device();

}  // namespace opfuse
