// Neighbour sampling on the CPU: rows of the output sampled in parallel on XLA's thread pool.
// jaxdata_host_sample reads a HostGraph's tables; jaxdata_sample reads a CSR given as operands.
// Either also reports each slot's relation when given the graph's etypes (sample.h).
#include <cstdint>
#include <optional>

#include "../common/parallel.h"
#include "handlers.h"
#include "sample.h"
#include "table.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxdata {
namespace {

// `etypes` and `relations` are null for an untyped call (kTyped false: the loop never looks).
template <bool kTyped, typename O>
void SampleRows(ffi::ThreadPool& pool, const int32_t* in, int64_t n, const uint32_t* key,
                const O* indptr, const int32_t* indices, const int32_t* etypes,
                int64_t num_nodes, int64_t num_edges, int64_t fanout, bool replace, int32_t* out,
                bool* valid, int32_t* relations) {
  const uint64_t key64 = (uint64_t(key[0]) << 32) | key[1];
  ParallelFor(pool, n, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      int64_t first, degree;
      NeighbourRange(indptr, num_nodes, num_edges, in[i], first, degree);
      int32_t* row = out + i * fanout;
      SamplePositions(RowKey(key64, i), degree, fanout, replace, row);
      for (int64_t s = 0; s < fanout; ++s) {
        const int32_t p = row[s];
        valid[i * fanout + s] = p >= 0;
        if (p >= 0) row[s] = indices[first + p];
        if constexpr (kTyped) relations[i * fanout + s] = p >= 0 ? etypes[first + p] : -1;
      }
    }
  });
}

template <typename O>
void SampleRowsMaybeTyped(ffi::ThreadPool& pool, const int32_t* in, int64_t n,
                          const uint32_t* key, const O* indptr, const int32_t* indices,
                          const int32_t* etypes, int64_t num_nodes, int64_t num_edges,
                          int64_t fanout, bool replace, int32_t* out, bool* valid,
                          int32_t* relations) {
  if (relations != nullptr) {
    SampleRows<true>(pool, in, n, key, indptr, indices, etypes, num_nodes, num_edges, fanout,
                     replace, out, valid, relations);
  } else {
    SampleRows<false>(pool, in, n, key, indptr, indices, nullptr, num_nodes, num_edges, fanout,
                      replace, out, valid, nullptr);
  }
}

using Relations = std::optional<ffi::Result<ffi::Buffer<ffi::S32>>>;

ffi::Error HostSampleCpu(ffi::ThreadPool pool, Handle indptr_handle, Handle indices_handle,
                         ffi::Buffer<ffi::S32> nodes, ffi::Buffer<ffi::U32> key,
                         std::optional<Handle> etypes_handle,
                         ffi::Result<ffi::Buffer<ffi::S32>> neighbours,
                         ffi::Result<ffi::Buffer<ffi::PRED>> mask, Relations relations,
                         int64_t num_nodes, int64_t num_edges, int64_t fanout, int32_t replace) {
  auto indptr_id = HandleValue(indptr_handle);
  if (indptr_id.has_error()) return indptr_id.error();
  auto indices_id = HandleValue(indices_handle);
  if (indices_id.has_error()) return indices_id.error();
  auto graph = LookupGraph(*indptr_id, *indices_id, num_nodes, num_edges);
  if (graph.has_error()) return graph.error();
  const int64_t n = nodes.element_count();
  if (auto err = CheckSampleShapes(n, fanout, key, *neighbours, *mask); !err.success()) return err;
  if (auto err = CheckTypedOperands(etypes_handle, relations, n * fanout); !err.success()) {
    return err;
  }
  TableView etypes_table;  // holds the memory while the rows are sampled
  const int32_t* etypes = nullptr;
  if (etypes_handle.has_value()) {
    auto etypes_id = HandleValue(*etypes_handle);
    if (etypes_id.has_error()) return etypes_id.error();
    // One int32 relation per row of the indices table.
    auto table = LookupTable(*etypes_id, graph->num_edges, sizeof(int32_t));
    if (table.has_error()) return table.error();
    etypes_table = *table;
    etypes = reinterpret_cast<const int32_t*>(etypes_table.buffer->data());
  }
  SampleRowsMaybeTyped(pool, nodes.typed_data(), n, key.typed_data(), graph->indptr,
                       graph->indices, etypes, graph->num_nodes, graph->num_edges, fanout,
                       replace != 0, neighbours->typed_data(), mask->typed_data(),
                       relations ? (*relations)->typed_data() : nullptr);
  return ffi::Error::Success();
}

ffi::Error SampleCpu(ffi::ThreadPool pool, ffi::AnyBuffer indptr, ffi::Buffer<ffi::S32> indices,
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
      SampleRowsMaybeTyped(pool, nodes.typed_data(), n, key.typed_data(),
                           indptr.typed_data<int32_t>(), indices.typed_data(), etype_data,
                           num_nodes, num_edges, fanout, replace != 0, neighbours->typed_data(),
                           mask->typed_data(), relation_data);
      return ffi::Error::Success();
    case ffi::S64:
      SampleRowsMaybeTyped(pool, nodes.typed_data(), n, key.typed_data(),
                           indptr.typed_data<int64_t>(), indices.typed_data(), etype_data,
                           num_nodes, num_edges, fanout, replace != 0, neighbours->typed_data(),
                           mask->typed_data(), relation_data);
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
