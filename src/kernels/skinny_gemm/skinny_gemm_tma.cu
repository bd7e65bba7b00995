// opfuse skinny GEMM, weights through the tensor memory accelerator (sm_90).
//
// Appended by the launcher after common/tma_ptx.cu (mbarriers, tensor copies)
// and skinny_gemm.cu (same namespace: its element types, MMA, epilogue and
// cluster helpers); inline PTX only, no headers.
// Same contract as skinny_gemm.cu's kernel (D = act(A W^T + bias + C), aux,
// M <= 16); no gated form. The CPU reference is the same one.
//
// Why a second kernel: ncu of the register-streaming kernel on the H200
// (bench/results/h200/ncu-skinny-3a54332/) reads W at 71-72% of DRAM peak
// where cuBLAS's nvjet kernel (TMA, 11 stages of 128 x 64) reads it at 79%;
// called alone (the gemm suite's timer) it takes 38.2 us on 16x4096->16384
// against cuBLAS's 37.5, and is faster only back to back, where programmatic
// launch hides its ramp (skinny-call-cost-a950a82.txt). Its bytes in flight
// live in registers (at most ~128 KB an SM, and more did not help); here they
// live in shared memory: STAGES boxes of BN rows x 128 bytes each, issued by
// one thread.
//
// Design:
// - A CTA owns BN = 8 * NTW * CW rows of W and a range of K in chunks of 64
//   elements (128 bytes, one TMA box row); with CLUSTER > 1 the CTAs of a
//   cluster split the chunks and add their partials in rank order through
//   distributed shared memory (cluster_sum_store), as the register kernel.
// - The consumers load the epilogue's bias and residual right after their
//   griddepcontrol.wait, so the tail is the tile's sums and stores alone.
// - Warp CW is the producer: lane 0 issues, per chunk, the W box [BN, 64]
//   and the A box [16, 64] into one stage of a ring (128-byte swizzle, zeros
//   past M, N and K), completing on the stage's full barrier. W's first
//   stages go out before griddepcontrol.wait (W does not depend on the
//   previous kernel; A may).
// - Consumer warps 0 .. CW - 1 each own NTW n-tiles of 8 rows and all of K:
//   no reduction between warps. Per chunk a warp loads A's fragments with 4
//   ldmatrix.x4 and each tile's W fragments with 2, runs 4 MMAs a tile, and
//   releases the stage (its empty barrier counts CW arrivals).
// - The 128-byte swizzle puts 16-byte piece c of row r at piece c ^ (r % 8)
//   of the row: the 8 rows an ldmatrix matrix reads land in 8 different
//   bank groups (no conflicts).
//
// Requirements (the launcher checks): as skinny_gemm.cu's, plus A and W
// 16-byte aligned with row strides multiples of 16 bytes (tensor maps);
// BN <= 256 (box rows). Launch: grid ceil(N / BN) * CLUSTER, block
// (CW + 1) * 32, dynamic shared memory tma_smem_bytes(BN, STAGES, CLUSTER > 1 || gated)
// (the launcher computes the same), arguments (SkinnyParams, W's map, A's map).
//
// Entry point: the launcher appends
//   OPFUSE_SKINNY_TMA_ENTRY(name, bf16, NTW, CW, STAGES, EARLY)   or
//   OPFUSE_SKINNY_TMA_CLUSTER_ENTRY(name, bf16, NTW, CW, STAGES, EARLY, CLUSTER)
// and for a pair (tag suffix x2) OPFUSE_SKINNY_TMA_PAIR_[CLUSTER_]ENTRY with
// the same arguments: W's map 3-D, then d2 and pair_ctas after A's map;
// for the gated pair (suffix xg, grid ceil(N / (BN / 2))) OPFUSE_SKINNY_TMA_GATED_PAIR_ENTRY,
// W's map 3-D with boxes [2, BN / 2, 64], then silu_z after A's map.

namespace opfuse_skinny {

typedef unsigned long long u64;
// From common/tma_ptx.cu (the launcher puts it ahead of this file).
using opfuse_tma::TmaMap;
using opfuse_tma::mbar_arrive;
using opfuse_tma::mbar_arrive_expect_tx;
using opfuse_tma::mbar_init;
using opfuse_tma::mbar_wait;
using opfuse_tma::smem_u32;
using opfuse_tma::tma_load_2d;

__device__ __forceinline__ void ldmatrix_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
// Byte offset of 16-byte piece `c` of row `r` in a 128-byte-swizzled box.
__device__ __forceinline__ u32 swizzled(int r, int c) { return static_cast<u32>(r * 128 + ((c ^ (r & 7)) << 4)); }

constexpr int kTmaA = 16 * 128;  // A's box: 16 rows x 64 elements
__host__ __device__ constexpr int tma_stage_bytes(int bn) { return bn * 128 + kTmaA; }
// The ring (1024-byte aligned for the swizzle: 1024 bytes of slack), the
// partial tile (a cluster's, or the gated pair's), then 2 * STAGES mbarriers.
__host__ __device__ constexpr int tma_smem_bytes(int bn, int stages, bool part) {
  return 1024 + stages * tma_stage_bytes(bn) + (part ? bn * 64 : 0) + 16 * stages;
}

// What one launch computes (the PAIR template argument):
enum TmaPair {
  kTmaOne = 0,    // one GEMM
  // Two GEMMs of one A (Llama's gate and up projections), W a 3-D map
  // [2, N, K] (the two weights at any 16-byte-multiple distance): CTAs
  // 0 .. pair_ctas - 1 compute the first into p.d, the rest the second into
  // d2 (every CTA streams one weight's rows; a cluster never straddles them).
  kTmaSplitPair = 1,
  // The same two GEMMs and silu(gate) * up, into p.d (h [M, N]): a CTA owns
  // BN / 2 columns of h, and each stage's box is those rows of both weights
  // ([2, BN / 2, 64]: lines 0 .. BN / 2 - 1 the first weight's, the rest the
  // second's). After the main loop the consumers put their tiles' sums in
  // shared memory, and each value of h is formed from its two sums (float32,
  // one rounding): the gate kernel and the two [M, N] results never exist.
  // `silu_z` says which weight (0: the lower) is the gate's.
  kTmaGatedPair = 2,
};

// The gated pair's epilogue: h[m, n0 + r] = silu(G) * U for r < H = BN / 2,
// G and U the sums of lines r and H + r of the box (silu_z = 1: the other
// way round), read from `part` in the MMA accumulator layout (tile t = line
// / 8: lane (m % 8) * 4 + (line % 8) / 2, component line % 2 + 2 * (m / 8)).
// Consecutive threads store consecutive columns of one row of h.
template <class E, int H, int THREADS>
__device__ __forceinline__ void gated_pair_store(const SkinnyParams& p, int n0, const float* part, int silu_z) {
  auto sum = [&](int line, int m) {
    return part[((line >> 3) * 32 + (m & 7) * 4 + ((line & 7) >> 1)) * 4 + (line & 1) + 2 * (m >> 3)];
  };
  const int gate_off = silu_z ? H : 0, up_off = silu_z ? 0 : H;
  for (int i = static_cast<int>(threadIdx.x); i < 16 * H; i += THREADS) {
    const int m = i / H, r = i - m * H, n = n0 + r;
    if (m >= p.m || n >= p.n) continue;
    const float g = sum(gate_off + r, m), u = sum(up_off + r, m);
    const float silu = g / (1.0f + ex2(-1.4426950408889634f * g));
    static_cast<u16*>(p.d)[m * p.ldd + n] = from_float(E{}, silu * u);
  }
}

template <class E, int NTW, int CW, int STAGES, int CLUSTER, int EARLY, int PAIR = kTmaOne>
__device__ __forceinline__ void skinny_gemm_tma_body(const SkinnyParams& p_in, const TmaMap* wmap, const TmaMap* amap,
                                                     void* d2 = nullptr, int pair_ctas = 0, int silu_z = 0) {
  constexpr int BN = 8 * NTW * CW, STAGE = tma_stage_bytes(BN);
  constexpr bool GATED = PAIR == kTmaGatedPair;
  static_assert(BN <= 256, "a TMA box has at most 256 rows");
  static_assert(!GATED || (CLUSTER == 1 && BN % 2 == 0), "the gated pair: no cluster, BN / 2 rows of each weight");
  static_assert(EARLY >= 1 && EARLY <= STAGES, "1 to STAGES early stages");
  extern __shared__ unsigned char smem_raw[];
  const u32 raw = smem_u32(smem_raw);
  const u32 ring = (raw + 1023) & ~1023u;
  unsigned char* const ring_ptr = smem_raw + (ring - raw);
  F4* const part = reinterpret_cast<F4*>(ring_ptr + STAGES * STAGE);
  const u32 bars = ring + STAGES * STAGE + (CLUSTER > 1 || GATED ? BN * 64 : 0);
  auto full = [&](int s) { return bars + 8 * s; };
  auto empty = [&](int s) { return bars + 8 * (STAGES + s); };

  trace_stamp(0);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int rank = CLUSTER > 1 ? static_cast<int>(cluster_rank()) : 0;
  const int second = PAIR == kTmaSplitPair && static_cast<int>(blockIdx.x) >= pair_ctas ? 1 : 0;
  SkinnyParams p = p_in;
  if (second) p.d = d2;
  // The first row of W (of each weight, for the gated pair) this CTA streams.
  const int n0 = static_cast<int>((blockIdx.x - second * pair_ctas) / CLUSTER) * (GATED ? BN / 2 : BN);
  const int chunks = (p.k + 63) / 64;
  const int c_begin = static_cast<int>(static_cast<i64>(chunks) * rank / CLUSTER);
  const int count = static_cast<int>(static_cast<i64>(chunks) * (rank + 1) / CLUSTER) - c_begin;

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full(s), 1);
      mbar_init(empty(s), CW);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
#ifdef OPFUSE_SKINNY_TRIGGER_START
  // The next kernel may launch now (tag suffix "d", a variant): its wait
  // still waits for this grid's end, but its CTAs take each SM this grid's
  // CTAs leave and stream their first W stages there, through the spread
  // of this grid's CTA ends, not only after the last main loop. Safe with
  // any grid: the trigger fires once every CTA of this grid is resident or
  // done, so no CTA of this grid waits for an SM behind them. Measured
  // 0.5 us slower a block at M = 16 (docs/perf-notes.md, "H200, session
  // 19"): the next kernel's ring is no deeper for starting earlier, and its
  // loads compete with this grid's last CTAs.
  launch_dependents();
#endif

  float acc[NTW][4];
#pragma unroll
  for (int j = 0; j < NTW; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  // The epilogue's bias and residual, loaded by the consumers ahead of the
  // main loop (load_addends says why): the values each stores at the end.
  constexpr int VALUES = BN / 8 * 32, CTHREADS = CW * 32;
  // (None for the gated pair, whose launcher refuses a bias or a residual.)
  constexpr int PRE = GATED ? 1 : CLUSTER > 1 ? cluster_store_rounds<CLUSTER, VALUES, CTHREADS> : NTW;
  const int n_warp = n0 + warp * NTW * 8;  // store_tile_value's tile j is this warp's tile j
  Addends pre[PRE];

  if (warp == CW) {  // the producer
    if (lane == 0) {
      const u64 policy = opfuse_tma::evict_first_policy();
      // EARLY stages of W go out before the wait: W does not depend on the
      // previous kernel, so behind one they stream during its tail. Alone,
      // the first A box queues behind them (a longer ramp): EARLY < STAGES
      // trades the one for the other.
      const int early = count < EARLY ? count : EARLY;
      for (int i = 0; i < early; ++i) {
        mbar_arrive_expect_tx(full(i), STAGE);
        if constexpr (PAIR != kTmaOne) tma_load_3d(ring + i * STAGE, wmap, (c_begin + i) * 64, n0, second, full(i), policy);
        else tma_load_2d(ring + i * STAGE, wmap, (c_begin + i) * 64, n0, full(i), policy);
      }
      grid_dependency_wait();  // A may be the previous kernel's output
      for (int i = 0; i < early; ++i) tma_load_2d(ring + i * STAGE + BN * 128, amap, (c_begin + i) * 64, 0, full(i));
      for (int i = early; i < count; ++i) {
        const int s = i % STAGES;
        if (i >= STAGES) mbar_wait(empty(s), ((i / STAGES) - 1) & 1);
        mbar_arrive_expect_tx(full(s), STAGE);
        if constexpr (PAIR != kTmaOne) tma_load_3d(ring + s * STAGE, wmap, (c_begin + i) * 64, n0, second, full(s), policy);
        else tma_load_2d(ring + s * STAGE, wmap, (c_begin + i) * 64, n0, full(s), policy);
        tma_load_2d(ring + s * STAGE + BN * 128, amap, (c_begin + i) * 64, 0, full(s));
      }
    }
    __syncwarp();
  } else {  // a consumer: tiles warp * NTW .. + NTW - 1
    grid_dependency_wait();  // the epilogue reads the bias and the residual
#pragma unroll
    for (int r = 0; r < (GATED ? 0 : PRE); ++r) {
      if constexpr (CLUSTER > 1) {
        const int i = static_cast<int>(threadIdx.x) + r * CTHREADS;
        pre[r] = i < VALUES / CLUSTER ? load_addends<E>(p, n0, rank * (VALUES / CLUSTER) + i) : Addends{};
      } else {
        pre[r] = load_addends<E>(p, n_warp, r * 32 + lane);
      }
    }
    // ldmatrix.x4: lane l gives row l % 8 of matrix l / 8. A's matrices
    // (a0..a3 of a k16 step kk): rows 0-7 / 8-15 (bit 0), pieces 2kk / 2kk+1 (bit 1).
    const int a_row = (lane & 7) + 8 * ((lane >> 3) & 1), a_piece = lane >> 4;
    // W's: 8 rows of the tile, pieces 4h + l / 8 (b0, b1 of kk = 2h, then of 2h + 1).
    const int w_row = warp * NTW * 8 + (lane & 7), w_piece = lane >> 3;
    FirstMmaStamp first;
    for (int i = 0; i < count; ++i) {
      const int s = i % STAGES;
      mbar_wait(full(s), (i / STAGES) & 1);
      const u32 wst = ring + s * STAGE, ast = wst + BN * 128;
      u32 a[4][4];
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        ldmatrix_x4(ast + swizzled(a_row, 2 * kk + a_piece), a[kk][0], a[kk][1], a[kk][2], a[kk][3]);
#pragma unroll
      for (int j = 0; j < NTW; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          u32 b0, b1, b2, b3;
          ldmatrix_x4(wst + swizzled(w_row + 8 * j, 4 * h + w_piece), b0, b1, b2, b3);
          mma(E{}, acc[j], a[2 * h][0], a[2 * h][1], a[2 * h][2], a[2 * h][3], b0, b1);
          mma(E{}, acc[j], a[2 * h + 1][0], a[2 * h + 1][1], a[2 * h + 1][2], a[2 * h + 1][3], b2, b3);
        }
      }
      first();
      __syncwarp();
      if (lane == 0) mbar_arrive(empty(s));
    }
  }
  trace_stamp(2);
#ifndef OPFUSE_SKINNY_TRIGGER_START
  launch_dependents();  // what is left is the tile's stores
#endif

  if constexpr (GATED) {
    if (warp < CW) {
#pragma unroll
      for (int j = 0; j < NTW; ++j) part[(warp * NTW + j) * 32 + lane] = {acc[j][0], acc[j][1], acc[j][2], acc[j][3]};
      asm volatile("bar.sync 1, %0;" ::"n"(CTHREADS) : "memory");  // the consumers only (the producer may be gone)
      gated_pair_store<E, BN / 2, CTHREADS>(p, n0, reinterpret_cast<const float*>(part), silu_z);
    }
  } else if constexpr (CLUSTER > 1) {
    if (warp < CW)
#pragma unroll
      for (int j = 0; j < NTW; ++j) part[(warp * NTW + j) * 32 + lane] = {acc[j][0], acc[j][1], acc[j][2], acc[j][3]};
    cluster_sum_store<E, CLUSTER, VALUES, CTHREADS>(p, n0, part, rank, [&](int r, int) { return pre[r]; });
  } else if (warp < CW) {
#pragma unroll
    for (int j = 0; j < NTW; ++j)
      store_tile_value<E>(p, n_warp, j * 32 + lane, {acc[j][0], acc[j][1], acc[j][2], acc[j][3]}, pre[j]);
  }
  trace_stamp(3);
}

}  // namespace opfuse_skinny

#define OPFUSE_SKINNY_TMA_ENTRY(NAME, E, NTW, CW, STAGES, EARLY)                                                      \
  extern "C" __global__ void __launch_bounds__(((CW) + 1) * 32, 1)                                               \
      NAME(const opfuse_skinny::SkinnyParams p, const __grid_constant__ opfuse_skinny::TmaMap wmap,            \
           const __grid_constant__ opfuse_skinny::TmaMap amap OPFUSE_SKINNY_TRACE_PARAM) {                    \
    OPFUSE_SKINNY_TRACE_SET                                                                                    \
    opfuse_skinny::skinny_gemm_tma_body<opfuse_skinny::E, NTW, CW, STAGES, 1, EARLY>(p, &wmap, &amap);               \
  }
#define OPFUSE_SKINNY_TMA_CLUSTER_ENTRY(NAME, E, NTW, CW, STAGES, EARLY, CLUSTER)                                     \
  extern "C" __global__ void __launch_bounds__(((CW) + 1) * 32, 1) __cluster_dims__(CLUSTER, 1, 1)            \
      NAME(const opfuse_skinny::SkinnyParams p, const __grid_constant__ opfuse_skinny::TmaMap wmap,            \
           const __grid_constant__ opfuse_skinny::TmaMap amap OPFUSE_SKINNY_TRACE_PARAM) {                    \
    OPFUSE_SKINNY_TRACE_SET                                                                                    \
    opfuse_skinny::skinny_gemm_tma_body<opfuse_skinny::E, NTW, CW, STAGES, CLUSTER, EARLY>(p, &wmap, &amap);         \
  }
// The pair (PAIR above): the arguments of the single entry, then the second
// output and the first GEMM's CTA count.
#define OPFUSE_SKINNY_TMA_PAIR_PARAMS                                                                             \
  const opfuse_skinny::SkinnyParams p, const __grid_constant__ opfuse_skinny::TmaMap wmap,                        \
      const __grid_constant__ opfuse_skinny::TmaMap amap, void *d2, int pair_ctas OPFUSE_SKINNY_TRACE_PARAM
#define OPFUSE_SKINNY_TMA_PAIR_ENTRY(NAME, E, NTW, CW, STAGES, EARLY)                                                 \
  extern "C" __global__ void __launch_bounds__(((CW) + 1) * 32, 1) NAME(OPFUSE_SKINNY_TMA_PAIR_PARAMS) {            \
    OPFUSE_SKINNY_TRACE_SET                                                                                    \
    opfuse_skinny::skinny_gemm_tma_body<opfuse_skinny::E, NTW, CW, STAGES, 1, EARLY, opfuse_skinny::kTmaSplitPair>( \
        p, &wmap, &amap, d2, pair_ctas);                                                                       \
  }
#define OPFUSE_SKINNY_TMA_PAIR_CLUSTER_ENTRY(NAME, E, NTW, CW, STAGES, EARLY, CLUSTER)                                \
  extern "C" __global__ void __launch_bounds__(((CW) + 1) * 32, 1) __cluster_dims__(CLUSTER, 1, 1)            \
      NAME(OPFUSE_SKINNY_TMA_PAIR_PARAMS) {                                                                    \
    OPFUSE_SKINNY_TRACE_SET                                                                                    \
    opfuse_skinny::skinny_gemm_tma_body<opfuse_skinny::E, NTW, CW, STAGES, CLUSTER, EARLY,                       \
                                         opfuse_skinny::kTmaSplitPair>(p, &wmap, &amap, d2, pair_ctas);       \
  }
// The gated pair (kTmaGatedPair): W's map 3-D with boxes of both weights,
// then which of the two is the gate's (0: the lower in memory).
#define OPFUSE_SKINNY_TMA_GATED_PAIR_ENTRY(NAME, E, NTW, CW, STAGES, EARLY)                                           \
  extern "C" __global__ void __launch_bounds__(((CW) + 1) * 32, 1)                                               \
      NAME(const opfuse_skinny::SkinnyParams p, const __grid_constant__ opfuse_skinny::TmaMap wmap,            \
           const __grid_constant__ opfuse_skinny::TmaMap amap, int silu_z OPFUSE_SKINNY_TRACE_PARAM) {         \
    OPFUSE_SKINNY_TRACE_SET                                                                                    \
    opfuse_skinny::skinny_gemm_tma_body<opfuse_skinny::E, NTW, CW, STAGES, 1, EARLY, opfuse_skinny::kTmaGatedPair>( \
        p, &wmap, &amap, nullptr, 0, silu_z);                                                                  \
  }
