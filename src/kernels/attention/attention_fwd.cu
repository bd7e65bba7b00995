// opfuse attention forward: a FlashAttention-2 style kernel (mma.sync, sm_80+).
//
// Compiled at run time by NVRTC. It includes NO header: NVRTC on the target
// machines finds no CUDA headers, so every device helper below is inline PTX.
//
//   O[b, h, i, :] = softmax_j(scale * Q[b, h, i, :] . K[b, h / G, j, :]) V[b, h / G, j, :]
//   LSE[b, h, i]  = log sum_j exp(scale * Q[b, h, i, :] . K[b, h / G, j, :])   (natural log, float32)
//
// with G = Hq / Hkv (GQA / MQA) and, when IS_CAUSAL, the mask aligned to the
// bottom-right corner (query i sees key j iff j <= i + Sk - Sq), as PyTorch and
// FlashAttention >= 2.1. Rows that see no key at all give O = 0 and LSE = -inf.
// The CPU reference with the same semantics is attention_reference.{h,cpp}.
//
// Design (docs/attention.md has the numbers):
// - one CTA computes BLOCK_M query rows of one (batch, head); NUM_WARPS warps
//   each own BLOCK_M / NUM_WARPS rows (16 or 32: one or two m16 tiles);
// - K and V tiles of BLOCK_N keys stream through shared memory with cp.async,
//   two stages deep: the tile for the next iteration is in flight while the
//   current one is used; one __syncthreads per iteration;
// - S = Q K^T and O += P V with mma.sync.m16n8k16 (float32 accumulators);
//   P stays in registers: the accumulator layout of S is the A-operand layout
//   of the second product; V is read with ldmatrix.trans;
// - online softmax in float32 on log2(e)-prescaled scores with ex2.approx;
//   a warp rescales O only when one of its row maxima grew;
// - key blocks are visited from the last to the first, so the blocks that
//   need a mask (the ragged end of Sk, the causal diagonal) come first and the
//   rest run unmasked; key blocks that are entirely masked are never visited;
// - shared-memory rows are padded by 16 bytes (an odd number of 16-byte
//   chunks per row) so that ldmatrix and cp.async are free of bank conflicts
//   for every head dim, 96 included.
//
// Entry points: attention_fwd<Elem, HEAD_DIM, IS_CAUSAL, BLOCK_M, BLOCK_N,
// NUM_WARPS, MIN_BLOCKS, SPLIT_PV, Mask>, obtained through NVRTC name
// expressions such as
//   "opfuse_attn::attention_fwd<opfuse_attn::bf16, 128, true, 128, 64, 4, 2, false>"
// (Mask defaults to MaskNone) or, with an attn_mask,
//   "... 4, 2, false, opfuse_attn::MaskFull<opfuse_attn::bool8>>".
// attn_mask (attention_ptx.cu, "attn_mask"): with one, every key block adds
// the mask to the scores (S * scale * log2 e + mask * log2 e, one fma) before
// the causal / ragged-end masking; MaskFull reads each thread's elements of
// the S tile straight from global memory (a quad of lanes reads 8 adjacent
// keys of a row), MaskKeyPad copies the BLOCK_N values of the key block into
// shared memory with the K/V tile (cp.async, one stage ahead). Rows whose
// keys are all masked give O = 0 and LSE = -inf, as causal ones.
// MIN_BLOCKS is __launch_bounds__' CTAs per SM (it caps registers); SPLIT_PV
// orders each iteration softmax(m-tile 0), PV(0), softmax(1), PV(1) so that the
// tensor cores and the ALUs may overlap within a warp (warps owning 32 rows
// only; measured no faster on the H200, so the launchers leave it off).
// Launch: grid (ceil(Sq / BLOCK_M), Hq, B), block NUM_WARPS * 32 threads,
// dynamic shared memory FwdTile<...>::kSmemBytes (over 48 KB: raise
// CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES first), one argument:
// AttnFwdParams by value. Requirements checked by the launcher: pointers
// 16-byte aligned, last dim contiguous, all other strides multiples of 8
// elements, Hq % Hkv == 0, softmax_scale > 0.

namespace opfuse_attn {

// u32, i64, the element tags bf16 / f16, ElemOps, the PTX helpers
// (cp.async, ldmatrix, ex2, shuffles) and the kernel argument AttnFwdParams
// come from attention_ptx.cu, which the launchers prepend.

// ---------------------------------------------------------------------------
// Tile geometry (shared by the kernel and, through the formulas in
// docs/attention.md, the launchers)
// ---------------------------------------------------------------------------

template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS>
struct FwdTile {
  static constexpr int kThreads = NUM_WARPS * 32;
  static constexpr int kRowsPerWarp = BLOCK_M / NUM_WARPS;
  static constexpr int kMTiles = kRowsPerWarp / 16;     // m16 tiles per warp
  static constexpr int kNTiles = BLOCK_N / 8;           // n8 tiles of S per warp row-tile
  static constexpr int kDTiles = HEAD_DIM / 8;          // n8 tiles of O
  static constexpr int kChunksPerRow = HEAD_DIM / 8;    // 16-byte chunks per row
  static constexpr int kStride = HEAD_DIM + 8;          // smem row stride, elements
  static constexpr int kStrideBytes = kStride * 2;
  static constexpr int kQBytes = BLOCK_M * kStrideBytes;
  static constexpr int kKVTileBytes = BLOCK_N * kStrideBytes;
  static constexpr int kStages = 2;
  // smem: Q | K stage 0 | V stage 0 | K stage 1 | V stage 1
  static constexpr int kSmemBytes = kQBytes + kStages * 2 * kKVTileBytes;
  // Q fragments stay in registers for the whole kernel when they are few.
  static constexpr bool kQInRegs = kMTiles == 1 && HEAD_DIM <= 128;

  static_assert(HEAD_DIM == 64 || HEAD_DIM == 96 || HEAD_DIM == 128 || HEAD_DIM == 256,
                "HEAD_DIM must be 64, 96, 128 or 256");
  static_assert(BLOCK_M % NUM_WARPS == 0 && kRowsPerWarp % 16 == 0 && kMTiles >= 1 && kMTiles <= 2,
                "each warp owns 16 or 32 query rows");
  static_assert(BLOCK_N % 16 == 0 && BLOCK_N >= 16 && BLOCK_N <= 128, "BLOCK_N must be a multiple of 16 in [16, 128]");
  static_assert(kSmemBytes <= 227 * 1024, "tile does not fit in shared memory");
  static_assert((kStride / 8) % 2 == 1, "row stride must be an odd number of 16-byte chunks");
};

// ---------------------------------------------------------------------------
// The kernel
// ---------------------------------------------------------------------------

template <typename Elem, int HEAD_DIM, bool IS_CAUSAL, int BLOCK_M, int BLOCK_N, int NUM_WARPS, int MIN_BLOCKS,
          bool SPLIT_PV, typename Mask = MaskNone>
__global__ void __launch_bounds__(NUM_WARPS * 32, MIN_BLOCKS) attention_fwd(const AttnFwdParams p) {
  using Tile = FwdTile<HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS>;
  using Ops = ElemOps<Elem>;
  constexpr int kThreads = Tile::kThreads;
  constexpr int kMT = Tile::kMTiles;
  constexpr int kNT = Tile::kNTiles;
  constexpr int kDT = Tile::kDTiles;
  constexpr int kChunks = Tile::kChunksPerRow;
  constexpr int kSB = Tile::kStrideBytes;
  // With an attn_mask, Q is read from shared memory each key block: the 32
  // registers its fragments would hold pay for the mask step (fewer spills).
  constexpr bool kQInRegs = Tile::kQInRegs && Mask::kMode == 0;

  extern __shared__ __align__(128) unsigned char smem[];

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  // Causal: the heaviest query blocks (the last ones) are launched first.
  const int m_block = IS_CAUSAL ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const int head_kv = head / p.q_per_kv;
  const int Sq = p.seqlen_q;
  const int Sk = p.seqlen_k;

  const char* q_base = (const char*)p.q + 2 * (batch * p.q_batch_stride + head * p.q_head_stride);
  char* o_base = (char*)p.o + 2 * (batch * p.o_batch_stride + head * p.o_head_stride);
  const i64 q_rs = 2 * p.q_row_stride, o_rs = 2 * p.o_row_stride;
  float* lse_base = p.lse ? p.lse + batch * p.lse_batch_stride + head * p.lse_head_stride : nullptr;

  const int m_start = m_block * BLOCK_M;
  const int m_end = (m_start + BLOCK_M < Sq) ? m_start + BLOCK_M : Sq;
  // Keys [0, key_end) are visible to at least one row of this block.
  int key_end = Sk;
  if (IS_CAUSAL) key_end = (m_end + Sk - Sq < Sk) ? m_end + Sk - Sq : Sk;

  if (key_end <= 0) {
    // Every row of the block sees no key: O = 0, LSE = -inf.
    for (int c = tid; c < BLOCK_M * kChunks; c += kThreads) {
      const int row = m_start + c / kChunks;
      if (row < Sq) store_zero16_global(o_base + row * o_rs + (c % kChunks) * 16);
    }
    if (lse_base)
      for (int r = tid; r < BLOCK_M; r += kThreads)
        if (m_start + r < Sq) store_f32_global(lse_base + m_start + r, neg_inf());
    return;
  }
  const int n_block_max = (key_end + BLOCK_N - 1) / BLOCK_N;
  // Keys [0, full_end) are visible to every row of the block: key blocks
  // below n_mask_start need no mask.
  int full_end = Sk;
  if (IS_CAUSAL) full_end = (m_start + Sk - Sq + 1 < Sk) ? m_start + Sk - Sq + 1 : Sk;
  const int n_mask_start = full_end > 0 ? full_end / BLOCK_N : 0;

  const u32 sQ = smem_u32(smem);
  const u32 sKV = sQ + Tile::kQBytes;  // stage s: K at sKV + s * 2 * tile, V right after it
  // MaskKeyPad: the key block's BLOCK_N float32 mask values per stage, after
  // the K/V stages (the launchers add 2 * BLOCK_N * 4 bytes of shared memory).
  constexpr int kMaskMode = Mask::kMode;
  const u32 sKP = sKV + Tile::kStages * 2 * Tile::kKVTileBytes;

  // ---- async tile loads -------------------------------------------------
  // Thread t copies chunk t % kChunksP2 of rows t / kChunksP2 + i * kRowsPerPass
  // (chunks past the row end, for HEAD_DIM 96, are idle lanes). Every address
  // is then a per-thread base plus a row times the stride.
  constexpr int kChunksP2 = kChunks <= 8 ? 8 : kChunks <= 16 ? 16 : 32;
  constexpr int kRowsPerPass = kThreads / kChunksP2;
  static_assert(kThreads % kChunksP2 == 0 && BLOCK_M % kRowsPerPass == 0 && BLOCK_N % kRowsPerPass == 0,
                "tile rows must split evenly into passes");
  const int ld_row = tid / kChunksP2;
  const int ld_ch = tid % kChunksP2;
  const bool ld_lane = ld_ch < kChunks;
  const u32 ld_soff = (u32)(ld_row * kSB + ld_ch * 16);

  auto load_q = [&]() {
    const char* q_thr = q_base + ld_ch * 16;
#pragma unroll
    for (int i = 0; i < BLOCK_M / kRowsPerPass; ++i) {
      const int row = m_start + ld_row + i * kRowsPerPass;
      const bool valid = row < Sq;
      if (ld_lane) cp_async_16(sQ + ld_soff + i * kRowsPerPass * kSB, q_thr + (valid ? row * q_rs : 0), valid);
    }
  };
  auto load_kv = [&](int n_block, int stage, bool pred) {
    const u32 sK = sKV + stage * 2 * Tile::kKVTileBytes + ld_soff;
    const u32 sV = sK + Tile::kKVTileBytes;
    const int row0 = n_block * BLOCK_N + ld_row;
    // Addresses are rebuilt here from the kernel parameters (constant bank)
    // and an opaque copy of the K/V head offset, so that the compiler keeps
    // no 64-bit address live across the main loop (at 255 registers every
    // live register is a spill elsewhere).
    const int b = opaque32(batch), hk = opaque32(head_kv);
    const char* k_thr = (const char*)p.k + 2 * (b * p.k_batch_stride + hk * p.k_head_stride + ld_ch * 8);
    const char* v_thr = (const char*)p.v + 2 * (b * p.v_batch_stride + hk * p.v_head_stride + ld_ch * 8);
    const i64 krs = 2 * p.k_row_stride, vrs = 2 * p.v_row_stride;
#pragma unroll
    for (int i = 0; i < BLOCK_N / kRowsPerPass; ++i) {
      const int row = row0 + i * kRowsPerPass;
      const bool valid = pred && row < Sk;
      const int r = valid ? row : 0;
      if (ld_lane) {
        cp_async_16(sK + i * kRowsPerPass * kSB, k_thr + r * krs, valid);
        cp_async_16(sV + i * kRowsPerPass * kSB, v_thr + r * vrs, valid);
      }
    }
    if constexpr (kMaskMode == 2) {
      // Key-padding values of this block, one 4-byte copy per key (zero past Sk).
      for (int j = tid; j < BLOCK_N; j += kThreads) {
        const int key = n_block * BLOCK_N + j;
        const bool valid = pred && key < Sk;
        const float* src = (const float*)p.mask + b * p.mask_batch_stride + (valid ? key : 0);
        cp_async_4(sKP + stage * BLOCK_N * 4 + j * 4, src, valid);
      }
    }
  };

  // ---- per-lane ldmatrix offsets -------------------------------------------
  // A operand (Q) and B operand via .trans (V): matrices ordered
  // (rows 0-7, cols 0-7), (rows 8-15, cols 0-7), (rows 0-7, cols 8-15), (rows 8-15, cols 8-15).
  const int row_a = (lane & 7) + ((lane >> 3) & 1) * 8;
  const int col_a = (lane >> 4) * 8;
  // B operand (K, non-trans): (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15).
  const int row_b = (lane & 7) + (lane >> 4) * 8;
  const int col_b = ((lane >> 3) & 1) * 8;
  const int warp_row0 = warp * Tile::kRowsPerWarp;
  const u32 q_lane = sQ + (warp_row0 + row_a) * kSB + col_a * 2;
  const u32 k_lane = (u32)(row_b * kSB + col_b * 2);
  const u32 v_lane = (u32)(row_a * kSB + col_a * 2);

  // ---- prologue: Q, then the first K/V tile ---------------------------------
  load_q();
  cp_async_commit();
  load_kv(n_block_max - 1, 0, true);
  cp_async_commit();

  u32 q_frag[kQInRegs ? kMT : 1][kQInRegs ? HEAD_DIM / 16 : 1][4];
  if constexpr (kQInRegs) {
    cp_async_wait<1>();
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int ks = 0; ks < HEAD_DIM / 16; ++ks) ldmatrix_x4(q_frag[mt][ks], q_lane + mt * 16 * kSB + ks * 32);
  }

  // Per-thread rows: for m-tile mt and half h, row warp_row0 + mt * 16 + lane / 4 + 8 * h.
  constexpr float kRescaleThreshold = 0.f;  // log2 units; see softmax below
  float row_max[kMT][2];
  float row_sum[kMT][2];  // this thread's part of the row sum of P (float32)
  float acc_o[kMT][kDT][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_max[mt][h] = neg_inf();
      row_sum[mt][h] = 0.f;
    }
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[mt][dt][e] = 0.f;
  }
  const float scale_log2 = p.scale_log2;
  // The scale the softmax applies: 1 when the attn_mask step has applied it.
  const float sl2 = kMaskMode ? 1.f : scale_log2;

  // ---- one key block ------------------------------------------------------
  // From the prefetch on, the body has no branch: `masked` is a constant at
  // each of the two call sites below (the lambda is inlined), so ptxas
  // schedules the products and the softmax as one basic block.
  auto iteration = [&](const int n_block, const int stage, const bool masked) {
    cp_async_wait<0>();
    // Makes this stage's tile visible to all warps and guarantees that every
    // warp is done with the other stage (read in the previous iteration).
    __syncthreads();
    // Prefetch the next (lower) key block into the other stage. (A branch
    // here costs no scheduling freedom: the barrier above is a boundary.)
    if (n_block > 0) load_kv(n_block - 1, stage ^ 1, true);
    cp_async_commit();

    const u32 sK = sKV + stage * 2 * Tile::kKVTileBytes;
    const u32 sV = sK + Tile::kKVTileBytes;

    // S = Q K^T
    float acc_s[kMT][kNT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_s[mt][nt][e] = 0.f;

#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
      u32 a[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        if constexpr (kQInRegs) {
#pragma unroll
          for (int e = 0; e < 4; ++e) a[mt][e] = q_frag[mt][ks][e];
        } else {
          ldmatrix_x4(a[mt], q_lane + mt * 16 * kSB + ks * 32);
        }
      }
#pragma unroll
      for (int np = 0; np < kNT / 2; ++np) {
        u32 b[4];
        ldmatrix_x4(b, sK + k_lane + np * 16 * kSB + ks * 32);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          Ops::mma(acc_s[mt][2 * np], a[mt], b[0], b[1]);
          Ops::mma(acc_s[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
      }
    }

    // attn_mask: S becomes S * scale * log2(e) + mask * log2(e) (the softmax
    // below then scales by 1). Past Sk (ragged last block, `masked`) nothing
    // is read; those scores become -inf below.
    if constexpr (kMaskMode == 1) {
      using MT = typename Mask::Elem;
      const int b = opaque32(batch), hq = opaque32(head);
      const char* mbase = (const char*)p.mask + (i64)sizeof(MT) * (b * p.mask_batch_stride + hq * p.mask_head_stride);
      const int c0 = n_block * BLOCK_N + 2 * (lane & 3);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = m_start + warp_row0 + mt * 16 + (lane >> 2) + 8 * h;
          const int r = row < Sq ? row : Sq - 1;  // rows past Sq are never stored
          const char* mrow = mbase + (i64)sizeof(MT) * (r * p.mask_row_stride + c0);
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const bool in = !masked || c0 + nt * 8 + e < Sk;
              const float add = in ? MaskLoad<MT>::l2(mrow + sizeof(MT) * (nt * 8 + e)) : 0.f;
              acc_s[mt][nt][2 * h + e] = acc_s[mt][nt][2 * h + e] * scale_log2 + add;
            }
        }
    } else if constexpr (kMaskMode == 2) {
      const u32 kp = sKP + stage * BLOCK_N * 4 + 8 * (lane & 3);
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        float a0, a1;
        ld_shared_f32x2(kp + nt * 32, a0, a1);
        a0 = mask_to_log2(a0);
        a1 = mask_to_log2(a1);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            acc_s[mt][nt][2 * h] = acc_s[mt][nt][2 * h] * scale_log2 + a0;
            acc_s[mt][nt][2 * h + 1] = acc_s[mt][nt][2 * h + 1] * scale_log2 + a1;
          }
      }
    }

    // Mask: the ragged end of Sk and, when causal, keys past the diagonal.
    if (masked) {
      const int col0 = n_block * BLOCK_N + 2 * (lane & 3);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = m_start + warp_row0 + mt * 16 + (lane >> 2) + 8 * h;
          int col_end = Sk;
          if (IS_CAUSAL) col_end = (row + Sk - Sq + 1 < Sk) ? row + Sk - Sq + 1 : Sk;
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e)
              if (col0 + nt * 8 + e >= col_end) acc_s[mt][nt][2 * h + e] = neg_inf();
        }
    }

    // Online softmax (float32, base 2) of m-tile mt; S becomes P in place.
    // row_max is the running max in log2 units (scores * scale * log2 e).
    // The warp rescales O only when some row's max grew (a warp-uniform
    // branch that long rows take ever more rarely). A threshold above 0 (the
    // FlashAttention-4 trick, P up to 2^threshold) was measured 4-6% faster at
    // D = 128 but fails the accuracy rule: the largest P is then rounded
    // instead of being exactly 1 (docs/attention.md).
    auto softmax = [&](const int mt) {
      float m_new[2];
      bool grow = false;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = fmax2(acc_s[mt][0][2 * h], acc_s[mt][0][2 * h + 1]);
#pragma unroll
        for (int nt = 1; nt < kNT; ++nt) mx = fmax2(mx, fmax2(acc_s[mt][nt][2 * h], acc_s[mt][nt][2 * h + 1]));
        mx = fmax2(mx, shfl_xor(mx, 1));
        mx = fmax2(mx, shfl_xor(mx, 2));
        m_new[h] = mx * sl2;  // -inf for a row whose keys are all masked
        grow |= m_new[h] > row_max[mt][h] + kRescaleThreshold;
      }
      if (vote_any(grow)) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float m_ref = fmax2(row_max[mt][h], m_new[h]);
          // -inf == -inf (a row that has seen no key yet) keeps corr = 1.
          const float corr = (m_ref == row_max[mt][h]) ? 1.f : ex2(row_max[mt][h] - m_ref);
          row_max[mt][h] = m_ref;
          row_sum[mt][h] *= corr;
#pragma unroll
          for (int dt = 0; dt < kDT; ++dt) {
            acc_o[mt][dt][2 * h] *= corr;
            acc_o[mt][dt][2 * h + 1] *= corr;
          }
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // A row still at -inf has only masked scores here: exp2(-inf - 0) = 0.
        const float m_ref = (row_max[mt][h] == neg_inf()) ? 0.f : row_max[mt][h];
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float pv = ex2(acc_s[mt][nt][2 * h + e] * sl2 - m_ref);
            acc_s[mt][nt][2 * h + e] = pv;
            sum += pv;
          }
        row_sum[mt][h] += sum;
      }
    };

    // O += P V for the m-tiles [MT0, MT1) (constants after inlining), P
    // converted to the element type straight from the S registers.
    auto gemm_pv = [&](const int MT0, const int MT1) {
#pragma unroll
      for (int ks = 0; ks < BLOCK_N / 16; ++ks) {
        u32 a[kMT][4];
#pragma unroll
        for (int mt = MT0; mt < MT1; ++mt) {
          a[mt][0] = Ops::pack(acc_s[mt][2 * ks][0], acc_s[mt][2 * ks][1]);
          a[mt][1] = Ops::pack(acc_s[mt][2 * ks][2], acc_s[mt][2 * ks][3]);
          a[mt][2] = Ops::pack(acc_s[mt][2 * ks + 1][0], acc_s[mt][2 * ks + 1][1]);
          a[mt][3] = Ops::pack(acc_s[mt][2 * ks + 1][2], acc_s[mt][2 * ks + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < kDT / 2; ++dp) {
          u32 b[4];
          ldmatrix_x4_trans(b, sV + v_lane + ks * 16 * kSB + dp * 32);
#pragma unroll
          for (int mt = MT0; mt < MT1; ++mt) {
            Ops::mma(acc_o[mt][2 * dp], a[mt], b[0], b[1]);
            Ops::mma(acc_o[mt][2 * dp + 1], a[mt], b[2], b[3]);
          }
        }
      }
    };

    if constexpr (SPLIT_PV && kMT == 2) {
      // softmax(1) has no dependence on P V of m-tile 0, so the tensor cores
      // can work on the latter while the ALUs do the former (at the price of
      // reading the V tile from shared memory twice).
      softmax(0);
      gemm_pv(0, 1);
      softmax(1);
      gemm_pv(1, 2);
    } else {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) softmax(mt);
      gemm_pv(0, kMT);
    }
  };

  // ---- main loop over key blocks, last to first -----------------------------
  // Blocks at or above n_mask_start need the mask; they come first.
  int n_block = n_block_max - 1;
  int stage = 0;
  for (; n_block >= n_mask_start; --n_block, stage ^= 1) iteration(n_block, stage, true);
  for (; n_block >= 0; --n_block, stage ^= 1) iteration(n_block, stage, false);
  cp_async_wait<0>();  // no copy may be in flight when the CTA exits

  // ---- epilogue: normalise, stage O through this warp's rows of sQ, store ----
  float inv_sum[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float s = row_sum[mt][h];
      s += shfl_xor(s, 1);
      s += shfl_xor(s, 2);
      inv_sum[mt][h] = (s > 0.f) ? rcp(s) : 0.f;
      const int row = m_start + warp_row0 + mt * 16 + (lane >> 2) + 8 * h;
      if (lse_base && (lane & 3) == 0 && row < Sq) {
        float lse = (s > 0.f) ? (row_max[mt][h] + lg2(s)) * 0.69314718055994531f : neg_inf();
        if constexpr (kMaskMode != 0)  // only huge mask values give a max of +-FLT_MAX
          if (s > 0.f && is_huge_row_max(row_max[mt][h])) lse = huge_row_lse(row_max[mt][h], lg2(s));
        store_f32_global(lse_base + row, lse);
      }
    }

  // Only this warp ever read these rows of sQ, so a warp barrier suffices.
  syncwarp();
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const u32 srow = sQ + (warp_row0 + mt * 16 + (lane >> 2) + 8 * h) * kSB + (lane & 3) * 4;
#pragma unroll
      for (int dt = 0; dt < kDT; ++dt)
        st_shared_u32(srow + dt * 16, Ops::pack(acc_o[mt][dt][2 * h] * inv_sum[mt][h],
                                                 acc_o[mt][dt][2 * h + 1] * inv_sum[mt][h]));
    }
  syncwarp();
#pragma unroll
  for (int i = 0; i < Tile::kRowsPerWarp * kChunks / 32; ++i) {
    const int c = lane + i * 32;
    const int r = warp_row0 + c / kChunks, ch = c % kChunks;
    if (m_start + r < Sq) copy16_shared_to_global(o_base + (m_start + r) * o_rs + ch * 16, sQ + r * kSB + ch * 16);
  }
}

}  // namespace opfuse_attn
