// Pieces the spill / load handlers share on CPU and GPU: the arrays of one spill as a list of
// byte ranges, the ticket, and the handler symbols for module.cc.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

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

}  // namespace jaxdata::offload
