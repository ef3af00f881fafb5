// Helpers shared by the depthwise convolution kernels (dwconv_tile.cu, dwconv_mma.cu): asynchronous copies,
// the double-buffered loop over a CTA's tiles, and the host's launch bookkeeping.
#pragma once

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include <cuda_runtime.h>

namespace gspn2 {
namespace {

// The CUDA error of the last launch, or an empty string.
std::string last_launch_error() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? std::string() : std::string("CUDA error: ") + cudaGetErrorString(err);
}

// 16-byte global-to-shared copies that skip registers (cp.async, sm_80 on; zeros where !valid), completed by
// cp_async_commit + cp_async_wait<N> (at most N of this thread's committed groups still in flight). Before
// sm_80: a plain copy through registers, complete at once.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  *reinterpret_cast<uint4*>(dst) = valid ? *reinterpret_cast<const uint4*>(src) : make_uint4(0, 0, 0, 0);
#else
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 16 : 0) : "memory");
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// Runs a CTA's tiles first, first + step, ... (below end) with two staging buffers: stage(t, buffer) starts
// the copies of tile t; compute(t, buffer) runs once they are complete. The copies of the next tile are in
// flight while the current one is computed.
template <typename Stage, typename Compute>
__device__ __forceinline__ void pipeline_tiles(int first, int end, int step, Stage&& stage, Compute&& compute) {
  if (first >= end) return;
  stage(first, 0);
  cp_async_commit();
  int buf = 0;
  for (int t = first; t < end; t += step, buf ^= 1) {
    if (t + step < end) {
      stage(t + step, buf ^ 1);  // that buffer's last reads (two tiles back) ended at the barrier below
      cp_async_commit();
      cp_async_wait<1>();        // tile t's copies are done, the next tile's may still run
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // every thread's copies (and element stores) of tile t are visible
    compute(t, buf);
    __syncthreads();  // tile t's buffer is free for the tile after next
  }
}

// Opts `kernel` in to `bytes` of dynamic shared memory where that is over the default 48 KB. One flag per
// kernel instantiation (the tag types), so each is raised once per size it grows to.
template <typename Tag, typename Kernel>
void allow_smem(Kernel kernel, int bytes) {
  static std::atomic<int> allowed{48 * 1024};
  if (bytes <= allowed.load()) return;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  allowed.store(bytes);
}
// How many CTAs of `kernel` (`threads` threads, `smem` bytes of dynamic shared memory, already allowed) the
// current GPU holds at once; asked once per (kernel, block size, shared memory, device).
template <typename Tag, typename Kernel>
int resident_ctas(Kernel kernel, int threads, int smem) {
  static std::mutex mutex;
  static std::map<std::tuple<int, int, int>, int> known;
  int dev = 0;
  cudaGetDevice(&dev);
  const auto key = std::make_tuple(dev, threads, smem);
  std::lock_guard<std::mutex> lock(mutex);
  const auto it = known.find(key);
  if (it != known.end()) return it->second;
  int per_sm = 0, sms = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const int n = std::max(1, per_sm) * std::max(1, sms);
  known.emplace(key, n);
  return n;
}

}  // namespace
}  // namespace gspn2
