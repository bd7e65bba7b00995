// opfuse decode MLP: one persistent kernel for a whole MLP block at decode
// shapes (M <= 16), sm_90.
//
// Compiled at run time by NVRTC, with NO header (NVRTC on the target
// machines finds no CUDA headers): every device helper is plain C++ or
// inline PTX. The launcher puts common/tma_ptx.cu (mbarriers, tensor
// copies) ahead of this file.
//
//   phase 1:  h[m, j]   = act(sum_k x[m, k] w1[j, k] + b1[j])                 (act: none, relu, tanh-gelu)
//        or   h[m, j]   = silu(sum_k x[m, k] w1[j, k]) * sum_k x[m, k] w3[j, k]   (GATED: Llama)
//   phase 2:  out[m, n] = sum_j h[m, j] w2[n, j] + b2[n]
//
// for 1 <= M <= 16, weights [rows, K] with K unit-stride (nn.Linear's
// layout), bf16 or f16 elements, float32 accumulation; h is rounded to the
// element type once (as the unfused graph stores it) into a global
// workspace. The CPU reference with the same semantics is
// decode_mlp_reference.{h,cpp}.
//
// Why one kernel: at M = 16 each GEMM is bound by reading its weight once
// (2-3 x 86-128 MiB at ~4.2 TB/s, 21-32 us each), and a chain of 2-4
// kernels loses several microseconds per kernel to its ramp, its tail and
// the launch gap to the next: 10-20% of the block. Here the grid is one
// persistent CTA per SM for both phases; the only seam is a grid barrier,
// and each CTA keeps streaming its phase-2 weights into shared memory while
// it waits there (those loads do not depend on h).
//
// Design:
// - Work unit = one stage: BN weight rows x KS values of k (BN * KS * 2
//   bytes, 32 KB at the default b64k256s5g2t) plus the matching [M, KS] slice of the
//   activation (x in phase 1, h in phase 2). Phase p has tiles_p * kc_p
//   stages (tile = BN rows; GATED: BN / 2 rows of w1 and the same rows of
//   w3, so the gate product is formed on chip; kc = K / KS chunks). Each CTA
//   takes a contiguous range of each phase's stages (stream-K): the ranges
//   differ by at most one stage, so the grid stays balanced whatever the
//   shapes.
// - One producer warp fills a STAGES-deep ring in shared memory with 1-D
//   bulk copies (cp.async.bulk, one per row segment, completing on an
//   mbarrier with a byte count); BN / 16 * KG consumer warps run mma.sync
//   m16n8k16 on it, each warp owning 16 rows of the stage (two n8 tiles)
//   and every KG-th 32-value step of k (its k group); the KG groups' sums
//   meet in shared memory at the end of a tile, added in group order.
//   Rows are padded by 64 bytes in shared memory, which makes the 16-byte
//   fragment loads bank-conflict free.
//   Measured limit (H200): ~60 ns per bulk copy per SM whatever its size up
//   to 2 KB, so the row segment (2 * KS bytes) sets the speed: 512-byte
//   segments ran at 27% of the copy bandwidth, 2 KB ones at 65%. The TM
//   configs load each stage as 2-3 tensor-map boxes (cp.async.bulk.tensor,
//   [BN, KS] of the weight and [16, KS] of the activation, zero-filled past
//   the tensor) instead of BN + M row copies: written after that
//   measurement, not yet run on a GPU.
//   The k order inside each 32-value step is renumbered (a sum does not care):
//   lane (g, t) reads 8 consecutive k of its row, which feed two MMAs.
// - Tiles split between CTAs: each CTA writes its float32 partial [16, BN]
//   to its slot of a workspace; the last CTA to arrive (an atomic counter
//   per tile, which it resets) adds the slots in CTA order (deterministic)
//   and applies the epilogue. A tile wholly inside one CTA is finished
//   directly.
// - Grid barrier between the phases: a global arrival counter and a
//   generation word. The last arriving CTA resets the counter and bumps the
//   generation, so it is correct for repeated launches and CUDA graph
//   replay without any host reset. Only the producer warp waits on it: the
//   consumers block on the ring's mbarriers, which complete only once the
//   producer, past the barrier, has copied the h slices. Before waiting,
//   the producer fills the ring with the first phase-2 weight stages and
//   asks L2 to prefetch `prefetch` more stages (cp.async.bulk.prefetch.L2).
// - Every CTA must be resident at once (grid barrier): the launcher sizes
//   the grid to the SM count with one CTA per SM (the ring takes 180-215 KB
//   of shared memory).
//
// Requirements (checked by the launcher, src/runtime/decode_mlp_launcher.cpp):
// M <= 16; K % 8 == 0 and H % 8 == 0; x, weights 16-byte aligned with row
// strides multiples of 8 elements; h workspace [16, ldh], ldh % 8 == 0.
// Launch: grid G (<= resident CTAs), block (BN / 16 * KG + 1) * 32, dynamic
// shared memory smem_bytes(config) (the launcher's copy of Layout below),
// two arguments by value: DecodeMlpParams and TensorMaps (zeros unless TM).
//
// Entry point: the launcher appends one line
//   OPFUSE_DECODE_MLP_ENTRY(name, bf16, GATED, BN, KS, STAGES, KG, TM)
// which defines an extern "C" kernel (no name mangling to look up).

namespace opfuse_decode {

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;
typedef unsigned long long u64;

struct bf16 { u16 bits; };
struct f16 { u16 bits; };

// Kernel argument; mirrored by the launcher (only append fields, in both places).
struct DecodeMlpParams {
  const void* x;      // [M, K]
  i64 ldx;
  const void* w1;     // [H, K]
  i64 ldw1;
  const void* w3;     // [H, K] (GATED) or null
  i64 ldw3;
  const void* b1;     // [H] or null
  i64 b1_stride;
  const void* w2;     // [N, H]
  i64 ldw2;
  const void* b2;     // [N] or null
  i64 b2_stride;
  void* out;          // [M, N]
  i64 ldo;
  void* h;            // workspace [16, ldh] of the element type
  i64 ldh;
  float* partials;    // workspace [2 phases][grid][2 slots][16 * BN]
  u32* counters;      // workspace [tiles1 + tiles2], zero between launches
  u32* barrier;       // workspace: [0] arrivals, [32] generation (separate 128-byte lines)
  int m, k, hdim, n;
  int act;            // 0 none, 1 relu, 2 gelu (tanh approximation); GATED: silu(w1) * w3
  int prefetch;       // phase-2 stages a CTA asks L2 to prefetch before the grid barrier
};
static_assert(sizeof(DecodeMlpParams) == 176, "DecodeMlpParams layout is a launch ABI");

struct V4 { u32 x, y, z, w; };

// ---------------------------------------------------------------------------
// Element conversions (round to nearest even, as PyTorch)
// ---------------------------------------------------------------------------

__device__ __forceinline__ float to_float(bf16, u16 h) {
  float f;
  asm("mov.b32 %0, %1;" : "=f"(f) : "r"((u32)h << 16));
  return f;
}
__device__ __forceinline__ float to_float(f16, u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ u16 from_float(bf16, float f) {
  u16 h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
__device__ __forceinline__ u16 from_float(f16, float f) {
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

__device__ __forceinline__ void mma(bf16, float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma(f16, float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float ex2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// 0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)): exp has ~2^-22 relative error
// where tanh.approx has 2^-11, too coarse for f16 outputs near 0.
__device__ __forceinline__ float gelu_tanh(float x) {
  const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  return x / (1.0f + ex2(-2.8853900817779268f * u));  // -2u * log2(e)
}
__device__ __forceinline__ float silu(float x) { return x / (1.0f + ex2(-1.4426950408889634f * x)); }

// ---------------------------------------------------------------------------
// Shared memory, mbarriers, bulk copies (sm_90 PTX)
// ---------------------------------------------------------------------------

// From common/tma_ptx.cu (the launcher puts it ahead of this file): shared
// addresses, mbarriers, tensor copies, the evict-first policy.
using TensorMap = opfuse_tma::TmaMap;
using opfuse_tma::evict_first_policy;
using opfuse_tma::mbar_arrive;
using opfuse_tma::mbar_init;
using opfuse_tma::mbar_wait;
using opfuse_tma::tma_load_2d;
__device__ __forceinline__ u32 smem_addr(const void* p) { return opfuse_tma::smem_u32(p); }
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) { opfuse_tma::mbar_arrive_expect_tx(bar, bytes); }

__device__ __forceinline__ V4 lds128(u32 a) {
  V4 r;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(a));
  return r;
}
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar, u64 policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar), "l"(policy)
      : "memory");
}
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
__device__ __forceinline__ void prefetch_l2(const void* src, u32 bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}
// Maps of the tensor-copy configs (TM): 2-D [rows, K] views, boxes of
// [rows per stage, KS], zero fill outside the tensor. Unused (zeros) otherwise.
struct TensorMaps {
  TensorMap w1, w3, w2, x, h;
};
__device__ __forceinline__ void tma_prefetch_2d(const TensorMap* map, int c0, int c1) {
  asm volatile("cp.async.bulk.prefetch.tensor.2d.L2.global.tile [%0, {%1, %2}];" ::"l"(reinterpret_cast<u64>(map)), "r"(c0),
               "r"(c1)
               : "memory");
}

// The consumer warps' own barrier (the producer warp never joins it).
__device__ __forceinline__ void consumers_sync(int threads) { asm volatile("bar.sync 1, %0;" ::"r"(threads) : "memory"); }

// Global-memory ordering for the counters and the grid barrier.
__device__ __forceinline__ void fence_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
__device__ __forceinline__ u32 atomic_add(u32* p, u32 v) {
  u32 old;
  asm volatile("atom.add.relaxed.gpu.global.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
__device__ __forceinline__ void store_relaxed(u32* p, u32 v) {
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ u32 load_acquire(const u32* p) {
  u32 v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void red_release_add(u32* p, u32 v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// h, written by other CTAs through the generic proxy, is read by bulk copies (the async proxy).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.global;" ::: "memory"); }
__device__ __forceinline__ void nanosleep(u32 ns) { asm volatile("nanosleep.u32 %0;" ::"r"(ns)); }
// Partials of other CTAs: read at L2 (never a stale L1 line).
__device__ __forceinline__ float ld_cg(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_cg(float* p, float v) {
  asm volatile("st.global.cg.f32 [%0], %1;" ::"l"(p), "f"(v) : "memory");
}

// ---------------------------------------------------------------------------
// Geometry
// ---------------------------------------------------------------------------

// Stage i of phase p: which tile, which chunk of k. A CTA c of G owns the
// stages [c S / G, (c + 1) S / G) of each phase; owner(s) inverts that.
struct Phase {
  int tiles, kc;  // tiles of BN rows (GATED phase 1: BN / 2 output rows), k chunks of KS
  int rows;       // output rows of a tile
  int nrows, klen;  // rows of the weight(s), length of k
  i64 stages() const { return static_cast<i64>(tiles) * kc; }
};
__device__ __forceinline__ i64 range_begin(int c, i64 s, int g) { return static_cast<i64>(c) * s / g; }
__device__ __forceinline__ int owner(i64 stage, i64 s, int g) { return static_cast<int>(((stage + 1) * g - 1) / s); }

template <int BN, int KS, int STAGES, int KG, bool TM>
struct Layout {
  // Bytes per row in the ring: 64 bytes of padding make the fragment loads
  // conflict free; tensor copies (TM) land rows unpadded, and the loads
  // alternate 64-byte halves between even and odd rows instead.
  static constexpr int kPitch = TM ? 2 * KS : 2 * KS + 64;
  static constexpr int kStageBytes = (BN + 16) * kPitch;  // BN weight rows, then 16 activation rows
  static constexpr int kTilePitch = BN + 4;        // floats per row of the tile buffer
  static constexpr int kRing = STAGES * kStageBytes;
  static constexpr int kTile = KG * 16 * kTilePitch * 4;  // one tile buffer per k group
  static constexpr int kBars = 2 * STAGES * 8;
  static constexpr int kBytes = kRing + kTile + kBars + 16;
};

// ---------------------------------------------------------------------------
// The kernel
// ---------------------------------------------------------------------------

template <class E, bool GATED, int BN, int KS, int STAGES, int KG, bool TM>
struct Kernel {
  static constexpr int RW = BN / 16;  // consumer warps per k group: 16 rows each
  static constexpr int CW = RW * KG;  // consumer warps: KG groups split each stage's k steps
  static constexpr int CT = CW * 32;  // consumer threads
  using L = Layout<BN, KS, STAGES, KG, TM>;
  static_assert(!TM || (KS <= 256 && (KS / 64) % KG == 0), "tensor copies: boxes of at most 256 values, KG pairs of steps");
  static_assert(KG >= 1 && (KS / 32) % KG == 0 && CW <= 16, "KG must divide the stage's 32-value steps");
  static_assert(BN % 32 == 0 && BN >= 32 && BN <= 256, "BN: a multiple of 32 up to 256");
  static_assert(KS % 32 == 0 && KS >= 32 && 2 * KS <= 4096, "KS: a multiple of 32");
  static_assert(STAGES >= 2 && STAGES <= 8, "2 to 8 stages");

  const DecodeMlpParams& p;
  const TensorMaps* tm;
  unsigned char* smem;
  Phase ph[2];
  int grid, cta;
  i64 begin[2];  // this CTA's first stage of each phase
  int count[2];  // and how many

  __device__ __forceinline__ Kernel(const DecodeMlpParams& params, const TensorMaps* maps, unsigned char* s)
      : p(params), tm(maps), smem(s) {
    grid = static_cast<int>(gridDim.x);
    cta = static_cast<int>(blockIdx.x);
    const int rows1 = GATED ? BN / 2 : BN;
    ph[0] = {(p.hdim + rows1 - 1) / rows1, (p.k + KS - 1) / KS, rows1, p.hdim, p.k};
    ph[1] = {(p.n + BN - 1) / BN, (p.hdim + KS - 1) / KS, BN, p.n, p.hdim};
    for (int q = 0; q < 2; ++q) {
      const i64 s = ph[q].stages();
      begin[q] = range_begin(cta, s, grid);
      count[q] = static_cast<int>(range_begin(cta + 1, s, grid) - begin[q]);
    }
  }

  __device__ __forceinline__ u32 ring(int slot) const { return smem_addr(smem) + slot * L::kStageBytes; }
  __device__ __forceinline__ float* tile_buf() const { return reinterpret_cast<float*>(smem + L::kRing); }
  __device__ __forceinline__ u32 full_bar(int slot) const { return smem_addr(smem + L::kRing + L::kTile) + 8 * slot; }
  __device__ __forceinline__ u32 empty_bar(int slot) const { return full_bar(STAGES) + 8 * slot; }
  __device__ __forceinline__ int* flag() const { return reinterpret_cast<int*>(smem + L::kRing + L::kTile + L::kBars); }

  // Weight row r (0..BN-1) of a stage of phase q, tile t: its base pointer, or null past the weight.
  __device__ __forceinline__ const char* weight_row(int q, int t, int r) const {
    if (q == 1) {
      const int row = t * BN + r;
      return row < p.n ? static_cast<const char*>(p.w2) + static_cast<i64>(row) * p.ldw2 * 2 : nullptr;
    }
    if (GATED) {
      const int half = BN / 2, row = t * half + (r < half ? r : r - half);
      if (row >= p.hdim) return nullptr;
      return r < half ? static_cast<const char*>(p.w1) + static_cast<i64>(row) * p.ldw1 * 2
                      : static_cast<const char*>(p.w3) + static_cast<i64>(row) * p.ldw3 * 2;
    }
    const int row = t * BN + r;
    return row < p.hdim ? static_cast<const char*>(p.w1) + static_cast<i64>(row) * p.ldw1 * 2 : nullptr;
  }
  __device__ __forceinline__ const char* act_row(int q, int m) const {
    return q == 0 ? static_cast<const char*>(p.x) + static_cast<i64>(m) * p.ldx * 2
                  : static_cast<const char*>(p.h) + static_cast<i64>(m) * p.ldh * 2;
  }
  __device__ __forceinline__ int valid_rows(int q, int t) const {
    const int left = ph[q].nrows - t * ph[q].rows;
    return left < ph[q].rows ? left : ph[q].rows;
  }

  // ---- producer warp -------------------------------------------------------

  // Copies of one stage: weights (W) and/or the activation slice (A).
  // Lane 0 has armed the stage's mbarrier with the total byte count.
  __device__ __forceinline__ void issue(int q, i64 s, int slot, bool w, bool a, int lane, u64 policy) const {
    const int t = static_cast<int>(s / ph[q].kc), ch = static_cast<int>(s % ph[q].kc);
    const int k0 = ch * KS;
    const int kl = ph[q].klen - k0 < KS ? ph[q].klen - k0 : KS;
    const u32 bytes = static_cast<u32>(kl) * 2;
    const u32 base = ring(slot), bar = full_bar(slot);
    if (TM) {
      // One box per weight (GATED phase 1: the same rows of w1 and w3) and
      // one for the activation; rows and k past the tensor arrive as zeros.
      if (lane != 0) return;
      if (w) {
        if (q == 1) tma_load_2d(base, &tm->w2, k0, t * BN, bar, policy);
        else if (!GATED) tma_load_2d(base, &tm->w1, k0, t * BN, bar, policy);
        else {
          tma_load_2d(base, &tm->w1, k0, t * (BN / 2), bar, policy);
          tma_load_2d(base + (BN / 2) * L::kPitch, &tm->w3, k0, t * (BN / 2), bar, policy);
        }
      }
      if (a) tma_load_2d(base + BN * L::kPitch, q == 0 ? &tm->x : &tm->h, k0, 0, bar);
      return;
    }
    for (int r = lane; r < BN + 16; r += 32) {
      if (r < BN) {
        if (!w) continue;
        const char* src = weight_row(q, t, r);
        if (src) bulk_copy(base + r * L::kPitch, src + static_cast<i64>(k0) * 2, bytes, bar, policy);
      } else if (a && r - BN < p.m) {
        bulk_copy(base + r * L::kPitch, act_row(q, r - BN) + static_cast<i64>(k0) * 2, bytes, bar);
      }
    }
  }
  __device__ __forceinline__ u32 stage_bytes(int q, i64 s) const {
    if (TM) return (BN + 16) * KS * 2;  // whole boxes, zero-filled parts included
    const int t = static_cast<int>(s / ph[q].kc), ch = static_cast<int>(s % ph[q].kc);
    const int kl = ph[q].klen - ch * KS < KS ? ph[q].klen - ch * KS : KS;
    int rows = 0;
    if (GATED && q == 0) rows = 2 * valid_rows(q, t);
    else rows = valid_rows(q, t);
    return static_cast<u32>((rows + p.m) * kl * 2);
  }
  __device__ __forceinline__ void prefetch_stage(int q, i64 s, int lane) const {
    const int t = static_cast<int>(s / ph[q].kc), ch = static_cast<int>(s % ph[q].kc);
    const int k0 = ch * KS;
    const int kl = ph[q].klen - k0 < KS ? ph[q].klen - k0 : KS;
    if (TM) {
      if (lane == 0) tma_prefetch_2d(&tm->w2, k0, t * BN);  // phase 2 only
      return;
    }
    for (int r = lane; r < BN; r += 32)
      if (const char* src = weight_row(q, t, r)) prefetch_l2(src + static_cast<i64>(k0) * 2, static_cast<u32>(kl) * 2);
  }
  // Waits for slot `slot` to be free before stage i (counted over both phases) fills it.
  __device__ __forceinline__ void acquire_slot(int i, int lane) const {
    if (i >= STAGES && lane == 0) mbar_wait(empty_bar(i % STAGES), static_cast<u32>((i / STAGES - 1) & 1));
    __syncwarp();
  }

  __device__ void producer(u32 gen0) const {
    const int lane = threadIdx.x & 31;
    const u64 policy = evict_first_policy();
    int i = 0;
    for (int j = 0; j < count[0]; ++j, ++i) {
      acquire_slot(i, lane);
      if (lane == 0) mbar_expect_tx(full_bar(i % STAGES), stage_bytes(0, begin[0] + j));
      __syncwarp();
      issue(0, begin[0] + j, i % STAGES, true, true, lane, policy);
    }
    if (count[1] == 0) return;
    // Phase 2's weights do not depend on h: fill the ring with them (and
    // have L2 fetch the next ones) before waiting at the grid barrier.
    const int ahead = count[1] < STAGES ? count[1] : STAGES;
    for (int j = 0; j < ahead; ++j) {
      acquire_slot(i + j, lane);
      if (lane == 0) mbar_expect_tx(full_bar((i + j) % STAGES), stage_bytes(1, begin[1] + j));
      __syncwarp();
      issue(1, begin[1] + j, (i + j) % STAGES, true, false, lane, policy);
    }
    for (int j = ahead; j < count[1] && j < ahead + p.prefetch; ++j) prefetch_stage(1, begin[1] + j, lane);
    if (lane == 0)
      while (load_acquire(p.barrier + 32) == gen0) nanosleep(64);
    __syncwarp();
    fence_proxy_async();
    for (int j = 0; j < ahead; ++j) issue(1, begin[1] + j, (i + j) % STAGES, false, true, lane, policy);
    i += ahead;
    for (int j = ahead; j < count[1]; ++j, ++i) {
      acquire_slot(i, lane);
      if (lane == 0) mbar_expect_tx(full_bar(i % STAGES), stage_bytes(1, begin[1] + j));
      __syncwarp();
      issue(1, begin[1] + j, i % STAGES, true, true, lane, policy);
    }
  }

  // ---- consumer warps ------------------------------------------------------

  // TM: rows are unpadded (512 bytes apart), so the two rows a quarter-warp
  // reads (g even and odd) would hit the same banks. Steps go in pairs: the
  // first load of a pair reads step 2u on even rows and 2u + 1 on odd rows
  // (the two 64-byte halves of a 128-byte window), the second load the
  // other step; a select puts each step's data back in place.
  static __device__ __forceinline__ V4 pick(bool odd, V4 a, V4 b) { return odd ? b : a; }
  __device__ __forceinline__ void compute_tm(float (&acc)[2][2][4], int slot) const {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3, rw = warp % RW, kg = warp / RW;
    const bool odd = g & 1;
    const u32 base = ring(slot) + 16 * t;
    const u32 w0 = base + (rw * 16 + g) * L::kPitch, w1 = w0 + 8 * L::kPitch;
    const u32 a0 = base + (BN + g) * L::kPitch, a1 = a0 + 8 * L::kPitch;
#pragma unroll
    for (int uu = 0; uu < KS / 64 / KG; ++uu) {
      const int u = uu * KG + kg;  // k group kg takes the pairs u = kg, kg + KG, ...
      const u32 first = 128 * u + (odd ? 64 : 0), second = 128 * u + (odd ? 0 : 64);
      const V4 fx0 = lds128(a0 + first), fx1 = lds128(a1 + first), fy0 = lds128(w0 + first), fy1 = lds128(w1 + first);
      const V4 sx0 = lds128(a0 + second), sx1 = lds128(a1 + second), sy0 = lds128(w0 + second), sy1 = lds128(w1 + second);
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // step 2u + h
        const V4 x0 = h == 0 ? pick(odd, fx0, sx0) : pick(odd, sx0, fx0);
        const V4 x1 = h == 0 ? pick(odd, fx1, sx1) : pick(odd, sx1, fx1);
        const V4 y0 = h == 0 ? pick(odd, fy0, sy0) : pick(odd, sy0, fy0);
        const V4 y1 = h == 0 ? pick(odd, fy1, sy1) : pick(odd, sy1, fy1);
        mma(E{}, acc[0][h], x0.x, x1.x, x0.y, x1.y, y0.x, y0.y);
        mma(E{}, acc[0][h], x0.z, x1.z, x0.w, x1.w, y0.z, y0.w);
        mma(E{}, acc[1][h], x0.x, x1.x, x0.y, x1.y, y1.x, y1.y);
        mma(E{}, acc[1][h], x0.z, x1.z, x0.w, x1.w, y1.z, y1.w);
      }
    }
  }

  template <bool CHECK>
  __device__ __forceinline__ void compute(float (&acc)[2][2][4], int slot, int kl) const {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3, rw = warp % RW, kg = warp / RW;
    const u32 base = ring(slot) + 64 * kg;  // k group kg takes the steps s = kg, kg + KG, ...
    const u32 w0 = base + (rw * 16 + g) * L::kPitch + 16 * t, w1 = w0 + 8 * L::kPitch;
    const u32 a0 = base + (BN + g) * L::kPitch + 16 * t, a1 = a0 + 8 * L::kPitch;
#pragma unroll
    for (int ss = 0; ss < KS / 32 / KG; ++ss) {
      const int s = ss * KG + kg;
      if (CHECK && 32 * s >= kl) break;
      const u32 off = 64 * KG * ss;
      V4 x0 = lds128(a0 + off), x1 = lds128(a1 + off), y0 = lds128(w0 + off), y1 = lds128(w1 + off);
      if (CHECK && 32 * s + 8 * t >= kl) x0 = x1 = y0 = y1 = V4{0, 0, 0, 0};  // past K: stale ring bytes
      mma(E{}, acc[0][ss & 1], x0.x, x1.x, x0.y, x1.y, y0.x, y0.y);
      mma(E{}, acc[0][ss & 1], x0.z, x1.z, x0.w, x1.w, y0.z, y0.w);
      mma(E{}, acc[1][ss & 1], x0.x, x1.x, x0.y, x1.y, y1.x, y1.y);
      mma(E{}, acc[1][ss & 1], x0.z, x1.z, x0.w, x1.w, y1.z, y1.w);
    }
  }

  // Elements of a [16, BN] tile a consumer thread takes at a tile end
  // (thread i takes i, i + CT, ...).
  static constexpr int kPer = (16 * BN + CT - 1) / CT;

  // The epilogue of a finished tile, from the tile buffer. Each thread first
  // loads the biases of all its elements, then stores: the compiler may not
  // move a bias load above an earlier element's h or out store (both 16-bit
  // pointers), and one L2 round trip per element stalled the consumers at
  // every tile end while the ring drained (docs/perf-notes.md, gemm-4).
  __device__ __forceinline__ void finish_tile(int q, int t) const {
    const float* tb = tile_buf();
    const int rows = ph[q].rows, vr = valid_rows(q, t);
    const u16* bias = q == 0 ? (GATED ? nullptr : static_cast<const u16*>(p.b1)) : static_cast<const u16*>(p.b2);
    const i64 bias_stride = q == 0 ? p.b1_stride : p.b2_stride;
    float b[kPer];
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int i = static_cast<int>(threadIdx.x) + u * CT, m = i / rows, j = i - m * rows;
      b[u] = bias && i < 16 * rows && m < p.m && j < vr ? to_float(E{}, bias[(t * rows + j) * bias_stride]) : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int i = static_cast<int>(threadIdx.x) + u * CT, m = i / rows, j = i - m * rows;
      if (i >= 16 * rows || m >= p.m || j >= vr) continue;
      float v = tb[m * L::kTilePitch + j];
      const int col = t * rows + j;
      if (q == 0) {
        if (GATED) {
          v = silu(v) * tb[m * L::kTilePitch + rows + j];
        } else {
          if (bias) v += b[u];
          if (p.act == 1) v = v < 0.0f ? 0.0f : v;  // NaN stays NaN, as torch.relu
          else if (p.act == 2) v = gelu_tanh(v);
        }
        static_cast<u16*>(p.h)[m * p.ldh + col] = from_float(E{}, v);
      } else {
        if (bias) v += b[u];
        static_cast<u16*>(p.out)[m * p.ldo + col] = from_float(E{}, v);
      }
    }
  }

  // The end of a run of stages on tile t of phase q: the warps' sums to the
  // tile buffer, then finished here or via the partial slots.
  __device__ void end_run(float (&acc)[2][2][4], int q, int t) const {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tq = lane & 3, rw = warp % RW, kg = warp / RW;
    float* tb = tile_buf();
    consumers_sync(CT);  // the previous tile's readers of the buffer are done
    float* mine = tb + kg * 16 * L::kTilePitch;  // k group kg's own buffer
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int col = rw * 16 + j * 8 + 2 * tq;
      mine[g * L::kTilePitch + col] = acc[j][0][0] + acc[j][1][0];
      mine[g * L::kTilePitch + col + 1] = acc[j][0][1] + acc[j][1][1];
      mine[(g + 8) * L::kTilePitch + col] = acc[j][0][2] + acc[j][1][2];
      mine[(g + 8) * L::kTilePitch + col + 1] = acc[j][0][3] + acc[j][1][3];
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][0][e] = acc[j][1][e] = 0.0f;
    }
    consumers_sync(CT);
    if (KG > 1) {
      // The k groups' sums, added in group order (deterministic) into buffer 0.
      for (int i = threadIdx.x; i < 16 * BN; i += CT) {
        const int at = (i / BN) * L::kTilePitch + i % BN;
        float v = tb[at];
#pragma unroll
        for (int q = 1; q < KG; ++q) v += tb[q * 16 * L::kTilePitch + at];
        tb[at] = v;
      }
      consumers_sync(CT);
    }
    const i64 s = ph[q].stages();
    const int first = owner(static_cast<i64>(t) * ph[q].kc, s, grid);
    const int last = owner(static_cast<i64>(t + 1) * ph[q].kc - 1, s, grid);
    if (first != last) {
      // Split tile: this CTA's slot is 0 when t is its first tile, else 1.
      auto slot_of = [&](int c) {
        const int first_tile = static_cast<int>(range_begin(c, s, grid) / ph[q].kc);
        return p.partials + ((static_cast<i64>(q) * grid + c) * 2 + (first_tile == t ? 0 : 1)) * 16 * BN;
      };
      float* slot = slot_of(cta);
      for (int i = threadIdx.x; i < 16 * BN; i += CT) st_cg(slot + i, tb[(i / BN) * L::kTilePitch + i % BN]);
      consumers_sync(CT);
      // With fewer stages than CTAs some CTAs own none: they take no part.
      auto takes_part = [&](int c) { return range_begin(c + 1, s, grid) > range_begin(c, s, grid); };
      if (threadIdx.x == 0) {
        u32* counter = p.counters + (q == 0 ? 0 : ph[0].tiles) + t;
        u32 parts = 0;
        for (int c = first; c <= last; ++c) parts += takes_part(c) ? 1u : 0u;
        fence_gpu();
        const bool is_last = atomic_add(counter, 1) == parts - 1;
        if (is_last) {
          store_relaxed(counter, 0);  // ready for the next launch
          fence_gpu();
        }
        *flag() = is_last;
      }
      consumers_sync(CT);
      if (!*flag()) return;
      // The last CTA of the tile adds every slot in CTA order (deterministic).
      // A thread loads one slot's values of all its elements at once, so a
      // slot costs one L2 round trip, not one per element (gemm-4).
      float v[kPer];
#pragma unroll
      for (int u = 0; u < kPer; ++u) v[u] = 0.0f;
      for (int c = first; c <= last; ++c) {
        if (!takes_part(c)) continue;
        const float* src = slot_of(c);
        float x[kPer];
#pragma unroll
        for (int u = 0; u < kPer; ++u) {
          const int i = static_cast<int>(threadIdx.x) + u * CT;
          x[u] = i < 16 * BN ? ld_cg(src + i) : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < kPer; ++u) v[u] += x[u];
      }
#pragma unroll
      for (int u = 0; u < kPer; ++u) {
        const int i = static_cast<int>(threadIdx.x) + u * CT;
        if (i < 16 * BN) tb[(i / BN) * L::kTilePitch + i % BN] = v[u];
      }
      consumers_sync(CT);
    }
    finish_tile(q, t);
  }

  __device__ void consumer() const {
    const int lane = threadIdx.x & 31;
    float acc[2][2][4];
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][0][e] = acc[j][1][e] = 0.0f;
    int i = 0;
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      int cur = -1;
      for (int j = 0; j < count[q]; ++j, ++i) {
        const i64 s = begin[q] + j;
        const int t = static_cast<int>(s / ph[q].kc), ch = static_cast<int>(s % ph[q].kc);
        if (t != cur && cur >= 0) end_run(acc, q, cur);
        cur = t;
        const int kl = ph[q].klen - ch * KS < KS ? ph[q].klen - ch * KS : KS;
        const int slot = i % STAGES;
        mbar_wait(full_bar(slot), static_cast<u32>((i / STAGES) & 1));
#ifdef OPFUSE_DECODE_NO_MMA
        if (false)  // diagnostic build (config tag "...n"): the stage is released unread
#endif
        if (TM) compute_tm(acc, slot);  // the boxes are whole: k past K arrived as zeros
        else if (kl == KS) compute<false>(acc, slot, kl);
        else compute<true>(acc, slot, kl);
        __syncwarp();
        if (lane == 0) mbar_arrive(empty_bar(slot));
      }
      if (cur >= 0) end_run(acc, q, cur);
      if (q == 0) {
        // Arrive at the grid barrier once every h value of this CTA is written.
        consumers_sync(CT);
        if (threadIdx.x == 0) {
          fence_gpu();
          if (atomic_add(p.barrier, 1) == static_cast<u32>(grid - 1)) {
            store_relaxed(p.barrier, 0);
            fence_gpu();
            red_release_add(p.barrier + 32, 1);
          }
        }
      }
    }
  }

  __device__ void run() const {
    const int warp = threadIdx.x >> 5;
    u32 gen0 = 0;
    if (threadIdx.x == 0) {
      for (int s = 0; s < STAGES; ++s) {
        mbar_init(full_bar(s), 1);
        mbar_init(empty_bar(s), CW);
      }
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    if (warp == CW && (threadIdx.x & 31) == 0) gen0 = load_acquire(p.barrier + 32);  // before any arrival of this CTA
    // Activation rows past M stay zero (no copy writes them; tensor copies
    // write them as zeros).
    if (!TM)
      for (int s = 0; s < STAGES; ++s)
        for (int i = threadIdx.x; i < (16 - p.m) * L::kPitch / 4; i += blockDim.x)
          reinterpret_cast<u32*>(smem + s * L::kStageBytes + (BN + p.m) * L::kPitch)[i] = 0;
    __syncthreads();
    if (warp == CW) producer(gen0);
    else consumer();
  }
};

}  // namespace opfuse_decode

#define OPFUSE_DECODE_MLP_ENTRY(NAME, E, GATED, BN, KS, STAGES, KG, TM)                                         \
  extern "C" __global__ void __launch_bounds__(((BN) / 16 * (KG) + 1) * 32, 1)                                    \
      NAME(const __grid_constant__ opfuse_decode::DecodeMlpParams p, const __grid_constant__ opfuse_decode::TensorMaps tm) { \
    extern __shared__ __align__(128) unsigned char opfuse_decode_smem[];                                          \
    opfuse_decode::Kernel<opfuse_decode::E, GATED, BN, KS, STAGES, KG, TM>(p, &tm, opfuse_decode_smem).run();       \
  }
