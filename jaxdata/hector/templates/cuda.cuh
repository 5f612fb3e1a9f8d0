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

__device__ __forceinline__ float ldf(const float* p) { return __ldg(p); }
__device__ __forceinline__ float ldf(const unsigned short* p) {
  return __uint_as_float(((unsigned)__ldg(p)) << 16); }

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
