// Element types: names, PyTorch's promotion table, and round_to_dtype, the
// oracle's emulation of each dtype's storage (round to nearest even, with
// overflow to inf and gradual underflow for the half types).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "ir/dtype.h"

namespace opfuse {
namespace {

constexpr DType kAll[] = {DType::Bool, DType::Int32, DType::Int64, DType::Float16,
                          DType::BFloat16, DType::Float32, DType::Float64};
constexpr double kInf = std::numeric_limits<double>::infinity();

TEST(DType, NamesRoundTrip) {
  const char* expected[] = {"b8", "i32", "i64", "f16", "bf16", "f32", "f64"};
  for (size_t i = 0; i < 7; ++i) {
    EXPECT_STREQ(dtype_name(kAll[i]), expected[i]);
    DType t;
    ASSERT_TRUE(parse_dtype(expected[i], &t));
    EXPECT_EQ(t, kAll[i]);
  }
  DType t;
  EXPECT_FALSE(parse_dtype("f8", &t));
  EXPECT_FALSE(parse_dtype("F32", &t));
  EXPECT_FALSE(parse_dtype("", &t));
}

TEST(DType, SizesAndCategories) {
  const int sizes[] = {1, 4, 8, 2, 2, 4, 8};
  const int categories[] = {0, 1, 1, 2, 2, 2, 2};
  for (size_t i = 0; i < 7; ++i) {
    EXPECT_EQ(dtype_size(kAll[i]), sizes[i]) << dtype_name(kAll[i]);
    EXPECT_EQ(dtype_category(kAll[i]), categories[i]) << dtype_name(kAll[i]);
    EXPECT_EQ(is_floating(kAll[i]), categories[i] == 2) << dtype_name(kAll[i]);
    EXPECT_EQ(is_integral(kAll[i]), categories[i] == 1) << dtype_name(kAll[i]);
  }
  EXPECT_EQ(compute_dtype(DType::Float16), DType::Float32);
  EXPECT_EQ(compute_dtype(DType::BFloat16), DType::Float32);
  EXPECT_EQ(compute_dtype(DType::Float64), DType::Float64);
  EXPECT_EQ(compute_dtype(DType::Int32), DType::Int32);
}

// torch.promote_types(a, b) for every pair, written out as PyTorch gives it.
TEST(DType, PromoteTypesMatchesTorch) {
  using D = DType;
  const D B = D::Bool, I = D::Int32, L = D::Int64, H = D::Float16, Z = D::BFloat16, F = D::Float32, X = D::Float64;
  //            b8 i32 i64 f16 bf16 f32 f64
  const D table[7][7] = {{B, I, L, H, Z, F, X},   // b8
                         {I, I, L, H, Z, F, X},   // i32
                         {L, L, L, H, Z, F, X},   // i64
                         {H, H, H, H, F, F, X},   // f16
                         {Z, Z, Z, F, Z, F, X},   // bf16
                         {F, F, F, F, F, F, X},   // f32
                         {X, X, X, X, X, X, X}};  // f64
  for (int a = 0; a < 7; ++a)
    for (int b = 0; b < 7; ++b)
      EXPECT_EQ(promote_types(kAll[a], kAll[b]), table[a][b])
          << dtype_name(kAll[a]) << " with " << dtype_name(kAll[b]) << " gave " << dtype_name(promote_types(kAll[a], kAll[b]));
}

TEST(DType, RoundBFloat16TiesToEven) {
  const DType t = DType::BFloat16;  // 8 significant bits: spacing 2^-7 in [1, 2)
  EXPECT_EQ(round_to_dtype(1.0, t), 1.0);
  EXPECT_EQ(round_to_dtype(1.0 + std::ldexp(1, -8), t), 1.0);                             // tie, down to even
  EXPECT_EQ(round_to_dtype(1.0 + 3 * std::ldexp(1, -8), t), 1.0 + std::ldexp(1, -6));     // tie, up to even
  EXPECT_EQ(round_to_dtype(1.0 + std::ldexp(1, -8) + std::ldexp(1, -20), t), 1.0 + std::ldexp(1, -7));
  EXPECT_EQ(round_to_dtype(-(1.0 + std::ldexp(1, -8) + std::ldexp(1, -20)), t), -(1.0 + std::ldexp(1, -7)));
  EXPECT_EQ(round_to_dtype(0.1, t), 0.10009765625);
  EXPECT_EQ(round_to_dtype(257.0, t), 256.0);
  EXPECT_EQ(round_to_dtype(259.0, t), 260.0);
}

TEST(DType, RoundBFloat16Extremes) {
  const DType t = DType::BFloat16;
  const double max_bf16 = std::ldexp(255.0, 120);  // (2 - 2^-7) * 2^127
  EXPECT_EQ(round_to_dtype(max_bf16, t), max_bf16);
  EXPECT_EQ(round_to_dtype(3.4e38, t), kInf);  // beyond the midpoint to 2^128
  EXPECT_EQ(round_to_dtype(-3.4e38, t), -kInf);
  EXPECT_EQ(round_to_dtype(kInf, t), kInf);
  EXPECT_EQ(round_to_dtype(-kInf, t), -kInf);
  EXPECT_TRUE(std::isnan(round_to_dtype(std::nan(""), t)));
  EXPECT_TRUE(std::signbit(round_to_dtype(-0.0, t)));
  // Subnormals: the smallest step is 2^-133.
  const double tiny = std::ldexp(1, -133);
  EXPECT_EQ(round_to_dtype(tiny, t), tiny);
  EXPECT_EQ(round_to_dtype(1.4 * tiny, t), tiny);
  EXPECT_EQ(round_to_dtype(1.6 * tiny, t), 2 * tiny);
  EXPECT_EQ(round_to_dtype(0.5 * tiny, t), 0.0);       // tie, to even (zero)
  EXPECT_EQ(round_to_dtype(1.5 * tiny, t), 2 * tiny);  // tie, to even
}

TEST(DType, RoundFloat16TiesToEven) {
  const DType t = DType::Float16;  // 11 significant bits: spacing 2^-10 in [1, 2)
  EXPECT_EQ(round_to_dtype(1.0 + std::ldexp(1, -11), t), 1.0);
  EXPECT_EQ(round_to_dtype(1.0 + 3 * std::ldexp(1, -11), t), 1.0 + std::ldexp(1, -9));
  EXPECT_EQ(round_to_dtype(1.0 + std::ldexp(1, -11) + std::ldexp(1, -20), t), 1.0 + std::ldexp(1, -10));
  EXPECT_EQ(round_to_dtype(0.1, t), 0.0999755859375);
  EXPECT_EQ(round_to_dtype(2049.0, t), 2048.0);
  EXPECT_EQ(round_to_dtype(2051.0, t), 2052.0);
  EXPECT_EQ(round_to_dtype(-2051.0, t), -2052.0);
}

TEST(DType, RoundFloat16Extremes) {
  const DType t = DType::Float16;
  EXPECT_EQ(round_to_dtype(65504.0, t), 65504.0);
  EXPECT_EQ(round_to_dtype(65519.0, t), 65504.0);
  EXPECT_EQ(round_to_dtype(65520.0, t), kInf);  // the midpoint to 65536 rounds to even: inf
  EXPECT_EQ(round_to_dtype(-65520.0, t), -kInf);
  EXPECT_EQ(round_to_dtype(1e6, t), kInf);
  EXPECT_EQ(round_to_dtype(-kInf, t), -kInf);
  EXPECT_TRUE(std::isnan(round_to_dtype(std::nan(""), t)));
  EXPECT_TRUE(std::signbit(round_to_dtype(-0.0, t)));
  // Smallest normal 2^-14; subnormal step 2^-24.
  const double tiny = std::ldexp(1, -24);
  EXPECT_EQ(round_to_dtype(std::ldexp(1, -14), t), std::ldexp(1, -14));
  EXPECT_EQ(round_to_dtype(tiny, t), tiny);
  EXPECT_EQ(round_to_dtype(0.75 * tiny, t), tiny);
  EXPECT_EQ(round_to_dtype(0.5 * tiny, t), 0.0);       // tie, to even (zero)
  EXPECT_EQ(round_to_dtype(0.4 * tiny, t), 0.0);
  EXPECT_EQ(round_to_dtype(1.5 * tiny, t), 2 * tiny);  // tie, to even
  EXPECT_EQ(round_to_dtype(2.5 * tiny, t), 2 * tiny);  // tie, to even
  EXPECT_EQ(round_to_dtype(1000.25 * tiny, t), 1000 * tiny);
  // Just below the smallest normal: a tie between 1023 and 1024 steps.
  EXPECT_EQ(round_to_dtype(std::ldexp(1, -14) - std::ldexp(1, -25), t), std::ldexp(1, -14));
  EXPECT_TRUE(std::signbit(round_to_dtype(-0.25 * tiny, t)));  // underflows to -0
}

TEST(DType, RoundFloat32AndFloat64) {
  EXPECT_EQ(round_to_dtype(0.1, DType::Float32), static_cast<double>(0.1f));
  EXPECT_NE(round_to_dtype(0.1, DType::Float32), 0.1);
  EXPECT_EQ(round_to_dtype(1.0 + std::ldexp(1, -24), DType::Float32), 1.0);
  EXPECT_EQ(round_to_dtype(1e39, DType::Float32), kInf);
  EXPECT_EQ(round_to_dtype(0.1, DType::Float64), 0.1);
  EXPECT_EQ(round_to_dtype(1e300, DType::Float64), 1e300);
}

TEST(DType, RoundIntegersAndBool) {
  EXPECT_EQ(round_to_dtype(3.7, DType::Int32), 3.0);   // truncation toward zero
  EXPECT_EQ(round_to_dtype(-3.7, DType::Int32), -3.0);
  EXPECT_EQ(round_to_dtype(std::nan(""), DType::Int32), 0.0);
  EXPECT_EQ(round_to_dtype(2147483648.0, DType::Int32), -2147483648.0);  // two's-complement wrap
  EXPECT_EQ(round_to_dtype(-2147483649.0, DType::Int32), 2147483647.0);
  EXPECT_EQ(round_to_dtype(-9.99, DType::Int64), -9.0);
  EXPECT_EQ(round_to_dtype(1e15 + 0.5, DType::Int64), 1e15);
  EXPECT_EQ(round_to_dtype(std::nan(""), DType::Int64), 0.0);
  EXPECT_EQ(round_to_dtype(0.0, DType::Bool), 0.0);
  EXPECT_EQ(round_to_dtype(-0.0, DType::Bool), 0.0);
  EXPECT_EQ(round_to_dtype(0.25, DType::Bool), 1.0);
  EXPECT_EQ(round_to_dtype(-7.0, DType::Bool), 1.0);
  EXPECT_EQ(round_to_dtype(std::nan(""), DType::Bool), 1.0);  // bool(nan) is True
}

}  // namespace
}  // namespace opfuse
