// jaxdata.hector: the fixed start of every generated CPU kernel. The generator appends
// common.h, then the kernel: its signature, the operand pointers (jaxdata/hector/operands.py)
// and the instance's loops.
#include <math.h>
#include <cstdint>
#include <cstring>
#include <algorithm>

// The runtime a kernel gets from xla_ffi/hector/launch_cpu.cc (declared there in kernels.h).
extern "C" {
struct jaxdata_cpu_runtime { int64_t abi_version; void* pool;
  void (*parallel_for)(void*, int64_t, int64_t, void (*)(void*, int64_t, int64_t), void*); };
}
#define JAXDATA_CPU_ABI_VERSION 1
#define JAXDATA_INLINE static inline

static inline float ldf(const float* p) { return *p; }
static inline float ldf(const unsigned short* p) {
  uint32_t bits = uint32_t(*p) << 16; float f; std::memcpy(&f, &bits, 4); return f; }

// v stored at p: a float as it is, a bfloat16 rounded to the nearest even (as XLA's convert)
static inline void stf(float* p, float v) { *p = v; }
static inline void stf(unsigned short* p, float v) {
  uint32_t u; std::memcpy(&u, &v, 4);  // a NaN keeps its sign and stays a (quiet) NaN
  *p = (unsigned short)(((u & 0x7fffffffu) > 0x7f800000u ? u | 0x400000u
                                                         : u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// The sum over i < D of a[i] * b[i], in order (ALIGN_A, ALIGN_B: see templates/cuda.cuh)
template <int D, int ALIGN_A, int ALIGN_B, typename A, typename B>
static inline float dot_rows(const A* a, const B* b) {
  float s = 0.0f;
  for (int i = 0; i < D; ++i) s += ldf(a + i) * ldf(b + i);
  return s;
}

// f(begin, end) over chunks of [0, n) of about `grain`, on XLA's thread pool and the caller
template <class F> static void parallel_for(const jaxdata_cpu_runtime* rt, int64_t n,
                                            int64_t grain, F f) {
  rt->parallel_for(rt->pool, n, grain, [](void* a, int64_t b, int64_t e) {
    (*static_cast<F*>(a))(b, e); }, &f);
}

