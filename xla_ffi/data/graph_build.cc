#include "data/graph_build.h"

#include <algorithm>
#include <atomic>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "data/radix_sort.h"
#include "data/threads.h"

namespace jaxdata::data {
namespace {

// f(const int32_t*) or f(const int64_t*), as the span holds.
template <typename F>
decltype(auto) Visit(IntSpan a, F&& f) {
  if (a.wide) return f(static_cast<const int64_t*>(a.data));
  return f(static_cast<const int32_t*>(a.data));
}

void CheckEdgeCount(int64_t n, const char* who) {
  if (n > std::numeric_limits<int32_t>::max()) {
    throw std::invalid_argument(std::string(who) + ": at most 2**31 - 1 edges, got " +
                                std::to_string(n));
  }
}

void CheckSize(int64_t size, const char* who, const char* what) {
  if (size < 0 || size > std::numeric_limits<int32_t>::max()) {
    throw std::invalid_argument(std::string(who) + ": " + what + " must be in [0, 2**31), got " +
                                std::to_string(size));
  }
}

// offsets[g] = the first i with keys[i] >= g, for g in [0, groups]; keys sorted, in [0, groups).
template <typename K>
void OffsetsFromSorted(const K* keys, int64_t n, int64_t groups, int64_t* offsets, int threads) {
  ParallelRanges(n, ThreadsFor(n, threads), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t prev = i == 0 ? -1 : int64_t(keys[i - 1]);
      for (int64_t g = prev + 1; g <= int64_t(keys[i]); ++g) offsets[g] = i;
    }
  });
  for (int64_t g = n == 0 ? 0 : int64_t(keys[n - 1]) + 1; g <= groups; ++g) offsets[g] = n;
}

template <typename T>
void ParallelCopy(const T* from, T* to, int64_t n, int threads) {
  ParallelRanges(n, ThreadsFor(n, threads), [&](int64_t begin, int64_t end) {
    std::copy(from + begin, from + end, to + begin);
  });
}

}  // namespace

void CheckIds(IntSpan ids, int64_t bound, const char* what, const char* bound_name, int threads) {
  const int parts = ThreadsFor(ids.size, threads);
  std::vector<int64_t> first_bad(size_t(parts), -1);
  Visit(ids, [&](const auto* a) {
    RunThreads(parts, [&](int t) {
      for (int64_t i = PartBegin(ids.size, parts, t), e = PartBegin(ids.size, parts, t + 1); i < e;
           ++i) {
        if (a[i] < 0 || int64_t(a[i]) >= bound) {
          first_bad[t] = i;
          return;
        }
      }
    });
    for (int64_t i : first_bad) {
      if (i >= 0) {
        throw std::invalid_argument(std::string(what) + ": value " + std::to_string(int64_t(a[i])) +
                                    " is outside [0, " + bound_name + "=" + std::to_string(bound) +
                                    ")");
      }
    }
    return 0;
  });
}

SortedEdges SortEdges(IntSpan src, IntSpan dst, IntSpan etype, int64_t num_nodes,
                      int64_t num_relations, bool want_order, int threads) {
  const int64_t n = src.size;
  if (dst.size != n || etype.size != n) {
    throw std::invalid_argument("sort_edges: src, dst and etype must have one length");
  }
  CheckEdgeCount(n, "sort_edges");
  CheckSize(num_nodes, "sort_edges", "num_nodes");
  CheckSize(num_relations, "sort_edges", "num_relations");
  CheckIds(src, num_nodes, "sort_edges: src", "num_nodes", threads);
  CheckIds(dst, num_nodes, "sort_edges: dst", "num_nodes", threads);
  CheckIds(etype, num_relations, "sort_edges: etype", "num_relations", threads);
  const int node_bits = BitWidth(num_nodes - 1), relation_bits = BitWidth(num_relations - 1);
  const int parts = ThreadsFor(n, threads);
  SortedEdges out{NewBuffer<int32_t>(n), NewBuffer<int32_t>(n), NewBuffer<int32_t>(n), nullptr};
  Buffer<uint64_t> keys = NewBuffer<uint64_t>(n), keys_tmp = NewBuffer<uint64_t>(n);
  Buffer<uint32_t> values, values_tmp;
  const bool packed = relation_bits + 2 * node_bits <= 64;
  if (want_order || !packed) values = NewBuffer<uint32_t>(n), values_tmp = NewBuffer<uint32_t>(n);

  // (dst, src) below, etype above when it fits: one key orders edges by (etype, dst, src).
  const int etype_shift = packed ? 2 * node_bits : 64;
  Visit(src, [&](const auto* s) {
    return Visit(dst, [&](const auto* d) {
      return Visit(etype, [&](const auto* r) {
        ParallelRanges(n, parts, [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) {
            uint64_t key = (uint64_t(d[i]) << node_bits) | uint64_t(s[i]);
            if (packed && etype_shift < 64) key |= uint64_t(r[i]) << etype_shift;
            keys[i] = key;
          }
        });
        return 0;
      });
    });
  });
  // Packed: by etype, then each relation's edges by (dst, src) while they sit in cache.
  SortedView<uint64_t> sorted =
      packed ? SegmentedRadixSort(keys.get(), keys_tmp.get(), values.get(), values_tmp.get(), n,
                                  2 * node_bits, relation_bits, true, threads)
             : RadixSort(keys.get(), keys_tmp.get(), values.get(), values_tmp.get(), n,
                         2 * node_bits, true, threads);
  if (!packed) {
    // Then stably by etype: the key of position i becomes the etype of the edge now there.
    uint64_t* by_type = sorted.keys;
    uint64_t* scratch = by_type == keys.get() ? keys_tmp.get() : keys.get();
    uint32_t* order = sorted.values;
    uint32_t* order_tmp = order == values.get() ? values_tmp.get() : values.get();
    Visit(etype, [&](const auto* r) {
      ParallelRanges(n, parts, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) by_type[i] = uint64_t(r[order[i]]);
      });
      return 0;
    });
    sorted = RadixSort(by_type, scratch, order, order_tmp, n, relation_bits, false, threads);
    const uint32_t* o = sorted.values;
    Visit(src, [&](const auto* s) {
      return Visit(dst, [&](const auto* d) {
        return Visit(etype, [&](const auto* r) {
          ParallelRanges(n, parts, [&](int64_t begin, int64_t end) {
            for (int64_t i = begin; i < end; ++i) {
              out.src[i] = int32_t(s[o[i]]), out.dst[i] = int32_t(d[o[i]]);
              out.etype[i] = int32_t(r[o[i]]);
            }
          });
          return 0;
        });
      });
    });
  } else {
    const uint64_t node_mask = (uint64_t(1) << node_bits) - 1;
    const uint64_t* k = sorted.keys;
    ParallelRanges(n, parts, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        out.src[i] = int32_t(k[i] & node_mask);
        out.dst[i] = int32_t((k[i] >> node_bits) & node_mask);
        out.etype[i] = etype_shift < 64 ? int32_t(k[i] >> etype_shift) : 0;
      }
    });
  }
  if (want_order) {
    out.order = NewBuffer<int32_t>(n);
    ParallelCopy(reinterpret_cast<const int32_t*>(sorted.values), out.order.get(), n, threads);
  }
  return out;
}

Groups GroupBy(IntSpan keys, int64_t groups, int threads) {
  const int64_t n = keys.size;
  CheckEdgeCount(n, "group_by");
  CheckSize(groups, "group_by", "num_groups");
  CheckIds(keys, groups, "group_by: keys", "num_groups", threads);
  const int parts = ThreadsFor(n, threads);
  Buffer<uint32_t> k = NewBuffer<uint32_t>(n), k_tmp = NewBuffer<uint32_t>(n);
  Buffer<uint32_t> ids_tmp = NewBuffer<uint32_t>(n);
  Groups out{NewBuffer<int64_t>(groups + 1), NewBuffer<int32_t>(n)};
  Visit(keys, [&](const auto* a) {
    ParallelRanges(n, parts, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) k[i] = uint32_t(a[i]);
    });
    return 0;
  });
  uint32_t* ids = reinterpret_cast<uint32_t*>(out.ids.get());
  SortedView<uint32_t> sorted = RadixSort(k.get(), k_tmp.get(), ids, ids_tmp.get(), n,
                                          BitWidth(groups - 1), true, threads);
  if (sorted.values != ids) ParallelCopy(sorted.values, ids, n, threads);
  OffsetsFromSorted(sorted.keys, n, groups, out.offsets.get(), threads);
  return out;
}

Pairs UniquePairs(IntSpan src, IntSpan etype, int64_t num_nodes, int64_t num_relations,
                  int threads) {
  const int64_t n = src.size;
  if (etype.size != n) throw std::invalid_argument("unique_pairs: src and etype must have one length");
  CheckEdgeCount(n, "unique_pairs");
  CheckSize(num_nodes, "unique_pairs", "num_nodes");
  CheckSize(num_relations, "unique_pairs", "num_relations");
  CheckIds(src, num_nodes, "unique_pairs: src", "num_nodes", threads);
  CheckIds(etype, num_relations, "unique_pairs: etype", "num_relations", threads);
  const int node_bits = BitWidth(num_nodes - 1), relation_bits = BitWidth(num_relations - 1);
  const uint64_t node_mask = (uint64_t(1) << node_bits) - 1;
  const int parts = ThreadsFor(n, threads);

  // Sort the edges by the key (etype << node_bits) | src, i.e. by (relation, source), stably:
  // edges come sorted by relation from a HeteroGraph, and then only each relation's run is
  // sorted, in cache.
  Buffer<uint64_t> keys = NewBuffer<uint64_t>(n), keys_tmp = NewBuffer<uint64_t>(n);
  Pairs out;
  out.pair_edges = NewBuffer<int32_t>(n);
  Buffer<uint32_t> edges_tmp = NewBuffer<uint32_t>(n);
  Visit(src, [&](const auto* s) {
    return Visit(etype, [&](const auto* r) {
      ParallelRanges(n, parts, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) keys[i] = (uint64_t(r[i]) << node_bits) | uint64_t(s[i]);
      });
      return 0;
    });
  });
  uint32_t* edges = reinterpret_cast<uint32_t*>(out.pair_edges.get());
  SortedView<uint64_t> sorted = SegmentedRadixSort(keys.get(), keys_tmp.get(), edges, edges_tmp.get(),
                                                   n, node_bits, relation_bits, true, threads);
  const uint64_t* k = sorted.keys;
  const uint32_t* e = sorted.values;

  // A pair starts wherever the key changes; count the starts of each part, then number them.
  std::vector<int64_t> base(size_t(parts) + 1, 0);
  RunThreads(parts, [&](int t) {
    int64_t starts = 0;
    for (int64_t i = PartBegin(n, parts, t), end = PartBegin(n, parts, t + 1); i < end; ++i) {
      starts += i == 0 || k[i] != k[i - 1];
    }
    base[t + 1] = starts;
  });
  for (int t = 0; t < parts; ++t) base[t + 1] += base[t];
  const int64_t p = out.num_pairs = base[parts];
  out.pair = NewBuffer<int32_t>(n);
  out.pair_offsets = NewBuffer<int64_t>(p + 1);
  out.pair_src = NewBuffer<int32_t>(p);
  out.pair_etype = NewBuffer<int32_t>(p);
  RunThreads(parts, [&](int t) {
    int64_t pair = base[t] - 1;  // a part that starts inside a pair continues the previous one
    for (int64_t i = PartBegin(n, parts, t), end = PartBegin(n, parts, t + 1); i < end; ++i) {
      if (i == 0 || k[i] != k[i - 1]) {
        ++pair;
        out.pair_offsets[pair] = i;
        out.pair_src[pair] = int32_t(k[i] & node_mask);
        out.pair_etype[pair] = int32_t(k[i] >> node_bits);
      }
      out.pair[e[i]] = int32_t(pair);
    }
  });
  out.pair_offsets[p] = n;
  if (sorted.values != edges) ParallelCopy(sorted.values, edges, n, threads);
  keys.reset(), keys_tmp.reset(), edges_tmp.reset();

  out.pair_rel_offsets = NewBuffer<int64_t>(num_relations + 1);
  OffsetsFromSorted(out.pair_etype.get(), p, num_relations, out.pair_rel_offsets.get(), threads);
  Groups by_src = GroupBy(IntSpan{out.pair_src.get(), p, false}, num_nodes, threads);
  out.pair_csr_offsets = std::move(by_src.offsets);
  out.pair_csr_edges = std::move(by_src.ids);
  return out;
}

Buffer<float> MeanEdgeNorm(IntSpan dst, IntSpan etype, int threads) {
  const int64_t n = dst.size;
  if (etype.size != n) throw std::invalid_argument("mean_edge_norm: dst and etype must have one length");
  const int parts = ThreadsFor(n, threads);
  Buffer<float> norm = NewBuffer<float>(n);
  Visit(dst, [&](const auto* d) {
    return Visit(etype, [&](const auto* r) {
      std::atomic<bool> in_order{true};
      ParallelRanges(n, parts, [&](int64_t begin, int64_t end) {
        for (int64_t i = std::max<int64_t>(begin, 1); i < end; ++i) {
          if (r[i] < r[i - 1] || (r[i] == r[i - 1] && d[i] < d[i - 1])) {
            in_order = false;
            return;
          }
        }
      });
      if (!in_order) {
        throw std::invalid_argument("mean_edge_norm: edges must be sorted by (etype, dst)");
      }
      auto same = [&](int64_t i) { return d[i] == d[i - 1] && r[i] == r[i - 1]; };
      // Part t handles the runs that start in [its first run start, the next part's).
      auto run_start = [&](int64_t i) {
        while (i > 0 && i < n && same(i)) ++i;
        return i;
      };
      RunThreads(parts, [&](int t) {
        const int64_t end = run_start(PartBegin(n, parts, t + 1));
        for (int64_t i = run_start(PartBegin(n, parts, t)); i < end;) {
          int64_t j = i + 1;
          while (j < n && same(j)) ++j;
          const float value = float(1.0 / double(j - i));
          std::fill(norm.get() + i, norm.get() + j, value);
          i = j;
        }
      });
      return 0;
    });
  });
  return norm;
}

bool EdgesSorted(IntSpan src, IntSpan dst, IntSpan etype, int threads) {
  const int64_t n = src.size;
  if (dst.size != n || etype.size != n) {
    throw std::invalid_argument("edges_sorted: src, dst and etype must have one length");
  }
  std::atomic<bool> in_order{true};
  Visit(src, [&](const auto* s) {
    return Visit(dst, [&](const auto* d) {
      return Visit(etype, [&](const auto* r) {
        ParallelRanges(n, ThreadsFor(n, threads), [&](int64_t begin, int64_t end) {
          for (int64_t i = std::max<int64_t>(begin, 1); i < end; ++i) {
            if (r[i] != r[i - 1] ? r[i] < r[i - 1]
                                 : (d[i] != d[i - 1] ? d[i] < d[i - 1] : s[i] < s[i - 1])) {
              in_order = false;
              return;
            }
          }
        });
        return 0;
      });
    });
  });
  return in_order;
}

}  // namespace jaxdata::data
