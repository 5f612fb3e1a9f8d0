// The FFI handlers of jaxdata.host, as C symbols for module.cc's registrations().
#pragma once
#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdata_host_gather_cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdata_host_slice_cpu);
#ifdef JAXDATA_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdata_host_gather_cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdata_host_slice_cuda);
#endif
