// Helpers for CUDA runtime calls: turn a cudaError_t into a message or an ffi::Error.
#pragma once
#ifdef JAXDATA_WITH_CUDA
#include <cuda_runtime.h>

#include <string>

#include "xla/ffi/api/ffi.h"

namespace jaxdata {

inline std::string CudaMessage(cudaError_t err, const char* what) {
  return std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
}

// Inside FFI handlers: return early with an ffi::Error when a CUDA call fails.
#define JAXDATA_CUDA_RETURN_IF_ERROR(expr)                                              \
  do {                                                                                  \
    cudaError_t jaxdata_err_ = (expr);                                                  \
    if (jaxdata_err_ != cudaSuccess)                                                    \
      return ::xla::ffi::Error::Internal(::jaxdata::CudaMessage(jaxdata_err_, #expr));  \
  } while (0)

}  // namespace jaxdata
#endif  // JAXDATA_WITH_CUDA
