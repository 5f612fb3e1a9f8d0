// spill / load on NVIDIA GPUs.
//
// spill, on XLA's stream: copy the arrays into one staging buffer of the store's own device
// memory (XLA may reuse the inputs as soon as the call returns), write the ticket,
// and return. Off XLA's stream: the RAM tier's host-bound copy and its checksum run on a
// side stream; the SSD tier's chunks go through pinned staging slots to the disk on a writer
// thread. Nothing on XLA's stream waits for them.
//
// load: the entry comes back to the device on another side stream, driven by a prefetch thread
// that walks the spills in reverse order (the order backward consumes them), a couple of entries
// ahead of the loads. The checksum is verified there, so a load waits only for what has not
// arrived: its call joins XLA's stream to the prefetch's event and copies device to device.
//
// The host cannot read a device ticket without a synchronization, so GPU loads take the newest
// spill of their (site, device), and a one-thread kernel compares the ticket on the device; a
// mismatch is reported by the store's next call.
#include <cuda_runtime.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../common/cuda_check.h"
#include "../common/thread_name.h"
#include "spill.h"
#include "store.h"

namespace ffi = xla::ffi;

namespace jaxdata::offload {
namespace {

constexpr int kThreads = 256;
constexpr int kPrefetchDepth = 2;  // entries brought back ahead of the load that needs them

int64_t Round256(int64_t n) { return (n + 255) / 256 * 256; }

__global__ void __launch_bounds__(kThreads)
    ChecksumKernel(const unsigned char* data, int64_t nbytes, unsigned long long* out) {
  const int64_t words = nbytes / 8;
  const uint64_t* w = reinterpret_cast<const uint64_t*>(data);
  uint64_t acc = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < words;
       i += int64_t(gridDim.x) * blockDim.x) {
    acc += MixWord(w[i], uint64_t(i));
  }
  if (blockIdx.x == 0 && threadIdx.x == 0 && nbytes % 8) {
    uint64_t tail = 0;
    for (int64_t b = 0; b < nbytes % 8; ++b) tail |= uint64_t(data[words * 8 + b]) << (8 * b);
    acc += MixWord(tail, uint64_t(words));
  }
  for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_down_sync(0xffffffffu, acc, offset);
  if ((threadIdx.x & 31) == 0) atomicAdd(out, (unsigned long long)acc);
}

__global__ void FillTicket(int32_t* ticket, int64_t n, int64_t value) {
  for (int64_t i = 2 * threadIdx.x; i < n; i += 2 * blockDim.x) EncodeTicket(ticket + i, value);
}

__global__ void CheckTicket(const int32_t* ticket, int64_t expected, int64_t* flag) {
  if (DecodeTicket(ticket) != expected) *flag = expected;
}

// Sums `nbytes` at `data` into the 8 bytes at `out` (zeroed first), on `stream`.
cudaError_t LaunchChecksum(const void* data, int64_t nbytes, void* out, cudaStream_t stream) {
  cudaError_t err = cudaMemsetAsync(out, 0, 8, stream);
  if (err != cudaSuccess) return err;
  const int64_t words = std::max<int64_t>(1, nbytes / 8);
  const int blocks = int(std::min<int64_t>((words + kThreads - 1) / kThreads, 2048));
  ChecksumKernel<<<blocks, kThreads, 0, stream>>>(static_cast<const unsigned char*>(data), nbytes,
                                                  static_cast<unsigned long long*>(out));
  return cudaGetLastError();
}

// Device staging the store owns: blocks carved first-fit from cudaMalloc'd segments, adjacent
// free ranges merged. A block is given back only once the GPU work that used it has finished
// (from a host function on the stream that used it last, or after a synchronize), so the next
// user may be any stream with no ordering at all, and what is reserved is what spills and loads
// hold at once. (A stream-ordered pool reserved a new block for almost every spill and load of a
// step on the H200, 7-8 GiB for plans holding 3-5 GiB at a time: its reuse across streams
// depends on when the driver sees a free as done.) Free is safe in host functions: no CUDA call.
class Staging {
 public:
  Staging() = default;
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  ~Staging() { Reset(); }

  cudaError_t Allocate(int64_t bytes, void** out) {
    bytes = Round256(std::max<int64_t>(bytes, 1));
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (Carve(bytes, out)) return cudaSuccess;
    }
    // A new segment; cudaMalloc outside the lock, which host functions take (Free).
    const int64_t size = (bytes + kSegmentGrain - 1) / kSegmentGrain * kSegmentGrain;
    char* base = nullptr;
    if (cudaError_t err = cudaMalloc(reinterpret_cast<void**>(&base), size_t(size)); err != cudaSuccess) {
      return err;
    }
    std::lock_guard<std::mutex> lock(mu_);
    segments_.push_back({base, size, {}, {}});
    reserved_ += size;
    reserved_peak_ = std::max(reserved_peak_, reserved_);
    if (size > bytes) segments_.back().free[bytes] = size - bytes;
    Take(segments_.back(), 0, bytes, out);
    return cudaSuccess;
  }

  void Free(void* p) {
    if (!p) return;
    std::lock_guard<std::mutex> lock(mu_);
    char* c = static_cast<char*>(p);
    for (auto& seg : segments_) {
      if (c < seg.base || c >= seg.base + seg.size) continue;
      int64_t offset = c - seg.base;
      auto taken = seg.taken.find(offset);
      if (taken == seg.taken.end()) return;
      int64_t size = taken->second;
      seg.taken.erase(taken);
      used_ -= size;
      auto next = seg.free.lower_bound(offset);
      if (next != seg.free.end() && offset + size == next->first) {
        size += next->second;
        next = seg.free.erase(next);
      }
      if (next != seg.free.begin()) {
        auto prev = std::prev(next);
        if (prev->first + prev->second == offset) {
          prev->second += size;
          return;
        }
      }
      seg.free[offset] = size;
      return;
    }
  }

  // Gives every segment back to the device (nothing may be in use).
  void Reset() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& seg : segments_) cudaFree(seg.base);
    segments_.clear();
    reserved_ = used_ = 0;
  }

  int64_t used() { std::lock_guard<std::mutex> lock(mu_); return used_; }
  int64_t reserved_peak() { std::lock_guard<std::mutex> lock(mu_); return reserved_peak_; }

 private:
  static constexpr int64_t kSegmentGrain = 2 << 20;
  struct Segment {
    char* base;
    int64_t size;
    std::map<int64_t, int64_t> free, taken;  // offset -> bytes
  };

  bool Carve(int64_t bytes, void** out) {  // first fit in the segments there are; under mu_
    for (auto& seg : segments_) {
      for (auto it = seg.free.begin(); it != seg.free.end(); ++it) {
        if (it->second < bytes) continue;
        const int64_t offset = it->first, left = it->second - bytes;
        seg.free.erase(it);
        if (left > 0) seg.free[offset + bytes] = left;
        Take(seg, offset, bytes, out);
        return true;
      }
    }
    return false;
  }

  void Take(Segment& seg, int64_t offset, int64_t bytes, void** out) {
    seg.taken[offset] = bytes;
    used_ += bytes;
    *out = seg.base + offset;
  }

  std::mutex mu_;
  std::vector<Segment> segments_;
  int64_t reserved_ = 0, reserved_peak_ = 0, used_ = 0;
};

// The device side of one entry.
struct EntryGpu {
  cudaEvent_t spilled = nullptr;    // RAM tier: the host copy and its checksum have landed
  void* dev = nullptr;              // the prefetched copy
  cudaEvent_t ready = nullptr;
  enum State { kNone, kQueued, kReady, kFailed } state = kNone;
  bool wanted = false;              // a load is waiting for it (not only prefetched)
  std::string error;
  ~EntryGpu() {
    if (spilled) cudaEventDestroy(spilled);
    if (ready) cudaEventDestroy(ready);
  }
};

EntryGpu& G(const Entry& e) { return *static_cast<EntryGpu*>(e.gpu.get()); }

// Streams, staging memory and threads of one store on one device.
class Gpu {
 public:
  Gpu(TensorStore* store, int device) : store_(store), device_(device) {}
  ~Gpu() { Stop(); }
  int device() const { return device_; }

  ffi::Error Start() {
    JAXDATA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&d2h_, cudaStreamNonBlocking));
    JAXDATA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&h2d_, cudaStreamNonBlocking));
    JAXDATA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&ssd_, cudaStreamNonBlocking));
    JAXDATA_CUDA_RETURN_IF_ERROR(cudaHostAlloc(reinterpret_cast<void**>(&flag_), sizeof(int64_t),
                                               cudaHostAllocMapped | cudaHostAllocPortable));
    *flag_ = 0;
    JAXDATA_CUDA_RETURN_IF_ERROR(
        cudaHostGetDevicePointer(reinterpret_cast<void**>(&flag_dev_), flag_, 0));
    writer_ = std::thread([this] { NameThisThread("jaxdata-writer"); WriterLoop(); });
    prefetcher_ = std::thread([this] { NameThisThread("jaxdata-fetch"); PrefetchLoop(); });
    return ffi::Error::Success();
  }

  // Called by the store's Close() once no FFI call holds it (so no handler is inside Spill or
  // Load): stops the threads, waits for the streams and frees the device staging.
  void Stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      stopping_ = true;
    }
    cv_.notify_all();
    if (writer_.joinable()) writer_.join();
    if (prefetcher_.joinable()) prefetcher_.join();
    cudaSetDevice(device_);
    for (cudaStream_t s : {d2h_, h2d_, ssd_}) {
      if (s) cudaStreamSynchronize(s);
    }
    for (auto& e : held_) G(*e).dev = nullptr;
    held_.clear();
    for (cudaStream_t s : {d2h_, h2d_, ssd_}) {
      if (s) cudaStreamDestroy(s);
    }
    d2h_ = h2d_ = ssd_ = nullptr;
    staging_.Reset();  // the streams are idle (synchronized above)
    if (flag_) cudaFreeHost(flag_), flag_ = nullptr;
  }

  // A ticket mismatch seen by the device since the last call.
  ffi::Error TakeFlag() {
    const int64_t v = *static_cast<volatile int64_t*>(flag_);
    if (v == 0) return ffi::Error::Success();
    *flag_ = 0;
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, 
        "offload: a GPU load received a ticket other than its site's newest spill (expected "
        "ticket " + std::to_string(v) + "); loads of a site must come in the reverse order of "
        "its spills, which jaxdata.offload.remat guarantees");
  }

  void NoteMemory() {
    const int64_t used = staging_.used(), high = staging_.reserved_peak();
    std::lock_guard<std::mutex> lock(mu_);
    store_->NoteDevice(used, high, spill_peak_, load_peak_);
  }

  ffi::Error Spill(cudaStream_t stream, const Parts& parts, const std::shared_ptr<Entry>& e,
                   int32_t* ticket, int64_t ticket_count) {
    auto g = std::make_shared<EntryGpu>();
    e->gpu = g;
    const int64_t n = e->nbytes, round = Round256(n);
    // The cap counts the spill's own bytes, as the planner does (its allocation adds at most
    // 511 bytes of rounding and checksum tail).
    if (!WaitForStaging(n)) {
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "offload: the TensorStore was closed");
    }
    // Until a host function or the writer takes over releasing it, an early error return does
    // (after the copies already queued are done with the staging).
    struct Claim {
      Gpu* gpu;
      int64_t bytes;
      cudaStream_t stream;
      void* block = nullptr;
      ~Claim() {
        if (!gpu) return;
        if (block) {
          cudaStreamSynchronize(stream), cudaStreamSynchronize(gpu->d2h_);
          gpu->staging_.Free(block);
        }
        gpu->Release(bytes);
      }
    } claim{this, n, stream};
    char* stage = nullptr;
    JAXDATA_CUDA_RETURN_IF_ERROR(staging_.Allocate(round + 64, reinterpret_cast<void**>(&stage)));
    claim.block = stage;
    int64_t at = 0;
    for (size_t p = 0; p < parts.data.size(); at += parts.bytes[p], ++p) {
      JAXDATA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(stage + at, parts.data[p], size_t(parts.bytes[p]),
                                                   cudaMemcpyDeviceToDevice, stream));
    }
    FillTicket<<<1, 64, 0, stream>>>(ticket, ticket_count, e->seq);
    JAXDATA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    cudaEvent_t copied;
    JAXDATA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&copied, cudaEventDisableTiming));
    JAXDATA_CUDA_RETURN_IF_ERROR(cudaEventRecord(copied, stream));
    if (e->tier == Tier::kRam) {
      // The data and, 8 bytes after its 256-byte-rounded end, its checksum, in one copy.
      JAXDATA_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(d2h_, copied, 0));
      cudaEventDestroy(copied);
      JAXDATA_CUDA_RETURN_IF_ERROR(LaunchChecksum(stage, n, stage + round, d2h_));
      JAXDATA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(store_->RamData(*e), stage, size_t(round + 8),
                                                   cudaMemcpyDeviceToHost, d2h_));
      auto* unstage = new Unstage{this, n, stage};
      if (cudaError_t err = cudaLaunchHostFunc(d2h_, &Gpu::Unstaged, unstage); err != cudaSuccess) {
        delete unstage;
        JAXDATA_CUDA_RETURN_IF_ERROR(err);
      }
      claim.gpu = nullptr;
      JAXDATA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&g->spilled, cudaEventDisableTiming));
      JAXDATA_CUDA_RETURN_IF_ERROR(cudaEventRecord(g->spilled, d2h_));
      store_->MarkStored(e);
    } else {
      claim.gpu = nullptr;
      PostWrite([this, e, stage, copied, n] {
        cudaSetDevice(device_);
        cudaStreamWaitEvent(ssd_, copied, 0);
        cudaEventDestroy(copied);
        store_->WriteSsd(e, [&](const Chunk& c, char* slot) -> std::string {
          cudaError_t err = cudaMemcpyAsync(slot, stage + c.offset, size_t(c.bytes),
                                            cudaMemcpyDeviceToHost, ssd_);
          if (err == cudaSuccess) err = cudaStreamSynchronize(ssd_);
          return err == cudaSuccess ? "" : CudaMessage(err, "offload: copy to the SSD staging");
        });
        cudaStreamSynchronize(ssd_);
        staging_.Free(stage);
        Release(n);
      });
    }
    NoteMemory();
    return ffi::Error::Success();
  }

  ffi::Error Load(cudaStream_t stream, const int32_t* ticket, const Parts& out,
                  const std::shared_ptr<Entry>& e) {
    CheckTicket<<<1, 1, 0, stream>>>(ticket, e->seq, flag_dev_);
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
      Discard(e);  // popped, and no load will copy it out: its prefetch place and block back
      store_->Free(e);
      return ffi::Error(ffi::ErrorCode::kInternal, CudaMessage(err, "offload: load"));
    }
    EntryGpu& g = G(*e);
    {
      std::unique_lock<std::mutex> lock(mu_);
      std::vector<std::shared_ptr<Entry>> want{e};
      for (auto& p : store_->Preceding(*e, kPrefetchDepth)) {
        if (p->device == device_ && p->gpu) want.push_back(p);
      }
      g.wanted = true;
      for (auto& p : want) {
        if (G(*p).state != EntryGpu::kNone) continue;
        G(*p).state = EntryGpu::kQueued;
        prefetches_.push_back(p);
      }
      cv_.notify_all();
      cv_.wait(lock, [&] { return g.state == EntryGpu::kReady || g.state == EntryGpu::kFailed ||
                                  stopping_; });
      if (g.state != EntryGpu::kReady) {  // as on the CPU: a close is not a disk error
        return ffi::Error(store_->closed() ? ffi::ErrorCode::kFailedPrecondition
                                           : ffi::ErrorCode::kDataLoss,
                          g.error.empty() ? "offload: the TensorStore was closed while loading "
                                            "ticket " + std::to_string(e->seq)
                                          : g.error);
      }
      if (auto it = std::find(held_.begin(), held_.end(), e); it != held_.end()) held_.erase(it);
    }
    // Given back by a host function on the h2d stream once XLA's stream has copied it out; on
    // an error before that is queued, here, once the copies already queued are done.
    cudaError_t err = cudaStreamWaitEvent(stream, g.ready, 0);
    int64_t at = 0;
    for (size_t p = 0; err == cudaSuccess && p < out.data.size(); at += out.bytes[p], ++p) {
      err = cudaMemcpyAsync(out.data[p], static_cast<char*>(g.dev) + at, size_t(out.bytes[p]),
                            cudaMemcpyDeviceToDevice, stream);
    }
    cudaEvent_t copied = nullptr;
    if (err == cudaSuccess) err = cudaEventCreateWithFlags(&copied, cudaEventDisableTiming);
    if (err == cudaSuccess) err = cudaEventRecord(copied, stream);
    if (err == cudaSuccess) err = cudaStreamWaitEvent(h2d_, copied, 0);
    if (copied) cudaEventDestroy(copied);
    auto* unheld = new Unstage{this, e->nbytes, g.dev};
    if (err == cudaSuccess) err = cudaLaunchHostFunc(h2d_, &Gpu::Unheld, unheld);
    g.dev = nullptr;
    if (err != cudaSuccess) {
      cudaStreamSynchronize(stream);
      Unheld(unheld);  // deletes it
      return ffi::Error(ffi::ErrorCode::kInternal, CudaMessage(err, "offload: load"));
    }
    NoteMemory();
    return ffi::Error::Success();
  }

  // A popped entry that will not be loaded (its load failed its checks): out of the prefetch
  // queue, or its prefetched copy given back.
  void Discard(const std::shared_ptr<Entry>& e) {
    if (!e->gpu) return;
    EntryGpu& g = G(*e);
    std::unique_lock<std::mutex> lock(mu_);
    if (auto it = std::find(prefetches_.begin(), prefetches_.end(), e); it != prefetches_.end()) {
      prefetches_.erase(it);
      g.state = EntryGpu::kNone;
      return;
    }
    if (g.state == EntryGpu::kQueued) {  // being brought back now
      cv_.wait(lock, [&] { return g.state != EntryGpu::kQueued || stopping_; });
    }
    if (g.state != EntryGpu::kReady || !g.dev) return;
    if (auto it = std::find(held_.begin(), held_.end(), e); it != held_.end()) held_.erase(it);
    void* block = g.dev;
    g.dev = nullptr;
    g.state = EntryGpu::kFailed;
    lock.unlock();
    GiveBack(block, e->nbytes);  // Bring synchronized its copies
  }

 private:
  // Spills' device staging still in flight to the host, capped by the store's device_bytes:
  // XLA's host thread runs ahead of the GPU, so without the cap every spill of a step would be
  // staged at once. Past it, a spill waits (on XLA's host thread: the GPU keeps working through
  // what is queued) until earlier copies finish; one spill always proceeds.
  struct Unstage {
    Gpu* gpu;
    int64_t bytes;
    void* block;  // its staging, now free
  };

  static void CUDART_CB Unstaged(void* arg) {  // a host function on the d2h stream
    std::unique_ptr<Unstage> u(static_cast<Unstage*>(arg));
    u->gpu->staging_.Free(u->block);
    u->gpu->Release(u->bytes);
  }

  void Release(int64_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    staged_ -= bytes;
    cv_.notify_all();
  }

  // Loads brought back and not yet copied out on XLA's stream. XLA's host thread runs ahead of
  // the GPU and asks for each load as soon as the previous one is back, so without a limit the
  // prefetcher would bring back every load of a backward pass long before the GPU needs them.
  // A prefetch (no load waiting for it yet) waits while kPrefetchDepth are held; a load that is
  // waited for always proceeds, so at most kPrefetchDepth + 1 are held: the one being copied out
  // and the next kPrefetchDepth (the one in use is given back as soon as it is copied out, at the
  // start of its block's backward pass, so kPrefetchDepth come back while a block computes).
  // The store's load_bytes caps the bytes held as well: a prefetch that would pass it waits,
  // unless nothing is held.
  static void CUDART_CB Unheld(void* arg) {  // a host function on the h2d stream
    std::unique_ptr<Unstage> u(static_cast<Unstage*>(arg));
    u->gpu->GiveBack(u->block, u->bytes);
  }

  // A held load's end (copied out, discarded, or failed): its block (if any) back to the
  // staging, its place back to the prefetcher. Called without mu_, which it takes.
  void GiveBack(void* block, int64_t bytes) {
    staging_.Free(block);
    std::lock_guard<std::mutex> lock(mu_);
    held_count_ -= 1;
    held_bytes_ -= bytes;
    cv_.notify_all();
  }

  // False when the store closed while waiting.
  bool WaitForStaging(int64_t bytes) {
    const int64_t cap = store_->device_bytes();
    std::unique_lock<std::mutex> lock(mu_);
    if (cap > 0) {
      cv_.wait(lock, [&] { return stopping_ || staged_ == 0 || staged_ + bytes <= cap; });
    }
    if (stopping_) return false;
    staged_ += bytes;
    spill_peak_ = std::max(spill_peak_, staged_);
    return true;
  }

  void PostWrite(std::function<void()> job) {
    std::lock_guard<std::mutex> lock(mu_);
    writes_.push_back(std::move(job));
    cv_.notify_all();
  }

  // The SSD writer: runs queued jobs in order. Stop() lets it finish the queue: a job waits
  // for its spill's copy into the staging on XLA's stream before it gives the staging back, and
  // once the store is closed it writes nothing (WriteSsd fails it as closed at once).
  void WriterLoop() {
    cudaSetDevice(device_);
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stopping_ || !writes_.empty(); });
      if (writes_.empty()) return;  // stopping, nothing left
      auto job = std::move(writes_.front());
      writes_.pop_front();
      lock.unlock();
      job();
      lock.lock();
    }
  }

  // The prefetcher: brings queued entries back to the device, in queue order.
  void PrefetchLoop() {
    cudaSetDevice(device_);
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      // The queue's first entry, or past the limits the first one a load waits for.
      auto next = prefetches_.end();
      cv_.wait(lock, [&] {
        if (stopping_) return true;
        const int64_t cap = store_->load_bytes();
        next = prefetches_.begin();
        const bool room =
            next != prefetches_.end() && held_count_ < kPrefetchDepth &&
            (cap <= 0 || held_count_ == 0 || held_bytes_ + (*next)->nbytes <= cap);
        if (!room) {
          next = std::find_if(prefetches_.begin(), prefetches_.end(),
                              [](const auto& p) { return G(*p).wanted; });
        }
        return next != prefetches_.end();
      });
      if (stopping_) return;
      auto e = std::move(*next);
      prefetches_.erase(next);
      held_.push_back(e);
      held_count_ += 1;
      held_bytes_ += e->nbytes;
      load_peak_ = std::max(load_peak_, held_bytes_);
      lock.unlock();
      std::string error = Bring(*e);
      if (!error.empty()) {  // no load will copy it out
        // Not under mu_: h2d_ may hold Unheld host functions of earlier loads, which take it.
        if (G(*e).dev) cudaStreamSynchronize(h2d_);
        GiveBack(std::exchange(G(*e).dev, nullptr), e->nbytes);
      }
      store_->Free(e);  // the host copy is no longer needed
      lock.lock();
      G(*e).state = error.empty() ? EntryGpu::kReady : EntryGpu::kFailed;
      G(*e).error = error;
      cv_.notify_all();
    }
  }

  // Copies the entry to a new device buffer on the h2d stream and verifies it; "" or a message.
  std::string Bring(Entry& e) {
    EntryGpu& g = G(e);
    ffi::Error stored = store_->WaitStored(e);
    if (stored.failure()) return stored.message();
    const int64_t n = e.nbytes, round = Round256(n);
    auto fail = [](cudaError_t err, const char* what) { return CudaMessage(err, what); };
    cudaError_t err = staging_.Allocate(round + 64, &g.dev);
    if (err != cudaSuccess) return fail(err, "offload: device buffer for a load");
    char* dev = static_cast<char*>(g.dev);
    if (e.tier == Tier::kRam) {
      uint64_t* tail = store_->RamTail(e);
      if ((err = cudaStreamWaitEvent(h2d_, g.spilled, 0)) != cudaSuccess ||
          (err = cudaMemcpyAsync(dev, store_->RamData(e), size_t(n), cudaMemcpyHostToDevice,
                                 h2d_)) != cudaSuccess ||
          (err = LaunchChecksum(dev, n, dev + round, h2d_)) != cudaSuccess ||
          (err = cudaMemcpyAsync(tail + 1, dev + round, 8, cudaMemcpyDeviceToHost, h2d_)) !=
              cudaSuccess ||
          (err = cudaStreamSynchronize(h2d_)) != cudaSuccess) {
        return fail(err, "offload: copy back from the RAM tier");
      }
      if (tail[0] != tail[1]) {
        return "offload: checksum mismatch in the RAM tier (ticket " + std::to_string(e.seq) + ")";
      }
    } else {
      std::string copy_error;
      ffi::Error read = store_->ReadSsd(e, [&](const Chunk& c, const char* host) {
        cudaError_t err = cudaMemcpyAsync(dev + c.offset, host, size_t(c.bytes),
                                          cudaMemcpyHostToDevice, h2d_);
        if (err == cudaSuccess) err = cudaStreamSynchronize(h2d_);
        if (err != cudaSuccess && copy_error.empty()) {
          copy_error = CudaMessage(err, "offload: copy back from the SSD staging");
        }
      });
      if (read.failure()) return read.message();
      if (!copy_error.empty()) return copy_error;
    }
    if (!g.ready && (err = cudaEventCreateWithFlags(&g.ready, cudaEventDisableTiming)) != cudaSuccess) {
      return fail(err, "offload: event");
    }
    if ((err = cudaEventRecord(g.ready, h2d_)) != cudaSuccess) return fail(err, "offload: event");
    return "";
  }

  TensorStore* store_;
  int device_;
  cudaStream_t d2h_ = nullptr, h2d_ = nullptr, ssd_ = nullptr;
  Staging staging_;
  int64_t* flag_ = nullptr;
  int64_t* flag_dev_ = nullptr;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  int64_t staged_ = 0;  // bytes of spill staging whose copy to the host has not finished
  int64_t held_count_ = 0, held_bytes_ = 0;  // loads brought back, not yet copied out
  int64_t spill_peak_ = 0, load_peak_ = 0;   // the largest staged_ and held_bytes_
  std::deque<std::function<void()>> writes_;
  std::deque<std::shared_ptr<Entry>> prefetches_;
  std::vector<std::shared_ptr<Entry>> held_;  // prefetched (or in flight), not yet loaded
  std::thread writer_, prefetcher_;
};

// The store's Gpu per device.
struct Gpus {
  std::mutex mu;
  std::map<int, std::shared_ptr<Gpu>> by_device;
};

// The device a call runs on: its stream's (with several devices in one process, e.g. under
// shard_map, each device's spills and loads must reach that device's Gpu and stacks; the
// current device of the calling thread is only a fallback, for a runtime or driver without
// cudaStreamGetDevice).
ffi::ErrorOr<int> StreamDevice(cudaStream_t stream) {
  int device = 0;
#if CUDART_VERSION >= 12080
  cudaError_t err = cudaStreamGetDevice(stream, &device);
  if (err != cudaSuccess) {
    cudaGetLastError();
    err = cudaGetDevice(&device);
  }
#else
  cudaError_t err = cudaGetDevice(&device);
#endif
  if (err != cudaSuccess) {
    cudaGetLastError();
    return ffi::Unexpected(ffi::Error::Internal(CudaMessage(err, "cudaStreamGetDevice")));
  }
  return device;
}

ffi::ErrorOr<std::shared_ptr<Gpu>> GpuFor(TensorStore& store, cudaStream_t stream) {
  auto found = StreamDevice(stream);
  if (found.has_error()) return ffi::Unexpected(found.error());
  const int device = *found;
  auto gpus = std::static_pointer_cast<Gpus>(store.GpuState([&store]() -> std::shared_ptr<void> {
    auto made = std::make_shared<Gpus>();
    std::weak_ptr<Gpus> weak = made;
    store.OnClose([weak] {
      if (auto g = weak.lock()) {
        std::lock_guard<std::mutex> lock(g->mu);
        for (auto& [d, gpu] : g->by_device) gpu->Stop();
      }
    });
    return made;
  }));
  std::lock_guard<std::mutex> lock(gpus->mu);
  auto& gpu = gpus->by_device[device];
  if (!gpu) {
    auto made = std::make_shared<Gpu>(&store, device);
    if (auto err = made->Start(); err.failure()) return ffi::Unexpected(err);
    gpu = made;
  }
  return gpu;
}

ffi::Error SpillCuda(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                     int64_t store_id, int64_t site, int64_t tier) {
  auto store = OpenStore(store_id);
  if (store.has_error()) return store.error();
  auto gpu = GpuFor(**store, stream);
  if (gpu.has_error()) return gpu.error();
  if (auto err = (*gpu)->TakeFlag(); err.failure()) return err;
  auto parts = ArgParts(args, 0);
  if (parts.has_error()) return parts.error();
  auto ticket = SpillTicket(rets);
  if (ticket.has_error()) return ticket.error();
  auto e = (*store)->Begin(site, (*gpu)->device(), parts->bytes, Tier(tier));
  if (e.has_error()) return e.error();
  return (*gpu)->Spill(stream, *parts, *e, ticket->pairs, ticket->count);
}

ffi::Error LoadCuda(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                    int64_t store_id, int64_t site) {
  auto store = OpenStore(store_id);
  if (store.has_error()) return store.error();
  auto gpu = GpuFor(**store, stream);
  if (gpu.has_error()) return gpu.error();
  if (auto err = (*gpu)->TakeFlag(); err.failure()) return err;
  auto ticket = LoadTicket(args);
  if (ticket.has_error()) return ticket.error();
  auto parts = RetParts(rets, 0);
  if (parts.has_error()) return parts.error();
  auto e = (*store)->Pop(site, (*gpu)->device(), -1);
  if (e.has_error()) return e.error();
  if (auto err = CheckSameParts((*e)->parts, *parts); err.failure()) {
    (*gpu)->Discard(*e);
    (*store)->Free(*e);
    return err;
  }
  if (!(*e)->gpu) {
    (*store)->Free(*e);
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "offload: a GPU load of a ticket spilled on the CPU");
  }
  return (*gpu)->Load(stream, *ticket, *parts, *e);
}

}  // namespace
}  // namespace jaxdata::offload

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxdata_offload_spill_cuda, jaxdata::offload::SpillCuda,
    jaxdata::offload::BindSpill<ffi::PlatformStream<cudaStream_t>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxdata_offload_load_cuda, jaxdata::offload::LoadCuda,
    jaxdata::offload::BindLoad<ffi::PlatformStream<cudaStream_t>>());
