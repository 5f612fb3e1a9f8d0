// jaxdata_hector_launch on CUDA: launches a generated kernel on XLA's stream.
//
// Every generated CUDA kernel takes one parameter, a struct of the call's buffer pointers (operands
// then results) followed by the int64 scalars, as jaxdata/hector/operands.py lays them out; this
// file builds that struct from whatever the call passes (it counts nothing) and launches.
#include <cuda_runtime.h>

#include <cstring>
#include <string>
#include <vector>

#include "common/cuda_check.h"
#include "hector/handlers.h"
#include "hector/kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxdata::hector {
namespace {

ffi::Error LaunchCuda(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                      int64_t kernel, ffi::Span<const int64_t> scalars, int64_t grid,
                      int64_t block, int64_t shared_bytes, int32_t zero_outputs) {
  const void* fn = FindCudaKernel(kernel);
  if (fn == nullptr) {
    return ffi::Error::Internal("jaxdata_hector_launch: kernel " + std::to_string(kernel) +
                                " is not loaded in this process");
  }
  std::vector<uint64_t> params;  // pointers and scalars, 8 bytes each
  params.reserve(args.size() + rets.size() + scalars.size());
  for (size_t i = 0; i < args.size(); ++i) {
    auto b = args.get<ffi::AnyBuffer>(i);
    if (b.has_error()) return b.error();
    params.push_back(reinterpret_cast<uint64_t>(b->untyped_data()));
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto b = rets.get<ffi::AnyBuffer>(i);
    if (b.has_error()) return b.error();
    if (zero_outputs) {
      JAXDATA_CUDA_RETURN_IF_ERROR(
          cudaMemsetAsync((*b)->untyped_data(), 0, (*b)->size_bytes(), stream));
    }
    params.push_back(reinterpret_cast<uint64_t>((*b)->untyped_data()));
  }
  for (int64_t s : scalars) params.push_back(static_cast<uint64_t>(s));
  if (grid <= 0) return ffi::Error::Success();  // nothing to do (empty graph)
  if (grid > 0x7fffffff || block <= 0 || block > 1024) {
    return ffi::Error::InvalidArgument("jaxdata_hector_launch: bad launch configuration grid=" +
                                       std::to_string(grid) + " block=" + std::to_string(block));
  }
  if (shared_bytes > 48 * 1024) {
    JAXDATA_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
        fn, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared_bytes)));
  }
  void* kernel_args[] = {params.data()};
  JAXDATA_CUDA_RETURN_IF_ERROR(cudaLaunchKernel(fn, dim3(static_cast<unsigned>(grid)),
                                                dim3(static_cast<unsigned>(block)), kernel_args,
                                                static_cast<size_t>(shared_bytes), stream));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxdata::hector

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxdata_hector_launch_cuda, jaxdata::hector::LaunchCuda,
    jaxdata::hector::BindLaunch<ffi::PlatformStream<cudaStream_t>>());
