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

// float32 operands through TF32: shared memory holds TF32 bit patterns (cvt.rna: rounded to
// nearest, ties away from zero, as cuBLAS rounds). K: an mma's depth; BK: a block's k-step;
// KPAD, XPAD: the padding, in elements, of a k-major row (BK + 4 words) and of any other row
// (x + 8 words).
struct MmaTF32 {
  typedef unsigned Elem;
  enum { K = 8, BK = 16, KPAD = 4, XPAD = 8 };
};
// bfloat16 operands: shared memory holds the raw bfloat16 bits
struct MmaBF16 {
  typedef unsigned short Elem;
  enum { K = 16, BK = 32, KPAD = 8, XPAD = 16 };
};

JAXDATA_INLINE unsigned to_tf32(float x) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
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

// the A fragment of the m16 x K slice at rows m0.., depth k0..
template <bool KM, int LD>
JAXDATA_INLINE void load_a(unsigned (&a)[4], const unsigned* s, int m0, int k0, int g, int t) {
  a[0] = tile_at<KM, LD>(s, m0 + g, k0 + t);
  a[1] = tile_at<KM, LD>(s, m0 + g + 8, k0 + t);
  a[2] = tile_at<KM, LD>(s, m0 + g, k0 + t + 4);
  a[3] = tile_at<KM, LD>(s, m0 + g + 8, k0 + t + 4);
}
template <bool KM, int LD>
JAXDATA_INLINE void load_a(unsigned (&a)[4], const unsigned short* s, int m0, int k0, int g,
                           int t) {
  a[0] = tile_pair<KM, LD>(s, m0 + g, k0 + 2 * t);
  a[1] = tile_pair<KM, LD>(s, m0 + g + 8, k0 + 2 * t);
  a[2] = tile_pair<KM, LD>(s, m0 + g, k0 + 2 * t + 8);
  a[3] = tile_pair<KM, LD>(s, m0 + g + 8, k0 + 2 * t + 8);
}

// the B fragment of the K x n8 slice at columns n0.., depth k0..
template <bool KM, int LD>
JAXDATA_INLINE void load_b(unsigned (&b)[2], const unsigned* s, int n0, int k0, int g, int t) {
  b[0] = tile_at<KM, LD>(s, n0 + g, k0 + t);
  b[1] = tile_at<KM, LD>(s, n0 + g, k0 + t + 4);
}
template <bool KM, int LD>
JAXDATA_INLINE void load_b(unsigned (&b)[2], const unsigned short* s, int n0, int k0, int g,
                           int t) {
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
// acc[mt][nt] += A[m0 + 16 mt .., 0..BK) B[0..BK, n0 + 8 nt ..).
template <typename M, int MT, int NT, int BK, bool AKM, int LDA, bool BKM, int LDB>
JAXDATA_INLINE void warp_mma(float (&acc)[MT][NT][4], const typename M::Elem* As,
                             const typename M::Elem* Bs, int m0, int n0, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int k0 = 0; k0 < BK; k0 += M::K) {
    unsigned a[MT][4], b[NT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) load_a<AKM, LDA>(a[mt], As, m0 + mt * 16, k0, g, t);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) load_b<BKM, LDB>(b[nt], Bs, n0 + nt * 8, k0, g, t);
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

// A shared-memory element from a global one: TF32 bits of a float (or bfloat16) value, times
// scale(e) where SCALED (evaluated after the load); or the raw bits of a bfloat16 value (never
// scaled: a scaled bfloat16 value is no longer one).
template <typename T>
JAXDATA_INLINE unsigned mma_operand(MmaTF32, const T* p) { return to_tf32(ldf(p)); }
template <bool SCALED, typename T, typename Scale>
JAXDATA_INLINE unsigned mma_operand(MmaTF32, const T* p, Scale scale, int64_t e) {
  return to_tf32(ldf(p) * (SCALED ? scale(e) : 1.0f)); }
JAXDATA_INLINE unsigned short mma_operand(MmaBF16, const unsigned short* p) { return __ldg(p); }
template <bool SCALED, typename Scale>
JAXDATA_INLINE unsigned short mma_operand(MmaBF16, const unsigned short* p, Scale, int64_t) {
  static_assert(!SCALED, "bfloat16 operands are never scaled");
  return __ldg(p); }

// The row GEMM on tensor cores (`gemm_mma`): gemm_simt's tiles of BM edges x BN columns, its
// rows, functors and outputs (templates/gemm.cuh), but `w_at(r, h, k, n)` gives the address of
// a weight element, not its value. The block's warps form a (BM / 16 MT) x WN grid, each an
// MT x NT grid of m16n8 tiles. A (the gathered rows) is staged k-major, B (the weight) k-major
// when transposed (its rows are the weight's contiguous rows) and n-major otherwise; global
// loads for the next k-step are in flight (in registers) while the warps run the current one.
// The scaled tile goes through shared memory to the output.
template <typename M, int BM, int BN, int MT, int WN, int K, int N, int HEADS, bool TRANSPOSE,
          bool SCATTER, bool GATHER, int W, bool SCALED, typename T, typename Ok, typename WAt,
          typename Scale>
JAXDATA_INLINE void gemm_mma(const int32_t* tiles, const int32_t* rel_offsets, int64_t R,
                             int64_t E, const T* a, const int32_t* ids, const int32_t* target,
                             float* out, Ok ok, WAt w_at, Scale scale) {
  typedef M Mma;
  typedef typename Mma::Elem Elem;
  constexpr int BK = Mma::BK, NT = BN / (8 * WN), THREADS = 32 * (BM / (16 * MT)) * WN;
  constexpr int NCB = (N + BN - 1) / BN, WIDTH = HEADS * N;
  constexpr int LDA = BK + Mma::KPAD, LDB = TRANSPOSE ? BK + Mma::KPAD : BN + Mma::XPAD;
  constexpr int AB_BYTES = (BM * LDA + (TRANSPOSE ? BN : BK) * LDB) * int(sizeof(Elem));
  constexpr int LDC = BN + 4, C_BYTES = BM * LDC * 4;
  constexpr int NA = BM * BK / THREADS, NB = BK * BN / THREADS;
  static_assert((BM * BK) % THREADS == 0 && (BK * BN) % THREADS == 0 && THREADS % BN == 0,
                "tile");
  const int64_t tile = blockIdx.x / (NCB * HEADS);
  const int h = HEADS > 1 ? int(blockIdx.x / NCB) % HEADS : 0;
  const int cb = blockIdx.x % NCB;
  if (tile >= tiles[R]) return;
  const int64_t r = find_relation(tiles, R, tile);
  const int64_t e0 = rel_offsets[r] + (tile - tiles[r]) * BM;
  const int64_t e1 = min((int64_t)rel_offsets[r + 1], E);
  __shared__ __align__(16) unsigned char smem[AB_BYTES > C_BYTES ? AB_BYTES : C_BYTES];
  Elem* As = reinterpret_cast<Elem*>(smem);  // [BM][LDA]: (m, k) k-major
  Elem* Bs = As + BM * LDA;                  // (n, k): k-major if TRANSPOSE, else n-major
  __shared__ int64_t arow[BM];
  __shared__ float rscale[BM];
  const int tid = threadIdx.x;
  for (int i = tid; i < BM; i += THREADS) {
    const int64_t e = e0 + i;
    const bool use = e < e1 && ok(e);
    arow[i] = use ? (GATHER ? (int64_t)ids[e] * W : e * W) : -1;
    rscale[i] = use ? (SCALED ? scale(e) : 1.0f) : 0.0f;
  }
  const int warp = tid >> 5, lane = tid & 31;
  const int m0 = (warp / WN) * (MT * 16), n0 = (warp % WN) * (NT * 8);
  float acc[MT][NT][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.0f;
  __syncthreads();
  Elem ra[NA], rb[NB];
  auto fetch = [&](int k0) {
#pragma unroll
    for (int t = 0; t < NA; ++t) {
      const int idx = tid + t * THREADS, i = idx / BK, k = k0 + idx % BK;
      ra[t] = (arow[i] >= 0 && k < K)
                  ? mma_operand(Mma(), a + arow[i] + head_offset<HEADS, K>(h) + k) : Elem(0);
    }
#pragma unroll
    for (int t = 0; t < NB; ++t) {
      const int idx = tid + t * THREADS;
      const int kk = TRANSPOSE ? idx % BK : idx / BN, nn = TRANSPOSE ? idx / BK : idx % BN;
      const int k = k0 + kk, n = cb * BN + nn;
      rb[t] = (k < K && n < N) ? mma_operand(Mma(), w_at(r, h, k, n)) : Elem(0);
    }
  };
  fetch(0);
  for (int k0 = 0; k0 < K; k0 += BK) {
#pragma unroll
    for (int t = 0; t < NA; ++t) {
      const int idx = tid + t * THREADS;
      As[(idx / BK) * LDA + idx % BK] = ra[t];
    }
#pragma unroll
    for (int t = 0; t < NB; ++t) {
      const int idx = tid + t * THREADS;
      const int kk = TRANSPOSE ? idx % BK : idx / BN, nn = TRANSPOSE ? idx / BK : idx % BN;
      Bs[TRANSPOSE ? nn * LDB + kk : kk * LDB + nn] = rb[t];
    }
    __syncthreads();
    if (k0 + BK < K) fetch(k0 + BK);
    warp_mma<Mma, MT, NT, BK, true, LDA, TRANSPOSE, LDB>(acc, As, Bs, m0, n0, lane);
    __syncthreads();
  }
  // the tile into shared memory (over the A/B tiles, no longer needed), then out
  float* Cs = reinterpret_cast<float*>(smem);  // [BM][LDC]
  store_acc<MT, NT, LDC>(Cs, acc, m0, n0, lane);
  __syncthreads();
  const int hn = head_offset<HEADS, N>(h);
  if (!SCATTER) {
    for (int idx = tid; idx < BM * BN; idx += THREADS) {
      const int row = idx / BN, col = idx % BN;
      const int64_t e = e0 + row;
      const int n = cb * BN + col;
      if (e < e1 && n < N) out[e * WIDTH + hn + n] = Cs[row * LDC + col] * rscale[row];
    }
    return;
  }
  // each thread walks PER rows of one column, one atomic per run of equal targets
  constexpr int PER = BM / (THREADS / BN);
  const int col = tid % BN, seg = tid / BN;
  const int n = cb * BN + col;
  if (n < N) {
    int64_t run = -1;
    float sum = 0.0f;
    for (int row = seg * PER; row < (seg + 1) * PER; ++row) {
      const int64_t t = arow[row] >= 0 ? (int64_t)target[e0 + row] : -1;
      if (t != run) {
        if (run >= 0) atomicAdd(out + run * WIDTH + hn + n, sum);
        run = t;
        sum = 0.0f;
      }
      sum += Cs[row * LDC + col] * rscale[row];
    }
    if (run >= 0) atomicAdd(out + run * WIDTH + hn + n, sum);
  }
}

// The weight gradient on tensor cores (`wgrad_mma`): wgrad_simt's rows (gemm.cuh), and its
// dW tile of BM x BN as A = left^T (BM features by the edges) times B = right (edges by the
// columns), each staged edge-major as the rows arrive (consecutive threads read consecutive
// features); the edge scales multiply the right rows. Accumulators go to dW with one atomic
// each.
template <typename M, int BE, int BM, int BN, int MT, int WN, int K, int N, int HEADS,
          bool LGATHER, int LW, bool RGATHER, int RW, bool SCALED, typename TL, typename TR,
          typename Ok, typename Scale>
JAXDATA_INLINE void wgrad_mma(const int32_t* tiles, const int32_t* rel_offsets, int64_t R,
                              int64_t E, const TL* left, const int32_t* lids, const TR* right,
                              const int32_t* rids, float* out, Ok ok, Scale scale) {
  typedef M Mma;
  typedef typename Mma::Elem Elem;
  constexpr int BK = Mma::BK, NT = BN / (8 * WN), THREADS = 32 * (BM / (16 * MT)) * WN;
  constexpr int NKB = (K + BM - 1) / BM, NNB = (N + BN - 1) / BN;
  constexpr int LDA = BM + Mma::XPAD, LDB = BN + Mma::XPAD;
  constexpr int NL = BK * BM / THREADS, NR = BK * BN / THREADS;
  static_assert((BK * BM) % THREADS == 0 && (BK * BN) % THREADS == 0 && BE % BK == 0, "tile");
  const int64_t tile = blockIdx.x / (NKB * NNB * HEADS);
  const int h = HEADS > 1 ? int(blockIdx.x / (NKB * NNB)) % HEADS : 0;
  const int kb = (blockIdx.x / NNB) % NKB, nb = blockIdx.x % NNB;
  if (tile >= tiles[R]) return;
  const int64_t r = find_relation(tiles, R, tile);
  const int64_t e0 = rel_offsets[r] + (tile - tiles[r]) * BE;
  const int64_t e1 = min(min(e0 + BE, (int64_t)rel_offsets[r + 1]), E);
  __shared__ __align__(16) Elem Ls[BK * LDA];  // (m, edge) edge-major: [BK][LDA]
  __shared__ __align__(16) Elem Rs[BK * LDB];  // (n, edge) edge-major: [BK][LDB]
  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int m0 = (warp / WN) * (MT * 16), n0 = (warp % WN) * (NT * 8);
  float acc[MT][NT][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.0f;
  Elem rl[NL], rr[NR];
  auto fetch = [&](int64_t c) {
#pragma unroll
    for (int t = 0; t < NL; ++t) {
      const int idx = tid + t * THREADS, k = kb * BM + idx % BM;
      const int64_t e = c + idx / BM;
      rl[t] = (e < e1 && k < K && ok(e))
                  ? mma_operand(Mma(), left + (LGATHER ? (int64_t)lids[e] * LW : e * LW) +
                                           head_offset<HEADS, K>(h) + k)
                  : Elem(0);
    }
#pragma unroll
    for (int t = 0; t < NR; ++t) {
      const int idx = tid + t * THREADS, n = nb * BN + idx % BN;
      const int64_t e = c + idx / BN;
      rr[t] = (e < e1 && n < N && ok(e))
                  ? mma_operand<SCALED>(Mma(), right + (RGATHER ? (int64_t)rids[e] * RW : e * RW) +
                                                   head_offset<HEADS, N>(h) + n, scale, e)
                  : Elem(0);
    }
  };
  fetch(e0);
  for (int64_t c = e0; c < e1; c += BK) {
#pragma unroll
    for (int t = 0; t < NL; ++t) {
      const int idx = tid + t * THREADS;
      Ls[(idx / BM) * LDA + idx % BM] = rl[t];
    }
#pragma unroll
    for (int t = 0; t < NR; ++t) {
      const int idx = tid + t * THREADS;
      Rs[(idx / BN) * LDB + idx % BN] = rr[t];
    }
    __syncthreads();
    if (c + BK < e1) fetch(c + BK);
    warp_mma<Mma, MT, NT, BK, false, LDA, false, LDB>(acc, Ls, Rs, m0, n0, lane);
    __syncthreads();
  }
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
