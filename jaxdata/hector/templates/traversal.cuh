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

// A hub's team: JAXDATA_HUB_CLUSTER blocks of one thread block cluster (sm_90; the kernel is
// compiled with __cluster_dims__ and launched on a multiple of that many blocks), on as many
// SMs. One block's walk of a hub is bound by its SM's share of memory throughput (RGAT, 2M
// edges: 240 of the softmax's 400 us were one 25K-edge hub on one SM), so a team walks each
// hub's edges together and combines its blocks' (m, s) through distributed shared memory.
// Elsewhere a team is one block.
#ifndef JAXDATA_HUB_CLUSTER
#define JAXDATA_HUB_CLUSTER 1
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && JAXDATA_HUB_CLUSTER > 1
#define JAXDATA_TEAM JAXDATA_HUB_CLUSTER
#define JAXDATA_CLUSTER_DIMS __cluster_dims__(JAXDATA_HUB_CLUSTER, 1, 1)
#else
#define JAXDATA_TEAM 1
#define JAXDATA_CLUSTER_DIMS
#endif

// This block's rank in its team (consecutive blocks form a cluster of a 1-D grid).
JAXDATA_INLINE unsigned team_rank() {
#if JAXDATA_TEAM > 1
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
#else
  return 0;
#endif
}

// Every thread of the team's blocks waits here; shared memory written before is visible after.
JAXDATA_INLINE void team_sync() {
#if JAXDATA_TEAM > 1
  asm volatile("barrier.cluster.arrive.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
#else
  __syncthreads();
#endif
}

#if JAXDATA_TEAM > 1
// The float at p (this block's shared memory) in block `rank` of the cluster.
JAXDATA_INLINE float team_load(const float* p, unsigned rank) {
  const unsigned local = (unsigned)__cvta_generic_to_shared(p);
  unsigned remote;
  float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}
#endif

// (m, s) of the team: each block's (m, s) (the same in all its threads) combined over the team in
// rank order; every thread of the team gets the result.
template <int W>
JAXDATA_INLINE void team_combine(float (&m)[W], float (&s)[W]) {
#if JAXDATA_TEAM > 1
  __shared__ float part_m[W], part_s[W];
  if (threadIdx.x == 0)
    for (int f = 0; f < W; ++f) { part_m[f] = m[f]; part_s[f] = s[f]; }
  team_sync();
  for (int f = 0; f < W; ++f) { m[f] = LOWEST; s[f] = 0.0f; }
  for (unsigned r = 0; r < JAXDATA_TEAM; ++r)
    for (int f = 0; f < W; ++f) {
      const float m2 = team_load(&part_m[f], r), s2 = team_load(&part_s[f], r);
      const float mm = fmaxf(m[f], m2);
      s[f] = s[f] * expf(m[f] - mm) + s2 * expf(m2 - mm);
      m[f] = mm;
    }
  team_sync();  // every block has read part_m and part_s before they are written again
#endif
}

// Every node of more than DEGREE edges (a hub), each given to a whole team: fn(q0, q1) with its
// edges' positions, called by every thread of the team. Node i's hub (if it is one) goes to team
// i % teams, so hubs with neighbouring ids (a real graph's class or type nodes often are) land
// on different teams rather than queueing on one; each block's threads test THREADS of its
// team's nodes at a time, and list the hubs in node order (every block of a team the same list).
template <int THREADS, int DEGREE, typename Fn>
JAXDATA_INLINE void for_each_hub(int64_t N, int64_t E, const int32_t* off, Fn fn) {
  constexpr int WARPS = THREADS / 32;
  __shared__ int64_t hubs[THREADS];
  __shared__ int counts[WARPS];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t team = blockIdx.x / JAXDATA_TEAM, teams = gridDim.x / JAXDATA_TEAM;
  for (int64_t base = team; base < N; base += teams * THREADS) {
    const int64_t c = base + (int64_t)threadIdx.x * teams;  // this thread's node
    bool hub = false;
    if (c < N) {
      const int64_t q0 = span(off[c], 0, E), q1 = span(off[c + 1], q0, E);
      hub = q1 - q0 > DEGREE;
    }
    const unsigned ballot = __ballot_sync(0xffffffffu, hub);
    if (lane == 0) counts[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, found = 0;
    for (int k = 0; k < WARPS; ++k) {
      before += k < warp ? counts[k] : 0;
      found += counts[k];
    }
    if (hub) hubs[before + __popc(ballot & ((1u << lane) - 1u))] = c;
    __syncthreads();
    for (int k = 0; k < found; ++k) {
      const int64_t i = hubs[k];
      const int64_t q0 = span(off[i], 0, E), q1 = span(off[i + 1], q0, E);
      fn(q0, q1);
      __syncthreads();  // the block's shared reductions are free for the next hub
    }
    __syncthreads();  // every thread has read hubs and counts before they are written again
  }
}

// (m, s) of the softmax over the edges at positions lo + threadIdx.x, ... (stride) below hi for
// the whole block: every thread's online pass (storing the raw scores), combined over the
// block; every thread gets the result.
template <int W, int THREADS, typename Ok, typename Score>
JAXDATA_INLINE void block_max_sum(int64_t lo, int64_t hi, int64_t stride, const int32_t* eids,
                                  float* out, Ok ok, Score score, float (&m)[W], float (&s)[W]) {
  constexpr int WARPS = THREADS / 32;
  __shared__ float red_m[WARPS][W], red_s[WARPS][W];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  warp_max_sum<W>(lo + threadIdx.x, hi, stride, eids, out, ok, score, m, s);
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
  for_each_hub<THREADS, DEGREE>(N, E, off, [&](int64_t q0, int64_t q1) {  // a team per hub
    const int64_t lo = q0 + (int64_t)team_rank() * THREADS, stride = JAXDATA_TEAM * THREADS;
    block_max_sum<W, THREADS>(lo, q1, stride, eids, out, ok, score, m, s);
    team_combine<W>(m, s);
    online_second<W>(lo + threadIdx.x, q1, stride, eids, out, ok, m, s);
  });
}

// Feature v of the VEC a thread owns as its f0-th lane of a row of W: f0 + v * (W / VEC), so a
// warp's loads of one feature are consecutive.
template <int W, int VEC> JAXDATA_INLINE int feature(int f0, int v) { return f0 + v * (W / VEC); }

// sum[v] added to out[row * W + feature(f0, v)] for each v, one atomic per feature.
template <int W, int VEC>
JAXDATA_INLINE void add_features(float* out, int64_t row, int f0, const float (&sum)[VEC]) {
#pragma unroll
  for (int v = 0; v < VEC; ++v) atomicAdd(out + row * W + feature<W, VEC>(f0, v), sum[v]);
}

// Features feature<W, VEC>(f0, v) (VEC of them) of positions [lo, hi): out[target(e) * W + f] +=
// value(e, f) for e = at(q), summed while the target stays the same, one atomic per run of equal
// targets and feature (`add_features`). A position's id loads and checks are shared by its VEC
// features.
template <int W, int VEC, typename At, typename Ok, typename Target, typename Value>
JAXDATA_INLINE void run_sums(int64_t lo, int64_t hi, int f0, float* out, At at, Ok ok,
                             Target target, Value value) {
  int64_t run = -1;
  float sum[VEC] = {};
  for (int64_t q = lo; q < hi; ++q) {
    const int64_t e = at(q);
    if (!ok(e)) continue;
    const int64_t to = target(e);
    if (to != run) {
      if (run >= 0) add_features<W, VEC>(out, run, f0, sum);
      run = to;
#pragma unroll
      for (int v = 0; v < VEC; ++v) sum[v] = 0.0f;
    }
#pragma unroll
    for (int v = 0; v < VEC; ++v) sum[v] += value(e, feature<W, VEC>(f0, v));
  }
  if (run >= 0) add_features<W, VEC>(out, run, f0, sum);
}

// The relation sum: out[r * W + f] += value(e, f) over the edges e of relation r. Each thread
// owns VEC features (f0, f0 + W / VEC, ...) and a run of consecutive edges; edges are sorted by
// relation, so it sums while the relation stays the same and adds one atomic per relation it
// crosses (rather than one per edge into the same R * W outputs).
template <int W, int VEC, typename Ok, typename Value>
JAXDATA_INLINE void relation_sum(int64_t E, const int32_t* etype, float* out, Ok ok,
                                 Value value) {
  static_assert(W % VEC == 0, "a thread's features divide the row");
  constexpr int LANES = W / VEC;
  const int64_t threads = (int64_t)gridDim.x * blockDim.x;
  const int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  const int64_t chunks = threads / LANES;
  if (tid >= chunks * LANES) return;
  const int64_t per = (E + chunks - 1) / chunks;
  const int64_t lo = (tid / LANES) * per;
  run_sums<W, VEC>(lo, min(E, lo + per), int(tid % LANES), out, [](int64_t q) { return q; }, ok,
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
      for (int v = 0; v < VEC; ++v) skip(e, feature<W, VEC>(f0, v));
      continue;
    }
    float x[VEC];
#pragma unroll
    for (int v = 0; v < VEC; ++v) x[v] = value(e, feature<W, VEC>(f0, v));
#pragma unroll
    for (int v = 0; v < VEC; ++v) write(e, feature<W, VEC>(f0, v), x[v]);
  }
}
