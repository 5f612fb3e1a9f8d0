// The FFI handlers of jaxdata.hector, as C symbols for module.cc's registrations().
#pragma once
#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdata_hector_launch_cpu);
#ifdef JAXDATA_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdata_hector_launch_cuda);
#endif
