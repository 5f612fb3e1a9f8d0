// jaxdata.hector: the fixed start of every generated CPU kernel. The generator appends
// common.h, then the kernel: its signature, the operand pointers (jaxdata/hector/operands.py)
// and the instance's loops.
//
// It includes no system header: parsing <math.h>, <cstdint>, <cstring> and <algorithm> was most
// of a small kernel's compile (g++ 12: 0.2 of 0.25 CPU-s), and a kernel needs only these names.
typedef __INT32_TYPE__ int32_t;
typedef __INT64_TYPE__ int64_t;
typedef __UINT32_TYPE__ uint32_t;
extern "C" {
float expf(float);  // the C library's, which the compiler knows as builtins
float tanhf(float);
float fmaxf(float, float);
}
// std::min and std::max, as <algorithm> defines them
template <class T> static inline T min_of(T a, T b) { return b < a ? b : a; }
template <class T> static inline T max_of(T a, T b) { return a < b ? b : a; }

// The runtime a kernel gets from xla_ffi/hector/launch_cpu.cc (declared there in kernels.h).
extern "C" {
struct jaxdata_cpu_runtime { int64_t abi_version; void* pool;
  void (*parallel_for)(void*, int64_t, int64_t, void (*)(void*, int64_t, int64_t), void*); };
}
#define JAXDATA_CPU_ABI_VERSION 1
#define JAXDATA_INLINE static inline

static inline float ldf(const float* p) { return *p; }
static inline float ldf(const unsigned short* p) {
  uint32_t bits = uint32_t(*p) << 16; float f; __builtin_memcpy(&f, &bits, 4); return f; }

// v stored at p: a float as it is, a bfloat16 rounded to the nearest even (as XLA's convert)
static inline void stf(float* p, float v) { *p = v; }
static inline void stf(unsigned short* p, float v) {
  uint32_t u; __builtin_memcpy(&u, &v, 4);  // a NaN keeps its sign and stays a (quiet) NaN
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

