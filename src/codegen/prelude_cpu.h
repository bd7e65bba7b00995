// Helper code at the top of every generated CPU source. Generated kernels
// compute half types in float and call these helpers by name; the CUDA
// prelude defines the same names for the device.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

typedef _Float16 opf_half;
typedef uint16_t opf_bf16;

static int opf_error_flag = 0;
extern "C" int opfuse_take_error(void) { return __atomic_exchange_n(&opf_error_flag, 0, __ATOMIC_RELAXED); }
static inline void opf_raise(int code) { __atomic_store_n(&opf_error_flag, code, __ATOMIC_RELAXED); }

static inline int64_t opf_imin(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t opf_imax(int64_t a, int64_t b) { return a > b ? a : b; }

static inline float opf_to_float(opf_half h) { return (float)h; }
static inline float opf_to_float(opf_bf16 b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline opf_half opf_float_to_half(float f) { return (opf_half)f; }
static inline opf_bf16 opf_float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (opf_bf16)((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return (opf_bf16)(u >> 16);
}
static inline float opf_round_bf16(float f) { return opf_to_float(opf_float_to_bf16(f)); }
static inline float opf_round_half(float f) { return (float)(opf_half)f; }

template <class T> static inline T opf_nan() { return std::numeric_limits<T>::quiet_NaN(); }
template <class T> static inline T opf_inf() { return std::numeric_limits<T>::infinity(); }
template <class T> static inline T opf_lowest() {
  return std::numeric_limits<T>::has_infinity ? -std::numeric_limits<T>::infinity() : std::numeric_limits<T>::lowest();
}
template <class T> static inline T opf_highest() {
  return std::numeric_limits<T>::has_infinity ? std::numeric_limits<T>::infinity() : std::numeric_limits<T>::max();
}

template <class T> static inline bool opf_isnan(T x) { return x != x; }
template <class T> static inline T opf_max_nan(T a, T b) { return (b > a || b != b) ? b : a; }
template <class T> static inline T opf_min_nan(T a, T b) { return (b < a || b != b) ? b : a; }
template <class T> static inline T opf_maximum(T a, T b) { return (a != a || b != b) ? (a != a ? a : b) : (a > b ? a : b); }
template <class T> static inline T opf_minimum(T a, T b) { return (a != a || b != b) ? (a != a ? a : b) : (a < b ? a : b); }
template <class T> static inline T opf_clamp_min(T x, T lo) { return x < lo ? lo : x; }
template <class T> static inline T opf_clamp_max(T x, T hi) { return x > hi ? hi : x; }
template <class T> static inline T opf_relu(T x) { return x < (T)0 ? (T)0 : x; }
static inline bool opf_relu(bool x) { return x; }
template <class T> static inline T opf_abs(T x) { return x < (T)0 ? -x : x; }
static inline float opf_abs(float x) { return std::fabs(x); }
static inline double opf_abs(double x) { return std::fabs(x); }
template <class T> static inline T opf_sign(T x) { return (T)((x > (T)0) - (x < (T)0)) + (x != x ? x : (T)0); }

// glibc's vector math library (libmvec) has SIMD versions of these; the
// declarations let `omp simd` loops call them (max error 4 ulp in float).
extern "C" {
#pragma omp declare simd notinbranch
float expf(float);
#pragma omp declare simd notinbranch
float logf(float);
}
static inline float opf_exp(float x) { return expf(x); }
static inline double opf_exp(double x) { return std::exp(x); }
static inline float opf_log(float x) { return logf(x); }
static inline double opf_log(double x) { return std::log(x); }
static inline float opf_log1p(float x) { return std::log1p(x); }
static inline double opf_log1p(double x) { return std::log1p(x); }
static inline float opf_expm1(float x) { return std::expm1(x); }
static inline double opf_expm1(double x) { return std::expm1(x); }
static inline float opf_sqrt(float x) { return std::sqrt(x); }
static inline double opf_sqrt(double x) { return std::sqrt(x); }
static inline float opf_rsqrt(float x) { return 1.0f / std::sqrt(x); }
static inline double opf_rsqrt(double x) { return 1.0 / std::sqrt(x); }
static inline float opf_tanh(float x) { return std::tanh(x); }
static inline double opf_tanh(double x) { return std::tanh(x); }
static inline float opf_erf(float x) { return std::erf(x); }
static inline double opf_erf(double x) { return std::erf(x); }
static inline float opf_sin(float x) { return std::sin(x); }
static inline double opf_sin(double x) { return std::sin(x); }
static inline float opf_cos(float x) { return std::cos(x); }
static inline double opf_cos(double x) { return std::cos(x); }
static inline float opf_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
static inline double opf_sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
static inline float opf_silu(float x) { return x / (1.0f + expf(-x)); }
static inline double opf_silu(double x) { return x / (1.0 + std::exp(-x)); }
static inline float opf_gelu_erf(float x) { return 0.5f * x * (1.0f + std::erf(x * 0.70710678118654752f)); }
static inline double opf_gelu_erf(double x) { return 0.5 * x * (1.0 + std::erf(x * 0.70710678118654752)); }
static inline float opf_gelu_tanh(float x) {
  return 0.5f * x * (1.0f + std::tanh(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}
static inline double opf_gelu_tanh(double x) {
  return 0.5 * x * (1.0 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
}
// grad * d/dx gelu(x) (gelu_backward), computed in float for half types as PyTorch does.
static inline float opf_gelu_tanh_backward(float g, float x) {
  const float t = std::tanh(0.7978845608028654f * (x + 0.044715f * x * x * x));
  return g * (0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * 0.7978845608028654f * (1.0f + 0.134145f * x * x));
}
static inline double opf_gelu_tanh_backward(double g, double x) {
  const double t = std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x));
  return g * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * x * x));
}
static inline float opf_gelu_erf_backward(float g, float x) {
  return g * (0.5f * (1.0f + std::erf(x * 0.70710678118654752f)) + x * 0.3989422804014327f * std::exp(-0.5f * x * x));
}
static inline double opf_gelu_erf_backward(double g, double x) {
  return g * (0.5 * (1.0 + std::erf(x * 0.70710678118654752)) + x * 0.3989422804014327 * std::exp(-0.5 * x * x));
}
static inline float opf_pow(float a, float b) { return std::pow(a, b); }
static inline double opf_pow(double a, double b) { return std::pow(a, b); }
template <class T> static inline T opf_pow(T a, T b) {
  if (b < 0) return (a == 1) ? 1 : (a == -1 ? ((b & 1) ? -1 : 1) : 0);
  T r = 1;
  while (b) {
    if (b & 1) r *= a;
    a *= a;
    b >>= 1;
  }
  return r;
}

// Floor and truncating division: PyTorch's rules, an error on integer /0.
template <class T> static inline T opf_floordiv(T a, T b) {
  if (b == 0) { opf_raise(1); return 0; }
  T q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}
template <class T> static inline T opf_truncdiv(T a, T b) {
  if (b == 0) { opf_raise(1); return 0; }
  return a / b;
}
template <class F> static inline F opf_floordiv_float(F a, F b) {
  if (b == 0) return a / b;
  F m = std::fmod(a, b);
  F d = (a - m) / b;
  if (m != 0 && ((b < 0) != (m < 0))) d -= 1;
  if (d == 0) return std::copysign((F)0, a / b);
  F f = std::floor(d);
  if (d - f > (F)0.5) f += 1;
  return f;
}
static inline float opf_floordiv(float a, float b) { return opf_floordiv_float(a, b); }
static inline double opf_floordiv(double a, double b) { return opf_floordiv_float(a, b); }
static inline float opf_truncdiv(float a, float b) { return std::trunc(a / b); }
static inline double opf_truncdiv(double a, double b) { return std::trunc(a / b); }
