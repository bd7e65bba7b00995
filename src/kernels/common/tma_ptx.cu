// opfuse: Hopper (sm_90) PTX helpers shared by the kernels that stream
// through the tensor memory accelerator: the skinny GEMM's TMA kernel
// (skinny_gemm/skinny_gemm_tma.cu) and the decode MLP (decode_mlp/decode_mlp.cu).
//
// Not compiled alone: their launchers prepend it to the kernel's source.
// Inline PTX only (NVRTC on the target machines finds no CUDA headers):
// shared-memory addresses, mbarriers, 2-D tensor copies completing on an
// mbarrier, an L2 evict-first policy.

namespace opfuse_tma {

typedef unsigned int u32;
typedef unsigned long long u64;

// CUtensorMap: 128 opaque bytes, 64-byte aligned, made on the host by
// cuTensorMapEncodeTiled; a __grid_constant__ kernel parameter, so that its
// address (in the parameter space) can be handed to the TMA unit.
struct alignas(64) TmaMap {
  u64 opaque[16];
};

// The 32-bit shared-window address of a shared-memory pointer.
__device__ __forceinline__ u32 smem_u32(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// One arrival, and `bytes` more of transactions (copies) the phase waits for.
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Spins until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  u32 done = 0;
  do {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}
// For data read once (weights): first out of L2.
__device__ __forceinline__ u64 evict_first_policy() {
  u64 p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}
// The box of `map` at coordinates (c0 innermost, c1) into shared memory at
// dst, completing `bar`'s transactions; with an L2 cache policy or without.
__device__ __forceinline__ void tma_load_2d(u32 dst, const TmaMap* map, int c0, int c1, u32 bar, u64 policy) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%2, %3}], "
      "[%4], %5;" ::"r"(dst),
      "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(bar), "l"(policy)
      : "memory");
}
// The same for a 3-D map (c2 outermost: which of a batch of matrices).
__device__ __forceinline__ void tma_load_3d(u32 dst, const TmaMap* map, int c0, int c1, int c2, u32 bar, u64 policy) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%2, %3, "
      "%4}], [%5], %6;" ::"r"(dst),
      "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "l"(policy)
      : "memory");
}
__device__ __forceinline__ void tma_load_2d(u32 dst, const TmaMap* map, int c0, int c1, u32 bar) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
                   dst),
               "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(bar)
               : "memory");
}

}  // namespace opfuse_tma
