// The registry of host tables.
//
// A host table is a HostBuffer seen as `rows` rows of `row_bytes` bytes. Python holds a table's
// id; FFI handlers receive that id as an attribute and look it up here. Ids are never reused,
// so an executable compiled for a table that has since been closed fails with a clear error
// instead of reading freed memory.
#pragma once
#include <cstdint>
#include <memory>

#include "../common/host_buffer.h"
#include "xla/ffi/api/ffi.h"

namespace jaxdata {

struct TableView {
  std::shared_ptr<HostBuffer> buffer;  // keeps the memory alive while a handler uses it
  int64_t rows = 0;
  int64_t row_bytes = 0;
};

// Registers a view of `buffer` (rows * row_bytes <= buffer->size()) and returns its id.
int64_t RegisterTable(std::shared_ptr<HostBuffer> buffer, int64_t rows, int64_t row_bytes);
// Forgets the id; the memory goes when no other view, handler or NumPy view holds it.
void CloseTable(int64_t id);

// The row size in bytes of a handler's output (last dimension times element width).
inline int64_t OutputRowBytes(const xla::ffi::AnyBuffer& out) {
  auto dims = out.dimensions();
  return dims.size() == 0 ? 0 : dims.back() * int64_t(xla::ffi::ByteWidth(out.element_type()));
}

// For handlers: the view, or an error naming the id when it is closed or unknown, or when the
// output's row size does not match the table's.
xla::ffi::ErrorOr<TableView> LookupTable(int64_t id, int64_t expected_row_bytes);
// The same, for GPU handlers: also an error when the table is not mapped into the GPU's address
// space (made with no GPU visible, or pinned=False).
xla::ffi::ErrorOr<TableView> LookupMappedTable(int64_t id, int64_t expected_row_bytes);

// A graph's in-neighbour CSR as two tables: indptr (num_nodes + 1 rows of one int64) and
// indices (num_edges rows of one int32). Pointers are host addresses for CPU handlers and
// device-mapped addresses for GPU handlers; the views keep the memory alive.
struct GraphView {
  TableView indptr_table, indices_table;
  const int64_t* indptr = nullptr;
  const int32_t* indices = nullptr;
  int64_t num_nodes = 0, num_edges = 0;
};
xla::ffi::ErrorOr<GraphView> LookupGraph(int64_t indptr_id, int64_t indices_id,
                                         bool mapped = false);

}  // namespace jaxdata
