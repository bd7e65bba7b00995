// opfuse attention backward for Hopper (sm_90a): wgmma, TMA, warp specialisation.
//
// Compiled at run time by NVRTC for sm_90a after attention_ptx.cu,
// attention_sm90_ptx.cu and attention_bwd.cu (whose AttnBwdParams, preprocess
// and dQ-convert kernels it shares); no #include. Same semantics as
// attention_bwd.cu's atomic mode: with P = exp(scale * Q K^T - LSE)
// (recomputed; causal bottom-right: query i sees key j iff j <= i + Sk - Sq),
//
//   dS = P * (dO V^T - Delta)   dV = P^T dO   dK = scale dS^T Q   dQ = scale dS K
//
// dK, dV summed over the Hq / Hkv query heads of each KV head.
//
// Launch sequence (attention_bwd_launcher_sm90.cpp): attention_bwd_preprocess
// (Delta, LSE * log2 e, zeroed float32 dQ accumulator), this kernel, then
// attention_bwd_dq_convert (dQ = scale * accumulator in the element type).
//
// Design (one CTA = BLOCK_N = 128 keys of one (batch, kv head)):
// - warpgroup 0 is the producer: after setmaxnreg.dec one thread loads K and V
//   once (TMA), then, for every query head of the group and every query block
//   that sees one of the CTA's keys, Q, dO (TMA, 128-byte swizzle) and the
//   block's LSE2 and Delta (1-D bulk copies) into a STAGES-deep ring; each
//   stage completes on a "full" mbarrier with its byte count and is reused
//   after all eight consumer warps arrived on its "empty" mbarrier;
// - warpgroups 1 and 2 are consumers, each owning 64 of the keys. Per query
//   block: S^T = K Q^T and dP^T = V dO^T with wgmma from shared memory (keys
//   are the M dimension, so the accumulators hold key rows), then
//   P^T = exp2(S^T * scale log2 e - LSE2) and dS^T = P^T (dP^T - Delta) in
//   registers, which are already the A fragments (registers) of
//   dV += P^T dO and dK += dS^T Q (dO and Q as N-major B operands): dK and dV
//   stay in registers for the whole loop, so GQA needs no atomics and they
//   are deterministic;
// - dQ += dS K needs all 128 keys: each consumer writes its dS^T rows to a
//   shared tile (the layout the TMA writes, so that wgmma reads it as an
//   M-major A operand), fences the async proxy, and the two meet at a named
//   barrier; then consumer w computes its part of dQ (BLOCK_M = 128: query
//   rows 64 w ..; BLOCK_M = 64: D columns 64 w ..) with wgmma (dS transposed
//   from shared memory, K N-major) and adds it to the float32 accumulator with
//   red.global.add.v2.f32. dS^T is double-buffered, so one barrier per block
//   suffices: a consumer rewrites a buffer two blocks later, after the other
//   has passed the barrier of the block in between, hence finished reading it;
// - masks in registers (only blocks crossing the causal diagonal, or all of
//   a ragged last key block: zero-filled keys would give P = exp(-LSE), which
//   overflows for very negative scores); TMA zero-fills rows past Sq / Sk,
//   whose LSE2 = +inf (preprocess) gives P = 0.
//
// (DQ_MODE 1 and 2 replace the red.global step, and the OPTS bits change the
// schedule: see BwdSm90Tile and the enums before it.)
//
// Entry point: attention_bwd_sm90<Elem, HEAD_DIM, IS_CAUSAL, BLOCK_M, STAGES, DQ_MODE[, OPTS]>,
// HEAD_DIM 64 (BLOCK_M 128) or 128 (BLOCK_M 64), DQ_MODE 0-2. Launch: grid
// (ceil(Sk / 128), Hkv, B), 384 threads, dynamic shared memory
// BwdSm90Tile<...>::kSmemBytes (raise the attribute first), five arguments:
// AttnBwdParams by value and the tensor maps of Q, K, V and dO (CUtensorMap,
// 4-D over (D, S, H, B), box (64, BLOCK_M for Q and dO, 128 for K and V, 1, 1),
// 128-byte swizzle, zero OOB fill; docs/attention.md, "Hopper backward").

namespace opfuse_attn {

// wgmma D (+)= A B with A M-major ("transposed", trans-a = 1) and B N-major
// (trans-b = 1), both from shared memory; allowed for 16-bit types. Operand
// lists generated as attention_sm90_ptx.cu's.
template <typename Elem, int N>
__device__ __forceinline__ void wgmma_ss_tt(float (&d)[N / 2], u64 da, u64 db, int scale_d);

template <>
__device__ __forceinline__ void wgmma_ss_tt<bf16, 64>(float (&d)[32], u64 da, u64 db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(scale_d));
}

template <>
__device__ __forceinline__ void wgmma_ss_tt<bf16, 128>(float (&d)[64], u64 da, u64 db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db), "r"(scale_d));
}

template <>
__device__ __forceinline__ void wgmma_ss_tt<f16, 64>(float (&d)[32], u64 da, u64 db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(scale_d));
}

template <>
__device__ __forceinline__ void wgmma_ss_tt<f16, 128>(float (&d)[64], u64 da, u64 db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db), "r"(scale_d));
}

// make_desc(tile + off, ...) from make_desc(tile, ...): the start-address field
// (bits 0-13, address / 16) takes off / 16. Shared addresses stay below 2^18
// (228 KB), so the field never carries into the leading byte offset above it,
// and a compile-time off becomes one add on the low word (OPTS "u").
__device__ __forceinline__ u64 desc_plus(u64 base, u32 off) {
  return ((base >> 32) << 32) | (u64)((u32)base + (off >> 4));
}

// ---------------------------------------------------------------------------
// Tile geometry (the launchers mirror kSmemBytes: docs/attention.md)
// ---------------------------------------------------------------------------

// How dQ += dS K reaches the float32 accumulator in global memory (DQ_MODE):
// 0: both consumers' dS^T rows meet in shared memory (a barrier of the two
//    per block), each consumer computes half of the block's dQ over all 128
//    keys and adds it with red.global.add.v2.f32 from registers;
// 1: as 0, but each warp stages its 16 rows of dQ in shared memory and its
//    lanes add them with one cp.reduce.async.bulk (.add.f32) per row: the
//    copy engine and L2 do the additions, the consumers issue 16 bulk ops
//    per warp instead of 16 RED per thread;
// 2: the consumers store their dQ into one shared BLOCK_M x D tile and arrive
//    on an mbarrier; writer threads of the producer warpgroup add the tile
//    to global memory with one bulk reduction per pair of rows and free it
//    (another mbarrier) once the copy engine has read it. The consumers' tail
//    is 16 (or 32) st.shared and an arrive, instead of the RED issue
//    (throttled by the LSU queue, and holding the address registers that the
//    next block's first instructions wait for: ncu at 1172345) or a per-lane
//    bulk loop. The D = 128 default (H200 at 1edd8e0: +20% over mode 0).
enum { kDqRed = 0, kDqBulk = 1, kDqWriter = 2 };

// Schedule options (OPTS, a bit set; tag suffix "_" + letters), A/B variants at
// BLOCK_M = 64 while they are measured (docs/attention.md, "Hopper backward"):
// - kOptEarlyDK ("k"): dK += dS^T Q is issued as soon as dS^T is packed, before
//   the dS^T stores to shared memory, so that the tensor cores run dK while the
//   stores, the proxy fence and the consumers' barrier go by;
// - kOptDeferDQ ("d"): the dQ of block i is computed in iteration i + 1 (after
//   this consumer stored dS^T of block i + 1), from a ring of dS^T buffers. The
//   consumers no longer meet at a barrier per block: each one arrives (bar.arrive)
//   on its own named barrier once its dS^T rows are stored and waits (bar.sync)
//   only for the other's rows of the previous block, so one may run up to about a
//   block ahead of the other and their exp / dS^T phases need not coincide (ncu at
//   1172345: both consumers idle the tensor pipe at the same points);
// - kOptStagger ("t", with "d"): consumer 1 starts its first block only once
//   consumer 0's S^T and dP^T of it are done, i.e. about half a block later;
// - kOptRedV4 ("v", dQ mode 0): lanes 2i and 2i + 1 swap half of their dQ
//   pairs (shfl) so that each adds 4 adjacent floats with one
//   red.global.add.v4.f32: half the RED instructions (ncu at 1172345: the REDs
//   wait on the LSU queue).
// - kOptOverlapS ("o", without "d"): the next block's S^T = K Q^T is issued
//   before this block's dQ epilogue (as soon as dV and dK are complete, while
//   dQ still runs), so that the tensor cores have work while the consumers
//   store dQ, fence, arrive and reach the next block. Without it both consumers
//   (kept in step by the per-block barrier) drain the tensor pipe at every block
//   boundary: the wait for dQ, the dQ stores, the loop top and the first S^T
//   HGMMA's latency all pass with no product in flight. The stage is released
//   to the producer at the same point (dQ reads only dS^T and K). At the last
//   block a dropped S^T reads whatever the next stage holds (a wgmma under a
//   branch made ptxas serialise them: see the deferred dQ's note below).
//   Measured 1-2% slower (H200 at edc04eb): ncu showed the consumers waiting
//   on wgmma only ~20% of their time (the wait 12%, HGMMA issue 9%), so the
//   drain it removes is short, and the loop body must start with the early S^T
//   complete.
// - kOptCheapDesc ("u"): wgmma descriptors as one base per tile plus the
//   compile-time offset of each k-step in the address field, instead of
//   make_desc from the full address at every HGMMA (12-15 integer and
//   uniform-register instructions per HGMMA in the SASS at d68063d): 704 to
//   566 instructions per consumer warp and block in the loop (ncu at edc04eb).
// - kOptDqSwizzle ("b", dQ mode 2): the two rows of a staging pair lie 512 bytes
//   apart, i.e. on the same banks, and a 64-bit store is served a half-warp (4
//   rows) at a time, so every dQ st.shared.v2 took 4 wavefronts instead of 2
//   (ncu at edc04eb: 2x excess on all 16 per thread and block). With "b" a
//   thread of an odd row stores its column chunks in the order j ^ 2, which puts
//   the 4 rows of a half-warp on 4 different groups of 8 banks.
enum { kOptEarlyDK = 1, kOptDeferDQ = 2, kOptStagger = 4, kOptRedV4 = 8, kOptOverlapS = 16, kOptCheapDesc = 32,
       kOptDqSwizzle = 64 };

template <int HEAD_DIM, int BLOCK_M, int STAGES, int DQ_MODE = kDqRed, int OPTS = 0>
struct BwdSm90Tile {
  static constexpr int kBlockN = 128;  // keys per CTA, 64 per consumer
  static constexpr int kConsumers = 2;
  static constexpr int kThreads = (kConsumers + 1) * 128;
  static constexpr int kChunks64 = HEAD_DIM / 64;  // 128-byte column chunks of a row
  static constexpr int kKVBytes = kBlockN * HEAD_DIM * 2;  // one of K, V
  static constexpr int kQBytes = BLOCK_M * HEAD_DIM * 2;   // one of Q, dO (per stage)
  static constexpr int kStatBytes = BLOCK_M * 4;           // one of LSE2, Delta (per stage)
  static constexpr int kDSBytes = kBlockN * BLOCK_M * 2;   // one dS^T buffer
  static constexpr bool kDqStaged = DQ_MODE != kDqRed;
  static constexpr bool kDqWriterThread = DQ_MODE == kDqWriter;
  static constexpr bool kEarlyDK = (OPTS & kOptEarlyDK) != 0;
  static constexpr bool kDeferDQ = (OPTS & kOptDeferDQ) != 0;
  static constexpr bool kStagger = (OPTS & kOptStagger) != 0;
  static constexpr bool kRedV4 = (OPTS & kOptRedV4) != 0;
  static constexpr bool kOverlapS = (OPTS & kOptOverlapS) != 0;
  static constexpr bool kCheapDesc = (OPTS & kOptCheapDesc) != 0;
  static constexpr bool kDqSwizzle = (OPTS & kOptDqSwizzle) != 0;
  // Both consumers read each dS^T buffer: two, so that one barrier per block
  // suffices. Deferred dQ: consumer w stores dS^T(i) while the other may still
  // read dS^T(i - 3) (its dQ(i - 3), finished in its iteration i - 2); w knows
  // that iteration is over only from the other's arrival for dS^T(i - 2),
  // waited for in w's iteration i - 1: four buffers. With the dQ writer (mode
  // 2) three suffice: before storing dQ(i - 2) in iteration i - 1, w waits until
  // the writer has added tile i - 3, which needed the other's dQ(i - 3) done.
  static constexpr int kDSBufs = !kDeferDQ ? 2 : DQ_MODE == kDqWriter ? 3 : 4;
  // dQ split between the consumers: query rows when there are 128, else D columns.
  static constexpr bool kDqSplitRows = BLOCK_M == 64 * kConsumers;
  static constexpr int kDqN = kDqSplitRows ? HEAD_DIM : HEAD_DIM / kConsumers;
  // dQ staging. Mode 1: each of the 8 consumer warps owns 16 rows of its kDqN
  // columns, rows padded by 32 bytes so that the v2 stores of a warp (8 rows x
  // 32 bytes) touch every bank twice, the minimum. Mode 2: the block's BLOCK_M
  // rows of HEAD_DIM floats (both consumers' parts side by side), in pairs of
  // rows padded by 32 bytes: the 8 rows of a warp's store fall on 4 bank
  // offsets 8 words apart (still every bank twice at D = 128), and one bulk
  // reduction adds a pair (two adjacent rows of the accumulator).
  static constexpr int kDqRowBytes = kDqN * 4 + 32;
  static constexpr int kDqWarpBytes = 16 * kDqRowBytes;
  static constexpr int kDqPairBytes = 2 * HEAD_DIM * 4 + 32;
  static constexpr int kDqStageBytes =
      DQ_MODE == kDqBulk ? 4 * kConsumers * kDqWarpBytes : DQ_MODE == kDqWriter ? BLOCK_M / 2 * kDqPairBytes : 0;
  // Mode 2: lane 0 of producer warps 1-3 each issues a third of the block's
  // reductions (one thread issuing all 64 per-row reductions of a block made
  // the backward 23% slower than mode 0 on the H200 at 5bd677a: it could not
  // keep up).
  static constexpr int kDqWriters = 3;
  // smem (from a 1024-byte aligned base):
  // K | V | Q[STAGES] | dO[STAGES] | dS^T[kDSBufs] | LSE2[STAGES] | Delta[STAGES] | dQ staging | barriers
  static constexpr int kOffK = 0;
  static constexpr int kOffV = kOffK + kKVBytes;
  static constexpr int kOffQ = kOffV + kKVBytes;
  static constexpr int kOffDO = kOffQ + STAGES * kQBytes;
  static constexpr int kOffDS = kOffDO + STAGES * kQBytes;
  static constexpr int kOffL = kOffDS + kDSBufs * kDSBytes;
  static constexpr int kOffD = kOffL + STAGES * kStatBytes;
  static constexpr int kOffDQ = kOffD + STAGES * kStatBytes;
  static constexpr int kOffBar = kOffDQ + kDqStageBytes;
  // K/V, full[STAGES], empty[STAGES], then (mode 2) dq_full, dq_empty.
  static constexpr int kBarBytes = 8 * (1 + 2 * STAGES + (kDqWriterThread ? 2 : 0));
  static constexpr int kSmemBytes = kOffBar + kBarBytes + 1024;  // + 1024 to align the base by hand
  static constexpr int kLimit = 227 * 1024;
  // 24 x 128 + 240 x 256 = 168 x 384, the registers the CTA is launched
  // with: setmaxnreg.inc waits until the pool can serve it, so the sum must
  // not exceed the launch allocation (32 for the producer, tried for the dQ
  // writer of mode 2, hung every launch on the H200 at 048c6f4).
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  // Issue dV += P^T dO as soon as P^T is packed, before dP^T is waited for,
  // so that the tensor cores work while dS^T is computed. Needs the 16-bit
  // P^T beside float S^T and dP^T: registers allow it at BLOCK_M = 64.
  static constexpr bool kEarlyDV = BLOCK_M == 64;

  static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "the sm_90 backward covers head dims 64 and 128");
  static_assert(BLOCK_M == 64 || BLOCK_M == 128, "BLOCK_M must be 64 or 128");
  // dQ by D columns needs whole 64-column chunks per consumer.
  static_assert(kDqSplitRows || kDqN % 64 == 0, "BLOCK_M = 64 needs HEAD_DIM = 128");
  // float32 registers: dK, dV (HEAD_DIM / 2 each), S^T and dP^T (BLOCK_M / 2 each).
  static_assert(HEAD_DIM + BLOCK_M <= 192, "accumulators would not fit in 240 registers");
  static_assert(STAGES >= 2 && STAGES <= 4, "2 to 4 stages");
  static_assert(DQ_MODE >= kDqRed && DQ_MODE <= kDqWriter, "DQ_MODE 0, 1 or 2");
  static_assert(kSmemBytes <= kLimit, "tile does not fit in shared memory");
  static_assert(OPTS >= 0 && OPTS < 128,
                "OPTS: bits kOptEarlyDK, kOptDeferDQ, kOptStagger, kOptRedV4, kOptOverlapS, kOptCheapDesc, kOptDqSwizzle");
  static_assert(!kDqSwizzle || (DQ_MODE == kDqWriter && kDqN % 32 == 0), "dQ staging order: mode 2, 4+ chunks");
  static_assert(!kOverlapS || !kDeferDQ, "the early S^T replaces the deferred dQ's schedule (not combined)");
  static_assert(!kRedV4 || DQ_MODE == kDqRed, "v4 reductions: dQ mode 0");
  static_assert(!kDeferDQ || (BLOCK_M == 64 && DQ_MODE != kDqBulk), "deferred dQ: BLOCK_M = 64, dQ mode 0 or 2");
  static_assert(!kStagger || kDeferDQ, "the stagger needs the deferred dQ (else the barrier re-aligns the consumers)");
};

// ---------------------------------------------------------------------------
// The kernel
// ---------------------------------------------------------------------------

template <typename Elem, int HEAD_DIM, bool IS_CAUSAL, int BLOCK_M, int STAGES, int DQ_MODE, int OPTS = 0>
__global__ void __launch_bounds__(384, 1)
    attention_bwd_sm90(const AttnBwdParams p, const __grid_constant__ TmaDesc tm_q,
                       const __grid_constant__ TmaDesc tm_k, const __grid_constant__ TmaDesc tm_v,
                       const __grid_constant__ TmaDesc tm_do) {
  using Tile = BwdSm90Tile<HEAD_DIM, BLOCK_M, STAGES, DQ_MODE, OPTS>;
  constexpr int BLOCK_N = Tile::kBlockN;
  constexpr int kChunks64 = Tile::kChunks64;
  constexpr int kNS = BLOCK_M / 2;    // S^T / dP^T accumulator floats per thread
  constexpr int kND = HEAD_DIM / 2;   // dK / dV accumulator floats per thread
  constexpr int kNQ = Tile::kDqN / 2;  // dQ accumulator floats per thread and m64 product

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // TMA with the 128-byte swizzle and the wgmma descriptors (base offset 0)
  // need 1024-byte aligned tiles; the dynamic base is aligned up by hand.
  const u32 smem = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const u32 sK = smem + Tile::kOffK, sV = smem + Tile::kOffV;
  const u32 sQ0 = smem + Tile::kOffQ, sdO0 = smem + Tile::kOffDO, sdS0 = smem + Tile::kOffDS;
  const u32 sL0 = smem + Tile::kOffL, sD0 = smem + Tile::kOffD, sDQ = smem + Tile::kOffDQ;
  const u32 bar_kv = smem + Tile::kOffBar;
  const u32 bar_full = bar_kv + 8;              // [STAGES]
  const u32 bar_empty = bar_full + 8 * STAGES;  // [STAGES]
  const u32 bar_dq_full = bar_empty + 8 * STAGES, bar_dq_empty = bar_dq_full + 8;  // mode 2

  const int tid = threadIdx.x;
  const int warpgroup = tid / 128;
  const int n_block = blockIdx.x, head_kv = blockIdx.y, batch = blockIdx.z;
  const int Sq = p.seqlen_q, Sk = p.seqlen_k;
  const int diag = Sk - Sq;  // query i sees key j iff j <= i + diag
  const int n0 = n_block * BLOCK_N;
  const int G = p.q_per_kv;

  // Query blocks that see a key of this block (query_blocks, attention_bwd.cu).
  const QueryBlocks qb = query_blocks<IS_CAUSAL, BLOCK_M, BLOCK_N>(n0, Sq, Sk, diag);
  const int n_mblocks = qb.n_mblocks, m_unmasked = qb.unmasked;
  const int m_first = qb.first < n_mblocks ? qb.first : n_mblocks;
  const int per_head = n_mblocks - m_first;
  const int n_iters = G * per_head;  // (query head, query block) pairs, head-major

  if (tid == 0) {
    mbar_init(bar_kv, 1);
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(bar_full + 8 * s, 1);
      mbar_init(bar_empty + 8 * s, 4 * Tile::kConsumers);  // one arrival per consumer warp
    }
    if (Tile::kDqWriterThread) {
      mbar_init(bar_dq_full, 4 * Tile::kConsumers);  // every consumer warp stored its dQ rows
      mbar_init(bar_dq_empty, Tile::kDqWriters);    // the writers' reductions have read the tile
    }
    fence_mbar_init();
  }
  __syncthreads();

  if (warpgroup == 0) {
    // ------------------------------ producer ------------------------------
    setmaxnreg_dec<Tile::kProducerRegs>();
    if (tid == 0 && n_iters > 0) {
      prefetch_tma_desc(&tm_q);
      prefetch_tma_desc(&tm_k);
      prefetch_tma_desc(&tm_v);
      prefetch_tma_desc(&tm_do);
      mbar_arrive_expect_tx(bar_kv, 2 * Tile::kKVBytes);
#pragma unroll
      for (int c = 0; c < kChunks64; ++c) {
        tma_load_4d(sK + c * BLOCK_N * 128, &tm_k, c * 64, n0, head_kv, batch, bar_kv);
        tma_load_4d(sV + c * BLOCK_N * 128, &tm_v, c * 64, n0, head_kv, batch, bar_kv);
      }
      for (int it = 0; it < n_iters; ++it) {
        const int head = head_kv * G + it / per_head;
        const int m0 = (m_first + it % per_head) * BLOCK_M;
        const int s = it % STAGES;
        mbar_wait(bar_empty + 8 * s, ((it / STAGES) & 1) ^ 1);
        const u32 full = bar_full + 8 * s;
        mbar_arrive_expect_tx(full, 2 * Tile::kQBytes + 2 * Tile::kStatBytes);
        const u32 sQ = sQ0 + s * Tile::kQBytes, sdO = sdO0 + s * Tile::kQBytes;
#pragma unroll
        for (int c = 0; c < kChunks64; ++c) {
          tma_load_4d(sQ + c * BLOCK_M * 128, &tm_q, c * 64, m0, head, batch, full);
          tma_load_4d(sdO + c * BLOCK_M * 128, &tm_do, c * 64, m0, head, batch, full);
        }
        // Workspace rows: Sq_pad (a multiple of 128) per (b, h), so the block
        // is in bounds and 16-byte aligned; rows past Sq hold LSE2 = +inf, Delta = 0.
        const i64 ws = ((i64)batch * p.heads_q + head) * p.seqlen_q_pad + m0;
        bulk_load(sL0 + s * Tile::kStatBytes, p.lse_log2 + ws, Tile::kStatBytes, full);
        bulk_load(sD0 + s * Tile::kStatBytes, p.delta + ws, Tile::kStatBytes, full);
      }
    }
    if constexpr (Tile::kDqWriterThread) {
      // The dQ writers (mode 2): per block, once all consumer warps stored
      // their rows, one bulk reduction per pair of rows into the float32
      // accumulator (rows of Sq_pad per (b, h): all in bounds), then the tile
      // is free again as soon as the copy engine has read it.
      const int writer = tid / 32 - 1;  // producer warps 1 .. kDqWriters
      if (writer >= 0 && writer < Tile::kDqWriters && (tid & 31) == 0 && n_iters > 0) {
        for (int it = 0; it < n_iters; ++it) {
          const int head = head_kv * G + it / per_head;
          const int m0 = (m_first + it % per_head) * BLOCK_M;
          mbar_wait(bar_dq_full, it & 1);
          float* dqa = p.dq_accum + (((i64)batch * p.heads_q + head) * p.seqlen_q_pad + m0) * HEAD_DIM;
#pragma unroll 1
          for (int q = writer; q < BLOCK_M / 2; q += Tile::kDqWriters)
            bulk_reduce_add_f32(dqa + 2 * q * HEAD_DIM, sDQ + q * Tile::kDqPairBytes, 2 * HEAD_DIM * 4);
          bulk_commit();
          bulk_wait_read_all();
          mbar_arrive(bar_dq_empty);
        }
        bulk_wait_all();  // complete before the CTA (and its shared memory) goes
      }
    }
  } else {
    // ------------------------------ consumers -----------------------------
    setmaxnreg_inc<Tile::kConsumerRegs>();
    const int wg = warpgroup - 1;  // this consumer's keys: n0 + 64 wg ...
    const int lane = tid & 31;
    const int warp_in_wg = (tid / 32) & 3;
    // Accumulator element d[4 j + 2 h + e]: row r0 + 8 h, column 8 j + 2 (lane % 4) + e.
    const int r0 = warp_in_wg * 16 + (lane >> 2);
    const int c0 = 2 * (lane & 3);
    const float scale_log2 = p.scale_log2;

    float acc_dk[kND], acc_dv[kND];
#pragma unroll
    for (int i = 0; i < kND; ++i) acc_dk[i] = acc_dv[i] = 0.f;

    if (n_iters > 0) mbar_wait(bar_kv, 0);

    // Named barriers of the deferred dQ: consumer w arrives on defer_bar(w, i)
    // once its dS^T rows of block i are stored, the other waits there before
    // its dQ of block i. Four per consumer: w arrives on a barrier again four
    // blocks later, by when the other has passed it (w's iteration i + 3 waited
    // for the other's rows of block i + 2, stored after its wait for block i).
    constexpr int kStaggerBar = 2;
    auto defer_bar = [](int w, int i) { return 3 + 4 * w + (i & 3); };

    // dQ += dS K of one block: dS^T from shared memory (M-major), K N-major.
    // Consumer w: query rows 64 w .. (BLOCK_M = 128) or D columns 64 w .. (64).
    auto issue_dq = [&](float (&acc_dq)[kNQ], u32 sdS_b, int wg) {
      constexpr int kDqChunk = Tile::kDqSplitRows ? 0 : 1;  // consumer w's 64-column chunk of K (split by D)
      constexpr int kDqRows = Tile::kDqSplitRows ? 1 : 0;   // consumer w's 64 query rows (split by rows)
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
        u64 da, db;
        if constexpr (Tile::kCheapDesc) {
          da = desc_plus(make_desc(sdS_b + kDqRows * wg * BLOCK_N * 128, BLOCK_N * 128, 1024), kk * 16 * 128);
          db = desc_plus(make_desc(sK + kDqChunk * wg * BLOCK_N * 128, BLOCK_N * 128, 1024), kk * 16 * 128);
        } else {
          da = make_desc(sdS_b + kDqRows * wg * BLOCK_N * 128 + kk * 16 * 128, BLOCK_N * 128, 1024);
          db = make_desc(sK + kDqChunk * wg * BLOCK_N * 128 + kk * 16 * 128, BLOCK_N * 128, 1024);
        }
        wgmma_ss_tt<Elem, Tile::kDqN>(acc_dq, da, db, kk > 0);
      }
      wgmma_commit();
    };
    // Block b's dQ (b counts the loop's (query head, query block) pairs),
    // complete in acc_dq, into the float32 accumulator, by DQ_MODE.
    auto emit_dq = [&](float (&acc_dq)[kNQ], int b, int head, int m0, int t_o) {
      const int wg = t_o / 128 - 1, lane = t_o & 31;
      const int r0 = ((t_o / 32) & 3) * 16 + (lane >> 2), c0 = 2 * (lane & 3);
      const int dq_row0 = Tile::kDqSplitRows ? wg * 64 : 0;
      const int dq_col0 = Tile::kDqSplitRows ? 0 : wg * Tile::kDqN;
      if constexpr (Tile::kDqWriterThread) {
        // Into the block's staging tile once the writer has read the previous one.
        mbar_wait(bar_dq_empty, (b & 1) ^ 1);
        if constexpr (Tile::kDqSwizzle) {
          // "b": an odd row stores chunk j ^ 2 in step j, i.e. at 32 (j ^ 2) =
          // 32 j + 64 (j & 2 ? -1 : 1) bytes: two bases per row and immediate
          // offsets; its values come through a select of two registers.
          const bool odd = (lane >> 2) & 1;  // the parity of dq_row0 + r0 + 8 h
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int row = dq_row0 + r0 + 8 * h;
            const u32 row_addr = sDQ + (row >> 1) * Tile::kDqPairBytes + (row & 1) * HEAD_DIM * 4 + (dq_col0 + c0) * 4;
            const u32 base_j02 = row_addr + (odd ? 64u : 0u), base_j13 = row_addr - (odd ? 64u : 0u);
#pragma unroll
            for (int j = 0; j < Tile::kDqN / 8; ++j)
              st_shared_f32x2(((j & 2) ? base_j13 : base_j02) + 32 * j,
                              odd ? acc_dq[4 * (j ^ 2) + 2 * h] : acc_dq[4 * j + 2 * h],
                              odd ? acc_dq[4 * (j ^ 2) + 2 * h + 1] : acc_dq[4 * j + 2 * h + 1]);
          }
        } else {
#pragma unroll
          for (int j = 0; j < Tile::kDqN / 8; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h)
              st_shared_f32x2(sDQ + ((dq_row0 + r0 + 8 * h) >> 1) * Tile::kDqPairBytes +
                                  ((dq_row0 + r0 + 8 * h) & 1) * HEAD_DIM * 4 + (dq_col0 + 8 * j + c0) * 4,
                              acc_dq[4 * j + 2 * h], acc_dq[4 * j + 2 * h + 1]);
        }
        fence_proxy_async_smem();
        syncwarp();
        if (lane == 0) mbar_arrive(bar_dq_full);
        return;
      }
      // dQ accumulator rows of Sq_pad per (b, h): every row of the block is in
      // bounds (rows past Sq add zeros).
      float* dqa = p.dq_accum + (((i64)batch * p.heads_q + head) * p.seqlen_q_pad + m0 + dq_row0) * HEAD_DIM + dq_col0;
      if constexpr (Tile::kDqStaged) {
        // This warp's 16 rows (r0 + 8 h - 16 w_in_wg), one bulk reduction per row.
        const int w_in_wg = (t_o / 32) & 3;
        const u32 stage = sDQ + (wg * 4 + w_in_wg) * Tile::kDqWarpBytes;
        bulk_wait_read_all();  // this lane's reductions of the previous block have read the staging rows
        syncwarp();
#pragma unroll
        for (int j = 0; j < Tile::kDqN / 8; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            st_shared_f32x2(stage + ((lane >> 2) + 8 * h) * Tile::kDqRowBytes + (8 * j + c0) * 4,
                            acc_dq[4 * j + 2 * h], acc_dq[4 * j + 2 * h + 1]);
        fence_proxy_async_smem();
        syncwarp();
        if (lane < 16) {
          bulk_reduce_add_f32(dqa + (w_in_wg * 16 + lane) * HEAD_DIM, stage + lane * Tile::kDqRowBytes,
                              Tile::kDqN * 4);
          bulk_commit();
        }
      } else if constexpr (Tile::kRedV4) {
        // Columns 8 j + 2 q, +1 at lane q = lane % 4. For the pair j0 = 2 m,
        // j1 = 2 m + 1: an even lane keeps its j0 pair and takes its odd
        // neighbour's (columns 8 j0 + 4 (q / 2) ..+3), the odd lane keeps its j1
        // pair and takes the even one's (8 j1 + 4 (q / 2) ..+3).
        const bool odd = lane & 1;
        const int c4 = 4 * ((lane & 3) >> 1);
#pragma unroll
        for (int m = 0; m < Tile::kDqN / 16; ++m)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float a0 = acc_dq[8 * m + 2 * h], a1 = acc_dq[8 * m + 2 * h + 1];
            const float b0 = acc_dq[8 * m + 4 + 2 * h], b1 = acc_dq[8 * m + 4 + 2 * h + 1];
            const float x0 = shfl_xor(odd ? a0 : b0, 1), x1 = shfl_xor(odd ? a1 : b1, 1);
            red_add_f32x4(dqa + (r0 + 8 * h) * HEAD_DIM + 8 * (2 * m + (odd ? 1 : 0)) + c4, odd ? x0 : a0,
                          odd ? x1 : a1, odd ? b0 : x0, odd ? b1 : x1);
          }
      } else {
#pragma unroll
        for (int j = 0; j < Tile::kDqN / 8; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            red_add_f32x2(dqa + (r0 + 8 * h) * HEAD_DIM + 8 * j + c0, acc_dq[4 * j + 2 * h],
                          acc_dq[4 * j + 2 * h + 1]);
      }
    };

    if (Tile::kDeferDQ && n_iters > 0) named_bar_arrive(defer_bar(wg, -1), 128 * Tile::kConsumers);

    // S^T = K Q^T of one block into acc (OPTS "o": issued a block ahead).
    auto issue_s = [&](float (&acc)[kNS], u32 sQ_b, int wg) {
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
        u64 da, db;
        if constexpr (Tile::kCheapDesc) {
          da = desc_plus(make_desc(sK + wg * 64 * 128, 16, 1024), (ks / 4) * BLOCK_N * 128 + (ks % 4) * 32);
          db = desc_plus(make_desc(sQ_b, 16, 1024), (ks / 4) * BLOCK_M * 128 + (ks % 4) * 32);
        } else {
          da = make_desc(sK + (ks / 4) * BLOCK_N * 128 + wg * 64 * 128 + (ks % 4) * 32, 16, 1024);
          db = make_desc(sQ_b + (ks / 4) * BLOCK_M * 128 + (ks % 4) * 32, 16, 1024);
        }
        wgmma_ss<Elem, BLOCK_M>(acc, da, db, ks > 0);
      }
      wgmma_commit();
    };
    // OPTS "o": S^T of block it lives across the loop's back edge (issued in
    // iteration it - 1, or here for block 0: with no block, it reads whatever
    // shared memory holds and is dropped).
    float acc_s_ahead[Tile::kOverlapS ? kNS : 1];
    if constexpr (Tile::kOverlapS) {
      if (n_iters > 0) mbar_wait(bar_full, 0);
      issue_s(acc_s_ahead, sQ0, wg);
    }

#pragma unroll 1
    for (int it = 0; it < n_iters; ++it) {
      const int head = head_kv * G + it / per_head;
      const int m_block = m_first + it % per_head;
      const int m0 = m_block * BLOCK_M;
      const int s = it % STAGES;
      const u32 sQ = sQ0 + s * Tile::kQBytes, sdO = sdO0 + s * Tile::kQBytes;
      const u32 sL = sL0 + s * Tile::kStatBytes, sD = sD0 + s * Tile::kStatBytes;
      const u32 sdS = sdS0 + (Tile::kDSBufs == 2 ? it & 1 : it % Tile::kDSBufs) * Tile::kDSBytes;
      if constexpr (!Tile::kOverlapS) mbar_wait(bar_full + 8 * s, (it / STAGES) & 1);  // else waited before S^T
      // Thread coordinates recomputed from an opaque %tid.x every block
      // instead of being kept live across the loop (ptxas spilled them).
      const int t_o = tid_opaque();
      const int wg = t_o / 128 - 1, lane = t_o & 31;
      const int r0 = ((t_o / 32) & 3) * 16 + (lane >> 2), c0 = 2 * (lane & 3);
      // Descriptors (attention_sm90_ptx.cu, make_desc). K-major: K and V rows of
      // this consumer as A of S^T / dP^T, Q and dO rows as B. N-major: dO and Q
      // as B of dV / dK (the reduction runs over query rows), K as B of dQ.
      // M-major: dS^T as A of dQ.
      auto kmaj_a = [&](u32 tile, int ks) {
        if constexpr (Tile::kCheapDesc)
          return desc_plus(make_desc(tile + wg * 64 * 128, 16, 1024), (ks / 4) * BLOCK_N * 128 + (ks % 4) * 32);
        return make_desc(tile + (ks / 4) * BLOCK_N * 128 + wg * 64 * 128 + (ks % 4) * 32, 16, 1024);
      };
      auto kmaj_b = [&](u32 tile, int ks) {
        if constexpr (Tile::kCheapDesc) return desc_plus(make_desc(tile, 16, 1024), (ks / 4) * BLOCK_M * 128 + (ks % 4) * 32);
        return make_desc(tile + (ks / 4) * BLOCK_M * 128 + (ks % 4) * 32, 16, 1024);
      };
      auto nmaj_q = [&](u32 tile, int kk) {
        if constexpr (Tile::kCheapDesc) return desc_plus(make_desc(tile, BLOCK_M * 128, 1024), kk * 16 * 128);
        return make_desc(tile + kk * 16 * 128, BLOCK_M * 128, 1024);
      };

      // Stagger: consumer 1 waits for consumer 0's S^T and dP^T of the first block.
      if (Tile::kStagger && it == 0 && wg == 1) named_bar_sync(kStaggerBar, 128 * Tile::kConsumers);

      float acc_s_here[Tile::kOverlapS ? 1 : kNS], acc_dp[kNS];
      float(&acc_s)[kNS] = *[&]() {
        if constexpr (Tile::kOverlapS) return &acc_s_ahead;
        else return &acc_s_here;
      }();
      // OPTS "o": S^T came across the back edge; ptxas serialises every wgmma
      // of the kernel (C7514) unless the loop body starts with it complete (as
      // the forward's overlap does), so it is waited for before dP^T goes out.
      if constexpr (Tile::kOverlapS) wgmma_wait<0>();
      wgmma_fence();
      if constexpr (!Tile::kOverlapS) {
#pragma unroll
        for (int ks = 0; ks < HEAD_DIM / 16; ++ks) wgmma_ss<Elem, BLOCK_M>(acc_s, kmaj_a(sK, ks), kmaj_b(sQ, ks), ks > 0);
        wgmma_commit();
      }
#pragma unroll
      for (int ks = 0; ks < HEAD_DIM / 16; ++ks)
        wgmma_ss<Elem, BLOCK_M>(acc_dp, kmaj_a(sV, ks), kmaj_b(sdO, ks), ks > 0);
      wgmma_commit();

      // P^T while dP^T is still on the tensor cores.
      wgmma_wait<1>();
      fence_regs(acc_s);
      if (m_block < m_unmasked) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int key = n0 + wg * 64 + r0 + 8 * h;
          // keys past Sk; causal: queries before key - diag
          const int q_first = IS_CAUSAL ? key - diag : 0;
#pragma unroll
          for (int j = 0; j < BLOCK_M / 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e)
              if (key >= Sk || m0 + 8 * j + c0 + e < q_first) acc_s[4 * j + 2 * h + e] = neg_inf();
        }
      }
#pragma unroll
      for (int j = 0; j < BLOCK_M / 8; ++j) {
        float l0, l1;
        ld_shared_f32x2(sL + (8 * j + c0) * 4, l0, l1);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          // exp2(-inf) = 0: masked keys, and rows with LSE2 = +inf (past Sq, or seeing no key)
          acc_s[4 * j + 2 * h] = ex2(acc_s[4 * j + 2 * h] * scale_log2 - l0);
          acc_s[4 * j + 2 * h + 1] = ex2(acc_s[4 * j + 2 * h + 1] * scale_log2 - l1);
        }
      }

      u32 p_frag[BLOCK_M / 16][4], ds_frag[BLOCK_M / 16][4];
      auto pack_p = [&]() {
#pragma unroll
        for (int kk = 0; kk < BLOCK_M / 16; ++kk)
#pragma unroll
          for (int i = 0; i < 4; ++i) p_frag[kk][i] = pack2<Elem>(acc_s[8 * kk + 2 * i], acc_s[8 * kk + 2 * i + 1]);
      };
      auto issue_dv = [&]() {
#pragma unroll
        for (int kk = 0; kk < BLOCK_M / 16; ++kk) wgmma_rs_tb<Elem, HEAD_DIM>(acc_dv, p_frag[kk], nmaj_q(sdO, kk), 1);
      };
      if constexpr (Tile::kEarlyDV) {
        pack_p();
        wgmma_fence();
        issue_dv();
        wgmma_commit();
        wgmma_wait<1>();  // S^T and dP^T are complete, dV may still run
      } else {
        wgmma_wait<0>();
      }
      if (Tile::kStagger && it == 0 && wg == 0) named_bar_arrive(kStaggerBar, 128 * Tile::kConsumers);
      fence_regs(acc_dp);
#pragma unroll
      for (int j = 0; j < BLOCK_M / 8; ++j) {
        float d0, d1;
        ld_shared_f32x2(sD + (8 * j + c0) * 4, d0, d1);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          acc_dp[4 * j + 2 * h] = acc_s[4 * j + 2 * h] * (acc_dp[4 * j + 2 * h] - d0);
          acc_dp[4 * j + 2 * h + 1] = acc_s[4 * j + 2 * h + 1] * (acc_dp[4 * j + 2 * h + 1] - d1);
        }
      }
      // Otherwise to 16 bits only now: float P^T and dP^T die as the fragments
      // are made (fewer registers live than packing P^T before dS^T).
      if constexpr (!Tile::kEarlyDV) pack_p();
#pragma unroll
      for (int kk = 0; kk < BLOCK_M / 16; ++kk)
#pragma unroll
        for (int i = 0; i < 4; ++i) ds_frag[kk][i] = pack2<Elem>(acc_dp[8 * kk + 2 * i], acc_dp[8 * kk + 2 * i + 1]);


      // dK += dS^T Q and (unless issued early) dV += P^T dO, A from registers.
      auto issue_dk_dv = [&]() {
        wgmma_fence();
        if constexpr (!Tile::kEarlyDV) issue_dv();
#pragma unroll
        for (int kk = 0; kk < BLOCK_M / 16; ++kk) wgmma_rs_tb<Elem, HEAD_DIM>(acc_dk, ds_frag[kk], nmaj_q(sQ, kk), 1);
        wgmma_commit();
      };
      if constexpr (Tile::kEarlyDK) issue_dk_dv();

      // dS^T rows of this consumer into the shared tile, in the TMA's layout
      // (64-query chunks of [128 keys][128 bytes], 16-byte chunk c of row r at
      // c ^ (r % 8)): the 8 rows of a store hit different banks.
#pragma unroll
      for (int j = 0; j < BLOCK_M / 8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = wg * 64 + r0 + 8 * h, c = 8 * j + c0;
          const u32 addr = sdS + (c / 64) * BLOCK_N * 128 + r * 128 + ((((c % 64) / 8) ^ (r & 7)) << 4) + (c % 8) * 2;
          st_shared_u32(addr, ds_frag[j / 2][(j & 1) * 2 + h]);
        }
      fence_proxy_async_smem();

      if constexpr (!Tile::kEarlyDK) issue_dk_dv();

      if constexpr (Tile::kDeferDQ) {
        // This consumer's dS^T(it) is stored; the dQ of the previous block
        // needs the other's rows of that block.
        named_bar_arrive(defer_bar(wg, it), 128 * Tile::kConsumers);
        // At it = 0 a dQ of "block -1" from a buffer not written yet is computed
        // and dropped (its barrier arrivals come before the loop): a wgmma
        // under a branch while dK / dV are in flight made ptxas serialise them
        // (C7512) and spill. The other consumer may store into that buffer
        // meanwhile (with three buffers): it only changes the dropped result.
        float acc_dq[kNQ];
        named_bar_sync(defer_bar(1 - wg, it - 1), 128 * Tile::kConsumers);
        issue_dq(acc_dq, sdS0 + ((it + Tile::kDSBufs - 1) % Tile::kDSBufs) * Tile::kDSBytes, wg);
        wgmma_wait<0>();
        fence_regs(acc_dq);
        fence_regs(acc_dk);
        fence_regs(acc_dv);
        syncwarp();  // this warp no longer reads the stage (Q, dO, LSE2, Delta)
        if (lane == 0) mbar_arrive(bar_empty + 8 * s);
        // The previous block's head and first query row.
        const int it_p = it > 0 ? it - 1 : 0;
        if (it > 0) emit_dq(acc_dq, it_p, head_kv * G + it_p / per_head, (m_first + it_p % per_head) * BLOCK_M, t_o);
      } else {
        // Both consumers' dS^T rows are in shared memory.
        named_bar_sync(1, 128 * Tile::kConsumers);
        float acc_dq[kNQ];
        issue_dq(acc_dq, sdS, wg);
        if constexpr (Tile::kOverlapS) {
          wgmma_wait<1>();  // dV and dK are done (dQ reads only dS^T and K)
          fence_regs(acc_dk);
          fence_regs(acc_dv);
          syncwarp();  // this warp no longer reads the stage (Q, dO, LSE2, Delta)
          if (lane == 0) mbar_arrive(bar_empty + 8 * s);
          const int s_n = (it + 1) % STAGES;
          if (it + 1 < n_iters) mbar_wait(bar_full + 8 * s_n, ((it + 1) / STAGES) & 1);
          issue_s(acc_s, sQ0 + s_n * Tile::kQBytes, wg);
          wgmma_wait<1>();  // dQ is done; the next S^T runs under the dQ epilogue
          fence_regs(acc_dq);
        } else {
          wgmma_wait<0>();
          fence_regs(acc_dq);
          fence_regs(acc_dk);
          fence_regs(acc_dv);
          // This warp no longer reads the stage (Q, dO, LSE2, Delta).
          syncwarp();
          if (lane == 0) mbar_arrive(bar_empty + 8 * s);
        }
        emit_dq(acc_dq, it, head, m0, t_o);
      }
    }
    if constexpr (Tile::kDeferDQ) {
      // The last block's dQ.
      if (n_iters > 0) {
        const int t_o = tid_opaque();
        const int wg = t_o / 128 - 1;
        named_bar_sync(defer_bar(1 - wg, n_iters - 1), 128 * Tile::kConsumers);
        float acc_dq[kNQ];
        issue_dq(acc_dq, sdS0 + ((n_iters - 1) % Tile::kDSBufs) * Tile::kDSBytes, wg);
        wgmma_wait<0>();
        fence_regs(acc_dq);
        const int b = n_iters - 1;
        emit_dq(acc_dq, b, head_kv * G + b / per_head, (m_first + b % per_head) * BLOCK_M, t_o);
      }
    }
    // The dropped S^T after the last block (OPTS "o") still writes acc_s_ahead.
    if constexpr (Tile::kOverlapS) {
      wgmma_wait<0>();
      fence_regs(acc_s_ahead);
    }
    // The staging rows must stay valid until the copy engine has read them.
    if constexpr (DQ_MODE == kDqBulk) bulk_wait_all();

    // ---- epilogue: dK = scale * acc, dV (zeros when no query sees the block) ----
    const float scale = p.softmax_scale;
    const int cols = p.d_cols > 0 ? p.d_cols : HEAD_DIM;  // D = 96 as 128: the first 96
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int key = n0 + wg * 64 + r0 + 8 * h;
      if (key < Sk) {
        char* dk_row = (char*)p.dk + 2 * (batch * p.dk_batch_stride + head_kv * p.dk_head_stride + key * p.dk_row_stride);
        char* dv_row = (char*)p.dv + 2 * (batch * p.dv_batch_stride + head_kv * p.dv_head_stride + key * p.dv_row_stride);
#pragma unroll
        for (int j = 0; j < HEAD_DIM / 8; ++j) {
          const int col = 8 * j + c0;
          if (8 * j >= cols) continue;  // (cols is a multiple of 8: whole j)
          st_global_u32(dk_row + 2 * col, pack2<Elem>(acc_dk[4 * j + 2 * h] * scale, acc_dk[4 * j + 2 * h + 1] * scale));
          st_global_u32(dv_row + 2 * col, pack2<Elem>(acc_dv[4 * j + 2 * h], acc_dv[4 * j + 2 * h + 1]));
        }
      }
    }
  }
}

}  // namespace opfuse_attn
