// jaxdata.hector: the fixed bodies of the edge traversals (appended after
// cuda.cuh and common.h for those traversals). The generator emits the per-edge value as a lambda
// (`score(e, f)`, `value(e, f)`: feature f of edge e) and one call; `ok(e)` is row_ok
// (templates/common.h). Each body is the whole kernel after the operand pointers.

// The edge softmax over the W scores of each edge, per node (its edges eids[off[i]..off[i+1])),
// in tiers by in-degree d. Each block takes THREADS / GROUP consecutive nodes:
//  - d <= GROUP: GROUP lanes per node, one edge per lane (`one_edge_per_lane`): each lane
//    computes its scores once and keeps them in registers (x) while the maximum and the sum are
//    reduced by shuffles among its GROUP lanes, then writes its results once. Most nodes of a
//    real graph are here.
//  - GROUP < d <= 32: the same, a warp per node.
//  - 32 < d <= DEGREE: a warp per node; d > DEGREE (hubs): the whole block, hub i on block
//    i % gridDim.x (`for_each_hub`: MUTAG's six hubs of neighbouring ids, 11K edges, had queued
//    on one block, 179 us of its 270 us forward on the H200). Both take an online
//    softmax in two passes (`online_first`, `online_second`): each lane keeps a running maximum m
//    and a sum s of exp(score - m), rescaled when the maximum grows, and stores the raw scores;
//    the lanes' (m, s) are combined (shuffles, and shared memory for the block); then each stored
//    score becomes exp(score - m) / s.
// No atomics. m, s and x are the kernel's own arrays (registers).
constexpr float LOWEST = -3.402823466e+38f;  // below every score

template <int W, int GROUP, typename Ok, typename Score>
JAXDATA_INLINE void one_edge_per_lane(int64_t q, int64_t q1, const int32_t* eids, float* out,
                                      Ok ok, Score score, float (&x)[W]) {
  const int64_t e = q < q1 ? (int64_t)eids[q] : 0;
  const bool has = q < q1 && ok(e);
#pragma unroll
  for (int f = 0; f < W; ++f) x[f] = has ? score(e, f) : LOWEST;
#pragma unroll
  for (int f = 0; f < W; ++f) {
    float a = x[f];
#pragma unroll
    for (int o = GROUP / 2; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
    x[f] = has ? expf(x[f] - a) : 0.0f;
  }
#pragma unroll
  for (int f = 0; f < W; ++f) {
    float a = x[f];
#pragma unroll
    for (int o = GROUP / 2; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
    if (has) out[e * W + f] = x[f] / a;
  }
}

// The first online pass over positions lo, lo + stride, ... below hi: raw scores stored, (m, s)
// updated, predicated rather than branched around (an edge that is not ok scores LOWEST and adds
// nothing).
template <int W, typename Ok, typename Score>
JAXDATA_INLINE void online_first(int64_t lo, int64_t hi, int64_t stride, const int32_t* eids,
                                 float* out, Ok ok, Score score, float (&m)[W], float (&s)[W]) {
  for (int64_t q = lo; q < hi; q += stride) {
    const int64_t e = eids[q];
    const bool v = ok(e);
    float y[W];
#pragma unroll
    for (int f = 0; f < W; ++f) y[f] = v ? score(e, f) : LOWEST;
#pragma unroll
    for (int f = 0; f < W; ++f) {
      if (v) out[e * W + f] = y[f];
      const float mm = fmaxf(m[f], y[f]);
      s[f] = s[f] * expf(m[f] - mm) + (v ? expf(y[f] - mm) : 0.0f);
      m[f] = mm;
    }
  }
}

// The second online pass: every stored score becomes exp(score - m) / s.
template <int W, typename Ok>
JAXDATA_INLINE void online_second(int64_t lo, int64_t hi, int64_t stride, const int32_t* eids,
                                  float* out, Ok ok, const float (&m)[W], const float (&s)[W]) {
  for (int64_t q = lo; q < hi; q += stride) {
    const int64_t e = eids[q];
    const bool v = ok(e);
    float y[W];
#pragma unroll
    for (int f = 0; f < W; ++f) y[f] = v ? out[e * W + f] : 0.0f;
#pragma unroll
    for (int f = 0; f < W; ++f)
      if (v) out[e * W + f] = expf(y[f] - m[f]) / s[f];
  }
}

// (m, s) of the 32 lanes of a warp combined (every lane gets the result).
template <int W>
JAXDATA_INLINE void warp_combine(float (&m)[W], float (&s)[W]) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
#pragma unroll
    for (int f = 0; f < W; ++f) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m[f], o);
      const float s2 = __shfl_xor_sync(0xffffffffu, s[f], o);
      const float mm = fmaxf(m[f], m2);
      s[f] = s[f] * expf(m[f] - mm) + s2 * expf(m2 - mm);
      m[f] = mm;
    }
}

// (m, s) of the softmax over positions lo, lo + stride, ... below hi, one warp's share: each
// lane's online pass from an empty start (raw scores stored), combined over the warp.
template <int W, typename Ok, typename Score>
JAXDATA_INLINE void warp_max_sum(int64_t lo, int64_t hi, int64_t stride, const int32_t* eids,
                                 float* out, Ok ok, Score score, float (&m)[W], float (&s)[W]) {
  for (int f = 0; f < W; ++f) { m[f] = LOWEST; s[f] = 0.0f; }
  online_first<W>(lo, hi, stride, eids, out, ok, score, m, s);
  warp_combine<W>(m, s);
}

// Every node of more than DEGREE edges (a hub), each given to the whole block: fn(q0, q1) with
// its edges' positions. Node i's hub (if it is one) goes to block i % gridDim.x, so hubs with
// neighbouring ids (a real graph's class or type nodes often are) land on different blocks
// rather than queueing on one; each block's threads test THREADS of its nodes at a time.
template <int THREADS, int DEGREE, typename Fn>
JAXDATA_INLINE void for_each_hub(int64_t N, int64_t E, const int32_t* off, Fn fn) {
  __shared__ int64_t hubs[THREADS];
  __shared__ int count;
  for (int64_t base = blockIdx.x; base < N; base += (int64_t)gridDim.x * THREADS) {
    const int64_t c = base + (int64_t)threadIdx.x * gridDim.x;  // this thread's node
    if (threadIdx.x == 0) count = 0;
    __syncthreads();
    if (c < N) {
      const int64_t q0 = span(off[c], 0, E), q1 = span(off[c + 1], q0, E);
      if (q1 - q0 > DEGREE) hubs[atomicAdd(&count, 1)] = c;
    }
    __syncthreads();
    const int found = count;
    for (int k = 0; k < found; ++k) {
      const int64_t i = hubs[k];
      const int64_t q0 = span(off[i], 0, E), q1 = span(off[i + 1], q0, E);
      fn(q0, q1);
      __syncthreads();  // the block's shared reductions are free for the next hub
    }
  }
}

// (m, s) of the softmax over the edges at positions [q0, q1) for the whole block: every
// thread's online pass (storing the raw scores), combined over the block; every thread gets
// the result.
template <int W, int THREADS, typename Ok, typename Score>
JAXDATA_INLINE void block_max_sum(int64_t q0, int64_t q1, const int32_t* eids, float* out, Ok ok,
                                  Score score, float (&m)[W], float (&s)[W]) {
  constexpr int WARPS = THREADS / 32;
  __shared__ float red_m[WARPS][W], red_s[WARPS][W];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  warp_max_sum<W>(q0 + threadIdx.x, q1, THREADS, eids, out, ok, score, m, s);
  if (lane == 0)
    for (int f = 0; f < W; ++f) { red_m[warp][f] = m[f]; red_s[warp][f] = s[f]; }
  __syncthreads();
  for (int f = 0; f < W; ++f) {
    float mm = red_m[0][f];
    for (int k = 1; k < WARPS; ++k) mm = fmaxf(mm, red_m[k][f]);
    float ss = 0.0f;
    for (int k = 0; k < WARPS; ++k) ss += red_s[k][f] * expf(red_m[k][f] - mm);
    m[f] = mm;
    s[f] = ss;
  }
  __syncthreads();  // every warp has read red_m and red_s before they are written again
}

template <int W, int THREADS, int DEGREE, int GROUP, typename Ok, typename Score>
JAXDATA_INLINE void edge_softmax(int64_t N, int64_t E, const int32_t* off, const int32_t* eids,
                                 float* out, Ok ok, Score score, float (&m)[W], float (&s)[W],
                                 float (&x)[W]) {
  static_assert(GROUP >= 1 && GROUP <= 32 && (GROUP & (GROUP - 1)) == 0 && THREADS % 32 == 0,
                "a node's lanes lie in one warp");
  constexpr int WARPS = THREADS / 32, NODES = THREADS / GROUP;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int64_t base = blockIdx.x * (int64_t)NODES; base < N; base += gridDim.x * (int64_t)NODES) {
    {  // GROUP lanes per light node; every lane takes part in the shuffles
      const int64_t i = base + threadIdx.x / GROUP;
      int64_t q = 0, q1 = 0;
      if (i < N) {
        const int64_t q0 = span(off[i], 0, E);
        q1 = span(off[i + 1], q0, E);
        q = q1 - q0 <= GROUP ? q0 + threadIdx.x % GROUP : q1;
      }
      one_edge_per_lane<W, GROUP>(q, q1, eids, out, ok, score, x);
    }
    for (int j = warp; j < NODES && base + j < N; j += WARPS) {  // a warp per middle node
      const int64_t i = base + j;
      const int64_t q0 = span(off[i], 0, E), q1 = span(off[i + 1], q0, E);
      if (q1 - q0 <= GROUP || q1 - q0 > DEGREE) continue;
      if (q1 - q0 <= 32) {
        one_edge_per_lane<W, 32>(q0 + lane, q1, eids, out, ok, score, x);
        continue;
      }
      warp_max_sum<W>(q0 + lane, q1, 32, eids, out, ok, score, m, s);
      online_second<W>(q0 + lane, q1, 32, eids, out, ok, m, s);
    }
  }
  for_each_hub<THREADS, DEGREE>(N, E, off, [&](int64_t q0, int64_t q1) {  // a block per hub
    block_max_sum<W, THREADS>(q0, q1, eids, out, ok, score, m, s);
    online_second<W>(q0 + threadIdx.x, q1, THREADS, eids, out, ok, m, s);
  });
}

// Features f0, f0 + W / VEC, ... (VEC of them) of positions [lo, hi): out[target(e) * W + f] +=
// value(e, f) for e = at(q), summed while the target stays the same, one atomic per run of equal
// targets and feature. A position's id loads and checks are shared by its VEC features.
template <int W, int VEC, typename At, typename Ok, typename Target, typename Value>
JAXDATA_INLINE void run_sums(int64_t lo, int64_t hi, int f0, float* out, At at, Ok ok,
                             Target target, Value value) {
  constexpr int LANES = W / VEC;
  int64_t run = -1;
  float sum[VEC] = {};
  for (int64_t q = lo; q < hi; ++q) {
    const int64_t e = at(q);
    if (!ok(e)) continue;
    const int64_t to = target(e);
    if (to != run) {
      if (run >= 0)
#pragma unroll
        for (int v = 0; v < VEC; ++v) atomicAdd(out + run * W + f0 + v * LANES, sum[v]);
      run = to;
#pragma unroll
      for (int v = 0; v < VEC; ++v) sum[v] = 0.0f;
    }
#pragma unroll
    for (int v = 0; v < VEC; ++v) sum[v] += value(e, f0 + v * LANES);
  }
  if (run >= 0)
#pragma unroll
    for (int v = 0; v < VEC; ++v) atomicAdd(out + run * W + f0 + v * LANES, sum[v]);
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
  run_sums<W, 1>(lo, min(E, lo + per), int(tid % W), out, [](int64_t q) { return q; }, ok,
                 [&](int64_t e) -> int64_t { return etype[e]; }, value);
}

// The grouped sum: out[target(e) * W + f] += value(e, f), visiting the edges in `order`, a
// permutation that puts edges of equal target next to each other (the CSC view for
// destinations, the CSR view for sources, pair_edges for pairs). Each thread owns VEC features
// (f0, f0 + W / VEC, ...: a warp's loads of one feature stay consecutive) of RUN consecutive
// positions (`run_sums`): a node's in-edges cost one atomic per RUN of them, where edge_map adds
// one per edge.
template <int W, int VEC, int RUN, typename Ok, typename Target, typename Value>
JAXDATA_INLINE void grouped_sum(int64_t E, const int32_t* order, float* out, Ok ok,
                                Target target, Value value) {
  static_assert(W % VEC == 0, "a thread's features divide the row");
  constexpr int LANES = W / VEC;
  const int64_t total = (E + RUN - 1) / RUN * LANES;
  for (int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; t < total;
       t += (int64_t)gridDim.x * blockDim.x) {
    const int64_t lo = t / LANES * RUN;
    run_sums<W, VEC>(lo, min(E, lo + RUN), int(t % LANES), out,
                     [&](int64_t q) -> int64_t { return order[q]; }, ok, target, value);
  }
}

// The per-edge traversal: W / VEC threads per edge, each owning VEC of its features (f0,
// f0 + W / VEC, ...), in a grid-stride loop; the edge's id loads and checks are done once per
// thread, not once per feature. An edge that is not ok(e) gets skip(e, f) (a store writes its
// zero there; a sum adds nothing); every other edge gets write(e, f, value(e, f)): a store, or an
// atomic add into its destination's, its pair's or its (relation, destination)'s row.
template <int W, int VEC, typename Ok, typename Value, typename Write, typename Skip>
JAXDATA_INLINE void edge_map(int64_t E, Ok ok, Value value, Write write, Skip skip) {
  static_assert(W % VEC == 0, "a thread's features divide the row");
  constexpr int LANES = W / VEC;
  const int64_t total = E * LANES;
  for (int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; t < total;
       t += (int64_t)gridDim.x * blockDim.x) {
    const int64_t e = t / LANES;
    const int f0 = int(t % LANES);
    if (!ok(e)) {
#pragma unroll
      for (int v = 0; v < VEC; ++v) skip(e, f0 + v * LANES);
      continue;
    }
    float x[VEC];
#pragma unroll
    for (int v = 0; v < VEC; ++v) x[v] = value(e, f0 + v * LANES);
#pragma unroll
    for (int v = 0; v < VEC; ++v) write(e, f0 + v * LANES, x[v]);
  }
}
