// host_scatter_add on NVIDIA GPUs: table[rows[j]] += updates[perm[j]] written straight into
// pinned, device-mapped host memory (zero-copy), on XLA's stream.
//
// As on the CPU (scatter_cpu.cc), a run of equal sorted rows is owned by its first position:
// thread (j, c) with j a run start adds the run's updates to column c of the row one after
// another, in their original order, rounding after each addition. No atomics, so the result is
// deterministic and bit-identical to the CPU's and to np.add.at.
//
// Concurrency: the same contract as on the CPU (calls on one table's memory run one after
// another, each as a whole), kept with the same lock. Atomics cannot keep it here: a device-scope
// atomicAdd on mapped host memory is atomic only among the threads of one GPU, not with respect
// to another GPU or the CPU updating the same table, and system-scope atomics over PCIe need
// cudaDevAttrHostNativeAtomicSupported, which x86 hosts do not offer. So the handler takes the
// table memory's update lock, launches the kernel, and releases the lock only once the stream
// has finished it: a scatter on another device or thread starts after this one's writes have
// reached host memory. To know which lock, the handler needs the table on the host, so it
// copies the handle back first; that wait is for the same preceding work the wait after the
// kernel would wait for anyway (it keeps the lock from being held meanwhile), so the call costs
// one extra round trip, not a second drain of the GPU. Concurrent calls on one table are
// serialized, each still using the whole GPU.
//
// The kernel also resolves the handle through the device's table registry (table_device.cuh),
// as host_gather's does: a table closed while the call is queued gets no addition, and since
// the handler waits for its kernel it reports that error on this very call.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>

#include "../common/cuda_check.h"
#include "handlers.h"
#include "scatter.h"
#include "table.h"
#include "table_device.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxdata {
namespace {

constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ T AddRounded(T a, T b) { return a + b; }
template <>
__device__ __forceinline__ int32_t AddRounded(int32_t a, int32_t b) {
  return int32_t(uint32_t(a) + uint32_t(b));
}
template <>
__device__ __forceinline__ int64_t AddRounded(int64_t a, int64_t b) {
  return int64_t(uint64_t(a) + uint64_t(b));
}
template <>
__device__ __forceinline__ __nv_bfloat16 AddRounded(__nv_bfloat16 a, __nv_bfloat16 b) {
  return __float2bfloat16_rn(__bfloat162float(a) + __bfloat162float(b));
}
template <>
__device__ __forceinline__ __half AddRounded(__half a, __half b) {
  return __float2half_rn(__half2float(a) + __half2float(b));
}

template <typename T, typename R>
__global__ void __launch_bounds__(kThreads)
    ScatterAddKernel(const R* __restrict__ rows, const int32_t* __restrict__ perm, int64_t n,
                     const T* __restrict__ updates, int64_t cols, DeviceTableArg handle,
                     int64_t table_rows) {
  T* table = reinterpret_cast<T*>(const_cast<char*>(ResolveTableForBlock(handle)));
  if (table == nullptr) return;  // a bad handle: add nothing
  const int64_t total = n * cols;
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < total;
       t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = t / cols, c = t - j * cols;
    const R row = rows[j];
    if ((j > 0 && rows[j - 1] == row) || row < 0 || int64_t(row) >= table_rows) continue;
    T* dst = table + int64_t(row) * cols + c;
    T acc = *dst;
    for (int64_t p = j; p < n && rows[p] == row; ++p) {
      acc = AddRounded(acc, updates[int64_t(perm[p]) * cols + c]);
    }
    *dst = acc;
  }
}

template <typename T, typename R>
cudaError_t Launch(cudaStream_t stream, const R* rows, const int32_t* perm, int64_t n,
                   const void* updates, int64_t cols, const DeviceTableArg& table,
                   int64_t table_rows) {
  const int64_t blocks = std::min<int64_t>((n * cols + kThreads - 1) / kThreads, 1 << 16);
  ScatterAddKernel<T, R><<<unsigned(blocks), kThreads, 0, stream>>>(
      rows, perm, n, static_cast<const T*>(updates), cols, table, table_rows);
  return cudaGetLastError();
}

template <typename R>
ffi::Error ScatterTyped(cudaStream_t stream, const R* rows, const int32_t* perm, int64_t n,
                        ffi::AnyBuffer& updates, int64_t cols, const DeviceTableArg& table,
                        int64_t table_rows) {
  const void* u = updates.untyped_data();
  switch (updates.element_type()) {
#define JAXDATA_CASE(TYPE, T)                                                                   \
  case ffi::TYPE:                                                                               \
    JAXDATA_CUDA_RETURN_IF_ERROR(                                                               \
        (Launch<T, R>(stream, rows, perm, n, u, cols, table, table_rows)));                     \
    return ffi::Error::Success();
    JAXDATA_CASE(F32, float)
    JAXDATA_CASE(F64, double)
    JAXDATA_CASE(S32, int32_t)
    JAXDATA_CASE(S64, int64_t)
    JAXDATA_CASE(BF16, __nv_bfloat16)
    JAXDATA_CASE(F16, __half)
#undef JAXDATA_CASE
    default:
      return ffi::Error::InvalidArgument(
          "jaxdata_host_scatter_add: updates must be float32, float64, bfloat16, float16, int32 "
          "or int64");
  }
}

ffi::Error HostScatterAddCuda(cudaStream_t stream, Handle handle, ffi::AnyBuffer rows,
                              ffi::Buffer<ffi::S32> perm, ffi::AnyBuffer updates,
                              ffi::Result<ffi::Buffer<ffi::S32>> token, int64_t table_rows) {
  const int64_t n = rows.element_count();
  auto columns = ScatterColumns(rows, perm, updates);
  if (columns.has_error()) return columns.error();
  const int64_t cols = *columns;
  if (rows.element_type() != ffi::S32 && rows.element_type() != ffi::S64) {
    return ffi::Error::InvalidArgument("jaxdata_host_scatter_add: rows must be int32 or int64");
  }
  auto tables = StreamDeviceTables(stream);
  if (tables.has_error()) return tables.error();
  if (auto err = TakeDeviceError(*tables); !err.success()) return err;
  const int64_t row_bytes = cols * int64_t(ffi::ByteWidth(updates.element_type()));
  int64_t id = 0;  // also waits for the stream: the operands are ready from here on
  if (auto err = DeviceHandleValues(stream, {&handle}, &id); !err.success()) return err;
  auto table = LookupMappedTable(id, table_rows, row_bytes);
  if (table.has_error()) return table.error();
  JAXDATA_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(token->typed_data(), 0, token->size_bytes(), stream));
  if (n == 0) return ffi::Error::Success();
  const DeviceTableArg t = tables->Arg(handle, table_rows, row_bytes, kOpScatterAdd);
  std::lock_guard<std::mutex> lock(table->buffer->update_mutex());
  ffi::Error launched =
      rows.element_type() == ffi::S32
          ? ScatterTyped(stream, rows.typed_data<int32_t>(), perm.typed_data(), n, updates, cols,
                         t, table->rows)
          : ScatterTyped(stream, rows.typed_data<int64_t>(), perm.typed_data(), n, updates, cols,
                         t, table->rows);
  if (!launched.success()) return launched;
  JAXDATA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));  // written before unlocking
  return TakeDeviceError(*tables);  // this call's kernel found the table closed meanwhile?
}

}  // namespace
}  // namespace jaxdata

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxdata_host_scatter_add_cuda, jaxdata::HostScatterAddCuda,
    jaxdata::BindHostScatterAdd<ffi::PlatformStream<cudaStream_t>>());
