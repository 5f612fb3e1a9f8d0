// Generated kernels loaded at run time, and the ABI they are written against.
//
// jaxdata.hector generates C++ and CUDA source for each kernel instance, compiles it (the system
// C++ compiler; NVRTC for CUDA) and registers the result here under an id derived from the source
// hash. One FFI target per platform, jaxdata_hector_launch, finds the kernel by that id and runs it
// with the call's buffers: a CPU kernel gets XLA's thread pool through CpuRuntime, a CUDA kernel is
// launched on XLA's stream.
#pragma once
#include <cstdint>
#include <string>

// The ABI of a generated CPU kernel (jaxdata/hector/templates/cpu.h declares the same):
//   extern "C" int jaxdata_hector_kernel(void* const* buffers, const int64_t* scalars,
//                                        const jaxdata_cpu_runtime* rt);
// buffers: the call's operands then its results, in jaxdata/hector/operands.py's order, passed
// through as they come (this side counts nothing); returns 0, or nonzero on an error it detected.
extern "C" {
struct jaxdata_cpu_runtime {
  int64_t abi_version;  // kCpuAbiVersion
  void* pool;
  // Runs body(arg, begin, end) over [0, n) in chunks of about `grain`, on the pool and the caller.
  void (*parallel_for)(void* pool, int64_t n, int64_t grain,
                       void (*body)(void* arg, int64_t begin, int64_t end), void* arg);
};
typedef int (*jaxdata_cpu_kernel)(void* const* buffers, const int64_t* scalars,
                                  const jaxdata_cpu_runtime* rt);
}

namespace jaxdata::hector {

inline constexpr int64_t kCpuAbiVersion = 1;

// Loads `symbol` from the shared library at `path` as kernel `id` (a no-op if `id` is loaded).
// Throws std::runtime_error with dlerror()'s message.
void LoadCpuKernel(int64_t id, const std::string& path, const std::string& symbol);
jaxdata_cpu_kernel FindCpuKernel(int64_t id);  // nullptr when not loaded

// Loads kernel `name` from a cubin (or PTX) image as kernel `id`; no-op if loaded. Throws.
void LoadCudaKernel(int64_t id, const std::string& image, const std::string& name);
const void* FindCudaKernel(int64_t id);  // a cudaKernel_t; nullptr when not loaded

// Compute capability (major * 10 + minor) of the current CUDA device; 0 without one.
int CudaComputeCapability();

// How often jaxdata_hector_launch's CUDA handler has run in this process: on a stream directly,
// and on a stream being captured into a CUDA graph (XLA's command buffers record a call once and
// then replay its kernels without calling the handler). Both 0 without CUDA.
struct LaunchCounts {
  int64_t direct, captured;
};
LaunchCounts CudaLaunchCounts();

}  // namespace jaxdata::hector
