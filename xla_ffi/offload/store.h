// TensorStore: where offloaded activations wait for the backward pass.
//
// Two tiers. RAM: a pinned (device-mapped when a GPU is present) arena of `ram_bytes`, carved
// into one region per tensor. SSD: one file per tensor in a per-process directory, written and
// read with direct I/O in `chunk_bytes` pieces through a pool of pinned staging slots by
// `io_threads` threads. A tensor goes to RAM when it fits, else to SSD ("auto"), or to the tier
// asked for.
//
// Every tensor ("entry") is cut into chunks, each with a 64-bit checksum taken when its bytes
// reach the host and verified when they come back. Entries are kept per call site ("site") as a
// stack, because the backward pass consumes a site's spills in the reverse order of the forward
// pass (also across the iterations of a scan); a ticket number checks the pairing. An entry's
// memory or file is released as soon as it has been loaded.
//
// The store is CUDA-agnostic: the GPU handlers (spill_cuda.cu) keep their device-side state in
// Entry::gpu and drive the copies; the store owns tiers, files, threads, checksums and stats.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "../common/host_buffer.h"
#include "xla/ffi/api/ffi.h"

namespace jaxdata::offload {

enum class Tier : int { kAuto = 0, kRam = 1, kSsd = 2 };

struct StoreOptions {
  int64_t ram_bytes = 0;               // RAM tier capacity
  std::string dir;                     // parent directory of the SSD tier; "" = no SSD tier
  int64_t ssd_bytes = 0;               // SSD tier capacity; 0 = as much as the disk holds
  int io_threads = 4;
  int64_t chunk_bytes = 8 << 20;       // I/O unit and checksum unit; a multiple of 4096
  int64_t staging_bytes = 256 << 20;   // pinned slots between device/host and the disk
  int64_t device_bytes = 0;            // cap on device staging of spills in flight; 0 = none
  int64_t load_bytes = 0;              // cap on device staging of prefetched loads; 0 = none
};

// The checksum of a chunk: position-dependent 64-bit mix of its 8-byte words (the tail padded
// with zeros), summed. The CUDA kernel in spill_cuda.cu computes the same function.
#ifdef __CUDACC__
#define JAXDATA_HOST_DEVICE __host__ __device__
#else
#define JAXDATA_HOST_DEVICE
#endif
JAXDATA_HOST_DEVICE inline uint64_t MixWord(uint64_t w, uint64_t i) {
  uint64_t z = w ^ (i * 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
// `first_word` is the index of data's first word in its entry, so the sums of an entry's chunks
// add up to the sum of the whole entry.
uint64_t Checksum(const char* data, int64_t nbytes, int64_t first_word);

struct Chunk {
  int64_t offset = 0, bytes = 0;  // within the entry's bytes
  uint64_t sum = 0;
};

struct Entry {
  int64_t seq = 0;       // the ticket number: unique in the process, in spill order
  int64_t site = 0;
  int device = 0;
  int64_t nbytes = 0;
  std::vector<int64_t> parts;  // bytes of each array, concatenated in order
  Tier tier = Tier::kRam;
  int64_t ram_offset = -1;     // RAM tier: region in the arena
  std::string path;            // SSD tier
  int fd = -1;
  std::vector<Chunk> chunks;
  // Guarded by the store's mutex:
  bool stored = false;         // every chunk is in its tier, checksummed (or `error` is set)
  int writes_left = 0;
  std::string error;
  std::shared_ptr<void> gpu;   // the CUDA handlers' per-entry state
};

struct StoreStats {
  int64_t ram_capacity = 0, ram_in_use = 0, ram_peak = 0;
  int64_t ssd_in_use = 0, ssd_peak = 0, ssd_written = 0, ssd_read = 0;
  int64_t spilled = 0, loaded = 0, spills = 0, loads = 0, outstanding = 0;
  int64_t device_in_use = 0, device_peak = 0;  // device staging owned by the store (reserved)
  int64_t spill_peak = 0, load_peak = 0;       // of it: spills in flight, loads held (bytes)
  double write_seconds = 0, read_seconds = 0;  // time with at least one SSD write/read in flight
  bool direct_io = true;                       // false where the filesystem refused O_DIRECT
  std::string dir;                             // the per-process directory ("" without SSD)
};

class TensorStore {
 public:
  explicit TensorStore(const StoreOptions& options);  // throws std::runtime_error
  ~TensorStore();
  TensorStore(const TensorStore&) = delete;
  TensorStore& operator=(const TensorStore&) = delete;

  // Marks the store closed, so that every wait and every I/O task of an FFI call in flight ends
  // with a "the TensorStore was closed" error; waits until every such call has returned (see
  // Enter), stops the GPU handlers' work (OnClose) and the I/O threads, then frees every tier:
  // entries' files and descriptors (loaded or not), the RAM arena, the staging slots, the
  // directory. Idempotent.
  void Close();
  // An FFI call's hold on the store: false once it is closed. Close() waits until every hold is
  // given back (Leave), so nothing it frees is still in use. LookupStore takes and gives back
  // holds for the handlers.
  bool Enter();
  void Leave();
  bool closed() const { return closed_.load(); }
  const StoreOptions& options() const { return options_; }
  // The cap on GPU spill staging (StoreOptions::device_bytes), adjustable while open.
  int64_t device_bytes() const { return device_bytes_.load(std::memory_order_relaxed); }
  void set_device_bytes(int64_t n) { device_bytes_.store(n, std::memory_order_relaxed); }
  // The cap on GPU load staging (StoreOptions::load_bytes), adjustable while open. A new value
  // is read at the prefetcher's next wake-up: it only holds prefetches back while a load is
  // held, and every held load's end wakes it.
  int64_t load_bytes() const { return load_bytes_.load(std::memory_order_relaxed); }
  void set_load_bytes(int64_t n) { load_bytes_.store(n, std::memory_order_relaxed); }

  // A new entry of arrays with `parts` bytes, in the tier asked for (kAuto: RAM if it fits,
  // else SSD). The entry is on the stack of (site, device) when this returns.
  xla::ffi::ErrorOr<std::shared_ptr<Entry>> Begin(int64_t site, int device,
                                                   std::vector<int64_t> parts, Tier tier);
  char* RamData(const Entry& e) const { return arena_->data() + e.ram_offset; }
  // 64 bytes after the entry's RAM region that the GPU handlers use for checksums.
  uint64_t* RamTail(const Entry& e) const {
    return reinterpret_cast<uint64_t*>(RamData(e) + (e.nbytes + 255) / 256 * 256);
  }

  // RAM tier: checksums the entry's chunks on the I/O threads and marks it stored.
  void FinishRamAsync(const std::shared_ptr<Entry>& e);
  // Marks an entry stored whose checksum and arrival the caller tracks itself (GPU RAM tier).
  void MarkStored(const std::shared_ptr<Entry>& e) { MarkWritten(e, ""); }
  // SSD tier, for each chunk in order: `fill(chunk, slot)` puts the chunk's bytes into a pinned
  // staging slot (on the calling thread, which may block until a slot is free); an I/O thread
  // then checksums it and a disk writer writes it, and the entry is stored after its last
  // chunk. When `fill` returns an error message the entry fails with it.
  void WriteSsd(const std::shared_ptr<Entry>& e,
                const std::function<std::string(const Chunk&, char* slot)>& fill);

  // The entry with ticket `seq` (which must belong to `site`), or with seq -1 the newest entry
  // of (site, device) (the GPU handlers cannot read the ticket on the host; they check it on
  // the device).
  xla::ffi::ErrorOr<std::shared_ptr<Entry>> Pop(int64_t site, int device, int64_t seq);
  // Blocks until the entry is stored; its error if it failed.
  xla::ffi::Error WaitStored(const Entry& e);
  // RAM tier: verifies every chunk's checksum (on the I/O threads).
  xla::ffi::Error VerifyRam(const Entry& e);
  // SSD tier: reads the chunks (several in flight on the I/O threads), verifies each, and hands
  // them in order to `consume(chunk, host_bytes)` on the calling thread.
  xla::ffi::Error ReadSsd(const Entry& e,
                          const std::function<void(const Chunk&, const char*)>& consume);
  // Releases the entry's region or file (once; later calls do nothing).
  void Free(const std::shared_ptr<Entry>& e);
  // Entries spilled before `e` that are still waiting to be loaded, nearest first.
  std::vector<std::shared_ptr<Entry>> Preceding(const Entry& e, int n);

  // The GPU handlers' device staging: in use now, reserved high-water mark, and the peaks of
  // spills in flight and loads held.
  void NoteDevice(int64_t in_use, int64_t peak, int64_t spill_peak, int64_t load_peak);
  StoreStats Stats();
  // Runs in Close() once no FFI call holds the store, before the I/O threads stop and the tiers
  // are freed (the GPU handlers stop their threads and streams and free their device staging).
  void OnClose(std::function<void()> hook);
  // Per-store state of the GPU handlers, made once by `make`.
  std::shared_ptr<void> GpuState(const std::function<std::shared_ptr<void>()>& make);
  // A GPU handler's failure that could only be seen after it returned; reported by the next call.
  void SetDeferredError(std::string message);
  xla::ffi::Error TakeDeferredError();

 private:
  char* AcquireSlot();  // blocks until a staging slot is free; nullptr once closed
  void ReleaseSlot(char* slot);
  // Queues a task for the I/O threads; `write`: for the disk writers, which only write (each
  // holds one direct-I/O write in flight, as the disk probe's writers do, with checksums and
  // reads on the other threads).
  void Post(std::function<void()> task, bool write = false);
  void IoLoop(std::deque<std::function<void()>>* queue);
  void WaitIdle();
  int64_t AllocateRam(int64_t nbytes);  // -1 when it does not fit
  void ReleaseRam(int64_t offset, int64_t nbytes);
  void EnterIo(bool write);
  void LeaveIo(bool write, int64_t bytes);
  void MarkWritten(const std::shared_ptr<Entry>& e, const std::string& error);

  StoreOptions options_;
  std::atomic<int64_t> device_bytes_{0};
  std::atomic<int64_t> load_bytes_{0};
  std::atomic<bool> closed_{false};
  std::shared_ptr<HostBuffer> arena_, staging_;
  std::string dir_;
  bool direct_io_ = true;

  std::mutex mu_;
  std::condition_variable cv_;                 // entries stored, slots freed, I/O idle
  std::map<int64_t, int64_t> free_;            // RAM arena: offset -> bytes
  std::vector<char*> slots_;
  std::map<std::pair<int64_t, int>, std::vector<std::shared_ptr<Entry>>> sites_;
  std::map<int64_t, std::shared_ptr<Entry>> live_;  // seq -> entry, not yet popped
  std::map<int64_t, std::shared_ptr<Entry>> owned_;  // seq -> entry, not yet freed
  int holds_ = 0;                              // FFI calls in flight (Enter / Leave)
  StoreStats stats_;
  int writes_in_flight_ = 0, reads_in_flight_ = 0;
  std::chrono::steady_clock::time_point write_start_, read_start_;
  std::string deferred_error_;
  std::vector<std::function<void()>> on_close_;
  std::mutex gpu_mu_;
  std::shared_ptr<void> gpu_state_;

  std::deque<std::function<void()>> tasks_, writes_;
  int busy_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

// The registry: Python holds a store's id, handlers receive it as an attribute. Ids of closed
// stores are given to new ones (the smallest free id), so that compiled programs are reused.
int64_t RegisterStore(std::shared_ptr<TensorStore> store);
std::shared_ptr<TensorStore> FindStore(int64_t id);  // nullptr when unknown
void CloseStore(int64_t id);
// The open store `id`, held (Enter) for as long as the returned pointer or a copy of it lives:
// a handler keeps it for its whole call, and Close() waits for it. An error once closed.
xla::ffi::ErrorOr<std::shared_ptr<TensorStore>> LookupStore(int64_t id);

// Writes `nbytes` to a fresh file in `dir` with direct I/O, `threads` writers of `chunk_bytes`,
// and returns bytes per second (the disk's sustained write bandwidth; the file is removed).
double MeasureDiskWrite(const std::string& dir, int64_t nbytes, int threads, int64_t chunk_bytes);

}  // namespace jaxdata::offload
