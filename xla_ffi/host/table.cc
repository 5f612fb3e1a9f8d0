#include "table.h"

#include <atomic>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#ifdef JAXDATA_WITH_CUDA
#include "../common/cuda_check.h"
#endif

namespace jaxdata {
namespace {

namespace ffi = xla::ffi;

constexpr int kMaxDevices = 64;

#ifdef JAXDATA_WITH_CUDA
// One GPU's copy of the slots, and its error block. Made once, never freed (handlers may run at
// interpreter exit).
struct DeviceRegistry {
  int device = 0;
  DeviceSlot* slots = nullptr;       // kTableSlots, device memory
  DeviceError* error_host = nullptr;  // mapped pinned memory
  DeviceError* error_device = nullptr;
  cudaStream_t stream = nullptr;     // private: registry writes never wait for XLA's work
};
#endif

struct Registry {
  std::mutex mu;
  int64_t next_id = 1;
  std::unordered_map<int64_t, TableView> tables;
  std::vector<DeviceSlot> slots = std::vector<DeviceSlot>(size_t(kTableSlots), DeviceSlot{});
  std::vector<bool> slot_used = std::vector<bool>(size_t(kTableSlots), false);
  int64_t slots_in_use = 0;  // open tables, and closed ones whose slot is not free yet
#ifdef JAXDATA_WITH_CUDA
  std::atomic<DeviceRegistry*> devices[kMaxDevices] = {};
#endif
};

Registry& GetRegistry() {
  static Registry* registry = new Registry();  // never destroyed: handlers may run at exit
  return *registry;
}

int64_t SlotOf(int64_t id) { return int64_t(uint64_t(uint32_t(id)) % uint64_t(kTableSlots)); }

std::string ClosedMessage(int64_t id) {
  return "jaxdata: HostTable #" + std::to_string(id) +
         " is closed (or was never opened); a computation cannot read or write it";
}

std::string GeometryMessage(int64_t id, int64_t rows, int64_t row_bytes, int64_t want_rows,
                            int64_t want_row_bytes) {
  return "jaxdata: HostTable #" + std::to_string(id) + " has " + std::to_string(rows) +
         " rows of " + std::to_string(row_bytes) + " bytes; the computation was built for " +
         std::to_string(want_rows) + " rows of " + std::to_string(want_row_bytes);
}

std::string NotMappedMessage(int64_t id) {
  return "jaxdata: HostTable #" + std::to_string(id) +
         " is not in pinned, device-mapped memory (it was made while no GPU was visible, or "
         "with pinned=False); a GPU cannot read it";
}

#ifdef JAXDATA_WITH_CUDA
// Runs `fn(registry)` on every GPU that has a registry, with that device current. Caller holds
// r.mu (so no registry appears meanwhile) when fn writes slots.
template <typename Fn>
void ForEachDevice(Registry& r, Fn fn) {
  struct RestoreDevice {  // also when fn throws
    int device = -1;
    ~RestoreDevice() {
      if (device >= 0) cudaSetDevice(device);
    }
  } restore;
  if (cudaGetDevice(&restore.device) != cudaSuccess) {
    cudaGetLastError();
    restore.device = -1;
  }
  for (int d = 0; d < kMaxDevices; ++d) {
    DeviceRegistry* dev = r.devices[d].load(std::memory_order_acquire);
    if (dev == nullptr) continue;
    if (cudaSetDevice(d) != cudaSuccess) {
      cudaGetLastError();
      continue;
    }
    fn(*dev);
  }
}

// Copies `bytes` of host memory to `dst` on dev's device and waits for that copy alone.
cudaError_t WriteDevice(DeviceRegistry& dev, void* dst, const void* src, size_t bytes) {
  cudaError_t err = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, dev.stream);
  if (err == cudaSuccess) err = cudaStreamSynchronize(dev.stream);
  return err;
}

// Writes slot s to every device. A table's slot goes in two steps: everything with id 0 (the
// slot still reads as free), then the id alone, so a kernel that sees the id sees the rest. A
// closed table's slot gets id 0 alone: the other fields stay as they were until the slot is
// reused, which CloseTable allows only once no kernel can still be reading them.
void PublishSlot(Registry& r, int64_t s) {
  const DeviceSlot slot = r.slots[size_t(s)];
  DeviceSlot hidden = slot;
  hidden.id = 0;
  ForEachDevice(r, [&](DeviceRegistry& dev) {
    cudaError_t err = cudaSuccess;
    if (slot.id != 0) err = WriteDevice(dev, dev.slots + s, &hidden, sizeof(DeviceSlot));
    if (err == cudaSuccess) err = WriteDevice(dev, &dev.slots[s].id, &slot.id, sizeof(int32_t));
    if (err != cudaSuccess) {
      cudaGetLastError();
      throw std::runtime_error(CudaMessage(err, "jaxdata: writing the GPU table registry"));
    }
  });
}
#endif

}  // namespace

int64_t RegisterTable(std::shared_ptr<HostBuffer> buffer, int64_t rows, int64_t row_bytes) {
  if (rows < 0 || row_bytes <= 0 || uint64_t(rows) * uint64_t(row_bytes) > buffer->size()) {
    throw std::invalid_argument("table geometry does not fit its buffer");
  }
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.slots_in_use >= kTableSlots) {
    throw std::overflow_error("this process has " + std::to_string(kTableSlots) +
                              " host tables open, the most it may; close some first");
  }
  // The next id whose slot is free: fewer than kTableSlots are used, so this ends within
  // kTableSlots steps. Ids are never reused.
  int64_t id = r.next_id;
  while (id <= std::numeric_limits<int32_t>::max() && r.slot_used[size_t(SlotOf(id))]) ++id;
  if (id > std::numeric_limits<int32_t>::max()) {
    throw std::overflow_error("this process has made 2**31 - 1 host tables; ids are not reused");
  }
  const int64_t s = SlotOf(id);
  const char* base = buffer->device_data();
  r.slots[size_t(s)] = DeviceSlot{int32_t(id), 0, base, rows, row_bytes};
#ifdef JAXDATA_WITH_CUDA
  try {
    PublishSlot(r, s);
  } catch (...) {
    r.slots[size_t(s)] = DeviceSlot{};
    try {
      PublishSlot(r, s);
    } catch (...) {
    }
    throw;
  }
#endif
  r.slot_used[size_t(s)] = true;
  ++r.slots_in_use;
  r.next_id = id + 1;
  r.tables[id] = TableView{std::move(buffer), rows, row_bytes};
  return id;
}

void CloseTable(int64_t id) {
  TableView dropped;  // released outside the lock: freeing pinned memory waits for the GPUs
  Registry& r = GetRegistry();
  const int64_t s = SlotOf(id);
  {
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.tables.find(id);
    if (it == r.tables.end()) return;
    dropped = std::move(it->second);
    r.tables.erase(it);
    r.slots[size_t(s)] = DeviceSlot{};
#ifdef JAXDATA_WITH_CUDA
    try {
      PublishSlot(r, s);  // id 0 on every device: kernels starting from now read nothing
    } catch (...) {
      // The slot stays used (never reissued) and the buffer reference is kept forever: a GPU
      // whose registry could not be cleared may still name this memory.
      new TableView(std::move(dropped));
      return;
    }
#endif
  }
#ifdef JAXDATA_WITH_CUDA
  // Kernels that resolved the id before the slot was cleared finish here. Not under the lock:
  // handlers never wait for it, and the GPUs' queued work never waits for us.
  ForEachDevice(r, [](DeviceRegistry&) {
    if (cudaDeviceSynchronize() != cudaSuccess) cudaGetLastError();
  });
#endif
  std::lock_guard<std::mutex> lock(r.mu);
  r.slot_used[size_t(s)] = false;  // only now may a new table take the slot
  --r.slots_in_use;
}

int64_t OpenTableCount() {
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  return int64_t(r.tables.size());
}

ffi::Error CheckHandleShape(const Handle& handle) {
  if (handle.element_count() != 1) {
    return ffi::Error::InvalidArgument("jaxdata: a table handle is one int32");
  }
  return ffi::Error::Success();
}

ffi::ErrorOr<int64_t> HandleValue(const Handle& handle) {
  if (auto err = CheckHandleShape(handle); !err.success()) return ffi::Unexpected(err);
  return int64_t(handle.typed_data()[0]);
}

#ifdef JAXDATA_WITH_CUDA
ffi::Error DeviceHandleValues(cudaStream_t stream, std::initializer_list<const Handle*> handles,
                              int64_t* ids) {
  int32_t values[4] = {0, 0, 0, 0};
  if (handles.size() > 4) return ffi::Error::Internal("jaxdata: too many table handles");
  int k = 0;
  for (const Handle* h : handles) {
    if (auto err = CheckHandleShape(*h); !err.success()) return err;
    JAXDATA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(&values[k++], h->typed_data(), sizeof(int32_t),
                                                 cudaMemcpyDeviceToHost, stream));
  }
  JAXDATA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  for (int i = 0; i < k; ++i) ids[i] = values[i];
  return ffi::Error::Success();
}

ffi::ErrorOr<DeviceTables> StreamDeviceTables(cudaStream_t stream) {
  // The stream's own device: a kernel must never get another device's registry address.
  int device = 0;
#if CUDART_VERSION >= 12080
  cudaError_t got = cudaStreamGetDevice(stream, &device);
  if (got != cudaSuccess) {  // e.g. a driver older than the call: XLA made the device current
    cudaGetLastError();
    got = cudaGetDevice(&device);
  }
#else
  cudaError_t got = cudaGetDevice(&device);
#endif
  if (got != cudaSuccess) {
    cudaGetLastError();
    return ffi::Unexpected(ffi::Error::Internal(CudaMessage(got, "cudaStreamGetDevice")));
  }
  if (device < 0 || device >= kMaxDevices) {
    return ffi::Unexpected(ffi::Error::Internal("jaxdata: GPU ordinal " + std::to_string(device) +
                                                " is past the " + std::to_string(kMaxDevices) +
                                                " the table registry supports"));
  }
  Registry& r = GetRegistry();
  DeviceRegistry* dev = r.devices[device].load(std::memory_order_acquire);
  if (dev == nullptr) {
    // First use on this device (XLA has made it current): allocate, copy every slot, publish.
    std::lock_guard<std::mutex> lock(r.mu);
    dev = r.devices[device].load(std::memory_order_acquire);
    if (dev == nullptr) {
      int current = -1;  // XLA has made the stream's device current; if not, for this only
      if (cudaGetDevice(&current) != cudaSuccess) cudaGetLastError(), current = -1;
      if (current != device && cudaSetDevice(device) != cudaSuccess) cudaGetLastError();
      struct Restore {
        int device;
        ~Restore() {
          if (device >= 0) cudaSetDevice(device);
        }
      } restore{current};
      auto made = std::make_unique<DeviceRegistry>();
      made->device = device;
      void* slots = nullptr;
      void* error = nullptr;
      void* error_device = nullptr;
      cudaError_t err = cudaMalloc(&slots, sizeof(DeviceSlot) * size_t(kTableSlots));
      if (err == cudaSuccess) err = cudaStreamCreateWithFlags(&made->stream, cudaStreamNonBlocking);
      if (err == cudaSuccess) {
        err = cudaHostAlloc(&error, sizeof(DeviceError),
                            cudaHostAllocPortable | cudaHostAllocMapped);
      }
      if (err == cudaSuccess) err = cudaHostGetDevicePointer(&error_device, error, 0);
      if (err == cudaSuccess) {
        made->slots = static_cast<DeviceSlot*>(slots);
        *static_cast<DeviceError*>(error) = DeviceError{};
        made->error_host = static_cast<DeviceError*>(error);
        made->error_device = static_cast<DeviceError*>(error_device);
        err = WriteDevice(*made, made->slots, r.slots.data(),
                          sizeof(DeviceSlot) * size_t(kTableSlots));
      }
      if (err != cudaSuccess) {  // a half-made registry is leaked, never published
        cudaGetLastError();
        return ffi::Unexpected(ffi::Error::Internal(
            CudaMessage(err, "jaxdata: making the GPU table registry")));
      }
      dev = made.release();
      r.devices[device].store(dev, std::memory_order_release);
    }
  }
  DeviceTables t;
  t.device = device;
  t.slots = dev->slots;
  t.error_host = dev->error_host;
  t.error_device = dev->error_device;
  return t;
}

ffi::Error TakeDeviceError(const DeviceTables& tables) {
  DeviceError* e = tables.error_host;
  auto* word_ptr = &e->word;
  uint64_t word = __atomic_load_n(word_ptr, __ATOMIC_ACQUIRE);
  if (word == 0) return ffi::Error::Success();
  const volatile DeviceError* v = e;  // written by the GPU
  DeviceError seen{};
  seen.op = v->op;
  seen.want_rows = v->want_rows, seen.want_row_bytes = v->want_row_bytes;
  seen.got_rows = v->got_rows, seen.got_row_bytes = v->got_row_bytes;
  // Cleared only if no other error replaced it meanwhile (that one stays for the next call).
  uint64_t expected = word;  // the exchange overwrites it when it fails; `word` stays ours
  __atomic_compare_exchange_n(word_ptr, &expected, uint64_t(0), false, __ATOMIC_ACQ_REL,
                              __ATOMIC_ACQUIRE);
  const uint32_t code = uint32_t(word >> 32);
  const int64_t id = int32_t(uint32_t(word));
  const char* op = seen.op == kOpGather       ? "host_gather"
                   : seen.op == kOpSample     ? "sample_neighbors"
                   : seen.op == kOpScatterAdd ? "host_scatter_add"
                                              : "jaxdata host call";
  const char* nothing = seen.op == kOpGather   ? "its output holds fill values"
                        : seen.op == kOpSample ? "its output is padding"
                                               : "it added nothing";
  std::string what;
  ffi::ErrorCode kind = ffi::ErrorCode::kFailedPrecondition;
  if (code == kHandleGeometry) {
    what = GeometryMessage(id, seen.got_rows, seen.got_row_bytes, seen.want_rows,
                           seen.want_row_bytes);
    kind = ffi::ErrorCode::kInvalidArgument;
  } else if (code == kHandleNotMapped) {
    what = NotMappedMessage(id);
  } else {
    what = ClosedMessage(id);
  }
  return ffi::Error(kind, what + " (found on GPU " + std::to_string(tables.device) + " by an " +
                              "earlier " + op + ", which read nothing from the table: " +
                              nothing + ". GPU kernels check table handles as they run, "
                              "without waiting, so the next jaxdata host call on the device "
                              "reports it)");
}
#endif

ffi::ErrorOr<TableView> LookupTable(int64_t id, int64_t expected_rows, int64_t expected_row_bytes) {
  TableView view;
  {
    Registry& r = GetRegistry();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.tables.find(id);
    if (it == r.tables.end()) {
      return ffi::Unexpected(ffi::Error(ffi::ErrorCode::kFailedPrecondition, ClosedMessage(id)));
    }
    view = it->second;
  }
  if (view.rows != expected_rows || view.row_bytes != expected_row_bytes) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        GeometryMessage(id, view.rows, view.row_bytes, expected_rows, expected_row_bytes)));
  }
  return view;
}

ffi::ErrorOr<TableView> LookupMappedTable(int64_t id, int64_t expected_rows,
                                          int64_t expected_row_bytes) {
  auto table = LookupTable(id, expected_rows, expected_row_bytes);
  if (!table.has_error() && table->buffer->device_data() == nullptr) {
    return ffi::Unexpected(ffi::Error(ffi::ErrorCode::kFailedPrecondition, NotMappedMessage(id)));
  }
  return table;
}

ffi::ErrorOr<GraphView> LookupGraph(int64_t indptr_id, int64_t indices_id, int64_t num_nodes,
                                    int64_t num_edges) {
  auto indptr = LookupTable(indptr_id, num_nodes + 1, sizeof(int64_t));
  if (indptr.has_error()) return ffi::Unexpected(indptr.error());
  auto indices = LookupTable(indices_id, num_edges, sizeof(int32_t));
  if (indices.has_error()) return ffi::Unexpected(indices.error());
  GraphView g;
  g.indptr_table = *indptr;
  g.indices_table = *indices;
  g.indptr = reinterpret_cast<const int64_t*>(indptr->buffer->data());
  g.indices = reinterpret_cast<const int32_t*>(indices->buffer->data());
  g.num_nodes = indptr->rows - 1;
  g.num_edges = indices->rows;
  return g;
}

}  // namespace jaxdata
