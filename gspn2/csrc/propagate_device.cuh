// Device helpers shared by the two kernel families (propagate_general.cu: general, shared-memory
// tiles; propagate_streaming.cu: register streaming for lines of up to 1024 pixels).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <c10/cuda/CUDAException.h>

#include "propagate.h"

namespace gspn2 {
namespace dev {

// ------------------------------------------------------------------------------------------------
// Element types: tiles are stored as raw bits in shared memory, math is fp32.
// ------------------------------------------------------------------------------------------------

template <typename scalar_t>
struct Elem;

template <>
struct Elem<float> {
  using bits = uint32_t;
  static __device__ __forceinline__ float load(bits b) { return __uint_as_float(b); }
  static __device__ __forceinline__ bits store(float f) { return __float_as_uint(f); }
};

template <>
struct Elem<__half> {
  using bits = uint16_t;
  static __device__ __forceinline__ float load(bits b) { return __half2float(__ushort_as_half(b)); }
  static __device__ __forceinline__ bits store(float f) { return __half_as_ushort(__float2half_rn(f)); }
};

template <>
struct Elem<__nv_bfloat16> {
  using bits = uint16_t;
  static __device__ __forceinline__ float load(bits b) { return __uint_as_float(uint32_t(b) << 16); }
  static __device__ __forceinline__ bits store(float f) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
  }
};

// Global -> shared copy of 4, 8 or 16 bytes without registers (cp.async, sm_80+); 2-byte copies
// (16-bit types with an odd W) fall back to a plain load and store.
__device__ __forceinline__ void copy_async(void* dst, const void* src, int bytes) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  if (bytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
  } else if (bytes == 8) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(d), "l"(src) : "memory");
  } else if (bytes == 4) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(d), "l"(src) : "memory");
  } else {
    *static_cast<unsigned short*>(dst) = __ldg(static_cast<const unsigned short*>(src));
  }
}
__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void copy_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// Branch-free approximations (a few ulp): the IEEE versions put a slow-path branch around every
// reciprocal, which serialises the per-step dependency chain.
__device__ __forceinline__ float rcp_approx(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ float exp2_approx(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
// min(x, cap) that keeps a NaN x (fminf would return the cap).
__device__ __forceinline__ float min_keep_nan(float x, float cap) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(cap));
  return r;
#else
  return isnan(x) ? x : fminf(x, cap);
#endif
}

// Normalised gate weights of line position q (docs/spec.md, "The propagation operator"): with a_k = mask_k *
// sigmoid(g_k), w_k = a_k / max(sum_k a_k, eps). One reciprocal instead of four (three sigmoids and the
// division): u_k = c (1 + exp(-g_k)) = c / sigmoid(g_k), with c = 2^-21 and u_k = c for an outer neighbour
// outside the line; U = u_0 u_1 u_2 and n_k = mask_k U / u_k (the product of the other two), so that
// w_k = n_k / max(sum_j n_j, (eps / c) U). exp(-g) is capped at 2^63 (g below -43.7, where sigmoid(g) < 1e-19),
// which keeps every u_k, n_k and U a normal float32 (U in [2^-63, 2^126]); a NaN gate stays NaN.
constexpr float kGateScale = 4.76837158203125e-07f;  // c = 2^-21
constexpr float kGateScaleInv = 2097152.f;           // 1 / c
struct WeightTerms {
  float n0, n1, n2;  // mask_k U / u_k
  float U;           // u_0 u_1 u_2
  float r;           // 1 / max(sum_k n_k, (eps / c) U)
  bool big;          // sum_k a_k >= eps
};

__device__ __forceinline__ WeightTerms weight_terms(float g0, float g1, float g2, int q, int L) {
  constexpr float kLog2e = 1.4426950408889634f;
  const float e0 = exp2_approx(min_keep_nan(-kLog2e * g0, 63.f));
  const float e1 = exp2_approx(min_keep_nan(-kLog2e * g1, 63.f));
  const float e2 = exp2_approx(min_keep_nan(-kLog2e * g2, 63.f));
  const bool m0 = q > 0, m2 = q < L - 1;
  const float u0 = m0 ? fmaf(kGateScale, e0, kGateScale) : kGateScale;
  const float u1 = fmaf(kGateScale, e1, kGateScale);
  const float u2 = m2 ? fmaf(kGateScale, e2, kGateScale) : kGateScale;
  WeightTerms t;
  t.n1 = u0 * u2;
  t.n0 = m0 ? u1 * u2 : 0.f;
  t.n2 = m2 ? u0 * u1 : 0.f;
  t.U = t.n1 * u1;
  const float sum = (t.n0 + t.n1) + t.n2, floor = (kNormEps * kGateScaleInv) * t.U;
  t.big = sum >= floor;
  t.r = rcp_approx(fmaxf(sum, floor));
  return t;
}

// The forward's weights: three exponentials and one reciprocal.
struct Weights {
  float w0, w1, w2;
};

__device__ __forceinline__ Weights weights(float g0, float g1, float g2, int q, int L) {
  const WeightTerms t = weight_terms(g0, g1, g2, q, L);
  return {t.n0 * t.r, t.n1 * t.r, t.n2 * t.r};
}

// What the backward needs of a pixel's gates: the same weights (bitwise the forward's), 1 / max(total, eps),
// sigmoid'(g_k) = s_k (1 - s_k) and whether total >= eps; one more reciprocal (of U) for s_k = c n_k / U.
struct Gates {
  float w0, w1, w2;
  float inv;         // 1 / max(total, eps) = U r / c
  float d0, d1, d2;  // s_k (1 - s_k); 0 for a neighbour outside the line
  bool big;          // total >= eps
};

__device__ __forceinline__ Gates normalise(float g0, float g1, float g2, int q, int L) {
  const WeightTerms t = weight_terms(g0, g1, g2, q, L);
  const float rs = kGateScale * rcp_approx(t.U);
  const float s0 = t.n0 * rs, s1 = t.n1 * rs, s2 = t.n2 * rs;
  Gates r;
  r.w0 = t.n0 * t.r;
  r.w1 = t.n1 * t.r;
  r.w2 = t.n2 * t.r;
  r.inv = (t.U * t.r) * kGateScaleInv;
  r.d0 = s0 * (1.f - s0);
  r.d1 = s1 * (1.f - s1);
  r.d2 = s2 * (1.f - s2);
  r.big = t.big;
  return r;
}

// The gates of one backward step (streaming and short-line kernels): normalised, or on a restart step the value whose weights are zero.
// Branch-free (selects), so that the gates of several steps computed together interleave.
__device__ __forceinline__ Gates step_gates(float g0, float g1, float g2, bool restart, int q, int L) {
  Gates r = normalise(g0, g1, g2, q, L);
  r.w0 = restart ? 0.f : r.w0;
  r.w1 = restart ? 0.f : r.w1;
  r.w2 = restart ? 0.f : r.w2;
  r.inv = restart ? 1.f : r.inv;
  r.d0 = restart ? 0.f : r.d0;
  r.d1 = restart ? 0.f : r.d1;
  r.d2 = restart ? 0.f : r.d2;
  r.big = restart ? false : r.big;
  return r;
}

// Gate-logit gradients of one pixel from grad_w (through w_k = a_k / max(total, eps), a_k = mask_k *
// sigmoid(g_k)): grad_a_k = gw_k inv - [total >= eps] (sum_j gw_j a_j) inv^2, where a_j inv = w_j; every
// kernel family's backward uses it.
__device__ __forceinline__ void gate_grads(const Gates& gt, float gw0, float gw1, float gw2, int q, int L,
                                           float& gg0, float& gg1, float& gg2) {
  const float dot = (gw0 * gt.w0 + gw1 * gt.w1) + gw2 * gt.w2;
  const float corr = gt.big ? dot * gt.inv : 0.f;
  gg0 = q > 0 ? (gw0 * gt.inv - corr) * gt.d0 : 0.f;
  gg1 = (gw1 * gt.inv - corr) * gt.d1;
  gg2 = q < L - 1 ? (gw2 * gt.inv - corr) * gt.d2 : 0.f;
}

struct BlockIndex {
  int d, b, grp, sl;
};

__device__ __forceinline__ BlockIndex block_index(const PropagateParams& p) {
  int bid = blockIdx.x;
  BlockIndex r;
  r.d = bid & 3;
  bid >>= 2;
  r.sl = bid % p.nsl;
  bid /= p.nsl;
  r.grp = bid % p.K;
  r.b = bid / p.K;
  return r;
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
// The split kernels' exchange between the CTAs of a cluster: each thread stores its boundary values into a
// neighbour's shared memory (`stored`), arrives on the cluster barrier, and waits (acquire) before reading
// its own inbox. A release arrive makes the warp first wait for every memory access it has in flight,
// global loads included (ERRBAR), which drains the kernels' prefetched loads at every exchange; so only the
// warps that stored release, the others arrive relaxed. Warp-uniform (the vote), as `.aligned` requires.
// (The cluster kernels' st.async exchange measured slower here: docs/benchmarks.md, "Design choices".)
__device__ __forceinline__ void cluster_arrive(bool stored) {
  if (__any_sync(0xffffffffu, stored)) {
    asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
  } else {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
  }
}
__device__ __forceinline__ void cluster_wait_acquire() {
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
#endif

}  // namespace dev

// Host: raises a kernel's opt-in dynamic shared memory to `bytes` where that is above the default 48 KB. Cheap,
// and a per-device setting, so every launch that needs it calls it.
template <typename Kernel>
void allow_dynamic_smem(Kernel kernel, int bytes) {
  if (bytes > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  }
}

// Host: calls fn with a value of the element type that `t` names (float, __half, __nv_bfloat16), so
// that one generic lambda instantiates a kernel launch for all three.
template <typename Fn>
void dispatch_dtype(ScalarType t, Fn&& fn) {
  switch (t) {
    case ScalarType::Float: fn(float{}); break;
    case ScalarType::Half: fn(__half{}); break;
    case ScalarType::BFloat16: fn(__nv_bfloat16{}); break;
  }
}

}  // namespace gspn2
