// The skinny GEMM without a GPU: its float64 CPU reference against a naive
// dot product, the launcher's config choice and applicability rules, and
// NVRTC builds of every instantiation the launcher can pick for sm_80 and
// sm_90 (no register spills). The kernel itself runs in
// tests/python/test_skinny_gemm.py (marked gpu).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <regex>
#include <vector>

#include "kernels/skinny_gemm/skinny_gemm_reference.h"
#include "runtime/cuda_api.h"
#include "runtime/skinny_gemm_launcher.h"

namespace opfuse {
namespace {

namespace ks = kernels::skinny_gemm;

std::vector<double> random_values(size_t n, DType t, std::mt19937& rng, double scale = 1.0) {
  std::normal_distribution<double> d(0.0, scale);
  std::vector<double> v(n);
  for (auto& x : v) x = round_to_dtype(d(rng), t);
  return v;
}

// Strided operands (row strides larger than the rows, a bias every 3rd
// element) against a column-by-column float64 dot product.
TEST(SkinnyGemmReference, MatchesNaiveDotProduct) {
  std::mt19937 rng(7);
  for (DType t : {DType::BFloat16, DType::Float16})
    for (const char* act : {"", "relu", "gelu_tanh"}) {
      const int64_t m = 5, n = 13, k = 40, lda = 48, ldw = 56, ldc = 17;
      auto a = random_values(m * lda, t, rng), w = random_values(n * ldw, t, rng, 0.2);
      auto bias = random_values(3 * n, t, rng), c = random_values(m * ldc, t, rng);
      std::vector<double> d(m * n), aux(m * n);
      ks::ReferenceArgs r;
      r.dtype = t, r.m = m, r.n = n, r.k = k;
      r.a = a.data(), r.lda = lda, r.w = w.data(), r.ldw = ldw;
      r.bias = bias.data(), r.bias_stride = 3, r.c = c.data(), r.ldc = ldc;
      r.activation = act, r.d = d.data(), r.aux = aux.data();
      ks::skinny_gemm_reference(r);
      for (int64_t j = 0; j < n; ++j)
        for (int64_t i = 0; i < m; ++i) {
          double s = bias[j * 3] + c[i * ldc + j];
          for (int64_t kk = k; kk-- > 0;) s += a[i * lda + kk] * w[j * ldw + kk];  // the other order
          double y = std::string(act) == "relu" ? std::max(s, 0.0)
                     : std::string(act) == "gelu_tanh" ? 0.5 * s * (1 + std::tanh(0.7978845608028654 * (s + 0.044715 * s * s * s)))
                                                       : s;
          EXPECT_EQ(aux[i * n + j], round_to_dtype(s, t)) << i << "," << j;
          EXPECT_NEAR(d[i * n + j], round_to_dtype(y, t), 1e-12 + 1e-2 * std::abs(y)) << act << " " << i << "," << j;
          // Within half an ulp of the exact value (f16: or of its subnormal spacing, 2^-24).
          EXPECT_LE(std::abs(d[i * n + j] - y),
                    t == DType::BFloat16 ? std::abs(y) / 256 + 1e-40 : std::max(std::abs(y) / 2048, std::ldexp(1.0, -25)));
        }
    }
}

TEST(SkinnyGemmReference, RejectsBadArguments) {
  ks::ReferenceArgs r;
  EXPECT_THROW(ks::skinny_gemm_reference(r), std::invalid_argument);  // null operands
  double x = 1, y = 0;
  r.a = &x, r.w = &x, r.d = &y, r.m = r.n = r.k = 1;
  r.activation = "silu";
  EXPECT_THROW(ks::skinny_gemm_reference(r), std::invalid_argument);
  r.activation = "";
  ks::skinny_gemm_reference(r);
  EXPECT_EQ(y, 1.0);
}

TEST(SkinnyGemmConfig, TagsRoundTripAndBadTagsThrow) {
  for (int arch : {80, 90})
    for (const auto& c : skinny::candidate_configs(arch)) EXPECT_EQ(skinny::SkinnyConfig::parse(c.tag()), c);
  EXPECT_THROW(skinny::SkinnyConfig::parse("n8u1w8b2"), std::invalid_argument);
  EXPECT_THROW(skinny::SkinnyConfig::parse("n8u1w8b2c3"), std::invalid_argument);
  EXPECT_THROW(skinny::SkinnyConfig::parse("n12u1w8b2c1"), std::invalid_argument);
}

// The benchmark's decode shapes on an H200 (132 SMs): one wave of CTAs, and
// a cluster split of K where N / 64 tiles alone would leave SMs idle.
TEST(SkinnyGemmConfig, ChoiceForTheDecodeShapes) {
  EXPECT_EQ(skinny::choose_config(16, 16384, 4096, 90, 132).tag(), "n8u1w8b2c1");   // MLP up: 256 CTAs
  EXPECT_EQ(skinny::choose_config(16, 4096, 16384, 90, 132).tag(), "n8u1w8b1c2p1");  // MLP down: 64 tiles x 2, pipelined (measured best)
  EXPECT_EQ(skinny::choose_config(16, 11008, 4096, 90, 132).tag(), "n8u1w8b2c1");   // Llama gate/up: 172 CTAs
  EXPECT_EQ(skinny::choose_config(16, 4096, 11008, 90, 132).tag(), "n8u1w8b1c2p1");  // Llama down
  EXPECT_EQ(skinny::choose_config(16, 4096, 16384, 80, 108).cluster, 1);            // no clusters before sm_90
  for (int arch : {80, 90})
    for (int64_t n : {1, 1001, 4096, 11008, 16384, 100000})
      for (int64_t k : {8, 1000, 4096, 16384}) {
        auto c = skinny::choose_config(16, n, k, arch, arch == 90 ? 132 : 108);
        auto all = skinny::candidate_configs(arch);
        EXPECT_NE(std::find(all.begin(), all.end(), c), all.end()) << c.tag() << " is not compiled by CI";
      }
}

// Without OPFUSE_SKINNY_GEMM: the box measured on the H200 (sm_90, N and K
// of 4096 to 16384); not a vocabulary projection, short K or older GPUs.
TEST(SkinnyGemmConfig, DefaultShapes) {
  EXPECT_TRUE(skinny::default_takes(16, 4096, 16384, 90, 132));
  EXPECT_TRUE(skinny::default_takes(1, 4096, 11008, 90, 132));
  EXPECT_TRUE(skinny::default_takes(16, 16384, 4096, 90, 132));
  EXPECT_TRUE(skinny::default_takes(16, 11008, 4096, 90, 132));
  EXPECT_FALSE(skinny::default_takes(16, 128256, 4096, 90, 132));
  EXPECT_FALSE(skinny::default_takes(16, 4096, 1024, 90, 132));
  EXPECT_FALSE(skinny::default_takes(16, 1024, 8192, 90, 132));
  EXPECT_FALSE(skinny::default_takes(16, 4096, 16384, 80, 108));
}

GemmArgs linear_args(int64_t m, int64_t n, int64_t k) {
  alignas(16) static const char buffer[64] = {};
  GemmArgs g;
  g.dtype = DType::BFloat16;
  g.m = m, g.n = n, g.k = k;
  g.a = {buffer, 0, k, 1};
  g.b = {buffer, 0, 1, k};  // B[k, n] = W[n, k]
  g.d = const_cast<char*>(buffer);
  return g;
}

TEST(SkinnyGemmLauncher, WhatItTakesAndWhatItLeavesToCuBLASLt) {
  EXPECT_EQ(skinny::unsupported_reason(linear_args(16, 16384, 4096)), "");
  EXPECT_EQ(skinny::unsupported_reason(linear_args(1, 1001, 1000)), "");
  EXPECT_NE(skinny::unsupported_reason(linear_args(17, 64, 64)), "");
  EXPECT_NE(skinny::unsupported_reason(linear_args(4, 64, 1001)), "");  // K not a multiple of 8
  GemmArgs g = linear_args(4, 64, 64);
  g.dtype = DType::Float32;
  EXPECT_NE(skinny::unsupported_reason(g), "");
  g = linear_args(4, 64, 64);
  g.b = {g.b.ptr, 0, 64, 1};  // B row-major [k, n]: W not K-contiguous
  EXPECT_NE(skinny::unsupported_reason(g), "");
  g = linear_args(4, 64, 64);
  g.a.ptr = static_cast<const char*>(g.a.ptr) + 2;  // misaligned
  EXPECT_NE(skinny::unsupported_reason(g), "");
  g = linear_args(4, 64, 64);
  g.a.row_stride = 68;
  EXPECT_NE(skinny::unsupported_reason(g), "");
  g = linear_args(4, 64, 64);
  g.batch = 2;
  EXPECT_NE(skinny::unsupported_reason(g), "");
  g = linear_args(4, 64, 64);
  g.bias_grad = g.d;
  EXPECT_NE(skinny::unsupported_reason(g), "");
  g = linear_args(4, 64, 64);
  g.activation = "silu";
  EXPECT_NE(skinny::unsupported_reason(g), "");
  g = linear_args(4, 64, 64);
  g.activation = "gelu_tanh";
  g.aux = g.d;
  g.bias = static_cast<const char*>(g.d) + 6;  // any alignment and stride: read one element at a time
  g.bias_stride = 3;
  EXPECT_EQ(skinny::unsupported_reason(g), "");
}

// Every instantiation the launcher may pick compiles for sm_80 and sm_90
// without spilling (NVRTC needs no GPU).
TEST(SkinnyGemmNvrtc, EveryCandidateCompilesWithoutSpills) {
  if (!nvrtc().loaded) GTEST_SKIP() << "NVRTC not available: " << nvrtc().error;
  static const std::regex spill(R"((\d+) bytes spill stores)"), regs(R"(Used (\d+) registers)");
  for (int arch : {80, 90})
    for (DType t : {DType::BFloat16, DType::Float16})
      for (const auto& c : skinny::candidate_configs(arch)) {
        skinny::Compiled out = skinny::compile(t, c, arch, /*use_cache=*/false);
        EXPECT_FALSE(out.cubin.empty());
        std::smatch m;
        ASSERT_TRUE(std::regex_search(out.log, m, regs)) << out.log;
        EXPECT_LE(std::stoi(m[1]) * c.warps * 32 * c.min_blocks, 65536) << c.tag() << " sm_" << arch;
        ASSERT_TRUE(std::regex_search(out.log, m, spill)) << out.log;
        EXPECT_EQ(m[1], "0") << c.tag() << " sm_" << arch << "\n" << out.log;
      }
}

}  // namespace
}  // namespace opfuse
