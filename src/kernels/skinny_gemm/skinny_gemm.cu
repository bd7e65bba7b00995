// opfuse skinny GEMM: a weight-streaming kernel for small M (decode shapes).
//
// Compiled at run time by NVRTC. It includes NO header (NVRTC on the target
// machines finds no CUDA headers): every device helper is plain C++ or
// inline PTX.
//
//   D[m, n] = act(sum_k A[m, k] W[n, k] + bias[n] + C[m, n]),  aux[m, n] = the act's input
//
// or, in the gated form (GATE = 1, Llama's down projection), with A the
// product of two [M, K] operands read in its place:
//
//   A[m, k] = round(silu(G[m, k]) * U[m, k])     (G = p.a, U = p.a2)
//
// so that silu(x @ w1^T) * (x @ w3^T) never makes its own trip through HBM
// and its kernel and launch go (the runtime falls back to that kernel and
// cuBLASLt where this one does not apply).
//
// for 1 <= M <= 16, W the [N, K] weight of nn.Linear (B = W^T), bf16 or f16
// elements, float32 accumulation; act is none, relu or tanh-gelu. The CPU
// reference with the same semantics is skinny_gemm_reference.{h,cpp}.
//
// Why tensor cores: at M = 16 every weight element (2 bytes) takes part in
// 16 multiply-adds. Streaming W at ~4.4 TB/s is 2.2e12 elements/s, i.e.
// 3.5e13 FMA/s = 70 TFLOP/s, more than the H200's ~67 TFLOP/s of float32
// FMA (and each element would also need a conversion and an A operand). So
// the products run on mma.sync.m16n8k16 (float32 accumulate): 70 TFLOP/s is
// a small fraction of its dense rate, and the SM's issue slots stay free for
// the loads. Rows of A past M are zeros (no load), so M < 16 costs the same
// as M = 16: the kernel is bound by the bytes of W, not by M.
//
// Design:
// - A CTA owns BN = 8 * NT consecutive rows of W (output features) and a
//   range of K; its WARPS warps split that range by chunks of 32 * U
//   elements (interleaved, so the CTA reads neighbouring DRAM pages); a
//   warp covers all BN rows of each of its chunks.
// - W goes straight from global memory to the MMA's B registers, no shared
//   memory: a lane reads 16 bytes (8 consecutive k) of one row with
//   ld.global.nc.L1::no_allocate, NT * U such loads in flight per thread
//   (2 * NT * U with PIPE = 1, below).
//   The MMA fragment wants lane (g = lane / 4, t = lane % 4) to hold k
//   {2t, 2t+1, 2t+8, 2t+9} of row g; a sum over k does not care how k is
//   numbered, so logical k {2t, 2t+1 | 2t+8, 2t+9} of the first MMA are
//   physical k 8t + {0, 1 | 2, 3} and of the second 8t + {4, 5 | 6, 7}:
//   one 128-bit load feeds two MMAs with no shuffle. A uses the same
//   renumbering (two 128-bit loads, rows g and g + 8, through L1/L2: A is
//   small and every CTA reads it). A costs M / BN of W's bytes in L2 reads.
// - Every element of W is read exactly once; rows of the last tile past N
//   are clamped to row N - 1 (read, never stored), and the last chunk of K
//   loads zeros past K.
// - The warps' partial sums meet in shared memory and are added in a fixed
//   order (deterministic, no atomics). With CLUSTER > 1 (sm_90 only) the K
//   range is also split over the CTAs of a thread-block cluster, whose
//   partials are added in rank order through distributed shared memory: it
//   gives enough CTAs to fill the GPU when N / BN is small (N = 4096) without
//   a workspace, a second kernel or atomics.
//
// Requirements (checked by the launcher, src/runtime/skinny_gemm_launcher.cpp):
// K % 8 == 0; A (G and U with GATE), W 16-byte aligned with row strides multiples of 8 elements;
// M <= 16; N, K < 2^31; 2 * 8 * NT * ldw < 2^31. Launch: grid (ceil(N / BN) * CLUSTER), block
// WARPS * 32, no dynamic shared memory, one argument SkinnyParams by value.
//
// Entry points: the launcher appends one line,
//   OPFUSE_SKINNY_ENTRY(name, bf16, NT, U, WARPS, MIN_BLOCKS, PIPE, GATE)   or
//   OPFUSE_SKINNY_CLUSTER_ENTRY(name, bf16, NT, U, WARPS, MIN_BLOCKS, PIPE, GATE, CLUSTER)
// which defines an extern "C" kernel (no name mangling to look up).

namespace opfuse_skinny {

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;

struct bf16 { u16 bits; };
struct f16 { u16 bits; };

// Kernel argument; mirrored by the launcher (only append fields, in both places).
struct SkinnyParams {
  const void* a;     // [M, K], k unit-stride
  i64 lda;           // elements between rows of A
  const void* w;     // [N, K], k unit-stride
  i64 ldw;
  void* d;           // [M, N], n unit-stride
  i64 ldd;
  const void* bias;  // [N] or null
  i64 bias_stride;
  const void* c;     // residual [M, N] (n unit-stride) or null
  i64 ldc;
  void* aux;         // [M, N] (n unit-stride) or null: the activation's input
  i64 ldaux;
  int m, n, k;
  int act;           // 0 none, 1 relu, 2 gelu (tanh approximation)
  const void* a2;    // GATE: U [M, K], k unit-stride (A = silu(p.a) * U)
  i64 lda2;
};
static_assert(sizeof(SkinnyParams) == 128, "SkinnyParams layout is a launch ABI");

struct V4 { u32 x, y, z, w; };
struct F4 { float x, y, z, w; };

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

// ---------------------------------------------------------------------------
// PTX helpers
// ---------------------------------------------------------------------------

// W: read once, never again: no L1 allocation; the L2 fetches whole 256-byte
// blocks (a warp's load covers 64 bytes of each of 8 rows; the rest of the
// block is the next loads').
__device__ __forceinline__ V4 ld_stream(const void* p) {
  V4 r;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

// A: small, read by every CTA: cached.
__device__ __forceinline__ V4 ld_cached(const void* p) {
  V4 r;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

__device__ __forceinline__ void mma(bf16, float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma(f16, float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float ex2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// Thread-block clusters (sm_90): only instantiated when CLUSTER > 1.
__device__ __forceinline__ u32 cluster_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ F4 ld_cluster(const void* local, u32 rank) {
  u32 addr, remote;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(addr) : "l"(local));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
  F4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(remote)
               : "memory");
  return v;
}

__device__ __forceinline__ F4 add(F4 a, F4 b) { return {a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w}; }

// Timeline of a CTA, for diagnosis only (trace configs, tag suffix "t": the
// launcher defines OPFUSE_SKINNY_TRACE and passes a buffer as the kernel's
// last argument; elsewhere these are empty and the kernel is unchanged).
// Thread 0 (warp 0, which runs MMAs in both kernels) writes %globaltimer
// (ns) to trace[6 * CTA + k]: 0 entry, 1 its first stage's MMAs done (the
// TMA kernel only: in the register kernel's loop the check changes how
// ptxas allocates, 156 -> 136 registers), 2 main loop done, 3 exit; word 4
// is the SM. scripts/skinny_timeline.py reads them.
#ifdef OPFUSE_SKINNY_TRACE
__shared__ unsigned long long* trace_buffer;  // set by thread 0 at entry, read by thread 0 only
__device__ __forceinline__ void trace_stamp(int k) {
  if (threadIdx.x != 0 || !trace_buffer) return;
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  trace_buffer[6 * blockIdx.x + k] = t;
  if (k == 0) {
    u32 sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    trace_buffer[6 * blockIdx.x + 4] = sm;
  }
}
// Stamp 1 once, after the first chunk's MMAs.
struct FirstMmaStamp {
  bool pending = true;
  __device__ __forceinline__ void operator()() {
    if (pending) trace_stamp(1);
    pending = false;
  }
};
#define OPFUSE_SKINNY_TRACE_PARAM , unsigned long long* trace
#define OPFUSE_SKINNY_TRACE_SET \
  if (threadIdx.x == 0) opfuse_skinny::trace_buffer = trace;
#else
__device__ __forceinline__ void trace_stamp(int) {}
struct FirstMmaStamp {
  __device__ __forceinline__ void operator()() {}
};
#define OPFUSE_SKINNY_TRACE_PARAM
#define OPFUSE_SKINNY_TRACE_SET
#endif

// Programmatic dependent launch (sm_90; the launcher sets the launch
// attribute there, and without it both are no-ops): the kernel may start
// while the previous kernel of the stream (e.g. the up projection whose
// output is A) still runs. Nothing it reads may be touched before
// grid_dependency_wait, except through L2 prefetches: L2 is the point of
// coherence, so a line prefetched early is still the line written last.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// Lets the next kernel of the stream start its own prologue (its wait still
// waits for this grid to end and flush).
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// ---------------------------------------------------------------------------
// Epilogue
// ---------------------------------------------------------------------------

// 0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)): exp has ~2^-22 relative error
// where tanh.approx has 2^-11, too coarse for f16 outputs near 0.
__device__ __forceinline__ float gelu_tanh(float x) {
  const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  return x / (1.0f + ex2(-2.8853900817779268f * u));  // -2u * log2(e)
}

// A value's epilogue inputs (store_tile_value's numbering): the bias of
// columns n, n + 1 and the residual of its four entries, zero past M and N.
// Loaded where the kernel chooses: the TMA kernel loads them ahead of its
// main loop, since at the tail their latency (1-2 us behind the weight
// stream of the other CTAs) sits on the critical path of the last CTA.
struct Addends {
  float b0, b1;
  F4 c;
};
template <class E>
__device__ __forceinline__ Addends load_addends(const SkinnyParams& p, int n0, int i) {
  const int j = i >> 5, l = i & 31, g = l >> 2, t = l & 3;
  const int n = n0 + 8 * j + 2 * t;
  Addends a{0.0f, 0.0f, {0.0f, 0.0f, 0.0f, 0.0f}};
  if (p.bias) {
    const u16* b = static_cast<const u16*>(p.bias);
    if (n < p.n) a.b0 = to_float(E{}, b[n * p.bias_stride]);
    if (n + 1 < p.n) a.b1 = to_float(E{}, b[(n + 1) * p.bias_stride]);
  }
  if (p.c) {
    const u16* c = static_cast<const u16*>(p.c);
    if (g < p.m && n < p.n) a.c.x = to_float(E{}, c[g * p.ldc + n]);
    if (g < p.m && n + 1 < p.n) a.c.y = to_float(E{}, c[g * p.ldc + n + 1]);
    if (g + 8 < p.m && n < p.n) a.c.z = to_float(E{}, c[(g + 8) * p.ldc + n]);
    if (g + 8 < p.m && n + 1 < p.n) a.c.w = to_float(E{}, c[(g + 8) * p.ldc + n + 1]);
  }
  return a;
}

template <class E>
__device__ __forceinline__ void store_one(const SkinnyParams& p, int m, int n, float v, float bias, float c) {
  if (m >= p.m || n >= p.n) return;
  // Unconditional: the addends are zero where there is no bias or residual
  // (only a zero's sign can differ). Branches here, 16 stores a thread with
  // the loads hoisted out, sent NVRTC's optimizer into minutes of work.
  v += bias;
  v += c;
  if (p.aux) static_cast<u16*>(p.aux)[m * p.ldaux + n] = from_float(E{}, v);
  if (p.act == 1) v = v < 0.0f ? 0.0f : v;  // NaN stays NaN, as torch.relu
  else if (p.act == 2) v = gelu_tanh(v);
  static_cast<u16*>(p.d)[m * p.ldd + n] = from_float(E{}, v);
}

// Value i of the CTA's tile: tile j = i / 32 of lane l = i % 32, the MMA
// accumulator layout: (x, y) are rows g, columns 2t, 2t+1 and (z, w) row g+8.
template <class E>
__device__ __forceinline__ void store_tile_value(const SkinnyParams& p, int n0, int i, F4 v, const Addends& a) {
  const int j = i >> 5, l = i & 31, g = l >> 2, t = l & 3;
  const int n = n0 + 8 * j + 2 * t;
  store_one<E>(p, g, n, v.x, a.b0, a.c.x);
  store_one<E>(p, g, n + 1, v.y, a.b1, a.c.y);
  store_one<E>(p, g + 8, n, v.z, a.b0, a.c.z);
  store_one<E>(p, g + 8, n + 1, v.w, a.b1, a.c.w);
}
template <class E>
__device__ __forceinline__ void store_tile_value(const SkinnyParams& p, int n0, int i, F4 v) {
  store_tile_value<E>(p, n0, i, v, load_addends<E>(p, n0, i));
}

// The cluster's partial sums of a tile (part[i]: value i of this CTA's
// partial tile, as store_tile_value numbers them), added in rank order through
// distributed shared memory: each CTA finishes 1 / CLUSTER of the tile,
// threads 0 .. THREADS - 1 value threadIdx.x + r * THREADS of its share in
// round r, with addends(r, value) as its epilogue inputs. Every thread of
// the CTA calls it (the cluster barriers are .aligned).
template <int CLUSTER, int VALUES, int THREADS>
constexpr int cluster_store_rounds = (VALUES / CLUSTER + THREADS - 1) / THREADS;
template <class E, int CLUSTER, int VALUES, int THREADS, class AddendsOf>
__device__ __forceinline__ void cluster_sum_store(const SkinnyParams& p, int n0, F4* part, int rank,
                                                  AddendsOf addends) {
  cluster_sync();
  constexpr int share = VALUES / CLUSTER;
#pragma unroll
  for (int r = 0; r < cluster_store_rounds<CLUSTER, VALUES, THREADS>; ++r) {
    const int i = static_cast<int>(threadIdx.x) + r * THREADS;
    if (threadIdx.x < THREADS && i < share) {
      const int idx = rank * share + i;
      F4 s = ld_cluster(&part[idx], 0);
#pragma unroll
      for (int q = 1; q < CLUSTER; ++q) s = add(s, ld_cluster(&part[idx], static_cast<u32>(q)));
      store_tile_value<E>(p, n0, idx, s, addends(r, idx));
    }
  }
  cluster_sync();  // no CTA exits while another still reads its shared memory
}

// ---------------------------------------------------------------------------
// Main loop
// ---------------------------------------------------------------------------

// One chunk's operands in registers: W's 16-byte pieces of every row of the
// tile and A's rows g and g + 8, U loads along k each.
template <int NT, int U, int GATE>
struct Operands {
  V4 w[U][NT], a0[U], a1[U];
  V4 u0[GATE ? U : 1], u1[GATE ? U : 1];  // GATE: U's rows g and g + 8 (A = silu(a) * u)
};

// A's row pointers of a lane: G (or A) rows g and g + 8, and with GATE U's.
struct ARows {
  const char *lo, *hi, *ulo, *uhi;
};

// Issues one chunk's loads (32 * U values of k, every row of the tile) of one
// warp. CHECK: the chunk crosses K (only the last one does), so groups past K
// load zeros.
template <int NT, int U, int GATE, bool CHECK>
__device__ __forceinline__ void load_chunk(Operands<NT, U, GATE>& o, const char* wbase, const int (&roff)[NT],
                                           const ARows& ar, int group0, int t, int groups) {
  const V4 zero = {0, 0, 0, 0};
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int gi = group0 + 4 * u;  // the quad's first group; the lane's is gi + t (wbase, alo, ahi hold t)
    const bool in = !CHECK || gi + t < groups;
    const i64 off = static_cast<i64>(gi) * 16;
#pragma unroll
    for (int j = 0; j < NT; ++j) o.w[u][j] = in ? ld_stream(wbase + roff[j] + off) : zero;
    o.a0[u] = in && ar.lo ? ld_cached(ar.lo + off) : zero;
    o.a1[u] = in && ar.hi ? ld_cached(ar.hi + off) : zero;
    if constexpr (GATE) {
      o.u0[u] = in && ar.ulo ? ld_cached(ar.ulo + off) : zero;
      o.u1[u] = in && ar.uhi ? ld_cached(ar.uhi + off) : zero;
    }
  }
}

// silu(g) * u of two packed 16-bit pairs, in float32, rounded once to E
// (as the gate kernel it replaces: one rounding of the product). silu(x) =
// x / (1 + 2^(-x log2 e)); rows and k past the data are zeros: silu(0) * 0 = 0.
template <class E>
__device__ __forceinline__ u32 gate_pair(u32 g, u32 u) {
  u32 r = 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float x = to_float(E{}, static_cast<u16>(g >> (16 * h)));
    const float y = to_float(E{}, static_cast<u16>(u >> (16 * h)));
    const float s = x / (1.0f + ex2(-1.4426950408889634f * x));
    r |= static_cast<u32>(from_float(E{}, s * y)) << (16 * h);
  }
  return r;
}
template <class E>
__device__ __forceinline__ V4 gate4(V4 g, V4 u) {
  return {gate_pair<E>(g.x, u.x), gate_pair<E>(g.y, u.y), gate_pair<E>(g.z, u.z), gate_pair<E>(g.w, u.w)};
}

template <class E, int NT, int U, int GATE>
__device__ __forceinline__ void mma_chunk(float (&acc)[NT][4], const Operands<NT, U, GATE>& o) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    // GATE: the product formed here, once the loads have landed (at load
    // time it would wait for them and empty the pipeline).
    V4 a0 = o.a0[u], a1 = o.a1[u];
    if constexpr (GATE) {
      a0 = gate4<E>(a0, o.u0[u]);
      a1 = gate4<E>(a1, o.u1[u]);
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      mma(E{}, acc[j], a0.x, a1.x, a0.y, a1.y, o.w[u][j].x, o.w[u][j].y);
      mma(E{}, acc[j], a0.z, a1.z, a0.w, a1.w, o.w[u][j].z, o.w[u][j].w);
    }
  }
}

// A warp's full chunks c, c + WARPS, ... below c_full_end; returns the
// first chunk past them. PIPE = 0: each chunk's loads, then its MMAs, so a
// warp's loads in flight fall to zero while it waits for them and runs the
// MMAs. PIPE = 1: the next chunk's loads go out before this chunk's MMAs
// (two operand sets in registers), so a warp always has a chunk in flight;
// PIPE = 2 the same as a ping-pong that keeps ptxas from undoing it (below).
// scripts/micro/weight_stream_runs.cu on the H200: the read rate follows
// the bytes in flight an SM (64 KB in bursts: 3.2-4.2 TB/s; 128 KB:
// 4.1-4.24), not the 64-byte pieces' run length (3% between 128-byte and
// 16 KB runs).
template <class E, int NT, int U, int WARPS, int PIPE, int GATE>
__device__ __forceinline__ int full_chunks(float (&acc)[NT][4], const char* wbase, const int (&roff)[NT],
                                           const ARows& ar, int c, int c_full_end, int t, int groups) {
  if constexpr (PIPE == 0) {
    for (; c < c_full_end; c += WARPS) {
      Operands<NT, U, GATE> o;
      load_chunk<NT, U, GATE, false>(o, wbase, roff, ar, c * 4 * U, t, groups);
      mma_chunk<E>(acc, o);
    }
    return c;
  } else if constexpr (PIPE == 2) {
    // The same two chunks in flight as PIPE = 1, written as a ping-pong of
    // two named operand sets in a loop that is not unrolled. Why: in PIPE =
    // 1's SASS (sm_90, n8u1w8b1c2p1) ptxas unrolls the loop by two and
    // renames registers so that, in one half, the next chunk's loads reuse
    // registers the current chunk's MMAs still read: those MMAs go first,
    // the warp waits for its one chunk in flight, and the loads follow.
    // Fixed sets keep every load ahead of the MMAs it does not feed.
    if (c >= c_full_end) return c;
    Operands<NT, U, GATE> x, y;
    load_chunk<NT, U, GATE, false>(x, wbase, roff, ar, c * 4 * U, t, groups);
    c += WARPS;
    // One half of the ping-pong: `next`'s loads, then `cur`'s MMAs; true
    // once `cur` was the last chunk.
    auto half = [&](Operands<NT, U, GATE>& cur, Operands<NT, U, GATE>& next) {
      if (c >= c_full_end) {
        mma_chunk<E>(acc, cur);
          return true;
      }
      load_chunk<NT, U, GATE, false>(next, wbase, roff, ar, c * 4 * U, t, groups);
      c += WARPS;
      mma_chunk<E>(acc, cur);
      return false;
    };
#pragma unroll 1
    while (!half(x, y) && !half(y, x)) {
    }
    return c;
  } else {
    if (c >= c_full_end) return c;
    Operands<NT, U, GATE> cur;
    load_chunk<NT, U, GATE, false>(cur, wbase, roff, ar, c * 4 * U, t, groups);
    for (c += WARPS; c < c_full_end; c += WARPS) {
      Operands<NT, U, GATE> next;
      load_chunk<NT, U, GATE, false>(next, wbase, roff, ar, c * 4 * U, t, groups);
      mma_chunk<E>(acc, cur);
      cur = next;
    }
    mma_chunk<E>(acc, cur);
    return c;
  }
}

template <class E, int NT, int U, int WARPS, int CLUSTER, int PIPE, int GATE>
__device__ __forceinline__ void skinny_gemm_body(const SkinnyParams& p) {
  static_assert(NT >= 1 && U >= 1 && WARPS >= 1, "bad tile");
  static_assert(CLUSTER == 1 || CLUSTER == 2 || CLUSTER == 4 || CLUSTER == 8, "cluster of 1, 2, 4 or 8 CTAs");
  constexpr int BN = 8 * NT;
  constexpr int RJ = NT < 8 ? NT : 8;  // tiles per round of the shared-memory reduction (32 KB at 8 warps)
  static_assert(NT % RJ == 0, "NT must be a multiple of 8 when above 8");
  __shared__ F4 red[WARPS][RJ * 32];
  __shared__ F4 part[CLUSTER > 1 ? NT * 32 : 1];

  trace_stamp(0);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int rank = CLUSTER > 1 ? static_cast<int>(cluster_rank()) : 0;
  const int n0 = static_cast<int>(blockIdx.x / CLUSTER) * BN;

  // Row j of this lane: wbase + roff[j], a 32-bit byte offset (the launcher
  // checks 2 * BN * ldw < 2^31) to save registers over NT 64-bit pointers.
  const int row0 = n0 + g < p.n ? n0 + g : p.n - 1;
  const char* wbase = static_cast<const char*>(p.w) + (static_cast<i64>(row0) * p.ldw + 8 * t) * 2;
  int roff[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int row = n0 + 8 * j + g < p.n ? n0 + 8 * j + g : p.n - 1;  // past N: read a real row, store nothing
    roff[j] = static_cast<int>((row - row0) * p.ldw * 2);
  }
  ARows ar;
  const char* abase = static_cast<const char*>(p.a) + 16 * t;
  ar.lo = g < p.m ? abase + static_cast<i64>(g) * p.lda * 2 : nullptr;
  ar.hi = g + 8 < p.m ? abase + static_cast<i64>(g + 8) * p.lda * 2 : nullptr;
  ar.ulo = ar.uhi = nullptr;
  if constexpr (GATE) {
    const char* ubase = static_cast<const char*>(p.a2) + 16 * t;
    ar.ulo = g < p.m ? ubase + static_cast<i64>(g) * p.lda2 * 2 : nullptr;
    ar.uhi = g + 8 < p.m ? ubase + static_cast<i64>(g + 8) * p.lda2 * 2 : nullptr;
  }

  // K in 16-byte groups; a chunk is 4 * U groups (4 lanes of a row, U loads each).
  const int groups = p.k >> 3;
  const int chunks = (groups + 4 * U - 1) / (4 * U);
  const int full = groups / (4 * U);
  const int c_begin = static_cast<int>(static_cast<i64>(chunks) * rank / CLUSTER);
  const int c_end = static_cast<int>(static_cast<i64>(chunks) * (rank + 1) / CLUSTER);

  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  const int c_full_end = c_end < full ? c_end : full;
  // Before the wait: the warp's first two chunks of W into L2 (W is read
  // once, and its bytes do not depend on the previous kernel's results in
  // any way the prefetch could get wrong), so HBM is busy from the start.
  for (int pc = c_begin + warp, i = 0; i < 2 && pc < c_full_end; pc += WARPS, ++i)
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int j = 0; j < NT; ++j) prefetch_l2(wbase + roff[j] + static_cast<i64>(pc * 4 * U + 4 * u) * 16);
  grid_dependency_wait();
  const int c = full_chunks<E, NT, U, WARPS, PIPE, GATE>(acc, wbase, roff, ar, c_begin + warp, c_full_end, t, groups);
  if (c < c_end) {  // the ragged last chunk
    Operands<NT, U, GATE> o;
    load_chunk<NT, U, GATE, true>(o, wbase, roff, ar, c * 4 * U, t, groups);
    mma_chunk<E>(acc, o);
  }

  trace_stamp(2);
  launch_dependents();  // the rest is this tile's sums and stores

  // Warps' partials: summed in warp order, RJ tiles per round.
#pragma unroll
  for (int r = 0; r < NT / RJ; ++r) {
    if (r > 0) __syncthreads();  // the previous round's reads are done
#pragma unroll
    for (int j = 0; j < RJ; ++j) red[warp][j * 32 + lane] = {acc[r * RJ + j][0], acc[r * RJ + j][1], acc[r * RJ + j][2], acc[r * RJ + j][3]};
    __syncthreads();
    for (int i = threadIdx.x; i < RJ * 32; i += WARPS * 32) {
      F4 s = red[0][i];
#pragma unroll
      for (int w = 1; w < WARPS; ++w) s = add(s, red[w][i]);
      if constexpr (CLUSTER > 1) part[r * RJ * 32 + i] = s;
      else store_tile_value<E>(p, n0, r * RJ * 32 + i, s);
    }
  }
  if constexpr (CLUSTER > 1)
    cluster_sum_store<E, CLUSTER, NT * 32, WARPS * 32>(p, n0, part, rank,
                                                      [&](int, int idx) { return load_addends<E>(p, n0, idx); });
  trace_stamp(3);
}

}  // namespace opfuse_skinny

#define OPFUSE_SKINNY_ENTRY(NAME, E, NT, U, WARPS, MIN_BLOCKS, PIPE, GATE)                        \
  extern "C" __global__ void __launch_bounds__((WARPS) * 32, MIN_BLOCKS)                          \
      NAME(const opfuse_skinny::SkinnyParams p OPFUSE_SKINNY_TRACE_PARAM) {                       \
    OPFUSE_SKINNY_TRACE_SET                                                                       \
    opfuse_skinny::skinny_gemm_body<opfuse_skinny::E, NT, U, WARPS, 1, PIPE, GATE>(p);            \
  }
#define OPFUSE_SKINNY_CLUSTER_ENTRY(NAME, E, NT, U, WARPS, MIN_BLOCKS, PIPE, GATE, CLUSTER)       \
  extern "C" __global__ void __launch_bounds__((WARPS) * 32, MIN_BLOCKS) __cluster_dims__(CLUSTER, 1, 1) \
      NAME(const opfuse_skinny::SkinnyParams p OPFUSE_SKINNY_TRACE_PARAM) {                       \
    OPFUSE_SKINNY_TRACE_SET                                                                       \
    opfuse_skinny::skinny_gemm_body<opfuse_skinny::E, NT, U, WARPS, CLUSTER, PIPE, GATE>(p);      \
  }
