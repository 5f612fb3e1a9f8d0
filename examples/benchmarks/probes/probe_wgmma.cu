// mma.sync against Hopper wgmma on hector's RGCN forward GEMM at dim 128, bfloat16 (issue 19:
// "with mma.sync or Hopper wgmma: measure which"). A standalone probe, not jaxdata's kernel:
// both variants share everything but the MMA, so the difference is the instruction's.
//
// out[dst[e]] += norm[e] * x[src[e]] @ W[etype[e]] over edges sorted by relation, one block of
// 128 threads (one warpgroup) per tile of 64 edges of one relation: the tile's 64 gathered rows
// (A, 64x128) and the relation's weight (B, 128x128, stored transposed so both are K-major) go
// to shared memory by cp.async in the no-swizzle core-matrix layout (8 rows x 16 bytes per core
// matrix, K-adjacent core matrices 128 bytes apart, 8-row groups 2048 bytes apart), then
//   mma:   each warp its 16 rows: per k16 step 1 ldmatrix.x4 of A, 8 of B, 16 mma.m16n8k16
//   wgmma: per k16 step one wgmma.mma_async.m64n128k16 from two shared-memory descriptors
//   none:  no MMA (the accumulators take one shared-memory value): the gather and the scatter
// and the same epilogue: scale by norm[e], atomicAdd into out. Accumulator layouts are the same
// per n8 tile (row 16*warp + lane/4 (+8), column 8j + 2*(lane%4) (+1)).
//
// Build and run (H200): nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a \
//                         -o /tmp/probe_wgmma probe_wgmma.cu
//                       /tmp/probe_wgmma [edges nodes relations]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#define CHECK(x)                                                                   \
  do {                                                                             \
    cudaError_t err_ = (x);                                                        \
    if (err_ != cudaSuccess) {                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x,               \
                   cudaGetErrorString(err_));                                      \
      std::exit(1);                                                                \
    }                                                                              \
  } while (0)

constexpr int D = 128, ROWS = 64, THREADS = 128;
constexpr int A_BYTES = ROWS * D * 2, B_BYTES = D * D * 2;
enum Variant { kNone = 0, kMma = 1, kWgmma = 2 };

// byte offset of 16-byte chunk `c` (k = 8c..8c+7) of row `r` in the core-matrix layout
__device__ __forceinline__ uint32_t core_offset(int r, int c) {
  return (((r >> 3) * (D / 8) + c) * 8 + (r & 7)) * 16;
}

__device__ __forceinline__ void cp_async16(uint32_t smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem),
               "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                        uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

__device__ __forceinline__ void mma16816(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// a shared-memory matrix descriptor, no swizzle: start address, leading (K-direction) and
// stride (8-row-group) byte offsets, each in 16-byte units
__device__ __forceinline__ uint64_t descriptor(uint32_t smem, uint32_t lbo, uint32_t sbo) {
  return uint64_t((smem & 0x3FFFF) >> 4) | (uint64_t((lbo & 0x3FFFF) >> 4) << 16) |
         (uint64_t((sbo & 0x3FFFF) >> 4) << 32);
}

__device__ __forceinline__ void wgmma_m64n128k16(float* d, uint64_t a, uint64_t b, int accumulate) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(a), "l"(b), "r"(accumulate));
#else
  __trap();
#endif
}

template <int V>
__global__ void __launch_bounds__(THREADS) gemm(const __nv_bfloat16* __restrict__ x,
                                                const __nv_bfloat16* __restrict__ wt,
                                                const int* __restrict__ src,
                                                const int* __restrict__ dst,
                                                const float* __restrict__ norm,
                                                const int* __restrict__ tile_rel,
                                                const int* __restrict__ tile_begin,
                                                const int* __restrict__ tile_end, float* out,
                                                uint32_t lbo, uint32_t sbo) {
  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t a_s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t b_s = a_s + A_BYTES;
  const int tile = blockIdx.x, t = threadIdx.x, warp = t / 32, lane = t % 32;
  const int rel = tile_rel[tile], begin = tile_begin[tile], end = tile_end[tile];
  for (int i = t; i < ROWS * (D / 8); i += THREADS) {  // A: the tile's gathered rows
    const int r = i / (D / 8), c = i % (D / 8);
    const bool valid = begin + r < end;
    const int row = valid ? src[begin + r] : 0;
    cp_async16(a_s + core_offset(r, c), x + size_t(row) * D + c * 8, valid);
  }
  const __nv_bfloat16* w = wt + size_t(rel) * D * D;  // B: W[rel] transposed, [n][k]
  for (int i = t; i < D * (D / 8); i += THREADS) {
    cp_async16(b_s + core_offset(i / (D / 8), i % (D / 8)), w + i * 8, true);
  }
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
  if (V == kWgmma) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();

  float d[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) d[i] = 0.f;
  if (V == kNone) {
    const float v = __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(smem)[t]);
#pragma unroll
    for (int i = 0; i < 64; ++i) d[i] = v;
  } else if (V == kMma) {
    const int mat = lane / 8, r8 = lane % 8;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t a[4];
      ldsm_x4(a_s + core_offset(16 * warp + 8 * (mat & 1) + r8, 2 * ks + (mat >> 1)), a[0], a[1],
              a[2], a[3]);
#pragma unroll
      for (int j = 0; j < D / 8; j += 2) {
        uint32_t b[4];
        ldsm_x4(b_s + core_offset(8 * (j + (mat >> 1)) + r8, 2 * ks + (mat & 1)), b[0], b[1], b[2],
                b[3]);
        mma16816(d + 4 * j, a, b[0], b[1]);
        mma16816(d + 4 * (j + 1), a, b[2], b[3]);
      }
    }
  } else {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {  // a k16 step is 2 K-adjacent core matrices: 256 bytes
      wgmma_m64n128k16(d, descriptor(a_s + ks * 256, lbo, sbo), descriptor(b_s + ks * 256, lbo, sbo),
                       ks > 0);
    }
    asm volatile("wgmma.commit_group.sync.aligned;\nwgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  }
  // epilogue: row 16*warp + lane/4 (+8), column 8j + 2*(lane%4) (+1)
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int e = begin + 16 * warp + lane / 4 + 8 * half;
    if (e >= end) continue;
    float* o = out + size_t(dst[e]) * D + 2 * (lane % 4);
    const float s = norm[e];
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      atomicAdd(o + 8 * j, s * d[4 * j + 2 * half]);
      atomicAdd(o + 8 * j + 1, s * d[4 * j + 2 * half + 1]);
    }
  }
}

int main(int argc, char** argv) {
  const int E = argc > 1 ? std::atoi(argv[1]) : 2000000;
  const int N = argc > 2 ? std::atoi(argv[2]) : 200000;
  const int R = argc > 3 ? std::atoi(argv[3]) : 500;
  std::mt19937_64 rng(0);
  std::vector<int> src(E), dst(E), rel(E);
  std::uniform_int_distribution<int> node(0, N - 1);
  std::exponential_distribution<double> popularity(1.0);  // relation sizes: skewed
  std::vector<double> weight(R);
  for (auto& v : weight) v = std::pow(popularity(rng), 3);
  std::discrete_distribution<int> relation(weight.begin(), weight.end());
  for (int e = 0; e < E; ++e) src[e] = node(rng), dst[e] = node(rng), rel[e] = relation(rng);
  std::vector<int> order(E);
  for (int e = 0; e < E; ++e) order[e] = e;
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return rel[a] < rel[b]; });
  std::vector<int> s(E), dd(E), r(E), count(R, 0);
  for (int i = 0; i < E; ++i) s[i] = src[order[i]], dd[i] = dst[order[i]], r[i] = rel[order[i]];
  for (int i = 0; i < E; ++i) ++count[r[i]];
  std::vector<float> norm(E);
  for (int i = 0; i < E; ++i) norm[i] = 1.f / count[r[i]];
  std::vector<int> t_rel, t_begin, t_end;
  for (int i = 0; i < E;) {
    int j = i;
    while (j < E && r[j] == r[i] && j - i < ROWS) ++j;
    t_rel.push_back(r[i]), t_begin.push_back(i), t_end.push_back(j);
    i = j;
  }
  const int tiles = int(t_rel.size());
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<__nv_bfloat16> x(size_t(N) * D), wt(size_t(R) * D * D);
  for (auto& v : x) v = __float2bfloat16(normal(rng));
  for (auto& v : wt) v = __float2bfloat16(normal(rng) / 11.f);

  auto upload = [](const auto& v) {
    using T = typename std::decay_t<decltype(v)>::value_type;
    T* p;
    CHECK(cudaMalloc(&p, v.size() * sizeof(T)));
    CHECK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    return p;
  };
  auto *x_d = upload(x), *wt_d = upload(wt);
  auto *s_d = upload(s), *d_d = upload(dd), *tr_d = upload(t_rel), *tb_d = upload(t_begin),
       *te_d = upload(t_end);
  auto* n_d = upload(norm);
  float* out;
  CHECK(cudaMalloc(&out, size_t(N) * D * sizeof(float)));
  const int smem = A_BYTES + B_BYTES;
  CHECK(cudaFuncSetAttribute(gemm<kNone>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CHECK(cudaFuncSetAttribute(gemm<kMma>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CHECK(cudaFuncSetAttribute(gemm<kWgmma>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));

  // reference: output rows < CHECK_ROWS in double, from the same bfloat16 values
  const int CHECK_ROWS = 256;
  std::vector<double> ref(size_t(CHECK_ROWS) * D, 0.0);
  for (int e = 0; e < E; ++e) {
    if (dd[e] >= CHECK_ROWS) continue;
    const __nv_bfloat16* xr = &x[size_t(s[e]) * D];
    const __nv_bfloat16* w = &wt[size_t(r[e]) * D * D];
    for (int n = 0; n < D; ++n) {
      double acc = 0;
      for (int k = 0; k < D; ++k) acc += double(__bfloat162float(xr[k])) * __bfloat162float(w[n * D + k]);
      ref[size_t(dd[e]) * D + n] += norm[e] * acc;
    }
  }
  double ref_max = 0;
  for (double v : ref) ref_max = std::max(ref_max, std::abs(v));

  std::printf("edges %d, nodes %d, relations %d, tiles of %d rows: %d; dim %d, bfloat16 in, float32 "
              "accumulate\n", E, N, R, ROWS, tiles, D);
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  auto run = [&](int v, uint32_t lbo, uint32_t sbo, const char* name) {
    auto zero = [&] { CHECK(cudaMemsetAsync(out, 0, size_t(N) * D * sizeof(float))); };
    auto kernel = [&] {
      auto* k = v == kNone ? gemm<kNone> : v == kMma ? gemm<kMma> : gemm<kWgmma>;
      k<<<tiles, THREADS, smem>>>(x_d, wt_d, s_d, d_d, n_d, tr_d, tb_d, te_d, out, lbo, sbo);
      CHECK(cudaGetLastError());
    };
    std::vector<float> ms;
    for (int rep = -2; rep < 15; ++rep) {  // 2 warm-ups, then the median of 15
      zero();
      CHECK(cudaEventRecord(start));
      kernel();
      CHECK(cudaEventRecord(stop));
      CHECK(cudaEventSynchronize(stop));
      float t;
      CHECK(cudaEventElapsedTime(&t, start, stop));
      if (rep >= 0) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    zero();  // one run for the check
    kernel();
    CHECK(cudaDeviceSynchronize());
    std::vector<float> got(size_t(CHECK_ROWS) * D);
    CHECK(cudaMemcpy(got.data(), out, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
    double err = 0;
    for (size_t i = 0; i < got.size(); ++i) err = std::max(err, std::abs(got[i] - ref[i]));
    const double flops = 2.0 * E * D * D;
    std::printf("%-34s %8.1f us  (min %8.1f)  %6.1f TFLOP/s   max|err| / max|ref| = %.2e\n", name,
                1e3 * ms[ms.size() / 2], 1e3 * ms[0], flops / (1e-3 * ms[ms.size() / 2]) / 1e12,
                err / ref_max);
  };
  run(kNone, 0, 0, "no MMA (gather + scatter only)");
  run(kMma, 0, 0, "mma.sync m16n8k16 (ldmatrix)");
  run(kWgmma, 128, 2048, "wgmma m64n128k16 (LBO 128, SBO 2048)");
  run(kWgmma, 2048, 128, "wgmma m64n128k16 (LBO 2048, SBO 128)");
  return 0;
}
