// opfuse attention forward for Hopper (sm_90a): wgmma, TMA, warp specialisation.
//
// Compiled at run time by NVRTC for sm_90a (wgmma and setmaxnreg exist only
// there). It includes NO header: every device helper is inline PTX, in
// attention_ptx.cu and attention_sm90_ptx.cu (TMA, mbarriers, wgmma), which
// the launchers prepend with attention_fwd_sm90_schedule.cu (which tiles a
// CTA runs). Same semantics as attention_fwd.cu:
//
//   O[b, h, i, :] = softmax_j(scale * Q[b, h, i, :] . K[b, h / G, j, :]) V[b, h / G, j, :]
//   LSE[b, h, i]  = log sum_j exp(scale * Q[b, h, i, :] . K[b, h / G, j, :])   (natural log, float32)
//
// G = Hq / Hkv (GQA / MQA); causal masks align bottom-right (query i sees key
// j iff j <= i + Sk - Sq); rows that see no key give O = 0 and LSE = -inf.
// The CPU reference is attention_reference.{h,cpp}; docs/attention.md has the
// design notes and the measurements.
//
// Design (one CTA = BLOCK_M = 64 * NUM_CONSUMERS query rows of one (batch, head)):
// - warpgroup 0 is the producer: after giving registers away (setmaxnreg.dec)
//   one thread issues TMA tile loads (cp.async.bulk.tensor) of Q once and of
//   K and V per key block into a STAGES-deep ring; each load completes on a
//   "full" mbarrier with an expected transaction count, and a slot is reused
//   only after every consumer warp has arrived on its "empty" mbarrier;
// - warpgroups 1..NUM_CONSUMERS are consumers (setmaxnreg.inc), each owning 64
//   query rows: S = Q K^T with wgmma (both operands from shared memory through
//   128-byte-swizzled matrix descriptors), online softmax in registers, and
//   O += P V with wgmma (P from registers as the A operand, V from shared
//   memory as an N-major, "transposed" B operand; allowed for 16-bit types);
// - within a consumer, the products of one key block are issued together:
//   S(j) = Q K(j)^T and O += P(j-1) V(j-1); the softmax of S(j) then runs while
//   the tensor cores still work on P(j-1) V(j-1) (wait_group 1, then 0 before O
//   is rescaled);
// - with PINGPONG, consumers take turns issuing their products (named
//   barriers, round robin), so one warpgroup's softmax overlaps another's
//   matrix products;
// - TMA zero-fills rows past Sq / Sk (the tensor maps bound every head), so the
//   kernel needs no bounds checks on loads; the ragged end of Sk and the causal
//   diagonal are masked in registers, key blocks are visited from the last to
//   the first so that only the first ones carry the mask.
//
// Entry point: attention_fwd_sm90<Elem, HEAD_DIM, IS_CAUSAL, BLOCK_N,
// NUM_CONSUMERS, STAGES, PINGPONG, Mask>, e.g. through the NVRTC name expression
//   "opfuse_attn::attention_fwd_sm90<opfuse_attn::bf16, 128, false, 128, 2, 2, true>"
// (Mask, attention_ptx.cu's attn_mask policy, defaults to MaskNone; with one
// the consumers add it to S before the causal / ragged-end masking, reading
// it from global memory, as attention_fwd.cu).
// Launch: grid (G, 1, 1) (persistent: G = min(tiles, SMs); any G >= 1 is
// correct), block (NUM_CONSUMERS + 1) * 128 threads, dynamic shared memory
// Sm90Tile<...>::kSmemBytes (raise CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
// first), five arguments: AttnFwdParams by value (the struct of
// attention_ptx.cu), the tensor maps of Q, K and V (CUtensorMap, 128 bytes
// each, by value) and AttnSplitWs (the split tail's workspace, or nulls). Each tensor map is
// 4-D over (D, S, H, B) with the tensor's byte strides, bf16 / f16, box
// (64, rows, 1, 1) with rows = BLOCK_M for Q and BLOCK_N for K and V,
// CU_TENSOR_MAP_SWIZZLE_128B, zero OOB fill (docs/attention.md, "Hopper").

namespace opfuse_attn {

// u32, i64, the element tags and AttnFwdParams come from attention_ptx.cu,
// u64 and the TMA / mbarrier / wgmma helpers from attention_sm90_ptx.cu.

// S = Q K^T with BLOCK_N = 176 keys (D = 128 non-causal variant): the
// m64n176k16 operand list (88 accumulators), here rather than in
// attention_sm90_ptx.cu because only this kernel uses it. P V keeps N = D.
template <>
__device__ __forceinline__ void wgmma_ss<bf16, 176>(float (&d)[88], u64 da, u64 db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %90, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n176k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87}, %88, %89, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87])
      : "l"(da), "l"(db), "r"(scale_d));
}

template <>
__device__ __forceinline__ void wgmma_ss<f16, 176>(float (&d)[88], u64 da, u64 db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %90, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n176k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87}, %88, %89, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87])
      : "l"(da), "l"(db), "r"(scale_d));
}

// P V with N = D = 256 (the D = 256 tiles): the m64n256k16 operand list (128
// accumulators), here for the same reason as the 176-key S above.
template <>
__device__ __forceinline__ void wgmma_rs_tb<bf16, 256>(float (&d)[128], const u32 (&a)[4], u64 db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
}

template <>
__device__ __forceinline__ void wgmma_rs_tb<f16, 256>(float (&d)[128], const u32 (&a)[4], u64 db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
}

// P V with N = D = 96 (the D = 96 tiles): the m64n96k16 operand list (48
// accumulators). V's rows are stored 128 columns wide (two 64-column swizzle
// atoms, the second half zero-filled by TMA); N = 96 reads the first one and
// a half.
template <>
__device__ __forceinline__ void wgmma_rs_tb<bf16, 96>(float (&d)[48], const u32 (&a)[4], u64 db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %53, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, {%48, %49, %50, %51}, %52, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
}

template <>
__device__ __forceinline__ void wgmma_rs_tb<f16, 96>(float (&d)[48], const u32 (&a)[4], u64 db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %53, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n96k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, {%48, %49, %50, %51}, %52, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
}

// ---------------------------------------------------------------------------
// Tile geometry (the launchers mirror kSmemBytes: docs/attention.md, "Hopper")
// ---------------------------------------------------------------------------

template <int HEAD_DIM, int BLOCK_N, int NUM_CONSUMERS, int STAGES>
struct Sm90Tile {
  static constexpr int kBlockM = 64 * NUM_CONSUMERS;
  static constexpr int kThreads = (NUM_CONSUMERS + 1) * 128;
  // Columns a row takes in shared memory: whole 64-column (128-byte) swizzle
  // atoms, so D = 96 is stored as 128 (TMA zero-fills the last 32; the
  // products read only the first 96).
  static constexpr int kStoredDim = (HEAD_DIM + 63) / 64 * 64;
  static constexpr int kChunks64 = kStoredDim / 64;  // 128-byte column chunks of a row
  static constexpr int kQBytes = kBlockM * kStoredDim * 2;
  static constexpr int kKVBytes = BLOCK_N * kStoredDim * 2;  // one K or one V tile
  // mbarriers (Q full / empty x 2, K and V full / empty a stage), then 32
  // bytes for the causal split's schedule (causal_tail_schedule)
  static constexpr int kBarBytes = 8 * (4 + 4 * STAGES) + 32;
  static constexpr int kOffTailSched = 8 * (4 + 4 * STAGES);  // from kOffBar
  static constexpr int kLimit = 227 * 1024;
  // Two Q buffers when they fit: the next tile's Q then loads while this
  // tile's O is staged through (and stored from) its own Q buffer.
  static constexpr int kQBufs = 2 * kQBytes + 2 * STAGES * kKVBytes + kBarBytes + 1024 <= kLimit ? 2 : 1;
  // smem (from a 1024-byte aligned base): Q[kQBufs] | K[STAGES] | V[STAGES] | barriers
  static constexpr int kOffK = kQBufs * kQBytes;
  static constexpr int kOffV = kOffK + STAGES * kKVBytes;
  static constexpr int kOffBar = kOffV + STAGES * kKVBytes;
  // + 1024 so that the base can be aligned up by hand
  static constexpr int kSmemBytes = kOffBar + kBarBytes + 1024;
  // Registers per thread after setmaxnreg: the producer keeps the minimum,
  // the consumers share the rest of the 64K-register file (multiples of 8).
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs =
      ((65536 / 128 - kProducerRegs) / NUM_CONSUMERS) / 8 * 8 > 240 ? 240
                                                                     : ((65536 / 128 - kProducerRegs) / NUM_CONSUMERS) / 8 * 8;

  static_assert(HEAD_DIM == 64 || HEAD_DIM == 96 || HEAD_DIM == 128 || HEAD_DIM == 256,
                "the sm_90 kernel covers head dims 64, 96, 128 and 256");
  // D = 256: 128 O accumulators a thread; with 64-key blocks (32 S floats and
  // 16 P registers) two consumers fit their 240 registers.
  static_assert(HEAD_DIM != 256 || (BLOCK_N == 64 && NUM_CONSUMERS <= 2), "D = 256: 64-key blocks, at most two consumers");
  // 176 (11 k steps of P V): fewer, longer key blocks for D = 128 (one Q
  // buffer then: 2 x 176 x 128 x 2 x 2 + 2 x 32 KB is past the limit).
  static_assert(BLOCK_N == 64 || BLOCK_N == 128 || BLOCK_N == 176, "BLOCK_N must be 64, 128 or 176");
  static_assert(BLOCK_N != 176 || HEAD_DIM == 128, "BLOCK_N = 176 only at D = 128");
  static_assert(NUM_CONSUMERS >= 1 && NUM_CONSUMERS <= 3, "1 to 3 consumer warpgroups");
  static_assert(STAGES >= 2 && STAGES <= 8, "2 to 8 K/V stages");
  static_assert(kSmemBytes <= kLimit, "tile does not fit in shared memory");
};

// The tiles each CTA runs (TileWork, cta_tile, cta_split_tile,
// cta_causal_split_tile) are in attention_fwd_sm90_schedule.cu, which the
// launchers put ahead of this file.

// Where a CTA's partials of a cut tile go (kOptSplit; null otherwise): CTA
// i's slot partial + i * 128 * NUM_CONSUMERS * (HEAD_DIM / 2 + 4) floats
// (each consumer thread's O accumulators, row maxima and row sums, in pairs,
// thread-fastest), and flags[i * NUM_CONSUMERS + consumer], zero at launch,
// set to 1 once that consumer's partials are out.
struct AttnSplitWs {
  float* partial;
  u32* flags;
};

__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
__device__ __forceinline__ void st_release_gpu_u32(u32* dst, u32 v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(dst), "r"(v) : "memory");
}
__device__ __forceinline__ u32 ld_acquire_gpu_u32(const u32* src) {
  u32 v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(src) : "memory");
  return v;
}

// OPTS bits of attention_fwd_sm90 (tag letters "o" and "k"; docs/attention.md, "Hopper").
// kOptOverlap: a consumer issues the next tile's first S = Q K^T right after
// this tile's last P V, outside its ping-pong turn, so the epilogue (normalise,
// LSE, stage and store O) runs while the tensor cores work on it; needs two Q
// buffers (ignored with one).
// kOptSkip: a consumer issues no product for the key blocks none of its own
// 64 rows see: the top key block of a causal tile above its rows' diagonal
// (192-row tiles: up to two of three consumers), and every block for rows
// past Sq (the last tile when BLOCK_M does not divide Sq). It still waits,
// takes its turns and releases the slots, so the protocol is unchanged.
// kOptPairs: causal tiles handed out in pairs of one head (cta_tile).
constexpr int kOptOverlap = 1;
constexpr int kOptSkip = 2;
constexpr int kOptPairs = 4;
// kOptDesc (tag letter "d"): the matrix descriptors of one product are its
// first one plus constant offsets in the start-address field (desc_plus), so
// each wgmma after the first needs one add instead of the mask / shift / or
// chain of make_desc (about 12 instructions between two HGMMAs in the SASS
// of the default tile).
constexpr int kOptDesc = 8;
// kOptSplit (tag letter "w", no attn_mask): the last rounds' tiles cut over
// the CTAs by key blocks (cta_split_tile; causal: with kOptPairs, the pairs
// schedule's tail, cta_causal_split_tile); the kernel's fifth argument
// (AttnSplitWs) carries the partials and flags.
constexpr int kOptSplit = 16;
// kOptShift (tag letter "b", causal, no attn_mask, no skip): query blocks
// aligned to end at Sq (row_shift_of), the ragged block first. At
// Sq = 2048 with 192-row tiles (10.67 blocks) the third consumer's rows of the
// last, 16-key-block tile were past Sq: 5% of the key-block iterations.
constexpr int kOptShift = 32;
// kOptStoreO (tag letter "t"; two consumers, not with kOptOverlap): a
// consumer's O rows, staged in its Q rows as before, leave through one TMA
// store per 64-column chunk (the kernel's sixth argument, a map over O with
// 64-row boxes) issued by one thread, instead of every thread's 16-byte
// copies; the map clips rows past Sq. Rows that start before 0 (the causal
// shift's first block) take the copies: such a store trapped. The
// consumer's warps 1-3 free the Q buffer at once; warp 0, whose first lane
// issued the store, frees it after the next tile's first S (by then the
// store has long read it; waiting here would hold the warpgroup's next
// products), or, with one Q buffer, before the next tile's Q wait.
// 0.5-4.3% slower than without at D = 128 (H200, session 25): a variant.
constexpr int kOptStoreO = 64;

// Descriptor `d` with its start address moved by `bytes` (a multiple of 16).
// Exact: every shared-memory address of the CTA is below 2^18 (the 14-bit
// field holds address >> 4), so the sum cannot carry into the next field.
__device__ __forceinline__ u64 desc_plus(u64 d, u32 bytes) {
  const u32 lo = (u32)d + (bytes >> 4);
  return ((d >> 32) << 32) | lo;
}

// ---------------------------------------------------------------------------
// The kernel
// ---------------------------------------------------------------------------

// Persistent: with G = gridDim.x CTAs, round k hands tiles [k G, k G + G) out,
// CTA i taking k G + i in even rounds and k G + G - 1 - i in odd ones (the
// snake evens out the decreasing work of causal tiles), so a grid of one CTA
// per SM overlaps one tile's epilogue with the next tile's loads. Any grid
// size is correct; with one CTA per tile it is the plain launch.
template <typename Elem, int HEAD_DIM, bool IS_CAUSAL, int BLOCK_N, int NUM_CONSUMERS, int STAGES, bool PINGPONG,
          typename Mask = MaskNone, int OPTS = 0>
__global__ void __launch_bounds__((NUM_CONSUMERS + 1) * 128, 1)
    attention_fwd_sm90(const AttnFwdParams p, const __grid_constant__ TmaDesc tm_q, const __grid_constant__ TmaDesc tm_k,
                       const __grid_constant__ TmaDesc tm_v, const AttnSplitWs ws,
                       const __grid_constant__ TmaDesc tm_o) {
  using Tile = Sm90Tile<HEAD_DIM, BLOCK_N, NUM_CONSUMERS, STAGES>;
  constexpr int BLOCK_M = Tile::kBlockM;
  constexpr int kChunks64 = Tile::kChunks64;
  constexpr int kQBufs = Tile::kQBufs;
  constexpr int kNS = BLOCK_N / 2;   // S accumulator floats per thread
  constexpr int kNO = HEAD_DIM / 2;  // O accumulator floats per thread

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // TMA with the 128-byte swizzle and the wgmma descriptors (base offset 0)
  // need 1024-byte aligned tiles; the dynamic base is aligned up by hand.
  const u32 smem = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const u32 sQ0 = smem;
  const u32 sK0 = smem + Tile::kOffK;
  const u32 sV0 = smem + Tile::kOffV;
  const u32 bar_q_full = smem + Tile::kOffBar;  // [2]
  const u32 bar_q_empty = bar_q_full + 16;      // [2]
  const u32 bar_full_k = bar_q_empty + 16;      // [STAGES] each
  const u32 bar_full_v = bar_full_k + 8 * STAGES;
  const u32 bar_empty_k = bar_full_v + 8 * STAGES;
  const u32 bar_empty_v = bar_empty_k + 8 * STAGES;

  const int tid = threadIdx.x;
  const int warpgroup = tid / 128;
  const int Sq = p.seqlen_q;
  const int Sk = p.seqlen_k;
  const int num_m = (Sq + BLOCK_M - 1) / BLOCK_M;
  constexpr bool kPairs = (OPTS & kOptPairs) != 0;
  // (Always at D = 256: with the split tail and make_desc's chains, a tile
  // without "d" spilled 56 bytes there.)
  constexpr bool kDescAdd = (OPTS & kOptDesc) != 0 || HEAD_DIM == 256;
  constexpr bool kSplit = (OPTS & kOptSplit) != 0;
  constexpr bool kShift = (OPTS & kOptShift) != 0;
  constexpr bool kStoreO = (OPTS & kOptStoreO) != 0;
  // (Three consumers spilled 168-228 bytes with the store beside the copies.)
  static_assert(!kStoreO || ((OPTS & kOptOverlap) == 0 && NUM_CONSUMERS == 2),
                "kOptStoreO: two consumers, not with kOptOverlap");
  static_assert(!kShift || (IS_CAUSAL && Mask::kMode == 0 && (OPTS & kOptSkip) == 0),
                "kOptShift: causal, no attn_mask, no skip");
  static_assert(!kSplit || (Mask::kMode == 0 && (OPTS & (kOptOverlap | kOptSkip)) == 0 && kPairs == IS_CAUSAL),
                "kOptSplit: no attn_mask, no overlap / skip; causal with pairs, non-causal without");
  // The causal split's schedule (causal_tail_schedule), after the mbarriers.
  int* const tail_sched = reinterpret_cast<int*>(smem_raw + (smem - smem_u32(smem_raw)) + Tile::kOffBar +
                                                  Tile::kOffTailSched);
  // This CTA's slot k: the split schedules or the rounds (cta_tile).
  auto next_tile = [&](int k, TileWork& w) -> int {
    if constexpr (kSplit && IS_CAUSAL) return cta_causal_split_tile<BLOCK_M, BLOCK_N>(p, num_m, k, tail_sched, w);
    if constexpr (kSplit && !IS_CAUSAL) return cta_split_tile<BLOCK_M, BLOCK_N>(p, num_m, k, w);
    return cta_tile<IS_CAUSAL, BLOCK_M, BLOCK_N, kPairs, kShift>(p, num_m, k, w);
  };

  if (tid == 0) {
    for (int b = 0; b < 2; ++b) {
      mbar_init(bar_q_full + 8 * b, 1);
      mbar_init(bar_q_empty + 8 * b, 4 * NUM_CONSUMERS);
    }
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(bar_full_k + 8 * s, 1);
      mbar_init(bar_full_v + 8 * s, 1);
      // one arrival per consumer warp
      mbar_init(bar_empty_k + 8 * s, 4 * NUM_CONSUMERS);
      mbar_init(bar_empty_v + 8 * s, 4 * NUM_CONSUMERS);
    }
    fence_mbar_init();
  }
  if constexpr (kSplit && IS_CAUSAL) {
    // (another warp than the barriers' thread: the two run side by side)
    if (tid == 32) causal_tail_schedule<BLOCK_M, BLOCK_N, kShift>(p, num_m, tail_sched);
  }
  __syncthreads();

  if (warpgroup == 0) {
    // ------------------------------ producer ------------------------------
    setmaxnreg_dec<Tile::kProducerRegs>();
    if (tid == 0) {
      prefetch_tma_desc(&tm_q);
      prefetch_tma_desc(&tm_k);
      prefetch_tma_desc(&tm_v);
      int q_count = 0, kv_count = 0;
      for (int k = 0;; ++k) {
        TileWork w;
        const int slot = next_tile(k, w);
        if (slot < 0) break;
        if (slot == 0) continue;
        if (w.n_blocks == 0) continue;  // the consumers write 0 / -inf
        const int qb = q_count % kQBufs;
        mbar_wait(bar_q_empty + 8 * qb, ((q_count / kQBufs) & 1) ^ 1);
        ++q_count;
        mbar_arrive_expect_tx(bar_q_full + 8 * qb, Tile::kQBytes);
        const u32 sQ = sQ0 + qb * Tile::kQBytes;
#pragma unroll
        for (int c = 0; c < kChunks64; ++c)
          tma_load_4d(sQ + c * BLOCK_M * 128, &tm_q, c * 64, w.m_start, w.head, w.batch, bar_q_full + 8 * qb);
        for (int it = 0; it < w.n_blocks - w.n_low; ++it, ++kv_count) {
          const int n = w.n_blocks - 1 - it;
          const int s = kv_count % STAGES;
          const u32 parity = ((kv_count / STAGES) & 1) ^ 1;
          const u32 sK = sK0 + s * Tile::kKVBytes, sV = sV0 + s * Tile::kKVBytes;
          mbar_wait(bar_empty_k + 8 * s, parity);
          mbar_arrive_expect_tx(bar_full_k + 8 * s, Tile::kKVBytes);
#pragma unroll
          for (int c = 0; c < kChunks64; ++c)
            tma_load_4d(sK + c * BLOCK_N * 128, &tm_k, c * 64, n * BLOCK_N, w.head_kv, w.batch, bar_full_k + 8 * s);
          mbar_wait(bar_empty_v + 8 * s, parity);
          mbar_arrive_expect_tx(bar_full_v + 8 * s, Tile::kKVBytes);
#pragma unroll
          for (int c = 0; c < kChunks64; ++c)
            tma_load_4d(sV + c * BLOCK_N * 128, &tm_v, c * 64, n * BLOCK_N, w.head_kv, w.batch, bar_full_v + 8 * s);
        }
      }
    }
  } else {
    // ------------------------------ consumers -----------------------------
    setmaxnreg_inc<Tile::kConsumerRegs>();
    const int wg = warpgroup - 1;  // this consumer's 64 rows: wg * 64 ...
    const int lane = tid & 31;
    const int warp_in_wg = (tid / 32) & 3;
    const bool lane0 = lane == 0;
    // Row of accumulator half h within the tile: row_in_tile0 + 8 h.
    const int row_in_tile0 = wg * 64 + warp_in_wg * 16 + (lane >> 2);
    const float scale_log2 = p.scale_log2;
    constexpr int kMaskMode = Mask::kMode;
    // The scale the softmax applies: 1 when the attn_mask step has applied it.
    const float sl2 = kMaskMode ? 1.f : scale_log2;

    // Round-robin turns for the products (PINGPONG): consumer c waits on
    // barrier 1 + c and, once its products are issued, lets consumer c + 1 go.
    constexpr int kPairThreads = 256;
    auto turn_wait = [&]() {
      if constexpr (PINGPONG && NUM_CONSUMERS > 1) named_bar_sync(1 + wg, kPairThreads);
    };
    auto turn_pass = [&]() {
      if constexpr (PINGPONG && NUM_CONSUMERS > 1) named_bar_arrive(1 + (wg + 1) % NUM_CONSUMERS, kPairThreads);
    };
    auto release = [&](u32 bar) {
      syncwarp();
      if (lane0) mbar_arrive(bar);
    };

    float acc_s[kNS];
    float acc_o[kNO];
    u32 p_frag[BLOCK_N / 16][4];
    float row_max[2], row_sum[2];  // running max (log2 units); this thread's part of the row sums
    float corr[2];
    bool grow_any;

    // Consumer 0 takes the first turn; the last consumer's final pass is
    // matched by consumer 0's extra wait after the loop.
    if (PINGPONG && NUM_CONSUMERS > 1 && wg == NUM_CONSUMERS - 1) named_bar_arrive(1, kPairThreads);

    // kOptOverlap needs the next tile's Q in its own buffer.
    constexpr bool kOverlap = (OPTS & kOptOverlap) != 0 && kQBufs == 2;
    // Key blocks this consumer skips at the start of tile w (kOptSkip): the
    // tile's blocks minus those its own rows see (rows past Sq see none).
    auto consumer_skip = [&](const TileWork& tw) -> int {
      if constexpr ((OPTS & kOptSkip) == 0) {
        return 0;
      } else {
        const int r0 = tw.m_start + wg * 64;
        if (r0 >= Sq) return tw.n_blocks;
        int key_end = Sk;
        if (IS_CAUSAL) {
          const int r_last = (r0 + 63 < Sq) ? r0 + 63 : Sq - 1;
          key_end = (r_last + 1 + Sk - Sq < Sk) ? r_last + 1 + Sk - Sq : Sk;
        }
        const int seen = key_end > 0 ? (key_end + BLOCK_N - 1) / BLOCK_N : 0;
        return tw.n_blocks - seen;
      }
    };

    int q_count = 0, kv_count = 0;
    // kOptStoreO: warp 0 of a consumer frees a tile's Q buffer only once the
    // next tile with keys (q_count on) is under way (no state to keep: every
    // tile with keys owes it, the split's written pieces included), after its
    // first lane's stores have read the buffer.
    auto free_q_of = [&](int count) {
      if (tid_opaque() % 128 == 0) bulk_wait_read_all();
      release(bar_q_empty + 8 * (count % kQBufs));
    };
    auto free_q_now = [&](int qbuf) {  // the other warps (all warps without kOptStoreO)
      if (!kStoreO || ((tid_opaque() / 32) & 3) != 0) release(bar_q_empty + 8 * qbuf);
    };
    // pre: the first S of this tile went out with the previous tile's last
    // P V (kOverlap; the same for every consumer, so turns stay matched).
    bool pre = false;
    for (int k = 0;; ++k) {
      TileWork w;
      const int slot = next_tile(k, w);
      if (slot < 0) break;
      if (slot == 0) continue;
      // The next S issued before the epilogue completes here at the latest:
      // on every path, so that ptxas sees no product in flight across tiles.
      if constexpr (kOverlap) wgmma_wait<0>();
      char* o_base = (char*)p.o + 2 * (w.batch * p.o_batch_stride + w.head * p.o_head_stride);
      const i64 o_rs = 2 * p.o_row_stride;
      float* lse_base = p.lse ? p.lse + w.batch * p.lse_batch_stride + w.head * p.lse_head_stride : nullptr;
      constexpr int kChunks = HEAD_DIM / 8;  // 16-byte chunks per row
      const int tw = tid - 128 * warpgroup;  // thread in this consumer

      if (w.n_blocks == 0) {
        // No row of the tile sees a key: O = 0, LSE = -inf (this consumer's rows).
#pragma unroll 1
        for (int c = tw; c < 64 * kChunks; c += 128) {
          const int row = w.m_start + wg * 64 + c / kChunks;
          if (row >= 0 && row < Sq) store_zero16_global(o_base + row * o_rs + (c % kChunks) * 16);
        }
        if (lse_base && tw < 64 && w.m_start + wg * 64 + tw >= 0 && w.m_start + wg * 64 + tw < Sq)
          store_f32_global(lse_base + w.m_start + wg * 64 + tw, neg_inf());
        continue;
      }

      const int qb = q_count % kQBufs;
      const u32 sQ = sQ0 + qb * Tile::kQBytes;
      // One Q buffer: the previous tile's must be free before this tile's load.
      if (kStoreO && kQBufs == 1 && q_count > 0 && ((tid_opaque() / 32) & 3) == 0) free_q_of(q_count - 1);
      // (Already waited for when pre: a completed phase waits no further, and
      // the buffer cannot be refilled before this tile releases it.)
      mbar_wait(bar_q_full + 8 * qb, (q_count / kQBufs) & 1);
      ++q_count;

      // Descriptors. Q rows of this consumer: chunk c of the Q tile at
      // sQ + c * BLOCK_M * 128, rows wg * 64 .. + 63 (8 KB, 1024-aligned).
      auto q_desc = [&](u32 sQb, int ks) {
        if constexpr (kDescAdd)
          return desc_plus(make_desc(sQb + wg * 64 * 128, 16, 1024), (ks / 4) * BLOCK_M * 128 + (ks % 4) * 32);
        return make_desc(sQb + (ks / 4) * BLOCK_M * 128 + wg * 64 * 128 + (ks % 4) * 32, 16, 1024);
      };
      auto k_desc = [&](u32 sK, int ks) {
        if constexpr (kDescAdd) return desc_plus(make_desc(sK, 16, 1024), (ks / 4) * BLOCK_N * 128 + (ks % 4) * 32);
        return make_desc(sK + (ks / 4) * BLOCK_N * 128 + (ks % 4) * 32, 16, 1024);
      };
      auto v_desc = [&](u32 sV, int kk) {
        if constexpr (kDescAdd) return desc_plus(make_desc(sV, BLOCK_N * 128, 1024), kk * 16 * 128);
        return make_desc(sV + kk * 16 * 128, BLOCK_N * 128, 1024);
      };
      auto issue_s_from = [&](u32 sQb, u32 sK) {
#pragma unroll
        for (int ks = 0; ks < HEAD_DIM / 16; ++ks)
          wgmma_ss<Elem, BLOCK_N>(acc_s, q_desc(sQb, ks), k_desc(sK, ks), ks > 0);
        wgmma_commit();
      };
      auto issue_s = [&](u32 sK) { issue_s_from(sQ, sK); };
      auto issue_pv = [&](u32 sV) {
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) wgmma_rs_tb<Elem, HEAD_DIM>(acc_o, p_frag[kk], v_desc(sV, kk), 1);
        wgmma_commit();
      };

      // Mask of key block n: the ragged end of Sk and, when causal, keys past
      // the diagonal of each row.
      auto apply_mask = [&](int n) {
        const int col0 = n * BLOCK_N + 2 * (lane & 3);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = w.m_start + row_in_tile0 + 8 * h;
          int col_end = Sk;
          if (IS_CAUSAL) col_end = (row + Sk - Sq + 1 < Sk) ? row + Sk - Sq + 1 : Sk;
#pragma unroll
          for (int j = 0; j < BLOCK_N / 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e)
              if (col0 + 8 * j + e >= col_end) acc_s[4 * j + 2 * h + e] = neg_inf();
        }
      };

      // attn_mask of key block n (attention_ptx.cu): S becomes S * scale *
      // log2(e) + mask * log2(e), read straight from global memory (a quad of
      // lanes reads 8 adjacent keys of a row; key padding: one value per
      // key, the same for every row). `ragged`: keys past Sk are not read
      // (apply_mask makes them -inf).
      auto apply_attn_mask = [&](int n, bool ragged) {
        if constexpr (kMaskMode != 0) {
          using MT = typename Mask::Elem;
          const int c0 = n * BLOCK_N + 2 * (lane & 3);
          const char* mbase = (const char*)p.mask + (i64)sizeof(MT) * (w.batch * p.mask_batch_stride +
                                                                        w.head * p.mask_head_stride + c0);
          if constexpr (kMaskMode == 2) {
#pragma unroll
            for (int j = 0; j < BLOCK_N / 8; ++j)
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const bool in = !ragged || c0 + 8 * j + e < Sk;
                const float add = in ? MaskLoad<MT>::l2(mbase + sizeof(MT) * (8 * j + e)) : 0.f;
                acc_s[4 * j + e] = acc_s[4 * j + e] * scale_log2 + add;
                acc_s[4 * j + 2 + e] = acc_s[4 * j + 2 + e] * scale_log2 + add;
              }
          } else {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int row = w.m_start + row_in_tile0 + 8 * h;
              const int r = row < Sq ? row : Sq - 1;  // rows past Sq are never stored
              const char* mrow = mbase + (i64)sizeof(MT) * r * p.mask_row_stride;
#pragma unroll
              for (int j = 0; j < BLOCK_N / 8; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                  const bool in = !ragged || c0 + 8 * j + e < Sk;
                  const float add = in ? MaskLoad<MT>::l2(mrow + sizeof(MT) * (8 * j + e)) : 0.f;
                  acc_s[4 * j + 2 * h + e] = acc_s[4 * j + 2 * h + e] * scale_log2 + add;
                }
            }
          }
        }
      };

      // Online softmax, part 1 (no access to O or P, so it may overlap P V):
      // new row maxima (log2 units) and S -> exp2(S * scale_log2 - max) in
      // place; sets the correction factors of O and updates the row sums.
      auto softmax_exp = [&]() {
        float m_new[2];
        bool grow = false;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float mx = fmax2(acc_s[2 * h], acc_s[2 * h + 1]);
#pragma unroll
          for (int j = 1; j < BLOCK_N / 8; ++j) mx = fmax2(mx, fmax2(acc_s[4 * j + 2 * h], acc_s[4 * j + 2 * h + 1]));
          mx = fmax2(mx, shfl_xor(mx, 1));
          mx = fmax2(mx, shfl_xor(mx, 2));
          m_new[h] = mx * sl2;  // -inf for a row whose keys are all masked
          grow |= m_new[h] > row_max[h];
        }
        // The warp rescales only when one of its rows' max grew (uniform branch).
        grow_any = vote_any(grow);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          corr[h] = 1.f;
          if (grow_any) {
            const float m_ref = fmax2(row_max[h], m_new[h]);
            // -inf == -inf (a row that has seen no key yet) keeps corr = 1.
            corr[h] = (m_ref == row_max[h]) ? 1.f : ex2(row_max[h] - m_ref);
            row_max[h] = m_ref;
          }
          // A row still at -inf has only masked scores: exp2(-inf - 0) = 0.
          const float m_sub = (row_max[h] == neg_inf()) ? 0.f : row_max[h];
          float sum = 0.f;
#pragma unroll
          for (int j = 0; j < BLOCK_N / 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float pv = ex2(acc_s[4 * j + 2 * h + e] * sl2 - m_sub);
              acc_s[4 * j + 2 * h + e] = pv;
              sum += pv;
            }
          row_sum[h] = row_sum[h] * corr[h] + sum;
        }
      };
      // Part 2 (after the previous P V has completed): rescale O, P to 16 bits.
      auto rescale_and_pack = [&]() {
        if (grow_any) {
#pragma unroll
          for (int j = 0; j < HEAD_DIM / 8; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              acc_o[4 * j + 2 * h] *= corr[h];
              acc_o[4 * j + 2 * h + 1] *= corr[h];
            }
        }
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
          p_frag[kk][0] = pack2<Elem>(acc_s[8 * kk + 0], acc_s[8 * kk + 1]);
          p_frag[kk][1] = pack2<Elem>(acc_s[8 * kk + 2], acc_s[8 * kk + 3]);
          p_frag[kk][2] = pack2<Elem>(acc_s[8 * kk + 4], acc_s[8 * kk + 5]);
          p_frag[kk][3] = pack2<Elem>(acc_s[8 * kk + 6], acc_s[8 * kk + 7]);
        }
      };

#pragma unroll
      for (int i = 0; i < kNO; ++i) acc_o[i] = 0.f;
      row_max[0] = row_max[1] = neg_inf();
      row_sum[0] = row_sum[1] = 0.f;
      const int n_blocks = w.n_blocks;
      const int n_iters = n_blocks - w.n_low;  // key blocks visited (all of them unless a cut tile)
      // Key blocks [0, n_skip) of the visiting order issue nothing here
      // (kOptSkip): a block none of this consumer's rows see adds nothing to
      // its rows' sums, maxima or O. Uniform over the warpgroup.
      const int n_skip = consumer_skip(w);
      // The first S of a pre tile is already out (or skipped): no turn for it.
      const bool turn0 = !(kOverlap && pre);

      // A skipped block: the same waits, turn and releases, no product. (A
      // code path of its own: a wgmma under a condition inside the step made
      // ptxas serialise every wgmma of the kernel, C7520.)
      auto skip_step = [&](const int it) {
        const int c = kv_count + it;
        const int s = c % STAGES, sp = (c + STAGES - 1) % STAGES;
        mbar_wait(bar_full_k + 8 * s, (c / STAGES) & 1);
        if (it > 0) mbar_wait(bar_full_v + 8 * sp, ((c - 1) / STAGES) & 1);
        if (it > 0 || turn0) {
          turn_wait();
          turn_pass();
        }
        release(bar_empty_k + 8 * s);
        if (it > 0) release(bar_empty_v + 8 * sp);
      };

      // ---- the first key block this consumer computes: S only ----
      // (the last one of the sequence when nothing is skipped: may be ragged)
      auto first_step = [&](const int it) {
        const int n = n_blocks - 1 - it;
        const int c = kv_count + it;
        const int s = c % STAGES, sp = (c + STAGES - 1) % STAGES;
        mbar_wait(bar_full_k + 8 * s, (c / STAGES) & 1);
        if (it > 0) mbar_wait(bar_full_v + 8 * sp, ((c - 1) / STAGES) & 1);
        if (it > 0 || turn0) {
          turn_wait();
          wgmma_fence();
          issue_s(sK0 + s * Tile::kKVBytes);
          turn_pass();
        }
        wgmma_wait<0>();
        fence_regs(acc_s);
        release(bar_empty_k + 8 * s);
        if (it > 0) release(bar_empty_v + 8 * sp);
        apply_attn_mask(n, true);
        if (n >= w.n_mask_start) apply_mask(n);
        softmax_exp();
        rescale_and_pack();
      };

      // ---- later key blocks: S(it) with P V(it - 1) ----
      auto iteration = [&](const int it, const bool masked) {
        const int n = n_blocks - 1 - it;
        const int c = kv_count + it;
        const int s = c % STAGES, sp = (c - 1) % STAGES;
        mbar_wait(bar_full_k + 8 * s, (c / STAGES) & 1);
        mbar_wait(bar_full_v + 8 * sp, ((c - 1) / STAGES) & 1);
        turn_wait();
        wgmma_fence();
        issue_s(sK0 + s * Tile::kKVBytes);
        issue_pv(sV0 + sp * Tile::kKVBytes);
        turn_pass();
        wgmma_wait<1>();  // S(it) is complete, P V(it - 1) may still run
        fence_regs(acc_s);
        release(bar_empty_k + 8 * s);
        apply_attn_mask(n, masked);
        if (masked) apply_mask(n);
        softmax_exp();
        wgmma_wait<0>();
        fence_regs(acc_o);
        release(bar_empty_v + 8 * sp);
        rescale_and_pack();
      };

      int it = 0;
      if constexpr ((OPTS & kOptSkip) != 0) {
        for (; it < n_skip; ++it) skip_step(it);
        // A consumer that sees no key of the tile still issues the last P V,
        // of zeros, so that the last product is unconditional.
        if (it == n_blocks) {
#pragma unroll
          for (int kk = 0; kk < BLOCK_N / 16; ++kk) p_frag[kk][0] = p_frag[kk][1] = p_frag[kk][2] = p_frag[kk][3] = 0u;
        }
      }
      // (n_blocks >= 1 here; only a skip can use all blocks up. Testing it
      // without one cost 4 bytes of spill in a masked instantiation.)
      if ((OPTS & kOptSkip) == 0 || it < n_blocks) {
        first_step(it);
        if (kStoreO && kQBufs == 2 && q_count > 1 && ((tid_opaque() / 32) & 3) == 0) free_q_of(q_count - 2);
        for (++it; it < n_iters && n_blocks - 1 - it >= w.n_mask_start; ++it) iteration(it, true);
        for (; it < n_iters; ++it) iteration(it, false);
      }

      // The next tile of this CTA (kOverlap): its first S goes out right
      // after this tile's last P V, when it has keys to visit.
      bool pre_next = false, issue_next = false;
      const int next_qb = q_count % kQBufs;
      const u32 next_sK = sK0 + ((kv_count + n_iters) % STAGES) * Tile::kKVBytes;
      if constexpr (kOverlap) {
        TileWork wn;
        if (next_tile(k + 1, wn) > 0) {
          pre_next = wn.n_blocks > 0;
          issue_next = pre_next && consumer_skip(wn) == 0;
        }
      }

      // ---- last P V (and, kOverlap, the next tile's first S, outside the turn) ----
      {
        const int c = kv_count + n_iters - 1;
        const int sp = c % STAGES;
        mbar_wait(bar_full_v + 8 * sp, (c / STAGES) & 1);
        turn_wait();
        wgmma_fence();
        issue_pv(sV0 + sp * Tile::kKVBytes);
        turn_pass();
        if constexpr (kOverlap) {
          if (issue_next) {
            const int cn = kv_count + n_iters;
            mbar_wait(bar_q_full + 8 * next_qb, (q_count / kQBufs) & 1);
            mbar_wait(bar_full_k + 8 * (cn % STAGES), (cn / STAGES) & 1);
          }
          // Issued on every path: with the product under the branch ptxas
          // serialised every wgmma of the kernel (C7520). Without a next
          // tile (or when this consumer skips its first block) the product
          // reads whatever the other Q buffer and that K slot hold (a TMA may
          // be writing them) and its result is dropped: the next tile's first
          // S overwrites acc_s (scale-d 0 on its first k step).
          wgmma_fence();
          issue_s_from(sQ0 + next_qb * Tile::kQBytes, next_sK);
          wgmma_wait<1>();  // P V is complete, the next S may run on
        } else {
          wgmma_wait<0>();
        }
        fence_regs(acc_o);
        release(bar_empty_v + 8 * sp);
      }
      kv_count += n_iters;
      pre = pre_next;

      // ---- epilogue: normalise, LSE, stage O in this consumer's Q rows, store ----
      const int e_tid = tid_opaque();
      const int e_lane = e_tid & 31;
      const int e_row0 = wg * 64 + ((e_tid / 32) & 3) * 16 + (e_lane >> 2);  // row_in_tile0
      const int e_tw = e_tid & 127;

      if constexpr (kSplit) {
        // A cut tile (cta_split_tile): this CTA's partials out, or the other
        // CTA's merged in. Each consumer thread writes and reads its own
        // accumulators (the same thread of the same consumer in both CTAs
        // holds the same rows and columns), pairs of floats thread-fastest.
        constexpr int kCT = 128 * NUM_CONSUMERS;  // consumer threads a CTA
        constexpr int kSlot = kCT * (kNO + 4);    // floats a CTA
        const int ct = e_tid - 128, e_wg = e_tid / 128 - 1, cta = ctaid_opaque();
        if (w.role == kRoleWrite) {
          float* slot = ws.partial + (i64)cta * kSlot;
#pragma unroll
          for (int q = 0; q < kNO / 2; ++q) st_global_f32x2(slot + 2 * (q * kCT + ct), acc_o[2 * q], acc_o[2 * q + 1]);
          st_global_f32x2(slot + 2 * ((kNO / 2) * kCT + ct), row_max[0], row_max[1]);
          st_global_f32x2(slot + 2 * ((kNO / 2 + 1) * kCT + ct), row_sum[0], row_sum[1]);
          fence_acq_rel_gpu();
          named_bar_sync(1 + NUM_CONSUMERS + wg, 128);
          if (e_tw == 0) st_release_gpu_u32(ws.flags + cta * NUM_CONSUMERS + e_wg, 1u);
          free_q_now(qb);
          continue;
        }
        if (w.role == kRoleMerge) {
          const float* slot = ws.partial + (i64)(cta - 1) * kSlot;
          if (e_tw == 0)
            while (ld_acquire_gpu_u32(ws.flags + (cta - 1) * NUM_CONSUMERS + e_wg) == 0u) {
            }
          named_bar_sync(1 + NUM_CONSUMERS + wg, 128);
          fence_acq_rel_gpu();
          float m_b[2], l_b[2], c_a[2], c_b[2];
          ld_global_f32x2(slot + 2 * ((kNO / 2) * kCT + ct), m_b[0], m_b[1]);
          ld_global_f32x2(slot + 2 * ((kNO / 2 + 1) * kCT + ct), l_b[0], l_b[1]);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            // Maxima in log2 units; -inf (no key seen) gives a factor 0, or 1 on both sides.
            const float m = fmax2(row_max[h], m_b[h]);
            c_a[h] = (row_max[h] == m) ? 1.f : ex2(row_max[h] - m);
            c_b[h] = (m_b[h] == m) ? 1.f : ex2(m_b[h] - m);
            row_max[h] = m;
            row_sum[h] = row_sum[h] * c_a[h] + l_b[h] * c_b[h];
          }
#pragma unroll
          for (int q = 0; q < kNO / 2; ++q) {
            float o0, o1;
            ld_global_f32x2(slot + 2 * (q * kCT + ct), o0, o1);
            acc_o[2 * q] = acc_o[2 * q] * c_a[q & 1] + o0 * c_b[q & 1];
            acc_o[2 * q + 1] = acc_o[2 * q + 1] * c_a[q & 1] + o1 * c_b[q & 1];
          }
        }
      }
      float inv_sum[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float s = row_sum[h];
        s += shfl_xor(s, 1);
        s += shfl_xor(s, 2);
        inv_sum[h] = (s > 0.f) ? rcp(s) : 0.f;
        const int row = w.m_start + e_row0 + 8 * h;
        if (lse_base && (e_lane & 3) == 0 && row >= 0 && row < Sq) {
          float lse = (s > 0.f) ? (row_max[h] + lg2(s)) * 0.69314718055994531f : neg_inf();
          if constexpr (kMaskMode != 0)  // only huge mask values give a max of +-FLT_MAX
            if (s > 0.f && is_huge_row_max(row_max[h])) lse = huge_row_lse(row_max[h], lg2(s));
          store_f32_global(lse_base + row, lse);
        }
      }
      // Every warp of this consumer is past its last wgmma on these Q rows.
      named_bar_sync(1 + NUM_CONSUMERS + wg, 128);
      // Same 128-byte swizzle as the TMA wrote Q: 16-byte chunk c of row r sits
      // at chunk c ^ (r % 8), so the 8 rows of a store go to different banks.
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = e_row0 + 8 * h;
#pragma unroll
        for (int j = 0; j < HEAD_DIM / 8; ++j) {
          const int col = 8 * j + 2 * (e_lane & 3);
          const u32 addr = sQ + (col / 64) * BLOCK_M * 128 + r * 128 + ((((col % 64) / 8) ^ (r & 7)) << 4) + (col % 8) * 2;
          st_shared_u32(addr, pack2<Elem>(acc_o[4 * j + 2 * h] * inv_sum[h], acc_o[4 * j + 2 * h + 1] * inv_sum[h]));
        }
      }
      // A TMA store whose box starts before row 0 traps (illegal instruction on
      // the H200, session 25): the causal shift's ragged first block (rows
      // before 0) takes the copies below.
      if (kStoreO && w.m_start + wg * 64 >= 0) {
        fence_proxy_async_smem();  // this thread's staged rows, before the TMA reads them
        named_bar_sync(1 + NUM_CONSUMERS + wg, 128);
        if (e_tw == 0) {
#pragma unroll
          for (int c = 0; c < kChunks64; ++c)
            tma_store_4d(&tm_o, sQ + c * BLOCK_M * 128 + wg * 64 * 128, c * 64, w.m_start + wg * 64, w.head, w.batch);
          bulk_commit();
        }
        free_q_now(qb);
        continue;
      }
      named_bar_sync(1 + NUM_CONSUMERS + wg, 128);
#pragma unroll
      for (int i = 0; i < 64 * kChunks / 128; ++i) {
        const int c = e_tw + i * 128;
        const int r = wg * 64 + c / kChunks, ch = c % kChunks;
        const u32 src = sQ + (ch / 8) * BLOCK_M * 128 + r * 128 + (((ch % 8) ^ (r & 7)) << 4);
        if ((unsigned)(w.m_start + r) < (unsigned)Sq)  // rows before 0 (kOptShift) or past Sq: none
          copy16_shared_to_global(o_base + (w.m_start + r) * o_rs + ch * 16, src);
      }
      // This warp is done with the Q buffer: the producer may load a later
      // tile's Q into it once every consumer warp has said so (kOptStoreO:
      // warp 0 frees it with the next tile, as after a store).
      free_q_now(qb);
    }
    if constexpr (kOverlap) wgmma_wait<0>();  // (nothing is in flight here; for ptxas)
    if constexpr (kStoreO)
      if (tid_opaque() % 128 == 0) bulk_wait_all();  // O written before the CTA (and its shared memory) goes
    if (PINGPONG && NUM_CONSUMERS > 1 && wg == 0) turn_wait();  // matches the last consumer's final pass
  }
}

}  // namespace opfuse_attn
