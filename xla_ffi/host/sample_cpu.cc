// host_sample_neighbors on the CPU: rows of the output sampled in parallel on XLA's thread pool.
#include <cstdint>
#include <string>

#include "../common/parallel.h"
#include "handlers.h"
#include "sample.h"
#include "table.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxdata {
namespace {

ffi::Error HostSampleCpu(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> nodes,
                         ffi::Buffer<ffi::U32> key, ffi::Result<ffi::Buffer<ffi::S32>> neighbours,
                         ffi::Result<ffi::Buffer<ffi::PRED>> mask, int64_t indptr_id,
                         int64_t indices_id, int64_t fanout, int32_t replace) {
  auto graph = LookupGraph(indptr_id, indices_id);
  if (graph.has_error()) return graph.error();
  const int64_t n = nodes.element_count();
  if (fanout < 1 || neighbours->element_count() != n * fanout ||
      mask->element_count() != n * fanout || key.element_count() != 2) {
    return ffi::Error::InvalidArgument("jaxdata_host_sample: operand shapes do not match");
  }
  const uint32_t* k = key.typed_data();
  const uint64_t key64 = (uint64_t(k[0]) << 32) | k[1];
  const int32_t* in = nodes.typed_data();
  int32_t* out = neighbours->typed_data();
  bool* valid = mask->typed_data();
  const GraphView& g = *graph;
  ParallelFor(pool, n, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      int64_t first, degree;
      NeighbourRange(g.indptr, g.num_nodes, g.num_edges, in[i], first, degree);
      int32_t* row = out + i * fanout;
      SamplePositions(RowKey(key64, i), degree, fanout, replace != 0, row);
      for (int64_t s = 0; s < fanout; ++s) {
        valid[i * fanout + s] = row[s] >= 0;
        if (row[s] >= 0) row[s] = g.indices[first + row[s]];
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxdata

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdata_host_sample_cpu, jaxdata::HostSampleCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>()
                                  .Attr<int64_t>("indptr_id")
                                  .Attr<int64_t>("indices_id")
                                  .Attr<int64_t>("fanout")
                                  .Attr<int32_t>("replace"));
