// jaxdata.hector: the fixed bodies of the edge traversals (appended after
// cuda.cuh and common.h for those traversals). The generator emits the per-edge value as a lambda
// (`score(e, f)`, `value(e, f)`: feature f of edge e) and one call; `ok(e)` is row_ok
// (templates/common.h). Each body is the whole kernel after the operand pointers.

// The edge softmax over the W scores of each edge, per node (its edges eids[off[i]..off[i+1])):
// a warp per node, or the whole block (THREADS threads) for a node of more than DEGREE edges
// (hubs). The lanes stride over the node's edges three times, every score at once: the maximum,
// exp(score - max) stored and summed, the division; maxima and sums are reduced by warp
// shuffles (and, for a block, through shared memory). Each block takes as many consecutive
// nodes as it has warps: its warps take the light ones, then the block takes each heavy one in
// turn. No atomics. m and s (each score's running maximum and sum) are the kernel's own
// arrays, and the passes are written out in full, not as helper functions: otherwise some
// instances compiled to different machine code from the kernel written out in the generator
// (m or s in local memory behind generic pointers; .ci/hector_sources.py --compare).
template <int W, int THREADS, int DEGREE, typename Ok, typename Score>
JAXDATA_INLINE void edge_softmax(int64_t N, int64_t E, const int32_t* off, const int32_t* eids,
                                 float* out, Ok ok, Score score, float (&m)[W], float (&s)[W]) {
  constexpr int WARPS = THREADS / 32;
  constexpr float LOWEST = -3.402823466e+38f;  // below every score
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __shared__ float red[WARPS][W];
  for (int64_t base = blockIdx.x * (int64_t)WARPS; base < N; base += gridDim.x * (int64_t)WARPS) {
    if (base + warp < N) {  // a warp per light node
      const int64_t i = base + warp;
      const int64_t q0 = span(off[i], 0, E), q1 = span(off[i + 1], q0, E);
      if (q1 - q0 <= DEGREE) {
        for (int f = 0; f < W; ++f) { m[f] = LOWEST; s[f] = 0.0f; }
        for (int64_t q = q0 + lane; q < q1; q += 32) {
          const int64_t e = eids[q];
          if (!ok(e)) continue;
          for (int f = 0; f < W; ++f) m[f] = fmaxf(m[f], score(e, f));
        }
        for (int o = 16; o > 0; o >>= 1)
          for (int f = 0; f < W; ++f) {
            const float a = m[f], b = __shfl_xor_sync(0xffffffffu, a, o);
            m[f] = fmaxf(a, b);
          }
        for (int64_t q = q0 + lane; q < q1; q += 32) {
          const int64_t e = eids[q];
          if (!ok(e)) continue;
          for (int f = 0; f < W; ++f) {
            const float x = expf(score(e, f) - m[f]);
            out[e * W + f] = x;
            s[f] += x;
          }
        }
        for (int o = 16; o > 0; o >>= 1)
          for (int f = 0; f < W; ++f) {
            const float a = s[f], b = __shfl_xor_sync(0xffffffffu, a, o);
            s[f] = a + b;
          }
        for (int64_t q = q0 + lane; q < q1; q += 32) {
          const int64_t e = eids[q];
          if (!ok(e)) continue;
          for (int f = 0; f < W; ++f) out[e * W + f] /= s[f];
        }
      }
    }
    for (int64_t i = base; i < base + WARPS && i < N; ++i) {  // the block per heavy node
      const int64_t q0 = span(off[i], 0, E), q1 = span(off[i + 1], q0, E);
      if (q1 - q0 <= DEGREE) continue;
      for (int f = 0; f < W; ++f) { m[f] = LOWEST; s[f] = 0.0f; }
      for (int64_t q = q0 + threadIdx.x; q < q1; q += THREADS) {
        const int64_t e = eids[q];
        if (!ok(e)) continue;
        for (int f = 0; f < W; ++f) m[f] = fmaxf(m[f], score(e, f));
      }
      for (int o = 16; o > 0; o >>= 1)
        for (int f = 0; f < W; ++f) {
          const float a = m[f], b = __shfl_xor_sync(0xffffffffu, a, o);
          m[f] = fmaxf(a, b);
        }
      if (lane == 0)
        for (int f = 0; f < W; ++f) red[warp][f] = m[f];
      __syncthreads();
      for (int f = 0; f < W; ++f) m[f] = red[0][f];
      for (int j = 1; j < WARPS; ++j)
        for (int f = 0; f < W; ++f) {
          const float a = m[f], b = red[j][f];
          m[f] = fmaxf(a, b);
        }
      __syncthreads();  // every warp has read red before the next node writes it
      for (int64_t q = q0 + threadIdx.x; q < q1; q += THREADS) {
        const int64_t e = eids[q];
        if (!ok(e)) continue;
        for (int f = 0; f < W; ++f) {
          const float x = expf(score(e, f) - m[f]);
          out[e * W + f] = x;
          s[f] += x;
        }
      }
      for (int o = 16; o > 0; o >>= 1)
        for (int f = 0; f < W; ++f) {
          const float a = s[f], b = __shfl_xor_sync(0xffffffffu, a, o);
          s[f] = a + b;
        }
      if (lane == 0)
        for (int f = 0; f < W; ++f) red[warp][f] = s[f];
      __syncthreads();
      for (int f = 0; f < W; ++f) s[f] = red[0][f];
      for (int j = 1; j < WARPS; ++j)
        for (int f = 0; f < W; ++f) {
          const float a = s[f], b = red[j][f];
          s[f] = a + b;
        }
      __syncthreads();
      for (int64_t q = q0 + threadIdx.x; q < q1; q += THREADS) {
        const int64_t e = eids[q];
        if (!ok(e)) continue;
        for (int f = 0; f < W; ++f) out[e * W + f] /= s[f];
      }
    }
  }
}

// Feature f of positions [lo, hi): out[target(e) * W + f] += value(e, f) for e = at(q), summed
// while the target stays the same, one atomic per run of equal targets.
template <int W, typename At, typename Ok, typename Target, typename Value>
JAXDATA_INLINE void run_sums(int64_t lo, int64_t hi, int f, float* out, At at, Ok ok,
                             Target target, Value value) {
  int64_t run = -1;
  float sum = 0.0f;
  for (int64_t q = lo; q < hi; ++q) {
    const int64_t e = at(q);
    if (!ok(e)) continue;
    const int64_t to = target(e);
    if (to != run) {
      if (run >= 0) atomicAdd(out + run * W + f, sum);
      run = to;
      sum = 0.0f;
    }
    sum += value(e, f);
  }
  if (run >= 0) atomicAdd(out + run * W + f, sum);
}

// The relation sum: out[r * W + f] += value(e, f) over the edges e of relation r. Each thread
// owns one feature and a run of consecutive edges; edges are sorted by relation, so it sums
// while the relation stays the same and adds one atomic per relation it crosses (rather than
// one per edge into the same R * W outputs).
template <int W, typename Ok, typename Value>
JAXDATA_INLINE void relation_sum(int64_t E, const int32_t* etype, float* out, Ok ok,
                                 Value value) {
  const int64_t threads = (int64_t)gridDim.x * blockDim.x;
  const int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  const int64_t chunks = threads / W;
  if (tid >= chunks * W) return;
  const int64_t per = (E + chunks - 1) / chunks;
  const int64_t lo = (tid / W) * per;
  run_sums<W>(lo, min(E, lo + per), int(tid % W), out, [](int64_t q) { return q; }, ok,
              [&](int64_t e) -> int64_t { return etype[e]; }, value);
}

// The grouped sum: out[target(e) * W + f] += value(e, f), visiting the edges in `order`, a
// permutation that puts edges of equal target next to each other (the CSC view for
// destinations, the CSR view for sources, pair_edges for pairs). Each thread owns one feature of
// RUN consecutive positions (`run_sums`): a node's in-edges cost one atomic per RUN of them,
// where edge_map adds one per edge.
template <int W, int RUN, typename Ok, typename Target, typename Value>
JAXDATA_INLINE void grouped_sum(int64_t E, const int32_t* order, float* out, Ok ok,
                                Target target, Value value) {
  const int64_t total = (E + RUN - 1) / RUN * W;
  for (int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; t < total;
       t += (int64_t)gridDim.x * blockDim.x) {
    const int64_t lo = t / W * RUN;
    run_sums<W>(lo, min(E, lo + RUN), int(t % W), out,
                [&](int64_t q) -> int64_t { return order[q]; }, ok, target, value);
  }
}

// The per-edge traversal: one thread per (edge e, feature f), in a grid-stride loop. An edge
// that is not ok(e) gets skip(e, f) (a store writes its zero there; a sum adds nothing); every
// other edge gets write(e, f, value(e, f)): a store, or an atomic add into its destination's,
// its pair's or its (relation, destination)'s row.
template <int W, typename Ok, typename Value, typename Write, typename Skip>
JAXDATA_INLINE void edge_map(int64_t E, Ok ok, Value value, Write write, Skip skip) {
  const int64_t total = E * W;
  for (int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; t < total;
       t += (int64_t)gridDim.x * blockDim.x) {
    const int64_t e = t / W;
    const int f = int(t % W);
    if (!ok(e)) {
      skip(e, f);
      continue;
    }
    write(e, f, value(e, f));
  }
}
