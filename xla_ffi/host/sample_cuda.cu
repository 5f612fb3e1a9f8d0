// Neighbour sampling on NVIDIA GPUs, on XLA's stream: one thread per output row reads the node's
// CSR range and its sampled neighbours, straight from pinned, device-mapped host memory
// (zero-copy) for jaxdata_host_sample, from device arrays for jaxdata_sample. The draws are those
// of sample.h, so the sample equals the CPU's for the same key.
//
// jaxdata_host_sample never waits for the GPU: the kernel resolves the graph's two table handles
// through the device's table registry itself (table_device.cuh). If either does not name an
// open, mapped table of the sizes the program was built for, nothing is read: every node gets
// a row of padding, and the error reaches the next jaxdata host call on the device (table.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "../common/cuda_check.h"
#include "handlers.h"
#include "sample.h"
#include "table.h"
#include "table_device.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxdata {
namespace {

constexpr int kThreads = 128;

// The CSR arrays: device arrays for jaxdata_sample, or two host tables named by handles.
template <typename O>
struct DirectCsr {
  const O* indptr;
  const int32_t* indices;
  int64_t num_nodes;
  __device__ __forceinline__ void Resolve(const O*& p, const int32_t*& i, int64_t& nodes) const {
    p = indptr, i = indices, nodes = num_nodes;
  }
};

struct TableCsr {
  DeviceTableArg indptr, indices;
  int64_t num_nodes;
  // A bad handle leaves no nodes: every input node is then outside the graph (padding).
  __device__ __forceinline__ void Resolve(const int64_t*& p, const int32_t*& i,
                                          int64_t& nodes) const {
    const char* a = ResolveTableForBlock(indptr);
    const char* b = ResolveTableForBlock(indices);
    const bool ok = a != nullptr && b != nullptr;
    p = ok ? reinterpret_cast<const int64_t*>(a) : nullptr;
    i = ok ? reinterpret_cast<const int32_t*>(b) : nullptr;
    nodes = ok ? num_nodes : 0;
  }
};

template <typename O, typename Csr>
__global__ void __launch_bounds__(kThreads)
    SampleKernel(const int32_t* __restrict__ nodes, int64_t n, const uint32_t* __restrict__ key,
                 Csr csr, int64_t num_edges, int64_t fanout, bool replace,
                 int32_t* __restrict__ out, bool* __restrict__ valid) {
  const O* indptr;
  const int32_t* indices;
  int64_t num_nodes;
  csr.Resolve(indptr, indices, num_nodes);
  const uint64_t key64 = (uint64_t(key[0]) << 32) | key[1];
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t first, degree;
    NeighbourRange(indptr, num_nodes, num_edges, nodes[i], first, degree);
    int32_t* row = out + i * fanout;
    SamplePositions(RowKey(key64, i), degree, fanout, replace, row);
    // The positions are known before any neighbour is read: the loads below are independent,
    // so several are in flight over PCIe at once.
#pragma unroll 4
    for (int64_t s = 0; s < fanout; ++s) {
      const int32_t p = row[s];
      valid[i * fanout + s] = p >= 0;
      if (p >= 0) row[s] = indices[first + p];
    }
  }
}

template <typename O, typename Csr>
ffi::Error Launch(cudaStream_t stream, const int32_t* nodes, int64_t n, const uint32_t* key,
                  Csr csr, int64_t num_edges, int64_t fanout, bool replace, int32_t* out,
                  bool* valid) {
  if (n == 0) return ffi::Error::Success();
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 1 << 16);
  SampleKernel<O, Csr><<<unsigned(blocks), kThreads, 0, stream>>>(
      nodes, n, key, csr, num_edges, fanout, replace, out, valid);
  JAXDATA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return ffi::Error::Success();
}

ffi::Error HostSampleCuda(cudaStream_t stream, Handle indptr_handle, Handle indices_handle,
                          ffi::Buffer<ffi::S32> nodes, ffi::Buffer<ffi::U32> key,
                          ffi::Result<ffi::Buffer<ffi::S32>> neighbours,
                          ffi::Result<ffi::Buffer<ffi::PRED>> mask, int64_t num_nodes,
                          int64_t num_edges, int64_t fanout, int32_t replace) {
  auto tables = StreamDeviceTables(stream);
  if (tables.has_error()) return tables.error();
  if (auto err = TakeDeviceError(*tables); !err.success()) return err;
  if (auto err = CheckHandleShape(indptr_handle); !err.success()) return err;
  if (auto err = CheckHandleShape(indices_handle); !err.success()) return err;
  const int64_t n = nodes.element_count();
  if (auto err = CheckSampleShapes(n, fanout, key, *neighbours, *mask); !err.success()) return err;
  const TableCsr csr{tables->Arg(indptr_handle, num_nodes + 1, sizeof(int64_t), kOpSample),
                     tables->Arg(indices_handle, num_edges, sizeof(int32_t), kOpSample),
                     num_nodes};
  if (n == 0) {
    CheckHandleKernel<<<1, 1, 0, stream>>>(csr.indptr);
    CheckHandleKernel<<<1, 1, 0, stream>>>(csr.indices);
    JAXDATA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    return ffi::Error::Success();
  }
  return Launch<int64_t>(stream, nodes.typed_data(), n, key.typed_data(), csr, num_edges, fanout,
                         replace != 0, neighbours->typed_data(), mask->typed_data());
}

ffi::Error SampleCuda(cudaStream_t stream, ffi::AnyBuffer indptr, ffi::Buffer<ffi::S32> indices,
                      ffi::Buffer<ffi::S32> nodes, ffi::Buffer<ffi::U32> key,
                      ffi::Result<ffi::Buffer<ffi::S32>> neighbours,
                      ffi::Result<ffi::Buffer<ffi::PRED>> mask, int64_t fanout, int32_t replace) {
  const int64_t n = nodes.element_count();
  if (auto err = CheckSampleShapes(n, fanout, key, *neighbours, *mask); !err.success()) return err;
  const int64_t num_nodes = int64_t(indptr.element_count()) - 1;
  const int64_t num_edges = indices.element_count();
  switch (indptr.element_type()) {
    case ffi::S32:
      return Launch<int32_t>(
          stream, nodes.typed_data(), n, key.typed_data(),
          DirectCsr<int32_t>{indptr.typed_data<int32_t>(), indices.typed_data(), num_nodes},
          num_edges, fanout, replace != 0, neighbours->typed_data(), mask->typed_data());
    case ffi::S64:
      return Launch<int64_t>(
          stream, nodes.typed_data(), n, key.typed_data(),
          DirectCsr<int64_t>{indptr.typed_data<int64_t>(), indices.typed_data(), num_nodes},
          num_edges, fanout, replace != 0, neighbours->typed_data(), mask->typed_data());
    default:
      return ffi::Error::InvalidArgument("jaxdata_sample: indptr must be int32 or int64");
  }
}

}  // namespace
}  // namespace jaxdata

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxdata_host_sample_cuda, jaxdata::HostSampleCuda,
    jaxdata::BindHostSample<ffi::PlatformStream<cudaStream_t>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxdata_sample_cuda, jaxdata::SampleCuda,
    jaxdata::BindSample<ffi::PlatformStream<cudaStream_t>>());
