// Helper code at the top of every generated CUDA source. Self-contained: no
// #include, so NVRTC needs no CUDA toolkit headers (a machine with only
// PyTorch's pip wheels and a driver compiles it). Same helper names as the
// CPU prelude, so both backends print the same statements.
typedef long long int64_t;
typedef int int32_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;

struct opf_half { uint16_t x; };
struct opf_bf16 { uint16_t x; };

__device__ int opf_error_flag;
static __device__ __forceinline__ void opf_raise(int code) { atomicExch(&opf_error_flag, code); }

static __device__ __forceinline__ int64_t opf_imin(int64_t a, int64_t b) { return a < b ? a : b; }
static __device__ __forceinline__ int64_t opf_imax(int64_t a, int64_t b) { return a > b ? a : b; }

static __device__ __forceinline__ float opf_to_float(opf_half h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.x));
  return f;
}
static __device__ __forceinline__ float opf_to_float(opf_bf16 b) { return __int_as_float(((uint32_t)b.x) << 16); }
static __device__ __forceinline__ opf_half opf_float_to_half(float f) {
  opf_half h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.x) : "f"(f));
  return h;
}
// One instruction on sm_80 and newer (round to nearest even; NaN stays NaN).
static __device__ __forceinline__ opf_bf16 opf_float_to_bf16(float f) {
  opf_bf16 b;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b.x) : "f"(f));
  return b;
}
static __device__ __forceinline__ float opf_round_bf16(float f) { return opf_to_float(opf_float_to_bf16(f)); }
static __device__ __forceinline__ float opf_round_half(float f) { return opf_to_float(opf_float_to_half(f)); }

template <class T> struct opf_limits;
template <> struct opf_limits<float> {
  static __device__ __forceinline__ float inf() { return __int_as_float(0x7f800000); }
  static __device__ __forceinline__ float nan() { return __int_as_float(0x7fc00000); }
  static __device__ __forceinline__ float lowest() { return -inf(); }
  static __device__ __forceinline__ float highest() { return inf(); }
};
template <> struct opf_limits<double> {
  static __device__ __forceinline__ double inf() { return __longlong_as_double(0x7ff0000000000000LL); }
  static __device__ __forceinline__ double nan() { return __longlong_as_double(0x7ff8000000000000LL); }
  static __device__ __forceinline__ double lowest() { return -inf(); }
  static __device__ __forceinline__ double highest() { return inf(); }
};
template <> struct opf_limits<int64_t> {
  static __device__ __forceinline__ int64_t lowest() { return (int64_t)(-9223372036854775807LL - 1); }
  static __device__ __forceinline__ int64_t highest() { return 9223372036854775807LL; }
};
template <> struct opf_limits<int32_t> {
  static __device__ __forceinline__ int32_t lowest() { return (int32_t)(-2147483647 - 1); }
  static __device__ __forceinline__ int32_t highest() { return 2147483647; }
};
template <> struct opf_limits<bool> {
  static __device__ __forceinline__ bool lowest() { return false; }
  static __device__ __forceinline__ bool highest() { return true; }
};
template <class T> static __device__ __forceinline__ T opf_nan() { return opf_limits<T>::nan(); }
template <class T> static __device__ __forceinline__ T opf_inf() { return opf_limits<T>::inf(); }
template <class T> static __device__ __forceinline__ T opf_lowest() { return opf_limits<T>::lowest(); }
template <class T> static __device__ __forceinline__ T opf_highest() { return opf_limits<T>::highest(); }

template <class T> static __device__ __forceinline__ bool opf_isnan(T x) { return x != x; }
template <class T> static __device__ __forceinline__ T opf_max_nan(T a, T b) { return (b > a || b != b) ? b : a; }
template <class T> static __device__ __forceinline__ T opf_min_nan(T a, T b) { return (b < a || b != b) ? b : a; }
// NaN-propagating max/min in one instruction (sm_80+), the hot op of softmax's max pass.
static __device__ __forceinline__ float opf_max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
static __device__ __forceinline__ float opf_min_nan(float a, float b) {
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
template <class T> static __device__ __forceinline__ T opf_maximum(T a, T b) { return (a != a || b != b) ? (a != a ? a : b) : (a > b ? a : b); }
template <class T> static __device__ __forceinline__ T opf_minimum(T a, T b) { return (a != a || b != b) ? (a != a ? a : b) : (a < b ? a : b); }
template <class T> static __device__ __forceinline__ T opf_clamp_min(T x, T lo) { return x < lo ? lo : x; }
template <class T> static __device__ __forceinline__ T opf_clamp_max(T x, T hi) { return x > hi ? hi : x; }
template <class T> static __device__ __forceinline__ T opf_relu(T x) { return x < (T)0 ? (T)0 : x; }
static __device__ __forceinline__ bool opf_relu(bool x) { return x; }
template <class T> static __device__ __forceinline__ T opf_abs(T x) { return x < (T)0 ? -x : x; }
static __device__ __forceinline__ float opf_abs(float x) { return fabsf(x); }
static __device__ __forceinline__ double opf_abs(double x) { return fabs(x); }
template <class T> static __device__ __forceinline__ T opf_sign(T x) { return (T)((x > (T)0) - (x < (T)0)) + (x != x ? x : (T)0); }

static __device__ __forceinline__ float opf_exp(float x) { return expf(x); }
// exp as one multiply and the hardware's ex2 (about 2 ulp, plus ~|x| * 2^-24
// relative from rounding x * log2(e)): used only in kernels whose every
// output is float16 or bfloat16, where rounding to 8 or 11 bits dwarfs it.
static __device__ __forceinline__ float opf_exp_fast(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x * 1.4426950408889634f));
  return r;
}
static __device__ __forceinline__ double opf_exp(double x) { return exp(x); }
static __device__ __forceinline__ float opf_log(float x) { return logf(x); }
static __device__ __forceinline__ double opf_log(double x) { return log(x); }
static __device__ __forceinline__ float opf_log1p(float x) { return log1pf(x); }
static __device__ __forceinline__ double opf_log1p(double x) { return log1p(x); }
static __device__ __forceinline__ float opf_expm1(float x) { return expm1f(x); }
static __device__ __forceinline__ double opf_expm1(double x) { return expm1(x); }
static __device__ __forceinline__ float opf_sqrt(float x) { return sqrtf(x); }
static __device__ __forceinline__ double opf_sqrt(double x) { return sqrt(x); }
static __device__ __forceinline__ float opf_rsqrt(float x) { return rsqrtf(x); }
static __device__ __forceinline__ double opf_rsqrt(double x) { return rsqrt(x); }
static __device__ __forceinline__ float opf_tanh(float x) { return tanhf(x); }
static __device__ __forceinline__ double opf_tanh(double x) { return tanh(x); }
static __device__ __forceinline__ float opf_erf(float x) { return erff(x); }
static __device__ __forceinline__ double opf_erf(double x) { return erf(x); }
static __device__ __forceinline__ float opf_sin(float x) { return sinf(x); }
static __device__ __forceinline__ double opf_sin(double x) { return sin(x); }
static __device__ __forceinline__ float opf_cos(float x) { return cosf(x); }
static __device__ __forceinline__ double opf_cos(double x) { return cos(x); }
static __device__ __forceinline__ float opf_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
static __device__ __forceinline__ double opf_sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }
static __device__ __forceinline__ float opf_silu(float x) { return x / (1.0f + expf(-x)); }
static __device__ __forceinline__ double opf_silu(double x) { return x / (1.0 + exp(-x)); }
static __device__ __forceinline__ float opf_gelu_erf(float x) { return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f)); }
static __device__ __forceinline__ double opf_gelu_erf(double x) { return 0.5 * x * (1.0 + erf(x * 0.70710678118654752)); }
static __device__ __forceinline__ float opf_gelu_tanh(float x) {
  return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}
static __device__ __forceinline__ double opf_gelu_tanh(double x) {
  return 0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
}
// grad * d/dx gelu(x) (gelu_backward), computed in float for half types as PyTorch does.
static __device__ __forceinline__ float opf_gelu_tanh_backward(float g, float x) {
  const float t = tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x));
  return g * (0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * 0.7978845608028654f * (1.0f + 0.134145f * x * x));
}
static __device__ __forceinline__ double opf_gelu_tanh_backward(double g, double x) {
  const double t = tanh(0.7978845608028654 * (x + 0.044715 * x * x * x));
  return g * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * x * x));
}
static __device__ __forceinline__ float opf_gelu_erf_backward(float g, float x) {
  return g * (0.5f * (1.0f + erff(x * 0.70710678118654752f)) + x * 0.3989422804014327f * expf(-0.5f * x * x));
}
static __device__ __forceinline__ double opf_gelu_erf_backward(double g, double x) {
  return g * (0.5 * (1.0 + erf(x * 0.70710678118654752)) + x * 0.3989422804014327 * exp(-0.5 * x * x));
}
static __device__ __forceinline__ float opf_pow(float a, float b) { return powf(a, b); }
static __device__ __forceinline__ double opf_pow(double a, double b) { return pow(a, b); }
template <class T> static __device__ __forceinline__ T opf_pow(T a, T b) {
  if (b < 0) return (a == 1) ? 1 : (a == -1 ? ((b & 1) ? -1 : 1) : 0);
  T r = 1;
  while (b) {
    if (b & 1) r *= a;
    a *= a;
    b >>= 1;
  }
  return r;
}
template <class T> static __device__ __forceinline__ T opf_floordiv(T a, T b) {
  if (b == 0) { opf_raise(1); return 0; }
  T q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}
template <class T> static __device__ __forceinline__ T opf_truncdiv(T a, T b) {
  if (b == 0) { opf_raise(1); return 0; }
  return a / b;
}
template <class F> static __device__ __forceinline__ F opf_floordiv_float(F a, F b) {
  if (b == 0) return a / b;
  F m = fmod(a, b);
  F d = (a - m) / b;
  if (m != 0 && ((b < 0) != (m < 0))) d -= 1;
  if (d == 0) return copysign((F)0, a / b);
  F f = floor(d);
  if (d - f > (F)0.5) f += 1;
  return f;
}
static __device__ __forceinline__ float opf_floordiv(float a, float b) { return opf_floordiv_float(a, b); }
static __device__ __forceinline__ double opf_floordiv(double a, double b) { return opf_floordiv_float(a, b); }
static __device__ __forceinline__ float opf_truncdiv(float a, float b) { return truncf(a / b); }
static __device__ __forceinline__ double opf_truncdiv(double a, double b) { return trunc(a / b); }

// 128-bit (or narrower) vector access of V consecutive elements.
template <int BYTES> struct opf_vec;
template <> struct alignas(16) opf_vec<16> { uint32_t w[4]; };
template <> struct alignas(8) opf_vec<8> { uint32_t w[2]; };
template <> struct alignas(4) opf_vec<4> { uint32_t w[1]; };
template <> struct alignas(2) opf_vec<2> { uint16_t w[1]; };
template <class T, int V> struct opf_lanes {
  union { opf_vec<sizeof(T) * V> v; T e[V]; };
};
template <int V, class T> static __device__ __forceinline__ void opf_vload(const T* __restrict__ p, T* out) {
  opf_lanes<T, V> l;
  l.v = *reinterpret_cast<const opf_vec<sizeof(T) * V>*>(p);
#pragma unroll
  for (int j = 0; j < V; ++j) out[j] = l.e[j];
}
// The V lanes of a 16-byte vector already in registers (a row pipeline's
// load of the previous iteration, OPFUSE_ROW_PIPELINE).
template <int V, class T> static __device__ __forceinline__ void opf_vunpack(const opf_vec<16>& v, T* out) {
  opf_lanes<T, V> l;
  l.v = v;
#pragma unroll
  for (int j = 0; j < V; ++j) out[j] = l.e[j];
}
// An L2 prefetch of the line holding p (generic address, no register
// result): row kernels ask for the row they take next while they reduce this
// one, so more of HBM's latency is covered than their registers allow.
static __device__ __forceinline__ void opf_prefetch_l2(const void* p) { asm volatile("prefetch.L2 [%0];" ::"l"(p)); }
// Rows staged in shared memory (sm_80+): each thread copies its own 16-byte
// pieces of the row with cp.async (no registers held while they are in
// flight, so the whole row is requested at once), waits for its own copies
// and later reads back only what it copied, so no barrier is needed.
static __device__ __forceinline__ void opf_cp_async16(void* smem, const void* gmem) {
  unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
static __device__ __forceinline__ void opf_cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
// A staged-row ring (OPFUSE_ROW_STAGE_RING): a thread's copies of one row
// close a group; waiting for all but the newest group leaves the next row's
// copies in flight while this row is reduced.
static __device__ __forceinline__ void opf_cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
static __device__ __forceinline__ void opf_cp_async_wait_prior() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }
template <int V, class T> static __device__ __forceinline__ void opf_vstore(T* __restrict__ p, const T* in) {
  opf_lanes<T, V> l;
#pragma unroll
  for (int j = 0; j < V; ++j) l.e[j] = in[j];
  *reinterpret_cast<opf_vec<sizeof(T) * V>*>(p) = l.v;
}
// The same store with 16-bit lanes packed into 32-bit words by hand and the
// 16-byte store written as one st.global.v4.b32. NVVM takes opf_vstore's
// union apart and, in unrolled row loops, stores the pieces as 4-byte
// st.global.v2.u16 (log_softmax 8192x32768's output loop and every
// cluster-staged row at 4096x262144: four store instructions, each writing
// part of 16 sectors, where one would do); packed words alone still came
// out as four st.global.u32, hence the asm. The buffers are global memory
// (generic addresses of global memory are their global addresses).
template <class T> static __device__ __forceinline__ uint32_t opf_bits16(T x) {
  union { T t; uint16_t u; } c;
  c.t = x;
  return c.u;
}
template <int V, class T> static __device__ __forceinline__ void opf_vstore_w(T* __restrict__ p, const T* in) {
  if constexpr (sizeof(T) == 2 && V % 2 == 0) {
    opf_vec<2 * V> v;
#pragma unroll
    for (int k = 0; k < V / 2; ++k) v.w[k] = opf_bits16(in[2 * k]) | (opf_bits16(in[2 * k + 1]) << 16);
    if constexpr (V == 8)
      asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.w[0]), "r"(v.w[1]), "r"(v.w[2]), "r"(v.w[3]) : "memory");
    else
      *reinterpret_cast<opf_vec<2 * V>*>(p) = v;
  } else {
    opf_vstore<V>(p, in);
  }
}

// L2 eviction priorities (OPFUSE_ROW_L2_HINTS, cuda_row_schedule.cpp): a
// policy for every line an access touches (fraction 1.0), evict_last to keep
// a row that is read again, evict_first for the last pass over it.
template <bool LAST> static __device__ __forceinline__ unsigned long long opf_l2_policy() {
  unsigned long long p;
  if constexpr (LAST)
    asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
  else
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}
// 16 bytes from global memory with an L2 policy (read-only buffers).
static __device__ __forceinline__ opf_vec<16> opf_ld16_hint(const void* p, unsigned long long policy) {
  opf_vec<16> v;
  asm volatile("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(v.w[0]), "=r"(v.w[1]), "=r"(v.w[2]), "=r"(v.w[3])
               : "l"(p), "l"(policy));
  return v;
}
// opf_vstore_w with an L2 policy on whole 16-byte vectors (others as opf_vstore_w).
template <int V, class T>
static __device__ __forceinline__ void opf_vstore_w_hint(T* __restrict__ p, const T* in, unsigned long long policy) {
  if constexpr (sizeof(T) * V == 16) {
    opf_lanes<T, V> l;
#pragma unroll
    for (int j = 0; j < V; ++j) l.e[j] = in[j];
    asm volatile("st.global.L2::cache_hint.v4.b32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(p), "r"(l.v.w[0]), "r"(l.v.w[1]),
                 "r"(l.v.w[2]), "r"(l.v.w[3]), "l"(policy)
                 : "memory");
  } else {
    opf_vstore_w<V>(p, in);
  }
}

// The row cache of 16-bit loads kept as the raw 128-bit vector
// (OPFUSE_ROW_CACHE_RAW): 4 registers for 8 values instead of 8 floats, so
// more blocks fit an SM; a later stage converts lane j again (a shift or a
// mask for bf16, one cvt for half).
template <class T> static __device__ __forceinline__ float opf_raw_lane(const opf_vec<16>& v, int j);
template <> __device__ __forceinline__ float opf_raw_lane<opf_bf16>(const opf_vec<16>& v, int j) {
  return __int_as_float((j & 1) ? (v.w[j >> 1] & 0xffff0000u) : (v.w[j >> 1] << 16));
}
template <> __device__ __forceinline__ float opf_raw_lane<opf_half>(const opf_vec<16>& v, int j) {
  opf_half h;
  h.x = (uint16_t)(v.w[j >> 1] >> ((j & 1) * 16));
  return opf_to_float(h);
}

// Column partials kept in shared memory (OPFUSE_ROW_PARTIALS_SMEM): a
// thread adds its row's 4 values of a column group to its own 16 bytes (one
// 128-bit shared load and store; threads of a warp hit consecutive 16-byte
// slots, so no bank conflicts and no barrier: no other thread touches them).
static __device__ __forceinline__ void opf_smem_add4(float* p, const float* v) {
  opf_lanes<float, 4> l;
  l.v = *reinterpret_cast<const opf_vec<16>*>(p);
#pragma unroll
  for (int j = 0; j < 4; ++j) l.e[j] += v[j];
  *reinterpret_cast<opf_vec<16>*>(p) = l.v;
}

// Reductions across the threads of a row: a warp (shuffles) or a block.
struct opf_sum {
  template <class T> static __device__ __forceinline__ T f(T a, T b) { return a + b; }
  template <class T> static __device__ __forceinline__ T identity() { return (T)0; }
};
struct opf_prod {
  template <class T> static __device__ __forceinline__ T f(T a, T b) { return a * b; }
  template <class T> static __device__ __forceinline__ T identity() { return (T)1; }
};
struct opf_max {
  template <class T> static __device__ __forceinline__ T f(T a, T b) { return opf_max_nan(a, b); }
  template <class T> static __device__ __forceinline__ T identity() { return opf_lowest<T>(); }
};
struct opf_min {
  template <class T> static __device__ __forceinline__ T f(T a, T b) { return opf_min_nan(a, b); }
  template <class T> static __device__ __forceinline__ T identity() { return opf_highest<T>(); }
};

// W: the lanes that share a row (an aligned group of 1 to 32 lanes).
template <class Op, int W = 32, class T> static __device__ __forceinline__ T opf_warp_reduce(T v) {
#pragma unroll
  for (int o = W / 2; o > 0; o >>= 1) v = Op::f(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
template <class Op, class T> static __device__ __forceinline__ T opf_block_reduce(T v, void* smem) {
  T* s = reinterpret_cast<T*>(smem);
  v = opf_warp_reduce<Op>(v);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = (blockDim.x + 31) >> 5;
  __syncthreads();
  if (lane == 0) s[warp] = v;
  __syncthreads();
  // Every warp folds the warps' partials with the same shuffle tree (one
  // shared load a lane instead of a chain of nwarps dependent loads), so
  // every thread holds the same total without a third barrier.
  v = lane < nwarps ? s[lane] : Op::template identity<T>();
  return opf_warp_reduce<Op>(v);
}

// Two sums of a row across a block in one pass (layer_norm backward's
// sum(g) and sum(g * xhat)): the two shuffle trees interleave and one
// shared-memory exchange with one barrier serves both, where two calls of
// opf_block_reduce cost four barriers in a chain. The exchange alternates
// between the two halves of `buf` (parity p, flipped each call): the half a
// call writes was last read two calls before, and every thread passed the
// previous call's barrier after that read, so no leading barrier is needed.
// Every thread of the block must make every call (block-uniform control
// flow). Same summation order as opf_block_reduce, so the same totals.
template <class T> static __device__ __forceinline__ void opf_block_sum2(T& a, T& b, T* buf, int& p) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, o);
    b += __shfl_xor_sync(0xffffffffu, b, o);
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = (blockDim.x + 31) >> 5;
  T* s = buf + p * 64;
  p ^= 1;
  if (lane == 0) { s[warp] = a; s[32 + warp] = b; }
  __syncthreads();
  a = lane < nwarps ? s[lane] : (T)0;
  b = lane < nwarps ? s[32 + lane] : (T)0;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, o);
    b += __shfl_xor_sync(0xffffffffu, b, o);
  }
}

// opf_block_sum2 with the block's warps NW (a power of two) known when the
// kernel is generated (OPFUSE_ROW_SUM2_CONST): no blockDim arithmetic, the
// pair exchanged as one 8-byte store and load a lane, and the second tree
// over NW lanes only: lane l takes warp (l % NW)'s pair, so every aligned
// group of NW lanes holds all warps' pairs and log2(NW) butterfly steps give
// every lane the total. Same sums bit for bit as opf_block_sum2: there,
// lanes of NW and up hold +0 and the first 5 - log2(NW) steps add +0 to each
// warp's sum, which changes no value (a sum started from +0 is never -0; a
// NaN stays NaN), and the remaining steps pair the same lanes in the same
// order (a + b and b + a are the same float).
template <int NW, class T> static __device__ __forceinline__ void opf_block_sum2_w(T& a, T& b, T* buf, int& p) {
  static_assert(NW >= 1 && NW <= 32 && (NW & (NW - 1)) == 0, "warps: a power of two up to 32");
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, o);
    b += __shfl_xor_sync(0xffffffffu, b, o);
  }
  struct alignas(2 * sizeof(T)) pair { T a, b; };
  pair* s = reinterpret_cast<pair*>(buf + p * 64);
  p ^= 1;
  const int lane = threadIdx.x & 31;
  if (lane == 0) s[threadIdx.x >> 5] = pair{a, b};
  __syncthreads();
  const pair q = s[lane & (NW - 1)];
  a = q.a;
  b = q.b;
#pragma unroll
  for (int o = NW / 2; o > 0; o >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, o);
    b += __shfl_xor_sync(0xffffffffu, b, o);
  }
}

// A thread-block cluster shares one row (distributed shared memory): each
// block reduces its part, publishes it in its own shared memory, and after a
// cluster barrier lane r of every warp reads block r's part and the warp
// folds them with one shuffle tree, so every block holds the same total. Each reduction has its own slot, so no
// second barrier is needed before the next one; the kernel ends with a
// cluster barrier so that no block exits while another reads its memory.
static __device__ __forceinline__ unsigned opf_cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
static __device__ __forceinline__ void opf_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// The two halves of opf_cluster_sync, for a kernel's last cluster barrier
// (default; OPFUSE_ROW_CLUSTER_EARLY_ARRIVE=0 turns it off): a block arrives once it has read its
// peers' memory for the last time and waits only before it exits, so it
// does not wait there for the slowest peer's output stage.
static __device__ __forceinline__ void opf_cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
static __device__ __forceinline__ void opf_cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
// Programmatic dependent launch (sm_90 unless OPFUSE_PDL=0): a kernel launched
// with the programmatic serialization attribute may start while the kernel
// before it in the stream ends; it waits here, before touching memory, for
// that kernel to finish and flush, and at once lets the kernel after it
// start too (which waits likewise).
static __device__ __forceinline__ void opf_grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
static __device__ __forceinline__ void opf_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
template <class T> static __device__ __forceinline__ T opf_cluster_load(const T* local, unsigned rank) {
  unsigned a = (unsigned)__cvta_generic_to_shared(local), remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(a), "r"(rank));
  union { T v; unsigned long long b64; unsigned b32; } u;
  if constexpr (sizeof(T) == 8) {
    asm volatile("ld.shared::cluster.b64 %0, [%1];" : "=l"(u.b64) : "r"(remote) : "memory");
  } else {
    asm volatile("ld.shared::cluster.b32 %0, [%1];" : "=r"(u.b32) : "r"(remote) : "memory");
  }
  return u.v;
}
template <class Op, int C, class T> static __device__ __forceinline__ T opf_cluster_reduce(T v, void* smem, T* slot) {
  v = opf_block_reduce<Op>(v, smem);
  if (threadIdx.x == 0) *slot = v;
  opf_cluster_sync();
  // Lane r of every warp reads block r's partial (C remote loads a warp, not
  // C a thread); the shuffle tree is the same everywhere, so is the total.
  const int lane = threadIdx.x & 31;
  v = lane < C ? opf_cluster_load(slot, (unsigned)lane) : Op::template identity<T>();
  return opf_warp_reduce<Op>(v);
}

// A cluster reduction without barrier.cluster (OPFUSE_ROW_CLUSTER_PUSH, rows
// staged over a cluster, sm_90): after the block's own reduction, lane r pushes
// the block's partial into block r's slots[my rank] with st.async, which
// completes C * sizeof(T) bytes on block r's mbarrier `bar`; each block
// then waits on its own mbarrier's phase `phase` only. No MEMBAR.ALL.GPU
// (barrier.cluster's release, which waits for every earlier store) and no
// CCTL.IVALL (its acquire, which empties L1). Every block of the cluster
// makes the same calls in the same order; a (slots, bar) pair is reused
// every second row in the ring (the caller alternates by row parity),
// which is safe: a peer's next push into it needs this block's partial of
// the row between.
template <int N> static __device__ __forceinline__ void opf_mbar_init_cluster(unsigned long long (&bar)[N]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (threadIdx.x == 0) {
    for (int i = 0; i < N; ++i)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"((unsigned)__cvta_generic_to_shared(&bar[i])) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  opf_cluster_sync();
#endif
}
template <class Op, int C, class T>
static __device__ __forceinline__ T opf_cluster_reduce_push(T v, void* smem, T* slots, unsigned long long* bar, unsigned phase) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "4- or 8-byte partials");
  v = opf_block_reduce<Op>(v, smem);
  const unsigned b = (unsigned)__cvta_generic_to_shared(bar);
  if (threadIdx.x == 0)
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"((unsigned)(C * sizeof(T))) : "memory");
  if (threadIdx.x < C) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(slots + opf_cluster_rank());
    unsigned rs, rb;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(rs) : "r"(s), "r"((unsigned)threadIdx.x));
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(rb) : "r"(b), "r"((unsigned)threadIdx.x));
    union { T v; unsigned long long b64; unsigned b32; } u;
    u.v = v;
    if constexpr (sizeof(T) == 8) {
      asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b64 [%0], %1, [%2];" ::"r"(rs), "l"(u.b64), "r"(rb) : "memory");
    } else {
      asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(rs), "r"(u.b32), "r"(rb) : "memory");
    }
  }
  unsigned done = 0;
  while (!done)
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done) : "r"(b), "r"(phase) : "memory");
  const int lane = threadIdx.x & 31;
  v = lane < C ? slots[lane] : Op::template identity<T>();
  return opf_warp_reduce<Op>(v);
}

// The same reduction over a group of C blocks that is not a cluster
// (OPFUSE_ROW_GROUP_EXCHANGE, the staged ring): the group's blocks are
// consecutive in the grid and all resident at once (the grid is at most the
// blocks the device holds), so they may wait for each other. `region` is
// the zeroed workspace's row-group region: G counters, each alone in a
// 128-byte line, then S slots a group (G, S: CudaEmitter's kRowGroupsMax,
// kGroupSlotsMax). Thread 0 puts the block's partial in its slot and
// arrives on the group's counter; the counter needs no reset: block 0
// adds 2^31 - (C - 1), the others 1, so the C arrivals add exactly 2^31,
// flip the top bit and leave the low bits as they were (zero: the
// workspace is zeroed once, and no slot is ever a counter). A block waits
// until the top bit differs from what it saw before its own arrival; a fast
// block's arrival at the next reduction adds less than 2^31 and cannot flip
// it back. Slots alternate by row parity (the caller's), so a block writes
// a slot again only after every peer has passed the barrier that follows
// its read. Release and acquire at gpu scope order the slot stores before
// the arrivals and the loads after the wait; the loads are volatile
// (strong), so L1 holds no stale copy. A wait past 10 s (a peer that never
// arrives: a bug, never a schedule) traps rather than hanging the process.
// The group's counter and its slots for (reduction, parity) `slot`, for the
// one-pass pair and moments below.
template <int C> static __device__ __forceinline__ unsigned* opf_group_bar(unsigned long long* region) {
  return reinterpret_cast<unsigned*>(region + (size_t)(blockIdx.x / C) * 16);
}
template <int C, int G, int S> static __device__ __forceinline__ unsigned long long* opf_group_slots(unsigned long long* region, int slot) {
  return region + (size_t)G * 16 + (size_t)(blockIdx.x / C) * S + slot * C;
}
// Thread 0's arrival on the group's counter and its wait for the group's
// (`rank`: blockIdx.x % C).
template <int C> static __device__ __forceinline__ void opf_group_arrive_wait(unsigned* bar, unsigned rank) {
  const unsigned add = rank == 0 ? 0x80000000u - (unsigned)(C - 1) : 1u;
  unsigned seen, now;
  asm volatile("atom.add.release.gpu.global.u32 %0, [%1], %2;" : "=r"(seen) : "l"(bar), "r"(add) : "memory");
  unsigned long long t0 = 0, t;
  for (unsigned spins = 0;; ++spins) {
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(now) : "l"(bar) : "memory");
    if (((now ^ seen) & 0x80000000u) != 0u) break;
    if ((spins & 1023u) == 1023u) {
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
      if (t0 == 0) t0 = t;
      else if (t - t0 > 10000000000ull) asm volatile("trap;");
    }
  }
}
template <class Op, int C, int G, int S, class T>
static __device__ __forceinline__ T opf_group_reduce(T v, void* smem, unsigned long long* region, int slot) {
  static_assert(sizeof(T) <= 8, "partials of at most 8 bytes");
  const unsigned group = blockIdx.x / C, rank = blockIdx.x % C;
  unsigned* const bar = reinterpret_cast<unsigned*>(region + (size_t)group * 16);
  unsigned long long* const slots = region + (size_t)G * 16 + (size_t)group * S + slot * C;
  v = opf_block_reduce<Op>(v, smem);
  if (threadIdx.x == 0) {
    *reinterpret_cast<volatile T*>(slots + rank) = v;
    opf_group_arrive_wait<C>(bar, rank);
  }
  __syncthreads();
  const int lane = threadIdx.x & 31;
  v = lane < C ? *reinterpret_cast<volatile T*>(slots + lane) : Op::template identity<T>();
  return opf_warp_reduce<Op>(v);
}

// Online softmax: a running (max m, sum s of exp(x - m)) pair, so the max
// and the sum of exp(x - max) take one pass over the row. A larger x
// rescales the sum; -inf adds nothing; NaN makes both NaN (as the max pass
// would have). Pairs combine the same way across lanes and warps.
template <bool FAST> static __device__ __forceinline__ float opf_online_exp(float x) {
  if constexpr (FAST) return opf_exp_fast(x);
  else return expf(x);
}
template <bool FAST> static __device__ __forceinline__ void opf_online_combine(float& m, float& s, float m2, float s2) {
  if (m2 != m2 || m != m) { m = opf_max_nan(m, m2); s = m; return; }
  if (m2 > m) {
    s = s * opf_online_exp<FAST>(m - m2) + s2;
    m = m2;
  } else if (m2 != opf_limits<float>::lowest()) {
    s = s + s2 * opf_online_exp<FAST>(m2 - m);
  }
}
template <bool FAST> static __device__ __forceinline__ void opf_online_add(float& m, float& s, float x) {
  // exp(x - max) is exp(inf - inf) = NaN for x = +inf, as the two passes had it.
  opf_online_combine<FAST>(m, s, x, x == opf_limits<float>::inf() ? opf_limits<float>::nan() : 1.0f);
}
// V values at once (a staged row's 16-byte vector, OPFUSE_ROW_STAGE_ONLINE):
// their max first, their sum of exp against it, then one combine, so an
// element costs one exp and no branch; a vector of -inf adds nothing, +inf
// or NaN make the pair NaN as opf_online_add would.
template <bool FAST, int V> static __device__ __forceinline__ void opf_online_add_vec(float& m, float& s, const float* x) {
  float cm = x[0];
#pragma unroll
  for (int j = 1; j < V; ++j) cm = opf_max_nan(cm, x[j]);
  const float base = cm == -opf_limits<float>::inf() ? 0.0f : cm;
  float cs = 0.0f;
#pragma unroll
  for (int j = 0; j < V; ++j) cs += opf_online_exp<FAST>(x[j] - base);
  opf_online_combine<FAST>(m, s, cm == -opf_limits<float>::inf() ? opf_limits<float>::lowest() : cm, cs);
}
template <bool FAST, int W = 32> static __device__ __forceinline__ void opf_warp_online(float& m, float& s) {
#pragma unroll
  for (int o = W / 2; o > 0; o >>= 1) {
    float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    opf_online_combine<FAST>(m, s, m2, s2);
  }
}
template <bool FAST> static __device__ __forceinline__ void opf_block_online(float& m, float& s, void* smem) {
  float* sm = reinterpret_cast<float*>(smem);
  opf_warp_online<FAST>(m, s);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = (blockDim.x + 31) >> 5;
  __syncthreads();
  if (lane == 0) { sm[warp] = m; sm[32 + warp] = s; }
  __syncthreads();
  m = lane < nwarps ? sm[lane] : opf_limits<float>::lowest();
  s = lane < nwarps ? sm[32 + lane] : 0.0f;
  opf_warp_online<FAST>(m, s);
}
// The online (max, sum) pair across a cluster: each block's pair in its
// 8-byte slot, lane r of every warp reads block r's, the same shuffle tree
// everywhere, so every thread ends with the same pair.
template <bool FAST, int C> static __device__ __forceinline__ void opf_cluster_online(float& m, float& s, void* smem, float* slot) {
  opf_block_online<FAST>(m, s, smem);
  if (threadIdx.x == 0) { slot[0] = m; slot[1] = s; }
  opf_cluster_sync();
  const int lane = threadIdx.x & 31;
  if (lane < C) {
    m = opf_cluster_load(slot, (unsigned)lane);
    s = opf_cluster_load(slot + 1, (unsigned)lane);
  } else {
    m = opf_limits<float>::lowest();
    s = 0.0f;
  }
  opf_warp_online<FAST>(m, s);
}

// The online pair across a group of blocks that is not a cluster: the
// block's pair (every thread holds it) in its 8-byte slot, the group's
// barrier as in opf_group_reduce, every thread ends with the group's pair.
template <bool FAST, int C, int G, int S>
static __device__ __forceinline__ void opf_group_pair_exchange(float& m, float& s, unsigned long long* region, int slot) {
  unsigned long long* const slots = opf_group_slots<C, G, S>(region, slot);
  if (threadIdx.x == 0) {
    volatile float* p = reinterpret_cast<volatile float*>(slots + blockIdx.x % C);
    p[0] = m;
    p[1] = s;
    opf_group_arrive_wait<C>(opf_group_bar<C>(region), blockIdx.x % C);
  }
  __syncthreads();
  const int lane = threadIdx.x & 31;
  if (lane < C) {
    volatile const float* p = reinterpret_cast<volatile const float*>(slots + lane);
    m = p[0];
    s = p[1];
  } else {
    m = opf_limits<float>::lowest();
    s = 0.0f;
  }
  opf_warp_online<FAST>(m, s);
}
// OPFUSE_ROW_GROUP_EXCHANGE with OPFUSE_ROW_STAGE_ONLINE: the threads' online
// pairs combine across the block, then across the group.
template <bool FAST, int C, int G, int S>
static __device__ __forceinline__ void opf_group_online(float& m, float& s, void* smem, unsigned long long* region, int slot) {
  opf_block_online<FAST>(m, s, smem);
  opf_group_pair_exchange<FAST, C, G, S>(m, s, region, slot);
}
// OPFUSE_ROW_GROUP_LOCAL: m is already the block's max (every thread's) and
// the threads' sums of exp(x - m) only add across the block.
template <bool FAST, int C, int G, int S>
static __device__ __forceinline__ void opf_group_local_online(float& m, float& s, void* smem, unsigned long long* region, int slot) {
  s = opf_block_reduce<opf_sum>(s, smem);
  opf_group_pair_exchange<FAST, C, G, S>(m, s, region, slot);
}

// Moments of a staged row in one pass (OPFUSE_ROW_STAGE_MOMENTS): a thread
// sums s1 = x - k and s2 = (x - k)^2 over its n values around its first value
// k; opf_shifted_moments turns them into its mean and squared deviations
// (s2 - s1^2 / n loses at most log2(n) bits: (k - mean)^2 <= m2 as k is one
// of the values; NaN stays NaN). Chan's update combines (count, mean, m2)
// of disjoint parts; parts of count 0 add nothing.
static __device__ __forceinline__ void opf_shifted_moments(float n, float k, float& s1, float& s2) {
  if (n == 0.0f) {
    s1 = 0.0f;
    s2 = 0.0f;
    return;
  }
  const float d = s1 / n;
  float m2 = s2 - s1 * d;
  if (m2 < 0.0f) m2 = 0.0f;
  s1 = k + d;
  s2 = m2;
}
static __device__ __forceinline__ void opf_moments_combine(float& n, float& m, float& m2, float nb, float mb, float m2b) {
  if (nb == 0.0f) return;
  if (n == 0.0f) {
    n = nb;
    m = mb;
    m2 = m2b;
    return;
  }
  const float t = n + nb, d = mb - m, f = nb / t;
  m = fmaf(d, f, m);
  m2 = m2 + m2b + d * d * n * f;
  n = t;
}
template <int W = 32> static __device__ __forceinline__ void opf_warp_moments(float& n, float& m, float& m2) {
#pragma unroll
  for (int o = W / 2; o > 0; o >>= 1) {
    const float nb = __shfl_xor_sync(0xffffffffu, n, o), mb = __shfl_xor_sync(0xffffffffu, m, o),
                m2b = __shfl_xor_sync(0xffffffffu, m2, o);
    opf_moments_combine(n, m, m2, nb, mb, m2b);
  }
}
static __device__ __forceinline__ void opf_block_moments(float& n, float& m, float& m2, void* smem) {
  float* sm = reinterpret_cast<float*>(smem);
  opf_warp_moments(n, m, m2);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = (blockDim.x + 31) >> 5;
  __syncthreads();
  if (lane == 0) {
    sm[warp] = n;
    sm[32 + warp] = m;
    sm[64 + warp] = m2;
  }
  __syncthreads();
  n = lane < nwarps ? sm[lane] : 0.0f;
  m = lane < nwarps ? sm[32 + lane] : 0.0f;
  m2 = lane < nwarps ? sm[64 + lane] : 0.0f;
  opf_warp_moments(n, m, m2);
}
// Across a cluster: each block's triple in its 16-byte slot (two of the
// kernel's 8-byte slots), lane r of every warp reads block r's.
template <int C> static __device__ __forceinline__ void opf_cluster_moments(float& n, float& m, float& m2, void* smem, float* slot) {
  opf_block_moments(n, m, m2, smem);
  if (threadIdx.x == 0) {
    slot[0] = n;
    slot[1] = m;
    slot[2] = m2;
  }
  opf_cluster_sync();
  const int lane = threadIdx.x & 31;
  if (lane < C) {
    n = opf_cluster_load(slot, (unsigned)lane);
    m = opf_cluster_load(slot + 1, (unsigned)lane);
    m2 = opf_cluster_load(slot + 2, (unsigned)lane);
  } else {
    n = 0.0f;
    m = 0.0f;
    m2 = 0.0f;
  }
  opf_warp_moments(n, m, m2);
}

// Across a group of blocks that is not a cluster: the block's triple (every
// thread holds it) in two of its 8-byte slots (`slot` and `slot` + 1), the
// group's barrier as in opf_group_reduce.
template <int C, int G, int S>
static __device__ __forceinline__ void opf_group_moments_exchange(float& n, float& m, float& m2, unsigned long long* region, int slot) {
  unsigned long long* const a = opf_group_slots<C, G, S>(region, slot);
  unsigned long long* const b = a + C;
  if (threadIdx.x == 0) {
    volatile float* p = reinterpret_cast<volatile float*>(a + blockIdx.x % C);
    volatile float* q = reinterpret_cast<volatile float*>(b + blockIdx.x % C);
    p[0] = n;
    p[1] = m;
    q[0] = m2;
    opf_group_arrive_wait<C>(opf_group_bar<C>(region), blockIdx.x % C);
  }
  __syncthreads();
  const int lane = threadIdx.x & 31;
  if (lane < C) {
    volatile const float* p = reinterpret_cast<volatile const float*>(a + lane);
    volatile const float* q = reinterpret_cast<volatile const float*>(b + lane);
    n = p[0];
    m = p[1];
    m2 = q[0];
  } else {
    n = 0.0f;
    m = 0.0f;
    m2 = 0.0f;
  }
  opf_warp_moments(n, m, m2);
}
// OPFUSE_ROW_STAGE_MOMENTS: the threads' triples combine across the block,
// then across the group.
template <int C, int G, int S>
static __device__ __forceinline__ void opf_group_moments(float& n, float& m, float& m2, void* smem, unsigned long long* region,
                                                         int slot) {
  opf_block_moments(n, m, m2, smem);
  opf_group_moments_exchange<C, G, S>(n, m, m2, region, slot);
}
// OPFUSE_ROW_GROUP_LOCAL: n and m are already the block's count and mean
// (every thread's) and the threads' squared deviations from m only add.
template <int C, int G, int S>
static __device__ __forceinline__ void opf_group_local_moments(float& n, float& m, float& m2, void* smem, unsigned long long* region,
                                                               int slot) {
  m2 = opf_block_reduce<opf_sum>(m2, smem);
  opf_group_moments_exchange<C, G, S>(n, m, m2, region, slot);
}

// Outer (column) reductions: lane x of every warp holds a partial of output
// x, warp y a slice of the reduced axis. The warps' partials meet in shared
// memory ([warp][lane]) and every thread folds its column's in warp order;
// with a cluster, every block publishes its 32 totals and every thread folds
// the blocks' in rank order. All threads of a column end with the same total.
template <class Op, int C, class T> static __device__ __forceinline__ T opf_column_reduce(T v, void* smem, T* slots) {
  T* s = reinterpret_cast<T*>(smem);
  const int x = threadIdx.x & 31, y = threadIdx.x >> 5, ny = blockDim.x >> 5;
  __syncthreads();
  s[y * 32 + x] = v;
  __syncthreads();
  v = s[x];
  for (int i = 1; i < ny; ++i) v = Op::f(v, s[i * 32 + x]);
  if constexpr (C > 1) {
    if (y == 0) slots[x] = v;
    opf_cluster_sync();
    v = opf_cluster_load(&slots[x], 0);
#pragma unroll
    for (int r = 1; r < C; ++r) v = Op::f(v, opf_cluster_load(&slots[x], (unsigned)r));
  }
  return v;
}

// argmax / argmin: value and index; ties and NaN go to the first index.
template <bool MAX, class T> static __device__ __forceinline__ void opf_arg_combine(T& v, int64_t& i, T v2, int64_t i2) {
  bool nan1 = v != v, nan2 = v2 != v2;
  bool take = nan2 ? (!nan1 || i2 < i) : (!nan1 && ((MAX ? v2 > v : v2 < v) || (v2 == v && i2 < i)));
  if (take) { v = v2; i = i2; }
}
template <bool MAX, int W = 32, class T> static __device__ __forceinline__ void opf_warp_arg(T& v, int64_t& i) {
#pragma unroll
  for (int o = W / 2; o > 0; o >>= 1) {
    T v2 = __shfl_xor_sync(0xffffffffu, v, o);
    int64_t i2 = __shfl_xor_sync(0xffffffffu, i, o);
    opf_arg_combine<MAX>(v, i, v2, i2);
  }
}
template <bool MAX, class T> static __device__ __forceinline__ void opf_block_arg(T& v, int64_t& i, void* smem) {
  opf_warp_arg<MAX>(v, i);
  T* sv = reinterpret_cast<T*>(smem);
  int64_t* si = reinterpret_cast<int64_t*>(reinterpret_cast<char*>(smem) + 32 * 8);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = (blockDim.x + 31) >> 5;
  __syncthreads();
  if (lane == 0) { sv[warp] = v; si[warp] = i; }
  __syncthreads();
  v = sv[0];
  i = si[0];
  for (int w = 1; w < nwarps; ++w) opf_arg_combine<MAX>(v, i, sv[w], si[w]);
}

// Welford (count, mean, M2), combined with Chan's formula.
static __device__ __forceinline__ void opf_welford_combine(double& m, double& m2, int64_t& n, double mb, double m2b, int64_t nb) {
  if (nb == 0) return;
  if (n == 0) { m = mb; m2 = m2b; n = nb; return; }
  int64_t t = n + nb;
  double d = mb - m;
  m += d * (double)nb / (double)t;
  m2 += m2b + d * d * (double)n * (double)nb / (double)t;
  n = t;
}
template <int W = 32> static __device__ __forceinline__ void opf_warp_welford(double& m, double& m2, int64_t& n) {
#pragma unroll
  for (int o = W / 2; o > 0; o >>= 1) {
    double mb = __shfl_xor_sync(0xffffffffu, m, o), m2b = __shfl_xor_sync(0xffffffffu, m2, o);
    int64_t nb = __shfl_xor_sync(0xffffffffu, n, o);
    opf_welford_combine(m, m2, n, mb, m2b, nb);
  }
}
static __device__ __forceinline__ void opf_block_welford(double& m, double& m2, int64_t& n, void* smem) {
  opf_warp_welford(m, m2, n);
  double* s = reinterpret_cast<double*>(smem);
  int64_t* sn = reinterpret_cast<int64_t*>(s + 64);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = (blockDim.x + 31) >> 5;
  __syncthreads();
  if (lane == 0) { s[warp] = m; s[32 + warp] = m2; sn[warp] = n; }
  __syncthreads();
  m = s[0]; m2 = s[32]; n = sn[0];
  for (int w = 1; w < nwarps; ++w) opf_welford_combine(m, m2, n, s[w], s[32 + w], sn[w]);
}

extern "C" __global__ void opfuse_take_error(int* out) { *out = atomicExch(&opf_error_flag, 0); }
