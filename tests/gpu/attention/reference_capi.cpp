// C shim over src/kernels/attention/attention_reference.h for the ctypes test
// (test_attention_reference_cpu.py). Strides are in elements.
#include <cstdint>

#include "attention_reference.h"
#include "capi_call.h"

namespace ref = opfuse::kernels::attention;

extern "C" int opfuse_attention_reference(
    int tiled, int block_m, int block_n, const float* q, const int64_t* q_strides, const float* k,
    const int64_t* k_strides, const float* v, const int64_t* v_strides, float* o, const int64_t* o_strides,
    float* lse, const int64_t* lse_strides, const int64_t* shape /* B, Hq, Hkv, Sq, Sk, D */, int causal,
    double scale, char* err, int err_len) {
  ref::AttentionForwardArgs a;
  a.q = {q, q_strides[0], q_strides[1], q_strides[2]};
  a.k = {k, k_strides[0], k_strides[1], k_strides[2]};
  a.v = {v, v_strides[0], v_strides[1], v_strides[2]};
  a.o = {o, o_strides[0], o_strides[1], o_strides[2]};
  a.lse = {lse, lse ? lse_strides[0] : 0, lse ? lse_strides[1] : 0};
  a.shape = {shape[0], shape[1], shape[2], shape[3], shape[4], shape[5]};
  a.causal = causal != 0;
  a.softmax_scale = scale;
  return capi_call(err, err_len, [&] {
    if (tiled)
      ref::attention_forward_tiled(a, block_m, block_n);
    else
      ref::attention_forward_plain(a);
  });
}
