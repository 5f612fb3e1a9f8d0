// The registry of host tables.
//
// A host table is a HostBuffer seen as `rows` rows of `row_bytes` bytes. Python holds a table's
// id; a jitted program receives it as a run-time operand (an int32 scalar: the table's "handle"),
// never as a compile-time attribute, so one executable serves every table of a shape and dtype
// and holds none of them alive. Handlers look the id up here, with the geometry the program was
// compiled for. Ids are never reused, so a handle of a table that has since been closed fails
// with a clear error instead of reading freed memory.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <memory>

#include "../common/host_buffer.h"
#include "xla/ffi/api/ffi.h"

#ifdef JAXDATA_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace jaxdata {

struct TableView {
  std::shared_ptr<HostBuffer> buffer;  // keeps the memory alive while a handler uses it
  int64_t rows = 0;
  int64_t row_bytes = 0;
};

// Registers a view of `buffer` (rows * row_bytes <= buffer->size()) and returns its id, in
// [1, 2**31 - 1] (an int32 handle); throws once a process has used them all.
int64_t RegisterTable(std::shared_ptr<HostBuffer> buffer, int64_t rows, int64_t row_bytes);
// Forgets the id; the memory goes when no other view, handler or NumPy view holds it.
void CloseTable(int64_t id);
// How many tables are open now (for leak tests).
int64_t OpenTableCount();

// The row size in bytes of a handler's output (last dimension times element width).
inline int64_t OutputRowBytes(const xla::ffi::AnyBuffer& out) {
  auto dims = out.dimensions();
  return dims.size() == 0 ? 0 : dims.back() * int64_t(xla::ffi::ByteWidth(out.element_type()));
}

using Handle = xla::ffi::Buffer<xla::ffi::S32>;  // a table's id, as an operand

// CPU handlers: the id a handle operand holds (its memory is host memory), or an error when the
// operand is not one int32.
xla::ffi::ErrorOr<int64_t> HandleValue(const Handle& handle);
#ifdef JAXDATA_WITH_CUDA
// GPU handlers: copies the ids of handle operands (device memory) to `ids`, and waits for the
// stream, since the handler must know the table before it launches anything. The wait costs a
// few microseconds per call: it is the price of executables that are not tied to one table.
xla::ffi::Error DeviceHandleValues(cudaStream_t stream, std::initializer_list<const Handle*> handles,
                                   int64_t* ids);
#endif

// For handlers: the view, or an error naming the id when it is closed or unknown, or when its
// geometry is not the one the program was compiled for.
xla::ffi::ErrorOr<TableView> LookupTable(int64_t id, int64_t expected_rows,
                                         int64_t expected_row_bytes);
// The same, for GPU handlers: also an error when the table is not mapped into the GPU's address
// space (made with no GPU visible, or pinned=False).
xla::ffi::ErrorOr<TableView> LookupMappedTable(int64_t id, int64_t expected_rows,
                                               int64_t expected_row_bytes);

// A graph's in-neighbour CSR as two tables: indptr (num_nodes + 1 rows of one int64) and
// indices (num_edges rows of one int32). Pointers are host addresses for CPU handlers and
// device-mapped addresses for GPU handlers; the views keep the memory alive.
struct GraphView {
  TableView indptr_table, indices_table;
  const int64_t* indptr = nullptr;
  const int32_t* indices = nullptr;
  int64_t num_nodes = 0, num_edges = 0;
};
xla::ffi::ErrorOr<GraphView> LookupGraph(int64_t indptr_id, int64_t indices_id, int64_t num_nodes,
                                         int64_t num_edges, bool mapped = false);

}  // namespace jaxdata
