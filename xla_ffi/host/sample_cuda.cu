// Neighbour sampling on NVIDIA GPUs, on XLA's stream: one thread per output row reads the node's
// CSR range and its sampled neighbours, straight from pinned, device-mapped host memory
// (zero-copy) for jaxdata_host_sample, from device arrays for jaxdata_sample. The draws are those of sample.h, so the sample equals the CPU's for the same key.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "../common/cuda_check.h"
#include "handlers.h"
#include "sample.h"
#include "table.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxdata {
namespace {

constexpr int kThreads = 128;

template <typename O>
__global__ void __launch_bounds__(kThreads)
    SampleKernel(const int32_t* __restrict__ nodes, int64_t n, const uint32_t* __restrict__ key,
                 const O* __restrict__ indptr, const int32_t* __restrict__ indices,
                 int64_t num_nodes, int64_t num_edges, int64_t fanout, bool replace,
                 int32_t* __restrict__ out, bool* __restrict__ valid) {
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

template <typename O>
ffi::Error Launch(cudaStream_t stream, const int32_t* nodes, int64_t n, const uint32_t* key,
                  const O* indptr, const int32_t* indices, int64_t num_nodes, int64_t num_edges,
                  int64_t fanout, bool replace, int32_t* out, bool* valid) {
  if (n == 0) return ffi::Error::Success();
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 1 << 16);
  SampleKernel<O><<<unsigned(blocks), kThreads, 0, stream>>>(
      nodes, n, key, indptr, indices, num_nodes, num_edges, fanout, replace, out, valid);
  JAXDATA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return ffi::Error::Success();
}

ffi::Error HostSampleCuda(cudaStream_t stream, Handle indptr_handle, Handle indices_handle,
                          ffi::Buffer<ffi::S32> nodes, ffi::Buffer<ffi::U32> key,
                          ffi::Result<ffi::Buffer<ffi::S32>> neighbours,
                          ffi::Result<ffi::Buffer<ffi::PRED>> mask, int64_t num_nodes,
                          int64_t num_edges, int64_t fanout, int32_t replace) {
  int64_t ids[2] = {0, 0};
  if (auto err = DeviceHandleValues(stream, {&indptr_handle, &indices_handle}, ids);
      !err.success()) {
    return err;
  }
  auto graph = LookupGraph(ids[0], ids[1], num_nodes, num_edges, /*mapped=*/true);
  if (graph.has_error()) return graph.error();
  const int64_t n = nodes.element_count();
  if (auto err = CheckSampleShapes(n, fanout, key, *neighbours, *mask); !err.success()) return err;
  return Launch(stream, nodes.typed_data(), n, key.typed_data(), graph->indptr, graph->indices,
                graph->num_nodes, graph->num_edges, fanout, replace != 0, neighbours->typed_data(),
                mask->typed_data());
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
      return Launch(stream, nodes.typed_data(), n, key.typed_data(), indptr.typed_data<int32_t>(),
                    indices.typed_data(), num_nodes, num_edges, fanout, replace != 0,
                    neighbours->typed_data(), mask->typed_data());
    case ffi::S64:
      return Launch(stream, nodes.typed_data(), n, key.typed_data(), indptr.typed_data<int64_t>(),
                    indices.typed_data(), num_nodes, num_edges, fanout, replace != 0,
                    neighbours->typed_data(), mask->typed_data());
    default:
      return ffi::Error::InvalidArgument("jaxdata_sample: indptr must be int32 or int64");
  }
}

}  // namespace
}  // namespace jaxdata

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdata_host_sample_cuda, jaxdata::HostSampleCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<jaxdata::Handle>()
                                  .Arg<jaxdata::Handle>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>()
                                  .Attr<int64_t>("num_nodes")
                                  .Attr<int64_t>("num_edges")
                                  .Attr<int64_t>("fanout")
                                  .Attr<int32_t>("replace"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdata_sample_cuda, jaxdata::SampleCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>()
                                  .Attr<int64_t>("fanout")
                                  .Attr<int32_t>("replace"));
