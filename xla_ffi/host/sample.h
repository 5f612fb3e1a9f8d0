// Uniform neighbour sampling, shared by the CPU and CUDA implementations so that both draw
// exactly the same sample for the same key.
//
// The graph is an in-neighbour CSR: the neighbours of node v are indices[indptr[v] ..
// indptr[v + 1]). Row i of the output (the i-th input node, counting flat) gets `fanout` slots:
//  - without replacement, a node of degree d <= fanout keeps all d neighbours in CSR order;
//    otherwise Floyd's algorithm picks a uniformly random fanout-subset of its d neighbours
//    with exactly fanout draws;
//  - with replacement, each slot is an independent uniform draw (none when d == 0).
// Unused slots hold -1 with mask false. An input node outside [0, num_nodes), such as the -1
// padding of the previous hop, gets a row of padding: nothing is read for it.
//
// Typed (relational) graphs: when the call also passes a per-edge relation array `etypes`
// (aligned with `indices`) and a third output, every used slot also gets the relation of the
// edge it drew, etypes[indptr[v] + position], and every unused slot -1. Both are optional
// operands (OptionalArg / OptionalRet), so a homogeneous call is exactly the call it always was
// and runs the untyped kernel instantiation. The draws never depend on the relations: a typed
// sample has the same neighbours as the untyped one for the same key.
//
// Why the relation and not the edge position: the kernel reads etypes[first + p] at the same
// moment as indices[first + p], two independent loads in flight together over PCIe, and
// writes 4 bytes per slot. Returning positions instead would need an int64 output on large
// graphs and then a second zero-copy gather (another launch, another round of PCIe latency,
// the positions written and read back) to reach the same 4 bytes.
//
// Randomness is counter-based: draw t of row i is a hash of (key, i, t) (SplitMix64's
// finalizer), and a uniform integer below m is the high half of the 128-bit product of a
// 64-bit draw and m, whose bias (at most m / 2**64) is far below any measurable level.
#pragma once
#include <cstdint>
#include <limits>
#include <optional>

#include "gather.h"  // JAXDATA_HD
#include "table.h"   // Handle
#include "xla/ffi/api/ffi.h"

namespace jaxdata {

JAXDATA_HD uint64_t Mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

JAXDATA_HD uint64_t RowKey(uint64_t key, int64_t row) { return Mix64(key ^ Mix64(uint64_t(row))); }

// A uniform integer in [0, m), from draw t of a row's stream.
JAXDATA_HD int64_t DrawBelow(uint64_t row_key, int64_t t, int64_t m) {
  const uint64_t r = Mix64(row_key + uint64_t(t + 1) * 0xd1b54a32d192ed03ULL);
#if defined(__CUDA_ARCH__)
  return int64_t(__umul64hi(r, uint64_t(m)));
#else
  return int64_t((unsigned __int128)r * uint64_t(m) >> 64);
#endif
}

// Fills one output row with CSR positions (offsets into the node's neighbour list), -1 for
// unused slots, and returns how many are used. `pos` is the row itself (fanout slots).
template <typename P>
JAXDATA_HD int64_t SamplePositions(uint64_t row_key, int64_t degree, int64_t fanout, bool replace,
                                   P* pos) {
  if (degree <= 0) {
    for (int64_t s = 0; s < fanout; ++s) pos[s] = -1;
    return 0;
  }
  if (replace) {
    for (int64_t s = 0; s < fanout; ++s) pos[s] = P(DrawBelow(row_key, s, degree));
    return fanout;
  }
  if (degree <= fanout) {
    for (int64_t s = 0; s < fanout; ++s) pos[s] = s < degree ? P(s) : P(-1);
    return degree;
  }
  // Floyd: for j = d - k .. d - 1, draw t in [0, j]; take t unless already taken, else j.
  for (int64_t s = 0; s < fanout; ++s) {
    const int64_t j = degree - fanout + s;
    int64_t t = DrawBelow(row_key, s, j + 1);
    for (int64_t q = 0; q < s; ++q) {
      if (int64_t(pos[q]) == t) {
        t = j;
        break;
      }
    }
    pos[s] = P(t);
  }
  return fanout;
}

// The neighbour range of `node`, or an empty one for a node outside the graph or a malformed
// CSR entry (never a range outside [0, num_edges)).
template <typename O>  // int64_t row pointers in a HostGraph, int32_t or int64_t in device arrays
JAXDATA_HD void NeighbourRange(const O* indptr, int64_t num_nodes, int64_t num_edges,
                               int64_t node, int64_t& begin, int64_t& degree) {
  begin = 0, degree = 0;
  if (node < 0 || node >= num_nodes) return;
  const int64_t b = indptr[node], e = indptr[node + 1];
  if (b < 0 || e > num_edges || e < b) return;
  begin = b, degree = e - b;
}

// The largest fanout: a row's sampled positions are int32 (SamplePositions writes them into
// the int32 output row).
constexpr int64_t kMaxFanout = std::numeric_limits<int32_t>::max();

// For the handlers: the fanout is in [1, kMaxFanout], the output holds `fanout` slots for each
// of the n input nodes (n * fanout checked against overflow before it is formed), and the key
// is two 32-bit words.
inline xla::ffi::Error CheckSampleShapes(int64_t n, int64_t fanout,
                                         const xla::ffi::Buffer<xla::ffi::U32>& key,
                                         const xla::ffi::Buffer<xla::ffi::S32>& out,
                                         const xla::ffi::Buffer<xla::ffi::PRED>& mask) {
  if (fanout < 1 || fanout > kMaxFanout) {
    return xla::ffi::Error::InvalidArgument(
        "jaxdata sampling: fanout must be in [1, 2**31 - 1]");
  }
  if (n < 0 || n > std::numeric_limits<int64_t>::max() / fanout) {
    return xla::ffi::Error::InvalidArgument(
        "jaxdata sampling: input nodes x fanout overflows int64");
  }
  if (int64_t(out.element_count()) != n * fanout || int64_t(mask.element_count()) != n * fanout ||
      key.element_count() != 2) {
    return xla::ffi::Error::InvalidArgument("jaxdata sampling: operand shapes do not match");
  }
  return xla::ffi::Error::Success();
}

// For the handlers: etypes and the relations output come together or not at all, and the
// relations output has the neighbours' shape.
template <typename E>
xla::ffi::Error CheckTypedOperands(const std::optional<E>& etypes,
                                   std::optional<xla::ffi::Result<
                                       xla::ffi::Buffer<xla::ffi::S32>>>& relations,
                                   int64_t slots) {
  if (etypes.has_value() != relations.has_value()) {
    return xla::ffi::Error::InvalidArgument(
        "jaxdata sampling: etypes and the relations output must be passed together");
  }
  if (relations.has_value() && (*relations)->element_count() != slots) {
    return xla::ffi::Error::InvalidArgument(
        "jaxdata sampling: the relations output does not match the neighbours' shape");
  }
  return xla::ffi::Error::Success();
}

// The FFI bindings of host_sample (a HostGraph's CSR in host memory) and sample (a CSR in device
// arrays), written once for both platforms: `Context` is ffi::ThreadPool on the CPU and
// ffi::PlatformStream<cudaStream_t> on CUDA.
template <typename Context>
auto BindHostSample() {
  return xla::ffi::Ffi::Bind()
      .Ctx<Context>()
      .template Arg<Handle>()                           // indptr
      .template Arg<Handle>()                           // indices
      .template Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // nodes
      .template Arg<xla::ffi::Buffer<xla::ffi::U32>>()  // key
      .template OptionalArg<Handle>()                   // etypes (typed graphs)
      .template Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // neighbours
      .template Ret<xla::ffi::Buffer<xla::ffi::PRED>>()  // mask
      .template OptionalRet<xla::ffi::Buffer<xla::ffi::S32>>()  // relations (typed graphs)
      .template Attr<int64_t>("num_nodes")
      .template Attr<int64_t>("num_edges")
      .template Attr<int64_t>("fanout")
      .template Attr<int32_t>("replace");
}

template <typename Context>
auto BindSample() {
  return xla::ffi::Ffi::Bind()
      .Ctx<Context>()
      .template Arg<xla::ffi::AnyBuffer>()              // indptr (int32 or int64)
      .template Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // indices
      .template Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // nodes
      .template Arg<xla::ffi::Buffer<xla::ffi::U32>>()  // key
      .template OptionalArg<xla::ffi::Buffer<xla::ffi::S32>>()  // etypes (typed graphs)
      .template Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // neighbours
      .template Ret<xla::ffi::Buffer<xla::ffi::PRED>>()  // mask
      .template OptionalRet<xla::ffi::Buffer<xla::ffi::S32>>()  // relations (typed graphs)
      .template Attr<int64_t>("fanout")
      .template Attr<int32_t>("replace");
}

}  // namespace jaxdata
