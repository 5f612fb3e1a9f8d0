// jaxdata.hector: helpers every generated kernel uses, CPU and CUDA alike (the prelude before
// this file defines JAXDATA_INLINE and ldf(p), a float load of a float or bfloat16 element).

// x clamped to [lo, hi]: offsets read from the graph never index outside their arrays
JAXDATA_INLINE int64_t span(int64_t x, int64_t lo, int64_t hi) {
  return x < lo ? lo : x > hi ? hi : x; }
JAXDATA_INLINE float leaky_relu(float x, float s) { return x > 0.0f ? x : s * x; }
JAXDATA_INLINE float leaky_relu_grad(float x, float g, float s) { return x > 0.0f ? g : s * g; }

// Whether row e of a kernel's domain may be used: out-of-range ids cannot be told apart from
// real ones before the kernel runs (they may be computed under jit), so a row whose src, dst or
// etype is out of range contributes nothing (docs/hector.md, "ids out of range"). On the pairs
// src/dst are the pair's source and etype its relation; on the edges, the edge's pair must be
// in range too (the overload that takes pair and P).
JAXDATA_INLINE bool row_ok(int64_t e, int64_t E, int64_t N, int64_t R, const int32_t* src,
                           const int32_t* dst, const int32_t* etype) {
  typedef unsigned long long u64;
  return (u64)e < (u64)E && (u64)src[e] < (u64)N && (u64)dst[e] < (u64)N &&
         (u64)etype[e] < (u64)R;
}
JAXDATA_INLINE bool row_ok(int64_t e, int64_t E, int64_t N, int64_t R, const int32_t* src,
                           const int32_t* dst, const int32_t* etype, const int32_t* pair,
                           int64_t P) {
  typedef unsigned long long u64;
  return row_ok(e, E, N, R, src, dst, etype) && (u64)pair[e] < (u64)P;
}
