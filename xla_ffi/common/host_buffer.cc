#include "host_buffer.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <thread>
#include <vector>

#ifdef JAXDATA_WITH_CUDA
#include <cuda_runtime.h>

#include "cuda_check.h"
#endif

namespace jaxdata {
namespace {

class AllocationError : public std::bad_alloc {
 public:
  explicit AllocationError(std::string msg) : msg_(std::move(msg)) {}
  const char* what() const noexcept override { return msg_.c_str(); }

 private:
  std::string msg_;
};

std::string GiB(size_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f GiB", bytes / double(1ull << 30));
  return buf;
}

}  // namespace

size_t PhysicalMemoryBytes() {
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? size_t(pages) * size_t(page) : 0;
}

bool BuiltWithCuda() {
#ifdef JAXDATA_WITH_CUDA
  return true;
#else
  return false;
#endif
}

int CudaDeviceCount() {
#ifdef JAXDATA_WITH_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
#else
  return 0;
#endif
}

int CudaRuntimeVersion() {
#ifdef JAXDATA_WITH_CUDA
  int v = 0;
  return cudaRuntimeGetVersion(&v) == cudaSuccess ? v : 0;
#else
  return 0;
#endif
}

int CudaDriverVersion() {
#ifdef JAXDATA_WITH_CUDA
  int v = 0;
  return cudaDriverGetVersion(&v) == cudaSuccess ? v : 0;
#else
  return 0;
#endif
}

std::shared_ptr<HostBuffer> HostBuffer::Allocate(size_t nbytes, bool pinned) {
  const size_t ram = PhysicalMemoryBytes();
  if (ram != 0 && nbytes > ram) {
    throw AllocationError("a host buffer of " + GiB(nbytes) + " cannot be " +
                          (pinned ? "pinned" : "allocated") + ": this machine has " + GiB(ram) +
                          " of physical memory");
  }
  std::shared_ptr<HostBuffer> buf(new HostBuffer());
  buf->size_ = nbytes;
  const size_t alloc = std::max<size_t>(nbytes, 1);
  if (pinned) {
#ifdef JAXDATA_WITH_CUDA
    void* p = nullptr;
    cudaError_t err = cudaHostAlloc(&p, alloc, cudaHostAllocPortable | cudaHostAllocMapped);
    if (err != cudaSuccess) {
      cudaGetLastError();
      throw AllocationError("cudaHostAlloc could not pin " + GiB(nbytes) + " of host memory: " +
                            cudaGetErrorString(err));
    }
    void* dp = nullptr;
    err = cudaHostGetDevicePointer(&dp, p, 0);
    if (err != cudaSuccess) {
      cudaFreeHost(p);
      throw AllocationError(CudaMessage(err, "cudaHostGetDevicePointer"));
    }
    buf->data_ = static_cast<char*>(p);
    buf->device_data_ = static_cast<char*>(dp);
    buf->pinned_ = true;
#else
    throw AllocationError("pinned host memory needs jaxdata built with CUDA");
#endif
  } else {
    void* p = nullptr;
    if (posix_memalign(&p, 4096, alloc) != 0) {
      throw AllocationError("could not allocate " + GiB(nbytes) + " of host memory");
    }
    buf->data_ = static_cast<char*>(p);
  }
  return buf;
}

HostBuffer::~HostBuffer() {
  if (!data_) return;
  if (pinned_) {
#ifdef JAXDATA_WITH_CUDA
    // Kernels that read this memory may still be queued on some device's streams: wait for
    // every device before the pages go back. Errors are ignored (the runtime may already be
    // shutting down at interpreter exit).
    int n = 0, current = 0;
    if (cudaGetDeviceCount(&n) == cudaSuccess && cudaGetDevice(&current) == cudaSuccess) {
      for (int d = 0; d < n; ++d) {
        if (cudaSetDevice(d) == cudaSuccess) cudaDeviceSynchronize();
      }
      cudaSetDevice(current);
    }
    cudaFreeHost(data_);
    cudaGetLastError();
#endif
  } else {
    std::free(data_);
  }
}

void ParallelMemcpy(void* dst, const void* src, size_t nbytes) {
  constexpr size_t kMinPerThread = size_t(64) << 20;
  const size_t hw = std::max(1u, std::thread::hardware_concurrency());
  const size_t nthreads = std::min<size_t>(std::min<size_t>(hw, 16), nbytes / kMinPerThread + 1);
  if (nthreads <= 1) {
    std::memcpy(dst, src, nbytes);
    return;
  }
  const size_t chunk = (nbytes + nthreads - 1) / nthreads;
  std::vector<std::thread> threads;
  for (size_t t = 0; t < nthreads; ++t) {
    const size_t begin = t * chunk, end = std::min(nbytes, begin + chunk);
    if (begin >= end) break;
    threads.emplace_back([=] {
      std::memcpy(static_cast<char*>(dst) + begin, static_cast<const char*>(src) + begin,
                  end - begin);
    });
  }
  for (auto& th : threads) th.join();
}

}  // namespace jaxdata
