#include "table.h"

#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>

namespace jaxdata {
namespace {

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

xla::ffi::ErrorOr<TableView> LookupTable(int64_t id, int64_t expected_row_bytes) {
  TableView view;
  {
    Registry& r = GetRegistry();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.tables.find(id);
    if (it == r.tables.end()) {
      return xla::ffi::Unexpected(xla::ffi::Error(
          xla::ffi::ErrorCode::kFailedPrecondition,
          "jaxdata: HostTable #" + std::to_string(id) +
              " is closed; this computation was compiled for it and cannot run any more"));
    }
    view = it->second;
  }
  if (view.row_bytes != expected_row_bytes) {
    return xla::ffi::Unexpected(xla::ffi::Error::InvalidArgument(
        "jaxdata: HostTable #" + std::to_string(id) + " has rows of " +
        std::to_string(view.row_bytes) + " bytes, the output expects " +
        std::to_string(expected_row_bytes)));
  }
  return view;
}

xla::ffi::ErrorOr<TableView> LookupMappedTable(int64_t id, int64_t expected_row_bytes) {
  auto table = LookupTable(id, expected_row_bytes);
  if (!table.has_error() && table->buffer->device_data() == nullptr) {
    return xla::ffi::Unexpected(xla::ffi::Error(
        xla::ffi::ErrorCode::kFailedPrecondition,
        "jaxdata: HostTable #" + std::to_string(id) +
            " is not in pinned, device-mapped memory (it was made while no GPU was visible, or "
            "with pinned=False); a GPU cannot read it"));
  }
  return table;
}

xla::ffi::ErrorOr<GraphView> LookupGraph(int64_t indptr_id, int64_t indices_id, bool mapped) {
  auto lookup = mapped ? LookupMappedTable : LookupTable;
  auto indptr = lookup(indptr_id, sizeof(int64_t));
  if (indptr.has_error()) return xla::ffi::Unexpected(indptr.error());
  auto indices = lookup(indices_id, sizeof(int32_t));
  if (indices.has_error()) return xla::ffi::Unexpected(indices.error());
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
