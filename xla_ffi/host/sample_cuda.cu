// Neighbour sampling on NVIDIA GPUs, on XLA's stream: one thread per output row reads the node's
// CSR range and its sampled neighbours, straight from pinned, device-mapped host memory
// (zero-copy) for jaxdata_host_sample, from device arrays for jaxdata_sample. The draws are those
// of sample.h, so the sample equals the CPU's for the same key. A typed graph's relations are
// read beside the neighbours (sample.h).
//
// jaxdata_host_sample never waits for the GPU: the kernel resolves the graph's table handles
// through the device's table registry itself (table_device.cuh). If any does not name an
// open, mapped table of the sizes the program was built for, nothing is read: every node gets
// a row of padding, and the error reaches the next jaxdata host call on the device (table.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <optional>

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

// The CSR arrays (and a typed graph's relations, else null): device arrays for jaxdata_sample,
// or host tables named by handles.
template <typename O>
struct DirectCsr {
  const O* indptr;
  const int32_t* indices;
  const int32_t* etypes;
  int64_t num_nodes;
  __device__ __forceinline__ void Resolve(const O*& p, const int32_t*& i, const int32_t*& e,
                                          int64_t& nodes) const {
    p = indptr, i = indices, e = etypes, nodes = num_nodes;
  }
};

template <bool kTyped>
struct TableCsr {
  DeviceTableArg indptr, indices, etypes;  // etypes only when kTyped
  int64_t num_nodes;
  // A bad handle leaves no nodes: every input node is then outside the graph (padding).
  __device__ __forceinline__ void Resolve(const int64_t*& p, const int32_t*& i,
                                          const int32_t*& e, int64_t& nodes) const {
    const char* a = ResolveTableForBlock(indptr);
    const char* b = ResolveTableForBlock(indices);
    const char* c = kTyped ? ResolveTableForBlock(etypes) : nullptr;
    const bool ok = a != nullptr && b != nullptr && (!kTyped || c != nullptr);
    p = ok ? reinterpret_cast<const int64_t*>(a) : nullptr;
    i = ok ? reinterpret_cast<const int32_t*>(b) : nullptr;
    e = ok ? reinterpret_cast<const int32_t*>(c) : nullptr;
    nodes = ok ? num_nodes : 0;
  }
};

// `relations` is written only when kTyped (the untyped instantiation is the kernel as it was).
template <bool kTyped, typename O, typename Csr>
__global__ void __launch_bounds__(kThreads)
    SampleKernel(const int32_t* __restrict__ nodes, int64_t n, const uint32_t* __restrict__ key,
                 Csr csr, int64_t num_edges, int64_t fanout, bool replace,
                 int32_t* __restrict__ out, bool* __restrict__ valid,
                 int32_t* __restrict__ relations) {
  const O* indptr;
  const int32_t* indices;
  const int32_t* etypes;
  int64_t num_nodes;
  csr.Resolve(indptr, indices, etypes, num_nodes);
  const uint64_t key64 = (uint64_t(key[0]) << 32) | key[1];
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t first, degree;
    NeighbourRange(indptr, num_nodes, num_edges, nodes[i], first, degree);
    int32_t* row = out + i * fanout;
    SamplePositions(RowKey(key64, i), degree, fanout, replace, row);
    // The positions are known before any neighbour is read: the loads below are independent,
    // so several are in flight over PCIe at once (a slot's relation with its neighbour).
#pragma unroll 4
    for (int64_t s = 0; s < fanout; ++s) {
      const int32_t p = row[s];
      valid[i * fanout + s] = p >= 0;
      if (p >= 0) row[s] = indices[first + p];
      if constexpr (kTyped) relations[i * fanout + s] = p >= 0 ? etypes[first + p] : -1;
    }
  }
}

template <bool kTyped, typename O, typename Csr>
ffi::Error Launch(cudaStream_t stream, const int32_t* nodes, int64_t n, const uint32_t* key,
                  Csr csr, int64_t num_edges, int64_t fanout, bool replace, int32_t* out,
                  bool* valid, int32_t* relations) {
  if (n == 0) return ffi::Error::Success();
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 1 << 16);
  SampleKernel<kTyped, O, Csr><<<unsigned(blocks), kThreads, 0, stream>>>(
      nodes, n, key, csr, num_edges, fanout, replace, out, valid, relations);
  JAXDATA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return ffi::Error::Success();
}

using Relations = std::optional<ffi::Result<ffi::Buffer<ffi::S32>>>;

template <bool kTyped>
ffi::Error LaunchHost(cudaStream_t stream, const TableCsr<kTyped>& csr, const int32_t* nodes,
                      int64_t n, const uint32_t* key, int64_t num_edges, int64_t fanout,
                      bool replace, int32_t* out, bool* valid, int32_t* relations) {
  if (n == 0) {
    CheckHandleKernel<<<1, 1, 0, stream>>>(csr.indptr);
    CheckHandleKernel<<<1, 1, 0, stream>>>(csr.indices);
    if (kTyped) CheckHandleKernel<<<1, 1, 0, stream>>>(csr.etypes);
    JAXDATA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    return ffi::Error::Success();
  }
  return Launch<kTyped, int64_t>(stream, nodes, n, key, csr, num_edges, fanout, replace, out,
                                 valid, relations);
}

ffi::Error HostSampleCuda(cudaStream_t stream, Handle indptr_handle, Handle indices_handle,
                          ffi::Buffer<ffi::S32> nodes, ffi::Buffer<ffi::U32> key,
                          std::optional<Handle> etypes_handle,
                          ffi::Result<ffi::Buffer<ffi::S32>> neighbours,
                          ffi::Result<ffi::Buffer<ffi::PRED>> mask, Relations relations,
                          int64_t num_nodes, int64_t num_edges, int64_t fanout,
                          int32_t replace) {
  auto tables = StreamDeviceTables(stream);
  if (tables.has_error()) return tables.error();
  if (auto err = TakeDeviceError(*tables); !err.success()) return err;
  if (auto err = CheckHandleShape(indptr_handle); !err.success()) return err;
  if (auto err = CheckHandleShape(indices_handle); !err.success()) return err;
  const int64_t n = nodes.element_count();
  if (auto err = CheckSampleShapes(n, fanout, key, *neighbours, *mask); !err.success()) return err;
  if (auto err = CheckTypedOperands(etypes_handle, relations, n * fanout); !err.success()) {
    return err;
  }
  const DeviceTableArg indptr = tables->Arg(indptr_handle, num_nodes + 1, sizeof(int64_t),
                                            kOpSample);
  const DeviceTableArg indices = tables->Arg(indices_handle, num_edges, sizeof(int32_t),
                                             kOpSample);
  if (etypes_handle.has_value()) {
    if (auto err = CheckHandleShape(*etypes_handle); !err.success()) return err;
    // One int32 relation per row of the indices table.
    const TableCsr<true> csr{
        indptr, indices, tables->Arg(*etypes_handle, num_edges, sizeof(int32_t), kOpSample),
        num_nodes};
    return LaunchHost<true>(stream, csr, nodes.typed_data(), n, key.typed_data(), num_edges,
                            fanout, replace != 0, neighbours->typed_data(), mask->typed_data(),
                            (*relations)->typed_data());
  }
  const TableCsr<false> csr{indptr, indices, DeviceTableArg{}, num_nodes};
  return LaunchHost<false>(stream, csr, nodes.typed_data(), n, key.typed_data(), num_edges,
                           fanout, replace != 0, neighbours->typed_data(), mask->typed_data(),
                           nullptr);
}

template <typename O>
ffi::Error LaunchDirect(cudaStream_t stream, const DirectCsr<O>& csr, const int32_t* nodes,
                        int64_t n, const uint32_t* key, int64_t num_edges, int64_t fanout,
                        bool replace, int32_t* out, bool* valid, int32_t* relations) {
  if (relations != nullptr) {
    return Launch<true, O>(stream, nodes, n, key, csr, num_edges, fanout, replace, out, valid,
                           relations);
  }
  return Launch<false, O>(stream, nodes, n, key, csr, num_edges, fanout, replace, out, valid,
                          nullptr);
}

ffi::Error SampleCuda(cudaStream_t stream, ffi::AnyBuffer indptr, ffi::Buffer<ffi::S32> indices,
                      ffi::Buffer<ffi::S32> nodes, ffi::Buffer<ffi::U32> key,
                      std::optional<ffi::Buffer<ffi::S32>> etypes,
                      ffi::Result<ffi::Buffer<ffi::S32>> neighbours,
                      ffi::Result<ffi::Buffer<ffi::PRED>> mask, Relations relations,
                      int64_t fanout, int32_t replace) {
  const int64_t n = nodes.element_count();
  if (auto err = CheckSampleShapes(n, fanout, key, *neighbours, *mask); !err.success()) return err;
  if (auto err = CheckTypedOperands(etypes, relations, n * fanout); !err.success()) return err;
  const int64_t num_nodes = int64_t(indptr.element_count()) - 1;
  const int64_t num_edges = indices.element_count();
  if (etypes && int64_t(etypes->element_count()) != num_edges) {
    return ffi::Error::InvalidArgument("jaxdata_sample: etypes and indices differ in length");
  }
  const int32_t* etype_data = etypes ? etypes->typed_data() : nullptr;
  int32_t* relation_data = relations ? (*relations)->typed_data() : nullptr;
  switch (indptr.element_type()) {
    case ffi::S32:
      return LaunchDirect(
          stream,
          DirectCsr<int32_t>{indptr.typed_data<int32_t>(), indices.typed_data(), etype_data,
                             num_nodes},
          nodes.typed_data(), n, key.typed_data(), num_edges, fanout, replace != 0,
          neighbours->typed_data(), mask->typed_data(), relation_data);
    case ffi::S64:
      return LaunchDirect(
          stream,
          DirectCsr<int64_t>{indptr.typed_data<int64_t>(), indices.typed_data(), etype_data,
                             num_nodes},
          nodes.typed_data(), n, key.typed_data(), num_edges, fanout, replace != 0,
          neighbours->typed_data(), mask->typed_data(), relation_data);
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
