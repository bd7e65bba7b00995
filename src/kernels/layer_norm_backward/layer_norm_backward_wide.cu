// opfuse layer_norm backward for wide rows: dx, and the weight and bias
// gradients' partial column sums, from one read of dy and x.
//
// Compiled at run time by NVRTC. It includes NO header (NVRTC on the target
// machines finds no CUDA headers): every device helper is plain C++ or
// inline PTX.
//
// For a row r of n columns (xhat = (x - mean_r) * rstd_r, g = dy * w):
//   dx[r, c]       = rstd_r * (g - sum_c(g) / n - xhat * sum_c(g * xhat) / n)
//   part_dw[p, c]  = sum over the rows of part p of dy * xhat
//   part_db[p, c]  = sum over the rows of part p of dy
// with float32 math on bf16, f16 or f32 elements; finish_body adds the
// parts in part order (deterministic: no atomics). The CPU reference with the
// same semantics is layer_norm_backward_reference.{h,cpp}.
//
// Why a hand-written kernel: the generated row kernels fold the weight and
// bias gradients into the dx kernel (column partials) only while a block
// holds a whole row and its 2 x n float32 partials; at n = 32768 that is
// 256 KB, more than an SM has, so the generated plan re-reads dy and x in a
// column kernel (2.5 bytes read for each byte the op needs: 43% of the
// floor on the H200 at 8192 x 32768 bf16). Here a thread-block cluster of C
// CTAs shares each row: CTA q owns a fixed slice of the columns for the
// whole kernel, so its threads keep the partials of their columns in
// registers across every row they see, and the row's two sums cross the
// cluster through distributed shared memory. The earlier cluster variant of
// the generated kernel paid two cluster barriers a row (~5 us a row,
// slower than the re-read); here R rows go through one cluster barrier
// together, and two CTAs an SM overlap one's barrier with the other's loads.
//
// Design:
// - The grid is persistent: as many clusters as are resident (the launcher
//   asks the driver), cluster p taking the row batches p, p + P, p + 2P, ...
//   of R rows each; part p of the workspace is cluster p's.
// - Thread t of CTA q holds NV 16-byte vectors of columns
//   ((q * NV + j) * THREADS + t) * VEC: each load is a coalesced 16 bytes a
//   lane; vectors past n (n % VEC == 0) are zeros and never stored.
// - A batch: all 2 R NV vector loads of dy and x issued at once (streaming,
//   no L1 allocation), the row statistics (mean, rstd: float32 [rows]), then
//   per row the thread's sums of g and g * xhat and its dw, db partials;
//   2R sums go through warp shuffles, the block's warps (shared memory, in
//   warp order) and the cluster (rank order), one barrier of each a batch;
//   then dx per row, rounded once, stored as 16-byte vectors.
// - The cluster slot of a batch alternates between two buffers: a CTA
//   writes slot s of batch k + 2 only after batch k + 1's cluster barrier,
//   which every CTA reaches after reading slot s of batch k.
//
// Requirements (checked by the launcher,
// src/runtime/layer_norm_backward_wide_launcher.cpp): sm_90 (clusters);
// n % VEC == 0 and n <= C * NV * THREADS * VEC; dy, x, dx 16-byte aligned with
// row strides (elements) multiples of VEC; the weight contiguous; mean and
// rstd float32 contiguous; rows * stride < 2^63. Launch: grid P * C, block
// THREADS, the ring's dynamic shared memory (staged variants), one argument
// LnBwdParams by value; then the finish kernel over (ceil(n / 256), 2)
// blocks of 256 threads (both gradients). Lane groups: n <= G * NV * VEC,
// grid P CTAs, then the split finish over (ceil(n / 32), 2) blocks of 1024.
//
// Entry points: the launcher appends
//   OPFUSE_LNBWD_ENTRY(name, bf16, THREADS, C, R, NV, MIN_BLOCKS)   or
//   OPFUSE_LNBWD_STAGED_ENTRY(name, bf16, THREADS, C, R, NV, MIN_BLOCKS, STAGES)   or
//   OPFUSE_LNBWD_PIPELINED_ENTRY(name, bf16, THREADS, C, R, NV, MIN_BLOCKS, STAGES)
//   OPFUSE_LNBWD_FINISH_ENTRY(name, bf16)
// or, for short rows (lane groups, G lanes a row),
//   OPFUSE_LNBWD_GROUPS_ENTRY(name, bf16, THREADS, G, R, NV, MIN_BLOCKS)
//   OPFUSE_LNBWD_FINISH_SPLIT_ENTRY(name, bf16)
// which define extern "C" kernels (no name mangling to look up).

namespace opfuse_lnbwd {

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;

struct bf16 { static constexpr int vec = 8; };
struct f16 { static constexpr int vec = 8; };
struct f32 { static constexpr int vec = 4; };

// Kernel argument; mirrored by the launcher (only append fields, in both places).
struct LnBwdParams {
  const void* dy;  // [rows, n], unit column stride
  i64 ld_dy;       // elements between rows
  const void* x;
  i64 ld_x;
  const float* mean;  // [rows]
  const float* rstd;  // [rows]
  const void* w;      // [n], or null (weight 1)
  void* dx;           // [rows, n] or null (dx not asked)
  i64 ld_dx;
  float* part_dw;  // [parts, n] or null
  float* part_db;  // [parts, n] or null
  int rows, n;
};
static_assert(sizeof(LnBwdParams) == 96, "LnBwdParams layout is a launch ABI");

struct V4 { u32 x, y, z, w; };

// ---------------------------------------------------------------------------
// Elements (round to nearest even, as PyTorch)
// ---------------------------------------------------------------------------

__device__ __forceinline__ u32 word(const V4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// Element j of a 16-byte vector, as float32.
__device__ __forceinline__ float lane(bf16, const V4& v, int j) {
  const u32 w = word(v, j >> 1);
  return __int_as_float((j & 1) ? (w & 0xffff0000u) : (w << 16));
}
__device__ __forceinline__ float lane(f16, const V4& v, int j) {
  const u32 w = word(v, j >> 1);
  const u16 h = static_cast<u16>((j & 1) ? (w >> 16) : (w & 0xffffu));
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ float lane(f32, const V4& v, int j) { return __int_as_float(word(v, j)); }

// Two float32 values as one word of two 16-bit elements (lo first).
__device__ __forceinline__ u32 pack2(bf16, float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ u32 pack2(f16, float lo, float hi) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

template <class E>
__device__ __forceinline__ V4 pack(const float (&f)[E::vec]) {
  V4 r;
  if constexpr (E::vec == 4) {
    r.x = __float_as_int(f[0]), r.y = __float_as_int(f[1]), r.z = __float_as_int(f[2]), r.w = __float_as_int(f[3]);
  } else {
    r.x = pack2(E{}, f[0], f[1]), r.y = pack2(E{}, f[2], f[3]), r.z = pack2(E{}, f[4], f[5]), r.w = pack2(E{}, f[6], f[7]);
  }
  return r;
}

__device__ __forceinline__ u16 to_bits(bf16, float f) {
  u16 h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
__device__ __forceinline__ u16 to_bits(f16, float f) {
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

// ---------------------------------------------------------------------------
// PTX helpers
// ---------------------------------------------------------------------------

// dy and x: read once: no L1 allocation.
__device__ __forceinline__ V4 ld_stream(const void* p) {
  V4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}
// The weight and the row statistics: small, read by many CTAs: cached.
__device__ __forceinline__ V4 ld_cached(const void* p) {
  V4 r;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
// dx: written once, not read again here: streaming store.
__device__ __forceinline__ void st_stream(void* p, const V4& v) {
  asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

__device__ __forceinline__ u32 cluster_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// The same barrier where the caller has already released its shared-memory
// writes (fence.release.sync_restrict::shared::cta.cluster): a relaxed
// arrive, an acquiring wait.
__device__ __forceinline__ void cluster_sync_shared() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// A float in the shared memory of CTA `rank` of this cluster, at the
// address `local` has in this CTA.
__device__ __forceinline__ float ld_cluster(const float* local, u32 rank) {
  u32 addr = static_cast<u32>(__cvta_generic_to_shared(local)), remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}

// cp.async (sm_80+): 16 bytes global -> shared, L1 bypassed; 4 bytes through L1.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(static_cast<u32>(__cvta_generic_to_shared(smem))), "l"(gmem)
               : "memory");
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(static_cast<u32>(__cvta_generic_to_shared(smem))), "l"(gmem)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ V4 ld_shared(const void* p) {
  V4 r;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "r"(static_cast<u32>(__cvta_generic_to_shared(p))));
  return r;
}

// ---------------------------------------------------------------------------
// The arithmetic of one element (the kernel is bound by issued
// instructions, not by DRAM: ncu, perf-notes session 12)
// ---------------------------------------------------------------------------

// Pass 1: the row's sums of g = dy * w and g * xhat, and the column
// partials of dy * xhat and dy. Rows past the end come with dy = x = mean =
// rstd = 0 and add zeros.
__device__ __forceinline__ void add_terms(float d, float xv, float w, float mu, float rs, float& s1, float& s2,
                                          float& pdw, float& pdb) {
  const float xh = (xv - mu) * rs;
  const float g = d * w;
  s1 += g;
  s2 = fmaf(g, xh, s2);
  pdw = fmaf(d, xh, pdw);
  pdb += d;
}

// A row's dx coefficients from its means of g (m1) and of g * xhat (m2):
//   dx = rs * (g - m1 - xhat * m2) = a * g + c - b * (x - mu)
// with a = rs, b = rs^2 * m2, c = -rs * m1: two FMAs an element after g.
struct DxRow {
  float mu, a, b, c;
  __device__ __forceinline__ DxRow(float mu_, float rs, float m1, float m2) : mu(mu_), a(rs), b(rs * rs * m2), c(-rs * m1) {}
  __device__ __forceinline__ float operator()(float d, float xv, float w) const {
    return fmaf(-b, xv - mu, fmaf(a, d * w, c));
  }
};

// The weight of a thread's NV vectors as float32 (1 where there is no
// weight), in shared memory for the whole kernel: float32 saves the
// unpacking of a 16-bit weight in both passes, shared memory because every
// cluster barrier's acquire invalidates L1 (a reload would wait on L2).
// Each thread writes and reads back only its own float4s (no barrier).
template <class E, int THREADS, int NV>
struct WeightSmem {
  static constexpr int VEC = E::vec, Q = VEC / 4, ES = 16 / VEC;
  float4 v[NV][Q][THREADS];
  __device__ __forceinline__ void fill(const LnBwdParams& p, const int (&col)[NV], const bool (&ok)[NV], int tid) {
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const V4 raw = ok[j] && p.w ? ld_cached(static_cast<const char*>(p.w) + static_cast<i64>(col[j]) * ES) : V4{0, 0, 0, 0};
#pragma unroll
      for (int q = 0; q < Q; ++q) {
        float f[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) f[i] = p.w ? lane(E{}, raw, 4 * q + i) : 1.0f;
        v[j][q][tid] = make_float4(f[0], f[1], f[2], f[3]);
      }
    }
  }
  // A volatile load where it is used: the compiler may not hoist it out of
  // the row loops and keep VEC more registers live.
  __device__ __forceinline__ void get(int j, int tid, float (&w)[VEC]) const {
#pragma unroll
    for (int q = 0; q < Q; ++q)
      asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                   : "=f"(w[4 * q]), "=f"(w[4 * q + 1]), "=f"(w[4 * q + 2]), "=f"(w[4 * q + 3])
                   : "r"(static_cast<u32>(__cvta_generic_to_shared(&v[j][q][tid]))));
  }
};

// The NS sums of a group of G lanes (G and NS powers of two, NS <= G <= 32)
// in fewer shuffles than NS butterflies: while a lane holds m > 1 values, it
// keeps half (the upper half where its lane bit `o` is set, o from G / 2
// down) and adds the other half from lane ^ o, so the first steps move m / 2
// values, not m. After log2(NS) steps lane L holds sum index
// (L % G) >> (log2 G - log2 NS), summed over the lanes that share those
// bits; plain butterflies finish the group. NS = 4, G = 32: 6 shuffles, not 20.
template <int NS, int G>
__device__ __forceinline__ float group_sums_transposed(const float (&s)[NS], int lane_id) {
  static_assert(NS >= 1 && NS <= G && G <= 32 && (NS & (NS - 1)) == 0 && (G & (G - 1)) == 0, "powers of two");
  float v[NS];
#pragma unroll
  for (int i = 0; i < NS; ++i) v[i] = s[i];
  int o = G / 2;
#pragma unroll
  for (int m = NS; m > 1; m >>= 1, o >>= 1) {
    const bool upper = (lane_id & o) != 0;
#pragma unroll
    for (int i = 0; i < m / 2; ++i) {
      const float keep = upper ? v[i + m / 2] : v[i], send = upper ? v[i] : v[i + m / 2];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
    }
  }
  float t = v[0];
#pragma unroll
  for (; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
  return t;
}

// The whole warp's: lane L ends with sum L >> (5 - log2 NS).
template <int NS>
__device__ __forceinline__ float warp_sums_transposed(const float (&s)[NS], int lane_id) {
  return group_sums_transposed<NS, 32>(s, lane_id);
}

template <int NS>
__device__ __forceinline__ constexpr int log2_of() {
  return NS <= 1 ? 0 : 1 + log2_of<NS / 2>();
}

// ---------------------------------------------------------------------------
// The kernel
// ---------------------------------------------------------------------------

// The batch's NS row means, from each thread's sums s[NS] to row_means[NS]
// in shared memory (visible to the whole block on return): the warp tree,
// then the block's warps in order, then the cluster's CTAs in rank order,
// divided by n once (by NS threads, not by every thread). `slot` alternates
// between batches (see the header).
template <int THREADS, int C, int NS>
__device__ __forceinline__ void reduce_rows(const float (&s)[NS], float (*warp_sums)[NS], float (*block_sums)[NS],
                                            int slot, float* row_means, float nf) {
  constexpr int WARPS = THREADS / 32;
  const int tid = static_cast<int>(threadIdx.x), lane_id = tid & 31, warp = tid >> 5;
  const float t = warp_sums_transposed<NS>(s, lane_id);
  if ((lane_id & (32 / NS - 1)) == 0) warp_sums[warp][lane_id >> (5 - log2_of<NS>())] = t;
  __syncthreads();
  if (tid < NS) {
    float t = 0.0f;
#pragma unroll
    for (int q = 0; q < WARPS; ++q) t += warp_sums[q][tid];
    block_sums[slot][tid] = t;
    // Only these shared-memory writes need ordering before the barrier: a
    // release restricted to shared memory (MEMBAR.CTA in the SASS), where
    // barrier.cluster.arrive.release would fence every thread's memory
    // operations at GPU scope (MEMBAR.ALL.GPU), waiting for the dx stores
    // and the loads still in flight.
    if constexpr (C > 1) asm volatile("fence.release.sync_restrict::shared::cta.cluster;" ::: "memory");
  }
  if constexpr (C > 1) {
    cluster_sync_shared();
    if (tid < NS) {
      float t = 0.0f;
#pragma unroll
      for (int q = 0; q < C; ++q) t += ld_cluster(&block_sums[slot][tid], static_cast<u32>(q));
      row_means[tid] = t / nf;
    }
  } else {
    if (tid < NS) row_means[tid] = block_sums[slot][tid] / nf;
  }
  __syncthreads();
}


// The part's column partials of the thread's columns, float32, 16-byte stores.
template <int VEC, int NV>
__device__ __forceinline__ void store_partials(const LnBwdParams& p, int part, const int (&col)[NV], const bool (&ok)[NV],
                                               const float (&pdw)[NV][VEC], const float (&pdb)[NV][VEC]) {
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    if (!ok[j]) continue;
    const i64 at = static_cast<i64>(part) * p.n + col[j];
#pragma unroll
    for (int k = 0; k < VEC; k += 4) {
      if (p.part_dw)
        *reinterpret_cast<float4*>(p.part_dw + at + k) = make_float4(pdw[j][k], pdw[j][k + 1], pdw[j][k + 2], pdw[j][k + 3]);
      if (p.part_db)
        *reinterpret_cast<float4*>(p.part_db + at + k) = make_float4(pdb[j][k], pdb[j][k + 1], pdb[j][k + 2], pdb[j][k + 3]);
    }
  }
}

// A batch of R rows held in registers (the register and lane-group
// variants): the thread's NV vectors of dy and x of each row and the rows'
// statistics. Rows past the end and columns past n hold zeros (mean and rstd
// too), so they add nothing.
template <class E, int R, int NV>
struct RegBatch {
  static constexpr int VEC = E::vec, ES = 16 / VEC;
  V4 vdy[R][NV], vx[R][NV];
  float mu[R], rs[R];

  __device__ __forceinline__ void load(const LnBwdParams& p, int r0, const int (&col)[NV], const bool (&ok)[NV]) {
    const char* dy = static_cast<const char*>(p.dy);
    const char* x = static_cast<const char*>(p.x);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const bool live = r0 + r < p.rows;
      const i64 row = live ? r0 + r : 0;
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        vdy[r][j] = V4{0, 0, 0, 0};
        vx[r][j] = V4{0, 0, 0, 0};
        if (live && ok[j]) {
          vdy[r][j] = ld_stream(dy + (row * p.ld_dy + col[j]) * ES);
          vx[r][j] = ld_stream(x + (row * p.ld_x + col[j]) * ES);
        }
      }
      mu[r] = live ? p.mean[row] : 0.0f;
      rs[r] = live ? p.rstd[row] : 0.0f;
    }
  }

  // Pass 1: each row's sums of g and g * xhat into s, and the partials.
  template <int THREADS>
  __device__ __forceinline__ void sums(const WeightSmem<E, THREADS, NV>& wsm, int tid, float (&s)[2 * R],
                                       float (&pdw)[NV][VEC], float (&pdb)[NV][VEC]) const {
#pragma unroll
    for (int r = 0; r < R; ++r) s[2 * r] = 0.0f, s[2 * r + 1] = 0.0f;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      float w[VEC];
      wsm.get(j, tid, w);
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int k = 0; k < VEC; ++k)
          add_terms(lane(E{}, vdy[r][j], k), lane(E{}, vx[r][j], k), w[k], mu[r], rs[r], s[2 * r], s[2 * r + 1],
                    pdw[j][k], pdb[j][k]);
    }
  }

  // Pass 2: dx of the live rows from their means m[2r] (g) and m[2r + 1]
  // (g * xhat), rounded once, 16-byte stores.
  template <int THREADS>
  __device__ __forceinline__ void store_dx(const LnBwdParams& p, const WeightSmem<E, THREADS, NV>& wsm, int tid, int r0,
                                           const int (&col)[NV], const bool (&ok)[NV], const float* m) const {
    char* dx = static_cast<char*>(p.dx);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (r0 + r >= p.rows) break;
      const DxRow f(mu[r], rs[r], m[2 * r], m[2 * r + 1]);
      const i64 row = r0 + r;
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        if (!ok[j]) continue;
        float w[VEC], o[VEC];
        wsm.get(j, tid, w);
#pragma unroll
        for (int k = 0; k < VEC; ++k) o[k] = f(lane(E{}, vdy[r][j], k), lane(E{}, vx[r][j], k), w[k]);
        st_stream(dx + (row * p.ld_dx + col[j]) * ES, pack<E>(o));
      }
    }
  }
};

template <class E, int THREADS, int C, int R, int NV>
__device__ __forceinline__ void lnbwd_body(const LnBwdParams& p) {
  constexpr int VEC = E::vec;
  constexpr int WARPS = THREADS / 32;
  constexpr int NS = 2 * R;  // a batch's sums: sum(g) and sum(g * xhat) of each row
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "whole warps");
  static_assert(C == 1 || C == 2 || C == 4 || C == 8, "a portable cluster");
  __shared__ float warp_sums[WARPS][NS];
  __shared__ float block_sums[2][NS];  // read by the cluster; batches alternate
  __shared__ float row_means[NS];
  __shared__ WeightSmem<E, THREADS, NV> wsm;

  const int tid = static_cast<int>(threadIdx.x);
  const int rank = C > 1 ? static_cast<int>(cluster_rank()) : 0;
  const int part = static_cast<int>(blockIdx.x) / C, parts = static_cast<int>(gridDim.x) / C;
  const int n = p.n, rows = p.rows;
  const float nf = static_cast<float>(n);

  int col[NV];
  bool ok[NV];
  float pdw[NV][VEC], pdb[NV][VEC];
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    col[j] = ((rank * NV + j) * THREADS + tid) * VEC;
    ok[j] = col[j] < n;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      pdw[j][k] = 0.0f;
      pdb[j][k] = 0.0f;
    }
  }
  wsm.fill(p, col, ok, tid);

  const int batches = (rows + R - 1) / R;
  int slot = 0;
  for (int b = part; b < batches; b += parts, slot ^= 1) {
    RegBatch<E, R, NV> batch;
    batch.load(p, b * R, col, ok);
    float s[NS];
    batch.template sums<THREADS>(wsm, tid, s, pdw, pdb);
    reduce_rows<THREADS, C, NS>(s, warp_sums, block_sums, slot, row_means, nf);
    if (p.dx) batch.template store_dx<THREADS>(p, wsm, tid, b * R, col, ok, row_means);
  }

  store_partials<VEC, NV>(p, part, col, ok, pdw, pdb);
  if constexpr (C > 1) cluster_sync();  // no CTA exits while another may still read its block_sums
}


// What the two ring variants share: the thread's columns and partials, the
// weight's shared copy, and the ring of batches in dynamic shared memory
// (STAGES slots of R rows x NV vectors x {dy, x} x THREADS pieces of 16
// bytes). Each thread copies and reads back only its own pieces (no barrier
// guards them); a batch's mean and rstd are copied by threads 0 .. 2R - 1
// into `stats` and read by all after a __syncthreads. Pieces that no copy
// fills (columns past n, rows past the end) hold zeros, so the passes add
// without tests.
template <class E, int THREADS, int C, int R, int NV, int STAGES>
struct RingCta {
  static constexpr int VEC = E::vec, ES = 16 / VEC, NS = 2 * R;
  static_assert(STAGES >= 2 && STAGES <= 4, "2 to 4 slots");
  const LnBwdParams& p;
  unsigned char* ring;
  float (*stats)[NS];  // [STAGES][NS]
  WeightSmem<E, THREADS, NV>& wsm;
  int tid, part, parts, batches;
  int col[NV];
  bool ok[NV];
  float pdw[NV][VEC], pdb[NV][VEC];

  __device__ __forceinline__ RingCta(const LnBwdParams& p_, unsigned char* ring_, float (*stats_)[NS],
                                     WeightSmem<E, THREADS, NV>& wsm_)
      : p(p_), ring(ring_), stats(stats_), wsm(wsm_) {
    tid = static_cast<int>(threadIdx.x);
    const int rank = C > 1 ? static_cast<int>(cluster_rank()) : 0;
    part = static_cast<int>(blockIdx.x) / C, parts = static_cast<int>(gridDim.x) / C;
    batches = (p.rows + R - 1) / R;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      col[j] = ((rank * NV + j) * THREADS + tid) * VEC;
      ok[j] = col[j] < p.n;
#pragma unroll
      for (int k = 0; k < VEC; ++k) pdw[j][k] = 0.0f, pdb[j][k] = 0.0f;
      if (!ok[j])
        for (int st = 0; st < STAGES; ++st)
#pragma unroll
          for (int r = 0; r < R; ++r) zero(st, r, j);
    }
    wsm.fill(p, col, ok, tid);
  }

  // This thread's piece t (0 dy, 1 x) of row r, vector j, in slot st.
  __device__ __forceinline__ unsigned char* piece(int st, int r, int j, int t) const {
    return ring + ((((st * R + r) * NV + j) * 2 + t) * THREADS + tid) * 16;
  }
  __device__ __forceinline__ void zero(int st, int r, int j) const {
    *reinterpret_cast<uint4*>(piece(st, r, j, 0)) = make_uint4(0, 0, 0, 0);
    *reinterpret_cast<uint4*>(piece(st, r, j, 1)) = make_uint4(0, 0, 0, 0);
  }

  // Batch b's copies into slot st, one commit group (empty past the last
  // batch); the rows past the end zeroed (statistics too: 0 * NaN of a stale
  // slot would poison the partials).
  __device__ __forceinline__ void issue(int b, int st) const {
    if (b < batches) {
      const char* dy = static_cast<const char*>(p.dy);
      const char* x = static_cast<const char*>(p.x);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int row = b * R + r;
#pragma unroll
        for (int j = 0; j < NV; ++j) {
          if (!ok[j]) continue;
          if (row < p.rows) {
            cp_async16(piece(st, r, j, 0), dy + (static_cast<i64>(row) * p.ld_dy + col[j]) * ES);
            cp_async16(piece(st, r, j, 1), x + (static_cast<i64>(row) * p.ld_x + col[j]) * ES);
          } else {
            zero(st, r, j);
          }
        }
      }
      if (tid < NS) {
        if (b * R + tid / 2 < p.rows) cp_async4(&stats[st][tid], (tid & 1 ? p.rstd : p.mean) + b * R + tid / 2);
        else stats[st][tid] = 0.0f;
      }
    }
    cp_async_commit();
  }

  // Pass 1 of the batch of rows r0.. in slot st (its copies and statistics
  // waited for): its statistics into mu, rs, this thread's sums of g and
  // g * xhat of each row into s, and the column partials.
  __device__ __forceinline__ void first_pass(int st, float (&mu)[R], float (&rs)[R], float (&s)[NS]) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      mu[r] = stats[st][2 * r];
      rs[r] = stats[st][2 * r + 1];
      s[2 * r] = 0.0f, s[2 * r + 1] = 0.0f;
    }
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      float w[VEC];
      wsm.get(j, tid, w);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const V4 vd = ld_shared(piece(st, r, j, 0)), vx = ld_shared(piece(st, r, j, 1));
#pragma unroll
        for (int k = 0; k < VEC; ++k)
          add_terms(lane(E{}, vd, k), lane(E{}, vx, k), w[k], mu[r], rs[r], s[2 * r], s[2 * r + 1], pdw[j][k],
                    pdb[j][k]);
      }
    }
  }

  // Pass 2 of the same batch, with the rows' means of the whole cluster:
  // dx (when asked), rounded once, 16-byte stores.
  __device__ __forceinline__ void second_pass(int st, int r0, const float (&mu)[R], const float (&rs)[R],
                                              const float* row_means) const {
    char* dx = static_cast<char*>(p.dx);
    if (!dx) return;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (r0 + r >= p.rows) break;
      const DxRow f(mu[r], rs[r], row_means[2 * r], row_means[2 * r + 1]);
      const i64 row = r0 + r;
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        if (!ok[j]) continue;
        float w[VEC], o[VEC];
        wsm.get(j, tid, w);
        const V4 vd = ld_shared(piece(st, r, j, 0)), vx = ld_shared(piece(st, r, j, 1));
#pragma unroll
        for (int k = 0; k < VEC; ++k) o[k] = f(lane(E{}, vd, k), lane(E{}, vx, k), w[k]);
        st_stream(dx + (row * p.ld_dx + col[j]) * ES, pack<E>(o));
      }
    }
  }

  __device__ __forceinline__ void finish() const {
    cp_async_wait<0>();
    store_partials<VEC, NV>(p, part, col, ok, pdw, pdb);
  }
};

// The staged variant (STAGES >= 2): the batches' dy and x go through the
// ring, filled with cp.async STAGES - 1 batches ahead, so the loads of the
// next batches are in flight while this one goes through its reductions,
// its cluster barrier and its dx stores (the register variant above waits
// for its own loads after each barrier). dy and x are read twice from
// shared memory (the sums, then dx and the partials), so registers hold no
// row. Dynamic shared memory: STAGES * R * NV * 2 * THREADS * 16 bytes.
template <class E, int THREADS, int C, int R, int NV, int STAGES>
__device__ __forceinline__ void lnbwd_staged_body(const LnBwdParams& p) {
  constexpr int WARPS = THREADS / 32;
  constexpr int NS = 2 * R;
  __shared__ float warp_sums[WARPS][NS];
  __shared__ float block_sums[2][NS];
  __shared__ float row_means[NS];
  __shared__ float stats[STAGES][NS];  // mean, rstd of each row of a slot's batch
  __shared__ WeightSmem<E, THREADS, NV> wsm;
  extern __shared__ __align__(16) unsigned char ring[];
  RingCta<E, THREADS, C, R, NV, STAGES> cta(p, ring, stats, wsm);

#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) cta.issue(cta.part + i * cta.parts, i);
  int st = 0, slot = 0;
  for (int b = cta.part; b < cta.batches; b += cta.parts, slot ^= 1) {
    cta.issue(b + (STAGES - 1) * cta.parts, st == 0 ? STAGES - 1 : st - 1);
    cp_async_wait<STAGES - 1>();  // this thread's copies of batch b
    __syncthreads();              // and threads 0 .. 2R - 1's statistics
    float mu[R], rs[R], s[NS];
    cta.first_pass(st, mu, rs, s);
    reduce_rows<THREADS, C, NS>(s, warp_sums, block_sums, slot, row_means, static_cast<float>(p.n));
    cta.second_pass(st, b * R, mu, rs, row_means);
    st = st + 1 == STAGES ? 0 : st + 1;
  }
  cta.finish();
  if constexpr (C > 1) cluster_sync();  // no CTA exits while another may still read its block_sums
}

// The pipelined variant (staged ring, tag suffix "p"): the cluster barrier
// of batch k is split into its arrive and its wait, and the first pass of
// batch k + 1 (sums, shuffle trees, the block step) runs between them, so
// the barrier's latency and the peers' skew hide behind work. Per batch:
//   arrive(k) .. pass 1 of k + 1, block sums of k + 1 .. wait(k), peers'
//   sums of k, dx and partials of k, refill of k's ring slot, arrive(k + 1)
// The block sums take three slots (a CTA writes batch k + 1's before its
// peers have all read batch k - 1's only once it has passed wait(k - 1),
// which they reach after reading batch k - 2's), the warp sums two.
template <class E, int THREADS, int C, int R, int NV, int STAGES>
__device__ __forceinline__ void lnbwd_pipelined_body(const LnBwdParams& p) {
  constexpr int WARPS = THREADS / 32;
  constexpr int NS = 2 * R;
  static_assert(C > 1, "the split barrier is the cluster's");
  __shared__ float warp_sums[2][WARPS][NS];
  __shared__ float block_sums[3][NS];
  __shared__ float row_means[NS];
  __shared__ float stats[STAGES][NS];
  __shared__ WeightSmem<E, THREADS, NV> wsm;
  extern __shared__ __align__(16) unsigned char ring[];
  RingCta<E, THREADS, C, R, NV, STAGES> cta(p, ring, stats, wsm);
  const int tid = cta.tid, lane_id = tid & 31, warp = tid >> 5;
  // This cluster's batches: k-th is part + k * parts, in slot k % STAGES.
  const int mine = cta.part < cta.batches ? (cta.batches - 1 - cta.part) / cta.parts + 1 : 0;
  auto issue = [&](int k) { cta.issue(k < mine ? cta.part + k * cta.parts : cta.batches, k % STAGES); };
  // Pass 1 of batch k (its copies waited for) up to its block sums in
  // block_sums[k % 3], released to the cluster; warp sums in warp_sums[k % 2].
  auto first_pass = [&](int k, float (&mu)[R], float (&rs)[R]) {
    float s[NS];
    cta.first_pass(k % STAGES, mu, rs, s);
    const float t = warp_sums_transposed<NS>(s, lane_id);
    if ((lane_id & (32 / NS - 1)) == 0) warp_sums[k & 1][warp][lane_id >> (5 - log2_of<NS>())] = t;
    __syncthreads();
    if (tid < NS) {
      float t = 0.0f;
#pragma unroll
      for (int q = 0; q < WARPS; ++q) t += warp_sums[k & 1][q][tid];
      block_sums[k % 3][tid] = t;
      asm volatile("fence.release.sync_restrict::shared::cta.cluster;" ::: "memory");
    }
  };
  auto arrive = [] { asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory"); };
  auto wait = [] { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); };

#pragma unroll
  for (int i = 0; i < STAGES; ++i) issue(i);
  float mu[R], rs[R], mu_n[R], rs_n[R];
  if (mine > 0) {
    cp_async_wait<STAGES - 1>();  // batch 0
    __syncthreads();
    first_pass(0, mu, rs);
    arrive();
  }
  for (int k = 0; k < mine; ++k) {
    if (k + 1 < mine) {
      // Committed: batches 0 .. STAGES - 1 + k; batch k + 1 must be in.
      cp_async_wait<STAGES - 2>();
      __syncthreads();
      first_pass(k + 1, mu_n, rs_n);
    }
    wait();  // batch k's block sums, every CTA's
    if (tid < NS) {
      float t = 0.0f;
#pragma unroll
      for (int q = 0; q < C; ++q) t += ld_cluster(&block_sums[k % 3][tid], static_cast<u32>(q));
      row_means[tid] = t / static_cast<float>(cta.p.n);
    }
    __syncthreads();
    cta.second_pass(k % STAGES, (cta.part + k * cta.parts) * R, mu, rs, row_means);
    // row_means is rewritten only after the next wait, which every thread of
    // this CTA reaches after the arrive below, i.e. after these reads.
    issue(k + STAGES);  // into slot k % STAGES, read for the last time above
    if (k + 1 < mine) {
#pragma unroll
      for (int r = 0; r < R; ++r) mu[r] = mu_n[r], rs[r] = rs_n[r];
      arrive();
    }
  }
  cta.finish();
  cluster_sync();  // no CTA exits while another may still read its block_sums
}

// Short rows (at most 32 lanes x NV vectors): lane groups. G lanes share a
// row (G a power of two, at most 32, within one warp), a CTA holds THREADS /
// G groups side by side, and each group walks its own row batches: the row
// sums cross the group by shuffles only, so no barrier is in the loop; dy
// and x stay in registers between the two passes. A CTA's groups own the
// same columns: at the end their partials add through shared memory (group
// order) into the CTA's part, and the finish kernel (finish_split_body:
// thousands of parts over a few hundred columns) adds the parts. Rows past
// the end and columns past n hold zeros (add nothing, store nothing).
// H200, bf16, 262144x256 (t256g32r2v1b4): 85% of the floor in the rows_bwd
// suite against 78% for the generated kernels (perf-notes, session 12).
template <class E, int THREADS, int G, int R, int NV>
__device__ __forceinline__ void lnbwd_groups_body(const LnBwdParams& p) {
  constexpr int VEC = E::vec, NS = 2 * R, GPC = THREADS / G, COLS = G * NV * VEC;
  static_assert(G >= 2 && G <= 32 && (G & (G - 1)) == 0 && THREADS % 32 == 0, "groups within a warp");
  static_assert(NS <= G && (NS & (NS - 1)) == 0, "a group's lanes hold one sum each after the tree");
  __shared__ WeightSmem<E, THREADS, NV> wsm;
  __shared__ float merge[GPC][COLS];  // one gradient's partials of each group

  const int tid = static_cast<int>(threadIdx.x), lane_id = tid & 31, g = tid / G, l = tid % G;
  const int n = p.n, rows = p.rows;
  const float nf = static_cast<float>(n);
  int col[NV];
  bool ok[NV];
  float pdw[NV][VEC], pdb[NV][VEC];
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    col[j] = (j * G + l) * VEC;
    ok[j] = col[j] < n;
#pragma unroll
    for (int k = 0; k < VEC; ++k) pdw[j][k] = 0.0f, pdb[j][k] = 0.0f;
  }
  wsm.fill(p, col, ok, tid);

  // The loop runs as many times in every lane of a warp (the shuffles
  // below take the whole warp): the warp's first group sets the trip count,
  // and a group past the last batch goes through with rows that are not live.
  constexpr int GPW = 32 / G;  // groups a warp
  const int batches = (rows + R - 1) / R;
  const int step = static_cast<int>(gridDim.x) * GPC, lead = (g / GPW) * GPW;
  for (int bw = static_cast<int>(blockIdx.x) * GPC + lead; bw < batches; bw += step) {
    const int b = bw + (g - lead);
    RegBatch<E, R, NV> batch;
    batch.load(p, b * R, col, ok);
    float s[NS];
    batch.template sums<THREADS>(wsm, tid, s, pdw, pdb);
    // The group's NS sums: the transposed tree over the group's lanes (lane
    // l ends with sum l >> (log2 G - log2 NS)), each divided by n there,
    // then every mean read from the lane that holds it.
    const float mine = group_sums_transposed<NS, G>(s, lane_id) / nf;
    float m[NS];
#pragma unroll
    for (int i = 0; i < NS; ++i) m[i] = __shfl_sync(0xffffffffu, mine, (lane_id & ~(G - 1)) + i * (G / NS));
    if (p.dx) batch.template store_dx<THREADS>(p, wsm, tid, b * R, col, ok, m);
  }

  // The CTA's part: each gradient's group partials added in group order.
#pragma unroll
  for (int grad = 0; grad < 2; ++grad) {
    float* out = grad == 0 ? p.part_dw : p.part_db;
    if (!out) continue;  // uniform: a kernel argument
    __syncthreads();     // the previous gradient's reads are done
#pragma unroll
    for (int j = 0; j < NV; ++j)
#pragma unroll
      for (int k = 0; k < VEC; ++k) merge[g][(j * G + l) * VEC + k] = grad == 0 ? pdw[j][k] : pdb[j][k];
    __syncthreads();
    for (int c = tid; c < n && c < COLS; c += THREADS) {
      float t = 0.0f;
#pragma unroll
      for (int q = 0; q < GPC; ++q) t += merge[q][c];
      out[static_cast<i64>(blockIdx.x) * n + c] = t;
    }
  }
}

// out[c] = sum over p of part[p, c], in part order, rounded once to E.
// Eight parts' loads go out together (one L2 round trip for eight, not one
// a part: ~33 parts at 32768 columns); the adds keep the part order.
// blockIdx.y picks the gradient: 0 dw, 1 db (a null output is skipped).
template <class E>
__device__ __forceinline__ void finish_body(const float* part_dw, const float* part_db, int parts, int n, void* dw,
                                            void* db) {
  const int c = static_cast<int>(blockIdx.x) * 256 + static_cast<int>(threadIdx.x);
  const float* part = blockIdx.y == 0 ? part_dw : part_db;
  void* out = blockIdx.y == 0 ? dw : db;
  if (c >= n || !out) return;
  float t = 0.0f;
  int q = 0;
  for (; q + 8 <= parts; q += 8) {
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = part[static_cast<i64>(q + i) * n + c];
#pragma unroll
    for (int i = 0; i < 8; ++i) t += v[i];
  }
  for (; q < parts; ++q) t += part[static_cast<i64>(q) * n + c];
  if constexpr (E::vec == 4) static_cast<float*>(out)[c] = t;
  else static_cast<u16*>(out)[c] = to_bits(E{}, t);
}

// The finish for many parts over few columns (the lane-group kernel's
// parts, one a CTA): a block of 32 columns x 32 slices, slice q adding parts
// q, q + 32, ... in order, then the 32 slices in order; blockIdx.y picks
// the gradient. Grid (ceil(n / 32), 2), 1024 threads.
template <class E>
__device__ __forceinline__ void finish_split_body(const float* part_dw, const float* part_db, int parts, int n,
                                                  void* dw, void* db) {
  __shared__ float slices[32][33];
  const int cl = static_cast<int>(threadIdx.x) & 31, q = static_cast<int>(threadIdx.x) >> 5;
  const int c = static_cast<int>(blockIdx.x) * 32 + cl;
  const float* part = blockIdx.y == 0 ? part_dw : part_db;
  void* out = blockIdx.y == 0 ? dw : db;
  if (!out) return;  // uniform across the block
  float t = 0.0f;
  if (c < n) {
    int i = q;
    for (; i + 7 * 32 < parts; i += 8 * 32) {
      float v[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) v[u] = part[static_cast<i64>(i + u * 32) * n + c];
#pragma unroll
      for (int u = 0; u < 8; ++u) t += v[u];
    }
    for (; i < parts; i += 32) t += part[static_cast<i64>(i) * n + c];
  }
  slices[q][cl] = t;
  __syncthreads();
  if (q == 0 && c < n) {
    float r = 0.0f;
#pragma unroll
    for (int k = 0; k < 32; ++k) r += slices[k][cl];
    if constexpr (E::vec == 4) static_cast<float*>(out)[c] = r;
    else static_cast<u16*>(out)[c] = to_bits(E{}, r);
  }
}

}  // namespace opfuse_lnbwd

#define OPFUSE_LNBWD_ENTRY(NAME, E, THREADS, C, R, NV, MIN_BLOCKS)                                      \
  extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) __cluster_dims__(C, 1, 1)           \
      NAME(const opfuse_lnbwd::LnBwdParams p) {                                                        \
    opfuse_lnbwd::lnbwd_body<opfuse_lnbwd::E, THREADS, C, R, NV>(p);                                   \
  }
#define OPFUSE_LNBWD_STAGED_ENTRY(NAME, E, THREADS, C, R, NV, MIN_BLOCKS, STAGES)                      \
  extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) __cluster_dims__(C, 1, 1)           \
      NAME(const opfuse_lnbwd::LnBwdParams p) {                                                        \
    opfuse_lnbwd::lnbwd_staged_body<opfuse_lnbwd::E, THREADS, C, R, NV, STAGES>(p);                    \
  }
#define OPFUSE_LNBWD_PIPELINED_ENTRY(NAME, E, THREADS, C, R, NV, MIN_BLOCKS, STAGES)                   \
  extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) __cluster_dims__(C, 1, 1)           \
      NAME(const opfuse_lnbwd::LnBwdParams p) {                                                        \
    opfuse_lnbwd::lnbwd_pipelined_body<opfuse_lnbwd::E, THREADS, C, R, NV, STAGES>(p);                 \
  }
#define OPFUSE_LNBWD_FINISH_ENTRY(NAME, E)                                                              \
  extern "C" __global__ void __launch_bounds__(256)                                                    \
      NAME(const float* part_dw, const float* part_db, int parts, int n, void* dw, void* db) {         \
    opfuse_lnbwd::finish_body<opfuse_lnbwd::E>(part_dw, part_db, parts, n, dw, db);                    \
  }
#define OPFUSE_LNBWD_GROUPS_ENTRY(NAME, E, THREADS, G, R, NV, MIN_BLOCKS)                             \
  extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) NAME(const opfuse_lnbwd::LnBwdParams p) { \
    opfuse_lnbwd::lnbwd_groups_body<opfuse_lnbwd::E, THREADS, G, R, NV>(p);                           \
  }
#define OPFUSE_LNBWD_FINISH_SPLIT_ENTRY(NAME, E)                                                       \
  extern "C" __global__ void __launch_bounds__(1024) NAME(const float* part_dw, const float* part_db, int parts, \
                                                          int n, void* dw, void* db) {                 \
    opfuse_lnbwd::finish_split_body<opfuse_lnbwd::E>(part_dw, part_db, parts, n, dw, db);             \
  }
