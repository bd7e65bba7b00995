// Does the length of the contiguous runs a GEMM reads its weight in set how
// fast HBM streams it? (Issue 5: at M = 16 cuBLASLt's 128x16x64 tiles read
// W [N, K] in 128-byte pieces of 128 rows and stream at 75-85% of the copy;
// the skinny kernel's 64-byte pieces do no better.) A pure read of a 256 MiB
// bf16 "weight" by persistent CTAs that each own R rows and walk along K in
// steps of L bytes (a tile of R x L = 16 KB a step, U = 2 or 4 steps in flight a
// thread), for R x L from 512 x 32 and 256 x 64 (the skinny kernel's warp loads:
// 8 rows x 64 bytes) through 128 x 128 (cuBLAS's tile) to 1 x 16384, against a
// flat sequential read. No arithmetic but an XOR, so only the access pattern
// differs. Build and run on the GPU machine:
//   nvcc -O3 -arch=sm_90 -o /tmp/wsr scripts/micro/weight_stream_runs.cu && /tmp/wsr
#include <cstdio>
#include <cstdint>
#include <vector>
#include <cuda_runtime.h>

#define CHECK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
  std::printf("CUDA error %s at line %d\n", cudaGetErrorString(e_), __LINE__); return 1; } } while (0)

constexpr int kThreads = 256;
constexpr int kTileBytes = 16384;                        // 256 threads x 4 loads x 16 bytes
constexpr int kLoads = kTileBytes / (kThreads * 16);     // 4

// Tiles t = 0 .. rows/R * K_bytes/L - 1, row block t / steps, step t % steps
// (K fastest, as a GEMM's CTA walks K); CTA c takes the contiguous range
// [c * per, (c + 1) * per).
// HINT: the skinny kernel's weight load (ld.global.nc.L1::no_allocate.L2::256B,
// which asks L2 to fetch 256 bytes around each miss) in place of __ldg.
__device__ __forceinline__ uint4 ld_hinted(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

template <int U, bool HINT = false>
__global__ void __launch_bounds__(kThreads) runs(const uint4* __restrict__ w, int64_t row_bytes, int R, int L,
                                                 int64_t tiles, int64_t per, unsigned* out) {
  const int64_t first = blockIdx.x * per;
  const int64_t last = first + per < tiles ? first + per : tiles;
  const int64_t steps = row_bytes / L;
  unsigned acc = 0;
  for (int64_t t0 = first; t0 < last; t0 += U) {
    uint4 v[U][kLoads];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t t = t0 + u < last ? t0 + u : last - 1;
      const int64_t rb = t / steps, step = t % steps;
#pragma unroll
      for (int j = 0; j < kLoads; ++j) {
        const int o = (j * kThreads + threadIdx.x) * 16;
        const int64_t row = rb * R + o / L;
        const int64_t byte = row * row_bytes + step * L + o % L;
        v[u][j] = HINT ? ld_hinted(w + byte / 16) : __ldg(w + byte / 16);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int j = 0; j < kLoads; ++j) acc ^= v[u][j].x ^ v[u][j].y ^ v[u][j].z ^ v[u][j].w;
  }
  if (acc == 0x9e3779b9u) out[blockIdx.x * kThreads + threadIdx.x] = acc;  // keeps the loads, writes nothing
}

// The copy-like floor: each CTA a contiguous range of the whole buffer.
template <int U>
__global__ void __launch_bounds__(kThreads) flat(const uint4* __restrict__ w, int64_t vecs, int64_t per,
                                                 unsigned* out) {
  const int64_t first = blockIdx.x * per;
  const int64_t last = first + per < vecs ? first + per : vecs;
  unsigned acc = 0;
  for (int64_t i0 = first + threadIdx.x; i0 < last; i0 += int64_t(kThreads) * U * kLoads) {
    uint4 v[U * kLoads];
#pragma unroll
    for (int u = 0; u < U * kLoads; ++u) {
      const int64_t i = i0 + int64_t(u) * kThreads;
      v[u] = __ldg(w + (i < last ? i : first));
    }
#pragma unroll
    for (int u = 0; u < U * kLoads; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x9e3779b9u) out[blockIdx.x * kThreads + threadIdx.x] = acc;
}

template <typename F>
float time_ms(F launch, int reps) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  launch();
  cudaEventRecord(a);
  for (int i = 0; i < reps; ++i) launch();
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms / reps;
}

int main() {
  const int64_t rows = 8192, row_bytes = 32768;  // W [8192, 16384] bf16: 256 MiB
  const int64_t bytes = rows * row_bytes;
  uint4* w = nullptr;
  unsigned* out = nullptr;
  CHECK(cudaMalloc(&w, bytes));
  CHECK(cudaMalloc(&out, 132 * 8 * kThreads * sizeof(unsigned)));
  CHECK(cudaMemset(w, 1, bytes));
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int reps = 20;
  std::printf("W %lld MiB, %d SMs, GB/s (median-free mean of %d launches after one warm-up)\n",
              (long long)(bytes >> 20), sms, reps);
  for (int ctas_per_sm : {1, 2, 4}) {
    const int grid = sms * ctas_per_sm;
    const int64_t vecs = bytes / 16, per = (vecs + grid - 1) / grid;
    float ms = time_ms([&] { flat<4><<<grid, kThreads>>>(w, vecs, per, out); }, reps);
    CHECK(cudaGetLastError());
    std::printf("flat          ctas/SM %d  U 4: %7.1f GB/s\n", ctas_per_sm, bytes / ms / 1e6);
  }
  const int shapes[][2] = {{512, 32}, {256, 64}, {128, 128}, {64, 256}, {32, 512}, {16, 1024}, {8, 2048}, {4, 4096}, {2, 8192}, {1, 16384}};
  for (int ctas_per_sm : {1, 2}) {
    for (auto& s : shapes) {
      const int R = s[0], L = s[1];
      const int grid = sms * ctas_per_sm;
      const int64_t tiles = (rows / R) * (row_bytes / L), per = (tiles + grid - 1) / grid;
      float ms4 = time_ms([&] { runs<4><<<grid, kThreads>>>(w, row_bytes, R, L, tiles, per, out); }, reps);
      float ms2 = time_ms([&] { runs<2><<<grid, kThreads>>>(w, row_bytes, R, L, tiles, per, out); }, reps);
      CHECK(cudaGetLastError());
      std::printf("R %3d x L %5d ctas/SM %d: U 4 %7.1f GB/s  U 2 %7.1f GB/s\n", R, L, ctas_per_sm,
                  bytes / ms4 / 1e6, bytes / ms2 / 1e6);
    }
  }
  // The same with the skinny kernel's L2::256B load: does the hint make
  // 64-byte pieces (its warp loads: 8 rows x 64 bytes) as fast as 128?
  const int hinted[][2] = {{256, 64}, {128, 128}, {8, 2048}};
  for (int ctas_per_sm : {1, 2}) {
    for (auto& s : hinted) {
      const int R = s[0], L = s[1];
      const int grid = sms * ctas_per_sm;
      const int64_t tiles = (rows / R) * (row_bytes / L), per = (tiles + grid - 1) / grid;
      float ms4 = time_ms([&] { runs<4, true><<<grid, kThreads>>>(w, row_bytes, R, L, tiles, per, out); }, reps);
      float ms2 = time_ms([&] { runs<2, true><<<grid, kThreads>>>(w, row_bytes, R, L, tiles, per, out); }, reps);
      CHECK(cudaGetLastError());
      std::printf("R %3d x L %5d ctas/SM %d L2::256B: U 4 %7.1f GB/s  U 2 %7.1f GB/s\n", R, L, ctas_per_sm,
                  bytes / ms4 / 1e6, bytes / ms2 / 1e6);
    }
  }
  CHECK(cudaDeviceSynchronize());
  return 0;
}
