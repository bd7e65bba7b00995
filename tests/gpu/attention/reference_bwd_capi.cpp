// C shim over src/kernels/attention/attention_backward_reference.h for the
// ctypes test (test_attention_bwd_reference_cpu.py). Strides are in elements;
// tensors in the order q, k, v, o, dout, dq, dk, dv.
#include <cstdint>

#include "attention_backward_reference.h"
#include "capi_call.h"

namespace ref = opfuse::kernels::attention;

extern "C" int opfuse_attention_backward_reference(const double* const* ptrs, const int64_t* strides /* 8 x 3 */,
                                                   const int64_t* shape /* B, Hq, Hkv, Sq, Sk, D */, int causal,
                                                   double scale, char* err, int err_len) {
  auto in = [&](int t) { return ref::ConstTensor4d{ptrs[t], strides[3 * t], strides[3 * t + 1], strides[3 * t + 2]}; };
  auto out = [&](int t) {
    return ref::Tensor4d{const_cast<double*>(ptrs[t]), strides[3 * t], strides[3 * t + 1], strides[3 * t + 2]};
  };
  ref::AttentionBackwardArgs a;
  a.q = in(0), a.k = in(1), a.v = in(2), a.o = in(3), a.dout = in(4);
  a.dq = out(5), a.dk = out(6), a.dv = out(7);
  a.shape = {shape[0], shape[1], shape[2], shape[3], shape[4], shape[5]};
  a.causal = causal != 0;
  a.softmax_scale = scale;
  return capi_call(err, err_len, [&] { ref::attention_backward_reference(a); });
}
