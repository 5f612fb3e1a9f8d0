// The FFI handlers of jaxdata.hector: their binding, and their C symbols for module.cc's
// registrations().
#pragma once
#include <cstdint>
#include <string_view>

#include "xla/ffi/api/api.h"
#include "xla/ffi/api/ffi.h"

namespace jaxdata::hector {

// The binding of jaxdata_hector_launch, written once for both platforms: `Context` is
// ffi::ThreadPool on the CPU and ffi::PlatformStream<cudaStream_t> on CUDA. The buffers are
// whatever the call passes (operands, then results), as jaxdata/hector/operands.py lays them out.
// `kernel`, `grid` and `block` are the launch; on CUDA, a call with a `tune_file` also passes
// `tune_launches`, (kernel, grid, block) for each tiling of the instance, to time on its first
// run (jaxdata/hector/tuning.py); the CPU takes neither.
template <typename Context>
auto BindLaunch() {
  return xla::ffi::Ffi::Bind()
      .Ctx<Context>()
      .RemainingArgs()
      .RemainingRets()
      .template Attr<int64_t>("kernel")
      .template Attr<xla::ffi::Span<const int64_t>>("scalars")
      .template Attr<int64_t>("grid")
      .template Attr<int64_t>("block")
      .template Attr<int32_t>("zero_outputs")
      .template Attr<xla::ffi::Span<const int64_t>>("tune_launches")
      .template Attr<std::string_view>("tune_file");
}

}  // namespace jaxdata::hector

XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdata_hector_launch_cpu);
#ifdef JAXDATA_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdata_hector_launch_cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdata_hector_tune_cuda);
#endif
