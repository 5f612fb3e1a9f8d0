// What host_gather computes, shared by the CPU and CUDA implementations.
//
// Semantics are jnp.take(table, idx, axis=0, mode=...): in "fill" mode an index in [-rows, 0)
// counts from the end and anything else outside [0, rows) yields a row of the fill value; in
// "clip" mode an index is clamped to [0, rows - 1] (negative indices go to row 0).
#pragma once
#include <cstdint>

#include "table.h"  // Handle
#include "xla/ffi/api/ffi.h"

#if defined(__CUDACC__)
#define JAXDATA_HD __host__ __device__ __forceinline__
#else
#define JAXDATA_HD inline
#endif

namespace jaxdata {

enum GatherMode : int32_t { kModeFill = 0, kModeClip = 1 };

// The table row that output row `raw` reads, or -1 for a row of the fill value.
template <typename I>
JAXDATA_HD int64_t ResolveRow(I raw, int64_t rows, int32_t mode) {
  int64_t i = static_cast<int64_t>(raw);
  if (mode == kModeClip) return i < 0 ? 0 : (i >= rows ? rows - 1 : i);
  if (i < 0) i += rows;
  return (i >= 0 && i < rows) ? i : -1;
}

// The fill element's bit pattern repeated over `n` bytes (itemsize divides n).
inline void RepeatPattern(uint64_t bits, int64_t itemsize, unsigned char* out, int64_t n) {
  for (int64_t b = 0; b < n; ++b) out[b] = static_cast<unsigned char>(bits >> (8 * (b % itemsize)));
}

// The FFI bindings of host_gather and host_slice, written once for both platforms: `Context` is
// the platform's context (ffi::ThreadPool on the CPU, ffi::PlatformStream<cudaStream_t> on
// CUDA), so the operands and attribute names jaxdata/host/gather.py passes cannot drift apart.
// (`.template` because the chain's type depends on Context.)
template <typename Context>
auto BindHostGather() {
  return xla::ffi::Ffi::Bind()
      .Ctx<Context>()
      .template Arg<Handle>()
      .template Arg<xla::ffi::AnyBuffer>()  // indices
      .template Ret<xla::ffi::AnyBuffer>()  // out
      .template Ret<xla::ffi::AnyBuffer>()  // scratch (for sorting on CUDA)
      .template Attr<int64_t>("rows")
      .template Attr<int32_t>("mode")
      .template Attr<int64_t>("fill_bits")
      .template Attr<int32_t>("sort");
}

template <typename Context>
auto BindHostSlice() {
  return xla::ffi::Ffi::Bind()
      .Ctx<Context>()
      .template Arg<Handle>()
      .template Ret<xla::ffi::AnyBuffer>()
      .template Attr<int64_t>("rows")
      .template Attr<int64_t>("start");
}

}  // namespace jaxdata
