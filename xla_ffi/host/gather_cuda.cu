// host_gather and host_slice on NVIDIA GPUs: the kernel reads the table straight out of pinned,
// device-mapped host memory (zero-copy over PCIe) on XLA's stream.
//
// No waiting: the handler passes the table's handle operand and the device's table registry to
// the kernel, whose blocks resolve the handle themselves (table_device.cuh), so the host thread
// that enqueues XLA's work runs ahead of the GPU. A handle that does not name an open, mapped
// table of the program's geometry reads nothing: every output row is the fill value, and the
// error reaches the next jaxdata host call on the device (table.h). host_slice (not a hot path)
// copies the handle back and waits, because its DMA copy needs the table's address on the host.
//
// Mapping of work to threads. A row is handled by a group of `lanes` threads (a power of two, at
// most a warp, so a group never straddles two warps); each thread moves one vector of V bytes,
// V = 16 where the row size and output alignment allow. Rows wider than a warp's reach take
// several segments of 32 * V bytes; their segments start at the row's 128-byte-aligned address
// (PyTorch-Direct's alignment), so each 128-byte line of the table is requested by exactly one
// warp instruction and the lanes before the row's first byte stay idle. Each thread keeps
// kUnroll loads in flight before it stores, which is what hides the PCIe latency.
//
// Large tables: random rows spread over many gigabytes defeat the GPU's address translation
// (DESIGN.md: 64-byte rows fall from 43.6 to 2.3 GB/s at 16 GB). With `sort`, the resolved row
// numbers are radix-sorted together with their output positions, the table is read in ascending
// order, and every row is written straight to its place in the output. The sort's buffers are a
// second, scratch output of the call, sized by HostGatherSortScratchBytes at trace time.
#include <cuda_runtime.h>

#include <cub/cub.cuh>
#include <cstdint>
#include <string>

#include "../common/cuda_check.h"
#include "gather.h"
#include "handlers.h"
#include "table.h"
#include "table_device.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxdata {
namespace {

constexpr int kThreads = 256;
// Loads in flight per thread. 8 measured within noise of 4 on the H200 (notes in
// docs/benchmarks/gather_notes.md), so the smaller register footprint stays.
constexpr int kUnroll = 4;

template <int N> struct VecOf;
template <> struct VecOf<16> { using T = uint4; };
template <> struct VecOf<8> { using T = uint2; };
template <> struct VecOf<4> { using T = uint32_t; };
template <> struct VecOf<2> { using T = uint16_t; };
template <> struct VecOf<1> { using T = uint8_t; };

// Where output row s comes from: (table row or -1 for fill, output row).
template <typename I>
struct DirectRows {
  const I* idx;
  int64_t rows;
  int32_t mode;
  __device__ __forceinline__ void operator()(int64_t s, int64_t& row, int64_t& dst) const {
    row = ResolveRow(idx[s], rows, mode);
    dst = s;
  }
};

struct SortedRows {
  const uint32_t* keys;  // ascending table rows; `rows` stands for fill
  const uint32_t* pos;   // where each goes in the output
  int64_t rows;
  __device__ __forceinline__ void operator()(int64_t s, int64_t& row, int64_t& dst) const {
    const uint32_t k = keys[s];
    row = k >= rows ? -1 : int64_t(k);
    dst = pos[s];
  }
};

template <typename V, typename Src>
__global__ void __launch_bounds__(kThreads)
    GatherKernel(DeviceTableArg handle, char* __restrict__ out, int64_t n, Src src,
                 int64_t row_bytes, int log2_lanes, int64_t segments, bool window, V fill) {
  // nullptr for a bad handle: then every row is the fill value.
  const char* __restrict__ table = ResolveTableForBlock(handle);
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t lane_offset = int64_t(tid & ((1 << log2_lanes) - 1)) * int64_t(sizeof(V));
  const int64_t segment_bytes = int64_t(sizeof(V)) << log2_lanes;
  const int64_t group = tid >> log2_lanes;
  const int64_t groups = (int64_t(gridDim.x) * blockDim.x) >> log2_lanes;
  const int64_t tasks = n * segments;
  for (int64_t base = group; base < tasks; base += groups * kUnroll) {
    V v[kUnroll];
    char* dst[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      dst[u] = nullptr;
      const int64_t q = base + u * groups;
      if (q >= tasks) continue;
      const int64_t s = segments == 1 ? q : q / segments;
      const int64_t pos = (q - s * segments) * segment_bytes + lane_offset;
      int64_t row, d;
      src(s, row, d);
      if (table == nullptr) row = -1;
      char* out_row = out + d * row_bytes;
      if (row >= 0) {
        const int64_t first = row * row_bytes;
        const int64_t a = (window ? (first & ~int64_t(127)) : first) + pos;
        if (a >= first && a < first + row_bytes) {
          v[u] = *reinterpret_cast<const V*>(table + a);
          dst[u] = out_row + (a - first);
        }
      } else if (pos < row_bytes) {
        v[u] = fill;
        dst[u] = out_row + pos;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (dst[u]) *reinterpret_cast<V*>(dst[u]) = v[u];
    }
  }
}

template <typename I>
__global__ void ResolveKeysKernel(const I* __restrict__ idx, int64_t n, int64_t rows, int32_t mode,
                                  uint32_t* __restrict__ keys, uint32_t* __restrict__ pos) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = ResolveRow(idx[i], rows, mode);
    keys[i] = r < 0 ? uint32_t(rows) : uint32_t(r);
    pos[i] = uint32_t(i);
  }
}

int SmCount() {
  static int counts[64] = {0};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 132;
  if (counts[dev] == 0) {
    int c = 0;
    cudaDeviceGetAttribute(&c, cudaDevAttrMultiProcessorCount, dev);
    counts[dev] = c > 0 ? c : 132;
  }
  return counts[dev];
}

int64_t Gcd(int64_t a, int64_t b) { return b == 0 ? a : Gcd(b, a % b); }

struct Plan {
  int vec_bytes;
  int log2_lanes;
  int64_t segments;
  bool window;
};

Plan MakePlan(int64_t row_bytes, uintptr_t out_addr) {
  Plan p{16, 0, 1, false};
  while (p.vec_bytes > 1 && (row_bytes % p.vec_bytes != 0 || out_addr % p.vec_bytes != 0))
    p.vec_bytes >>= 1;
  const int64_t chunks = (row_bytes + p.vec_bytes - 1) / p.vec_bytes;
  if (chunks <= 32) {
    while ((int64_t(1) << p.log2_lanes) < chunks) ++p.log2_lanes;
  } else {
    // The table's base is page-aligned, so a row starts `misalign` bytes past a 128-byte line
    // at most; the window covers that much more.
    const int64_t window_bytes = row_bytes + 128 - Gcd(row_bytes, 128);
    p.log2_lanes = 5;
    p.window = true;
    p.segments = (window_bytes + 32 * p.vec_bytes - 1) / (32 * p.vec_bytes);
  }
  return p;
}

template <typename V, typename Src>
cudaError_t LaunchTyped(cudaStream_t stream, const DeviceTableArg& table, char* out, int64_t n,
                        Src src,
                        int64_t row_bytes, const Plan& p, const unsigned char* fill16) {
  V fill;
  memcpy(&fill, fill16, sizeof(V));
  const int64_t threads_needed = n * p.segments << p.log2_lanes;
  const int64_t max_blocks = int64_t(SmCount()) * (2048 / kThreads);
  const int64_t blocks = std::min(max_blocks, (threads_needed + kThreads - 1) / kThreads);
  GatherKernel<V, Src><<<unsigned(blocks), kThreads, 0, stream>>>(
      table, out, n, src, row_bytes, p.log2_lanes, p.segments, p.window, fill);
  return cudaGetLastError();
}

template <typename Src>
cudaError_t Launch(cudaStream_t stream, const DeviceTableArg& table, char* out, int64_t n, Src src,
                   int64_t row_bytes, const unsigned char* fill16) {
  const Plan p = MakePlan(row_bytes, reinterpret_cast<uintptr_t>(out));
  switch (p.vec_bytes) {
    case 16: return LaunchTyped<VecOf<16>::T>(stream, table, out, n, src, row_bytes, p, fill16);
    case 8: return LaunchTyped<VecOf<8>::T>(stream, table, out, n, src, row_bytes, p, fill16);
    case 4: return LaunchTyped<VecOf<4>::T>(stream, table, out, n, src, row_bytes, p, fill16);
    case 2: return LaunchTyped<VecOf<2>::T>(stream, table, out, n, src, row_bytes, p, fill16);
    default: return LaunchTyped<VecOf<1>::T>(stream, table, out, n, src, row_bytes, p, fill16);
  }
}

bool CanSort(int64_t n, int64_t rows) {
  return n > 1 && n < (int64_t(1) << 31) && rows < (int64_t(1) << 32) - 1;
}

int SortEndBit(int64_t rows) {  // bits that hold every row number and the fill sentinel `rows`
  int end_bit = 1;
  while (end_bit < 32 && (int64_t(1) << end_bit) <= rows) ++end_bit;
  return end_bit;
}

size_t AlignedArrayBytes(int64_t n) { return (size_t(n) * sizeof(uint32_t) + 255) & ~size_t(255); }

size_t CubTempBytes(int64_t n, int64_t rows) {
  cub::DoubleBuffer<uint32_t> keys(nullptr, nullptr), pos(nullptr, nullptr);
  size_t temp_bytes = 0;
  if (cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys, pos, int(n), 0, SortEndBit(rows)) !=
      cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return temp_bytes;
}

template <typename I>
ffi::Error GatherTyped(cudaStream_t stream, ffi::AnyBuffer& scratch, const I* idx, int64_t n,
                       const DeviceTableArg& table, int32_t mode, bool sort,
                       const unsigned char* fill16, char* out) {
  const DeviceTableArg& t = table;  // only the gather kernel resolves it; the sort needs rows
  const size_t needed = sort ? HostGatherSortScratchBytes(n, t.rows) : 0;
  // Python sizes the scratch output for one call; under vmap the batch may need more than it
  // was given, and then the rows are read unsorted (the same result, only slower).
  if (needed == 0 || scratch.size_bytes() < needed) {
    JAXDATA_CUDA_RETURN_IF_ERROR(
        Launch(stream, table, out, n, DirectRows<I>{idx, t.rows, mode}, t.row_bytes, fill16));
    return ffi::Error::Success();
  }
  const size_t array_bytes = AlignedArrayBytes(n);
  size_t temp_bytes = needed - 4 * array_bytes;  // CUB takes it by reference
  char* m = static_cast<char*>(scratch.untyped_data());
  cub::DoubleBuffer<uint32_t> keys(reinterpret_cast<uint32_t*>(m),
                                   reinterpret_cast<uint32_t*>(m + array_bytes));
  cub::DoubleBuffer<uint32_t> pos(reinterpret_cast<uint32_t*>(m + 2 * array_bytes),
                                  reinterpret_cast<uint32_t*>(m + 3 * array_bytes));
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, SmCount() * 8);
  ResolveKeysKernel<I><<<unsigned(blocks), kThreads, 0, stream>>>(idx, n, t.rows, mode,
                                                                   keys.Current(), pos.Current());
  JAXDATA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  JAXDATA_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairs(
      m + 4 * array_bytes, temp_bytes, keys, pos, int(n), 0, SortEndBit(t.rows), stream));
  JAXDATA_CUDA_RETURN_IF_ERROR(Launch(stream, table, out, n,
                                      SortedRows{keys.Current(), pos.Current(), t.rows},
                                      t.row_bytes, fill16));
  return ffi::Error::Success();
}

ffi::Error HostGatherCuda(cudaStream_t stream, Handle handle, ffi::AnyBuffer idx,
                          ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> scratch,
                          int64_t rows, int32_t mode, int64_t fill_bits, int32_t sort) {
  auto tables = StreamDeviceTables(stream);
  if (tables.has_error()) return tables.error();
  if (auto err = TakeDeviceError(*tables); !err.success()) return err;
  if (auto err = CheckHandleShape(handle); !err.success()) return err;
  const int64_t rb = OutputRowBytes(*out);
  const DeviceTableArg table = tables->Arg(handle, rows, rb, kOpGather);
  const int64_t n = idx.element_count();
  if (n == 0) {
    CheckHandleKernel<<<1, 1, 0, stream>>>(table);
    JAXDATA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    return ffi::Error::Success();
  }
  unsigned char fill16[16];
  RepeatPattern(uint64_t(fill_bits), ffi::ByteWidth(out->element_type()), fill16, 16);
  char* dst = static_cast<char*>(out->untyped_data());
  switch (idx.element_type()) {
    case ffi::S32:
      return GatherTyped(stream, *scratch, idx.typed_data<int32_t>(), n, table, mode, sort != 0,
                         fill16, dst);
    case ffi::S64:
      return GatherTyped(stream, *scratch, idx.typed_data<int64_t>(), n, table, mode, sort != 0,
                         fill16, dst);
    default:
      return ffi::Error::InvalidArgument("jaxdata_host_gather: indices must be int32 or int64");
  }
}

// Not a hot path: the handle is copied back (one wait) because the DMA copy needs the table's
// host address. The table view held meanwhile keeps the memory alive while the copy is queued
// (the last owner's ~HostBuffer waits for the GPUs before freeing).
ffi::Error HostSliceCuda(cudaStream_t stream, Handle handle, ffi::Result<ffi::AnyBuffer> out,
                         int64_t rows, int64_t start) {
  auto tables = StreamDeviceTables(stream);
  if (tables.has_error()) return tables.error();
  if (auto err = TakeDeviceError(*tables); !err.success()) return err;
  int64_t id = 0;
  if (auto err = DeviceHandleValues(stream, {&handle}, &id); !err.success()) return err;
  const int64_t rb = OutputRowBytes(*out);
  auto table = LookupMappedTable(id, rows, rb);
  if (table.has_error()) return table.error();
  const int64_t bytes = out->size_bytes();
  if (start < 0 || start * rb + bytes > table->rows * rb) {
    return ffi::Error(ffi::ErrorCode::kOutOfRange, "jaxdata_host_slice: rows out of range");
  }
  if (bytes == 0) return ffi::Error::Success();
  JAXDATA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(out->untyped_data(),
                                               table->buffer->data() + start * rb, bytes,
                                               cudaMemcpyHostToDevice, stream));
  return ffi::Error::Success();
}

}  // namespace

// Keys and positions, double-buffered, then CUB's temporary storage; 0: no sorting possible.
size_t HostGatherSortScratchBytes(int64_t n, int64_t rows) {
  if (!CanSort(n, rows)) return 0;
  const size_t temp = CubTempBytes(n, rows);
  return temp == 0 ? 0 : 4 * AlignedArrayBytes(n) + temp;
}

}  // namespace jaxdata

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxdata_host_gather_cuda, jaxdata::HostGatherCuda,
    jaxdata::BindHostGather<ffi::PlatformStream<cudaStream_t>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxdata_host_slice_cuda, jaxdata::HostSliceCuda,
    jaxdata::BindHostSlice<ffi::PlatformStream<cudaStream_t>>());
