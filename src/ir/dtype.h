// Element types of the tensor-graph IR and PyTorch's type-promotion lattice.
#pragma once
#include <cstdint>
#include <string>

namespace opfuse {

enum class DType : uint8_t { Bool, Int32, Int64, Float16, BFloat16, Float32, Float64 };

// Short names used by the IR text form: b8 i32 i64 f16 bf16 f32 f64.
const char* dtype_name(DType t);
bool parse_dtype(const std::string& s, DType* out);

int dtype_size(DType t);
bool is_floating(DType t);
bool is_integral(DType t);  // excludes bool

// Category used by promotion with scalars: 0 bool, 1 integer, 2 floating.
int dtype_category(DType t);

// torch.promote_types for two dtypes.
DType promote_types(DType a, DType b);

// The type that arithmetic is carried out in: half types compute in float32
// (as PyTorch's kernels do internally), everything else in itself.
DType compute_dtype(DType t);

// Rounds a double to the value representable in `t` (the oracle's way of
// emulating each dtype's storage).
double round_to_dtype(double v, DType t);

}  // namespace opfuse
