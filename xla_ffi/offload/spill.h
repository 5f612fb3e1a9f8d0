// Pieces the spill / load handlers share on CPU and GPU: the arrays of one spill as a list of
// byte ranges, the ticket, and the handler symbols for module.cc.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "store.h"
#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdata_offload_spill_cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdata_offload_load_cpu);
#ifdef JAXDATA_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdata_offload_spill_cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdata_offload_load_cuda);
#endif

namespace jaxdata::offload {

// The arrays of a spill (or a load's outputs), seen as one run of bytes.
struct Parts {
  std::vector<char*> data;
  std::vector<int64_t> bytes;

  // Calls f(part_data, n) for the pieces of [offset, offset + len) of the concatenation, in order.
  template <typename F>
  void ForRange(int64_t offset, int64_t len, const F& f) const {
    int64_t start = 0;
    for (size_t p = 0; p < data.size() && len > 0; start += bytes[p], ++p) {
      const int64_t end = start + bytes[p];
      if (offset >= end) continue;
      const int64_t n = std::min(end - offset, len);
      f(data[p] + (offset - start), n);
      offset += n, len -= n;
    }
  }
  void CopyOut(int64_t offset, int64_t len, char* dst) const {
    int64_t at = 0;
    ForRange(offset, len, [&](char* src, int64_t n) {
      std::memcpy(dst + at, src, size_t(n));
      at += n;
    });
  }
  void CopyIn(int64_t offset, int64_t len, const char* src) const {
    int64_t at = 0;
    ForRange(offset, len, [&](char* dst, int64_t n) {
      std::memcpy(dst, src + at, size_t(n));
      at += n;
    });
  }
};

template <typename Buffers>  // RemainingArgs
xla::ffi::ErrorOr<Parts> ArgParts(const Buffers& args, size_t first) {
  Parts parts;
  for (size_t i = first; i < args.size(); ++i) {
    auto b = args.template get<xla::ffi::AnyBuffer>(i);
    if (b.has_error()) return xla::ffi::Unexpected(b.error());
    parts.data.push_back(static_cast<char*>(b->untyped_data()));
    parts.bytes.push_back(int64_t(b->size_bytes()));
  }
  return parts;
}

template <typename Buffers>  // RemainingRets
xla::ffi::ErrorOr<Parts> RetParts(const Buffers& rets, size_t first) {
  Parts parts;
  for (size_t i = first; i < rets.size(); ++i) {
    auto b = rets.template get<xla::ffi::AnyBuffer>(i);
    if (b.has_error()) return xla::ffi::Unexpected(b.error());
    parts.data.push_back(static_cast<char*>((*b)->untyped_data()));
    parts.bytes.push_back(int64_t((*b)->size_bytes()));
  }
  return parts;
}

// A ticket is int32 pairs (the low 31 bits of the entry's number, the rest) so that it needs no
// 64-bit JAX types; a batched spill (vmap) repeats the pair.
JAXDATA_HOST_DEVICE inline void EncodeTicket(int32_t* pair, int64_t seq) {
  pair[0] = int32_t(seq & 0x7fffffff), pair[1] = int32_t(seq >> 31);
}
JAXDATA_HOST_DEVICE inline int64_t DecodeTicket(const int32_t* pair) {
  return int64_t(pair[0]) | (int64_t(pair[1]) << 31);
}

// The store a handler names, held for as long as the handler keeps the pointer (close() waits
// for it: see LookupStore), or its error; also the failure an earlier GPU call of this store
// could only see after it had returned.
inline xla::ffi::ErrorOr<std::shared_ptr<TensorStore>> OpenStore(int64_t id) {
  auto store = LookupStore(id);
  if (store.has_error()) return store;
  if (auto err = (*store)->TakeDeferredError(); err.failure()) return xla::ffi::Unexpected(err);
  return store;
}

struct TicketBuffer {
  int32_t* pairs;
  int64_t count;  // int32 elements (twice the pairs)
};

// spill's one output: the ticket.
template <typename Rets>  // RemainingRets
xla::ffi::ErrorOr<TicketBuffer> SpillTicket(const Rets& rets) {
  if (rets.size() != 1) {
    return xla::ffi::Unexpected(xla::ffi::Error::InvalidArgument("offload spill: one ticket output"));
  }
  auto t = rets.template get<xla::ffi::AnyBuffer>(0);
  if (t.has_error()) return xla::ffi::Unexpected(t.error());
  if ((*t)->element_type() != xla::ffi::S32 || (*t)->element_count() % 2) {
    return xla::ffi::Unexpected(
        xla::ffi::Error::InvalidArgument("offload spill: the ticket is int32 pairs"));
  }
  return TicketBuffer{static_cast<int32_t*>((*t)->untyped_data()), int64_t((*t)->element_count())};
}

// load's one input: the ticket (its first pair).
template <typename Args>  // RemainingArgs
xla::ffi::ErrorOr<const int32_t*> LoadTicket(const Args& args) {
  if (args.size() != 1) {
    return xla::ffi::Unexpected(xla::ffi::Error::InvalidArgument("offload load: one ticket input"));
  }
  auto t = args.template get<xla::ffi::AnyBuffer>(0);
  if (t.has_error()) return xla::ffi::Unexpected(t.error());
  if (t->element_type() != xla::ffi::S32 || t->element_count() < 2) {
    return xla::ffi::Unexpected(xla::ffi::Error::InvalidArgument(
        "offload load: the ticket is int32 pairs (from spill)"));
  }
  return static_cast<const int32_t*>(t->untyped_data());
}

// A load's outputs must have the spilled arrays' sizes.
inline xla::ffi::Error CheckSameParts(const std::vector<int64_t>& spilled, const Parts& out) {
  if (spilled == out.bytes) return xla::ffi::Error::Success();
  auto list = [](const std::vector<int64_t>& v) {
    std::string s;
    for (int64_t b : v) s += (s.empty() ? "" : ", ") + std::to_string(b);
    return "[" + s + "]";
  };
  return xla::ffi::Error::InvalidArgument("offload: load's outputs have bytes " + list(out.bytes) +
                                          " but the spill had " + list(spilled));
}

// The bindings of spill and load, written once for both platforms: `Context` is ffi::ThreadPool
// on the CPU and ffi::PlatformStream<cudaStream_t> on CUDA. spill takes the arrays and returns
// the ticket; load takes the ticket and returns the arrays.
template <typename Context>
auto BindSpill() {
  return xla::ffi::Ffi::Bind()
      .Ctx<Context>()
      .RemainingArgs()
      .RemainingRets()
      .template Attr<int64_t>("store")
      .template Attr<int64_t>("site")
      .template Attr<int64_t>("tier");
}

template <typename Context>
auto BindLoad() {
  return xla::ffi::Ffi::Bind()
      .Ctx<Context>()
      .RemainingArgs()
      .RemainingRets()
      .template Attr<int64_t>("store")
      .template Attr<int64_t>("site");
}

}  // namespace jaxdata::offload
