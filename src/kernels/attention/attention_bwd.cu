// opfuse attention backward: FlashAttention-2 style kernels (mma.sync, sm_80+).
//
// Compiled at run time by NVRTC after attention_ptx.cu (the shared PTX
// helpers, prepended by the launchers); no #include. Given the forward's
// inputs q [B, Hq, Sq, D], k, v [B, Hkv, Sk, D], its output O and
// log-sum-exp LSE (float32, natural log; -inf for a row that sees no key) and
// the output gradient dO, it computes, with P = exp(scale * Q K^T - LSE)
// (recomputed, causal mask bottom-right: query i sees key j iff j <= i + Sk - Sq),
//
//   Delta_i = sum_d dO_id O_id              dS = P * (dO V^T - Delta)
//   dV = P^T dO      dK = scale dS^T Q      dQ = scale dS K
//
// with dK and dV summed over the Hq / Hkv query heads of each KV head (GQA/MQA).
// The CPU reference with the same semantics is attention_reference.cpp
// (attention_backward_reference).
//
// Kernels (one launch sequence per call, all on the caller's stream):
//   1. attention_bwd_preprocess: Delta and LSE * log2(e) (+inf for a row that
//      sees no key, so that exp2 gives P = 0 there and never NaN) into float32
//      workspaces of Sq_pad = round_up(Sq, 128) rows per (b, h); padding rows
//      get Delta = 0, +inf. In atomic mode it also zeroes the dQ accumulator.
//   2. attention_bwd_dkdv: one CTA per BLOCK_N keys of one (b, kv head). It loops
//      over the query heads of its group and over the query blocks, recomputes
//      S^T = K Q^T and dP^T = V dO^T (key rows in each warp), P^T and dS^T, and
//      accumulates dV += P^T dO and dK += dS^T Q in registers, so GQA sums need
//      no atomics and dK, dV are deterministic. With WITH_DQ it also adds
//      dS K into the float32 dQ accumulator with atomics (order-dependent
//      rounding: not bitwise reproducible).
//   3a. atomic mode: attention_bwd_dq_convert: dQ = scale * accumulator, in the
//      input dtype;
//   3b. deterministic mode (kernel 2 without WITH_DQ): attention_bwd_dq, one
//      CTA per BLOCK_M query rows of one (b, h), loops over the key blocks,
//      recomputes S, P, dP, dS and accumulates dQ in registers: no atomics, so
//      reruns are bitwise equal.
//
// attn_mask (the Mask template argument of kernels 2 and 3b, attention_ptx.cu):
// P is recomputed as exp2(S * scale * log2 e + mask * log2 e - LSE2), the
// forward's formula; MaskFull reads each thread's (query, key) elements from
// global memory, MaskKeyPad the thread's keys once (dK/dV: two per thread for
// the whole CTA) or per key block (dQ). dMask is not computed here (the op
// takes its PyTorch-ops backward when an additive mask needs a gradient).
//
// Masks: the causal diagonal, and keys past Sk in a ragged last key block
// (zero-filled K rows give S = 0 and P = exp(-LSE), which overflows for rows
// whose scores are all very negative: inf * 0 would put NaN into dQ). Rows
// past Sq need none: their LSE2 = +inf gives P = 0, and their dO is zero.
//
// Launch ABI: docs/attention.md ("Backward"). One kernel argument, AttnBwdParams.

namespace opfuse_attn {

// Kernel argument. The layout is part of the launch ABI (mirrored by the
// Python harness with ctypes and by the C++ runtime): only append fields.
struct AttnBwdParams {
  const void* q;     // [B, Hq, Sq, D]
  const void* k;     // [B, Hkv, Sk, D]
  const void* v;     // [B, Hkv, Sk, D]
  const void* o;     // [B, Hq, Sq, D] forward output
  const void* dout;  // [B, Hq, Sq, D] gradient of o
  void* dq;          // [B, Hq, Sq, D]  outputs, same dtype as q
  void* dk;          // [B, Hkv, Sk, D]
  void* dv;          // [B, Hkv, Sk, D]
  const float* lse;  // [B, Hq, Sq] forward log-sum-exp (natural log)
  float* dq_accum;   // workspace [B, Hq, Sq_pad, D] float32 (atomic mode), else null
  float* delta;      // workspace [B, Hq, Sq_pad] float32
  float* lse_log2;   // workspace [B, Hq, Sq_pad] float32; [2, B, Hq, Sq_pad] with a mask (huge_rows_offset)
  // element strides of dims 0..2; the last dim of every tensor is contiguous
  i64 q_batch_stride, q_head_stride, q_row_stride;
  i64 k_batch_stride, k_head_stride, k_row_stride;
  i64 v_batch_stride, v_head_stride, v_row_stride;
  i64 o_batch_stride, o_head_stride, o_row_stride;
  i64 do_batch_stride, do_head_stride, do_row_stride;
  i64 dq_batch_stride, dq_head_stride, dq_row_stride;
  i64 dk_batch_stride, dk_head_stride, dk_row_stride;
  i64 dv_batch_stride, dv_head_stride, dv_row_stride;
  i64 lse_batch_stride, lse_head_stride;
  int batch, heads_q, heads_kv, q_per_kv;  // q_per_kv = heads_q / heads_kv
  int seqlen_q, seqlen_k;
  int seqlen_q_pad;  // rows per (b, h) of the workspaces: round_up(seqlen_q, 128)
  // Columns of O, dO, dQ, dK and dV (a multiple of 8 up to HEAD_DIM; 0: all
  // HEAD_DIM). The Hopper backward runs D = 96 as 128: its tensor maps
  // zero-fill q, k, v and dO past column 96, preprocess reads and the dQ
  // convert and dK/dV epilogue write only these; dq_accum rows stay HEAD_DIM.
  int d_cols;
  float softmax_scale;  // > 0
  float scale_log2;     // softmax_scale * log2(e)
  // attn_mask as in the forward (AttnFwdParams::mask; the Mask template
  // argument of the dK/dV and dQ kernels): element strides over [B, Hq, Sq, Sk].
  const void* mask;
  i64 mask_batch_stride, mask_head_stride, mask_row_stride, mask_col_stride;
};
static_assert(sizeof(AttnBwdParams) == 384, "AttnBwdParams layout is a launch ABI");

constexpr int kBwdRowPad = 128;  // workspace rows per (b, h) are a multiple of this
constexpr float kLog2e = 1.4426950408889634f;

// What P = 2^(a * S2 - L2) needs of a row (S2: the scaled, masked score in
// log2 units), from the forward's LSE: a = 1 and L2 = LSE * log2(e) for
// every row but huge ones; +inf for a row that saw no key (P = 0). A huge
// row (its max was +-FLT_MAX: only huge mask values, attention_ptx.cu,
// mask_to_log2) stores a marker instead of its LSE; its live scores are
// exactly m = +-FLT_MAX, so P = 2^(S2 - m - log2(l)) with S2 - m computed
// after scaling both by 2^-119 (exact; m becomes +-512) so that log2(l)
// keeps its precision: a = 2^-119, L2 = m * 2^-119 + log2(l). Other
// scores of such a row (only in a +FLT_MAX one, all far below) still give
// P = 2^(<= -500) = 0.
constexpr float kHugeRowScale = 1.5046327690525280e-36f;  // 2^-119
__device__ __forceinline__ void attn_bwd_row_terms(float lse, float& l2, float& a) {
  a = 1.f;
  if (lse == neg_inf()) {
    l2 = pos_inf();
  } else if (lse > 0.5f * kHugeRowLse || lse < -0.5f * kHugeRowLse) {
    const float log2_sum = ((lse < 0.f ? -lse : lse) * (1.f / kHugeRowLse) - 1.f) * 64.f;
    a = kHugeRowScale;
    l2 = (lse < 0.f ? -kFltMax : kFltMax) * kHugeRowScale + log2_sum;
  } else {
    l2 = lse * kLog2e;
  }
}

// With a mask, the workspace lse_log2 holds two arrays of [B, Hq, Sq_pad]:
// L2, then the rows' a (attn_bwd_row_terms).
__device__ __forceinline__ i64 huge_rows_offset(const AttnBwdParams& p) {
  return (i64)p.batch * p.heads_q * p.seqlen_q_pad;
}

__device__ __forceinline__ const char* elem_ptr(const void* base, i64 b, i64 bs, i64 h, i64 hs, i64 r, i64 rs) {
  return (const char*)base + 2 * (b * bs + h * hs + r * rs);
}

// Two products of one warp's 16 rows at once, from scratch: x = X Bx^T and
// y = Y By^T over HEAD_DIM (S and dP in both kernels: K Q^T and V dO^T for
// dK dV, Q K^T and dO V^T for dQ). a_* address this lane's ldmatrix rows of
// X and Y, b_* its rows of Bx and By (NT * 8 of them, SB bytes apart by 16).
// Interleaving the two keeps each A fragment in registers across all of
// the columns.
template <typename Ops, int HEAD_DIM, int NT, int SB>
__device__ __forceinline__ void mma_pair_from_zero(float (&x)[NT][4], float (&y)[NT][4], u32 a_x, u32 a_y, u32 b_x,
                                                   u32 b_y) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) x[nt][e] = y[nt][e] = 0.f;
#pragma unroll
  for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
    u32 ax[4], ay[4];
    ldmatrix_x4(ax, a_x + ks * 32);
    ldmatrix_x4(ay, a_y + ks * 32);
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      u32 bx[4], by[4];
      ldmatrix_x4(bx, b_x + np * 16 * SB + ks * 32);
      Ops::mma(x[2 * np], ax, bx[0], bx[1]);
      Ops::mma(x[2 * np + 1], ax, bx[2], bx[3]);
      ldmatrix_x4(by, b_y + np * 16 * SB + ks * 32);
      Ops::mma(y[2 * np], ay, by[0], by[1]);
      Ops::mma(y[2 * np + 1], ay, by[2], by[3]);
    }
  }
}

// ---------------------------------------------------------------------------
// 1. Preprocess: Delta, LSE in log2 units, zeroed dQ accumulator
// ---------------------------------------------------------------------------

// Grid (Sq_pad / 64, Hq, B), 256 threads: each warp owns 8 rows.
template <typename Elem, int HEAD_DIM>
__global__ void __launch_bounds__(256) attention_bwd_preprocess(const AttnBwdParams p) {
  static_assert(HEAD_DIM == 64 || HEAD_DIM == 96 || HEAD_DIM == 128 || HEAD_DIM == 256,
                "HEAD_DIM must be 64, 96, 128 or 256");
  using Ops = ElemOps<Elem>;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int h = blockIdx.y, b = blockIdx.z;
  const i64 ws_row0 = ((i64)b * p.heads_q + h) * p.seqlen_q_pad;
#pragma unroll 1
  for (int r = 0; r < 8; ++r) {
    const int i = blockIdx.x * 64 + warp * 8 + r;
    float delta = 0.f, l2 = pos_inf(), a = 1.f;
    if (i < p.seqlen_q) {
      const char* orow = elem_ptr(p.o, b, p.o_batch_stride, h, p.o_head_stride, i, p.o_row_stride);
      const char* grow = elem_ptr(p.dout, b, p.do_batch_stride, h, p.do_head_stride, i, p.do_row_stride);
      float s = 0.f;
      const int pairs = (p.d_cols > 0 ? p.d_cols : HEAD_DIM) / 2;
#pragma unroll
      for (int c = lane; c < pairs; c += 32) {
        float o0, o1, g0, g1;
        Ops::unpack(ld_global_u32(orow + 4 * c), o0, o1);
        Ops::unpack(ld_global_u32(grow + 4 * c), g0, g1);
        s += o0 * g0 + o1 * g1;
      }
#pragma unroll
      for (int m = 16; m >= 1; m >>= 1) s += shfl_xor(s, m);
      delta = s;
      const float lse = ld_global_f32(p.lse + b * p.lse_batch_stride + h * p.lse_head_stride + i);
      attn_bwd_row_terms(lse, l2, a);
    }
    if (lane == 0) {
      st_global_f32(p.delta + ws_row0 + i, delta);
      st_global_f32(p.lse_log2 + ws_row0 + i, l2);
      if (p.mask) st_global_f32(p.lse_log2 + huge_rows_offset(p) + ws_row0 + i, a);
    }
    if (p.dq_accum) {
      float* row = p.dq_accum + (ws_row0 + i) * HEAD_DIM;
#pragma unroll
      for (int c = 2 * lane; c < HEAD_DIM; c += 64) st_global_f32x2(row + c, 0.f, 0.f);
    }
  }
}

// ---------------------------------------------------------------------------
// 2. dK, dV (and atomic dQ): one CTA per key block
// ---------------------------------------------------------------------------

template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, bool MASKED = false>
struct BwdKVTile {
  static constexpr int kThreads = NUM_WARPS * 32;
  static constexpr int kKeyGroups = BLOCK_N / 16;           // 16-key row groups of S^T
  static constexpr int kWarpsD = NUM_WARPS / kKeyGroups;    // warps per key group (split D of dK/dV)
  static constexpr int kQCols = BLOCK_M / kWarpsD;          // query columns of S^T per warp
  static constexpr int kDCols = HEAD_DIM / kWarpsD;         // dK/dV columns per warp
  static constexpr int kDqWarpsD = NUM_WARPS / (BLOCK_M / 16);  // warps per m16 tile of dQ
  static constexpr int kDqCols = HEAD_DIM / kDqWarpsD;      // dQ columns per warp
  static constexpr int kChunks = HEAD_DIM / 8;              // 16-byte chunks per row
  static constexpr int kStrideBytes = (HEAD_DIM + 8) * 2;   // odd number of 16-byte chunks
  static constexpr int kPStrideBytes = (BLOCK_M + 8) * 2;   // rows of P^T / dS^T in smem
  static constexpr int kKVBytes = BLOCK_N * kStrideBytes;   // one of K, V
  static constexpr int kQBytes = BLOCK_M * kStrideBytes;    // one of Q, dO (per stage)
  static constexpr int kStatBytes = BLOCK_M * 4;            // one of LSE2, Delta, (masked) A (per stage)
  static constexpr int kStatArrays = MASKED ? 3 : 2;
  static constexpr int kStageBytes = 2 * kQBytes + kStatArrays * kStatBytes;
  static constexpr int kStages = 2;
  static constexpr int kPBytes = BLOCK_N * kPStrideBytes;   // one of dS^T, P^T
  // smem: K | V | stages of (Q, dO, LSE2, Delta, A when masked) | dS^T | P^T (only when warps split D)
  static constexpr int kSmemBytes = 2 * kKVBytes + kStages * kStageBytes + (kWarpsD > 1 ? 2 : 1) * kPBytes;

  static_assert(HEAD_DIM == 64 || HEAD_DIM == 96 || HEAD_DIM == 128 || HEAD_DIM == 256,
                "HEAD_DIM must be 64, 96, 128 or 256");
  static_assert(BLOCK_N % 16 == 0 && NUM_WARPS % kKeyGroups == 0 && kWarpsD >= 1,
                "BLOCK_N / 16 key groups must divide the warps");
  static_assert(kQCols % 16 == 0 && kDCols % 16 == 0, "per-warp query and D columns must be multiples of 16");
  static_assert(BLOCK_M % 16 == 0 && NUM_WARPS % (BLOCK_M / 16) == 0 && kDqCols % 16 == 0,
                "dQ: BLOCK_M / 16 m-tiles must divide the warps, D columns per warp a multiple of 16");
  static_assert(BLOCK_M % 4 == 0 && kBwdRowPad % BLOCK_M == 0, "BLOCK_M must divide the workspace row padding");
  static_assert(kSmemBytes <= 227 * 1024, "tile does not fit in shared memory");
  static_assert((kStrideBytes / 16) % 2 == 1 && (kPStrideBytes / 16) % 2 == 1,
                "smem row strides must be odd numbers of 16-byte chunks (conflict-free ldmatrix)");
};

// The query blocks of BLOCK_M rows that see a key of the key block at n0
// (BLOCK_N keys), for the dK/dV kernels of both backwards: [first,
// n_mblocks); those below `unmasked` need the mask (the causal diagonal
// crosses them, or the key block is ragged: keys past Sk, which every
// iteration masks). diag = Sk - Sq: query i sees key j iff j <= i + diag.
struct QueryBlocks {
  int n_mblocks, first, unmasked;
};
template <bool IS_CAUSAL, int BLOCK_M, int BLOCK_N>
__device__ __forceinline__ QueryBlocks query_blocks(int n0, int Sq, int Sk, int diag) {
  const int n_mblocks = (Sq + BLOCK_M - 1) / BLOCK_M;
  const bool ragged = n0 + BLOCK_N > Sk;
  int m_first = 0, m_unmasked = ragged ? n_mblocks : 0;
  if (IS_CAUSAL) {
    const int first_q = n0 - diag > 0 ? n0 - diag : 0;
    m_first = first_q / BLOCK_M;
    const int last_key = (n0 + BLOCK_N < Sk ? n0 + BLOCK_N : Sk) - 1;
    const int need = last_key - diag;  // block m is fully visible iff m * BLOCK_M >= need
    m_unmasked = need <= 0 ? 0 : (need + BLOCK_M - 1) / BLOCK_M;
    if (ragged || m_unmasked > n_mblocks) m_unmasked = n_mblocks;
    if (m_unmasked < m_first) m_unmasked = m_first;
  }
  return {n_mblocks, m_first, m_unmasked};
}

// A thread's part of the cp.async tile loads of both kernels (as the
// forward): chunk `ch` (16 bytes; kChunks per row, the lanes up to the next
// power of two, past kChunks `lane` is false and they copy nothing) of rows
// `row` + i * rows_per_pass(), at byte `soff` of the first row in shared
// memory. Its constants are functions: static data members would each add a
// .global to the PTX.
template <int kThreads, int kChunks, int kSB, int BLOCK_M, int BLOCK_N>
struct BwdLoadLane {
  __host__ __device__ static constexpr int chunks_p2() { return kChunks <= 8 ? 8 : kChunks <= 16 ? 16 : 32; }
  __host__ __device__ static constexpr int rows_per_pass() { return kThreads / chunks_p2(); }
  static_assert(kThreads % chunks_p2() == 0 && BLOCK_M % rows_per_pass() == 0 && BLOCK_N % rows_per_pass() == 0,
                "tile rows must split evenly into passes");
  int row, ch;
  bool lane;
  u32 soff;
  __device__ __forceinline__ explicit BwdLoadLane(int tid)
      : row(tid / chunks_p2()), ch(tid % chunks_p2()), lane(ch < kChunks), soff((u32)(row * kSB + ch * 16)) {}
};

template <typename Elem, int HEAD_DIM, bool IS_CAUSAL, int BLOCK_M, int BLOCK_N, int NUM_WARPS, int MIN_BLOCKS,
          bool WITH_DQ, typename Mask = MaskNone>
__global__ void __launch_bounds__(NUM_WARPS * 32, MIN_BLOCKS) attention_bwd_dkdv(const AttnBwdParams p) {
  using Tile = BwdKVTile<HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, Mask::kMode != 0>;
  using Ops = ElemOps<Elem>;
  constexpr int kThreads = Tile::kThreads;
  constexpr int kWD = Tile::kWarpsD;
  constexpr int kQC = Tile::kQCols;
  constexpr int kDC = Tile::kDCols;
  constexpr int kSB = Tile::kStrideBytes;
  constexpr int kPSB = Tile::kPStrideBytes;
  constexpr int kChunks = Tile::kChunks;

  extern __shared__ __align__(128) unsigned char smem[];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int n_block = blockIdx.x, head_kv = blockIdx.y, batch = blockIdx.z;
  const int Sq = p.seqlen_q, Sk = p.seqlen_k;
  const int diag = Sk - Sq;  // query i sees key j iff j <= i + diag
  const int n0 = n_block * BLOCK_N;
  const int G = p.q_per_kv;
  const int h_first = head_kv * G;

  const QueryBlocks qb = query_blocks<IS_CAUSAL, BLOCK_M, BLOCK_N>(n0, Sq, Sk, diag);
  const int n_mblocks = qb.n_mblocks, m_first = qb.first, m_unmasked = qb.unmasked;

  const u32 sK = smem_u32(smem);
  const u32 sV = sK + Tile::kKVBytes;
  const u32 sStage0 = sV + Tile::kKVBytes;  // stage s: Q, dO, LSE2, Delta at sStage0 + s * kStageBytes
  const u32 sDS = sStage0 + Tile::kStages * Tile::kStageBytes;
  const u32 sP = sDS + Tile::kPBytes;  // only when kWD > 1

  // ---- async tile loads (as the forward: per-thread chunk, rows by passes)
  using Ld = BwdLoadLane<kThreads, kChunks, kSB, BLOCK_M, BLOCK_N>;
  const Ld ld(tid);

  auto load_kv = [&]() {
    const char* k_thr = (const char*)p.k + 2 * (batch * p.k_batch_stride + head_kv * p.k_head_stride + ld.ch * 8);
    const char* v_thr = (const char*)p.v + 2 * (batch * p.v_batch_stride + head_kv * p.v_head_stride + ld.ch * 8);
    cp_async_row_pair<BLOCK_N, Ld::rows_per_pass(), kSB>(sK + ld.soff, sV + ld.soff, k_thr, p.k_row_stride, v_thr,
                                                        p.v_row_stride, n0 + ld.row, Sk, ld.lane);
  };
  auto load_q = [&](int h, int m_block, int stage) {
    const u32 sQ = sStage0 + stage * Tile::kStageBytes;
    const u32 sdO = sQ + Tile::kQBytes;
    const u32 sL = sdO + Tile::kQBytes;
    const u32 sD = sL + Tile::kStatBytes;
    const u32 sA = sD + Tile::kStatBytes;  // masked only
    const int b = opaque32(batch);
    const char* q_thr = (const char*)p.q + 2 * (b * p.q_batch_stride + h * p.q_head_stride + ld.ch * 8);
    const char* g_thr = (const char*)p.dout + 2 * (b * p.do_batch_stride + h * p.do_head_stride + ld.ch * 8);
    const int m0 = m_block * BLOCK_M;
    cp_async_row_pair<BLOCK_M, Ld::rows_per_pass(), kSB>(sQ + ld.soff, sdO + ld.soff, q_thr, p.q_row_stride, g_thr,
                                                        p.do_row_stride, m0 + ld.row, Sq, ld.lane);
    // LSE2 and Delta: BLOCK_M floats each from the padded workspaces (no bounds).
    const i64 ws = ((i64)b * p.heads_q + h) * p.seqlen_q_pad + m0;
    if (tid < BLOCK_M / 4) {
      cp_async_16(sL + tid * 16, p.lse_log2 + ws + tid * 4, true);
      cp_async_16(sD + tid * 16, p.delta + ws + tid * 4, true);
      if constexpr (Mask::kMode != 0) cp_async_16(sA + tid * 16, p.lse_log2 + huge_rows_offset(p) + ws + tid * 4, true);
    }
  };

  // ---- per-warp roles
  const int kg = warp / kWD;  // key group: keys kg*16 .. +16 of the block
  const int wd = warp % kWD;  // which kQC query columns of S^T, which kDC columns of dK/dV
  const int row_a = frag_row_a(lane), col_a = frag_col_a(lane);
  const int row_b = frag_row_b(lane), col_b = frag_col_b(lane);
  // A operand of S^T / dP^T: rows of K / V (this warp's key group).
  const u32 kv_a_lane = (u32)((kg * 16 + row_a) * kSB + col_a * 2);
  // B operand (non-trans) of S^T / dP^T: rows of Q / dO (this warp's queries).
  const u32 qd_b_lane = (u32)((wd * kQC + row_b) * kSB + col_b * 2);
  // B operand (trans) of dV / dK: [queries][D] tiles, this warp's D columns.
  const u32 qd_bt_lane = (u32)(row_a * kSB + (wd * kDC + col_a) * 2);
  // dQ: m-tile and D columns of this warp.
  constexpr int kDqWD = Tile::kDqWarpsD;
  constexpr int kDqC = Tile::kDqCols;
  const int dq_mt = warp / kDqWD;
  const int dq_c0 = (warp % kDqWD) * kDqC;
  const u32 ds_at_lane = (u32)(row_b * kPSB + (dq_mt * 16 + col_b) * 2);  // A of dQ: dS^T via .trans
  const u32 k_bt_lane = (u32)(row_a * kSB + (dq_c0 + col_a) * 2);          // B of dQ: K via .trans

  float acc_dv[kDC / 8][4];
  float acc_dk[kDC / 8][4];
#pragma unroll
  for (int dt = 0; dt < kDC / 8; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dv[dt][e] = acc_dk[dt][e] = 0.f;

  const float scale_log2 = p.scale_log2;
  constexpr int kMaskMode = Mask::kMode;
  using MT = typename MaskElemOf<Mask>::type;
  // This thread's two keys (key_l and key_l + 8 of the block, clamped into
  // [0, Sk): keys past Sk are masked anyway) and, for key padding, their
  // mask values, loaded once for the whole CTA.
  const int key_t = n0 + kg * 16 + (lane >> 2);
  const int mkey[2] = {key_t < Sk ? key_t : Sk - 1, key_t + 8 < Sk ? key_t + 8 : Sk - 1};
  float kp_add[2] = {0.f, 0.f};
  if constexpr (kMaskMode == 2) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
      kp_add[hh] = MaskLoad<MT>::l2((const float*)p.mask + batch * p.mask_batch_stride + mkey[hh]);
  }

  // ---- one query block of one head
  auto iteration = [&](const int h, const int m_block, const int stage, const bool masked, const int next_h,
                       const int next_m) {
    cp_async_wait<0>();
    // This stage's tiles are visible to all warps, and every warp is done
    // with the other stage and with the dS^T / P^T tiles of the last iteration.
    __syncthreads();
    if (next_m >= 0) load_q(next_h, next_m, stage ^ 1);
    cp_async_commit();

    const u32 sQ = sStage0 + stage * Tile::kStageBytes;
    const u32 sdO = sQ + Tile::kQBytes;
    const u32 sL = sdO + Tile::kQBytes;
    const u32 sDl = sL + Tile::kStatBytes;
    const u32 sA = sDl + Tile::kStatBytes;  // masked only
    const int m0 = m_block * BLOCK_M;

    // S^T = K Q^T and dP^T = V dO^T for 16 keys x kQC queries
    float acc_s[kQC / 8][4], acc_dp[kQC / 8][4];
    mma_pair_from_zero<Ops, HEAD_DIM, kQC / 8, kSB>(acc_s, acc_dp, sK + kv_a_lane, sV + kv_a_lane, sQ + qd_b_lane,
                                                   sdO + qd_b_lane);

    // P^T = exp2(S^T * scale * log2 e - LSE2) (0 past the diagonal), dS^T = P^T (dP^T - Delta)
    const int key_l = kg * 16 + (lane >> 2);  // local key of e = 0, 1; +8 for e = 2, 3
#pragma unroll
    for (int nt = 0; nt < kQC / 8; ++nt) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int q_l = wd * kQC + nt * 8 + 2 * (lane & 3) + c;  // local query
        const float l2 = ld_shared_f32(sL + q_l * 4);
        const float dl = ld_shared_f32(sDl + q_l * 4);
        float a = 1.f;  // the row's scale of S (huge rows: attn_bwd_row_terms)
        if constexpr (kMaskMode != 0) a = ld_shared_f32(sA + q_l * 4);
        const char* mrow = nullptr;
        if constexpr (kMaskMode == 1) {
          const int qr = m0 + q_l < Sq ? m0 + q_l : Sq - 1;  // rows past Sq have P = 0 (LSE2 = +inf)
          mrow = (const char*)p.mask + (i64)sizeof(MT) * (batch * p.mask_batch_stride + h * p.mask_head_stride +
                                                           qr * p.mask_row_stride);
        }
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int e = 2 * hh + c;
          float sv = acc_s[nt][e] * scale_log2;
          if constexpr (kMaskMode == 1) sv += MaskLoad<MT>::l2(mrow + sizeof(MT) * mkey[hh]);
          if constexpr (kMaskMode == 2) sv += kp_add[hh];
          float pv = kMaskMode != 0 ? ex2(fmaf_rn(sv, a, -l2)) : ex2(sv - l2);
          if (masked) {
            const int key = n0 + key_l + 8 * hh;
            if ((IS_CAUSAL && key > m0 + q_l + diag) || key >= Sk) pv = 0.f;
          }
          acc_s[nt][e] = pv;
          acc_dp[nt][e] = pv * (acc_dp[nt][e] - dl);
        }
      }
    }

    // dS^T (and P^T when warps split D) to shared memory, rounded to the element type.
    auto store_t = [&](const u32 base, const float (&acc)[kQC / 8][4]) {
#pragma unroll
      for (int nt = 0; nt < kQC / 8; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
          st_shared_u32(base + (key_l + 8 * hh) * kPSB + (wd * kQC + nt * 8 + 2 * (lane & 3)) * 2,
                        Ops::pack(acc[nt][2 * hh], acc[nt][2 * hh + 1]));
    };
    if (WITH_DQ || kWD > 1) store_t(sDS, acc_dp);
    if (kWD > 1) {
      store_t(sP, acc_s);
      __syncthreads();  // the key group's other warps wrote the rest of the rows
    }

    // dV += P^T dO and dK += dS^T Q over this warp's kDC columns
#pragma unroll
    for (int ks = 0; ks < BLOCK_M / 16; ++ks) {
      u32 ap[4], ad[4];
      if constexpr (kWD == 1) {
        // P^T and dS^T straight from the accumulators (their layout is the A layout).
        ap[0] = Ops::pack(acc_s[2 * ks][0], acc_s[2 * ks][1]);
        ap[1] = Ops::pack(acc_s[2 * ks][2], acc_s[2 * ks][3]);
        ap[2] = Ops::pack(acc_s[2 * ks + 1][0], acc_s[2 * ks + 1][1]);
        ap[3] = Ops::pack(acc_s[2 * ks + 1][2], acc_s[2 * ks + 1][3]);
        ad[0] = Ops::pack(acc_dp[2 * ks][0], acc_dp[2 * ks][1]);
        ad[1] = Ops::pack(acc_dp[2 * ks][2], acc_dp[2 * ks][3]);
        ad[2] = Ops::pack(acc_dp[2 * ks + 1][0], acc_dp[2 * ks + 1][1]);
        ad[3] = Ops::pack(acc_dp[2 * ks + 1][2], acc_dp[2 * ks + 1][3]);
      } else {
        ldmatrix_x4(ap, sP + (kg * 16 + row_a) * kPSB + (ks * 16 + col_a) * 2);
        ldmatrix_x4(ad, sDS + (kg * 16 + row_a) * kPSB + (ks * 16 + col_a) * 2);
      }
#pragma unroll
      for (int dp = 0; dp < kDC / 16; ++dp) {
        u32 bg[4], bq[4];
        ldmatrix_x4_trans(bg, sdO + qd_bt_lane + ks * 16 * kSB + dp * 32);
        Ops::mma(acc_dv[2 * dp], ap, bg[0], bg[1]);
        Ops::mma(acc_dv[2 * dp + 1], ap, bg[2], bg[3]);
        ldmatrix_x4_trans(bq, sQ + qd_bt_lane + ks * 16 * kSB + dp * 32);
        Ops::mma(acc_dk[2 * dp], ad, bq[0], bq[1]);
        Ops::mma(acc_dk[2 * dp + 1], ad, bq[2], bq[3]);
      }
    }

    if constexpr (WITH_DQ) {
      if constexpr (kWD == 1) __syncthreads();  // all of dS^T is in shared memory
      // dQ[m-tile dq_mt, columns dq_c0..] += dS K, added to the float32 accumulator.
      float acc_dq[kDqC / 8][4];
#pragma unroll
      for (int nt = 0; nt < kDqC / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dq[nt][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
        u32 a[4];
        ldmatrix_x4_trans(a, sDS + ds_at_lane + kk * 16 * kPSB);
#pragma unroll
        for (int dp = 0; dp < kDqC / 16; ++dp) {
          u32 bk[4];
          ldmatrix_x4_trans(bk, sK + k_bt_lane + kk * 16 * kSB + dp * 32);
          Ops::mma(acc_dq[2 * dp], a, bk[0], bk[1]);
          Ops::mma(acc_dq[2 * dp + 1], a, bk[2], bk[3]);
        }
      }
      // Rows past Sq land in the workspace's padding (zero there anyway: P = 0).
      float* dst = p.dq_accum + (((i64)batch * p.heads_q + h) * p.seqlen_q_pad + m0 + dq_mt * 16 + (lane >> 2)) *
                                    HEAD_DIM + dq_c0 + 2 * (lane & 3);
#pragma unroll
      for (int nt = 0; nt < kDqC / 8; ++nt) {
        red_add_f32x2(dst + nt * 8, acc_dq[nt][0], acc_dq[nt][1]);
        red_add_f32x2(dst + 8 * HEAD_DIM + nt * 8, acc_dq[nt][2], acc_dq[nt][3]);
      }
    }
  };

  // ---- prologue and main loop: heads of the group, query blocks ascending
  // (masked blocks first), each iteration prefetching the next one's tiles.
  load_kv();
  if (m_first < n_mblocks) load_q(h_first, m_first, 0);
  cp_async_commit();
  int stage = 0;
  for (int g = 0; g < G; ++g) {
    const int h = h_first + g;
    auto next = [&](int m, int& nh, int& nm) {
      if (m + 1 < n_mblocks) {
        nh = h, nm = m + 1;
      } else if (g + 1 < G) {
        nh = h + 1, nm = m_first;
      } else {
        nh = h, nm = -1;
      }
    };
    int m = m_first;
    for (; m < m_unmasked; ++m, stage ^= 1) {
      int nh, nm;
      next(m, nh, nm);
      iteration(h, m, stage, true, nh, nm);
    }
    for (; m < n_mblocks; ++m, stage ^= 1) {
      int nh, nm;
      next(m, nh, nm);
      iteration(h, m, stage, false, nh, nm);
    }
  }
  cp_async_wait<0>();  // no copy may be in flight when the CTA exits

  // ---- epilogue: dV and dK (times the softmax scale) in the element type
  const float scale = p.softmax_scale;
  char* dv_base = (char*)p.dv + 2 * (batch * p.dv_batch_stride + head_kv * p.dv_head_stride);
  char* dk_base = (char*)p.dk + 2 * (batch * p.dk_batch_stride + head_kv * p.dk_head_stride);
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int key = n0 + kg * 16 + (lane >> 2) + 8 * hh;
    if (key >= Sk) continue;
    char* dv_row = dv_base + 2 * (key * p.dv_row_stride + wd * kDC + 2 * (lane & 3));
    char* dk_row = dk_base + 2 * (key * p.dk_row_stride + wd * kDC + 2 * (lane & 3));
#pragma unroll
    for (int dt = 0; dt < kDC / 8; ++dt) {
      st_global_u32(dv_row + dt * 16, Ops::pack(acc_dv[dt][2 * hh], acc_dv[dt][2 * hh + 1]));
      st_global_u32(dk_row + dt * 16, Ops::pack(acc_dk[dt][2 * hh] * scale, acc_dk[dt][2 * hh + 1] * scale));
    }
  }
}

// ---------------------------------------------------------------------------
// 3a. Atomic mode: dQ = scale * accumulator in the element type
// ---------------------------------------------------------------------------

// Grid (ceil(Sq / 64), Hq, B), 256 threads: each warp owns 8 rows.
template <typename Elem, int HEAD_DIM>
__global__ void __launch_bounds__(256) attention_bwd_dq_convert(const AttnBwdParams p) {
  using Ops = ElemOps<Elem>;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int h = blockIdx.y, b = blockIdx.z;
  const i64 ws_row0 = ((i64)b * p.heads_q + h) * p.seqlen_q_pad;
  const float scale = p.softmax_scale;
#pragma unroll 1
  for (int r = 0; r < 8; ++r) {
    const int i = blockIdx.x * 64 + warp * 8 + r;
    if (i >= p.seqlen_q) break;
    const float* src = p.dq_accum + (ws_row0 + i) * HEAD_DIM;
    char* dst = (char*)elem_ptr(p.dq, b, p.dq_batch_stride, h, p.dq_head_stride, i, p.dq_row_stride);
    const int cols = p.d_cols > 0 ? p.d_cols : HEAD_DIM;
#pragma unroll
    for (int c = 2 * lane; c < cols; c += 64) {
      float x, y;
      ld_global_f32x2(src + c, x, y);
      st_global_u32(dst + 2 * c, Ops::pack(x * scale, y * scale));
    }
  }
}

// ---------------------------------------------------------------------------
// 3b. Deterministic mode: dQ by query blocks, no atomics
// ---------------------------------------------------------------------------

template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS>
struct BwdQTile {
  static constexpr int kThreads = NUM_WARPS * 32;
  static constexpr int kChunks = HEAD_DIM / 8;
  static constexpr int kStrideBytes = (HEAD_DIM + 8) * 2;
  static constexpr int kQBytes = BLOCK_M * kStrideBytes;   // one of Q, dO
  static constexpr int kKVBytes = BLOCK_N * kStrideBytes;  // one of K, V per stage
  static constexpr int kStages = 2;
  // smem: Q | dO | stages of (K, V)
  static constexpr int kSmemBytes = 2 * kQBytes + kStages * 2 * kKVBytes;
  static_assert(HEAD_DIM == 64 || HEAD_DIM == 96 || HEAD_DIM == 128 || HEAD_DIM == 256,
                "HEAD_DIM must be 64, 96, 128 or 256");
  static_assert(BLOCK_M == 16 * NUM_WARPS, "each warp owns 16 query rows");
  static_assert(BLOCK_N % 16 == 0 && BLOCK_N >= 16 && BLOCK_N <= 128, "BLOCK_N must be a multiple of 16 in [16, 128]");
  static_assert(kSmemBytes <= 227 * 1024, "tile does not fit in shared memory");
  static_assert((kStrideBytes / 16) % 2 == 1, "row stride must be an odd number of 16-byte chunks");
};

template <typename Elem, int HEAD_DIM, bool IS_CAUSAL, int BLOCK_M, int BLOCK_N, int NUM_WARPS, int MIN_BLOCKS,
          typename Mask = MaskNone>
__global__ void __launch_bounds__(NUM_WARPS * 32, MIN_BLOCKS) attention_bwd_dq(const AttnBwdParams p) {
  using Tile = BwdQTile<HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS>;
  using Ops = ElemOps<Elem>;
  constexpr int kThreads = Tile::kThreads;
  constexpr int kSB = Tile::kStrideBytes;
  constexpr int kChunks = Tile::kChunks;
  constexpr int kNT = BLOCK_N / 8;
  constexpr int kDT = HEAD_DIM / 8;

  extern __shared__ __align__(128) unsigned char smem[];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  // Causal: the heaviest query blocks (the last ones) are launched first.
  const int m_block = IS_CAUSAL ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x;
  const int head = blockIdx.y, batch = blockIdx.z;
  const int head_kv = head / p.q_per_kv;
  const int Sq = p.seqlen_q, Sk = p.seqlen_k;
  const int diag = Sk - Sq;
  const int m0 = m_block * BLOCK_M;
  const int m_end = (m0 + BLOCK_M < Sq) ? m0 + BLOCK_M : Sq;
  char* dq_base = (char*)p.dq + 2 * (batch * p.dq_batch_stride + head * p.dq_head_stride);

  int key_end = Sk;
  if (IS_CAUSAL) key_end = (m_end + diag < Sk) ? m_end + diag : Sk;
  if (key_end <= 0) {
    // No row of the block sees a key: dQ = 0.
    for (int c = tid; c < BLOCK_M * kChunks; c += kThreads) {
      const int row = m0 + c / kChunks;
      if (row < Sq) {
        char* d = dq_base + 2 * (row * p.dq_row_stride) + (c % kChunks) * 16;
        asm volatile("st.global.v4.u32 [%0], {%1, %1, %1, %1};" ::"l"(d), "r"(0u) : "memory");
      }
    }
    return;
  }
  const int n_block_max = (key_end + BLOCK_N - 1) / BLOCK_N;
  // Key blocks below n_mask_start are visible to every row of the block and
  // hold no key past Sk.
  int n_mask_start = n_block_max;
  if (IS_CAUSAL) {
    const int full_end = (m0 + diag + 1 < Sk) ? m0 + diag + 1 : Sk;
    n_mask_start = full_end > 0 ? full_end / BLOCK_N : 0;
  }
  if (n_block_max * BLOCK_N > Sk && n_mask_start > n_block_max - 1) n_mask_start = n_block_max - 1;

  const u32 sQ = smem_u32(smem);
  const u32 sdO = sQ + Tile::kQBytes;
  const u32 sKV = sdO + Tile::kQBytes;  // stage s: K at sKV + s * 2 * kKVBytes, V after it

  using Ld = BwdLoadLane<kThreads, kChunks, kSB, BLOCK_M, BLOCK_N>;
  const Ld ld(tid);

  auto load_qdo = [&]() {
    const char* q_thr = (const char*)p.q + 2 * (batch * p.q_batch_stride + head * p.q_head_stride + ld.ch * 8);
    const char* g_thr = (const char*)p.dout + 2 * (batch * p.do_batch_stride + head * p.do_head_stride + ld.ch * 8);
    cp_async_row_pair<BLOCK_M, Ld::rows_per_pass(), kSB>(sQ + ld.soff, sdO + ld.soff, q_thr, p.q_row_stride, g_thr,
                                                        p.do_row_stride, m0 + ld.row, Sq, ld.lane);
  };
  auto load_kv = [&](int n_block, int stage) {
    const u32 sK = sKV + stage * 2 * Tile::kKVBytes + ld.soff;
    const u32 sV = sK + Tile::kKVBytes;
    const int b = opaque32(batch), hk = opaque32(head_kv);
    const char* k_thr = (const char*)p.k + 2 * (b * p.k_batch_stride + hk * p.k_head_stride + ld.ch * 8);
    const char* v_thr = (const char*)p.v + 2 * (b * p.v_batch_stride + hk * p.v_head_stride + ld.ch * 8);
    cp_async_row_pair<BLOCK_N, Ld::rows_per_pass(), kSB>(sK, sV, k_thr, p.k_row_stride, v_thr, p.v_row_stride,
                                                        n_block * BLOCK_N + ld.row, Sk, ld.lane);
  };

  const int row_a = frag_row_a(lane), col_a = frag_col_a(lane);
  const int row_b = frag_row_b(lane), col_b = frag_col_b(lane);
  const int warp_row0 = warp * 16;
  const u32 a_lane = (u32)((warp_row0 + row_a) * kSB + col_a * 2);  // A: Q, dO rows
  const u32 b_lane = (u32)(row_b * kSB + col_b * 2);                // B non-trans: K, V rows
  const u32 bt_lane = (u32)(row_a * kSB + col_a * 2);               // B trans: K as [keys][D]

  // This thread's rows: warp_row0 + lane / 4 + 8 * hh; their LSE2 and Delta.
  float l2[2], dl[2], a[2] = {1.f, 1.f};  // a: the rows' scales of S (huge rows: attn_bwd_row_terms)
  {
    const i64 ws = ((i64)batch * p.heads_q + head) * p.seqlen_q_pad + m0 + warp_row0 + (lane >> 2);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      l2[hh] = ld_global_f32(p.lse_log2 + ws + 8 * hh);
      dl[hh] = ld_global_f32(p.delta + ws + 8 * hh);
      if constexpr (Mask::kMode != 0) a[hh] = ld_global_f32(p.lse_log2 + huge_rows_offset(p) + ws + 8 * hh);
    }
  }

  load_qdo();
  cp_async_commit();
  load_kv(n_block_max - 1, 0);
  cp_async_commit();

  float acc_dq[kDT][4];
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dq[dt][e] = 0.f;
  const float scale_log2 = p.scale_log2;

  auto iteration = [&](const int n_block, const int stage, const bool masked) {
    cp_async_wait<0>();
    __syncthreads();
    if (n_block > 0) load_kv(n_block - 1, stage ^ 1);
    cp_async_commit();
    const u32 sK = sKV + stage * 2 * Tile::kKVBytes;
    const u32 sV = sK + Tile::kKVBytes;

    float acc_s[kNT][4], acc_dp[kNT][4];
    mma_pair_from_zero<Ops, HEAD_DIM, kNT, kSB>(acc_s, acc_dp, sQ + a_lane, sdO + a_lane, sK + b_lane, sV + b_lane);

    const int col0 = n_block * BLOCK_N + 2 * (lane & 3);
    constexpr int kMaskMode = Mask::kMode;
    using MT = typename MaskElemOf<Mask>::type;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int row = m0 + warp_row0 + (lane >> 2) + 8 * hh;
      const char* mrow = nullptr;
      if constexpr (kMaskMode != 0) {
        // Rows past Sq: P = 0 (LSE2 = +inf); keys past Sk (masked blocks only) are not read.
        const int r = row < Sq ? row : Sq - 1;
        mrow = (const char*)p.mask + (i64)sizeof(MT) * (batch * p.mask_batch_stride + head * p.mask_head_stride +
                                                         r * p.mask_row_stride + col0);
      }
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int e = 2 * hh + c;
          float sv = acc_s[nt][e] * scale_log2;
          if constexpr (kMaskMode != 0) {
            const bool in = !masked || col0 + nt * 8 + c < Sk;
            sv += in ? MaskLoad<MT>::l2(mrow + sizeof(MT) * (nt * 8 + c)) : 0.f;
          }
          float pv = kMaskMode != 0 ? ex2(fmaf_rn(sv, a[hh], -l2[hh])) : ex2(sv - l2[hh]);
          if (masked) {
            const int key = col0 + nt * 8 + c;
            if ((IS_CAUSAL && key > row + diag) || key >= Sk) pv = 0.f;
          }
          acc_dp[nt][e] = pv * (acc_dp[nt][e] - dl[hh]);
        }
    }

    // dQ += dS K
#pragma unroll
    for (int ks = 0; ks < BLOCK_N / 16; ++ks) {
      u32 a[4];
      a[0] = Ops::pack(acc_dp[2 * ks][0], acc_dp[2 * ks][1]);
      a[1] = Ops::pack(acc_dp[2 * ks][2], acc_dp[2 * ks][3]);
      a[2] = Ops::pack(acc_dp[2 * ks + 1][0], acc_dp[2 * ks + 1][1]);
      a[3] = Ops::pack(acc_dp[2 * ks + 1][2], acc_dp[2 * ks + 1][3]);
#pragma unroll
      for (int dp = 0; dp < kDT / 2; ++dp) {
        u32 b[4];
        ldmatrix_x4_trans(b, sK + bt_lane + ks * 16 * kSB + dp * 32);
        Ops::mma(acc_dq[2 * dp], a, b[0], b[1]);
        Ops::mma(acc_dq[2 * dp + 1], a, b[2], b[3]);
      }
    }
  };

  int n_block = n_block_max - 1;
  int stage = 0;
  for (; n_block >= n_mask_start; --n_block, stage ^= 1) iteration(n_block, stage, true);
  for (; n_block >= 0; --n_block, stage ^= 1) iteration(n_block, stage, false);
  cp_async_wait<0>();

  const float scale = p.softmax_scale;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int row = m0 + warp_row0 + (lane >> 2) + 8 * hh;
    if (row >= Sq) continue;
    char* d = dq_base + 2 * (row * p.dq_row_stride + 2 * (lane & 3));
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt)
      st_global_u32(d + dt * 16, Ops::pack(acc_dq[dt][2 * hh] * scale, acc_dq[dt][2 * hh + 1] * scale));
  }
}

}  // namespace opfuse_attn
