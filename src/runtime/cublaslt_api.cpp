#include "runtime/cublaslt_api.h"

#include <mutex>

#include "runtime/dynamic_library.h"

namespace opfuse {

const lt::Api& cublaslt() {
  static lt::Api api;
  static std::once_flag once;
  std::call_once(once, [] {
    void* h = open_library({"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"}, &api.path, &api.error);
    if (!h) return;
    std::string* e = &api.error;
    bool ok = bind(h, api.Create, "cublasLtCreate", e) & bind(h, api.GetVersion, "cublasLtGetVersion", e) &
              bind(h, api.GetStatusString, "cublasLtGetStatusString", e) &
              bind(h, api.MatmulDescCreate, "cublasLtMatmulDescCreate", e) &
              bind(h, api.MatmulDescDestroy, "cublasLtMatmulDescDestroy", e) &
              bind(h, api.MatmulDescSetAttribute, "cublasLtMatmulDescSetAttribute", e) &
              bind(h, api.MatrixLayoutCreate, "cublasLtMatrixLayoutCreate", e) &
              bind(h, api.MatrixLayoutDestroy, "cublasLtMatrixLayoutDestroy", e) &
              bind(h, api.MatrixLayoutSetAttribute, "cublasLtMatrixLayoutSetAttribute", e) &
              bind(h, api.MatmulPreferenceCreate, "cublasLtMatmulPreferenceCreate", e) &
              bind(h, api.MatmulPreferenceDestroy, "cublasLtMatmulPreferenceDestroy", e) &
              bind(h, api.MatmulPreferenceSetAttribute, "cublasLtMatmulPreferenceSetAttribute", e) &
              bind(h, api.MatmulAlgoGetHeuristic, "cublasLtMatmulAlgoGetHeuristic", e) &
              bind(h, api.Matmul, "cublasLtMatmul", e);
    api.loaded = ok;
    std::string optional;  // a missing optional symbol only turns its use off
    bind(h, api.AlgoConfigGetAttribute, "cublasLtMatmulAlgoConfigGetAttribute", &optional);
    bind(h, api.AlgoConfigSetAttribute, "cublasLtMatmulAlgoConfigSetAttribute", &optional);
    bind(h, api.AlgoCapGetAttribute, "cublasLtMatmulAlgoCapGetAttribute", &optional);
    bind(h, api.AlgoCheck, "cublasLtMatmulAlgoCheck", &optional);
  });
  return api;
}

}  // namespace opfuse
