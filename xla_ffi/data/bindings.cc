#include "data/bindings.h"

#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <string>
#include <utility>

#include "data/graph_build.h"

namespace nb = nanobind;

namespace jaxdata::data {
namespace {

using Ids = nb::ndarray<nb::ro, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
template <typename T>
using Array = nb::ndarray<nb::numpy, T, nb::ndim<1>>;

// A 1-D int32 or int64 array as an IntSpan; TypeError naming the argument otherwise.
IntSpan Span(const Ids& a, const char* what) {
  if (a.dtype() == nb::dtype<int32_t>()) return {a.data(), int64_t(a.shape(0)), false};
  if (a.dtype() == nb::dtype<int64_t>()) return {a.data(), int64_t(a.shape(0)), true};
  throw nb::type_error((std::string(what) + ": expected an int32 or int64 array").c_str());
}

// A NumPy array that owns `data` (freed when the array goes).
template <typename T>
Array<T> Own(Buffer<T> data, int64_t n) {
  T* p = data.release();
  nb::capsule owner(p, [](void* q) noexcept { delete[] static_cast<T*>(q); });
  return Array<T>(p, {size_t(n)}, owner);
}

}  // namespace

void AddGraphBuildFunctions(nb::module_& m) {
  m.def(
      "graph_sort_edges",
      [](Ids src, Ids dst, Ids etype, int64_t num_nodes, int64_t num_relations, bool return_order,
         int threads) {
        IntSpan s = Span(src, "sort_edges: src"), d = Span(dst, "sort_edges: dst");
        IntSpan r = Span(etype, "sort_edges: etype");
        SortedEdges out;
        {
          nb::gil_scoped_release release;
          out = SortEdges(s, d, r, num_nodes, num_relations, return_order, threads);
        }
        const int64_t n = s.size;
        nb::list result;
        result.append(Own(std::move(out.src), n));
        result.append(Own(std::move(out.dst), n));
        result.append(Own(std::move(out.etype), n));
        if (return_order) result.append(Own(std::move(out.order), n));
        return nb::tuple(result);
      },
      nb::arg("src"), nb::arg("dst"), nb::arg("etype"), nb::arg("num_nodes"),
      nb::arg("num_relations"), nb::arg("return_order") = false, nb::arg("threads") = 0,
      "(src, dst, etype[, order]) int32, sorted stably by (etype, dst, src); a parallel radix "
      "sort. order: the stable permutation (sorted = input[order]).");
  m.def(
      "graph_group_by",
      [](Ids keys, int64_t num_groups, int threads) {
        IntSpan k = Span(keys, "group_by: keys");
        Groups out;
        {
          nb::gil_scoped_release release;
          out = GroupBy(k, num_groups, threads);
        }
        return nb::make_tuple(Own(std::move(out.offsets), num_groups + 1),
                              Own(std::move(out.ids), k.size));
      },
      nb::arg("keys"), nb::arg("num_groups"), nb::arg("threads") = 0,
      "(offsets int64[G+1], ids int32[n]): the i with keys[i] == g are ids[offsets[g]:offsets[g+1]], "
      "ascending (a stable counting sort by key).");
  m.def(
      "graph_unique_pairs",
      [](Ids src, Ids etype, int64_t num_nodes, int64_t num_relations, int threads) {
        IntSpan s = Span(src, "unique_pairs: src"), r = Span(etype, "unique_pairs: etype");
        Pairs out;
        {
          nb::gil_scoped_release release;
          out = UniquePairs(s, r, num_nodes, num_relations, threads);
        }
        const int64_t e = s.size, p = out.num_pairs;
        return nb::make_tuple(
            Own(std::move(out.pair), e), Own(std::move(out.pair_offsets), p + 1),
            Own(std::move(out.pair_edges), e), Own(std::move(out.pair_src), p),
            Own(std::move(out.pair_etype), p), Own(std::move(out.pair_rel_offsets), num_relations + 1),
            Own(std::move(out.pair_csr_offsets), num_nodes + 1), Own(std::move(out.pair_csr_edges), p));
      },
      nb::arg("src"), nb::arg("etype"), nb::arg("num_nodes"), nb::arg("num_relations"),
      nb::arg("threads") = 0,
      "The unique (src, etype) pairs: (pair, pair_offsets, pair_edges, pair_src, pair_etype, "
      "pair_rel_offsets, pair_csr_offsets, pair_csr_edges); offsets int64, ids int32.");
  m.def(
      "graph_mean_edge_norm",
      [](Ids dst, Ids etype, int threads) {
        IntSpan d = Span(dst, "mean_edge_norm: dst"), r = Span(etype, "mean_edge_norm: etype");
        Buffer<float> norm;
        {
          nb::gil_scoped_release release;
          norm = MeanEdgeNorm(d, r, threads);
        }
        return Own(std::move(norm), d.size);
      },
      nb::arg("dst"), nb::arg("etype"), nb::arg("threads") = 0,
      "float32[E]: 1 / (edges of the same (etype, dst)); edges sorted by (etype, dst).");
  m.def(
      "graph_edges_sorted",
      [](Ids src, Ids dst, Ids etype, int threads) {
        IntSpan s = Span(src, "edges_sorted: src"), d = Span(dst, "edges_sorted: dst");
        IntSpan r = Span(etype, "edges_sorted: etype");
        nb::gil_scoped_release release;
        return EdgesSorted(s, d, r, threads);
      },
      nb::arg("src"), nb::arg("dst"), nb::arg("etype"), nb::arg("threads") = 0,
      "Whether the edges are sorted by (etype, dst, src).");
}

}  // namespace jaxdata::data
