// Hopper's tensor memory accelerator (TMA) and transaction-counting mbarriers, shared by the cluster
// kernels (propagate_cluster.cu) and the depthwise tile kernels (dwconv_tile.cu). The device helpers exist
// for sm_90 and later; callers guard their use with __CUDA_ARCH__ >= 900. No torch headers: the host helper
// returns the driver's encoder (or null) and each caller reports its own error.
#pragma once

#include <cstdint>

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include "propagate.h"  // ScalarType

namespace gspn2 {
namespace tma {

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}
// An mbarrier that completes once `count` threads arrived and every expected byte landed.
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
// Makes the initialised mbarriers visible to the async proxy (and the CTA's cluster).
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// This thread's arrival, expecting `bytes` more from TMA copies that complete on `bar`.
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
// Waits until the phase of parity `parity` of `bar` has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred P;\n WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 P, [%0], %1;\n"
      " @!P bra WAIT_%=;\n}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}
// The address of `ptr` (this CTA's shared memory) in the shared memory of CTA `rank` of the cluster.
__device__ __forceinline__ uint32_t cluster_addr(const void* ptr, int rank) {
  uint32_t a;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(a) : "r"(smem_u32(ptr)), "r"(rank));
  return a;
}
// Stores `v` at `addr` in another CTA's shared memory (cluster_addr) and counts its 4 bytes on that CTA's
// mbarrier `bar` (cluster_addr too): no fence; the receiver's mbar_wait orders its reads after the store, as
// for a TMA copy. (A cluster-scope acquire there would also invalidate the SM's L1 cache at every exchange:
// these values are in shared memory, which needs none of that.)
__device__ __forceinline__ void st_async(uint32_t addr, float v, uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];\n" ::"r"(addr),
               "r"(__float_as_uint(v)), "r"(bar)
               : "memory");
}
// Orders this thread's earlier generic-proxy shared-memory accesses before its later async-proxy ones (a
// TMA copy into a buffer that the CTA has just read).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// A box of a 3-D / 4-D tensor map at the given coordinates (innermost first; boxes may reach outside the
// tensor, whose elements arrive as zeros) into shared memory, completing on `bar`.
__device__ __forceinline__ void load_3d(void* dst, const CUtensorMap* map, int c0, int c1, int c2, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(
          smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(smem_u32(bar))
      : "memory");
}
__device__ __forceinline__ void load_4d(void* dst, const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                        uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_u32(bar))
      : "memory");
}
// A shared-memory box to a 3-D tensor map (committed with cp.async.bulk.commit_group).
__device__ __forceinline__ void store_3d(const CUtensorMap* map, int c0, int c1, int c2, const void* src) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1), "r"(c2), "r"(smem_u32(src))
               : "memory");
}
#endif

// The driver's cuTensorMapEncodeTiled, or null where the driver has none. The driver call needs a current
// context on the calling thread: call bind_context() first (autograd's device threads may have none yet).
inline PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult res{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &res) !=
            cudaSuccess ||
        res != cudaDriverEntryPointSuccess) {
      cudaGetLastError();  // clear the runtime's error state
      return PFN_cuTensorMapEncodeTiled_v12000(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

// The tensor-map element type of a float32, float16 or bfloat16 tensor.
inline CUtensorMapDataType data_type(ScalarType dtype) {
  return dtype == ScalarType::Float  ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
         : dtype == ScalarType::Half ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                     : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
}

// Binds the current device's primary context to the calling thread (cuTensorMapEncodeTiled returns
// CUDA_ERROR_INVALID_CONTEXT on a thread where no runtime call has bound one).
inline cudaError_t bind_context() {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  return err == cudaSuccess ? cudaSetDevice(dev) : err;
}

}  // namespace tma
}  // namespace gspn2
