// jaxdata.hector: the GEMM and weight-gradient kernels' fixed bodies on CUDA cores (appended
// after cuda.cuh; mma.cuh holds their tensor-core forms). Tile sizes and shapes are template
// arguments; what varies with the instance's IR comes as small functors that the generator
// (jaxdata/hector/codegen/cuda.py) emits before the call, `[&]` lambdas the compiler inlines:
//   ok(e)                   whether row e may be used (row_ok, templates/common.h)
//   weight(r, h, k, n)      element (k, n) of relation r's weight (head h's block), as a float
//                           (gemm_mma in mma.cuh takes w_at(r, h, k, n), its address)
//   scale(e)                the product of row e's scales (called only where SCALED)
// Rows are read at (int64_t)ids[e] * W (GATHER: a node's, pair's or relation's row) or e * W
// (the row of the edge). These and the unscaled case are template arguments, not functors:
// nvcc compiles a functor's call inside `c ? x : y` to a branch where plain arithmetic there
// becomes a select, and the kernels are meant to compile to the machine code that the
// expressions written out gave (hector_sources.py --compare). Each body is the whole
// kernel after the operand pointers: it returns from the kernel.
//
// The row GEMM (`gemm_simt`): the rows of one relation in tiles of BM edges x BN output
// columns, K features in and N out per head; 4 x TN outputs per thread on float32 FMAs. Per
// head (HEADS > 1) one block per tile, head and column block. Output rows go to `out` at
// e * HEADS * N + h * N (SCATTER false; a float or bfloat16 output, `stf`), or are summed per
// run of equal targets `target[e]` inside the tile and added to out's row target[e] with one
// atomic per run and column.

template <int BM, int BK, int BN, int TN, int K, int N, int HEADS, bool TRANSPOSE, bool SCATTER,
          bool GATHER, int W, bool SCALED, typename T, typename O, typename Ok, typename Weight,
          typename Scale>
JAXDATA_INLINE void gemm_simt(const int32_t* tiles, const int32_t* rel_offsets, int64_t R,
                              int64_t E, const T* a, const int32_t* ids, const int32_t* target,
                              O* out, Ok ok, Weight weight, Scale scale) {
  constexpr int THREADS = 16 * (BN / TN), NCB = (N + BN - 1) / BN, WIDTH = HEADS * N;
  constexpr int AB_FLOATS = BK * (BM + 4) + BK * (BN + 4), C_FLOATS = BM * (BN + 1);
  constexpr int NA = BM * BK / THREADS, NB = BK * BN / THREADS;
  static_assert((BM * BK) % THREADS == 0 && (BK * BN) % THREADS == 0, "tile");
  const int64_t tile = blockIdx.x / (NCB * HEADS);
  const int h = HEADS > 1 ? int(blockIdx.x / NCB) % HEADS : 0;
  const int cb = blockIdx.x % NCB;
  if (tile >= tiles[R]) {
    if constexpr (!SCATTER)
      zero_tail<BM, BN, THREADS, N, WIDTH>(out, tiles, rel_offsets, R, E, tile,
                                           head_offset<HEADS, N>(h), cb * BN);
    return;
  }
  const int64_t r = find_relation(tiles, R, tile);
  const int64_t e0 = rel_offsets[r] + (tile - tiles[r]) * BM;
  const int64_t e1 = min((int64_t)rel_offsets[r + 1], E);
  __shared__ __align__(16) float smem[AB_FLOATS > C_FLOATS ? AB_FLOATS : C_FLOATS];
  float (*As)[BM + 4] = reinterpret_cast<float (*)[BM + 4]>(smem);
  float (*Bs)[BN + 4] = reinterpret_cast<float (*)[BN + 4]>(smem + BK * (BM + 4));
  __shared__ int64_t arow[BM];
  const int tid = threadIdx.x;
  for (int i = tid; i < BM; i += THREADS) {
    const int64_t e = e0 + i;
    arow[i] = e < e1 && ok(e) ? (GATHER ? (int64_t)ids[e] * W : e * W) : -1;
  }
  const int ty = tid / (BN / TN), tx = tid % (BN / TN);
  float acc[4][TN] = {{0}};
  __syncthreads();
  // register-staged pipeline: step k0's tiles go from registers to shared memory, then the
  // next step's global loads are issued before the FMAs, so they are in flight while they run
  float ra[NA], rb[NB];
  auto fetch = [&](int k0) {
#pragma unroll
    for (int t = 0; t < NA; ++t) {
      const int idx = tid + t * THREADS, i = idx / BK, k = k0 + idx % BK;
      ra[t] = (arow[i] >= 0 && k < K) ? ldf(a + arow[i] + head_offset<HEADS, K>(h) + k) : 0.0f;
    }
#pragma unroll
    for (int t = 0; t < NB; ++t) {
      const int idx = tid + t * THREADS;
      // transposed (B[k][n] = W[r][n][k]): consecutive threads walk k
      const int kk = TRANSPOSE ? idx % BK : idx / BN, nn = TRANSPOSE ? idx / BK : idx % BN;
      const int k = k0 + kk, n = cb * BN + nn;
      rb[t] = (k < K && n < N) ? weight(r, h, k, n) : 0.0f;
    }
  };
  fetch(0);
  for (int k0 = 0; k0 < K; k0 += BK) {
#pragma unroll
    for (int t = 0; t < NA; ++t) {
      const int idx = tid + t * THREADS;
      As[idx % BK][idx / BK] = ra[t];
    }
#pragma unroll
    for (int t = 0; t < NB; ++t) {
      const int idx = tid + t * THREADS;
      const int kk = TRANSPOSE ? idx % BK : idx / BN, nn = TRANSPOSE ? idx / BK : idx % BN;
      Bs[kk][nn] = rb[t];
    }
    __syncthreads();
    if (k0 + BK < K) fetch(k0 + BK);
    micro_fma<BK, TN>(acc, As, Bs, ty, tx);
    __syncthreads();
  }
  const int hn = head_offset<HEADS, N>(h);
  if constexpr (!SCATTER) {  // stored: a float or a bfloat16 output
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t e = e0 + ty * 4 + i;
      if (e < 0 || e >= e1) continue;
      const float sc = arow[ty * 4 + i] >= 0 ? (SCALED ? scale(e) : 1.0f) : 0.0f;
#pragma unroll
      for (int j = 0; j < TN; ++j) {
        const int n = cb * BN + tx * TN + j;
        if (n < N) stf(out + e * WIDTH + hn + n, acc[i][j] * sc);
      }
    }
  } else {
    // the tile's scaled rows into shared memory (over the A/B tiles, no longer needed) ...
    float (*Cs)[BN + 1] = reinterpret_cast<float (*)[BN + 1]>(smem);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = ty * 4 + i;
      const int64_t e = e0 + row;
      const float sc = arow[row] >= 0 ? (SCALED ? scale(e) : 1.0f) : 0.0f;
#pragma unroll
      for (int j = 0; j < TN; ++j) Cs[row][tx * TN + j] = acc[i][j] * sc;
    }
    __syncthreads();
    // ... then added to the targets' rows, one atomic per run of equal targets
    scatter_tile<BM, BN, THREADS, N, WIDTH>(
        out + hn, cb * BN,
        [&](int row) -> int64_t { return arow[row] >= 0 ? (int64_t)target[e0 + row] : -1; },
        [&](int row, int col) { return Cs[row][col]; });
  }
}

// The weight gradient (`wgrad_simt`): dW[r] (head h's K x N block, per head) = sum over the
// relation's edges e of outer(left row, right row * scale(e)), the rows read as above (`lids`,
// LW and LGATHER for the left rows; `rids`, RW and RGATHER for the right) plus the head's
// offset. A block takes BE edges of one relation and a BM x BN tile of dW, BK edges per step,
// 4 x TN outputs per thread; one atomic per output.
template <int BE, int BK, int BM, int BN, int TN, int K, int N, int HEADS, bool LGATHER, int LW,
          bool RGATHER, int RW, bool SCALED, typename TL, typename TR, typename Ok,
          typename Scale>
JAXDATA_INLINE void wgrad_simt(const int32_t* tiles, const int32_t* rel_offsets, int64_t R,
                               int64_t E, const TL* left, const int32_t* lids, const TR* right,
                               const int32_t* rids, float* out, Ok ok, Scale scale) {
  constexpr int THREADS = 16 * (BN / TN), NKB = (K + BM - 1) / BM, NNB = (N + BN - 1) / BN;
  constexpr int NL = BK * BM / THREADS, NR = BK * BN / THREADS;
  static_assert((BK * BM) % THREADS == 0 && (BK * BN) % THREADS == 0, "tile");
  const int64_t tile = blockIdx.x / (NKB * NNB * HEADS);
  const int h = HEADS > 1 ? int(blockIdx.x / (NKB * NNB)) % HEADS : 0;
  const int kb = (blockIdx.x / NNB) % NKB, nb = blockIdx.x % NNB;
  if (tile >= tiles[R]) return;
  const int64_t r = find_relation(tiles, R, tile);
  const int64_t e0 = rel_offsets[r] + (tile - tiles[r]) * BE;
  const int64_t e1 = min(min(e0 + BE, (int64_t)rel_offsets[r + 1]), E);
  __shared__ float Ls[BK][BM + 4];
  __shared__ float Rs[BK][BN + 4];
  const int tid = threadIdx.x;
  const int ty = tid / (BN / TN), tx = tid % (BN / TN);
  float acc[4][TN] = {{0}};
  // register-staged pipeline, as in the GEMM: the next edges' rows load during the FMAs
  float rl[NL], rr[NR];
  auto fetch = [&](int64_t c) {
#pragma unroll
    for (int t = 0; t < NL; ++t) {
      const int idx = tid + t * THREADS, k = kb * BM + idx % BM;
      const int64_t e = c + idx / BM;
      rl[t] = (e < e1 && k < K && ok(e))
          ? ldf(left + (LGATHER ? (int64_t)lids[e] * LW : e * LW) + head_offset<HEADS, K>(h) + k)
          : 0.0f;
    }
#pragma unroll
    for (int t = 0; t < NR; ++t) {
      const int idx = tid + t * THREADS, n = nb * BN + idx % BN;
      const int64_t e = c + idx / BN;
      rr[t] = (e < e1 && n < N && ok(e))
          ? ldf(right + (RGATHER ? (int64_t)rids[e] * RW : e * RW) + head_offset<HEADS, N>(h) + n)
                * (SCALED ? scale(e) : 1.0f)
          : 0.0f;
    }
  };
  fetch(e0);
  for (int64_t c = e0; c < e1; c += BK) {
#pragma unroll
    for (int t = 0; t < NL; ++t) {
      const int idx = tid + t * THREADS;
      Ls[idx / BM][idx % BM] = rl[t];
    }
#pragma unroll
    for (int t = 0; t < NR; ++t) {
      const int idx = tid + t * THREADS;
      Rs[idx / BN][idx % BN] = rr[t];
    }
    __syncthreads();
    if (c + BK < e1) fetch(c + BK);
    micro_fma<BK, TN>(acc, Ls, Rs, ty, tx);
    __syncthreads();
  }
  atomic_add_tile<TN, K, N>(out + (r * HEADS + h) * (K * N), acc, kb * BM + ty * 4,
                            nb * BN + tx * TN);
}
