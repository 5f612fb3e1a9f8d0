#include "table.h"

#include <limits>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>

#ifdef JAXDATA_WITH_CUDA
#include "../common/cuda_check.h"
#endif

namespace jaxdata {
namespace {

namespace ffi = xla::ffi;

struct Registry {
  std::mutex mu;
  int64_t next_id = 1;
  std::unordered_map<int64_t, TableView> tables;
};

Registry& GetRegistry() {
  static Registry* registry = new Registry();  // never destroyed: handlers may run at exit
  return *registry;
}

}  // namespace

int64_t RegisterTable(std::shared_ptr<HostBuffer> buffer, int64_t rows, int64_t row_bytes) {
  if (rows < 0 || row_bytes <= 0 || uint64_t(rows) * uint64_t(row_bytes) > buffer->size()) {
    throw std::invalid_argument("table geometry does not fit its buffer");
  }
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.next_id > std::numeric_limits<int32_t>::max()) {
    throw std::overflow_error("this process has made 2**31 - 1 host tables; ids are not reused");
  }
  const int64_t id = r.next_id++;
  r.tables[id] = TableView{std::move(buffer), rows, row_bytes};
  return id;
}

void CloseTable(int64_t id) {
  TableView dropped;  // released outside the lock: freeing pinned memory waits for the GPUs
  {
    Registry& r = GetRegistry();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.tables.find(id);
    if (it == r.tables.end()) return;
    dropped = std::move(it->second);
    r.tables.erase(it);
  }
}

int64_t OpenTableCount() {
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  return int64_t(r.tables.size());
}

ffi::ErrorOr<int64_t> HandleValue(const Handle& handle) {
  if (handle.element_count() != 1) {
    return ffi::Unexpected(ffi::Error::InvalidArgument("jaxdata: a table handle is one int32"));
  }
  return int64_t(handle.typed_data()[0]);
}

#ifdef JAXDATA_WITH_CUDA
ffi::Error DeviceHandleValues(cudaStream_t stream, std::initializer_list<const Handle*> handles,
                              int64_t* ids) {
  int32_t values[4] = {0, 0, 0, 0};
  if (handles.size() > 4) return ffi::Error::Internal("jaxdata: too many table handles");
  int k = 0;
  for (const Handle* h : handles) {
    if (h->element_count() != 1) {
      return ffi::Error::InvalidArgument("jaxdata: a table handle is one int32");
    }
    JAXDATA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(&values[k++], h->typed_data(), sizeof(int32_t),
                                                 cudaMemcpyDeviceToHost, stream));
  }
  JAXDATA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  for (int i = 0; i < k; ++i) ids[i] = values[i];
  return ffi::Error::Success();
}
#endif

ffi::ErrorOr<TableView> LookupTable(int64_t id, int64_t expected_rows, int64_t expected_row_bytes) {
  TableView view;
  {
    Registry& r = GetRegistry();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.tables.find(id);
    if (it == r.tables.end()) {
      return ffi::Unexpected(ffi::Error(
          ffi::ErrorCode::kFailedPrecondition,
          "jaxdata: HostTable #" + std::to_string(id) +
              " is closed (or was never opened); a computation cannot read or write it"));
    }
    view = it->second;
  }
  if (view.rows != expected_rows || view.row_bytes != expected_row_bytes) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        "jaxdata: HostTable #" + std::to_string(id) + " has " + std::to_string(view.rows) +
        " rows of " + std::to_string(view.row_bytes) + " bytes; the computation was built for " +
        std::to_string(expected_rows) + " rows of " + std::to_string(expected_row_bytes)));
  }
  return view;
}

ffi::ErrorOr<TableView> LookupMappedTable(int64_t id, int64_t expected_rows,
                                          int64_t expected_row_bytes) {
  auto table = LookupTable(id, expected_rows, expected_row_bytes);
  if (!table.has_error() && table->buffer->device_data() == nullptr) {
    return ffi::Unexpected(ffi::Error(
        ffi::ErrorCode::kFailedPrecondition,
        "jaxdata: HostTable #" + std::to_string(id) +
            " is not in pinned, device-mapped memory (it was made while no GPU was visible, or "
            "with pinned=False); a GPU cannot read it"));
  }
  return table;
}

ffi::ErrorOr<GraphView> LookupGraph(int64_t indptr_id, int64_t indices_id, int64_t num_nodes,
                                    int64_t num_edges, bool mapped) {
  auto lookup = mapped ? LookupMappedTable : LookupTable;
  auto indptr = lookup(indptr_id, num_nodes + 1, sizeof(int64_t));
  if (indptr.has_error()) return ffi::Unexpected(indptr.error());
  auto indices = lookup(indices_id, num_edges, sizeof(int32_t));
  if (indices.has_error()) return ffi::Unexpected(indices.error());
  GraphView g;
  g.indptr_table = *indptr;
  g.indices_table = *indices;
  g.indptr = reinterpret_cast<const int64_t*>(mapped ? indptr->buffer->device_data()
                                                     : indptr->buffer->data());
  g.indices = reinterpret_cast<const int32_t*>(mapped ? indices->buffer->device_data()
                                                      : indices->buffer->data());
  g.num_nodes = indptr->rows - 1;
  g.num_edges = indices->rows;
  return g;
}

}  // namespace jaxdata
