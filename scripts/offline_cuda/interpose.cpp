// Loaded with LD_PRELOAD by scripts/inductor_offline.py: answers the CUDA device queries that torch makes while
// it traces and compiles a model with fake CUDA tensors, as one H200 would, on a machine without a GPU. Nothing
// here runs a kernel or allocates device memory; a call that would (a real CUDA tensor) still fails as before.
//
// Two kinds of definitions take the place of the libraries' own through symbol interposition:
//   * c10_cuda's device and stream queries (device count, current device and stream, primary context);
//   * the CUDA runtime's device selection and count, and at::cuda::getDeviceProperties (an H200's properties).
// c10::cuda::CUDAStream is a trivially copyable {device type, device index, stream id}, passed in registers.
#include <cstdint>
#include <cstring>

#include <cuda_runtime_api.h>

namespace c10 {
namespace cuda {
int8_t device_count() noexcept { return 1; }
bool hasPrimaryContext(int8_t) { return false; }
int8_t current_device() { return 0; }
void set_device(int8_t, bool) {}
int SetDevice(int8_t, bool) { return 0; }
int MaybeSetDevice(int8_t) { return 0; }
int8_t ExchangeDevice(int8_t) { return 0; }
int8_t MaybeExchangeDevice(int8_t) { return 0; }
int GetDevice(int8_t* device) {
  *device = 0;
  return 0;
}
}  // namespace cuda
}  // namespace c10

namespace {
struct Stream {
  int8_t type;  // c10::DeviceType::CUDA
  int8_t index;
  int64_t id;   // 0: the default stream
};

cudaDeviceProp* h200() {
  static cudaDeviceProp props = [] {
    cudaDeviceProp p;
    std::memset(&p, 0, sizeof(p));
    std::strcpy(p.name, "NVIDIA H200");
    p.major = 9;
    p.minor = 0;
    p.multiProcessorCount = 132;
    p.warpSize = 32;
    p.totalGlobalMem = size_t(141) << 30;
    p.sharedMemPerBlock = 48 * 1024;
    p.sharedMemPerBlockOptin = 227 * 1024;
    p.sharedMemPerMultiprocessor = 228 * 1024;
    p.regsPerBlock = 65536;
    p.regsPerMultiprocessor = 65536;
    p.maxThreadsPerBlock = 1024;
    p.maxThreadsPerMultiProcessor = 2048;
    p.maxBlocksPerMultiProcessor = 32;
    p.maxThreadsDim[0] = 1024;
    p.maxThreadsDim[1] = 1024;
    p.maxThreadsDim[2] = 64;
    p.maxGridSize[0] = 2147483647;
    p.maxGridSize[1] = 65535;
    p.maxGridSize[2] = 65535;
    p.l2CacheSize = 60 << 20;
    p.memoryBusWidth = 6144;
    return p;
  }();
  return &props;
}
}  // namespace

extern "C" {
Stream gspn2_current_stream(int8_t) __asm__("_ZN3c104cuda20getCurrentCUDAStreamEa");
Stream gspn2_current_stream(int8_t) { return Stream{1, 0, 0}; }
Stream gspn2_default_stream(int8_t) __asm__("_ZN3c104cuda20getDefaultCUDAStreamEa");
Stream gspn2_default_stream(int8_t) { return Stream{1, 0, 0}; }
void gspn2_set_current_stream(Stream) __asm__("_ZN3c104cuda20setCurrentCUDAStreamENS0_10CUDAStreamE");
void gspn2_set_current_stream(Stream) {}
cudaDeviceProp* gspn2_device_properties(int8_t) __asm__("_ZN2at4cuda19getDevicePropertiesEa");
cudaDeviceProp* gspn2_device_properties(int8_t) { return h200(); }
cudaDeviceProp* gspn2_current_device_properties() __asm__("_ZN2at4cuda26getCurrentDevicePropertiesEv");
cudaDeviceProp* gspn2_current_device_properties() { return h200(); }

cudaError_t cudaSetDevice(int) { return cudaSuccess; }
cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest) {
  *least = 0;
  *greatest = -5;
  return cudaSuccess;
}
}
