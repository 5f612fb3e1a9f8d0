#include "hector/kernels.h"

#include <dlfcn.h>

#include <mutex>
#include <stdexcept>
#include <unordered_map>

#ifdef JAXDATA_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace jaxdata::hector {
namespace {

struct Registry {
  std::mutex mu;
  std::unordered_map<int64_t, jaxdata_cpu_kernel> cpu;
  std::unordered_map<int64_t, const void*> cuda;
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: kernels may run during exit
  return *r;
}

}  // namespace

void LoadCpuKernel(int64_t id, const std::string& path, const std::string& symbol) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.cpu.count(id)) return;
  // Libraries stay loaded for the life of the process: compiled executables may hold the id.
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) throw std::runtime_error("cannot load " + path + ": " + dlerror());
  void* fn = dlsym(lib, symbol.c_str());
  if (fn == nullptr) {
    // Unloaded again, so that a rebuilt library at the same path is really opened next time.
    dlclose(lib);
    throw std::runtime_error(path + " has no symbol " + symbol);
  }
  r.cpu[id] = reinterpret_cast<jaxdata_cpu_kernel>(fn);
}

jaxdata_cpu_kernel FindCpuKernel(int64_t id) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.cpu.find(id);
  return it == r.cpu.end() ? nullptr : it->second;
}

#ifdef JAXDATA_WITH_CUDA
void LoadCudaKernel(int64_t id, const std::string& image, const std::string& name) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.cuda.count(id)) return;
  // A context-independent library: its kernels launch on whichever device is current.
  cudaLibrary_t lib;
  cudaError_t err = cudaLibraryLoadData(&lib, image.data(), nullptr, nullptr, 0, nullptr, nullptr, 0);
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("cudaLibraryLoadData: ") + cudaGetErrorString(err));
  }
  cudaKernel_t kernel;
  err = cudaLibraryGetKernel(&kernel, lib, name.c_str());
  if (err != cudaSuccess) {
    cudaLibraryUnload(lib);
    throw std::runtime_error("kernel " + name + ": " + cudaGetErrorString(err));
  }
  r.cuda[id] = reinterpret_cast<const void*>(kernel);
}

const void* FindCudaKernel(int64_t id) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.cuda.find(id);
  return it == r.cuda.end() ? nullptr : it->second;
}

int CudaComputeCapability() {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  return major * 10 + minor;
}
#else
void LoadCudaKernel(int64_t, const std::string&, const std::string&) {
  throw std::runtime_error("jaxdata was built without CUDA");
}
const void* FindCudaKernel(int64_t) { return nullptr; }
int CudaComputeCapability() { return 0; }
LaunchCounts CudaLaunchCounts() { return {0, 0}; }
#endif

}  // namespace jaxdata::hector
