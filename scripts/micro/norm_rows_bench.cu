// Standalone check and timing of norm_rows_persistent.cu (beside this file)
// (no opfuse build needed): bf16 rows, layer_norm with weight and bias, with
// neither, rms_norm with a weight; a device-to-device copy of the same bytes
// in the same run; a few rows checked against a float64 CPU computation.
//   nvcc -O3 -arch=sm_90 -o /tmp/nrb scripts/micro/norm_rows_bench.cu && /tmp/nrb [rows cols]
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "norm_rows_persistent.cu"

// THREADS, NV vectors a thread, EXACT (n == NV * THREADS * VEC), SLOTS rows in the ring.
OPFUSE_NORM_ROWS_ENTRY(ln_wb, bf16, 512, 8, true, 3, false, true, true)
OPFUSE_NORM_ROWS_ENTRY(ln_plain, bf16, 512, 8, true, 3, false, false, false)
OPFUSE_NORM_ROWS_ENTRY(rms_w, bf16, 512, 8, true, 3, true, true, false)
OPFUSE_NORM_ROWS_ENTRY(ln_wb_s2, bf16, 512, 8, true, 2, false, true, true)
OPFUSE_NORM_ROWS_ENTRY(ln_wb_t256, bf16, 256, 8, true, 6, false, true, true)
OPFUSE_NORM_ROWS_ENTRY(ln_wb_nv4s6, bf16, 512, 4, true, 6, false, true, true)
OPFUSE_NORM_ROWS_ENTRY(ln_wb_nv5s4, bf16, 512, 5, false, 4, false, true, true)
OPFUSE_NORM_ROWS_ENTRY(ln_wb_nv8chk, bf16, 512, 8, false, 3, false, true, true)

#define CK(x)                                                                   \
  do {                                                                          \
    cudaError_t e = (x);                                                        \
    if (e != cudaSuccess) {                                                     \
      std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e));     \
      std::exit(1);                                                             \
    }                                                                           \
  } while (0)

static float bf2f(unsigned short h) {
  unsigned u = static_cast<unsigned>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static unsigned short f2bf(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<unsigned short>(u >> 16);
}

template <class F>
static float median_us(F launch) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> t;
  for (int i = 0; i < 3; ++i) launch();
  for (int r = 0; r < 25; ++r) {
    CK(cudaEventRecord(a));
    for (int i = 0; i < 5; ++i) launch();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms * 1000.f / 5);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int main(int argc, char** argv) {
  const int rows = argc > 2 ? std::atoi(argv[1]) : 8192, n = argc > 2 ? std::atoi(argv[2]) : 32768;
  const size_t elems = static_cast<size_t>(rows) * n;
  std::vector<unsigned short> hx(elems), hw(n), hb(n), hy(elems);
  unsigned s = 12345;
  auto rnd = [&]() { s = s * 1664525u + 1013904223u; return (static_cast<int>(s >> 9) % 20001 - 10000) / 5000.f; };
  for (auto& v : hx) v = f2bf(rnd() + 0.3f);
  for (auto& v : hw) v = f2bf(rnd());
  for (auto& v : hb) v = f2bf(rnd());
  void *x, *w, *b, *y, *cpy;
  float *mean, *rstd;
  CK(cudaMalloc(&x, elems * 2));
  CK(cudaMalloc(&y, elems * 2));
  CK(cudaMalloc(&cpy, elems * 2));
  CK(cudaMalloc(&w, n * 2));
  CK(cudaMalloc(&b, n * 2));
  CK(cudaMalloc(&mean, rows * 4));
  CK(cudaMalloc(&rstd, rows * 4));
  CK(cudaMemcpy(x, hx.data(), elems * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(w, hw.data(), n * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(b, hb.data(), n * 2, cudaMemcpyHostToDevice));
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  opfuse_norm_rows::NormRowsParams p{x, n, w, b, y, n, mean, rstd, 1e-5f, rows, n};
  const int grid = std::min(rows, sms);
  struct Case { const char* name; void (*fn)(opfuse_norm_rows::NormRowsParams); int threads, nv, slots; bool exact, rms, hw, hb; };
  Case cases[] = {{"layer_norm w,b", ln_wb, 512, 8, 3, true, false, true, true},
                  {"layer_norm plain", ln_plain, 512, 8, 3, true, false, false, false},
                  {"rms_norm w", rms_w, 512, 8, 3, true, true, true, false},
                  {"layer_norm w,b s2", ln_wb_s2, 512, 8, 2, true, false, true, true},
                  {"layer_norm w,b t256 s6", ln_wb_t256, 256, 8, 6, true, false, true, true},
                  {"layer_norm w,b v4 s6", ln_wb_nv4s6, 512, 4, 6, true, false, true, true},
                  {"layer_norm w,b v5 s4 chk", ln_wb_nv5s4, 512, 5, 4, false, false, true, true},
                  {"layer_norm w,b v8 chk", ln_wb_nv8chk, 512, 8, 3, false, false, true, true}};
  const double bytes = 2.0 * elems * 2;
  float copy_us = median_us([&] { CK(cudaMemcpyAsync(cpy, x, elems * 2, cudaMemcpyDeviceToDevice)); });
  std::printf("%d x %d bf16, grid %d; copy %.1f us = %.0f GB/s\n", rows, n, grid, copy_us, bytes / copy_us / 1e3);
  for (const Case& c : cases) {
    if (c.nv * c.threads * 8 < n || (c.exact && c.nv * c.threads * 8 != n) || c.slots * n * 2 > 220 * 1024) continue;
    const int smem = c.slots * n * 2;
    CK(cudaFuncSetAttribute(c.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    auto launch = [&] { c.fn<<<grid, c.threads, smem>>>(p); };
    launch();
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(hy.data(), y, elems * 2, cudaMemcpyDeviceToHost));
    double worst = 0;
    for (int r : {0, 1, rows / 2, rows - 1}) {
      const unsigned short* xr = hx.data() + static_cast<size_t>(r) * n;
      double m = 0, v = 0;
      if (!c.rms) {
        for (int i = 0; i < n; ++i) m += bf2f(xr[i]);
        m /= n;
      }
      for (int i = 0; i < n; ++i) v += (bf2f(xr[i]) - m) * (bf2f(xr[i]) - m);
      const double rs = 1.0 / std::sqrt(v / n + 1e-5);
      for (int i = 0; i < n; ++i) {
        double ref = (bf2f(xr[i]) - m) * rs * (c.hw ? bf2f(hw[i]) : 1.0) + (c.hb ? bf2f(hb[i]) : 0.0);
        double err = std::fabs(bf2f(hy[static_cast<size_t>(r) * n + i]) - ref) / (1.6e-2 + 1.6e-2 * std::fabs(ref));
        worst = std::max(worst, err);
      }
    }
    float us = median_us(launch);
    CK(cudaGetLastError());
    std::printf("  %-18s %8.1f us %7.0f GB/s %5.1f%% of the copy   worst err/(atol+rtol|ref|) %.3f %s\n", c.name, us,
                bytes / us / 1e3, 100.0 * copy_us / us, worst, worst <= 1.0 ? "ok" : "FAIL");
  }
  return 0;
}
