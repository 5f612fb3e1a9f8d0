// Neighbour sampling on the CPU: rows of the output sampled in parallel on XLA's thread pool.
// jaxdata_host_sample reads a HostGraph's tables; jaxdata_sample reads a CSR given as operands.
#include <cstdint>

#include "../common/parallel.h"
#include "handlers.h"
#include "sample.h"
#include "table.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxdata {
namespace {

template <typename O>
void SampleRows(ffi::ThreadPool& pool, const int32_t* in, int64_t n, const uint32_t* key,
                const O* indptr, const int32_t* indices, int64_t num_nodes, int64_t num_edges,
                int64_t fanout, bool replace, int32_t* out, bool* valid) {
  const uint64_t key64 = (uint64_t(key[0]) << 32) | key[1];
  ParallelFor(pool, n, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      int64_t first, degree;
      NeighbourRange(indptr, num_nodes, num_edges, in[i], first, degree);
      int32_t* row = out + i * fanout;
      SamplePositions(RowKey(key64, i), degree, fanout, replace, row);
      for (int64_t s = 0; s < fanout; ++s) {
        valid[i * fanout + s] = row[s] >= 0;
        if (row[s] >= 0) row[s] = indices[first + row[s]];
      }
    }
  });
}

ffi::Error HostSampleCpu(ffi::ThreadPool pool, Handle indptr_handle, Handle indices_handle,
                         ffi::Buffer<ffi::S32> nodes, ffi::Buffer<ffi::U32> key,
                         ffi::Result<ffi::Buffer<ffi::S32>> neighbours,
                         ffi::Result<ffi::Buffer<ffi::PRED>> mask, int64_t num_nodes,
                         int64_t num_edges, int64_t fanout, int32_t replace) {
  auto indptr_id = HandleValue(indptr_handle);
  if (indptr_id.has_error()) return indptr_id.error();
  auto indices_id = HandleValue(indices_handle);
  if (indices_id.has_error()) return indices_id.error();
  auto graph = LookupGraph(*indptr_id, *indices_id, num_nodes, num_edges);
  if (graph.has_error()) return graph.error();
  const int64_t n = nodes.element_count();
  if (auto err = CheckSampleShapes(n, fanout, key, *neighbours, *mask); !err.success()) return err;
  SampleRows(pool, nodes.typed_data(), n, key.typed_data(), graph->indptr, graph->indices,
             graph->num_nodes, graph->num_edges, fanout, replace != 0, neighbours->typed_data(),
             mask->typed_data());
  return ffi::Error::Success();
}

ffi::Error SampleCpu(ffi::ThreadPool pool, ffi::AnyBuffer indptr, ffi::Buffer<ffi::S32> indices,
                     ffi::Buffer<ffi::S32> nodes, ffi::Buffer<ffi::U32> key,
                     ffi::Result<ffi::Buffer<ffi::S32>> neighbours,
                     ffi::Result<ffi::Buffer<ffi::PRED>> mask, int64_t fanout, int32_t replace) {
  const int64_t n = nodes.element_count();
  if (auto err = CheckSampleShapes(n, fanout, key, *neighbours, *mask); !err.success()) return err;
  const int64_t num_nodes = int64_t(indptr.element_count()) - 1;
  const int64_t num_edges = indices.element_count();
  switch (indptr.element_type()) {
    case ffi::S32:
      SampleRows(pool, nodes.typed_data(), n, key.typed_data(), indptr.typed_data<int32_t>(),
                 indices.typed_data(), num_nodes, num_edges, fanout, replace != 0,
                 neighbours->typed_data(), mask->typed_data());
      return ffi::Error::Success();
    case ffi::S64:
      SampleRows(pool, nodes.typed_data(), n, key.typed_data(), indptr.typed_data<int64_t>(),
                 indices.typed_data(), num_nodes, num_edges, fanout, replace != 0,
                 neighbours->typed_data(), mask->typed_data());
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("jaxdata_sample: indptr must be int32 or int64");
  }
}

}  // namespace
}  // namespace jaxdata

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdata_host_sample_cpu, jaxdata::HostSampleCpu,
                              jaxdata::BindHostSample<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdata_sample_cpu, jaxdata::SampleCpu,
                              jaxdata::BindSample<ffi::ThreadPool>());
