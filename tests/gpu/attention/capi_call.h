// What the C shims over the CPU references share (reference_capi.cpp,
// reference_bwd_capi.cpp): ctypes sees no C++ exception, so the shim runs
// the reference through capi_call, which returns 0, or 1 with the
// exception's message in err (err_len bytes, NUL-terminated).
#pragma once
#include <cstddef>
#include <cstring>
#include <stdexcept>

template <class F>
int capi_call(char* err, int err_len, F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    if (err && err_len > 0) {
      std::strncpy(err, e.what(), static_cast<size_t>(err_len) - 1);
      err[err_len - 1] = 0;
    }
    return 1;
  }
  return 0;
}
