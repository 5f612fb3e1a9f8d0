// host_gather and host_slice on the CPU: rows copied by XLA's intra-op thread pool.
#include <cstring>
#include <vector>

#include "../common/parallel.h"
#include "gather.h"
#include "handlers.h"
#include "table.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxdata {
namespace {

constexpr int64_t kGrainBytes = 256 << 10;  // a task copies about this much


template <typename I>
void GatherRows(ffi::ThreadPool& pool, const I* idx, int64_t n, const TableView& t, int32_t mode,
                const unsigned char* fill_row, char* out) {
  const char* base = t.buffer->data();
  const int64_t rb = t.row_bytes;
  ParallelFor(pool, n, kGrainBytes / rb + 1, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const int64_t row = ResolveRow(idx[k], t.rows, mode);
      std::memcpy(out + k * rb, row >= 0 ? base + row * rb : reinterpret_cast<const char*>(fill_row),
                  rb);
    }
  });
}

// `scratch` and `sort` matter only on the GPU; the CPU reads rows in the order given.
ffi::Error HostGatherCpu(ffi::ThreadPool pool, Handle handle, ffi::AnyBuffer idx,
                         ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> /*scratch*/,
                         int64_t rows, int32_t mode, int64_t fill_bits, int32_t /*sort*/) {
  auto id = HandleValue(handle);
  if (id.has_error()) return id.error();
  const int64_t rb = OutputRowBytes(*out);
  auto table = LookupTable(*id, rows, rb);
  if (table.has_error()) return table.error();
  const int64_t n = idx.element_count();
  if (n == 0) return ffi::Error::Success();
  std::vector<unsigned char> fill_row(rb);
  RepeatPattern(uint64_t(fill_bits), ffi::ByteWidth(out->element_type()), fill_row.data(), rb);
  char* dst = static_cast<char*>(out->untyped_data());
  switch (idx.element_type()) {
    case ffi::S32:
      GatherRows(pool, idx.typed_data<int32_t>(), n, *table, mode, fill_row.data(), dst);
      return ffi::Error::Success();
    case ffi::S64:
      GatherRows(pool, idx.typed_data<int64_t>(), n, *table, mode, fill_row.data(), dst);
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("jaxdata_host_gather: indices must be int32 or int64");
  }
}

ffi::Error HostSliceCpu(ffi::ThreadPool pool, Handle handle, ffi::Result<ffi::AnyBuffer> out,
                        int64_t rows, int64_t start) {
  auto id = HandleValue(handle);
  if (id.has_error()) return id.error();
  const int64_t rb = OutputRowBytes(*out);
  auto table = LookupTable(*id, rows, rb);
  if (table.has_error()) return table.error();
  const int64_t bytes = out->size_bytes();
  if (start < 0 || start * rb + bytes > table->rows * rb) {
    return ffi::Error(ffi::ErrorCode::kOutOfRange, "jaxdata_host_slice: rows out of range");
  }
  const char* src = table->buffer->data() + start * rb;
  char* dst = static_cast<char*>(out->untyped_data());
  ParallelFor(pool, bytes, kGrainBytes * 16, [&](int64_t begin, int64_t end) {
    std::memcpy(dst + begin, src + begin, end - begin);
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxdata

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdata_host_gather_cpu, jaxdata::HostGatherCpu,
                              jaxdata::BindHostGather<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdata_host_slice_cpu, jaxdata::HostSliceCpu,
                              jaxdata::BindHostSlice<ffi::ThreadPool>());
