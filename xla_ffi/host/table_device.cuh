// Device side of the table registry (table.h): how a kernel turns a handle operand into the
// table's mapped address, for CUDA sources only.
#pragma once
#include <cstdint>

#include "table.h"

namespace jaxdata {

// Records a bad handle in the device's error block (mapped pinned memory): the details first,
// then the word that marks the error pending. Several blocks or kernels may record at once;
// each write is whole, so the host sees one of them (details of two errors may mix, never the
// word that says whether there is one).
__device__ __forceinline__ void RecordHandleError(const DeviceTableArg& t, uint32_t code,
                                                  int32_t id, int64_t got_rows,
                                                  int64_t got_row_bytes) {
  volatile DeviceError* e = t.error;
  e->op = t.op;
  e->want_rows = t.rows;
  e->want_row_bytes = t.row_bytes;
  e->got_rows = got_rows;
  e->got_row_bytes = got_row_bytes;
  __threadfence_system();
  e->word = (uint64_t(code) << 32) | uint64_t(uint32_t(id));
}

// The table's device address, or nullptr (and the error recorded) when the handle does not name
// an open, mapped table of the geometry the program was built for. One thread calls it; the
// slot is read with volatile (L1-bypassing) loads, its id first: registration writes the id
// last and closing clears it first, and the other fields of a slot change only while no kernel
// can be reading it (table.h, "Close ordering").
__device__ __forceinline__ const char* ResolveTable(const DeviceTableArg& t) {
  const int32_t id = *t.handle;
  if (id <= 0) {
    RecordHandleError(t, kHandleClosed, id, 0, 0);
    return nullptr;
  }
  const volatile DeviceSlot* slot = t.slots + (uint32_t(id) % uint32_t(kTableSlots));
  if (slot->id != id) {
    RecordHandleError(t, kHandleClosed, id, 0, 0);
    return nullptr;
  }
  __threadfence();  // the fields below are read after the id
  const char* base = slot->base;
  const int64_t rows = slot->rows, row_bytes = slot->row_bytes;
  if (rows != t.rows || row_bytes != t.row_bytes) {
    RecordHandleError(t, kHandleGeometry, id, rows, row_bytes);
    return nullptr;
  }
  if (base == nullptr) {
    RecordHandleError(t, kHandleNotMapped, id, rows, row_bytes);
    return nullptr;
  }
  return base;
}

// ResolveTable once per block: thread 0 resolves, every thread gets the result. Every thread of
// the block must call it (it synchronizes the block, twice, so that it may be called again).
__device__ __forceinline__ const char* ResolveTableForBlock(const DeviceTableArg& t) {
  __shared__ const char* resolved;
  if (threadIdx.x == 0) resolved = ResolveTable(t);
  __syncthreads();
  const char* base = resolved;
  __syncthreads();
  return base;
}

// Resolves a handle and reads nothing: for calls with no work, so that a bad handle is reported
// as it is when there is work.
static __global__ void CheckHandleKernel(DeviceTableArg t) { ResolveTable(t); }

}  // namespace jaxdata
