#include "store.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#include "../common/thread_name.h"

namespace ffi = xla::ffi;
namespace fs = std::filesystem;

namespace jaxdata::offload {
namespace {

constexpr int64_t kAlign = 4096;     // direct I/O: offsets, lengths and buffers
constexpr int64_t kRamAlign = 256;
constexpr int64_t kTailBytes = 64;   // after each RAM region, for the GPU handlers' checksums

int64_t RoundUp(int64_t n, int64_t a) { return (n + a - 1) / a * a; }

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

// A byte count in the largest unit that keeps it at least 1 ("512 bytes", "39.1 KiB",
// "1.5 GiB"), so that small stores' sizes do not all read "0.00 GiB".
std::string Size(int64_t bytes) {
  if (bytes < 1024 && bytes > -1024) return std::to_string(bytes) + " bytes";
  const char* units[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = double(bytes) / 1024;
  int u = 0;
  while (u < 4 && (v >= 1024 || v <= -1024)) v /= 1024, ++u;
  char buf[48];
  std::snprintf(buf, sizeof(buf), "%.1f %s", v, units[u]);
  return buf;
}

ffi::Error ClosedError(const std::string& what) {
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    "offload: the TensorStore was closed " + what);
}

// Directories of earlier processes that died without cleaning up (their pid no longer runs).
void RemoveStaleDirectories(const fs::path& parent) {
  std::error_code ec;
  for (const auto& d : fs::directory_iterator(parent, ec)) {
    const std::string name = d.path().filename().string();
    const std::string prefix = "jaxdata-offload-";
    if (name.rfind(prefix, 0) != 0) continue;
    const long pid = std::strtol(name.c_str() + prefix.size(), nullptr, 10);
    if (pid <= 0 || pid == long(getpid())) continue;
    if (kill(pid_t(pid), 0) != 0 && errno == ESRCH) fs::remove_all(d.path(), ec);
  }
}

// Opens `path` for direct I/O; where the filesystem refuses O_DIRECT (tmpfs), without it.
int OpenFile(const std::string& path, int flags, bool* direct) {
  int fd = *direct ? open(path.c_str(), flags | O_DIRECT | O_CLOEXEC, 0600) : -1;
  if (fd < 0 && (!*direct || errno == EINVAL)) {
    *direct = false;
    fd = open(path.c_str(), flags | O_CLOEXEC, 0600);
  }
  return fd;
}

// Full-length pwrite/pread; "" or a message.
std::string WriteAll(int fd, const char* src, int64_t n, int64_t offset) {
  while (n > 0) {
    ssize_t got = pwrite(fd, src, size_t(n), offset);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return got < 0 ? std::strerror(errno) : "wrote 0 bytes";
    src += got, n -= got, offset += got;
  }
  return "";
}

int64_t ReadAll(int fd, char* dst, int64_t n, int64_t offset, std::string* error) {
  int64_t done = 0;
  while (done < n) {
    ssize_t got = pread(fd, dst + done, size_t(n - done), offset + done);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      *error = std::strerror(errno);
      break;
    }
    if (got == 0) break;
    done += got;
  }
  return done;
}

// Ticket numbers are unique in the process, not only in a store: store ids are reused (see
// RegisterStore), and a ticket of a closed store must never name an entry of a later one.
std::atomic<int64_t> next_seq{1};

}  // namespace

uint64_t Checksum(const char* data, int64_t nbytes, int64_t first_word) {
  const int64_t words = nbytes / 8;
  uint64_t s0 = 0, s1 = 0;
  int64_t i = 0;
  for (; i + 1 < words; i += 2) {
    uint64_t a, b;
    std::memcpy(&a, data + 8 * i, 8);
    std::memcpy(&b, data + 8 * i + 8, 8);
    s0 += MixWord(a, uint64_t(first_word + i));
    s1 += MixWord(b, uint64_t(first_word + i + 1));
  }
  for (; i < words; ++i) {
    uint64_t a;
    std::memcpy(&a, data + 8 * i, 8);
    s0 += MixWord(a, uint64_t(first_word + i));
  }
  if (nbytes % 8) {
    uint64_t a = 0;
    std::memcpy(&a, data + 8 * words, size_t(nbytes % 8));
    s0 += MixWord(a, uint64_t(first_word + words));
  }
  return s0 + s1;
}

TensorStore::TensorStore(const StoreOptions& options)
    : options_(options), device_bytes_(options.device_bytes), load_bytes_(options.load_bytes) {
  if (options_.ram_bytes < 0) throw std::invalid_argument("ram_bytes must be >= 0");
  if (options_.io_threads < 1) throw std::invalid_argument("io_threads must be >= 1");
  if (options_.chunk_bytes <= 0 || options_.chunk_bytes % kAlign) {
    throw std::invalid_argument("chunk_bytes must be a positive multiple of 4096");
  }
  const bool pinned = CudaDeviceCount() > 0;
  const int64_t ram = RoundUp(options_.ram_bytes, kAlign);
  arena_ = HostBuffer::Allocate(size_t(std::max<int64_t>(ram, kAlign)), pinned);
  if (options_.ram_bytes / kRamAlign > 0) free_[0] = options_.ram_bytes / kRamAlign * kRamAlign;
  stats_.ram_capacity = options_.ram_bytes;

  if (!options_.dir.empty()) {
    const int64_t nslots = options_.staging_bytes / options_.chunk_bytes;
    if (nslots < 2) throw std::invalid_argument("staging_bytes must hold at least two chunks");
    std::error_code ec;
    fs::create_directories(options_.dir, ec);
    if (ec) throw std::runtime_error("cannot create the SSD directory " + options_.dir + ": " +
                                     ec.message());
    RemoveStaleDirectories(options_.dir);
    static std::atomic<int> counter{0};
    dir_ = (fs::path(options_.dir) /
            ("jaxdata-offload-" + std::to_string(getpid()) + "-" + std::to_string(counter++)))
               .string();
    if (mkdir(dir_.c_str(), 0700) != 0) {
      throw std::runtime_error(Errno("cannot create the spill directory " + dir_));
    }
    const std::string probe = dir_ + "/probe";
    int fd = OpenFile(probe, O_CREAT | O_RDWR | O_TRUNC, &direct_io_);
    if (fd < 0) {
      std::string msg = Errno("cannot write in the SSD directory " + options_.dir);
      fs::remove_all(dir_, ec);
      throw std::runtime_error(msg);
    }
    close(fd);
    unlink(probe.c_str());
    staging_ = HostBuffer::Allocate(size_t(nslots * options_.chunk_bytes), pinned);
    for (int64_t i = 0; i < nslots; ++i) slots_.push_back(staging_->data() + i * options_.chunk_bytes);
  }
  stats_.direct_io = direct_io_;
  stats_.dir = dir_;
  for (int i = 0; i < options_.io_threads; ++i) {
    threads_.emplace_back([this] { NameThisThread("jaxdata-io"); IoLoop(&tasks_); });
  }
  if (!dir_.empty()) {
    for (int i = 0; i < options_.io_threads; ++i) {
      threads_.emplace_back([this] { NameThisThread("jaxdata-write"); IoLoop(&writes_); });
    }
  }
}

TensorStore::~TensorStore() { Close(); }

void TensorStore::Close() {
  std::vector<std::function<void()>> hooks;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (closed_) return;
    closed_ = true;
    // Every wait of a call in flight (slots, stored entries, reads) sees closed_ and ends, and
    // every I/O task not yet started fails as closed; then nothing uses the tiers any more.
    cv_.notify_all();
    cv_.wait(lock, [&] { return holds_ == 0; });
    hooks.swap(on_close_);
  }
  for (auto& hook : hooks) hook();
  WaitIdle();
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
  threads_.clear();
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [seq, e] : owned_) {  // loaded or not: popped entries are here too
    if (e->fd >= 0) close(e->fd), e->fd = -1;
    if (!e->path.empty()) unlink(e->path.c_str());
    e->ram_offset = -1;
  }
  owned_.clear();
  live_.clear();
  sites_.clear();
  free_.clear();
  slots_.clear();
  arena_.reset();
  staging_.reset();
  stats_.outstanding = stats_.ram_in_use = stats_.ssd_in_use = 0;
  if (!dir_.empty()) {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
}

bool TensorStore::Enter() {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) return false;
  ++holds_;
  return true;
}

void TensorStore::Leave() {
  std::lock_guard<std::mutex> lock(mu_);
  if (--holds_ == 0) cv_.notify_all();
}

void TensorStore::Post(std::function<void()> task, bool write) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopping_) {
      (write && !dir_.empty() ? writes_ : tasks_).push_back(std::move(task));
      cv_.notify_all();
      return;
    }
  }
  task();  // closed: nobody else will run it
}

void TensorStore::IoLoop(std::deque<std::function<void()>>* queue) {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stopping_ || !queue->empty(); });
    if (queue->empty()) return;  // stopping, nothing left
    auto task = std::move(queue->front());
    queue->pop_front();
    ++busy_;
    lock.unlock();
    task();
    lock.lock();
    --busy_;
    cv_.notify_all();
  }
}

void TensorStore::WaitIdle() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return tasks_.empty() && writes_.empty() && busy_ == 0; });
}

int64_t TensorStore::AllocateRam(int64_t nbytes) {
  const int64_t need = RoundUp(nbytes, kRamAlign) + kTailBytes;
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < need) continue;
    const int64_t offset = it->first, left = it->second - need;
    free_.erase(it);
    if (left > 0) free_[offset + need] = left;
    stats_.ram_in_use += need;
    stats_.ram_peak = std::max(stats_.ram_peak, stats_.ram_in_use);
    return offset;
  }
  return -1;
}

void TensorStore::ReleaseRam(int64_t offset, int64_t nbytes) {
  int64_t size = RoundUp(nbytes, kRamAlign) + kTailBytes;
  stats_.ram_in_use -= size;
  auto next = free_.lower_bound(offset);
  if (next != free_.end() && offset + size == next->first) {
    size += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      prev->second += size;
      return;
    }
  }
  free_[offset] = size;
}

ffi::ErrorOr<std::shared_ptr<Entry>> TensorStore::Begin(int64_t site, int device,
                                                         std::vector<int64_t> parts, Tier tier) {
  if (closed_) return ffi::Unexpected(ClosedError("before this spill"));
  auto e = std::make_shared<Entry>();
  e->site = site;
  e->device = device;
  for (int64_t p : parts) e->nbytes += p;
  e->parts = std::move(parts);
  std::lock_guard<std::mutex> lock(mu_);
  e->seq = next_seq.fetch_add(1);
  if (tier != Tier::kSsd) e->ram_offset = AllocateRam(e->nbytes);
  if (e->ram_offset >= 0) {
    e->tier = Tier::kRam;
  } else if (tier == Tier::kSsd && dir_.empty()) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        "offload spill: tier 'ssd' was asked for, but this TensorStore has no SSD tier; "
        "configure one with TensorStore(ssd_dir=<a directory on local disk>)"));
  } else if (tier == Tier::kRam || dir_.empty()) {
    const int64_t need = RoundUp(e->nbytes, kRamAlign) + kTailBytes;
    std::string msg = "offload spill: the RAM tier is full: " + Size(e->nbytes) +
                      " asked for, " + Size(stats_.ram_in_use) + " of its " +
                      Size(options_.ram_bytes) + " limit in use";
    if (need > options_.ram_bytes) msg += " (a spill this size never fits in it)";
    msg += "; raise the limit with TensorStore(ram_bytes=...)";
    msg += dir_.empty() ? ", or add an SSD tier for what does not fit: this store has no SSD "
                          "tier (TensorStore(ssd_dir=<a directory on local disk>))"
                        : ", or spill with tier 'auto' or 'ssd' to use the store's SSD tier";
    return ffi::Unexpected(ffi::Error(ffi::ErrorCode::kResourceExhausted, msg));
  } else {
    e->tier = Tier::kSsd;
    const int64_t padded = RoundUp(e->nbytes, kAlign);
    if (options_.ssd_bytes > 0 && stats_.ssd_in_use + padded > options_.ssd_bytes) {
      return ffi::Unexpected(ffi::Error(
          ffi::ErrorCode::kResourceExhausted,
          "offload spill: the SSD tier is full: " + Size(padded) + " asked for, " +
              Size(stats_.ssd_in_use) + " of its " + Size(options_.ssd_bytes) +
              " limit in use; raise the limit with TensorStore(ssd_bytes=...) (0: as much as "
              "the disk holds)"));
    }
    e->path = dir_ + "/t" + std::to_string(e->seq) + ".bin";
    bool direct = direct_io_;
    e->fd = OpenFile(e->path, O_CREAT | O_RDWR | O_TRUNC, &direct);
    if (e->fd < 0) return ffi::Unexpected(ffi::Error::Internal(Errno("offload: cannot create " + e->path)));
    stats_.ssd_in_use += padded;
    stats_.ssd_peak = std::max(stats_.ssd_peak, stats_.ssd_in_use);
  }
  for (int64_t off = 0; off < e->nbytes; off += options_.chunk_bytes) {
    e->chunks.push_back({off, std::min(options_.chunk_bytes, e->nbytes - off), 0});
  }
  sites_[{site, device}].push_back(e);
  live_[e->seq] = e;
  owned_[e->seq] = e;
  stats_.spills += 1;
  stats_.spilled += e->nbytes;
  stats_.outstanding += 1;
  return e;
}

void TensorStore::FinishRamAsync(const std::shared_ptr<Entry>& e) {
  Post([this, e] {
    if (!e->chunks.empty()) {
      auto left = std::make_shared<std::atomic<int64_t>>(int64_t(e->chunks.size()));
      // One task per chunk so several threads share a large tensor; the last marks it stored.
      for (size_t i = 0; i < e->chunks.size(); ++i) {
        Post([this, e, i, left] {
          Chunk& c = e->chunks[i];
          c.sum = Checksum(RamData(*e) + c.offset, c.bytes, c.offset / 8);
          if (left->fetch_sub(1) == 1) MarkWritten(e, "");
        });
      }
      return;
    }
    MarkWritten(e, "");
  });
}

void TensorStore::MarkWritten(const std::shared_ptr<Entry>& e, const std::string& error) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!error.empty() && e->error.empty()) e->error = error;
  if (e->writes_left > 0) --e->writes_left;
  if (e->writes_left == 0) e->stored = true;
  cv_.notify_all();
}

char* TensorStore::AcquireSlot() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return closed_ || !slots_.empty(); });
  if (slots_.empty()) return nullptr;
  char* s = slots_.back();
  slots_.pop_back();
  return s;
}

void TensorStore::ReleaseSlot(char* slot) {
  std::lock_guard<std::mutex> lock(mu_);
  slots_.push_back(slot);
  cv_.notify_all();
}

void TensorStore::EnterIo(bool write) {
  std::lock_guard<std::mutex> lock(mu_);
  int& n = write ? writes_in_flight_ : reads_in_flight_;
  if (n++ == 0) (write ? write_start_ : read_start_) = std::chrono::steady_clock::now();
}

void TensorStore::LeaveIo(bool write, int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  int& n = write ? writes_in_flight_ : reads_in_flight_;
  (write ? stats_.ssd_written : stats_.ssd_read) += bytes;
  if (--n == 0) {
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                                    (write ? write_start_ : read_start_))
                          .count();
    (write ? stats_.write_seconds : stats_.read_seconds) += dt;
  }
}

void TensorStore::WriteSsd(const std::shared_ptr<Entry>& e,
                           const std::function<std::string(const Chunk&, char*)>& fill) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    e->writes_left = int(e->chunks.size());
    if (e->chunks.empty()) e->stored = true;
  }
  for (size_t i = 0; i < e->chunks.size(); ++i) {
    char* slot = AcquireSlot();
    if (!slot) {
      MarkWritten(e, "offload: the TensorStore was closed while spilling");
      continue;
    }
    const Chunk& c = e->chunks[i];
    std::string failed = fill(c, slot);
    if (!failed.empty()) {
      ReleaseSlot(slot);
      MarkWritten(e, failed);
      continue;
    }
    const int64_t padded = RoundUp(c.bytes, kAlign);
    std::memset(slot + c.bytes, 0, size_t(padded - c.bytes));
    Post([this, e, i, slot, padded] {
      Chunk& c = e->chunks[i];
      c.sum = Checksum(slot, c.bytes, c.offset / 8);
      Post([this, e, slot, padded, offset = c.offset] {
        std::string error;
        if (closed_) {
          error = "offload: the TensorStore was closed while spilling";
        } else {
          EnterIo(true);
          error = WriteAll(e->fd, slot, padded, offset);
          LeaveIo(true, error.empty() ? padded : 0);
          if (!error.empty()) error = "offload: writing " + e->path + " failed: " + error;
        }
        ReleaseSlot(slot);
        MarkWritten(e, error);
      }, /*write=*/true);
    });
  }
}

ffi::ErrorOr<std::shared_ptr<Entry>> TensorStore::Pop(int64_t site, int device, int64_t seq) {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) return ffi::Unexpected(ClosedError("before this load"));
  std::shared_ptr<Entry> e;
  if (seq >= 0) {
    auto it = live_.find(seq);
    if (it == live_.end() || it->second->site != site) {
      return ffi::Unexpected(ffi::Error(ffi::ErrorCode::kFailedPrecondition, 
          "offload: ticket " + std::to_string(seq) + " of site " + std::to_string(site) +
          " is not in the store (loaded twice, or its store was closed and made anew?)"));
    }
    e = it->second;
  } else {
    auto it = sites_.find({site, device});
    if (it == sites_.end() || it->second.empty()) {
      return ffi::Unexpected(ffi::Error(ffi::ErrorCode::kFailedPrecondition, 
          "offload: load of site " + std::to_string(site) +
          " has nothing to load (was the store closed, or the spill's computation not run?)"));
    }
    e = it->second.back();
  }
  auto& stack = sites_[{e->site, e->device}];
  stack.erase(std::find(stack.begin(), stack.end(), e));
  live_.erase(e->seq);
  return e;
}

ffi::Error TensorStore::WaitStored(const Entry& e) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return e.stored || closed_; });
  if (closed_) return ClosedError("while loading ticket " + std::to_string(e.seq));
  if (!e.error.empty()) return ffi::Error(ffi::ErrorCode::kDataLoss, e.error);
  return ffi::Error::Success();
}

ffi::Error TensorStore::VerifyRam(const Entry& e) {
  struct State {
    std::atomic<int64_t> bad{-1}, left{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  const int64_t n = int64_t(e.chunks.size());
  auto state = std::make_shared<State>();
  state->left = n;
  const char* data = RamData(e);
  auto check = [state, data, chunks = &e.chunks](int64_t i) {
    const Chunk& c = (*chunks)[size_t(i)];
    if (Checksum(data + c.offset, c.bytes, c.offset / 8) != c.sum) state->bad.store(i);
    std::lock_guard<std::mutex> lock(state->mu);
    if (--state->left == 0) state->cv.notify_all();
  };
  for (int64_t i = 1; i < n; ++i) Post([check, i] { check(i); });
  if (n > 0) check(0);
  {
    std::unique_lock<std::mutex> lock(state->mu);
    state->cv.wait(lock, [&] { return state->left.load() == 0; });
  }
  if (state->bad.load() >= 0) {
    return ffi::Error(ffi::ErrorCode::kDataLoss,
                      "offload: checksum mismatch in the RAM tier (ticket " +
                          std::to_string(e.seq) + ", chunk " + std::to_string(state->bad.load()) +
                          ")");
  }
  return ffi::Error::Success();
}

ffi::Error TensorStore::ReadSsd(const Entry& e,
                                const std::function<void(const Chunk&, const char*)>& consume) {
  struct Read {
    char* slot = nullptr;
    bool done = false;
    std::string error;
  };
  const int64_t n = int64_t(e.chunks.size());
  std::vector<Read> reads(static_cast<size_t>(n));
  const int64_t ahead = std::max<int64_t>(1, std::min<int64_t>(
      int64_t(slots_.size() + 1) / 2, 2 * int64_t(options_.io_threads)));
  int64_t issued = 0;
  auto issue = [&]() {
    Read& r = reads[size_t(issued)];
    r.slot = AcquireSlot();
    const int64_t i = issued++;
    const std::string closed =
        "offload: the TensorStore was closed while loading ticket " + std::to_string(e.seq);
    if (!r.slot) {
      std::lock_guard<std::mutex> lock(mu_);
      r.error = closed, r.done = true;
      return;
    }
    Post([this, &e, &r, i, closed] {
      const Chunk& c = e.chunks[size_t(i)];
      const int64_t padded = RoundUp(c.bytes, kAlign);
      std::string error;
      int64_t got = 0;
      if (!closed_) {  // Close() frees the file only after this call returns
        EnterIo(false);
        got = ReadAll(e.fd, r.slot, padded, c.offset, &error);
        LeaveIo(false, got);
      }
      if (closed_) {
        error = closed;
      } else if (!error.empty()) {
        error = "offload: reading " + e.path + " failed: " + error;
      } else if (got < c.bytes) {
        error = "offload: spill file " + e.path + " is truncated (chunk " + std::to_string(i) +
                ": " + std::to_string(got) + " of " + std::to_string(c.bytes) + " bytes)";
      } else if (Checksum(r.slot, c.bytes, c.offset / 8) != c.sum) {
        error = "offload: spill file " + e.path + " is corrupted (checksum mismatch in chunk " +
                std::to_string(i) + ")";
      }
      std::lock_guard<std::mutex> lock(mu_);
      r.error = std::move(error), r.done = true;
      cv_.notify_all();
    });
  };
  std::string error;
  int64_t next = 0;
  while (next < n) {
    while (issued < n && issued < next + ahead) issue();
    Read& r = reads[size_t(next)];
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return r.done; });
    }
    if (r.error.empty() && error.empty()) consume(e.chunks[size_t(next)], r.slot);
    if (!r.error.empty() && error.empty()) error = r.error;
    if (r.slot) ReleaseSlot(r.slot);
    ++next;
    if (!error.empty()) break;
  }
  for (int64_t i = next; i < issued; ++i) {  // reads still in flight use `reads`: wait for them
    Read& r = reads[size_t(i)];
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return r.done; });
    }
    if (r.slot) ReleaseSlot(r.slot);
  }
  if (!error.empty()) {
    return ffi::Error(closed_ ? ffi::ErrorCode::kFailedPrecondition : ffi::ErrorCode::kDataLoss,
                      error);
  }
  return ffi::Error::Success();
}

void TensorStore::Free(const std::shared_ptr<Entry>& e) {
  std::lock_guard<std::mutex> lock(mu_);
  // Once closed, a load that gave up (WaitStored returned "closed") may free an entry whose
  // writes or checksums are still running on the I/O threads: its RAM range or file would go
  // while they use it. Close() frees every entry itself, after those tasks have finished.
  if (closed_) return;
  if (owned_.erase(e->seq) == 0) return;  // freed already
  if (e->tier == Tier::kRam && e->ram_offset >= 0) {
    ReleaseRam(e->ram_offset, e->nbytes);
    e->ram_offset = -1;
  } else if (e->tier == Tier::kSsd && e->fd >= 0) {
    close(e->fd);
    e->fd = -1;
    unlink(e->path.c_str());
    stats_.ssd_in_use -= RoundUp(e->nbytes, kAlign);
  }
  stats_.outstanding -= 1;
  stats_.loads += 1;
  stats_.loaded += e->nbytes;
}

std::vector<std::shared_ptr<Entry>> TensorStore::Preceding(const Entry& e, int n) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::shared_ptr<Entry>> out;
  auto it = live_.lower_bound(e.seq);
  while (int(out.size()) < n && it != live_.begin()) out.push_back((--it)->second);
  return out;
}

void TensorStore::NoteDevice(int64_t in_use, int64_t peak, int64_t spill_peak,
                             int64_t load_peak) {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.device_in_use = in_use;
  stats_.device_peak = std::max(stats_.device_peak, peak);
  stats_.spill_peak = std::max(stats_.spill_peak, spill_peak);
  stats_.load_peak = std::max(stats_.load_peak, load_peak);
}

StoreStats TensorStore::Stats() {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void TensorStore::OnClose(std::function<void()> hook) {
  std::lock_guard<std::mutex> lock(mu_);
  on_close_.push_back(std::move(hook));
}

std::shared_ptr<void> TensorStore::GpuState(const std::function<std::shared_ptr<void>()>& make) {
  std::lock_guard<std::mutex> lock(gpu_mu_);
  if (!gpu_state_) gpu_state_ = make();
  return gpu_state_;
}

void TensorStore::SetDeferredError(std::string message) {
  std::lock_guard<std::mutex> lock(mu_);
  if (deferred_error_.empty()) deferred_error_ = std::move(message);
}

ffi::Error TensorStore::TakeDeferredError() {
  std::lock_guard<std::mutex> lock(mu_);
  if (deferred_error_.empty()) return ffi::Error::Success();
  std::string msg = std::move(deferred_error_);
  deferred_error_.clear();
  return ffi::Error(ffi::ErrorCode::kDataLoss, msg);
}

// ---------------------------------------------------------------------------------------------

namespace {
std::mutex registry_mu;
std::unordered_map<int64_t, std::shared_ptr<TensorStore>>& Registry() {
  static auto* r = new std::unordered_map<int64_t, std::shared_ptr<TensorStore>>();
  return *r;
}
}  // namespace

// The smallest id no open store has. The id is an attribute of every compiled spill and load,
// so reusing ids keeps a loop of create / use / close from compiling (and caching) new
// executables for every store; a ticket from a closed store still fails (ticket numbers are
// unique in the process).
int64_t RegisterStore(std::shared_ptr<TensorStore> store) {
  std::lock_guard<std::mutex> lock(registry_mu);
  int64_t id = 1;
  while (Registry().count(id)) ++id;
  Registry()[id] = std::move(store);
  return id;
}

std::shared_ptr<TensorStore> FindStore(int64_t id) {
  std::lock_guard<std::mutex> lock(registry_mu);
  auto it = Registry().find(id);
  return it == Registry().end() ? nullptr : it->second;
}

void CloseStore(int64_t id) {
  std::shared_ptr<TensorStore> store;
  {
    std::lock_guard<std::mutex> lock(registry_mu);
    auto it = Registry().find(id);
    if (it == Registry().end()) return;
    store = std::move(it->second);
    Registry().erase(it);
  }
  store->Close();
}

ffi::ErrorOr<std::shared_ptr<TensorStore>> LookupStore(int64_t id) {
  auto store = FindStore(id);
  if (!store || !store->Enter()) {
    return ffi::Unexpected(ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                                      "offload: TensorStore #" + std::to_string(id) +
                                          " is closed (its tickets cannot be loaded any more)"));
  }
  // Shares ownership with `store`; its "deleter" gives the hold back.
  TensorStore* raw = store.get();
  return std::shared_ptr<TensorStore>(raw, [owner = std::move(store)](TensorStore* s) {
    s->Leave();
  });
}

double MeasureDiskWrite(const std::string& dir, int64_t nbytes, int threads, int64_t chunk_bytes) {
  if (chunk_bytes <= 0 || chunk_bytes % kAlign) {
    throw std::invalid_argument("chunk_bytes must be a positive multiple of 4096");
  }
  threads = std::max(1, threads);
  // One file per writer, as the store writes one file per tensor: extending writes to a single
  // file serialize on its inode, which would measure the file system rather than the disk.
  const std::string stem = dir + "/jaxdata-disk-probe-" + std::to_string(getpid()) + "-";
  std::vector<int> fds;
  for (int t = 0; t < threads; ++t) {
    bool direct = true;
    const std::string path = stem + std::to_string(t) + ".bin";
    int fd = OpenFile(path, O_CREAT | O_RDWR | O_TRUNC, &direct);
    if (fd < 0) {
      for (int u = 0; u < t; ++u) close(fds[u]), unlink((stem + std::to_string(u) + ".bin").c_str());
      throw std::runtime_error(Errno("cannot create " + path));
    }
    fds.push_back(fd);
  }
  const int64_t chunks = std::max<int64_t>(1, nbytes / chunk_bytes);
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  std::string error;
  std::mutex error_mu;
  auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      void* buf = nullptr;
      if (posix_memalign(&buf, kAlign, size_t(chunk_bytes)) != 0) {
        failed = true;
        return;
      }
      std::memset(buf, 0x5A + t, size_t(chunk_bytes));
      int64_t at = 0;
      for (; !failed && next.fetch_add(1) < chunks; at += chunk_bytes) {
        std::string err = WriteAll(fds[t], static_cast<char*>(buf), chunk_bytes, at);
        if (!err.empty()) {
          std::lock_guard<std::mutex> lock(error_mu);
          error = err, failed = true;
        }
      }
      std::free(buf);
    });
  }
  for (auto& th : pool) th.join();
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (int t = 0; t < threads; ++t) close(fds[t]), unlink((stem + std::to_string(t) + ".bin").c_str());
  if (failed) throw std::runtime_error("disk write probe in " + dir + " failed: " + error);
  return double(chunks * chunk_bytes) / dt;
}

}  // namespace jaxdata::offload
