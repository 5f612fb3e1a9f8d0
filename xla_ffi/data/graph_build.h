// Host-side construction of relational graphs at scale: sorting edges by (etype, dst, src),
// grouping edges by a node (CSR / CSC), the unique (source, relation) pairs of compact
// materialization, and the per-(destination, relation) mean edge norm.
//
// These are the multithreaded versions of the NumPy formulations in jaxdata/reference/graph.py and
// give bit-identical results; jaxdata/data/graph.py (HeteroGraph) and jaxdata/hector/runtime.py
// call them through the nanobind module. Inputs are int32 or int64 id arrays; every id is checked
// against its bound before it is used (std::invalid_argument naming the argument), so nothing
// reads or writes out of bounds. Edge and pair ids are int32: at most 2**31 - 1 edges.
#pragma once
#include <cstdint>
#include <memory>

namespace jaxdata::data {

// A read-only 1-D array of int32 (wide = false) or int64 (wide = true) ids.
struct IntSpan {
  const void* data = nullptr;
  int64_t size = 0;
  bool wide = false;
};

template <typename T>
using Buffer = std::unique_ptr<T[]>;

// An uninitialized array of n values (at least one element, so that data() is never null).
template <typename T>
Buffer<T> NewBuffer(int64_t n) {
  return Buffer<T>(new T[size_t(n > 0 ? n : 1)]);
}

struct SortedEdges {
  Buffer<int32_t> src, dst, etype;
  Buffer<int32_t> order;  // the stable permutation (sorted[i] = input[order[i]]); null unless asked
};

// The edges sorted by (etype, dst, src), stably. One packed 64-bit key and an LSD radix sort
// over its used bits when etype, dst and src fit in 64 bits together; otherwise a radix sort by
// (dst, src) followed by a stable one by etype. `threads` <= 0: all CPUs of the process.
SortedEdges SortEdges(IntSpan src, IntSpan dst, IntSpan etype, int64_t num_nodes,
                      int64_t num_relations, bool want_order, int threads);

struct Groups {
  Buffer<int64_t> offsets;  // [groups + 1]
  Buffer<int32_t> ids;      // [n]: the i with keys[i] == g are ids[offsets[g]:offsets[g + 1]], ascending
};

// Stable grouping of n items by key in [0, groups): a CSR (keys = src) or CSC (keys = dst).
Groups GroupBy(IntSpan keys, int64_t groups, int threads);

// The unique (src, etype) pairs and the maps between edges and pairs, as
// jaxdata.reference.graph.unique_pairs defines them.
struct Pairs {
  int64_t num_pairs = 0;
  Buffer<int32_t> pair;              // [E] pair of each edge
  Buffer<int64_t> pair_offsets;      // [P + 1]
  Buffer<int32_t> pair_edges;        // [E] edges grouped by pair, ascending inside a pair
  Buffer<int32_t> pair_src;          // [P]
  Buffer<int32_t> pair_etype;        // [P]
  Buffer<int64_t> pair_rel_offsets;  // [R + 1]
  Buffer<int64_t> pair_csr_offsets;  // [N + 1]
  Buffer<int32_t> pair_csr_edges;    // [P]
};
Pairs UniquePairs(IntSpan src, IntSpan etype, int64_t num_nodes, int64_t num_relations,
                  int threads);

// float32[E]: 1 / (the number of edges in e's run of equal (etype, dst)); the edges must be
// sorted by (etype, dst) (std::invalid_argument otherwise), so a run is a (dst, etype) group.
Buffer<float> MeanEdgeNorm(IntSpan dst, IntSpan etype, int threads);

// Whether the edges are sorted by (etype, dst, src).
bool EdgesSorted(IntSpan src, IntSpan dst, IntSpan etype, int threads);

// Throws std::invalid_argument("<what>: value V is outside [0, <bound_name>=bound)") unless every
// value is in [0, bound).
void CheckIds(IntSpan ids, int64_t bound, const char* what, const char* bound_name, int threads);

}  // namespace jaxdata::data
