// jaxdata.hector: tensor-core tiles for the generated GEMM and weight-gradient kernels
// (appended after cuda.cuh when an instance runs on tensor cores; inline PTX, no headers, so
// NVRTC compiles it as it is), and at its end the tensor-core forms of gemm.cuh's bodies. A
// block computes a BM x BN tile of C = A B from BK-deep slices of A and B staged in shared
// memory; each warp owns an MT x NT grid of m16n8 tiles and issues one mma.sync per tile and
// k-step (8 deep for TF32, 16 for bfloat16), accumulating in float32.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k8" / "mma.m16n8k16", floating
// point types; g = lane >> 2 (groupID), t = lane & 3 (threadID_in_group)):
//
//   m16n8k8, .tf32 (one element per .b32 register):
//     A (16 x 8, row):  a0 = A[g][t]      a1 = A[g+8][t]     a2 = A[g][t+4]    a3 = A[g+8][t+4]
//     B (8 x 8, col):   b0 = B[t][g]      b1 = B[t+4][g]
//   m16n8k16, .bf16 (two elements per .b32 register, the lower index in the low half):
//     A (16 x 16, row): a0 = A[g][2t..2t+1]     a1 = A[g+8][2t..2t+1]
//                       a2 = A[g][2t+8..2t+9]   a3 = A[g+8][2t+8..2t+9]
//     B (16 x 8, col):  b0 = B[2t..2t+1][g]     b1 = B[2t+8..2t+9][g]
//   C and D (16 x 8, float32) for both:
//                       c0 = C[g][2t]  c1 = C[g][2t+1]  c2 = C[g+8][2t]  c3 = C[g+8][2t+1]
//
// Tiles in shared memory: A is indexed (m, k), B (n, k). A tile is "k-major" (KM = true) when
// k is the contiguous index, s[i * LD + k], else s[k * LD + i]. The bodies below pad LD so that
// the fragment loads of a warp hit 32 different banks (k-major: LD = BK + 4 words; otherwise
// LD = rows + 8 words, i.e. LD % 32 == 8).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "jaxdata.hector: tensor-core kernels need compute capability 8.0 or newer"
#endif

// The two kinds of tensor-core math. K: an mma's depth; BK: a block's k-step (64 bytes of a row
// of either kind's operands).
//   MmaTF32: float32 (or bfloat16) operands rounded to TF32 (cvt.rna: to nearest, ties away
//            from zero, as cuBLAS rounds) as each fragment is loaded from shared memory
//   MmaBF16: bfloat16 operands, their raw bits
struct MmaTF32 { enum { K = 8, BK = 16 }; };
struct MmaBF16 { enum { K = 16, BK = 32 }; };

JAXDATA_INLINE unsigned to_tf32(float x) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}
JAXDATA_INLINE float as_float(float x) { return x; }
JAXDATA_INLINE float as_float(unsigned short x) { return __uint_as_float(((unsigned)x) << 16); }

// The element type a pointer points to (no <type_traits> under NVRTC).
template <typename P> struct pointee;
template <typename X> struct pointee<const X*> { typedef X type; };
template <typename X> struct pointee<X*> { typedef X type; };

// Shared-memory tiles hold the operands as they are in global memory (float or bfloat16 bits),
// copied there by cp.async. Row pitches, in elements of S: k-major rows BK + KPAD<S> (16 bytes
// of padding), any other rows x + XPAD<S> (32 bytes: LD % 32 words == 8). Both keep rows 16-byte
// aligned for cp.async and make a warp's fragment loads hit 32 different banks.
template <typename S> struct Pad { enum { K = 16 / sizeof(S), X = 32 / sizeof(S) }; };

// Elements per cp.async of rows whose extent and stride are `extent` and `stride` elements of
// S: the largest of 16, 8 and 4 bytes that divides both (0 where none does: the generator
// keeps such instances on CUDA cores, jaxdata/hector/codegen/cuda.py `_chunkable`).
template <typename S>
__host__ __device__ constexpr int chunk(int extent, int stride) {
  // both are multiples of 2^k bytes exactly where their bitwise or is
  return ((extent | stride) * int(sizeof(S))) % 16 == 0 ? 16 / int(sizeof(S))
       : ((extent | stride) * int(sizeof(S))) % 8 == 0 ? 8 / int(sizeof(S))
       : ((extent | stride) * int(sizeof(S))) % 4 == 0 ? 4 / int(sizeof(S)) : 0;
}

// cp.async of BYTES (4, 8 or 16) from global `src` to shared `dst`, or BYTES zeros where !valid
// (src-size 0: nothing is read; `src` is then the operand's base, a valid address anyway).
template <int BYTES>
JAXDATA_INLINE void cp_async(void* dst, const void* src, bool valid) {
  unsigned d;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(d) : "l"(dst));
  const int n = valid ? BYTES : 0;
  if (BYTES == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(d), "l"(src), "r"(n));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;"
                 :: "r"(d), "l"(src), "n"(BYTES), "r"(n));
}
JAXDATA_INLINE void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int PENDING>
JAXDATA_INLINE void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" :: "n"(PENDING) : "memory");
}

// element (i, k) of a tile
template <bool KM, int LD, typename E>
JAXDATA_INLINE E tile_at(const E* s, int i, int k) {
  return KM ? s[i * LD + k] : s[k * LD + i];
}

// bfloat16 elements (i, k) and (i, k + 1) in one register, (i, k) in the low half; k is even
// and LD even, so a k-major pair is one aligned 32-bit load
template <bool KM, int LD>
JAXDATA_INLINE unsigned tile_pair(const unsigned short* s, int i, int k) {
  if (KM) return *reinterpret_cast<const unsigned*>(s + i * LD + k);
  return (unsigned)s[k * LD + i] | ((unsigned)s[(k + 1) * LD + i] << 16);
}

// The A fragment of the m16 x K slice at rows m0.., depth k0.. (TF32: each element rounded,
// times the scale of its k where SCALED: sc[k], the scales of the slice's k indices)
template <bool KM, int LD, bool SCALED, typename S>
JAXDATA_INLINE void load_a(unsigned (&a)[4], const S* s, int m0, int k0, int g, int t,
                           const float* sc, MmaTF32) {
  const float s0 = SCALED ? sc[k0 + t] : 1.0f, s1 = SCALED ? sc[k0 + t + 4] : 1.0f;
  a[0] = to_tf32(as_float(tile_at<KM, LD>(s, m0 + g, k0 + t)) * s0);
  a[1] = to_tf32(as_float(tile_at<KM, LD>(s, m0 + g + 8, k0 + t)) * s0);
  a[2] = to_tf32(as_float(tile_at<KM, LD>(s, m0 + g, k0 + t + 4)) * s1);
  a[3] = to_tf32(as_float(tile_at<KM, LD>(s, m0 + g + 8, k0 + t + 4)) * s1);
}
template <bool KM, int LD, bool SCALED>
JAXDATA_INLINE void load_a(unsigned (&a)[4], const unsigned short* s, int m0, int k0, int g,
                           int t, const float*, MmaBF16) {
  static_assert(!SCALED, "bfloat16 operands are never scaled");
  a[0] = tile_pair<KM, LD>(s, m0 + g, k0 + 2 * t);
  a[1] = tile_pair<KM, LD>(s, m0 + g + 8, k0 + 2 * t);
  a[2] = tile_pair<KM, LD>(s, m0 + g, k0 + 2 * t + 8);
  a[3] = tile_pair<KM, LD>(s, m0 + g + 8, k0 + 2 * t + 8);
}

// the B fragment of the K x n8 slice at columns n0.., depth k0..
template <bool KM, int LD, typename S>
JAXDATA_INLINE void load_b(unsigned (&b)[2], const S* s, int n0, int k0, int g, int t, MmaTF32) {
  b[0] = to_tf32(as_float(tile_at<KM, LD>(s, n0 + g, k0 + t)));
  b[1] = to_tf32(as_float(tile_at<KM, LD>(s, n0 + g, k0 + t + 4)));
}
template <bool KM, int LD>
JAXDATA_INLINE void load_b(unsigned (&b)[2], const unsigned short* s, int n0, int k0, int g,
                           int t, MmaBF16) {
  b[0] = tile_pair<KM, LD>(s, n0 + g, k0 + 2 * t);
  b[1] = tile_pair<KM, LD>(s, n0 + g, k0 + 2 * t + 8);
}

JAXDATA_INLINE void mma(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2], MmaTF32) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
JAXDATA_INLINE void mma(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2], MmaBF16) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// One BK-deep step of a warp's MT x NT grid of m16n8 tiles at (m0, n0) of the block's tile:
// acc[mt][nt] += A[m0 + 16 mt .., 0..BK) B[0..BK, n0 + 8 nt ..) (A's k scaled by sc[k] where
// SCALED).
template <typename M, int MT, int NT, int BK, bool AKM, int LDA, bool BKM, int LDB, bool SCALED,
          typename SA, typename SB>
JAXDATA_INLINE void warp_mma(float (&acc)[MT][NT][4], const SA* As, const SB* Bs, int m0, int n0,
                             int lane, const float* sc) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int k0 = 0; k0 < BK; k0 += M::K) {
    unsigned a[MT][4], b[NT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      load_a<AKM, LDA, SCALED>(a[mt], As, m0 + mt * 16, k0, g, t, sc, M());
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) load_b<BKM, LDB>(b[nt], Bs, n0 + nt * 8, k0, g, t, M());
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) mma(acc[mt][nt], a[mt], b[nt], M());
  }
}

// Where accumulator element i of tile (mt, nt) of the warp at (m0, n0) lies in the block's tile.
JAXDATA_INLINE int acc_row(int m0, int mt, int i, int lane) {
  return m0 + mt * 16 + (lane >> 2) + (i >> 1) * 8; }
JAXDATA_INLINE int acc_col(int n0, int nt, int i, int lane) {
  return n0 + nt * 8 + (lane & 3) * 2 + (i & 1); }

// The warp's accumulators into a float tile C[row * LDC + col] in shared memory.
template <int MT, int NT, int LDC>
JAXDATA_INLINE void store_acc(float* C, const float (&acc)[MT][NT][4], int m0, int n0,
                              int lane) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        C[acc_row(m0, mt, i, lane) * LDC + acc_col(n0, nt, i, lane)] = acc[mt][nt][i];
}

template <int MT, int NT>
JAXDATA_INLINE void zero(float (&acc)[MT][NT][4]) {
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.0f;
}

// k-steps in flight: cp.async fills STAGES - 1 steps ahead of the one the warps multiply. At
// most JAXDATA_MMA_STAGES (codegen/cuda.py's MMA_STAGES, defined before this file), fewer
// where the stages' buffers and `fixed` other bytes would not fit in 48 KB of static shared
// memory (never fewer than 2).
__host__ __device__ constexpr int mma_stages(int stage_bytes, int fixed_bytes) {
  int s = JAXDATA_MMA_STAGES;
  while (s > 2 && s * stage_bytes + fixed_bytes > 48 * 1024) --s;
  return s;
}

// find_relation (cuda.cuh) by warp 0 in rounds of 32 pivots (a 32-ary search: 2 rounds of loads
// for 535 relations where the binary search of one thread takes 10 dependent ones): tiles[] is
// non-decreasing, so the lanes whose pivot has tiles[p] <= tile are a prefix, and the next
// round searches between the last of them and its successor. The same answer, the last
// r < R with tiles[r] <= tile; a tensor-core tile is a few microseconds of work, and the
// search's chain of loads was a sizable part of it.
__device__ __forceinline__ int64_t find_relation_warp(const int32_t* tiles, int64_t R,
                                                      int64_t tile) {
  __shared__ int64_t s_r;
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    int64_t lo = 0, hi = R;  // tiles[lo] <= tile (tiles[0] is 0); the answer is in [lo, hi)
    while (hi - lo > 1) {
      const int64_t step = (hi - lo + 31) / 32, p = lo + lane * step;
      const unsigned below = __ballot_sync(0xffffffffu, p < hi && tiles[p] <= tile);
      lo += below ? (31 - __clz(below)) * step : 0;  // lane 0's pivot is lo itself
      hi = min(hi, lo + step);
    }
    if (lane == 0) s_r = lo;
  }
  __syncthreads();
  return s_r;
}

// The k-loop of a cp.async pipeline over nk steps: issue(kt) starts the copies of step kt into
// its stage (kt % STAGES), STAGES - 1 steps ahead of multiply(kt), which reads that stage.
// Returns with every copy landed (the caller syncs before reusing shared memory).
template <int STAGES, typename Issue, typename Multiply>
JAXDATA_INLINE void pipeline(int nk, Issue issue, Multiply multiply) {
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nk) issue(s);
    cp_async_commit();
  }
#pragma unroll 1
  for (int kt = 0; kt < nk; ++kt) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // step kt is in shared memory, and every warp is done with step kt - 1
    if (kt + STAGES - 1 < nk) issue(kt + STAGES - 1);
    cp_async_commit();
    multiply(kt);
  }
  cp_async_wait<0>();
}

// The row GEMM on tensor cores (`gemm_mma`): gemm_simt's tiles of BM edges x BN columns, its
// rows, functors and outputs (templates/gemm.cuh), but `w_at(r, h, k, n)` gives the address of
// a weight element, not its value. The block's warps form a (BM / 16 MT) x WN grid, each an
// MT x NT grid of m16n8 tiles. Each k-step's slices of A (the gathered rows, k-major) and B
// (the weight: k-major when transposed, its rows being the weight's contiguous rows, else
// n-major) go global -> shared by cp.async, STAGES - 1 steps ahead of the multiply, so a
// block keeps many rows in flight without holding them in registers. The edge scales multiply
// the output rows; the tile goes through shared memory to the output.
template <typename M, int BM, int BN, int MT, int WN, int K, int N, int HEADS, bool TRANSPOSE,
          bool SCATTER, bool GATHER, int W, bool SCALED, typename T, typename O, typename Ok,
          typename WAt, typename Scale>
JAXDATA_INLINE void gemm_mma(const int32_t* tiles, const int32_t* rel_offsets, int64_t R,
                             int64_t E, const T* a, const int32_t* ids, const int32_t* target,
                             O* out, Ok ok, WAt w_at, Scale scale) {
  typedef M Mma;
  typedef typename pointee<decltype(w_at(0, 0, 0, 0))>::type TB;
  constexpr int BK = Mma::BK, NT = BN / (8 * WN);
  constexpr int THREADS = 32 * (BM / (16 * MT)) * WN, NK = (K + BK - 1) / BK;
  constexpr int NCB = (N + BN - 1) / BN, WIDTH = HEADS * N;
  constexpr int LDA = BK + Pad<T>::K, LDB = TRANSPOSE ? BK + Pad<TB>::K : BN + Pad<TB>::X;
  constexpr int A_STAGE = BM * LDA, B_STAGE = (TRANSPOSE ? BN : BK) * LDB;
  constexpr int STAGE_BYTES = A_STAGE * int(sizeof(T)) + B_STAGE * int(sizeof(TB));
  constexpr int STAGES = mma_stages(STAGE_BYTES, BM * 12 + 64);  // + arow, rscale
  constexpr int AB_BYTES = STAGES * STAGE_BYTES;
  constexpr int LDC = BN + 4, C_BYTES = BM * LDC * 4;
  constexpr int CA = chunk<T>(K, W), CB = TRANSPOSE ? chunk<TB>(K, K) : chunk<TB>(N, N);
  static_assert(CA > 0 && CB > 0 && BK % CA == 0 && (TRANSPOSE ? BK : BN) % CB == 0, "chunks");
  static_assert(THREADS % BN == 0 && BM % (THREADS / BN) == 0, "tile");
  const int64_t tile = blockIdx.x / (NCB * HEADS);
  const int h = HEADS > 1 ? int(blockIdx.x / NCB) % HEADS : 0;
  const int cb = blockIdx.x % NCB;
  if (tile >= tiles[R]) {
    if constexpr (!SCATTER)
      zero_tail<BM, BN, THREADS, N, WIDTH>(out, tiles, rel_offsets, R, E, tile,
                                           head_offset<HEADS, N>(h), cb * BN);
    return;
  }
  const int64_t r = find_relation_warp(tiles, R, tile);
  const int64_t e0 = rel_offsets[r] + (tile - tiles[r]) * BM;
  const int64_t e1 = min((int64_t)rel_offsets[r + 1], E);
  __shared__ __align__(16) unsigned char smem[AB_BYTES > C_BYTES ? AB_BYTES : C_BYTES];
  T* As = reinterpret_cast<T*>(smem);                     // STAGES x [BM][LDA]: (m, k)
  TB* Bs = reinterpret_cast<TB*>(As + STAGES * A_STAGE);  // STAGES x (n, k) or (k, n)
  __shared__ int64_t arow[BM];
  __shared__ float rscale[BM];
  const int tid = threadIdx.x;
  for (int i = tid; i < BM; i += THREADS) {
    const int64_t e = e0 + i;
    const bool use = e < e1 && ok(e);
    arow[i] = use ? (GATHER ? (int64_t)ids[e] * W : e * W) + head_offset<HEADS, K>(h) : -1;
    rscale[i] = use ? (SCALED ? scale(e) : 1.0f) : 0.0f;
  }
  const int warp = tid >> 5, lane = tid & 31;
  const int m0 = (warp / WN) * (MT * 16), n0 = (warp % WN) * (NT * 8);
  float acc[MT][NT][4];
  zero(acc);
  __syncthreads();
  auto issue = [&](int kt) {
    T* as = As + (kt % STAGES) * A_STAGE;
    TB* bs = Bs + (kt % STAGES) * B_STAGE;
    const int k0 = kt * BK;
#pragma unroll
    for (int c = tid; c < BM * (BK / CA); c += THREADS) {
      const int i = c / (BK / CA), kc = (c % (BK / CA)) * CA;
      const bool use = arow[i] >= 0 && k0 + kc < K;
      cp_async<int(CA * sizeof(T))>(as + i * LDA + kc, use ? a + arow[i] + k0 + kc : a, use);
    }
    if (TRANSPOSE) {  // (n, k): the weight's row n, k contiguous
#pragma unroll
      for (int c = tid; c < BN * (BK / CB); c += THREADS) {
        const int nn = c / (BK / CB), kc = (c % (BK / CB)) * CB, n = cb * BN + nn;
        const bool use = n < N && k0 + kc < K;
        const TB* src = w_at(r, h, use ? k0 + kc : 0, use ? n : 0);
        cp_async<int(CB * sizeof(TB))>(bs + nn * LDB + kc, src, use);
      }
    } else {  // (k, n): the weight's row k, n contiguous
#pragma unroll
      for (int c = tid; c < BK * (BN / CB); c += THREADS) {
        const int kk = c / (BN / CB), nc = (c % (BN / CB)) * CB, n = cb * BN + nc;
        const bool use = k0 + kk < K && n < N;
        const TB* src = w_at(r, h, use ? k0 + kk : 0, use ? n : 0);
        cp_async<int(CB * sizeof(TB))>(bs + kk * LDB + nc, src, use);
      }
    }
  };
  pipeline<STAGES>(NK, issue, [&](int kt) {
    warp_mma<Mma, MT, NT, BK, true, LDA, TRANSPOSE, LDB, false>(
        acc, As + (kt % STAGES) * A_STAGE, Bs + (kt % STAGES) * B_STAGE, m0, n0, lane, nullptr);
  });
  __syncthreads();
  // the tile into shared memory (over the A/B tiles, no longer needed), then out
  float* Cs = reinterpret_cast<float*>(smem);  // [BM][LDC]
  store_acc<MT, NT, LDC>(Cs, acc, m0, n0, lane);
  __syncthreads();
  const int hn = head_offset<HEADS, N>(h);
  if constexpr (!SCATTER) {  // stored: a float or a bfloat16 output
    for (int idx = tid; idx < BM * BN; idx += THREADS) {
      const int row = idx / BN, col = idx % BN;
      const int64_t e = e0 + row;
      const int n = cb * BN + col;
      if (e < e1 && n < N) stf(out + e * WIDTH + hn + n, Cs[row * LDC + col] * rscale[row]);
    }
  } else {  // added to the targets' rows, one atomic per run of equal targets
    scatter_tile<BM, BN, THREADS, N, WIDTH>(
        out + hn, cb * BN,
        [&](int row) -> int64_t { return arow[row] >= 0 ? (int64_t)target[e0 + row] : -1; },
        [&](int row, int col) { return Cs[row * LDC + col] * rscale[row]; });
  }
}

// The weight gradient on tensor cores (`wgrad_mma`): wgrad_simt's rows (gemm.cuh), and its
// dW tile of BM x BN as A = left^T (BM features by the edges) times B = right (edges by the
// columns). Each k-step (BK edges) goes global -> shared by cp.async, edge-major as the rows
// lie, STAGES - 1 steps ahead of the multiply; the rows' offsets (and edge scales) are found
// once per block. The edge scales multiply A's fragments in registers (TF32 only: a scaled
// bfloat16 row is no longer a bfloat16 value). Accumulators go to dW with one atomic each.
template <typename M, int BE, int BM, int BN, int MT, int WN, int K, int N, int HEADS,
          bool LGATHER, int LW, bool RGATHER, int RW, bool SCALED, typename TL, typename TR,
          typename Ok, typename Scale>
JAXDATA_INLINE void wgrad_mma(const int32_t* tiles, const int32_t* rel_offsets, int64_t R,
                              int64_t E, const TL* left, const int32_t* lids, const TR* right,
                              const int32_t* rids, float* out, Ok ok, Scale scale) {
  typedef M Mma;
  constexpr int BK = Mma::BK, NT = BN / (8 * WN);
  constexpr int THREADS = 32 * (BM / (16 * MT)) * WN;
  constexpr int NKB = (K + BM - 1) / BM, NNB = (N + BN - 1) / BN;
  constexpr int LDL = BM + Pad<TL>::X, LDR = BN + Pad<TR>::X;
  constexpr int L_STAGE = BK * LDL, R_STAGE = BK * LDR;
  constexpr int STAGES = mma_stages(L_STAGE * int(sizeof(TL)) + R_STAGE * int(sizeof(TR)),
                                    BE * (SCALED ? 12 : 8) + 64);  // + lrow, rrow, esc
  constexpr int CL = chunk<TL>(K, LW), CR = chunk<TR>(N, RW);
  static_assert(CL > 0 && CR > 0 && BM % CL == 0 && BN % CR == 0 && BE % BK == 0, "tile");
  const int64_t tile = blockIdx.x / (NKB * NNB * HEADS);
  const int h = HEADS > 1 ? int(blockIdx.x / (NKB * NNB)) % HEADS : 0;
  const int kb = (blockIdx.x / NNB) % NKB, nb = blockIdx.x % NNB;
  if (tile >= tiles[R]) return;
  const int64_t r = find_relation_warp(tiles, R, tile);
  const int64_t e0 = rel_offsets[r] + (tile - tiles[r]) * BE;
  const int64_t e1 = min(min(e0 + BE, (int64_t)rel_offsets[r + 1]), E);
  __shared__ __align__(16) TL Ls[STAGES * L_STAGE];  // [BK][LDL] per stage: (m, edge)
  __shared__ __align__(16) TR Rs[STAGES * R_STAGE];  // [BK][LDR] per stage: (n, edge)
  __shared__ int32_t lrow[BE], rrow[BE];  // each edge's left and right row (-1: not used)
  __shared__ float esc[SCALED ? BE : 1];
  const int tid = threadIdx.x;
  for (int i = tid; i < BE; i += THREADS) {
    const int64_t e = e0 + i;
    const bool use = e < e1 && ok(e);  // ok(e): lids[e] and rids[e] are rows in range
    lrow[i] = use ? (LGATHER ? lids[e] : int32_t(e)) : -1;
    rrow[i] = use ? (RGATHER ? rids[e] : int32_t(e)) : -1;
    if (SCALED) esc[i] = use ? scale(e) : 0.0f;
  }
  const int warp = tid >> 5, lane = tid & 31;
  const int m0 = (warp / WN) * (MT * 16), n0 = (warp % WN) * (NT * 8);
  float acc[MT][NT][4];
  zero(acc);
  __syncthreads();
  const int nk = int((e1 - e0 + BK - 1) / BK);
  auto issue = [&](int kt) {
    TL* ls = Ls + (kt % STAGES) * L_STAGE;
    TR* rs = Rs + (kt % STAGES) * R_STAGE;
    const int i0 = kt * BK;
#pragma unroll
    for (int c = tid; c < BK * (BM / CL); c += THREADS) {
      const int j = c / (BM / CL), mc = (c % (BM / CL)) * CL, m = kb * BM + mc;
      const int32_t row = lrow[i0 + j];
      const bool use = row >= 0 && m < K;
      const int64_t o = (int64_t)row * LW + head_offset<HEADS, K>(h) + m;
      cp_async<int(CL * sizeof(TL))>(ls + j * LDL + mc, use ? left + o : left, use);
    }
#pragma unroll
    for (int c = tid; c < BK * (BN / CR); c += THREADS) {
      const int j = c / (BN / CR), nc = (c % (BN / CR)) * CR, n = nb * BN + nc;
      const int32_t row = rrow[i0 + j];
      const bool use = row >= 0 && n < N;
      const int64_t o = (int64_t)row * RW + head_offset<HEADS, N>(h) + n;
      cp_async<int(CR * sizeof(TR))>(rs + j * LDR + nc, use ? right + o : right, use);
    }
  };
  pipeline<STAGES>(nk, issue, [&](int kt) {
    warp_mma<Mma, MT, NT, BK, false, LDL, false, LDR, SCALED>(
        acc, Ls + (kt % STAGES) * L_STAGE, Rs + (kt % STAGES) * R_STAGE, m0, n0, lane,
        SCALED ? esc + kt * BK : nullptr);
  });
  float* o = out + (r * HEADS + h) * (K * N);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int k = kb * BM + acc_row(m0, mt, i, lane);
        const int n = nb * BN + acc_col(n0, nt, i, lane);
        if (k < K && n < N) atomicAdd(o + k * N + n, acc[mt][nt][i]);
      }
}
