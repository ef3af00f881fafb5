// Depthwise convolution on channels-last memory: the row kernels (tile 4 or 8; dwconv.h), and the entry points
// that hand tile 0 and 1 to the shared-memory tile kernels (dwconv_tile.cu).
//
// Forward / input gradient: one thread computes `tile` (4 or 8) consecutive output pixels of one row for `V`
// channels (16 bytes of the input dtype, or 4 channels of a 16-bit dtype with `vec` 4; 4 where C is not a
// multiple of 8 but of 4, else one). For each of the
// K kernel rows it loads the K + tile - 1 input pixels of its window once and slides them over its
// outputs in registers, so an input vector is read K times (once per kernel row, mostly from L1), not K*K.
// Threads are ordered channel vector fastest, so a warp reads whole pixels' channel runs.
//
// Weight and bias gradients: a CTA owns one kernel row i, a tile of channel vectors (threadIdx.x) and one
// chunk of output strips (`tile` pixels of a row), which its threadIdx.y rows share round robin. Each thread
// keeps the K * V partial sums of its kernel row in registers; the CTA adds its rows in a fixed order through
// shared memory and writes one partial per chunk; a last pass sums the chunks in order. No atomics: the
// result is deterministic.
#include <algorithm>

#include "dwconv.h"
#include "dwconv_device.cuh"

namespace gspn2 {
namespace {

template <typename T, int V, int K, int TW>
__global__ void __launch_bounds__(128) dwconv_forward_kernel(
    const T* __restrict__ x, const float* __restrict__ taps, const float* __restrict__ bias,
    const T* __restrict__ residual, T* __restrict__ y, int H, int W, int C, int n_cv, int n_ws, int64_t total,
    bool flip, bool silu) {
  constexpr int P = K / 2;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= total) return;
  const int cv = int(idx % n_cv);
  int64_t r = idx / n_cv;
  const int ws = int(r % n_ws);
  r /= n_ws;
  const int h = int(r % H);
  const int64_t b = r / H;
  const int c0 = cv * V;
  const int w0 = ws * TW;

  float acc[TW][V];
  {
    float bv[V];
    if (bias != nullptr) {
      load_vec<float, V>(bias + c0, bv);
    } else {
      zero_vec(bv);
    }
#pragma unroll
    for (int t = 0; t < TW; ++t)
#pragma unroll
      for (int v = 0; v < V; ++v) acc[t][v] = bv[v];
  }
  const T* xb = x + b * H * W * C + c0;
#pragma unroll
  for (int i = 0; i < K; ++i) {
    const int hi = h + i - P;
    if (hi < 0 || hi >= H) continue;
    float wr[K][V];
#pragma unroll
    for (int j = 0; j < K; ++j) {
      const int tap = flip ? K * K - 1 - (i * K + j) : i * K + j;
      load_vec<float, V>(taps + int64_t(tap) * C + c0, wr[j]);
    }
    const T* xrow = xb + int64_t(hi) * W * C;
#pragma unroll
    for (int s = 0; s < TW + K - 1; ++s) {
      const int wi = w0 + s - P;
      float xv[V];
      if (wi >= 0 && wi < W) {
        load_vec<T, V>(xrow + int64_t(wi) * C, xv);
      } else {
        zero_vec(xv);
      }
#pragma unroll
      for (int t = 0; t < TW; ++t) {
        const int j = s - t;
        if (j >= 0 && j < K) {
#pragma unroll
          for (int v = 0; v < V; ++v) acc[t][v] = fmaf(xv[v], wr[j][v], acc[t][v]);
        }
      }
    }
  }
  const int64_t row = (b * H + h) * int64_t(W);
#pragma unroll
  for (int t = 0; t < TW; ++t) {
    const int wo = w0 + t;
    if (wo >= W) break;
    const int64_t off = (row + wo) * C + c0;
    if (residual != nullptr) {
      float rv[V];
      load_vec<T, V>(residual + off, rv);
#pragma unroll
      for (int v = 0; v < V; ++v) acc[t][v] += rv[v];
    }
    if (silu) {
#pragma unroll
      for (int v = 0; v < V; ++v) acc[t][v] = acc[t][v] / (1.f + __expf(-acc[t][v]));
    }
    store_vec<T, V>(y + off, acc[t]);
  }
}

// Largest block the weight-gradient CTA uses (threads), and its shared-memory staging (floats).
constexpr int kWgradThreads = 256;

// Kernel rows per weight-gradient CTA: all K of a 3x3 (grad_y is read once; 9 taps x V accumulators per
// thread), one of a 5x5 or 7x7 (K x V accumulators; grad_y is read once per kernel row).
__host__ __device__ constexpr int wgrad_rows(int K) { return K == 3 ? 3 : 1; }

template <typename T, int V, int K, int TW>
__global__ void __launch_bounds__(kWgradThreads) dwconv_wgrad_kernel(
    const T* __restrict__ gy, const T* __restrict__ x, float* __restrict__ partial, int H, int W, int C, int n_cv,
    int n_ws, int64_t strips, int64_t strips_per_chunk) {
  constexpr int P = K / 2;
  constexpr int R = wgrad_rows(K);
  __shared__ float red[kWgradThreads * V];
  const int i0 = blockIdx.x * R;  // first kernel row of this CTA
  const int cv = blockIdx.y * blockDim.x + threadIdx.x;
  const int chunk = blockIdx.z;
  const bool active = cv < n_cv;
  const int c0 = cv * V;

  float acc[R][K][V];
  float accb[V];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < K; ++j) zero_vec(acc[r][j]);
  zero_vec(accb);

  const int64_t s_begin = int64_t(chunk) * strips_per_chunk;
  const int64_t s_end = s_begin + strips_per_chunk < strips ? s_begin + strips_per_chunk : strips;
  if (active) {
    for (int64_t s = s_begin + threadIdx.y; s < s_end; s += blockDim.y) {
      const int ws = int(s % n_ws);
      const int64_t row = s / n_ws;  // b * H + h
      const int h = int(row % H);
      const int w0 = ws * TW;
      float gv[TW][V];
#pragma unroll
      for (int t = 0; t < TW; ++t) {
        if (w0 + t < W) {
          load_vec<T, V>(gy + (row * W + w0 + t) * C + c0, gv[t]);
        } else {
          zero_vec(gv[t]);
        }
      }
      if (i0 == 0) {
#pragma unroll
        for (int t = 0; t < TW; ++t)
#pragma unroll
          for (int v = 0; v < V; ++v) accb[v] += gv[t][v];
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int hi = h + i0 + r - P;
        if (hi < 0 || hi >= H) continue;
        const T* xrow = x + ((row - h + hi) * W) * C + c0;
#pragma unroll
        for (int s2 = 0; s2 < TW + K - 1; ++s2) {
          const int wi = w0 + s2 - P;
          if (wi < 0 || wi >= W) continue;
          float xv[V];
          load_vec<T, V>(xrow + int64_t(wi) * C, xv);
#pragma unroll
          for (int t = 0; t < TW; ++t) {
            const int j = s2 - t;
            if (j >= 0 && j < K) {
#pragma unroll
              for (int v = 0; v < V; ++v) acc[r][j][v] = fmaf(gv[t][v], xv[v], acc[r][j][v]);
            }
          }
        }
      }
    }
  }

  // Sum the threadIdx.y rows in order: one column (channel) per thread, for each tap of rows i0 .. i0 + R - 1
  // (and the bias, in the CTA of row 0).
  const int lt = threadIdx.y * blockDim.x + threadIdx.x;
  const int cols = blockDim.x * V;
  const int64_t base = int64_t(chunk) * (K * K + 1) * C + int64_t(blockIdx.y) * blockDim.x * V;
#pragma unroll
  for (int q = 0; q <= R * K; ++q) {
    if (q == R * K && i0 != 0) break;
    const int r = q < R * K ? q / K : 0, j = q < R * K ? q % K : 0;
#pragma unroll
    for (int v = 0; v < V; ++v) red[lt * V + v] = q < R * K ? acc[r][j][v] : accb[v];
    __syncthreads();
    if (lt < cols && blockIdx.y * blockDim.x + lt / V < n_cv) {
      // red's row y, column lt: thread (lt / V, y), vector lane lt % V
      float sum = 0.f;
      for (int yy = 0; yy < blockDim.y; ++yy) sum += red[yy * cols + lt];
      const int tap = q < R * K ? (i0 + r) * K + j : K * K;
      partial[base + int64_t(tap) * C + lt] = sum;
    }
    __syncthreads();
  }
}

__global__ void dwconv_reduce_kernel(const float* __restrict__ partial, float* __restrict__ out, int chunks, int64_t n) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= n) return;
  float sum = 0.f;
  for (int c = 0; c < chunks; ++c) sum += partial[int64_t(c) * n + e];
  out[e] = sum;
}

int row_vector_width(int C, ScalarType dtype, int vec) {
  int v = 16 / element_size(dtype);
  if (vec == 4) v = 4;
  for (; v > 1; v /= 2)
    if (C % v == 0 && (v == 16 / element_size(dtype) || v == 4)) return v;
  return 1;
}

template <typename T, int V, int TW>
void launch_row_forward(const DwConvForwardParams& p) {
  const int n_cv = p.C / V;
  const int n_ws = (p.W + TW - 1) / TW;
  const int64_t total = int64_t(p.B) * p.H * n_ws * n_cv;
  const int threads = 128;
  const unsigned blocks = unsigned((total + threads - 1) / threads);
  auto x = static_cast<const T*>(p.x);
  auto res = static_cast<const T*>(p.residual);
  auto y = static_cast<T*>(p.y);
#define GSPN2_DW_FWD(KS)                                                                                           \
  dwconv_forward_kernel<T, V, KS, TW><<<blocks, threads, 0, p.stream>>>(x, p.taps, p.bias, res, y, p.H, p.W, p.C, \
                                                                       n_cv, n_ws, total, p.flip, p.silu)
  switch (p.K) {
    case 3: GSPN2_DW_FWD(3); break;
    case 5: GSPN2_DW_FWD(5); break;
    case 7: GSPN2_DW_FWD(7); break;
    default: break;
  }
#undef GSPN2_DW_FWD
}

template <typename T, int V, int TW>
void launch_row_wgrad(const DwConvWgradParams& p) {
  const DwConvWgradPlan& q = p.plan;
  const int n_ws = (p.W + TW - 1) / TW;
  const dim3 grid(q.row_groups, q.channel_tiles, q.chunks);
  const dim3 block(q.block_x, q.block_y);
  auto gy = static_cast<const T*>(p.grad_y);
  auto x = static_cast<const T*>(p.x);
#define GSPN2_DW_WGRAD(KS)                                                                                       \
  dwconv_wgrad_kernel<T, V, KS, TW><<<grid, block, 0, p.stream>>>(gy, x, p.partial, p.H, p.W, p.C, p.C / V, n_ws, \
                                                                  q.strips, q.strips_per_chunk)
  switch (p.K) {
    case 3: GSPN2_DW_WGRAD(3); break;
    case 5: GSPN2_DW_WGRAD(5); break;
    case 7: GSPN2_DW_WGRAD(7); break;
    default: break;
  }
#undef GSPN2_DW_WGRAD
}

// Vector width: 16 bytes (8 channels in 16-bit, 4 in float32), or 4 channels of a 16-bit dtype with `vec`
// == 4, or one channel where C is not a multiple of the width.
template <typename T, template <typename, int, int> class F, typename Params>
void dispatch(const Params& p, int vec, int tile) {
  constexpr int kWide = 16 / sizeof(T);
  const int v = row_vector_width(p.C, p.dtype, vec);
  if (v == kWide) {
    if (tile == 4) F<T, kWide, 4>::run(p); else F<T, kWide, 8>::run(p);
  } else if (v == 4) {
    if (tile == 4) F<T, 4, 4>::run(p); else F<T, 4, 8>::run(p);
  } else {
    if (tile == 4) F<T, 1, 4>::run(p); else F<T, 1, 8>::run(p);
  }
}

template <typename T, int V, int TW>
struct ForwardLauncher {
  static void run(const DwConvForwardParams& p) { launch_row_forward<T, V, TW>(p); }
};
template <typename T, int V, int TW>
struct WgradLauncher {
  static void run(const DwConvWgradParams& p) { launch_row_wgrad<T, V, TW>(p); }
};

template <typename T>
void forward_t(const DwConvForwardParams& p) {
  dispatch<T, ForwardLauncher>(p, p.vec, p.tile);
}

template <typename T>
void wgrad_t(const DwConvWgradParams& p) {
  dispatch<T, WgradLauncher>(p, p.plan.vec, p.plan.tile);
  const int64_t n = int64_t(p.K * p.K + 1) * p.C;
  dwconv_reduce_kernel<<<unsigned((n + 255) / 256), 256, 0, p.stream>>>(p.partial, p.out, p.plan.chunks, n);
}

}  // namespace

DwConvWgradPlan dwconv_wgrad_plan(int B, int H, int W, int C, int K, ScalarType dtype, int tile, int vec) {
  DwConvWgradPlan q;
  q.tile = tile;
  q.vec = row_vector_width(C, dtype, vec);
  q.strips = int64_t(B) * H * ((W + tile - 1) / tile);
  const int n_cv = C / q.vec;
  q.block_x = std::min(n_cv, 32);
  q.block_y = std::max(1, kWgradThreads / q.block_x);
  q.channel_tiles = (n_cv + q.block_x - 1) / q.block_x;
  // At least 8 strips per thread; at most about 512 CTAs in all (a constant, not the GPU's SM count, so
  // the summation order and the result do not depend on the GPU).
  const int64_t min_per_chunk = int64_t(8) * q.block_y;
  const int64_t by_work = std::max<int64_t>(1, q.strips / min_per_chunk);
  q.row_groups = K / wgrad_rows(K);
  const int64_t by_grid = std::max<int64_t>(1, 512 / (int64_t(q.row_groups) * q.channel_tiles));
  q.chunks = int(std::min<int64_t>({by_work, by_grid, 65535}));
  q.strips_per_chunk = std::max<int64_t>(1, (q.strips + q.chunks - 1) / q.chunks);
  q.chunks = int(std::max<int64_t>(1, (q.strips + q.strips_per_chunk - 1) / q.strips_per_chunk));
  return q;
}

std::string dwconv_forward_launch(const DwConvForwardParams& p) {
  if (!dwconv_kernel_size_supported(p.K)) return "gspn2: depthwise kernel size " + std::to_string(p.K) + " has no compiled kernel";
  if (int64_t(p.B) * p.H * p.W * p.C == 0) return std::string();
  if (p.tile == 0) return dwconv_tile_forward_launch(p);
  switch (p.dtype) {
    case ScalarType::Float: forward_t<float>(p); break;
    case ScalarType::Half: forward_t<__half>(p); break;
    case ScalarType::BFloat16: forward_t<__nv_bfloat16>(p); break;
  }
  return last_launch_error();
}

std::string dwconv_wgrad_launch(const DwConvWgradParams& p) {
  if (!dwconv_kernel_size_supported(p.K)) return "gspn2: depthwise kernel size " + std::to_string(p.K) + " has no compiled kernel";
  if (p.plan.tile == 0) return dwconv_tile_wgrad_launch(p);
  switch (p.dtype) {
    case ScalarType::Float: wgrad_t<float>(p); break;
    case ScalarType::Half: wgrad_t<__half>(p); break;
    case ScalarType::BFloat16: wgrad_t<__nv_bfloat16>(p); break;
  }
  return last_launch_error();
}

}  // namespace gspn2
