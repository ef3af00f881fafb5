// LayerNorm (+ GELU) kernels over contiguous rows: layer_norm.h describes the layout and the plan.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "layer_norm.h"
#include "propagate_device.cuh"

namespace gspn2 {
namespace {

using dev::Elem;

constexpr float kInvSqrt2 = 0.70710678118654752f;
constexpr float kInvSqrt2Pi = 0.39894228040143268f;

// VEC elements of type T moved as one 16- or 4-byte access.
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Vec {
  typename Elem<T>::bits v[VEC];
};

template <typename T, int VEC>
__device__ __forceinline__ void load_vec(const T* p, float (&out)[VEC]) {
  const Vec<T, VEC> v = *reinterpret_cast<const Vec<T, VEC>*>(p);
#pragma unroll
  for (int k = 0; k < VEC; ++k) out[k] = Elem<T>::load(v.v[k]);
}

template <typename T, int VEC>
__device__ __forceinline__ void store_vec(T* p, const float (&in)[VEC]) {
  Vec<T, VEC> v;
#pragma unroll
  for (int k = 0; k < VEC; ++k) v.v[k] = Elem<T>::store(in[k]);
  *reinterpret_cast<Vec<T, VEC>*>(p) = v;
}

// VEC float32 parameters from column col (16-byte aligned base): float4 / float2 loads; `fill` without them.
template <int VEC>
__device__ __forceinline__ void load_param(const float* p, int col, float (&out)[VEC], float fill) {
  if (p == nullptr) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) out[k] = fill;
  } else if constexpr (VEC % 4 == 0) {
#pragma unroll
    for (int q = 0; q < VEC / 4; ++q) {
      const float4 v = __ldg(reinterpret_cast<const float4*>(p + col) + q);
      out[4 * q] = v.x, out[4 * q + 1] = v.y, out[4 * q + 2] = v.z, out[4 * q + 3] = v.w;
    }
  } else if constexpr (VEC == 2) {
    const float2 v = __ldg(reinterpret_cast<const float2*>(p + col));
    out[0] = v.x, out[1] = v.y;
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) out[k] = __ldg(p + col + k);
  }
}

// Sum over the `lanes` (a power of two) lanes of a row: xor shuffles, every lane ends with the total.
__device__ __forceinline__ float row_sum(float s, int lanes) {
  for (int o = lanes >> 1; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}

__device__ __forceinline__ float gelu(float u) { return 0.5f * u * (1.f + erff(u * kInvSqrt2)); }
__device__ __forceinline__ float gelu_grad(float u) {
  return 0.5f * (1.f + erff(u * kInvSqrt2)) + u * kInvSqrt2Pi * __expf(-0.5f * u * u);
}

// Each warp walks groups of 32 / lanes rows (the same count for all its lanes, so the shuffles stay
// converged); lane l of a row holds columns ((j * lanes + l) * VEC + k). The parameters are read per row
// (from L1): kept in registers over the row loop, the pass measured 7% slower over gspn2_tiny's norms.
template <typename T, int VEC, int NV>
__global__ void __launch_bounds__(kLayerNormThreads) layer_norm_forward_kernel(LayerNormParams p, int lg) {
  const int lanes = 1 << lg;
  const int lane = threadIdx.x & 31;
  const int sub = lane & (lanes - 1);
  const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t rows_per_warp = 32 >> lg;
  const int64_t step = (int64_t(gridDim.x) * blockDim.x >> 5) * rows_per_warp;
  const T* __restrict__ x = static_cast<const T*>(p.x);
  T* __restrict__ y = static_cast<T*>(p.y);
  const int C = p.C;
  const float inv_c = 1.f / float(C);
  for (int64_t base = warp * rows_per_warp; base < p.N; base += step) {
    const int64_t row = base + (lane >> lg);
    const bool active = row < p.N;
    float v[NV][VEC];
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int col = (j * lanes + sub) * VEC;
      if (active && col < C) {
        load_vec<T, VEC>(x + row * C + col, v[j]);
      } else {
#pragma unroll
        for (int k = 0; k < VEC; ++k) v[j][k] = 0.f;
      }
#pragma unroll
      for (int k = 0; k < VEC; ++k) s += v[j][k];
    }
    const float mean = row_sum(s, lanes) * inv_c;
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int col = (j * lanes + sub) * VEC;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float d = col < C ? v[j][k] - mean : 0.f;
        ss += d * d;
      }
    }
    const float rstd = rsqrtf(row_sum(ss, lanes) * inv_c + p.eps);
    if (!active) continue;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int col = (j * lanes + sub) * VEC;
      if (col >= C) continue;
      float o[VEC], w[VEC], b[VEC];
      load_param<VEC>(p.weight, col, w, 1.f);
      load_param<VEC>(p.bias, col, b, 0.f);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float u = (v[j][k] - mean) * rstd * w[k] + b[k];
        o[k] = p.gelu ? gelu(u) : u;
      }
      store_vec<T, VEC>(y + row * C + col, o);
    }
    if (sub == 0 && p.mean != nullptr) {
      p.mean[row] = mean;
      p.rstd[row] = rstd;
    }
  }
}

// One lane's VEC columns of a row in the backward: xhat, and g, the gradient at the norm's output (through
// GELU when `gelu`), from x and grad_y; zeros outside the row.
template <typename T, int VEC>
__device__ __forceinline__ void backward_columns(const LayerNormParams& p, const T* x, const T* gy, bool in,
                                                 float mean, float rstd, const float (&w)[VEC],
                                                 const float (&b)[VEC], float (&xh)[VEC], float (&g)[VEC]) {
  if (in) {
    load_vec<T, VEC>(x, xh);
    load_vec<T, VEC>(gy, g);
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) xh[k] = g[k] = 0.f;
  }
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    xh[k] = (xh[k] - mean) * rstd;
    if (p.gelu) g[k] *= gelu_grad(xh[k] * w[k] + b[k]);
  }
}

// grad_x = rstd * (g*w - mean(g*w) - xhat * mean(g*w * xhat)). Pass 1 over a row sums g*w and g*w*xhat and
// adds g*xhat and g into the lane's weight and bias gradient columns (registers, over all the warp's rows);
// pass 2 writes grad_x, from the row kept in registers (at most kLayerNormKeep elements per lane) or read a
// second time (from L1 / L2). At the end the warp's row groups are summed by shuffles and the block's warps
// through shared memory in warp order, and each block writes one fp32 partial row (deterministic).
template <typename T, int VEC, int NV>
__global__ void __launch_bounds__(kLayerNormThreads, layer_norm_backward_blocks_per_sm(NV * VEC))
    layer_norm_backward_kernel(LayerNormParams p, int lg) {
  constexpr bool kKeep = NV * VEC <= kLayerNormKeep;
  const int lanes = 1 << lg;
  const int lane = threadIdx.x & 31;
  const int sub = lane & (lanes - 1);
  const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t rows_per_warp = 32 >> lg;
  const int64_t step = (int64_t(gridDim.x) * blockDim.x >> 5) * rows_per_warp;
  const T* __restrict__ x = static_cast<const T*>(p.x);
  const T* __restrict__ gy = static_cast<const T*>(p.grad_y);
  T* __restrict__ gx = static_cast<T*>(p.grad_x);
  const int C = p.C;
  const float inv_c = 1.f / float(C);
  const bool want_params = p.partial_w != nullptr || p.partial_b != nullptr;
  float acc_w[NV][VEC], acc_b[NV][VEC];
  float hw[kKeep ? NV : 1][VEC], hb[kKeep ? NV : 1][VEC];
#pragma unroll
  for (int j = 0; j < NV; ++j) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc_w[j][k] = acc_b[j][k] = 0.f;
    if constexpr (kKeep) {
      const int col = (j * lanes + sub) * VEC;
      load_param<VEC>(col < C ? p.weight : nullptr, col, hw[j], 1.f);
      load_param<VEC>(col < C && p.gelu ? p.bias : nullptr, col, hb[j], 0.f);
    }
  }
  for (int64_t base = warp * rows_per_warp; base < p.N; base += step) {
    const int64_t row = base + (lane >> lg);
    const bool active = row < p.N;
    const float mean = active ? p.mean[row] : 0.f;
    const float rstd = active ? p.rstd[row] : 0.f;
    float kx[kKeep ? NV : 1][VEC], kg[kKeep ? NV : 1][VEC];  // the row, kept for pass 2
    float a = 0.f, c = 0.f;  // sums of g*w and g*w*xhat over the row
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int col = (j * lanes + sub) * VEC;
      const bool in = active && col < C;
      float w[VEC], b[VEC], xh[VEC], g[VEC];
      if constexpr (kKeep) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) w[k] = hw[j][k], b[k] = hb[j][k];
      } else {
        load_param<VEC>(in ? p.weight : nullptr, col, w, 1.f);
        load_param<VEC>(in && p.gelu ? p.bias : nullptr, col, b, 0.f);
      }
      backward_columns<T, VEC>(p, x + row * C + col, gy + row * C + col, in, mean, rstd, w, b, xh, g);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        acc_w[j][k] += g[k] * xh[k];
        acc_b[j][k] += g[k];
        const float gw = g[k] * w[k];
        a += gw;
        c += gw * xh[k];
        if constexpr (kKeep) kx[j][k] = xh[k], kg[j][k] = g[k];
      }
    }
    if (gx == nullptr) continue;
    a = row_sum(a, lanes) * inv_c;
    c = row_sum(c, lanes) * inv_c;
    if (!active) continue;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int col = (j * lanes + sub) * VEC;
      if (col >= C) continue;
      float o[VEC], w[VEC], xh[VEC], g[VEC];
      if constexpr (kKeep) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) w[k] = hw[j][k], xh[k] = kx[j][k], g[k] = kg[j][k];
      } else {
        float b[VEC];
        load_param<VEC>(p.weight, col, w, 1.f);
        load_param<VEC>(p.gelu ? p.bias : nullptr, col, b, 0.f);
        backward_columns<T, VEC>(p, x + row * C + col, gy + row * C + col, true, mean, rstd, w, b, xh, g);
      }
#pragma unroll
      for (int k = 0; k < VEC; ++k) o[k] = rstd * (g[k] * w[k] - a - xh[k] * c);
      store_vec<T, VEC>(gx + row * C + col, o);
    }
  }
  if (!want_params) return;  // the same for the whole grid
  // Sum the warp's 32 / lanes row groups (lanes sub, sub + lanes, ...): lanes 0 .. lanes - 1 hold the totals.
#pragma unroll
  for (int j = 0; j < NV; ++j) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      for (int o = 16; o >= lanes; o >>= 1) {
        acc_w[j][k] += __shfl_xor_sync(0xffffffffu, acc_w[j][k], o);
        acc_b[j][k] += __shfl_xor_sync(0xffffffffu, acc_b[j][k], o);
      }
    }
  }
  // Then the block's warps, in warp order, into 2 * C floats of shared memory; the block writes its row.
  extern __shared__ float red[];
  const int wib = threadIdx.x >> 5;
  for (int turn = 0; turn < kLayerNormThreads / 32; ++turn) {
    if (wib == turn && lane < lanes) {
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        const int col = (j * lanes + sub) * VEC;
        if (col >= C) continue;
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          red[col + k] = turn == 0 ? acc_w[j][k] : red[col + k] + acc_w[j][k];
          red[C + col + k] = turn == 0 ? acc_b[j][k] : red[C + col + k] + acc_b[j][k];
        }
      }
    }
    __syncthreads();
  }
  for (int i = threadIdx.x; i < C; i += kLayerNormThreads) {
    if (p.partial_w != nullptr) p.partial_w[int64_t(blockIdx.x) * C + i] = red[i];
    if (p.partial_b != nullptr) p.partial_b[int64_t(blockIdx.x) * C + i] = red[C + i];
  }
}

template <bool Backward, typename T, int VEC, int NV>
void launch_one(const LayerNormParams& p, const LayerNormPlan& q, int lg) {
  if constexpr (Backward) {
    const bool params = p.partial_w != nullptr || p.partial_b != nullptr;
    const size_t smem = params ? 2 * size_t(p.C) * sizeof(float) : 0;
    layer_norm_backward_kernel<T, VEC, NV><<<q.blocks, kLayerNormThreads, smem, p.stream>>>(p, lg);
  } else {
    layer_norm_forward_kernel<T, VEC, NV><<<q.blocks, kLayerNormThreads, 0, p.stream>>>(p, lg);
  }
}

template <bool Backward, typename T, int VEC>
void launch_vectors(const LayerNormParams& p, const LayerNormPlan& q, int lg) {
  switch (q.vectors) {
    case 1: launch_one<Backward, T, VEC, 1>(p, q, lg); break;
    case 2: launch_one<Backward, T, VEC, 2>(p, q, lg); break;
    case 3: launch_one<Backward, T, VEC, 3>(p, q, lg); break;
    case 4: launch_one<Backward, T, VEC, 4>(p, q, lg); break;
    case 5: launch_one<Backward, T, VEC, 5>(p, q, lg); break;
    case 6: launch_one<Backward, T, VEC, 6>(p, q, lg); break;
    case 7: launch_one<Backward, T, VEC, 7>(p, q, lg); break;
    default: launch_one<Backward, T, VEC, 8>(p, q, lg); break;
  }
}

template <bool Backward>
std::string launch(const LayerNormParams& p, const LayerNormPlan& q) {
  if (!q.ok) return "gspn2: layer_norm: no kernel plan for this call";
  int lg = 0;
  while ((1 << lg) < q.lanes) ++lg;
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (q.vec_bytes == 16) {
      launch_vectors<Backward, T, 16 / sizeof(T)>(p, q, lg);
    } else {
      launch_vectors<Backward, T, 4 / sizeof(T)>(p, q, lg);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return "";
}

}  // namespace

LayerNormPlan layer_norm_plan(int64_t N, int C, int esize, bool aligned16, bool aligned4, bool backward, int nsm) {
  LayerNormPlan q;
  if (N < 1 || C < 1) return q;
  const int64_t row_bytes = int64_t(C) * esize;
  if (aligned16 && row_bytes % 16 == 0) {
    q.vec_bytes = 16;
  } else if (aligned4 && row_bytes % 4 == 0) {
    q.vec_bytes = 4;
  } else {
    return q;
  }
  const int vec = q.vec_bytes / esize;
  const int nvec = C / vec;
  // The fewest lanes per row that keep at most 16 elements per lane (more rows per warp, fewer shuffles);
  // rows longer than 32 lanes * 16 elements take more vectors per lane, up to kLayerNormMaxVectors.
  int lanes = 1;
  while (lanes < 32 && (nvec + lanes - 1) / lanes * vec > 16) lanes <<= 1;
  const int vectors = (nvec + lanes - 1) / lanes;
  if (vectors > kLayerNormMaxVectors) return q;
  q.lanes = lanes;
  q.vectors = vectors;
  const int64_t rows_per_block = int64_t(kLayerNormThreads / 32) * (32 / lanes);
  const int64_t need = (N + rows_per_block - 1) / rows_per_block;
  // The backward: one wave of the blocks that fit at its register cap, each writing one partial row.
  const int per_sm = backward ? layer_norm_backward_blocks_per_sm(vectors * vec) : 16;
  q.blocks = int(std::min(need, int64_t(std::max(nsm, 1)) * per_sm));
  q.ok = true;
  return q;
}

std::string layer_norm_forward_launch(const LayerNormParams& p, const LayerNormPlan& q) { return launch<false>(p, q); }
std::string layer_norm_backward_launch(const LayerNormParams& p, const LayerNormPlan& q) { return launch<true>(p, q); }

}  // namespace gspn2
