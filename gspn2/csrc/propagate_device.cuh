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
// 1 / (1 + exp(-g)); saturates cleanly to 0 and 1.
__device__ __forceinline__ float sigmoid(float g) { return rcp_approx(1.f + exp2_approx(-1.4426950408889634f * g)); }

// Normalised gate weights of line position q (docs/spec.md, "The propagation operator"): a_k = mask_k * sigmoid(g_k),
// w_k = a_k / max(sum_k a_k, eps).
struct Gates {
  float s0, s1, s2;  // sigmoid(g_k)
  float a0, a2;      // masked sigmoids of the outer neighbours (a1 = s1)
  float total;       // sum_k a_k
  float inv;         // 1 / max(total, eps)
};

__device__ __forceinline__ Gates normalise(float g0, float g1, float g2, int q, int L) {
  Gates r;
  r.s0 = sigmoid(g0);
  r.s1 = sigmoid(g1);
  r.s2 = sigmoid(g2);
  r.a0 = q > 0 ? r.s0 : 0.f;
  r.a2 = q < L - 1 ? r.s2 : 0.f;
  r.total = (r.a0 + r.s1) + r.a2;
  r.inv = rcp_approx(fmaxf(r.total, kNormEps));
  return r;
}

// The gates of one backward step (streaming and short-line kernels): normalised, or on a restart step the value whose weights are zero.
// Branch-free (selects), so that the gates of several steps computed together interleave.
__device__ __forceinline__ Gates step_gates(float g0, float g1, float g2, bool restart, int q, int L) {
  Gates r = normalise(g0, g1, g2, q, L);
  r.s0 = restart ? 0.f : r.s0;
  r.s1 = restart ? 0.f : r.s1;
  r.s2 = restart ? 0.f : r.s2;
  r.a0 = restart ? 0.f : r.a0;
  r.a2 = restart ? 0.f : r.a2;
  r.total = restart ? 0.f : r.total;
  r.inv = restart ? 1.f : r.inv;
  return r;
}

// Gate-logit gradients of one pixel from grad_w (through w_k = a_k / max(total, eps), a_k = mask_k *
// sigmoid(g_k)); the streaming and the cluster backward both use it.
__device__ __forceinline__ void gate_grads(const Gates& gt, float gw0, float gw1, float gw2, int q, int L,
                                           float& gg0, float& gg1, float& gg2) {
  const float dot = (gw0 * gt.a0 + gw1 * gt.s1) + gw2 * gt.a2;
  const float corr = gt.total >= kNormEps ? dot * gt.inv * gt.inv : 0.f;
  gg0 = q > 0 ? (gw0 * gt.inv - corr) * (gt.s0 * (1.f - gt.s0)) : 0.f;
  gg1 = (gw1 * gt.inv - corr) * (gt.s1 * (1.f - gt.s1));
  gg2 = q < L - 1 ? (gw2 * gt.inv - corr) * (gt.s2 * (1.f - gt.s2)) : 0.f;
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
