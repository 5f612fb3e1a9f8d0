// The FFI handlers of jaxdata.host, as C symbols for module.cc's registrations().
#pragma once
#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdata_host_gather_cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdata_host_slice_cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdata_host_sample_cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdata_sample_cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdata_host_scatter_add_cpu);
#ifdef JAXDATA_WITH_CUDA
#include <cstddef>
#include <cstdint>

XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdata_host_gather_cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdata_host_slice_cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdata_host_sample_cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdata_sample_cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdata_host_scatter_add_cuda);

namespace jaxdata {
// Bytes of scratch output host_gather needs to sort n indices into a table of `rows` rows on the
// current GPU (0: it will not sort).
size_t HostGatherSortScratchBytes(int64_t n, int64_t rows);
}  // namespace jaxdata
#endif
