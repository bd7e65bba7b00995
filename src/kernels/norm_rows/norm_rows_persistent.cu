// opfuse layer_norm / rms_norm forward for long rows whose weight and bias
// fit in shared memory: one persistent CTA an SM, the weight and bias read
// from HBM once a CTA, the next row's loads in flight while a row is reduced
// and written.
//
// Compiled at run time by NVRTC. It includes NO header (NVRTC on the target
// machines finds no CUDA headers): every device helper is plain C++ or
// inline PTX.
//
// For a row r of n columns, float32 math, one rounding of the output:
//   layer_norm: mean_r = sum(x) / n, var_r = sum((x - mean_r)^2) / n (two
//               passes over the row in registers: exact, no Welford),
//               rstd_r = rsqrt(var_r + eps), y = (x - mean_r) * rstd_r * w + b
//   rms_norm:   rstd_r = rsqrt(sum(x^2) / n + eps), y = x * rstd_r * w
// (w, b: 1 and 0 where absent). mean and rstd (float32 [rows]) are written
// where asked (the training graph's native_layer_norm returns them). The CPU
// reference with the same semantics is norm_rows_reference.{h,cpp}.
//
// Why a hand-written kernel: the generated row kernels (three 512-thread
// CTAs an SM, each staging a row in shared memory) read the weight and
// bias again for every row. On the H200 at 8192 x 32768 bf16 that is
// 128 KB of L2 reads a row beside the row's 128 KB of HBM traffic, and
// layer_norm ran 288 us against 270 without its weight and bias
// (perf-notes, session 20: 88.7% of the copy against ~95%). Here each CTA
// holds the weight and bias in shared memory for all its rows, so only the
// row itself moves.
//
// Design:
// - Grid: one CTA of THREADS (1024) an SM, persistent: CTA i takes the rows
//   i, i + G, i + 2G, ... (G CTAs).
// - Thread t holds NV 16-byte vectors of a row, columns (j * THREADS + t) *
//   VEC for j < NV (coalesced: 16 bytes a lane); vectors past n (n % VEC ==
//   0) are zeros and never stored. The next row's NV vectors are loaded at
//   the top of a row's work (streaming, no L1 allocation), so an SM keeps
//   THREADS * NV * 16 bytes (64 KB at NV = 4) in flight while it reduces
//   and writes the current row.
// - The weight and bias go into shared memory once (2 * n elements), read
//   back as 16-byte vectors in the thread's own columns (no bank conflict).
// - Block sums: warp shuffles, then the warps' sums through shared memory;
//   two alternating slots, so one barrier a sum.
//
// Requirements (checked by the launcher, src/runtime/norm_rows_launcher.cpp):
// n % VEC == 0 and n <= NV * THREADS * VEC; x and y 16-byte aligned with row
// strides (elements) multiples of VEC; w and b contiguous, 16-byte aligned;
// mean and rstd float32 contiguous. Launch: grid min(rows, CTAs resident),
// block THREADS, dynamic shared memory (w and b) n * sizeof(elem) * (w? +
// b?), one argument NormRowsParams by value.
//
// Entry point: the launcher appends
//   OPFUSE_NORM_ROWS_ENTRY(name, bf16, THREADS, NV, RMS, HAS_W, HAS_B)
// which defines an extern "C" kernel (no name mangling to look up).

namespace opfuse_norm_rows {

typedef unsigned int u32;
typedef long long i64;

struct bf16 { static constexpr int vec = 8; };
struct f16 { static constexpr int vec = 8; };
struct f32 { static constexpr int vec = 4; };

// Kernel argument; mirrored by the launcher (only append fields, in both places).
struct NormRowsParams {
  const void* x;  // [rows, n], unit column stride
  i64 ld_x;       // elements between rows
  const void* w;  // [n] or null (weight 1)
  const void* b;  // [n] or null (bias 0)
  void* y;        // [rows, n]
  i64 ld_y;
  float* mean;  // [rows] or null
  float* rstd;  // [rows] or null
  float eps;
  int rows, n;
};
static_assert(sizeof(NormRowsParams) == 80, "NormRowsParams layout is a launch ABI");

struct V4 { u32 x, y, z, w; };

__device__ __forceinline__ u32 word_of(const V4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// Element j of a 16-byte vector as float32.

// Two float32 values rounded to nearest even into one word (lo first).
__device__ __forceinline__ u32 round2(bf16, float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ u32 round2(f16, float lo, float hi) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}


// One output word from one word of x, of the weight and of the bias (one
// float32 element or two 16-bit ones).
__device__ __forceinline__ float half_of(bf16, u32 w, int h) { return __int_as_float(h ? (w & 0xffff0000u) : (w << 16)); }
__device__ __forceinline__ float half_of(f16, u32 w, int h) {
  const unsigned short b = static_cast<unsigned short>(h ? (w >> 16) : (w & 0xffffu));
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(b));
  return f;
}
// Element j of a 16-byte vector as float32.
template <class E>
__device__ __forceinline__ float elem(E, const V4& v, int j) {
  if constexpr (E::vec == 4) return __int_as_float(word_of(v, j));
  else return half_of(E{}, word_of(v, j >> 1), j & 1);
}

template <class E, bool HAS_W, bool HAS_B>
__device__ __forceinline__ u32 out_word(u32 xw, u32 ww, u32 bw, float mean, float rstd) {
  if constexpr (E::vec == 4) {
    float o = (__int_as_float(xw) - mean) * rstd;
    if constexpr (HAS_W) o *= __int_as_float(ww);
    if constexpr (HAS_B) o += __int_as_float(bw);
    return __float_as_int(o);
  } else {
    float lo = (half_of(E{}, xw, 0) - mean) * rstd, hi = (half_of(E{}, xw, 1) - mean) * rstd;
    if constexpr (HAS_W) lo *= half_of(E{}, ww, 0), hi *= half_of(E{}, ww, 1);
    if constexpr (HAS_B) lo += half_of(E{}, bw, 0), hi += half_of(E{}, bw, 1);
    return round2(E{}, lo, hi);
  }
}

// The rows: 16 bytes global -> shared, L1 bypassed (sm_80+).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(static_cast<u32>(__cvta_generic_to_shared(smem))), "l"(gmem)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
__device__ __forceinline__ V4 load_vector(const void* p) {
  V4 r;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
__device__ __forceinline__ void store_vector(void* p, const V4& v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// The CTA's sum of v, in every thread. `slots` holds 2 x 32 floats; `k`
// alternates between its halves, so the next sum may write its half while
// a slow warp still reads this one (the barrier between them orders it).
template <int THREADS>
__device__ __forceinline__ float block_sum(float v, float* slots, int k) {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "whole warps");
  constexpr int kWarps = THREADS / 32;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  float* s = slots + (k & 1) * 32;
  const int lane = threadIdx.x & 31;
  if (lane == 0) s[threadIdx.x >> 5] = v;
  __syncthreads();
  float t = lane < kWarps ? s[lane] : 0.f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
  return t;
}

template <class E, int THREADS, int NV, bool RMS, bool HAS_W, bool HAS_B>
__device__ __forceinline__ void norm_rows(const NormRowsParams& p) {
  extern __shared__ __align__(16) V4 opf_wb[];  // the weight's vectors, then the bias's
  __shared__ float slots[64];
  constexpr int VEC = E::vec;
  const int t = threadIdx.x;
  const int nvec = p.n / VEC;
  const char* x = static_cast<const char*>(p.x);
  char* y = static_cast<char*>(p.y);
  constexpr int kBytes = 16 / VEC;  // bytes an element

  // The row slot: thread t's own vectors of the next row, copied with
  // cp.async; each thread reads back only what it copied, so no barrier
  // guards the slot.
  V4* slot = opf_wb + (HAS_W ? nvec : 0) + (HAS_B ? nvec : 0);
  auto copy_row = [&](int row) {
    const char* base = x + static_cast<i64>(row) * p.ld_x * kBytes;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int v = j * THREADS + t;
      if (v < nvec) cp_async16(slot + v, base + static_cast<i64>(v) * 16);
    }
    cp_async_commit();
  };
  int row = blockIdx.x;
  if (row < p.rows) copy_row(row);  // in flight while the weight and bias arrive
  u32* ws = reinterpret_cast<u32*>(opf_wb);  // read back a word at a time
  u32* bs = reinterpret_cast<u32*>(opf_wb + (HAS_W ? nvec : 0));
  for (int v = t; v < nvec; v += THREADS) {
    if constexpr (HAS_W) opf_wb[v] = load_vector(static_cast<const char*>(p.w) + static_cast<i64>(v) * 16);
    if constexpr (HAS_B) opf_wb[(HAS_W ? nvec : 0) + v] = load_vector(static_cast<const char*>(p.b) + static_cast<i64>(v) * 16);
  }
  __syncthreads();
  const float inv_n = 1.f / static_cast<float>(p.n);
  int k = 0;
  for (; row < p.rows; row += gridDim.x) {
    V4 cur[NV];
    cp_async_wait_all();
#pragma unroll
    for (int j = 0; j < NV; ++j) cur[j] = j * THREADS + t < nvec ? slot[j * THREADS + t] : V4{0, 0, 0, 0};
    // The next row's copy goes out now, over the vectors just read (the
    // same thread's shared-memory loads come first), and is in flight while
    // this row is reduced and written.
    if (row + static_cast<int>(gridDim.x) < p.rows) copy_row(row + gridDim.x);
    float mean = 0.f, ss = 0.f;
    if constexpr (!RMS) {
      float s = 0.f;
#pragma unroll
      for (int j = 0; j < NV; ++j)
#pragma unroll
        for (int e = 0; e < VEC; ++e) s += elem(E{}, cur[j], e);  // zeros past n add nothing
      mean = block_sum<THREADS>(s, slots, k++) * inv_n;
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        if (j * THREADS + t < nvec) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            const float d = elem(E{}, cur[j], e) - mean;
            ss += d * d;
          }
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < NV; ++j)
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float v = elem(E{}, cur[j], e);
          ss += v * v;
        }
    }
    const float rstd = rsqrtf(block_sum<THREADS>(ss, slots, k++) * inv_n + p.eps);
    if (t == 0) {
      if (p.mean) p.mean[row] = mean;
      if (p.rstd) p.rstd[row] = rstd;
    }
    char* out = y + static_cast<i64>(row) * p.ld_y * kBytes;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int v = j * THREADS + t;
      if (v < nvec) {
        // A word (one or two elements) at a time, the weight and bias read
        // from shared memory a word at a time: fewer registers live than
        // whole vectors (the next row's vectors already hold 4 * NV).
        u32 o[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const u32 wwd = HAS_W ? ws[v * 4 + i] : 0u, bwd = HAS_B ? bs[v * 4 + i] : 0u;
          o[i] = out_word<E, HAS_W, HAS_B>(word_of(cur[j], i), wwd, bwd, mean, rstd);
        }
        store_vector(out + static_cast<i64>(v) * 16, V4{o[0], o[1], o[2], o[3]});
      }
    }
  }
}

}  // namespace opfuse_norm_rows

#define OPFUSE_NORM_ROWS_ENTRY(name, E, THREADS, NV, RMS, HAS_W, HAS_B)                                 \
  extern "C" __global__ void __launch_bounds__(THREADS, 1) name(const opfuse_norm_rows::NormRowsParams p) { \
    opfuse_norm_rows::norm_rows<opfuse_norm_rows::E, THREADS, NV, RMS, HAS_W, HAS_B>(p);                  \
  }
