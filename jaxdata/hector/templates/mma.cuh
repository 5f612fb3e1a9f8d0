// jaxdata.hector: tensor-core tiles for the generated GEMM and weight-gradient kernels
// (appended after cuda.cuh when an instance runs on tensor cores; inline PTX, no headers, so
// NVRTC compiles it as it is). A block computes a BM x BN tile of C = A B from BK-deep slices
// of A and B staged in shared memory; each warp owns an MT x NT grid of m16n8 tiles and issues
// one mma.sync per tile and k-step (8 deep for TF32, 16 for bfloat16), accumulating in float32.
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
// k is the contiguous index, s[i * LD + k], else s[k * LD + i]. The generator pads LD so that
// the fragment loads of a warp hit 32 different banks (k-major: LD = BK + 4 words; otherwise
// LD = rows + 8 words, i.e. LD % 32 == 8).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "jaxdata.hector: tensor-core kernels need compute capability 8.0 or newer"
#endif

// float32 operands through TF32: shared memory holds TF32 bit patterns (cvt.rna: rounded to
// nearest, ties away from zero, as cuBLAS rounds)
struct MmaTF32 {
  typedef unsigned Elem;
  enum { K = 8 };
};
// bfloat16 operands: shared memory holds the raw bfloat16 bits
struct MmaBF16 {
  typedef unsigned short Elem;
  enum { K = 16 };
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
