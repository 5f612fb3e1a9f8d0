// What host_scatter_add's CPU and CUDA handlers share: the operands' geometry.
#pragma once
#include <cstdint>

#include "table.h"  // Handle
#include "xla/ffi/api/ffi.h"

namespace jaxdata {

// Sorted rows [n], their positions perm [n], updates [n, cols]: the columns, or an error.
inline xla::ffi::ErrorOr<int64_t> ScatterColumns(const xla::ffi::AnyBuffer& rows,
                                                 const xla::ffi::Buffer<xla::ffi::S32>& perm,
                                                 const xla::ffi::AnyBuffer& updates) {
  const int64_t n = rows.element_count();
  auto dims = updates.dimensions();
  if (dims.size() != 2 || dims[0] != n || perm.element_count() != n) {
    return xla::ffi::Unexpected(
        xla::ffi::Error::InvalidArgument("jaxdata_host_scatter_add: operand shapes do not match"));
  }
  return int64_t(dims[1]);
}

// The FFI binding of host_scatter_add, written once for both platforms: `Context` is
// ffi::ThreadPool on the CPU and ffi::PlatformStream<cudaStream_t> on CUDA.
template <typename Context>
auto BindHostScatterAdd() {
  return xla::ffi::Ffi::Bind()
      .Ctx<Context>()
      .template Arg<Handle>()
      .template Arg<xla::ffi::AnyBuffer>()              // rows, sorted
      .template Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // perm
      .template Arg<xla::ffi::AnyBuffer>()              // updates
      .template Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // token
      .template Attr<int64_t>("rows");
}

}  // namespace jaxdata
