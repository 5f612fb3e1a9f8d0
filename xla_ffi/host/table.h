// The registry of host tables.
//
// A host table is a HostBuffer seen as `rows` rows of `row_bytes` bytes. Python holds a table's
// id; a jitted program receives it as a run-time operand (an int32 scalar: the table's "handle"),
// never as a compile-time attribute, so one executable serves every table of a shape and dtype
// and holds none of them alive. Ids are never reused, so the handle of a table that has since
// been closed never names another table.
//
// Two views of the registry:
//  - on the host, id -> TableView (CPU handlers, host_slice and host_scatter_add on a GPU, which
//    read the handle in host memory or copy it back);
//  - on every GPU that has run a jaxdata host kernel, a fixed array of kTableSlots DeviceSlots in
//    device memory, which kernels read themselves: table `id` lives in slot id % kTableSlots
//    (registration picks the next unused id whose slot is free). host_gather and
//    sample_neighbors pass the handle operand and the slot array to their kernels and never
//    wait for the GPU: a kernel resolves the handle, checks it against the geometry the program
//    was built for, and reads the table only if everything matches.
//
// Close ordering (what makes a racing close safe): CloseTable (1) drops the id from the host
// map, (2) sets the slot's id to 0 on every device (a synchronous copy), (3) waits for every such
// device (cudaDeviceSynchronize), and only then (4) frees the slot for reuse and releases its
// reference to the memory. A kernel that resolved the handle before (2) has finished by the end
// of (3); one that starts after (2) sees id 0 and reads nothing. The memory itself is freed by
// the last owner (~HostBuffer waits for every GPU first), so it may outlive the id.
//
// Errors a kernel finds (a closed, unknown or forged handle; the wrong geometry; a table not in
// mapped memory) cannot stop the computation that is already running: the kernel reads nothing
// (fill values, padding, no additions) and records the error in a small block of mapped pinned
// memory of its device. Every jaxdata host handler on that device checks the block when it is
// called and returns the recorded error (an ffi::Error naming the table and the earlier call),
// so the next jaxdata host call on the device fails with it. host_scatter_add waits for its
// kernel anyway and reports its own call's error at once.
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

// How many tables may be open at once in a process (one device slot each).
constexpr int64_t kTableSlots = int64_t(1) << 16;

// One table as GPU kernels see it. `id` 0 marks a free slot; `base` is null for a table that is
// not in device-mapped memory. Kernels read `id` first and the rest only when it matches.
struct DeviceSlot {
  int32_t id;
  int32_t pad;
  const char* base;
  int64_t rows;
  int64_t row_bytes;
};

// What a kernel found wrong with a handle (DeviceError::code).
enum HandleError : uint32_t { kHandleOk = 0, kHandleClosed = 1, kHandleNotMapped = 2,
                              kHandleGeometry = 3 };
// Which operation found it (DeviceError::op).
enum HandleOp : uint32_t { kOpGather = 1, kOpSample = 2, kOpScatterAdd = 3 };

// The error block of one device, in mapped pinned memory. A kernel writes the details, then
// `word` = code << 32 | uint32(id) (nonzero: an error is pending); handlers take it on the host.
struct DeviceError {
  uint64_t word;
  uint32_t op, pad;
  int64_t want_rows, want_row_bytes;  // the geometry the program was built for
  int64_t got_rows, got_row_bytes;    // the slot's (kHandleGeometry)
};

// What a kernel needs to resolve a handle: passed by value as a kernel argument.
struct DeviceTableArg {
  const int32_t* handle;     // the operand (device memory)
  const DeviceSlot* slots;   // this device's registry
  DeviceError* error;        // this device's error block (device address)
  int64_t rows, row_bytes;   // the geometry the program was built for
  uint32_t op;
};

// Registers a view of `buffer` (rows * row_bytes <= buffer->size()) and returns its id, in
// [1, 2**31 - 1] (an int32 handle); throws once a process has used them all, or when
// kTableSlots tables are open. The slot is written to every GPU's registry before it returns.
int64_t RegisterTable(std::shared_ptr<HostBuffer> buffer, int64_t rows, int64_t row_bytes);
// Forgets the id (see "Close ordering" above: waits for the GPUs that have a registry); the
// memory goes when no other view, handler or NumPy view holds it.
void CloseTable(int64_t id);
// How many tables are open now (for leak tests).
int64_t OpenTableCount();

// The row size in bytes of a handler's output (last dimension times element width).
inline int64_t OutputRowBytes(const xla::ffi::AnyBuffer& out) {
  auto dims = out.dimensions();
  return dims.size() == 0 ? 0 : dims.back() * int64_t(xla::ffi::ByteWidth(out.element_type()));
}

using Handle = xla::ffi::Buffer<xla::ffi::S32>;  // a table's id, as an operand

// An error unless the operand is one int32.
xla::ffi::Error CheckHandleShape(const Handle& handle);
// CPU handlers: the id a handle operand holds (its memory is host memory), or an error when the
// operand is not one int32.
xla::ffi::ErrorOr<int64_t> HandleValue(const Handle& handle);
#ifdef JAXDATA_WITH_CUDA
// GPU handlers that need the table on the host (host_slice, host_scatter_add): copies the ids
// of handle operands (device memory) to `ids` and waits for the stream.
xla::ffi::Error DeviceHandleValues(cudaStream_t stream, std::initializer_list<const Handle*> handles,
                                   int64_t* ids);

// The registry of the device that `stream` belongs to, made on first use (device memory for the
// slots, filled with every open table; mapped pinned memory for the error block).
struct DeviceTables {
  int device = 0;
  const DeviceSlot* slots = nullptr;
  DeviceError* error_host = nullptr;    // the error block, host address
  DeviceError* error_device = nullptr;  // the same, device address
  // A kernel argument for `handle`, checked against the given geometry.
  DeviceTableArg Arg(const Handle& handle, int64_t rows, int64_t row_bytes, HandleOp op) const {
    return DeviceTableArg{handle.typed_data(), slots, error_device, rows, row_bytes,
                          uint32_t(op)};
  }
};
xla::ffi::ErrorOr<DeviceTables> StreamDeviceTables(cudaStream_t stream);
// Every GPU handler calls this first: the error an earlier kernel on this device recorded (and
// clears it), or success. Reads host memory only; never waits for the GPU.
xla::ffi::Error TakeDeviceError(const DeviceTables& tables);
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
// indices (num_edges rows of one int32), for CPU handlers; the views keep the memory alive.
struct GraphView {
  TableView indptr_table, indices_table;
  const int64_t* indptr = nullptr;
  const int32_t* indices = nullptr;
  int64_t num_nodes = 0, num_edges = 0;
};
xla::ffi::ErrorOr<GraphView> LookupGraph(int64_t indptr_id, int64_t indices_id, int64_t num_nodes,
                                         int64_t num_edges);

}  // namespace jaxdata
