// jaxdata_hector_launch on the CPU: runs a generated kernel with XLA's thread pool.
#include <cstring>
#include <string>
#include <vector>

#include "common/parallel.h"
#include "hector/handlers.h"
#include "hector/kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxdata::hector {
namespace {

void PoolParallelFor(void* pool, int64_t n, int64_t grain,
                     void (*body)(void* arg, int64_t begin, int64_t end), void* arg) {
  ParallelFor(*static_cast<ffi::ThreadPool*>(pool), n, grain,
              [&](int64_t begin, int64_t end) { body(arg, begin, end); });
}

ffi::Error LaunchCpu(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::RemainingRets rets,
                     int64_t kernel, ffi::Span<const int64_t> scalars, int64_t grid, int64_t block,
                     int32_t zero_outputs,
                     ffi::Span<const int64_t> tune_launches, std::string_view tune_file) {
  (void)grid, (void)block;  // the CUDA launch configuration
  if (tune_launches.size() != 0 || !tune_file.empty()) {
    return ffi::Error::InvalidArgument("jaxdata_hector_launch: tuning is for CUDA kernels only");
  }
  jaxdata_cpu_kernel fn = FindCpuKernel(kernel);
  if (fn == nullptr) {
    return ffi::Error::Internal("jaxdata_hector_launch: kernel " + std::to_string(kernel) +
                                " is not loaded in this process");
  }
  std::vector<void*> buffers;
  buffers.reserve(args.size() + rets.size());
  for (size_t i = 0; i < args.size(); ++i) {
    auto b = args.get<ffi::AnyBuffer>(i);
    if (b.has_error()) return b.error();
    buffers.push_back(b->untyped_data());
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto b = rets.get<ffi::AnyBuffer>(i);
    if (b.has_error()) return b.error();
    if (zero_outputs) std::memset((*b)->untyped_data(), 0, (*b)->size_bytes());
    buffers.push_back((*b)->untyped_data());
  }
  jaxdata_cpu_runtime rt{kCpuAbiVersion, &pool, &PoolParallelFor};
  if (int status = fn(buffers.data(), scalars.begin(), &rt); status != 0) {
    return ffi::Error::Internal("jaxdata_hector_launch: generated kernel failed with status " +
                                std::to_string(status));
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxdata::hector

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdata_hector_launch_cpu, jaxdata::hector::LaunchCpu,
                              jaxdata::hector::BindLaunch<ffi::ThreadPool>());
