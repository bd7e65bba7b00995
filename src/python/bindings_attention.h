// What the attention bindings share (bindings_ops.cpp: the forward,
// bindings_attention_bwd.cpp: the backward): the argument types that cross
// from Python (tensors as raw pointers, sizes, element strides), the argument
// check and the attn_mask fields of the launchers' argument structs.
#pragma once
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/attention_launcher.h"

namespace opfuse::attention_bindings {

using Ptrs = std::vector<uintptr_t>;
using Sizes = std::vector<int64_t>;
using Strides = std::vector<std::vector<int64_t>>;

inline void need(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(what);
}

// attn_mask: kind name (attention_launcher.h), data pointer, 4 element strides
// over [B, Hq, Sq, Sk]; Args: AttnForwardArgs or AttnBackwardArgs.
template <typename Args>
void set_mask(Args& a, const std::string& kind, uintptr_t ptr, const std::vector<int64_t>& strides) {
  a.mask = opfuse::attention::parse_attn_mask(kind);
  if (a.mask == opfuse::attention::AttnMaskKind::None) return;
  need(strides.size() == 4, "mask strides: 4 entries over [B, Hq, Sq, Sk]");
  a.mask_ptr = reinterpret_cast<const void*>(ptr);
  for (size_t d = 0; d < 4; ++d) a.mask_strides[d] = strides[d];
}

}  // namespace opfuse::attention_bindings
