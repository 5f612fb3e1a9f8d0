// Probe: does mapping pinned host memory into the GPU with large pages speed up zero-copy
// gathers of random rows from a big table? (Foundation issue: 512-byte rows from a 16 GiB table
// reach ~70% of memcpy, which gather_notes.md puts down to one GPU address-translation miss per
// row.) Compares, for the same kernel and indices:
//   hostalloc  cudaHostAlloc(Portable | Mapped), the allocation HostBuffer uses today;
//   vmm        cuMemCreate on CU_MEM_LOCATION_TYPE_HOST_NUMA, mapped with cuMemMap at the
//              allocation granularity the driver reports (printed), read/write from the device.
// Build and run on the GPU machine:
//   nvcc -O3 -arch=sm_90 -o /tmp/probe probe_host_pages.cu -lcuda && /tmp/probe 16 512
// (table GiB, row bytes). Prints GB/s of gathered rows, unsorted and sorted indices, and of a
// plain cudaMemcpy from pinned memory for scale.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#define CK(x)                                                                   \
  do {                                                                          \
    cudaError_t e = (x);                                                        \
    if (e != cudaSuccess) {                                                     \
      std::printf("%s failed: %s\n", #x, cudaGetErrorString(e));                \
      std::exit(1);                                                             \
    }                                                                           \
  } while (0)
#define CU(x)                                                                   \
  do {                                                                          \
    CUresult r = (x);                                                           \
    if (r != CUDA_SUCCESS) {                                                    \
      const char* s = nullptr;                                                  \
      cuGetErrorString(r, &s);                                                  \
      std::printf("%s failed: %s\n", #x, s ? s : "?");                          \
      return nullptr;                                                           \
    }                                                                           \
  } while (0)

// One warp per row, 16-byte loads.
__global__ void gather(const int4* __restrict__ table, const long long* __restrict__ idx,
                       int4* __restrict__ out, long long n, int vecs) {
  const long long warp = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
  for (long long i = warp; i < n; i += warps) {
    const int4* src = table + idx[i] * vecs;
    for (int v = lane; v < vecs; v += 32) out[i * vecs + v] = src[v];
  }
}

static char* vmm_host(size_t bytes, size_t* granularity) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
  prop.location.id = 0;
  size_t g = 0;
  CU(cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  *granularity = g;
  bytes = (bytes + g - 1) / g * g;
  CUmemGenericAllocationHandle h;
  CU(cuMemCreate(&h, bytes, &prop, 0));
  CUdeviceptr p = 0;
  CU(cuMemAddressReserve(&p, bytes, g, 0, 0));
  CU(cuMemMap(p, bytes, 0, h, 0));
  CUmemAccessDesc access[2] = {};
  access[0].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access[0].location.id = 0;
  access[0].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  access[1].location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
  access[1].location.id = 0;
  access[1].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (cuMemSetAccess(p, bytes, access, 2) != CUDA_SUCCESS) {
    std::printf("vmm: host access refused, device access only\n");
    CU(cuMemSetAccess(p, bytes, access, 1));
  }
  return reinterpret_cast<char*>(p);
}

static double time_gather(const char* table, const long long* idx, int4* out, long long n,
                          int row) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  const int threads = 256, blocks = 132 * 16;
  gather<<<blocks, threads>>>((const int4*)table, idx, out, n, row / 16);  // warm-up
  CK(cudaDeviceSynchronize());
  float best = 1e30f;
  for (int rep = 0; rep < 5; ++rep) {
    CK(cudaEventRecord(a));
    gather<<<blocks, threads>>>((const int4*)table, idx, out, n, row / 16);
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    best = std::min(best, ms);
  }
  return double(n) * row / (best * 1e-3) / 1e9;
}

int main(int argc, char** argv) {
  const size_t gib = argc > 1 ? std::atoll(argv[1]) : 16;
  const int row = argc > 2 ? std::atoi(argv[2]) : 512;
  const size_t bytes = gib << 30, rows = bytes / row;
  const long long n = (256ll << 20) / row;  // 256 MiB of rows per gather
  CK(cudaSetDevice(0));
  CK(cudaFree(0));

  char* ha = nullptr;
  CK(cudaHostAlloc((void**)&ha, bytes, cudaHostAllocPortable | cudaHostAllocMapped));
  char* hd = nullptr;
  CK(cudaHostGetDevicePointer((void**)&hd, ha, 0));
  CK(cudaMemset(hd, 1, bytes));
  size_t g = 0;
  char* vm = vmm_host(bytes, &g);
  std::printf("table %zu GiB, rows of %d B, %lld rows gathered; vmm granularity %zu KiB\n", gib,
              row, n, g >> 10);
  if (vm) CK(cudaMemset(vm, 1, bytes));

  std::vector<long long> idx(n);
  std::mt19937_64 rng(0);
  std::uniform_int_distribution<long long> pick(0, (long long)rows - 1);
  for (auto& i : idx) i = pick(rng);
  long long* didx;
  int4* out;
  CK(cudaMalloc(&didx, n * sizeof(long long)));
  CK(cudaMalloc(&out, size_t(n) * row));
  for (int sorted = 0; sorted < 2; ++sorted) {
    if (sorted) std::sort(idx.begin(), idx.end());
    CK(cudaMemcpy(didx, idx.data(), n * sizeof(long long), cudaMemcpyHostToDevice));
    std::printf("%s indices: hostalloc %.1f GB/s", sorted ? "sorted  " : "unsorted",
                time_gather(hd, didx, out, n, row));
    if (vm) std::printf(", vmm %.1f GB/s", time_gather(vm, didx, out, n, row));
    std::printf("\n");
  }
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  CK(cudaEventRecord(a));
  CK(cudaMemcpyAsync(out, ha, size_t(n) * row, cudaMemcpyHostToDevice));
  CK(cudaEventRecord(b));
  CK(cudaEventSynchronize(b));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, a, b));
  std::printf("cudaMemcpy of the same bytes from pinned memory: %.1f GB/s\n",
              double(n) * row / (ms * 1e-3) / 1e9);
  return 0;
}
