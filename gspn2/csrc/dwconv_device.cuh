// Device helpers shared by the depthwise convolution kernels (dwconv_kernel.cu: the row kernels,
// dwconv_tile.cu: the shared-memory tile kernels): dtype conversions and 16-byte vector loads and stores.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

namespace gspn2 {
namespace {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

template <typename T, int V>
__device__ __forceinline__ void load_vec(const T* __restrict__ p, float (&out)[V]) {
  const Pack<T, V> pk = *reinterpret_cast<const Pack<T, V>*>(p);
#pragma unroll
  for (int v = 0; v < V; ++v) out[v] = to_float(pk.v[v]);
}

template <typename T, int V>
__device__ __forceinline__ void store_vec(T* __restrict__ p, const float (&in)[V]) {
  Pack<T, V> pk;
#pragma unroll
  for (int v = 0; v < V; ++v) pk.v[v] = from_float<T>(in[v]);
  *reinterpret_cast<Pack<T, V>*>(p) = pk;
}

template <int V>
__device__ __forceinline__ void zero_vec(float (&out)[V]) {
#pragma unroll
  for (int v = 0; v < V; ++v) out[v] = 0.f;
}

// The CUDA error of the last launch, or an empty string.
inline std::string last_launch_error() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? std::string() : std::string("CUDA error: ") + cudaGetErrorString(err);
}

}  // namespace
}  // namespace gspn2
