// host_scatter_add on the CPU: table[rows[j]] += updates[perm[j]], in place in host memory.
//
// Python hands the kernel the resolved row of every update sorted stably (rows), and where each
// came from (perm). A run of equal rows belongs to the task that holds its first position, which
// adds the run's updates to the table row one after another, in their original order: the result
// is exactly NumPy's np.add.at(table, indices, updates), rounding after every addition.
//
// Concurrency: a call holds its table memory's update lock (HostBuffer::update_mutex) from its
// first addition to its last, so calls from several threads or devices on one table run one
// after another, each as a whole: no addition is lost, and each call's result is that of
// np.add.at applied to the table as the previous call left it. An uncontended lock costs one
// atomic operation per call, nothing per addition (atomic float adds would cost one CAS loop per
// element and would let two calls' additions of a row interleave).
#include <cstdint>
#include <cstring>
#include <mutex>

#include "../common/parallel.h"
#include "handlers.h"
#include "scatter.h"
#include "table.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxdata {
namespace {

// One addition in the element type, rounded to it as NumPy does.
template <typename T>
struct Add {
  static T Do(T a, T b) { return a + b; }
};
template <>
struct Add<int32_t> {  // wraps around, like NumPy
  static int32_t Do(int32_t a, int32_t b) { return int32_t(uint32_t(a) + uint32_t(b)); }
};
template <>
struct Add<int64_t> {
  static int64_t Do(int64_t a, int64_t b) { return int64_t(uint64_t(a) + uint64_t(b)); }
};

struct Bf16 {
  uint16_t bits;
};
inline float Bf16ToFloat(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t FloatToBf16(float f) {  // round to nearest even, NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
template <>
struct Add<Bf16> {
  static Bf16 Do(Bf16 a, Bf16 b) { return {FloatToBf16(Bf16ToFloat(a.bits) + Bf16ToFloat(b.bits))}; }
};
#ifdef __FLT16_MAX__
template <>
struct Add<_Float16> {
  static _Float16 Do(_Float16 a, _Float16 b) { return _Float16(float(a) + float(b)); }
};
#endif

template <typename T, typename R>
void ScatterRuns(ffi::ThreadPool& pool, const R* rows, const int32_t* perm, int64_t n,
                 const T* updates, int64_t cols, T* table, int64_t table_rows) {
  ParallelFor(pool, n, 4096 / cols + 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int64_t row = rows[j];
      if ((j > 0 && rows[j - 1] == rows[j]) || row < 0 || row >= table_rows) continue;
      T* dst = table + row * cols;
      for (int64_t p = j; p < n && rows[p] == rows[j]; ++p) {
        const T* src = updates + int64_t(perm[p]) * cols;
        for (int64_t c = 0; c < cols; ++c) dst[c] = Add<T>::Do(dst[c], src[c]);
      }
    }
  });
}

template <typename R>
ffi::Error ScatterTyped(ffi::ThreadPool& pool, const R* rows, const int32_t* perm, int64_t n,
                        ffi::AnyBuffer& updates, int64_t cols, char* table, int64_t table_rows) {
  const void* u = updates.untyped_data();
  switch (updates.element_type()) {
#define JAXDATA_CASE(TYPE, T)                                                                  \
  case ffi::TYPE:                                                                              \
    ScatterRuns(pool, rows, perm, n, static_cast<const T*>(u), cols, reinterpret_cast<T*>(table), \
                table_rows);                                                                   \
    return ffi::Error::Success();
    JAXDATA_CASE(F32, float)
    JAXDATA_CASE(F64, double)
    JAXDATA_CASE(S32, int32_t)
    JAXDATA_CASE(S64, int64_t)
    JAXDATA_CASE(BF16, Bf16)
#ifdef __FLT16_MAX__
    JAXDATA_CASE(F16, _Float16)
#endif
#undef JAXDATA_CASE
    default:
      return ffi::Error::InvalidArgument(
          "jaxdata_host_scatter_add: updates must be float32, float64, bfloat16, float16, int32 "
          "or int64");
  }
}

ffi::Error HostScatterAddCpu(ffi::ThreadPool pool, Handle handle, ffi::AnyBuffer rows,
                             ffi::Buffer<ffi::S32> perm, ffi::AnyBuffer updates,
                             ffi::Result<ffi::Buffer<ffi::S32>> token, int64_t table_rows) {
  const int64_t n = rows.element_count();
  auto columns = ScatterColumns(rows, perm, updates);
  if (columns.has_error()) return columns.error();
  const int64_t cols = *columns;
  auto id = HandleValue(handle);
  if (id.has_error()) return id.error();
  auto table =
      LookupTable(*id, table_rows, cols * int64_t(ffi::ByteWidth(updates.element_type())));
  if (table.has_error()) return table.error();
  for (int64_t i = 0; i < token->element_count(); ++i) token->typed_data()[i] = 0;
  if (n == 0) return ffi::Error::Success();
  std::lock_guard<std::mutex> lock(table->buffer->update_mutex());
  char* t = table->buffer->data();
  switch (rows.element_type()) {
    case ffi::S32:
      return ScatterTyped(pool, rows.typed_data<int32_t>(), perm.typed_data(), n, updates, cols, t,
                          table->rows);
    case ffi::S64:
      return ScatterTyped(pool, rows.typed_data<int64_t>(), perm.typed_data(), n, updates, cols, t,
                          table->rows);
    default:
      return ffi::Error::InvalidArgument("jaxdata_host_scatter_add: rows must be int32 or int64");
  }
}

}  // namespace
}  // namespace jaxdata

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdata_host_scatter_add_cpu, jaxdata::HostScatterAddCpu,
                              jaxdata::BindHostScatterAdd<ffi::ThreadPool>());
