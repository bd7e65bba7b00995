// An experiment, not part of opfuse (docs/perf-notes.md, session 20): a
// layer_norm / rms_norm forward for long rows with one persistent CTA an
// SM, the weight and bias held in registers for all of its rows, the rows
// streamed through a ring of shared-memory slots a few rows ahead. It ran
// at ~90% of the copy at 8192 x 32768 bf16 (282 us against the generated
// kernel's 286), and below the generated kernel at 16384 columns, so it was
// not wired in; norm_rows_bench.cu (beside it) checks and times it alone.
//
// Compiled at run time by NVRTC. It includes NO header (NVRTC on the target
// machines finds no CUDA headers): every device helper is plain C++ or
// inline PTX.
//
// For a row r of n columns, float32 math, one rounding of the output:
//   layer_norm: mean_r = sum(x) / n, var_r = sum((x - mean_r)^2) / n (two
//               passes over the row in shared memory: exact, no Welford),
//               rstd_r = rsqrt(var_r + eps), y = (x - mean_r) * rstd_r * w + b
//   rms_norm:   rstd_r = rsqrt(sum(x^2) / n + eps), y = x * rstd_r * w
// (w, b: 1 and 0 where absent). mean and rstd (float32 [rows]) are written
// where asked (the training graph's native_layer_norm returns them).
// norm_rows_bench.cu checks rows against a float64 CPU computation.
//
// Why a hand-written kernel: the generated row kernels (three 512-thread
// CTAs an SM, each staging a 64 KB row in shared memory) read the weight
// and bias again for every row, and at 32768 16-bit columns they no longer
// fit in what is left of L1 (they do at 16384: 99% of the copy there). On
// the H200 at 8192 x 32768 bf16, layer_norm ran 288-300 us against 270-280
// without its weight and bias (perf-notes, session 20). A first version of
// this kernel (1024 threads, the weight and bias in shared memory, one row
// slot) ran at 89%: one row in flight an SM is not enough.
//
// Design:
// - Grid: one CTA of THREADS (512) an SM, persistent: CTA i takes the rows
//   i, i + G, i + 2G, ... (G CTAs).
// - Thread t owns NV 16-byte vectors of a row, columns (j * THREADS + t) *
//   VEC for j < NV (coalesced: 16 bytes a lane); vectors past n (n % VEC ==
//   0) are zeros and never stored. Its weight and bias vectors stay in
//   registers (8 NV of them; 512 threads an SM leave 128 registers a thread).
// - The ring: SLOTS row slots in shared memory; the thread copies its own
//   vectors of the row SLOTS - 1 ahead with cp.async (L1 bypassed) into the
//   slot the previous row left, waits for its own copies of this row and
//   reads them in each pass: SLOTS - 1 rows in flight an SM, no barrier.
// - Block sums: warp shuffles, then the warps' sums through shared memory;
//   two alternating slots, so one barrier a sum.
//
// Requirements (the caller's to check):
// sm_80 or newer; n % VEC == 0 and n <= NV * THREADS * VEC; x and y 16-byte
// aligned with row strides (elements) multiples of VEC; w and b contiguous,
// 16-byte aligned; mean and rstd float32 contiguous; rows < 2^31. Launch:
// grid min(rows, SMs), block THREADS, dynamic shared memory SLOTS * n *
// sizeof(elem), one argument NormRowsParams by value.
//
// Entry point: the includer writes
//   OPFUSE_NORM_ROWS_ENTRY(name, bf16, THREADS, NV, EXACT, SLOTS, RMS, HAS_W, HAS_B)
// which defines an extern "C" kernel (no name mangling to look up).

namespace opfuse_norm_rows {

typedef unsigned int u32;
typedef long long i64;

struct bf16 { static constexpr int vec = 8; };
struct f16 { static constexpr int vec = 8; };
struct f32 { static constexpr int vec = 4; };

// Kernel argument (the includer fills it; a launch ABI).
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

template <int N>
__device__ __forceinline__ void cp_async_wait_pending() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

template <class E, int THREADS, int NV, bool EXACT, int SLOTS, bool RMS, bool HAS_W, bool HAS_B>
__device__ __forceinline__ void norm_rows(const NormRowsParams& p) {
  static_assert(SLOTS >= 2, "a slot being read and one being filled at least");
  // The ring: SLOTS rows; thread t copies and reads back only its own
  // vectors of each slot, so no barrier guards it.
  extern __shared__ __align__(16) V4 opf_ring[];
  __shared__ float sums[64];
  constexpr int VEC = E::vec;
  constexpr int kBytes = 16 / VEC;  // bytes an element
  const int t = threadIdx.x;
  const int nvec = p.n / VEC;
  const int grid = static_cast<int>(gridDim.x);
  // Bit j: vector j * THREADS + t lies within the row (EXACT: every one
  // does, n == NV * THREADS * VEC, and no check is compiled: with the
  // checks, NV = 8 spilled ~100 bytes a thread).
  const u32 mine = t < nvec ? ((nvec - 1 - t) / THREADS >= NV - 1 ? (1u << NV) - 1 : (2u << ((nvec - 1 - t) / THREADS)) - 1) : 0u;
  const char* x = static_cast<const char*>(p.x);
  char* y = static_cast<char*>(p.y);

  auto copy_row = [&](int slot, int row) {
    if (row < p.rows) {
      const char* base = x + static_cast<i64>(row) * p.ld_x * kBytes;
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        const int v = j * THREADS + t;
        if ((EXACT || (mine >> j & 1u))) cp_async16(opf_ring + slot * nvec + v, base + static_cast<i64>(v) * 16);
      }
    }
    cp_async_commit();  // an empty group past the last row keeps the count uniform
  };
  int row = blockIdx.x;
#pragma unroll
  for (int s = 0; s < SLOTS - 1; ++s) copy_row(s, row + s * grid);
  // The weight and bias of the thread's columns, in registers for every row.
  V4 wv[NV], bv[NV];
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int v = j * THREADS + t;
    wv[j] = HAS_W && (EXACT || (mine >> j & 1u)) ? load_vector(static_cast<const char*>(p.w) + static_cast<i64>(v) * 16) : V4{0, 0, 0, 0};
    bv[j] = HAS_B && (EXACT || (mine >> j & 1u)) ? load_vector(static_cast<const char*>(p.b) + static_cast<i64>(v) * 16) : V4{0, 0, 0, 0};
  }
  const float inv_n = 1.f / static_cast<float>(p.n);
  int k = 0, slot = 0;
  for (; row < p.rows; row += grid) {
    // The slot the previous row was read from takes the row SLOTS - 1 on.
    copy_row(slot == 0 ? SLOTS - 1 : slot - 1, row + (SLOTS - 1) * grid);
    cp_async_wait_pending<SLOTS - 1>();  // this row's copies have landed
    // The row is read from its slot in each pass (three for layer_norm):
    // registers hold the weight and bias, and shared memory has bandwidth
    // to spare (3 x 64 KB a row against HBM's ~32 KB a microsecond an SM).
    const V4* cur = opf_ring + slot * nvec;
    slot = slot == SLOTS - 1 ? 0 : slot + 1;
    // The sum of f over the thread's elements of the row.
    auto row_sum = [&](auto f) {
      float acc = 0.f;
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        if (EXACT || (mine >> j & 1u)) {
          const V4 c = cur[j * THREADS + t];
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc += f(elem(E{}, c, e));
        }
      }
      return acc;
    };
    // rms_norm is layer_norm's second pass about a mean of 0.
    const float mean = RMS ? 0.f : block_sum<THREADS>(row_sum([](float v) { return v; }), sums, k++) * inv_n;
    const float ss = row_sum([mean](float v) { return (v - mean) * (v - mean); });
    const float rstd = rsqrtf(block_sum<THREADS>(ss, sums, k++) * inv_n + p.eps);
    if (t == 0) {
      if (p.mean) p.mean[row] = mean;
      if (p.rstd) p.rstd[row] = rstd;
    }
    char* out = y + static_cast<i64>(row) * p.ld_y * kBytes;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int v = j * THREADS + t;
      if ((EXACT || (mine >> j & 1u))) {
        const V4 c = cur[v];
        u32 o[4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
          o[i] = out_word<E, HAS_W, HAS_B>(word_of(c, i), word_of(wv[j], i), word_of(bv[j], i), mean, rstd);
        store_vector(out + static_cast<i64>(v) * 16, V4{o[0], o[1], o[2], o[3]});
      }
    }
  }
  cp_async_wait_pending<0>();  // no copy outlives the CTA
}

}  // namespace opfuse_norm_rows

#define OPFUSE_NORM_ROWS_ENTRY(name, E, THREADS, NV, EXACT, SLOTS, RMS, HAS_W, HAS_B)                  \
  extern "C" __global__ void __launch_bounds__(THREADS, 1) name(const opfuse_norm_rows::NormRowsParams p) { \
    opfuse_norm_rows::norm_rows<opfuse_norm_rows::E, THREADS, NV, EXACT, SLOTS, RMS, HAS_W, HAS_B>(p);    \
  }
