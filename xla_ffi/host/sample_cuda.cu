// host_sample_neighbors on NVIDIA GPUs: one thread per output row reads the node's CSR range and
// its sampled neighbours straight from pinned, device-mapped host memory (zero-copy), on XLA's
// stream. The draws are those of sample.h, so the sample equals the CPU's for the same key.
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

__global__ void __launch_bounds__(kThreads)
    SampleKernel(const int32_t* __restrict__ nodes, int64_t n, const uint32_t* __restrict__ key,
                 const int64_t* __restrict__ indptr, const int32_t* __restrict__ indices,
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

ffi::Error HostSampleCuda(cudaStream_t stream, ffi::Buffer<ffi::S32> nodes,
                          ffi::Buffer<ffi::U32> key, ffi::Result<ffi::Buffer<ffi::S32>> neighbours,
                          ffi::Result<ffi::Buffer<ffi::PRED>> mask, int64_t indptr_id,
                          int64_t indices_id, int64_t fanout, int32_t replace) {
  auto graph = LookupGraph(indptr_id, indices_id, /*mapped=*/true);
  if (graph.has_error()) return graph.error();
  const int64_t n = nodes.element_count();
  if (fanout < 1 || neighbours->element_count() != n * fanout ||
      mask->element_count() != n * fanout || key.element_count() != 2) {
    return ffi::Error::InvalidArgument("jaxdata_host_sample: operand shapes do not match");
  }
  if (n == 0) return ffi::Error::Success();
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 1 << 16);
  SampleKernel<<<unsigned(blocks), kThreads, 0, stream>>>(
      nodes.typed_data(), n, key.typed_data(), graph->indptr, graph->indices, graph->num_nodes,
      graph->num_edges, fanout, replace != 0, neighbours->typed_data(), mask->typed_data());
  JAXDATA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxdata

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdata_host_sample_cuda, jaxdata::HostSampleCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>()
                                  .Attr<int64_t>("indptr_id")
                                  .Attr<int64_t>("indices_id")
                                  .Attr<int64_t>("fanout")
                                  .Attr<int32_t>("replace"));
