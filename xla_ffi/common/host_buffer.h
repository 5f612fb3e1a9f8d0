// HostBuffer: one block of host memory that GPU kernels may read directly.
//
// With CUDA built and a device visible, the block is page-locked and mapped into every GPU's
// address space (cudaHostAlloc with Portable|Mapped), so a kernel dereferences device_data()
// and the reads travel over PCIe without any CPU copy. Otherwise it is plain 4 KiB-aligned
// memory and only CPU code may touch it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>

namespace jaxdata {

class HostBuffer {
 public:
  // Throws std::bad_alloc (nanobind: MemoryError) with a message when the memory cannot be had.
  static std::shared_ptr<HostBuffer> Allocate(size_t nbytes, bool pinned);
  ~HostBuffer();
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  char* data() const { return data_; }
  // The address a GPU kernel uses; nullptr when the buffer is not mapped.
  const char* device_data() const { return device_data_; }
  size_t size() const { return size_; }
  bool pinned() const { return pinned_; }
  // Held by every in-place update of this memory (host_scatter_add), on any device: concurrent
  // updates of one buffer, through any table viewing it, run one after another, never interleaved.
  std::mutex& update_mutex() const { return update_mutex_; }

 private:
  HostBuffer() = default;
  char* data_ = nullptr;
  char* device_data_ = nullptr;
  size_t size_ = 0;
  bool pinned_ = false;
  mutable std::mutex update_mutex_;
};

// Physical memory of this machine in bytes (what can be pinned at the very most).
size_t PhysicalMemoryBytes();

// Whether this build has CUDA, and how many devices its runtime sees now (0 without a driver).
bool BuiltWithCuda();
int CudaDeviceCount();
int CudaRuntimeVersion();  // e.g. 13000; 0 without CUDA
int CudaDriverVersion();   // 0 without a driver

// Copies nbytes with several threads (large tables fill at memory bandwidth, not one core's).
void ParallelMemcpy(void* dst, const void* src, size_t nbytes);

}  // namespace jaxdata
