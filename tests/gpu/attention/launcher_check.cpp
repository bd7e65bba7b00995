// GPU check of the C++ attention launcher (src/runtime/attention_launcher*.cpp)
// without PyTorch or the Python extension: a standalone program that loads
// libcuda and libnvrtc at run time like the runtime does, runs the forward
// through attn_forward_cuda on a few shapes with the default dispatch (sm_90:
// the Hopper kernel), a forced Hopper tile, a forced mma.sync tile and
// OPFUSE_ATTN_SM90=0, and compares each with the float64 CPU reference
// (attention_reference.h) on the same bf16-rounded inputs.
//
// Build (any x86-64 machine; it links no CUDA library):
//   g++ -O2 -std=c++20 -Isrc -I<dir with attention_fwd_cu.inc, attention_fwd_sm90_cu.inc,
//       attention_fwd_sm90_schedule_cu.inc, attention_ptx_cu.inc, attention_sm90_ptx_cu.inc> \
//       tests/gpu/attention/launcher_check.cpp src/runtime/{attention_launcher,attention_launcher_sm90,nvrtc_named,cuda_api,compile_cache,hash}.cpp \
//       src/kernels/attention/attention_reference.cpp -ldl -o launcher_check
// Run on a GPU machine: OPFUSE_CUDA_LIB_DIRS=<dir of libnvrtc.so.13> ./launcher_check
// Exit status 0 when every case is within tolerance.
#include <dlfcn.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/attention/attention_reference.h"
#include "runtime/attention_launcher.h"
#include "runtime/attention_launcher_sm90.h"
#include "runtime/cuda_api.h"

namespace at = opfuse::attention;
namespace ka = opfuse::kernels::attention;

namespace {

using MemAlloc = int (*)(unsigned long long*, size_t);
using MemcpyH2D = int (*)(unsigned long long, const void*, size_t);
using MemcpyD2H = int (*)(void*, unsigned long long, size_t);
using CtxSync = int (*)();
MemAlloc mem_alloc;
MemcpyH2D h2d;
MemcpyD2H d2h;
CtxSync ctx_sync;

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}
float from_bf16(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct Case {
  int D;
  bool causal;
  int Sq, Sk, Hq, Hkv;
};

// Returns the max |O - ref| (NaN counts as infinite) and the max LSE error.
std::pair<double, double> run(const Case& c, const std::string& tile, const char* env_sm90) {
  const int B = 2;
  std::mt19937 rng(c.D * 131 + c.Sq * 7 + c.Sk + c.causal);
  std::normal_distribution<float> nd;
  auto make = [&](int64_t n, std::vector<uint16_t>& h, std::vector<float>& f) {
    h.resize(n);
    f.resize(n);
    for (int64_t i = 0; i < n; ++i) h[i] = to_bf16(nd(rng)), f[i] = from_bf16(h[i]);
  };
  std::vector<uint16_t> hq, hk, hv;
  std::vector<float> fq, fk, fv;
  make(int64_t(B) * c.Hq * c.Sq * c.D, hq, fq);
  make(int64_t(B) * c.Hkv * c.Sk * c.D, hk, fk);
  make(int64_t(B) * c.Hkv * c.Sk * c.D, hv, fv);
  unsigned long long dq, dk, dv, dout, dlse;
  const size_t no = size_t(B) * c.Hq * c.Sq * c.D, nl = size_t(B) * c.Hq * c.Sq;
  mem_alloc(&dq, hq.size() * 2), mem_alloc(&dk, hk.size() * 2), mem_alloc(&dv, hv.size() * 2);
  mem_alloc(&dout, no * 2), mem_alloc(&dlse, nl * 4);
  h2d(dq, hq.data(), hq.size() * 2), h2d(dk, hk.data(), hk.size() * 2), h2d(dv, hv.data(), hv.size() * 2);
  std::vector<uint16_t> poison(no, 0x7FC0);  // NaN: an unwritten element fails
  h2d(dout, poison.data(), no * 2);

  at::AttnForwardArgs a;
  a.elem = at::AttnElem::BF16;
  a.q = reinterpret_cast<void*>(dq), a.k = reinterpret_cast<void*>(dk), a.v = reinterpret_cast<void*>(dv);
  a.o = reinterpret_cast<void*>(dout), a.lse = reinterpret_cast<float*>(dlse);
  auto st = [](int64_t* s, int H, int S, int D) { s[0] = int64_t(H) * S * D, s[1] = int64_t(S) * D, s[2] = D; };
  st(a.q_strides, c.Hq, c.Sq, c.D), st(a.o_strides, c.Hq, c.Sq, c.D);
  st(a.k_strides, c.Hkv, c.Sk, c.D), st(a.v_strides, c.Hkv, c.Sk, c.D);
  a.lse_strides[0] = int64_t(c.Hq) * c.Sq, a.lse_strides[1] = c.Sq;
  a.batch = B, a.heads_q = c.Hq, a.heads_kv = c.Hkv, a.seqlen_q = c.Sq, a.seqlen_k = c.Sk, a.head_dim = c.D;
  a.causal = c.causal;
  a.tile = tile;
  if (env_sm90) setenv("OPFUSE_ATTN_SM90", env_sm90, 1);
  else unsetenv("OPFUSE_ATTN_SM90");
  at::attn_forward_cuda(a, nullptr);
  if (int r = ctx_sync()) {
    std::printf("cuCtxSynchronize failed: %d\n", r);
    std::exit(2);
  }
  std::vector<uint16_t> ho(no);
  std::vector<float> lse(nl);
  d2h(ho.data(), dout, no * 2), d2h(lse.data(), dlse, nl * 4);

  std::vector<float> ro(no), rl(nl);
  ka::AttentionForwardArgs r;
  r.q = {fq.data(), a.q_strides[0], a.q_strides[1], a.q_strides[2]};
  r.k = {fk.data(), a.k_strides[0], a.k_strides[1], a.k_strides[2]};
  r.v = {fv.data(), a.v_strides[0], a.v_strides[1], a.v_strides[2]};
  r.o = {ro.data(), a.o_strides[0], a.o_strides[1], a.o_strides[2]};
  r.lse = {rl.data(), a.lse_strides[0], a.lse_strides[1]};
  r.shape = {B, c.Hq, c.Hkv, c.Sq, c.Sk, c.D};
  r.causal = c.causal;
  ka::attention_forward_plain(r);
  double err = 0, lerr = 0;
  for (size_t i = 0; i < no; ++i) {
    const double d = std::fabs(double(from_bf16(ho[i])) - ro[i]);
    err = std::isnan(d) ? INFINITY : std::max(err, d);
  }
  for (size_t i = 0; i < nl; ++i) {
    if (std::isinf(rl[i]) && std::isinf(lse[i]) && lse[i] < 0) continue;
    const double d = std::fabs(double(lse[i]) - rl[i]);
    lerr = std::isnan(d) ? INFINITY : std::max(lerr, d);
  }
  return {err, lerr};
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "precompile") {
    // Fills the disk cache (OPFUSE_CACHE_DIR) with what the run below needs:
    // no GPU required, so the GPU machine's time goes to running only.
    for (int D : {64, 128})
      for (bool causal : {false, true}) {
        for (const char* t : {"wg128x128s2n", "default"}) {
          const at::AttnSm90Tile tile = std::string(t) == "default" ? at::attn_sm90_default_tile(D, causal) : at::AttnSm90Tile::parse(t);
          std::printf("%s hit=%d\n", at::attn_sm90_name_expression(at::AttnElem::BF16, D, causal, tile).c_str(),
                      at::attn_sm90_compile(at::AttnElem::BF16, D, causal, tile).cache_hit);
        }
        for (const at::AttnTile& tile : {at::AttnTile::parse("128x64w4b2"), at::attn_choose_tile(D, 1000, 1000, causal, 90)})
          std::printf("%s hit=%d\n", at::attn_name_expression(at::AttnElem::BF16, D, causal, tile).c_str(),
                      at::attn_compile(at::AttnElem::BF16, D, causal, tile, 90).cache_hit);
      }
    for (bool causal : {false, true})
      at::attn_compile(at::AttnElem::BF16, 96, causal, at::AttnTile::parse("128x64w4b2"), 90);
    return 0;
  }
  const opfuse::CudaApi& c = opfuse::cuda();
  if (!c.loaded) {
    std::printf("no CUDA driver: %s\n", c.error.c_str());
    return 2;
  }
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  mem_alloc = reinterpret_cast<MemAlloc>(dlsym(h, "cuMemAlloc_v2"));
  h2d = reinterpret_cast<MemcpyH2D>(dlsym(h, "cuMemcpyHtoD_v2"));
  d2h = reinterpret_cast<MemcpyD2H>(dlsym(h, "cuMemcpyDtoH_v2"));
  ctx_sync = reinterpret_cast<CtxSync>(dlsym(h, "cuCtxSynchronize"));
  opfuse::ensure_cuda_context(0);
  std::printf("sm_%d\n", opfuse::current_device_arch());
  const Case cases[] = {{128, false, 113, 203, 4, 2}, {128, true, 300, 200, 4, 1}, {64, true, 1, 239, 4, 4},
                        {64, false, 1023, 1024, 2, 2}, {96, true, 113, 203, 4, 2},
                        {64, true, 1000, 700, 16, 4}};  // the last: 192 tiles, more than one per CTA
  struct Mode {
    const char* tile;
    const char* env;
  } modes[] = {{"", nullptr}, {"", "0"}, {"wg128x128s2n", nullptr}, {"128x64w4b2", nullptr}};
  int bad = 0;
  for (const Case& cs : cases)
    for (const Mode& m : modes) {
      if (std::string(m.tile).rfind("wg", 0) == 0 && cs.D == 96) continue;
      std::pair<double, double> e;
      try {
        e = run(cs, m.tile, m.env);
      } catch (const std::exception& ex) {
        std::printf("D=%d causal=%d Sq=%d Sk=%d tile='%s' env=%s: EXCEPTION %s\n", cs.D, cs.causal, cs.Sq, cs.Sk, m.tile,
                    m.env ? m.env : "-", ex.what());
        ++bad;
        continue;
      }
      // bf16 output rounding of values of size ~1 is ~4e-3; 2e-2 leaves room for P's rounding.
      const bool ok = e.first < 2e-2 && e.second < 2e-3;
      bad += !ok;
      std::printf("D=%d causal=%d Sq=%d Sk=%d Hq=%d Hkv=%d tile='%s' OPFUSE_ATTN_SM90=%s: err %.3e lse err %.3e %s\n", cs.D,
                  cs.causal, cs.Sq, cs.Sk, cs.Hq, cs.Hkv, m.tile, m.env ? m.env : "-", e.first, e.second,
                  ok ? "ok" : "BAD");
    }
  std::printf("%s\n", bad ? "FAILED" : "all ok");
  return bad ? 1 : 0;
}
