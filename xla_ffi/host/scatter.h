// What host_scatter_add's CPU and CUDA handlers share: the operands' geometry.
#pragma once
#include <cstdint>

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

}  // namespace jaxdata
