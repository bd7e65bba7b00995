// opfuse attention: device helpers shared by the NVRTC attention kernels.
//
// Not compiled alone: the launchers (C++ and the tests' ctypes harnesses)
// prepend this text to each kernel source (attention_fwd.cu,
// attention_fwd_sm90.cu, attention_bwd.cu). NVRTC on the target machines
// finds no CUDA headers, so everything below is inline PTX.
// Namespace opfuse_attn, as the kernels.

namespace opfuse_attn {

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;

// Element tags. The kernels never do arithmetic on elements themselves: they
// travel through cp.async / ldmatrix and the tensor cores, and are converted
// to float by ElemOps::to_float2 where a kernel needs their values.
struct bf16 { u16 bits; };
struct f16 { u16 bits; };

__device__ __forceinline__ float neg_inf() {
  float r;
  asm("mov.b32 %0, 0xff800000;" : "=f"(r));
  return r;
}
__device__ __forceinline__ float pos_inf() {
  float r;
  asm("mov.b32 %0, 0x7f800000;" : "=f"(r));
  return r;
}

__device__ __forceinline__ float ex2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ float shfl_xor(float x, int lane_mask) {
  float r;
  asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=f"(r) : "f"(x), "r"(lane_mask));
  return r;
}

// Returns x unchanged, but the compiler cannot see through it (so it cannot
// hoist what is computed from it out of a loop and keep it live).
__device__ __forceinline__ int opaque32(int x) {
  int r;
  asm volatile("mov.b32 %0, %1;" : "=r"(r) : "r"(x));
  return r;
}

__device__ __forceinline__ u32 smem_u32(const void* p) {
  u32 r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}

// 16-byte async copy global -> shared; when !valid the destination is
// zero-filled and nothing is read (src must still be a mapped address).
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// ROWS rows (from row0, every PASS_ROWS-th: this thread's rows of a tile
// loaded in passes) of two [rows, D] 16-bit tensors with the same row bound,
// one 16-byte chunk each, copied asynchronously into two shared tiles of
// SB-byte rows. Rows at or past `bound` are zero-filled (and read row 0,
// which is mapped). `a` and `b` point at this thread's chunk of row 0.
template <int ROWS, int PASS_ROWS, int SB>
__device__ __forceinline__ void cp_async_row_pair(u32 sa, u32 sb, const char* a, i64 a_row_stride, const char* b,
                                                  i64 b_row_stride, int row0, int bound, bool lane_loads) {
#pragma unroll
  for (int i = 0; i < ROWS / PASS_ROWS; ++i) {
    const int row = row0 + i * PASS_ROWS;
    const bool valid = row < bound;
    const int r = valid ? row : 0;
    if (lane_loads) {
      cp_async_16(sa + i * PASS_ROWS * SB, a + 2 * r * a_row_stride, valid);
      cp_async_16(sb + i * PASS_ROWS * SB, b + 2 * r * b_row_stride, valid);
    }
  }
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void st_shared_u32(u32 addr, u32 v) {
  asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ float ld_shared_f32(u32 addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ void st_global_u32(void* dst, u32 v) {
  asm volatile("st.global.u32 [%0], %1;" ::"l"(dst), "r"(v) : "memory");
}
__device__ __forceinline__ u32 ld_global_u32(const void* src) {
  u32 v;
  asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(v) : "l"(src));
  return v;
}
__device__ __forceinline__ void st_global_f32(float* dst, float v) {
  asm volatile("st.global.f32 [%0], %1;" ::"l"(dst), "f"(v) : "memory");
}
__device__ __forceinline__ float ld_global_f32(const float* src) {
  float v;
  asm volatile("ld.global.f32 %0, [%1];" : "=f"(v) : "l"(src));
  return v;
}
__device__ __forceinline__ void st_global_f32x2(float* dst, float a, float b) {
  asm volatile("st.global.v2.f32 [%0], {%1, %2};" ::"l"(dst), "f"(a), "f"(b) : "memory");
}
__device__ __forceinline__ void ld_global_f32x2(const float* src, float& a, float& b) {
  asm volatile("ld.global.v2.f32 {%0, %1}, [%2];" : "=f"(a), "=f"(b) : "l"(src));
}

// dst[0] += a, dst[1] += b without ordering (dst 8-byte aligned). sm_90 has a
// vector reduction (one request for both); sm_80 issues two.
__device__ __forceinline__ void red_add_f32x2(float* dst, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(dst), "f"(a), "f"(b) : "memory");
#else
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(dst), "f"(a) : "memory");
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(dst + 1), "f"(b) : "memory");
#endif
}

// Per-element-type pieces: packing two floats, unpacking two elements, the mma.
template <typename Elem>
struct ElemOps;

template <>
struct ElemOps<bf16> {
  // lo goes to the low half (the lower column index), as the mma expects.
  static __device__ __forceinline__ u32 pack(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
  static __device__ __forceinline__ void unpack(u32 v, float& lo, float& hi) {
    asm("mov.b32 %0, %1;" : "=f"(lo) : "r"(v << 16));
    asm("mov.b32 %0, %1;" : "=f"(hi) : "r"(v & 0xffff0000u));
  }
  static __device__ __forceinline__ void mma(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <>
struct ElemOps<f16> {
  static __device__ __forceinline__ u32 pack(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
  static __device__ __forceinline__ void unpack(u32 v, float& lo, float& hi) {
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }"
        : "=f"(lo), "=f"(hi)
        : "r"(v));
  }
  static __device__ __forceinline__ void mma(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// ldmatrix lane offsets of an m16k16 / k16n16 fragment (rows, columns in elements):
// - "row-major" A (and B via .trans from a [k][n] tile): matrices ordered
//   (rows 0-7, cols 0-7), (rows 8-15, cols 0-7), (rows 0-7, cols 8-15), (rows 8-15, cols 8-15);
// - B from an [n][k] tile (non-trans), and A via .trans from a [k][m] tile:
//   (rows 0-7, cols 0-7), (rows 0-7, cols 8-15), (rows 8-15, cols 0-7), (rows 8-15, cols 8-15).
__device__ __forceinline__ int frag_row_a(int lane) { return (lane & 7) + ((lane >> 3) & 1) * 8; }
__device__ __forceinline__ int frag_col_a(int lane) { return (lane >> 4) * 8; }
__device__ __forceinline__ int frag_row_b(int lane) { return (lane & 7) + (lane >> 4) * 8; }
__device__ __forceinline__ int frag_col_b(int lane) { return ((lane >> 3) & 1) * 8; }

// Used by the forward kernels (mma.sync and Hopper).
__device__ __forceinline__ float lg2(float x) {
  float r;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ float rcp(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ float fmax2(float a, float b) {
  float r;
  asm("max.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ bool vote_any(bool x) {
  u32 r;
  asm volatile("{ .reg .pred p, q; setp.ne.u32 p, %1, 0; vote.sync.any.pred q, p, 0xffffffff; selp.u32 %0, 1, 0, q; }"
               : "=r"(r)
               : "r"((u32)x));
  return r != 0;
}
__device__ __forceinline__ void syncwarp() { asm volatile("bar.warp.sync 0xffffffff;" ::: "memory"); }
__device__ __forceinline__ void copy16_shared_to_global(void* dst, u32 src) {
  u32 a, b, c, d;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "r"(src) : "memory");
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}
__device__ __forceinline__ void store_zero16_global(void* dst) {
  asm volatile("st.global.v4.u32 [%0], {%1, %1, %1, %1};" ::"l"(dst), "r"(0u) : "memory");
}
__device__ __forceinline__ void store_f32_global(float* dst, float v) {
  asm volatile("st.global.f32 [%0], %1;" ::"l"(dst), "f"(v) : "memory");
}

// The argument of both forward kernels (attention_fwd.cu and
// attention_fwd_sm90.cu; the Hopper one does not see attention_fwd.cu, so it
// lives here). The layout is part of the launch ABI (mirrored by the Python
// harness with ctypes and by the C++ runtime): only append fields.
struct AttnFwdParams {
  const void* q;  // [B, Hq, Sq, D]
  const void* k;  // [B, Hkv, Sk, D]
  const void* v;  // [B, Hkv, Sk, D]
  void* o;        // [B, Hq, Sq, D], same dtype as q
  float* lse;     // [B, Hq, Sq] float32, or null to skip
  // strides in elements; the last dim of q, k, v, o is contiguous
  i64 q_batch_stride, q_head_stride, q_row_stride;
  i64 k_batch_stride, k_head_stride, k_row_stride;
  i64 v_batch_stride, v_head_stride, v_row_stride;
  i64 o_batch_stride, o_head_stride, o_row_stride;
  i64 lse_batch_stride, lse_head_stride;
  int batch, heads_q, heads_kv, q_per_kv;  // q_per_kv = heads_q / heads_kv
  int seqlen_q, seqlen_k;
  float softmax_scale;  // > 0
  float scale_log2;     // softmax_scale * log2(e)
  // attn_mask (null unless the Mask template argument says there is one):
  // element strides over the broadcast [B, Hq, Sq, Sk] (0 on broadcast dims);
  // the key stride must be 1 (the launchers make it so).
  const void* mask;
  i64 mask_batch_stride, mask_head_stride, mask_row_stride, mask_col_stride;
};
static_assert(sizeof(AttnFwdParams) == 224, "AttnFwdParams layout is a launch ABI");

// ---------------------------------------------------------------------------
// attn_mask: the kernels' last template argument (Mask) says whether there is
// one, how it is laid out and its element type. Its values are read from
// global memory through AttnFwdParams / AttnBwdParams::mask with element
// strides over [B, Hq, Sq, Sk] (0 on broadcast dims; the key stride is 1).
// ---------------------------------------------------------------------------

struct bool8 { unsigned char bits; };  // torch.bool: one byte, 0 or 1 (True = attend)

struct MaskNone {  // no attn_mask (the default: existing name expressions are unchanged)
  static constexpr int kMode = 0;
};
// A mask of any broadcast shape: one value per (b, h, i, j), read per tile.
// T: bool8 (False gives -inf), bf16, f16 or float (added to the scaled scores).
template <typename T>
struct MaskFull {
  static constexpr int kMode = 1;
  typedef T Elem;
};
// Key padding: one value per (b, j), the strides of Hq and Sq are 0. Float32
// additive (the launchers convert a boolean one to 0 / -inf), read once per
// key block rather than once per query row.
struct MaskKeyPad {
  static constexpr int kMode = 2;
  typedef float Elem;
};

// 4-byte async copy global -> shared (zero-filled when !valid; src must
// still be a mapped address): the key-padding values, whose rows need not be
// 16-byte aligned.
__device__ __forceinline__ void cp_async_4(u32 dst, const void* src, bool valid) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void ld_shared_f32x2(u32 addr, float& a, float& b) {
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(a), "=f"(b) : "r"(addr) : "memory");
}

// The mask's element type (float for MaskNone, which never reads one).
template <typename Mask>
struct MaskElemOf {
  typedef typename Mask::Elem type;
};
template <>
struct MaskElemOf<MaskNone> {
  typedef float type;
};

// One mask element as its additive contribution in log2 units (value *
// log2(e); -inf where a boolean mask is False). The kernels then form
// scores * scale * log2(e) + this with one fma. Plain (not volatile) asm:
// the loads are free to move, and the mask is read-only (.nc).
constexpr float kMaskLog2e = 1.4426950408889634f;

// Huge additive values (|value * log2(e)| > 2^100, e.g. finfo(bf16).min, or
// finfo(float32).min, which would overflow to -inf in log2 units): no score
// can move them, as in PyTorch's float sum `scores + mask`, where they absorb
// the score. They saturate to +-FLT_MAX, which absorbs the fma's score
// exactly, so a row masked only by such values still sees its keys with
// equal weights (the mean of V, as eager) instead of counting as fully
// masked. Such a row's max is exactly +-FLT_MAX, which the forward's
// epilogue recognises (huge_row_lse). -inf stays -inf: a masked key.
constexpr float kFltMax = 3.40282347e38f;
constexpr float kMaskHugeLog2 = 1.2676506002282294e30f;  // 2^100
__device__ __forceinline__ float mask_to_log2(float v) {
  const float a = v * kMaskLog2e;
  const bool huge = (a > kMaskHugeLog2 || a < -kMaskHugeLog2) && v != pos_inf() && v != neg_inf();
  return huge ? (v < 0.f ? -kFltMax : kFltMax) : a;
}

// The forward's LSE of a row whose max is +-FLT_MAX (only huge mask values
// lead there): m + log2(l) cannot be stored next to FLT_MAX (its ulp is
// 2^104), so the row stores a marker that the backward's preprocess decodes
// (attention_bwd.cu, "huge rows"): +-2^120 * (1 + log2(l) / 64) in natural
// units; log2(l) < 32 for any Sk < 2^31, and no other row's |LSE| reaches
// 2^119 (that would need scores beyond 2^100).
constexpr float kHugeRowLse = 1.329227995784916e36f;  // 2^120
__device__ __forceinline__ bool is_huge_row_max(float m) { return m == kFltMax || m == -kFltMax; }
__device__ __forceinline__ float huge_row_lse(float m, float log2_sum) {
  return (m > 0.f ? kHugeRowLse : -kHugeRowLse) * (1.f + log2_sum * 0.015625f);
}

// a * b + c rounded once (the masked backward's P = 2^(a S2 - L2); asm, as
// every helper here, so that no CUDA header is needed).
__device__ __forceinline__ float fmaf_rn(float a, float b, float c) {
  float r;
  asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c));
  return r;
}

template <typename T>
struct MaskLoad;
template <>
struct MaskLoad<float> {
  static __device__ __forceinline__ float l2(const void* p) {
    float v;
    asm("ld.global.nc.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return mask_to_log2(v);
  }
};
template <>
struct MaskLoad<bf16> {
  static __device__ __forceinline__ float l2(const void* p) {
    u32 v;
    asm("ld.global.nc.u16 %0, [%1];" : "=r"(v) : "l"(p));
    float f;
    asm("mov.b32 %0, %1;" : "=f"(f) : "r"(v << 16));
    return mask_to_log2(f);
  }
};
template <>
struct MaskLoad<f16> {
  static __device__ __forceinline__ float l2(const void* p) {
    float f;
    asm("{ .reg .b16 h; ld.global.nc.b16 h, [%1]; cvt.f32.f16 %0, h; }" : "=f"(f) : "l"(p));
    return f * kMaskLog2e;
  }
};
template <>
struct MaskLoad<bool8> {
  static __device__ __forceinline__ float l2(const void* p) {
    u32 v;
    asm("ld.global.nc.u8 %0, [%1];" : "=r"(v) : "l"(p));
    return v ? 0.f : neg_inf();
  }
};

}  // namespace opfuse_attn
