// spill / load on the CPU: copies between XLA's buffers and the store's tiers.
#include <cstring>

#include "../common/parallel.h"
#include "spill.h"
#include "store.h"

namespace ffi = xla::ffi;

namespace jaxdata::offload {
namespace {

constexpr int64_t kCopyGrain = 4 << 20;

void ParallelCopy(ffi::ThreadPool& pool, const Parts& parts, char* ram, bool into_ram) {
  const int64_t total = [&] { int64_t t = 0; for (int64_t b : parts.bytes) t += b; return t; }();
  ParallelFor(pool, (total + kCopyGrain - 1) / kCopyGrain, 1, [&](int64_t b, int64_t e) {
    const int64_t lo = b * kCopyGrain, hi = std::min(total, e * kCopyGrain);
    if (into_ram) parts.CopyOut(lo, hi - lo, ram + lo);
    else parts.CopyIn(lo, hi - lo, ram + lo);
  });
}

ffi::Error SpillCpu(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::RemainingRets rets,
                    int64_t store_id, int64_t site, int64_t tier) {
  auto store = OpenStore(store_id);
  if (store.has_error()) return store.error();
  auto parts = ArgParts(args, 0);
  if (parts.has_error()) return parts.error();
  auto ticket = SpillTicket(rets);
  if (ticket.has_error()) return ticket.error();
  auto e = (*store)->Begin(site, 0, parts->bytes, Tier(tier));
  if (e.has_error()) return e.error();
  if ((*e)->tier == Tier::kRam) {
    ParallelCopy(pool, *parts, (*store)->RamData(**e), true);
    (*store)->FinishRamAsync(*e);
  } else {
    (*store)->WriteSsd(*e, [&](const Chunk& c, char* slot) {
      parts->CopyOut(c.offset, c.bytes, slot);
      return std::string();
    });
  }
  for (int64_t i = 0; i < ticket->count; i += 2) EncodeTicket(ticket->pairs + i, (*e)->seq);
  return ffi::Error::Success();
}

ffi::Error LoadCpu(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::RemainingRets rets,
                   int64_t store_id, int64_t site) {
  auto store = OpenStore(store_id);
  if (store.has_error()) return store.error();
  auto ticket = LoadTicket(args);
  if (ticket.has_error()) return ticket.error();
  auto parts = RetParts(rets, 0);
  if (parts.has_error()) return parts.error();
  auto e = (*store)->Pop(site, 0, DecodeTicket(*ticket));
  if (e.has_error()) return e.error();
  ffi::Error err = CheckSameParts((*e)->parts, *parts);
  if (err.success()) err = (*store)->WaitStored(**e);
  if (err.success() && (*e)->tier == Tier::kRam) {
    err = (*store)->VerifyRam(**e);
    if (err.success()) ParallelCopy(pool, *parts, (*store)->RamData(**e), false);
  } else if (err.success()) {
    err = (*store)->ReadSsd(**e, [&](const Chunk& c, const char* host) {
      parts->CopyIn(c.offset, c.bytes, host);
    });
  }
  (*store)->Free(*e);
  return err;
}

}  // namespace
}  // namespace jaxdata::offload

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdata_offload_spill_cpu, jaxdata::offload::SpillCpu,
                              jaxdata::offload::BindSpill<ffi::ThreadPool>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdata_offload_load_cpu, jaxdata::offload::LoadCpu,
                              jaxdata::offload::BindLoad<ffi::ThreadPool>());
