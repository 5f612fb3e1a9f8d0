// jaxdata.hector: the fixed start of every generated CUDA kernel (compiled by NVRTC, or nvcc).
// The generator appends gemm.cuh or mma.cuh for a GEMM or weight gradient, common.h (and
// traversal.cuh for an edge softmax or a relation sum), then the kernel: its Params struct and
// signature, the operand pointers (jaxdata/hector/operands.py) and the instance's body.
#ifdef __CUDACC_RTC__
typedef int int32_t; typedef long long int64_t;
#else
#include <cstdint>
#endif
#define JAXDATA_INLINE __device__ __forceinline__

// element p as a float. JAXDATA_PLAIN_LOADS (traversals): a plain load, which the compiler may
// merge with its neighbours into one vector load (the read-only path's __ldg stays scalar)
#ifdef JAXDATA_PLAIN_LOADS
__device__ __forceinline__ float ldf(const float* p) { return *p; }
__device__ __forceinline__ float ldf(const unsigned short* p) {
  return __uint_as_float(((unsigned)*p) << 16); }
#else
__device__ __forceinline__ float ldf(const float* p) { return __ldg(p); }
__device__ __forceinline__ float ldf(const unsigned short* p) {
  return __uint_as_float(((unsigned)__ldg(p)) << 16); }
#endif

// v stored at p: a float as it is, a bfloat16 rounded to the nearest even (as XLA's convert)
__device__ __forceinline__ void stf(float* p, float v) { *p = v; }
__device__ __forceinline__ void stf(unsigned short* p, float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  unsigned short b;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(v));
  *p = b;
#else
  const unsigned u = __float_as_uint(v);  // a NaN keeps its sign and stays a (quiet) NaN
  *p = (unsigned short)(((u & 0x7fffffffu) > 0x7f800000u ? u | 0x400000u
                                                         : u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#endif
}

// BYTES (4, 8 or 16) bytes from p (aligned to that) as 32-bit words, in one load
template <int BYTES> __device__ __forceinline__ void ldw(const void* p, unsigned* w) {
  static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "one 4-, 8- or 16-byte load");
  if constexpr (BYTES == 16) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
    w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
  } else if constexpr (BYTES == 8) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    w[0] = v.x; w[1] = v.y;
  } else {
    w[0] = __ldg(reinterpret_cast<const unsigned*>(p));
  }
}

// V consecutive elements from p (V * sizeof(T) bytes, p aligned to that) as floats, in one load
template <int V> __device__ __forceinline__ void ldv(const float* p, float* x) {
  if constexpr (V == 1) {
    x[0] = ldf(p);
  } else {
    unsigned w[V];
    ldw<4 * V>(p, w);
#pragma unroll
    for (int i = 0; i < V; ++i) x[i] = __uint_as_float(w[i]);
  }
}
template <int V> __device__ __forceinline__ void ldv(const unsigned short* p, float* x) {
  if constexpr (V == 1) {
    x[0] = ldf(p);
  } else {
    unsigned w[V / 2];
    ldw<2 * V>(p, w);
#pragma unroll
    for (int i = 0; i < V / 2; ++i) {  // little-endian: the lower half is the earlier element
      x[2 * i] = __uint_as_float(w[i] << 16);
      x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
}

// The widest load (at most 16 bytes, so 4 floats or 8 bfloat16) that divides both D and ALIGN
template <typename T> __host__ __device__ constexpr int vector_width(int d, int align) {
  int v = 16 / (int)sizeof(T);
  while (v > 1 && (d % v || align % v)) v /= 2;
  return v;
}

// The sum over i < D of a[i] * b[i], in order (the same sum as a loop of scalar loads). ALIGN_A:
// a's offset from its buffer's start is a whole multiple of ALIGN_A elements (XLA's buffers are
// 16-byte aligned at least), so each row is read in the widest loads that alignment allows
// (jaxdata/hector/codegen/common.py `_dot_rows`): a lane that reads a row of its own edge
// (the edge softmax's scores) issues a quarter of the loads it did with one float at a time.
template <int D, int ALIGN_A, int ALIGN_B, typename A, typename B>
__device__ __forceinline__ float dot_rows(const A* a, const B* b) {
  constexpr int VA = vector_width<A>(D, ALIGN_A), VB = vector_width<B>(D, ALIGN_B);
  constexpr int V = VA < VB ? VA : VB;
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < D; i += V) {
    float x[V], y[V];
    ldv<V>(a + i, x);
    ldv<V>(b + i, y);
#pragma unroll
    for (int j = 0; j < V; ++j) s += x[j] * y[j];
  }
  return s;
}

// The relation of row tile `tile` of a GEMM: the last r with tiles[r] <= tile (thread 0
// searches, the block shares the answer).
__device__ __forceinline__ int64_t find_relation(const int32_t* tiles, int64_t R, int64_t tile) {
  __shared__ int64_t s_r;
  if (threadIdx.x == 0) {
    int64_t lo = 0, hi = R;
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (tiles[mid] <= tile) lo = mid; else hi = mid;
    }
    s_r = lo;
  }
  __syncthreads();
  return s_r;
}

// One step of a tiled GEMM: each thread adds A[kk][ty*4 + i] * B[kk][tx*TN + j] into its
// 4 x TN outputs, for kk < BK (A and B are tiles in shared memory).
template <int BK, int TN, int LDA, int LDB>
__device__ __forceinline__ void micro_fma(float (&acc)[4][TN], float (*A)[LDA], float (*B)[LDB],
                                          int ty, int tx) {
#pragma unroll
  for (int kk = 0; kk < BK; ++kk) {
    float a[4], b[TN];
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = A[kk][ty * 4 + i];
#pragma unroll
    for (int j = 0; j < TN; ++j) b[j] = B[kk][tx * TN + j];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j) acc[i][j] += a[i] * b[j];
  }
}


// A GEMM tile's scatter (`gemm_simt`, `gemm_mma`): its BM rows by BN columns, value(row, col),
// added to out[target(row) * WIDTH + n0 + col] for the columns n0 + col < N (a row without a
// target has target -1 and adds nothing). Each of the THREADS threads walks BM / (THREADS / BN)
// rows of one column, summing while the target stays the same: one atomic per run of equal
// targets (the tile's rows are sorted by target within their relation: a hub's are adjacent).
template <int BM, int BN, int THREADS, int N, int WIDTH, typename Target, typename Value>
JAXDATA_INLINE void scatter_tile(float* out, int n0, Target target, Value value) {
  constexpr int PER = BM / (THREADS / BN);
  const int col = threadIdx.x % BN, seg = threadIdx.x / BN;
  if (n0 + col >= N) return;
  int64_t run = -1;
  float sum = 0.0f;
  for (int row = seg * PER; row < (seg + 1) * PER; ++row) {
    const int64_t t = target(row);
    if (t != run) {
      if (run >= 0) atomicAdd(out + run * WIDTH + n0 + col, sum);
      run = t;
      sum = 0.0f;
    }
    sum += value(row, col);
  }
  if (run >= 0) atomicAdd(out + run * WIDTH + n0 + col, sum);
}

// A stored GEMM's block past the relations' tiles (`gemm_simt`, `gemm_mma`): rows from
// rel_offsets[R] on hold no relation (a block's unused (source, relation) pairs) and no tile
// covers them, so the blocks past tiles[R] write their zeros, BM rows each, in the block's
// head (`hn`) and columns n0 + col < N. The launch's tile bound, ceil(E / BM) + R, covers
// tiles[R] plus those rows.
template <int BM, int BN, int THREADS, int N, int WIDTH, typename O>
JAXDATA_INLINE void zero_tail(O* out, const int32_t* tiles, const int32_t* rel_offsets, int64_t R,
                              int64_t E, int64_t tile, int hn, int n0) {
  const int64_t e0 = (int64_t)rel_offsets[R] + (tile - tiles[R]) * BM;
  for (int idx = threadIdx.x; idx < BM * BN; idx += THREADS) {
    const int64_t e = e0 + idx / BN;
    const int n = n0 + idx % BN;
    if (e >= 0 && e < E && n < N) stf(out + e * WIDTH + hn + n, 0.0f);
  }
}

// A thread's 4 x TN accumulators added (one atomic each) into a K x N float matrix at `o`:
// acc[i][j] to (k0 + i, n0 + j), skipped outside K x N.
template <int TN, int K, int N>
JAXDATA_INLINE void atomic_add_tile(float* o, const float (&acc)[4][TN], int k0, int n0) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int k = k0 + i;
    if (k >= K) continue;
#pragma unroll
    for (int j = 0; j < TN; ++j) {
      const int n = n0 + j;
      if (n < N) atomicAdd(o + k * N + n, acc[i][j]);
    }
  }
}

// head h's offset in a row of HEADS heads of W features (0 for one head)
template <int HEADS, int W>
JAXDATA_INLINE int head_offset(int h) { return HEADS > 1 ? h * W : 0; }
