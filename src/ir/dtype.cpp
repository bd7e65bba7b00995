#include "ir/dtype.h"

#include <cmath>
#include <cstring>

namespace opfuse {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::Bool: return "b8";
    case DType::Int32: return "i32";
    case DType::Int64: return "i64";
    case DType::Float16: return "f16";
    case DType::BFloat16: return "bf16";
    case DType::Float32: return "f32";
    case DType::Float64: return "f64";
  }
  return "?";
}

bool parse_dtype(const std::string& s, DType* out) {
  static const struct { const char* n; DType t; } table[] = {
      {"b8", DType::Bool},      {"i32", DType::Int32},   {"i64", DType::Int64},
      {"f16", DType::Float16},  {"bf16", DType::BFloat16}, {"f32", DType::Float32},
      {"f64", DType::Float64}};
  for (const auto& e : table)
    if (s == e.n) { *out = e.t; return true; }
  return false;
}

int dtype_size(DType t) {
  switch (t) {
    case DType::Bool: return 1;
    case DType::Float16: case DType::BFloat16: return 2;
    case DType::Int32: case DType::Float32: return 4;
    case DType::Int64: case DType::Float64: return 8;
  }
  return 0;
}

bool is_floating(DType t) {
  return t == DType::Float16 || t == DType::BFloat16 || t == DType::Float32 || t == DType::Float64;
}
bool is_integral(DType t) { return t == DType::Int32 || t == DType::Int64; }
int dtype_category(DType t) { return t == DType::Bool ? 0 : is_integral(t) ? 1 : 2; }

DType promote_types(DType a, DType b) {
  if (a == b) return a;
  int ca = dtype_category(a), cb = dtype_category(b);
  if (ca != cb) return ca > cb ? a : b;
  if (ca == 1) return DType::Int64;  // i32 with i64
  // floating: f16 with bf16 gives f32 (as in PyTorch); otherwise the wider.
  if ((a == DType::Float16 && b == DType::BFloat16) || (a == DType::BFloat16 && b == DType::Float16))
    return DType::Float32;
  return dtype_size(a) >= dtype_size(b) ? a : b;
}

DType compute_dtype(DType t) {
  return (t == DType::Float16 || t == DType::BFloat16) ? DType::Float32 : t;
}

static float round_bf16(float f) {
  if (std::isnan(f)) return f;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest even
  u &= 0xFFFF0000u;
  std::memcpy(&f, &u, 4);
  return f;
}

static float round_f16(float f) {
  if (std::isnan(f) || std::isinf(f)) return f;
  float a = std::fabs(f);
  if (a >= 65520.0f) return std::copysign(INFINITY, f);
  // Spacing of f16 values around a: 2^(e-10), subnormal spacing 2^-24.
  int e;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5,1)
  int exp2 = e - 1;
  if (exp2 < -14) exp2 = -14;
  double q = std::ldexp(1.0, exp2 - 10);
  double r = std::nearbyint(static_cast<double>(f) / q) * q;  // ties to even
  return static_cast<float>(r);
}

double round_to_dtype(double v, DType t) {
  switch (t) {
    case DType::Bool: return v != 0.0 ? 1.0 : 0.0;
    case DType::Int32: {
      if (std::isnan(v)) return 0;
      return static_cast<double>(static_cast<int32_t>(static_cast<int64_t>(std::trunc(v))));
    }
    case DType::Int64: return std::isnan(v) ? 0 : std::trunc(v) + 0.0;  // + 0.0: an integer has no -0 (trunc(-0.4) is -0.0)
    case DType::Float16: return round_f16(static_cast<float>(v));
    case DType::BFloat16: return round_bf16(static_cast<float>(v));
    case DType::Float32: return static_cast<float>(v);
    case DType::Float64: return v;
  }
  return v;
}

}  // namespace opfuse
