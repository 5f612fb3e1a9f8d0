// jaxdata_hector_launch on CUDA: launches a generated kernel on XLA's stream.
//
// Every generated CUDA kernel takes one parameter, a struct of the call's buffer pointers (operands
// then results) followed by the int64 scalars, as jaxdata/hector/operands.py lays them out; this
// file builds that struct from whatever the call passes (it counts nothing) and launches.
//
// A call with a `tune_file` carries every tiling of one tensor-core instance (`tune_launches`:
// kernel, grid, block each; jaxdata/hector/tuning.py). Its first run in the process times each
// tiling on the call's own operands (a warm-up, then the median of 3 launches, outputs zeroed
// before each as before any launch), keeps the fastest for the process, writes the choice to
// `tune_file` (to a temporary name, then renamed: readers never see half a file) and runs it;
// later runs launch the kept tiling directly. A tiling that fails to launch is timed as
// infinite; if all do, the call fails with that error. A stream being captured into a CUDA
// graph cannot be timed: such a call launches the default tiling and tunes nothing.
//
// The handler is registered twice. `jaxdata_hector_launch_cuda` is command-buffer compatible:
// its host work is a table lookup, cudaMemsetAsync and cudaLaunchKernel, all of which a stream
// capture records, so XLA puts the call in its CUDA graphs with the fusions around it (one
// graph launch per step instead of a launch per kernel; jaxdata/hector/runtime.py lowers every
// call without a tune file to it). `jaxdata_hector_tune_cuda` is the same function without that
// trait, for the calls that carry a tune file: XLA runs them outside its graphs, so their first
// run is not captured and can time the tilings.
#include <cuda_runtime.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/cuda_check.h"
#include "hector/handlers.h"
#include "hector/kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxdata::hector {
namespace {

struct Launch {
  const void* fn;
  int64_t grid, block;
};

// The call's kernel and its buffers, ready to launch in any tiling.
struct Call {
  cudaStream_t stream;
  std::vector<uint64_t> params;  // pointers and scalars, 8 bytes each
  std::vector<std::pair<void*, size_t>> zeroed;  // outputs the kernel sums into

  cudaError_t Zero() const {
    for (const auto& [ptr, bytes] : zeroed) {
      if (cudaError_t err = cudaMemsetAsync(ptr, 0, bytes, stream); err != cudaSuccess) return err;
    }
    return cudaSuccess;
  }

  cudaError_t Run(const Launch& l) const {
    if (l.grid <= 0) return cudaSuccess;  // nothing to do (empty graph)
    void* kernel_args[] = {const_cast<uint64_t*>(params.data())};
    return cudaLaunchKernel(l.fn, dim3(static_cast<unsigned>(l.grid)),
                            dim3(static_cast<unsigned>(l.block)), kernel_args, 0, stream);
  }
};

ffi::Error Check(const Launch& l, int64_t kernel) {
  if (l.fn == nullptr) {
    return ffi::Error::Internal("jaxdata_hector_launch: kernel " + std::to_string(kernel) +
                                " is not loaded in this process");
  }
  if (l.grid > 0x7fffffff || (l.grid > 0 && (l.block <= 0 || l.block > 1024))) {
    return ffi::Error::InvalidArgument("jaxdata_hector_launch: bad launch configuration grid=" +
                                       std::to_string(l.grid) +
                                       " block=" + std::to_string(l.block));
  }
  return ffi::Error::Success();
}

std::atomic<int64_t> direct_calls{0}, captured_calls{0};

// The tilings chosen in this process, by choice file.
std::mutex tune_mu;
std::unordered_map<std::string, size_t>& Chosen() {
  static auto* chosen = new std::unordered_map<std::string, size_t>();
  return *chosen;
}

// Median microseconds of 3 launches of `l` after a warm-up (infinite if it fails to launch).
double TimeUs(const Call& call, const Launch& l, cudaEvent_t start, cudaEvent_t stop) {
  float ms[3];
  for (int rep = -1; rep < 3; ++rep) {
    if (call.Zero() != cudaSuccess) return INFINITY;
    if (rep >= 0 && cudaEventRecord(start, call.stream) != cudaSuccess) return INFINITY;
    if (call.Run(l) != cudaSuccess) {
      cudaGetLastError();  // a launch error (resources) is not sticky: clear it
      return INFINITY;
    }
    if (rep < 0) continue;
    if (cudaEventRecord(stop, call.stream) != cudaSuccess ||
        cudaEventSynchronize(stop) != cudaSuccess ||
        cudaEventElapsedTime(&ms[rep], start, stop) != cudaSuccess) {
      return INFINITY;
    }
  }
  std::sort(ms, ms + 3);
  return 1e3 * ms[1];
}

// `best`: the index of the fastest of `launches`, timed on `call`'s operands; written to `file`.
ffi::Error Tune(const Call& call, const std::vector<Launch>& launches, const std::string& file,
                size_t* best) {
  cudaEvent_t start, stop;
  JAXDATA_CUDA_RETURN_IF_ERROR(cudaEventCreate(&start));
  if (cudaError_t err = cudaEventCreate(&stop); err != cudaSuccess) {
    cudaEventDestroy(start);
    return ffi::Error::Internal(CudaMessage(err, "cudaEventCreate"));
  }
  std::vector<double> us;
  for (const Launch& l : launches) us.push_back(TimeUs(call, l, start, stop));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  *best = std::min_element(us.begin(), us.end()) - us.begin();
  if (std::isinf(us[*best])) return ffi::Error::Success();  // none launched: the launch says why
  // POSIX I/O, not iostreams: the extension shares its process with other libstdc++ builds
  std::string text = "jaxdata-hector-tune 1\nchoice " + std::to_string(*best) + "\ntimes_us";
  for (double t : us) {
    char cell[32] = " inf";
    if (!std::isinf(t)) std::snprintf(cell, sizeof cell, " %.3f", t);
    text += cell;
  }
  text += "\n";
  const std::string tmp = file + ".tmp" + std::to_string(getpid());
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd >= 0) {  // otherwise the choice is kept in memory only
    const bool whole = write(fd, text.data(), text.size()) == ssize_t(text.size());
    close(fd);
    if (!whole || std::rename(tmp.c_str(), file.c_str()) != 0) std::remove(tmp.c_str());
  }
  return ffi::Error::Success();
}

ffi::Error LaunchCuda(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                      int64_t kernel, ffi::Span<const int64_t> scalars, int64_t grid,
                      int64_t block, int32_t zero_outputs,
                      ffi::Span<const int64_t> tune_launches, std::string_view tune_file) {
  Call call{stream, {}, {}};
  call.params.reserve(args.size() + rets.size() + scalars.size());
  for (size_t i = 0; i < args.size(); ++i) {
    auto b = args.get<ffi::AnyBuffer>(i);
    if (b.has_error()) return b.error();
    call.params.push_back(reinterpret_cast<uint64_t>(b->untyped_data()));
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto b = rets.get<ffi::AnyBuffer>(i);
    if (b.has_error()) return b.error();
    if (zero_outputs) call.zeroed.emplace_back((*b)->untyped_data(), (*b)->size_bytes());
    call.params.push_back(reinterpret_cast<uint64_t>((*b)->untyped_data()));
  }
  for (int64_t s : scalars) call.params.push_back(static_cast<uint64_t>(s));
  Launch launch{FindCudaKernel(kernel), grid, block};
  if (ffi::Error e = Check(launch, kernel); e.failure()) return e;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  JAXDATA_CUDA_RETURN_IF_ERROR(cudaStreamIsCapturing(stream, &capture));
  (capture == cudaStreamCaptureStatusNone ? direct_calls : captured_calls)
      .fetch_add(1, std::memory_order_relaxed);
  if (!tune_file.empty()) {
    if (tune_launches.size() % 3 != 0 || tune_launches.size() < 3) {
      return ffi::Error::InvalidArgument("jaxdata_hector_launch: tune_launches is not triples");
    }
    std::vector<Launch> tilings;
    for (size_t i = 0; i < tune_launches.size(); i += 3) {
      tilings.push_back({FindCudaKernel(tune_launches[i]), tune_launches[i + 1],
                         tune_launches[i + 2]});
      if (ffi::Error e = Check(tilings.back(), tune_launches[i]); e.failure()) return e;
    }
    const std::string file(tune_file);
    std::lock_guard<std::mutex> lock(tune_mu);
    size_t pick = 0;  // a stream being captured cannot be timed: the default, untuned
    if (auto it = Chosen().find(file); it != Chosen().end()) {
      pick = it->second;
    } else if (capture == cudaStreamCaptureStatusNone) {
      if (ffi::Error e = Tune(call, tilings, file, &pick); e.failure()) return e;
      Chosen().emplace(file, pick);
    }
    launch = tilings[pick];
  }
  JAXDATA_CUDA_RETURN_IF_ERROR(call.Zero());
  JAXDATA_CUDA_RETURN_IF_ERROR(call.Run(launch));
  return ffi::Error::Success();
}

}  // namespace

LaunchCounts CudaLaunchCounts() {
  return {direct_calls.load(std::memory_order_relaxed),
          captured_calls.load(std::memory_order_relaxed)};
}

}  // namespace jaxdata::hector

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxdata_hector_launch_cuda, jaxdata::hector::LaunchCuda,
    jaxdata::hector::BindLaunch<ffi::PlatformStream<cudaStream_t>>(),
    {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxdata_hector_tune_cuda, jaxdata::hector::LaunchCuda,
    jaxdata::hector::BindLaunch<ffi::PlatformStream<cudaStream_t>>());
