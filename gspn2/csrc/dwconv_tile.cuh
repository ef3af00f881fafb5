// Depthwise convolution: device and host helpers that the tile kernels (dwconv_tile.cu) and the tensor-core
// kernels (dwconv_mma.cu) share: element conversions, the taps' staging, TMA staging and the double-buffered
// tile loop, and the launch-side queries (shared-memory opt-in, resident CTAs, TMA availability, tensor maps).
#pragma once

#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "dwconv.h"
#include "tma.cuh"

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

// The CUDA error of the last launch, or an empty string.
inline std::string last_launch_error() {
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

// Stages the KK taps of the CTA's kTileLanes channels from the (C, KK) float32 weight at s[lane * KK + tap]
// (coalesced reads along each channel's taps), flipped (tap KK - 1 - t) for the input gradient; zeros past
// channel C. KK is odd, so the lanes' reads s[lane * KK + t] hit distinct banks. Complete at the next
// __syncthreads.
template <int KK>
__device__ __forceinline__ void stage_taps(float* __restrict__ s, const float* __restrict__ weight, int c0, int C,
                                           bool flip) {
  const int warps = blockDim.x / kTileLanes;
  for (int cc = threadIdx.x / kTileLanes; cc < kTileLanes; cc += warps) {
    const float* src = weight + int64_t(c0 + cc) * KK;
    for (int tap = threadIdx.x % kTileLanes; tap < KK; tap += kTileLanes)
      s[cc * KK + (flip ? KK - 1 - tap : tap)] = c0 + cc < C ? src[tap] : 0.f;
  }
}

__device__ __forceinline__ float silu(float v) { return __fdividef(v, 1.f + __expf(-v)); }

// TMA staging (sm_90): thread 0 starts one tile's copies into a buffer, expecting `bytes` on the buffer's
// mbarrier (the fence orders the CTA's earlier reads of that buffer, ended at a barrier, before the copies),
// then one box per staged tensor: 32 channels from c0 by the box's columns and rows from (w0, h0) of image b.
__device__ __forceinline__ void tma_begin(uint64_t* bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  tma::fence_proxy_async();
  tma::mbar_expect_tx(bar, bytes);
#else
  __trap();  // the host asks for TMA only where the kernel was compiled for sm_90 or later
#endif
}
__device__ __forceinline__ void tma_box(void* dst, const CUtensorMap* map, int c0, int w0, int h0, int b,
                                        uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  tma::load_4d(dst, map, c0, w0, h0, b, bar);
#endif
}
// The two buffers' mbarriers (at the start of dynamic shared memory), set up by thread 0; visible to the CTA
// after its next __syncthreads.
__device__ __forceinline__ void tma_init(uint64_t* bars) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (threadIdx.x == 0) {
    tma::mbar_init(&bars[0], 1);
    tma::mbar_init(&bars[1], 1);
    tma::mbar_init_fence();
  }
#endif
}
__device__ __forceinline__ void tma_wait(uint64_t* bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  tma::mbar_wait(bar, parity);
#endif
}

// Runs a CTA's tiles first, first + step, ... (below end) with two staging buffers: stage(t, buffer) starts
// the copies of tile t; compute(t, buffer) runs once they are complete. The copies of the next tile are in
// flight while the current one is computed. `bars`: the buffers' mbarriers where TMA stages the tiles (the
// caller has initialised them and passed a __syncthreads since), or null for cp.async and element copies.
template <typename Stage, typename Compute>
__device__ __forceinline__ void pipeline_tiles(int first, int end, int step, uint64_t* bars, Stage&& stage,
                                               Compute&& compute) {
  if (first >= end) return;
  stage(first, 0);
  if (bars == nullptr) cp_async_commit();
  int buf = 0;
  uint32_t parity = 0;  // bit b: the parity of the phase of bars[b] to wait for next
  for (int t = first; t < end; t += step, buf ^= 1) {
    if (t + step < end) {
      stage(t + step, buf ^ 1);  // that buffer's last reads (two tiles back) ended at the barrier below
      if (bars == nullptr) {
        cp_async_commit();
        cp_async_wait<1>();  // tile t's copies are done, the next tile's may still run
      }
    } else if (bars == nullptr) {
      cp_async_wait<0>();
    }
    if (bars != nullptr) {
      tma_wait(&bars[buf], (parity >> buf) & 1u);  // tile t's boxes have landed
      parity ^= 1u << buf;
    } else {
      __syncthreads();  // every thread's copies (and element stores) of tile t are visible
    }
    compute(t, buf);
    __syncthreads();  // tile t's buffer is free for the tile after next
  }
}

// The weight-gradient kernels' grid: (channel block, chunk), channel blocks fastest, so that the CTAs of one
// chunk's channel blocks run together and read the same pixels at about the same time: a DRAM fetch of a
// pixel's channels then serves every channel block (with the chunk fastest, each channel block would fetch
// the pixels from DRAM again).
__device__ __forceinline__ int wgrad_channel_block() { return int(blockIdx.x); }
__device__ __forceinline__ int wgrad_chunk() { return int(blockIdx.y); }

// The weight-gradient kernels' split: chunk wgrad_chunk() takes tiles_per_chunk consecutive tiles (fewer in the
// last chunk), a split that fixes the summation order.
template <typename Stage, typename Compute>
__device__ __forceinline__ void pipeline_chunk(int tiles, int tiles_per_chunk, uint64_t* bars, Stage&& stage,
                                               Compute&& compute) {
  const int first = wgrad_chunk() * tiles_per_chunk;
  pipeline_tiles(first, min(first + tiles_per_chunk, tiles), 1, bars, stage, compute);
}

// The chunks' partial sums: grad_w (C, K*K) and grad_b (C,) from partial (chunks, K*K + 1, C). A CTA takes 32
// consecutive elements (lane = element, coalesced); warp w adds chunks w, w + kReduceWarps, ... in order, with
// several loads in flight, then warp 0 adds the warps' sums in warp order. The order depends on the chunk count
// only, so the result is the same on every GPU.
constexpr int kReduceWarps = 8;
__global__ void __launch_bounds__(kReduceWarps * 32) dwconv_tile_reduce_kernel(
    const float* __restrict__ partial, float* __restrict__ grad_w, float* __restrict__ grad_b, int chunks, int C,
    int KK) {
  __shared__ float sums[kReduceWarps][32];
  const int64_t n = int64_t(KK + 1) * C;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t e = int64_t(blockIdx.x) * 32 + lane;
  float sum = 0.f;
  if (e < n) {
#pragma unroll 8
    for (int k = warp; k < chunks; k += kReduceWarps) sum += partial[int64_t(k) * n + e];
  }
  sums[warp][lane] = sum;
  __syncthreads();
  if (warp != 0 || e >= n) return;
  float total = sums[0][lane];
#pragma unroll
  for (int w = 1; w < kReduceWarps; ++w) total += sums[w][lane];
  const int tap = int(e / C), c = int(e % C);
  if (tap < KK) {
    grad_w[int64_t(c) * KK + tap] = total;
  } else {
    grad_b[c] = total;
  }
}

inline void launch_chunk_reduce(const float* partial, float* grad_w, float* grad_b, int chunks, int C, int KK,
                                cudaStream_t stream) {
  const int64_t n = int64_t(KK + 1) * C;
  dwconv_tile_reduce_kernel<<<unsigned((n + 31) / 32), kReduceWarps * 32, 0, stream>>>(partial, grad_w, grad_b,
                                                                                      chunks, C, KK);
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

// Whether `kernel` stages its tiles by TMA on the current device: its code was compiled for sm_90 or later
// (the PTX version the driver picked for this device, asked once per kernel and device) and the driver
// encodes tensor maps.
template <typename Tag, typename Kernel>
bool kernel_has_tma(Kernel kernel) {
  static std::mutex mutex;
  static std::map<int, bool> known;
  int dev = 0;
  cudaGetDevice(&dev);
  std::lock_guard<std::mutex> lock(mutex);
  const auto it = known.find(dev);
  if (it != known.end()) return it->second;
  cudaFuncAttributes attr{};
  const bool ok = cudaFuncGetAttributes(&attr, kernel) == cudaSuccess && attr.ptxVersion >= 90 &&
                  tma::encoder() != nullptr;
  cudaGetLastError();  // a failed query leaves no error behind: the kernels then copy without TMA
  known.emplace(dev, ok);
  return ok;
}

// A (C, W, H, B) map of a channels-last tensor with boxes of box_channels channels x box_cols x box_rows
// pixels of one image; zeros outside. The calling thread has a current context. "" or the error.
inline std::string encode_tile_box(CUtensorMap* map, const void* ptr, ScalarType dtype, int B, int H, int W, int C,
                                   int box_cols, int box_rows, int box_channels = kTileLanes) {
  const cuuint64_t es = cuuint64_t(element_size(dtype));
  const cuuint64_t dims[4] = {cuuint64_t(C), cuuint64_t(W), cuuint64_t(H), cuuint64_t(B)};
  const cuuint64_t strides[3] = {C * es, cuuint64_t(W) * C * es, cuuint64_t(H) * W * C * es};
  const cuuint32_t box[4] = {cuuint32_t(box_channels), cuuint32_t(box_cols), cuuint32_t(box_rows), 1};
  const cuuint32_t estr[4] = {1, 1, 1, 1};
  const CUresult r = tma::encoder()(map, tma::data_type(dtype), 4, const_cast<void*>(ptr), dims, strides, box, estr,
                                    CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                                    CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r == CUDA_SUCCESS) return "";
  return "gspn2: cuTensorMapEncodeTiled failed (CUresult " + std::to_string(int(r)) +
         ") for the depthwise kernels' box of " + std::to_string(box_channels) + " x " + std::to_string(box_cols) +
         " x " + std::to_string(box_rows) + " on a (" + std::to_string(B) + ", " + std::to_string(H) + ", " +
         std::to_string(W) + ", " + std::to_string(C) + ") channels-last tensor";
}

inline FastDiv fast_div(int d) {
  FastDiv f;
  f.init(uint32_t(d));
  return f;
}

}  // namespace
}  // namespace gspn2
