// The extension jaxdata._xla_ffi: host buffers and tables for Python, and registrations() for
// jaxdata/_ffi.py, which registers every FFI target with JAX.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/shared_ptr.h>

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>

#include "common/host_buffer.h"
#include "data/bindings.h"
#include "hector/handlers.h"
#include "hector/kernels.h"
#include "host/handlers.h"
#include "host/table.h"
#include "offload/spill.h"
#include "offload/store.h"

namespace nb = nanobind;

namespace jaxdata {
namespace {

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, Fn, XLA_FFI_CallFrame*>);
  return nb::capsule(reinterpret_cast<void*>(fn));
}

// One row per FFI target: its name, its CPU handler and its CUDA handler (null when the extension
// is built without CUDA), so a target cannot be registered on one platform and forgotten on the
// other.
#ifdef JAXDATA_WITH_CUDA
#define JAXDATA_CUDA_HANDLER(handler) handler
#else
#define JAXDATA_CUDA_HANDLER(handler) nullptr
#endif
struct Target {
  const char* name;
  XLA_FFI_Handler* cpu;
  XLA_FFI_Handler* cuda;
};
constexpr Target kTargets[] = {
    {"jaxdata_host_gather", jaxdata_host_gather_cpu,
     JAXDATA_CUDA_HANDLER(jaxdata_host_gather_cuda)},
    {"jaxdata_host_slice", jaxdata_host_slice_cpu, JAXDATA_CUDA_HANDLER(jaxdata_host_slice_cuda)},
    {"jaxdata_host_sample", jaxdata_host_sample_cpu,
     JAXDATA_CUDA_HANDLER(jaxdata_host_sample_cuda)},
    {"jaxdata_sample", jaxdata_sample_cpu, JAXDATA_CUDA_HANDLER(jaxdata_sample_cuda)},
    {"jaxdata_host_scatter_add", jaxdata_host_scatter_add_cpu,
     JAXDATA_CUDA_HANDLER(jaxdata_host_scatter_add_cuda)},
    {"jaxdata_hector_launch", jaxdata_hector_launch_cpu,
     JAXDATA_CUDA_HANDLER(jaxdata_hector_launch_cuda)},
    // a launch that tunes its tiling on its first run (CUDA only; the CPU never tunes)
    {"jaxdata_hector_tune", jaxdata_hector_launch_cpu,
     JAXDATA_CUDA_HANDLER(jaxdata_hector_tune_cuda)},
    {"jaxdata_offload_spill", jaxdata_offload_spill_cpu,
     JAXDATA_CUDA_HANDLER(jaxdata_offload_spill_cuda)},
    {"jaxdata_offload_load", jaxdata_offload_load_cpu,
     JAXDATA_CUDA_HANDLER(jaxdata_offload_load_cuda)},
};
#undef JAXDATA_CUDA_HANDLER

// {target name: {platform: capsule}}
nb::dict Registrations() {
  nb::dict all;
  for (const Target& t : kTargets) {
    nb::dict platforms;
    platforms["cpu"] = Capsule(t.cpu);
    if (t.cuda != nullptr) platforms["CUDA"] = Capsule(t.cuda);
    all[t.name] = platforms;
  }
  return all;
}

using Bytes = nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using AnyContig = nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu>;  // read-only arrays too

void CheckRange(const HostBuffer& b, int64_t offset, int64_t nbytes) {
  if (offset < 0 || nbytes < 0 || uint64_t(offset) + uint64_t(nbytes) > b.size()) {
    throw std::out_of_range("byte range [" + std::to_string(offset) + ", " +
                            std::to_string(offset + nbytes) + ") outside a buffer of " +
                            std::to_string(b.size()) + " bytes");
  }
}

}  // namespace
}  // namespace jaxdata

NB_MODULE(_xla_ffi, m) {
  using namespace jaxdata;
  m.doc() = "jaxdata's native code: XLA FFI handlers and the host memory they read.";
  m.def("registrations", &Registrations,
        "{target name: {platform: capsule}} for jax.ffi.register_ffi_target.");
  m.def("built_with_cuda", &BuiltWithCuda);
  m.def("cuda_device_count", &CudaDeviceCount, nb::call_guard<nb::gil_scoped_release>());
  m.def("cuda_runtime_version", &CudaRuntimeVersion);
  m.def("cuda_driver_version", &CudaDriverVersion);
  m.def("physical_memory_bytes", &PhysicalMemoryBytes);
  data::AddGraphBuildFunctions(m);  // graph construction on the host (xla_ffi/data/)
  m.def(
      "sort_scratch_bytes",
      [](int64_t n, int64_t rows) -> int64_t {
#ifdef JAXDATA_WITH_CUDA
        return CudaDeviceCount() > 0 ? int64_t(HostGatherSortScratchBytes(n, rows)) : 0;
#else
        return 0;
#endif
      },
      nb::arg("n"), nb::arg("rows"),
      "Scratch bytes host_gather needs to sort n indices into a table of `rows` rows on the GPU.");

  nb::class_<HostBuffer>(m, "HostBuffer",
                         "Host memory that GPU kernels can read: pinned and mapped when CUDA is "
                         "usable, else plain 4 KiB-aligned memory.")
      .def_static(
          "allocate",
          [](int64_t nbytes, bool pinned) {
            if (nbytes < 0) throw std::invalid_argument("nbytes must be >= 0");
            nb::gil_scoped_release release;
            return HostBuffer::Allocate(size_t(nbytes), pinned);
          },
          nb::arg("nbytes"), nb::arg("pinned"))
      .def_prop_ro("nbytes", [](const HostBuffer& b) { return int64_t(b.size()); })
      .def_prop_ro("pinned", &HostBuffer::pinned)
      .def_prop_ro("address", [](const HostBuffer& b) { return uintptr_t(b.data()); })
      .def(
          "write",
          [](HostBuffer& b, int64_t offset, AnyContig src) {
            const int64_t nbytes = int64_t(src.nbytes());
            CheckRange(b, offset, nbytes);
            nb::gil_scoped_release release;  // before the lock: a scatter holding it never waits
            std::lock_guard<std::mutex> lock(b.update_mutex());  // on Python
            ParallelMemcpy(b.data() + offset, src.data(), size_t(nbytes));
          },
          nb::arg("offset"), nb::arg("src"),
          "Copies a C-contiguous array's bytes in at `offset`, serialized with in-place updates "
          "(host_scatter_add) of the same memory.")
      .def(
          "view",
          [](nb::handle self) {
            HostBuffer& b = nb::cast<HostBuffer&>(self);
            // The array's owner is this Python object, which holds the memory: the view stays
            // valid after the table is closed and the memory goes when the last view does.
            return Bytes(b.data(), {b.size()}, self);
          },
          "A writable uint8 NumPy view of the whole buffer (no copy).")
      .def(
          "read_file",
          [](HostBuffer& b, int fd, int64_t file_offset, int64_t offset, int64_t nbytes) {
            CheckRange(b, offset, nbytes);
            nb::gil_scoped_release release;
            char* dst = b.data() + offset;
            while (nbytes > 0) {
              ssize_t got = pread(fd, dst, size_t(std::min<int64_t>(nbytes, 1 << 30)), file_offset);
              if (got < 0 && errno == EINTR) continue;
              if (got <= 0) {
                throw std::runtime_error(got == 0 ? std::string("file ended early")
                                                  : std::string(std::strerror(errno)));
              }
              dst += got, file_offset += got, nbytes -= got;
            }
          },
          nb::arg("fd"), nb::arg("file_offset"), nb::arg("offset"), nb::arg("nbytes"),
          "Reads nbytes of an open file straight into the buffer (no intermediate copy).");

  m.def(
      "register_table",
      [](std::shared_ptr<HostBuffer> buffer, int64_t rows, int64_t row_bytes) {
        return RegisterTable(std::move(buffer), rows, row_bytes);
      },
      nb::arg("buffer"), nb::arg("rows"), nb::arg("row_bytes"));
  m.def("close_table", &CloseTable, nb::arg("table_id"), nb::call_guard<nb::gil_scoped_release>());
  m.def("open_table_count", &OpenTableCount, "How many host tables are open (for leak checks).");

  m.def("hector_load_cpu_kernel", &hector::LoadCpuKernel, nb::arg("kernel"), nb::arg("path"),
        nb::arg("symbol"), "Loads a generated CPU kernel from a shared library under an id.");
  m.def(
      "hector_load_cuda_kernel",
      [](int64_t kernel, nb::bytes image, std::string name) {
        hector::LoadCudaKernel(kernel, std::string(image.c_str(), image.size()), name);
      },
      nb::arg("kernel"), nb::arg("image"), nb::arg("name"),
      "Loads a generated CUDA kernel from a cubin image under an id.");
  m.def("hector_cpu_abi_version", [] { return hector::kCpuAbiVersion; });
  m.def(
      "hector_launch_counts",
      [] {
        const hector::LaunchCounts c = hector::CudaLaunchCounts();
        return nb::make_tuple(c.direct, c.captured);
      },
      "(direct, captured): how often the CUDA launcher ran on a stream, and on a stream being "
      "captured into a CUDA graph (XLA's command buffers then replay it without calling it).");
  m.def("cuda_compute_capability", &hector::CudaComputeCapability,
        "Compute capability of the current CUDA device as major*10+minor (0: none).");

  m.def(
      "offload_store_open",
      [](int64_t ram_bytes, std::string dir, int64_t ssd_bytes, int io_threads, int64_t chunk_bytes,
         int64_t staging_bytes, int64_t device_bytes, int64_t load_bytes) {
        offload::StoreOptions o{ram_bytes,     std::move(dir), ssd_bytes,   io_threads,
                                chunk_bytes,   staging_bytes,  device_bytes, load_bytes};
        nb::gil_scoped_release release;
        return offload::RegisterStore(std::make_shared<offload::TensorStore>(o));
      },
      nb::arg("ram_bytes"), nb::arg("dir"), nb::arg("ssd_bytes"), nb::arg("io_threads"),
      nb::arg("chunk_bytes"), nb::arg("staging_bytes"), nb::arg("device_bytes"),
      nb::arg("load_bytes"),
      "Opens a TensorStore and returns its id (handlers receive it as the `store` attribute).");
  // The store's GPU staging caps, settable while it is open.
  static constexpr auto open_store = [](int64_t id) {
    auto store = offload::FindStore(id);
    if (!store || store->closed()) throw std::invalid_argument("TensorStore is closed");
    return store;
  };
  m.def(
      "offload_store_set_device_bytes",
      [](int64_t id, int64_t n) { open_store(id)->set_device_bytes(n); },
      nb::arg("store_id"), nb::arg("device_bytes"));
  m.def(
      "offload_store_set_load_bytes",
      [](int64_t id, int64_t n) { open_store(id)->set_load_bytes(n); },
      nb::arg("store_id"), nb::arg("load_bytes"));
  m.def("offload_store_close", &offload::CloseStore, nb::arg("store_id"),
        nb::call_guard<nb::gil_scoped_release>());
  m.def(
      "offload_store_stats",
      [](int64_t id) {
        auto store = offload::FindStore(id);
        if (!store) throw std::invalid_argument("TensorStore #" + std::to_string(id) + " is closed");
        offload::StoreStats s;
        {
          nb::gil_scoped_release release;
          s = store->Stats();
        }
        nb::dict d;
        d["ram_capacity"] = s.ram_capacity, d["ram_in_use"] = s.ram_in_use;
        d["ram_peak"] = s.ram_peak, d["ssd_in_use"] = s.ssd_in_use, d["ssd_peak"] = s.ssd_peak;
        d["ssd_written"] = s.ssd_written, d["ssd_read"] = s.ssd_read;
        d["spilled"] = s.spilled, d["loaded"] = s.loaded, d["spills"] = s.spills;
        d["loads"] = s.loads, d["outstanding"] = s.outstanding;
        d["device_in_use"] = s.device_in_use, d["device_peak"] = s.device_peak;
        d["spill_peak"] = s.spill_peak, d["load_peak"] = s.load_peak;
        d["write_seconds"] = s.write_seconds, d["read_seconds"] = s.read_seconds;
        d["direct_io"] = s.direct_io, d["dir"] = s.dir;
        return d;
      },
      nb::arg("store_id"));
  m.def("offload_measure_disk_write", &offload::MeasureDiskWrite, nb::arg("dir"), nb::arg("nbytes"),
        nb::arg("threads"), nb::arg("chunk_bytes"), nb::call_guard<nb::gil_scoped_release>(),
        "Sustained direct-I/O write bandwidth of the disk under `dir`, in bytes per second.");
}
