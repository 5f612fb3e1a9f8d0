// A parallel, stable least-significant-digit radix sort of unsigned keys, optionally carrying a
// uint32 payload (an index) along: the building block of edge sorting and grouping (data/).
//
// Each pass counts one digit per part of the array (one part per thread), turns the counts into
// write positions (bucket-major, part-minor, which keeps equal digits in input order: stable) and
// scatters. A digit that is the same for every key costs the counting read only. Digits are at
// most kMaxDigitBits wide, as few passes as the key width needs. 8 bits (256 buckets, whose
// write positions stay in L1) beat 11 bits (fewer passes) by 1.3-1.5x on 32M keys of 22, 31
// and 51 bits, one thread, on the 2-core development machine.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "data/threads.h"

namespace jaxdata::data {

inline constexpr int kMaxDigitBits = 8;

// The number of bits needed to write x (0 for x <= 0).
inline int BitWidth(int64_t x) { return x <= 0 ? 0 : 64 - __builtin_clzll(uint64_t(x)); }

template <typename K>
struct SortedView {
  K* keys;
  uint32_t* values;  // null when no payload was sorted
};

// Sorts keys[0, n) stably by their bits [low_bit, bits) (bits from `bits` up must be zero),
// carrying values along when `values` is not null. `identity_values`: values[i] is taken to be i on input (it
// need not be written). The result lies in either the given buffers or the scratch ones
// (`keys_tmp`, `values_tmp`, each also n long); the returned view says which.
template <typename K>
SortedView<K> RadixSort(K* keys, K* keys_tmp, uint32_t* values, uint32_t* values_tmp, int64_t n,
                        int bits, bool identity_values, int requested_threads, int low_bit = 0) {
  const bool carry = values != nullptr;
  SortedView<K> in{keys, values}, out{keys_tmp, values_tmp};
  const int threads = ThreadsFor(n, requested_threads);
  if (n > 1 && bits > low_bit) {
    const int passes = (bits - low_bit + kMaxDigitBits - 1) / kMaxDigitBits;
    const int width = (bits - low_bit + passes - 1) / passes;
    const int64_t buckets = int64_t(1) << width;
    const K mask = K(buckets - 1);
    std::vector<int64_t> position(size_t(threads * buckets));
    for (int shift = low_bit; shift < bits; shift += width) {
      RunThreads(threads, [&](int t) {
        int64_t* count = position.data() + t * buckets;
        std::fill(count, count + buckets, 0);
        const K* k = in.keys;
        for (int64_t i = PartBegin(n, threads, t), e = PartBegin(n, threads, t + 1); i < e; ++i) {
          ++count[(k[i] >> shift) & mask];
        }
      });
      bool trivial = false;
      int64_t next = 0;
      for (int64_t b = 0; b < buckets; ++b) {
        int64_t total = 0;
        for (int t = 0; t < threads; ++t) {
          const int64_t c = position[t * buckets + b];
          position[t * buckets + b] = next + total;
          total += c;
        }
        trivial |= total == n;
        next += total;
      }
      if (trivial) continue;  // every key has this digit: the order stays
      const bool identity = carry && identity_values;
      RunThreads(threads, [&](int t) {
        int64_t* pos = position.data() + t * buckets;
        const K* k = in.keys;
        K* ko = out.keys;
        const int64_t begin = PartBegin(n, threads, t), end = PartBegin(n, threads, t + 1);
        if (!carry) {
          for (int64_t i = begin; i < end; ++i) ko[pos[(k[i] >> shift) & mask]++] = k[i];
        } else if (identity) {
          uint32_t* vo = out.values;
          for (int64_t i = begin; i < end; ++i) {
            const int64_t p = pos[(k[i] >> shift) & mask]++;
            ko[p] = k[i];
            vo[p] = uint32_t(i);
          }
        } else {
          const uint32_t* v = in.values;
          uint32_t* vo = out.values;
          for (int64_t i = begin; i < end; ++i) {
            const int64_t p = pos[(k[i] >> shift) & mask]++;
            ko[p] = k[i];
            vo[p] = v[i];
          }
        }
      });
      identity_values = false;
      std::swap(in, out);
    }
  }
  if (carry && identity_values) {  // no pass moved anything: the payload is still 0, 1, 2, ...
    ParallelRanges(n, threads, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) in.values[i] = uint32_t(i);
    });
  }
  return in;
}

// Sorts keys[0, n) stably by their `high_bits + low_bits` bits, most significant part first: a
// radix sort by the high part (skipped when the keys are already in that order), then each run
// of one high value by the low part. Runs of a relation's edges are small enough to stay in
// cache while they are sorted, and many are sorted at once, one per thread; a run larger than a
// thread's share is sorted by all threads. Same result as RadixSort over all the bits.
template <typename K>
SortedView<K> SegmentedRadixSort(K* keys, K* keys_tmp, uint32_t* values, uint32_t* values_tmp,
                                 int64_t n, int low_bits, int high_bits, bool identity_values,
                                 int requested_threads) {
  const int bits = low_bits + high_bits;
  const int threads = ThreadsFor(n, requested_threads);
  if (high_bits == 0 || n <= 1) {
    return RadixSort(keys, keys_tmp, values, values_tmp, n, bits, identity_values, threads);
  }
  // 1. By the high part, unless already so ordered.
  std::vector<char> ordered(size_t(threads), 1);
  RunThreads(threads, [&](int t) {
    for (int64_t i = std::max<int64_t>(PartBegin(n, threads, t), 1),
                 e = PartBegin(n, threads, t + 1); i < e; ++i) {
      if ((keys[i] >> low_bits) < (keys[i - 1] >> low_bits)) {
        ordered[t] = 0;
        return;
      }
    }
  });
  SortedView<K> in{keys, values};
  if (std::find(ordered.begin(), ordered.end(), 0) != ordered.end()) {
    in = RadixSort(keys, keys_tmp, values, values_tmp, n, bits, identity_values, threads,
                   low_bits);
  } else if (values != nullptr && identity_values) {
    ParallelRanges(n, threads, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) values[i] = uint32_t(i);
    });
  }
  SortedView<K> scratch{in.keys == keys ? keys_tmp : keys,
                        values == nullptr ? nullptr : (in.values == values ? values_tmp : values)};
  // 2. The runs of one high value: [starts[s], starts[s + 1]).
  std::vector<std::vector<int64_t>> found(static_cast<size_t>(threads));
  RunThreads(threads, [&](int t) {
    for (int64_t i = PartBegin(n, threads, t), e = PartBegin(n, threads, t + 1); i < e; ++i) {
      if (i == 0 || (in.keys[i] >> low_bits) != (in.keys[i - 1] >> low_bits)) found[t].push_back(i);
    }
  });
  std::vector<int64_t> starts;
  for (auto& f : found) starts.insert(starts.end(), f.begin(), f.end());
  starts.push_back(n);
  const int64_t runs = int64_t(starts.size()) - 1;
  // 3. Each run by the low part, in place (a result left in the scratch buffers is copied back).
  auto sort_run = [&](int64_t r, int run_threads) {
    const int64_t b = starts[r], len = starts[r + 1] - b;
    SortedView<K> out = RadixSort(in.keys + b, scratch.keys + b,
                                  in.values ? in.values + b : nullptr,
                                  scratch.values ? scratch.values + b : nullptr, len, low_bits,
                                  false, run_threads);
    if (out.keys != in.keys + b) {
      std::copy(out.keys, out.keys + len, in.keys + b);
      if (in.values) std::copy(out.values, out.values + len, in.values + b);
    }
  };
  const int64_t large = std::max<int64_t>(n / (2 * threads), int64_t(1) << 16);
  std::vector<int64_t> small;
  for (int64_t r = 0; r < runs; ++r) {
    if (threads > 1 && starts[r + 1] - starts[r] >= large) {
      sort_run(r, threads);
    } else {
      small.push_back(r);
    }
  }
  std::atomic<int64_t> next{0};
  RunThreads(std::min<int64_t>(threads, int64_t(small.size())), [&](int) {
    for (int64_t s; (s = next.fetch_add(1)) < int64_t(small.size());) sort_run(small[s], 1);
  });
  return in;
}

}  // namespace jaxdata::data
