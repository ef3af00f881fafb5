// Short-line propagation kernels: images whose lines are all at most kShortMaxLine (32) pixels (H, W <= 32),
// the later stages of every GSPN-2 model. One block owns one (batch, affinity group) for all four directions
// and all of the group's channels, so a pass is one launch and the backward needs no reduce pass:
//
//   * Stage in: every input plane of the block is copied once into shared memory (16-byte cp.async along
//     the contiguous planes), whatever the direction; a horizontal scan then reads its column-ordered steps
//     from shared memory instead of visiting rows in global memory.
//   * Scan: a direction's line sits in one warp, one lane per line position (a warp holds 2 lines of up to
//     16 pixels, or 1 of up to 32; PropagateParams::su). The previous line's neighbours (forward) and the adjoint
//     terms of the next line (backward) move between lanes by warp shuffles: no barrier per step. The gates of
//     a group of kAhead steps are normalised together before the group (kAhead independent chains of
//     transcendental work that interleave, branch-free), so that a step's chain is only the shuffles, the
//     FMAs and the stores: with one warp per scheduler nothing else hides that latency. The forward reads a
//     group's x and lam with its gates; the backward reads the rest of a step's inputs one step ahead.
//   * Stage out: outputs replace the inputs they were computed from in shared memory (h over lam; grad_lam
//     over lam, the gate gradients over the gates, grad_x over x) and leave as 16-byte stores. grad_x sums
//     the four directions' fp32 terms (kept in shared memory) in the order d = 0, 1, 2, 3.
//
// Arithmetic per pixel, step and channel is the streaming kernels' (same normalisation helper, same fma
// order, same sums): outputs and gradients are bitwise equal to kernel="fast" where that keeps a group in
// one block.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <c10/cuda/CUDAException.h>

#include "propagate.h"
#include "propagate_device.cuh"

namespace gspn2 {
namespace {

using namespace dev;

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kAhead = 4;     // forward: steps whose gates are normalised together
constexpr int kAheadBwd = 2;  // the same in the backward (groups of 4 measured 1.09-1.18x slower)

// A run of n bytes (a multiple of 2) split by alignment: `pre` bytes (0 or 2) to a 4-byte boundary, `mid` bytes
// of 4-byte pieces to a 16-byte boundary, the 16-byte body, `tail` bytes of 4-byte pieces, `post` bytes (0 or 2).
struct RunSplit {
  int pre, mid, body, tail, post;
  __device__ __forceinline__ RunSplit(const void* g, int n) {
    const int a = int(reinterpret_cast<uintptr_t>(g) & 15);
    pre = min(n, (4 - (a & 3)) & 3);
    mid = min(n - pre, (16 - ((a + pre) & 15)) & 15) & ~3;
    body = (n - pre - mid) & ~15;
    tail = (n - pre - mid - body) & ~3;
    post = n - pre - mid - body - tail;
  }
};

// Copies a run of n bytes from global memory to shared memory, s and g congruent modulo 16 (each slot is
// shifted by its run's misalignment): cp.async of 16 bytes for the body and 4 bytes for the pieces around
// it, so that every copy of the block is in flight at once; only a 16-bit run's odd ends (one element at
// either end at most) go through registers, each on a thread of its own (`run` spreads them).
__device__ __forceinline__ void stage_in(unsigned char* s, const unsigned char* g, int n, int run, int tid, int nt) {
  const RunSplit r(g, n);
  const int b0 = r.pre + r.mid, b1 = b0 + r.body;
  for (int i = b0 + tid * 16; i < b1; i += nt * 16) copy_async(s + i, g + i, 16);
  const int n4 = (r.mid + r.tail) / 4;
  for (int i = tid; i < n4; i += nt) {
    const int o = i * 4 < r.mid ? r.pre + i * 4 : b1 + (i * 4 - r.mid);
    copy_async(s + o, g + o, 4);
  }
  if (r.pre && tid == ((2 * run) & (nt - 1))) copy_async(s, g, 2);
  if (r.post && tid == ((2 * run + 1) & (nt - 1))) copy_async(s + n - 2, g + n - 2, 2);
}

// The way back: n bytes of shared memory to global memory, same congruence, same pieces.
__device__ __forceinline__ void stage_out(unsigned char* g, const unsigned char* s, int n, int run, int tid, int nt) {
  const RunSplit r(g, n);
  const int b0 = r.pre + r.mid, b1 = b0 + r.body;
  for (int i = b0 + tid * 16; i < b1; i += nt * 16) {
    *reinterpret_cast<uint4*>(g + i) = *reinterpret_cast<const uint4*>(s + i);
  }
  const int n4 = (r.mid + r.tail) / 4;
  for (int i = tid; i < n4; i += nt) {
    const int o = i * 4 < r.mid ? r.pre + i * 4 : b1 + (i * 4 - r.mid);
    *reinterpret_cast<uint32_t*>(g + o) = *reinterpret_cast<const uint32_t*>(s + o);
  }
  if (r.pre && tid == ((2 * run) & (nt - 1))) *reinterpret_cast<uint16_t*>(g) = *reinterpret_cast<const uint16_t*>(s);
  if (r.post && tid == ((2 * run + 1) & (nt - 1))) {
    *reinterpret_cast<uint16_t*>(g + n - 2) = *reinterpret_cast<const uint16_t*>(s + n - 2);
  }
}

// One staged tensor of a block: `count` runs of `bytes` bytes, run k at element offset e0 + k * stride of its
// (contiguous) tensor. In shared memory from byte `off`: where the runs are adjacent in memory (stride = run
// length: K = 1) as one copy, shifted by the first run's misalignment; otherwise a slot of `slot` bytes per
// run, each shifted by its own.
template <int ES>
struct Staged {
  int off, slot, count, bytes;
  int64_t e0, stride;
  bool merged;
  __device__ __forceinline__ Staged(int off_, int slot_, int count_, int elems, int64_t e0_, int64_t stride_)
      : off(off_), slot(slot_), count(count_), bytes(elems * ES), e0(e0_), stride(stride_), merged(stride_ == elems) {}
  __device__ __forceinline__ unsigned char* run(unsigned char* smem, int k) const {
    return merged ? smem + off + int((e0 * ES) & 15) + k * bytes
                  : smem + off + k * slot + int(((e0 + k * stride) * ES) & 15);
  }
  // Copies in from / out to the tensor at g; `id` numbers the runs for stage_in / stage_out.
  __device__ __forceinline__ void in(unsigned char* smem, const void* g, int id, int tid, int nt) const {
    const auto* gb = static_cast<const unsigned char*>(g);
    if (merged) {
      stage_in(run(smem, 0), gb + e0 * ES, count * bytes, id, tid, nt);
    } else {
      for (int k = 0; k < count; ++k) stage_in(run(smem, k), gb + (e0 + k * stride) * ES, bytes, id + k, tid, nt);
    }
  }
  __device__ __forceinline__ void out(void* g, unsigned char* smem, int id, int tid, int nt) const {
    auto* gb = static_cast<unsigned char*>(g);
    if (merged) {
      stage_out(gb + e0 * ES, run(smem, 0), count * bytes, id, tid, nt);
    } else {
      for (int k = 0; k < count; ++k) stage_out(gb + (e0 + k * stride) * ES, run(smem, k), bytes, id + k, tid, nt);
    }
  }
};

// The block's staged tensors: the group's channels of x; of lam (and grad_h, h, grad_lam, h's output, which share
// its strides) per direction; the group's 12 gate planes (d, o) in the order 3 d + o.
template <int ES>
struct BlockRuns {
  Staged<ES> x, gates;
  int64_t lam0, lam_sd;
  int pb, G, HW;
  __device__ __forceinline__ BlockRuns(const PropagateParams& p, const ShortLayout& ly, int b, int grp)
      : x(ly.x, ly.pb, 1, p.G * p.H * p.W, b * p.x_sb + grp * p.G * p.x_sc, 0),
        gates(ly.gates, ly.pg, 12, p.H * p.W, b * p.g_sb + grp * p.g_sk, p.g_so),
        lam0(b * p.lam_sb + grp * p.G * p.lam_sc), lam_sd(p.lam_sd), pb(ly.pb), G(p.G), HW(p.H * p.W) {}
  // A lam-shaped tensor staged at `off` (ly.lam, ly.gh, ly.h).
  __device__ __forceinline__ Staged<ES> lam(int off) const { return Staged<ES>(off, pb, 4, G * HW, lam0, lam_sd); }
};

// One lane's line: direction d = its warp's first unit + its segment, position q along the line.
struct Lane {
  int d, q, L, S, o0, ds, dq, ce;
  bool active;
  __device__ __forceinline__ Lane(const PropagateParams& p) {
    const int lane = threadIdx.x & 31;
    const int wshift = p.su == 2 ? 4 : 5;  // log2 of the lanes per line: 16 for 2 lines per warp, else 32
    d = (threadIdx.x >> 5) * p.su + (lane >> wshift);
    q = lane & ((1 << wshift) - 1);
    const bool horiz = d < 2, inc = (d & 1) == 0;
    L = horiz ? p.H : p.W;
    S = horiz ? p.W : p.H;
    active = q < L;
    ds = horiz ? (inc ? 1 : -1) : (inc ? p.W : -p.W);
    dq = horiz ? p.W : 1;
    o0 = horiz ? q * p.W + (inc ? 0 : S - 1) : (inc ? 0 : (S - 1) * p.W) + q;
    ce = (p.chunk > 0 && p.chunk < S) ? p.chunk : S;
  }
  // Whether this lane has a pixel at scan step s; the pixel, or pixel 0 where it has none (a read of a plane
  // that no lane writes during the scan; the planes outputs replace are read only where has(s)).
  __device__ __forceinline__ bool has(int s) const { return active && s >= 0 && s < S; }
  __device__ __forceinline__ int off(int s) const { return has(s) ? o0 + s * ds : 0; }
};

// ------------------------------------------------------------------------------------------------
// Forward
// ------------------------------------------------------------------------------------------------

template <typename scalar_t, int CS>
__global__ void __launch_bounds__(128) short_forward_kernel(const PropagateParams p) {
  using EL = Elem<scalar_t>;
  using Bits = typename EL::bits;
  constexpr int ES = sizeof(Bits);
  extern __shared__ __align__(16) unsigned char smem[];
  const int b = blockIdx.x / p.K, grp = blockIdx.x % p.K;
  const int HW = p.H * p.W, tid = threadIdx.x, nt = blockDim.x;
  const ShortLayout ly = short_layout(CS, HW, ES, false);
  const BlockRuns<ES> r(p, ly, b, grp);
  const Staged<ES> lam = r.lam(ly.lam);
  r.x.in(smem, p.x, 0, tid, nt);
  lam.in(smem, p.lam, 1, tid, nt);
  r.gates.in(smem, p.gates, 5, tid, nt);
  copy_async_commit();
  copy_async_wait_all();
  __syncthreads();

  const Lane v(p);
  const Bits* sx = reinterpret_cast<const Bits*>(r.x.run(smem, 0));
  Bits* sl = reinterpret_cast<Bits*>(lam.run(smem, v.d));  // h replaces lam
  const Bits* const sg0 = reinterpret_cast<const Bits*>(r.gates.run(smem, 3 * v.d));
  const Bits* const sg1 = reinterpret_cast<const Bits*>(r.gates.run(smem, 3 * v.d + 1));
  const Bits* const sg2 = reinterpret_cast<const Bits*>(r.gates.run(smem, 3 * v.d + 2));
  float prev[CS];
#pragma unroll
  for (int c = 0; c < CS; ++c) prev[c] = 0.f;
  const int steps = max(p.H, p.W);  // every lane walks the same count: the shuffles need the whole warp
  int sm = 0;                       // s % ce
  for (int s0 = 0; s0 < steps; s0 += kAhead) {
    // The group's weights (branch-free: unused steps normalise pixel 0's gates) and inputs.
    float w[kAhead][3];
    Bits xb[kAhead][CS], lb[kAhead][CS];
    int smt = sm;
#pragma unroll
    for (int j = 0; j < kAhead; ++j) {
      const int o = v.off(s0 + j);
      const bool own = v.has(s0 + j);
      const Weights gt = weights(EL::load(sg0[o]), EL::load(sg1[o]), EL::load(sg2[o]), v.q, v.L);
      const bool use = smt != 0;
      w[j][0] = use ? gt.w0 : 0.f;
      w[j][1] = use ? gt.w1 : 0.f;
      w[j][2] = use ? gt.w2 : 0.f;
#pragma unroll
      for (int c = 0; c < CS; ++c) {
        xb[j][c] = sx[c * HW + o];
        lb[j][c] = own ? sl[c * HW + o] : Bits(0);  // h replaces lam: another lane may be writing pixel 0
      }
      smt = (smt + 1 == v.ce) ? 0 : smt + 1;
    }
#pragma unroll
    for (int j = 0; j < kAhead; ++j) {
      const int s = s0 + j;
      if (s >= steps) break;
      const bool restart = sm == 0;
      const bool store = v.active && s < v.S;
      const int o = v.off(s);
#pragma unroll
      for (int c = 0; c < CS; ++c) {
        float left = __shfl_up_sync(kFullMask, prev[c], 1);
        float right = __shfl_down_sync(kFullMask, prev[c], 1);
        left = v.q > 0 ? left : 0.f;
        right = v.q + 1 < v.L ? right : 0.f;
        float hv = EL::load(xb[j][c]) * EL::load(lb[j][c]);
        if (!restart) {  // positions q - 1, q, q + 1
          hv = fmaf(w[j][0], left, hv);
          hv = fmaf(w[j][1], prev[c], hv);
          hv = fmaf(w[j][2], right, hv);
        }
        prev[c] = hv;
        if (store) sl[c * HW + o] = EL::store(hv);
      }
      sm = (sm + 1 == v.ce) ? 0 : sm + 1;
    }
  }
  __syncthreads();
  lam.out(p.h, smem, 0, tid, nt);  // h shares lam's shape and strides
}

// ------------------------------------------------------------------------------------------------
// Backward: the reverse scan of gspn_propagate_backward_ref. A lane's adjoint terms C_o = w_o * adj of its
// pixel (offsets o = -1, 0, +1) reach the lanes at q + o of the line before by shuffles.
// ------------------------------------------------------------------------------------------------

template <typename scalar_t, int CS>
__global__ void __launch_bounds__(128) short_backward_kernel(const PropagateParams p) {
  using EL = Elem<scalar_t>;
  using Bits = typename EL::bits;
  constexpr int ES = sizeof(Bits);
  extern __shared__ __align__(16) unsigned char smem[];
  const int b = blockIdx.x / p.K, grp = blockIdx.x % p.K;
  const int HW = p.H * p.W, tid = threadIdx.x, nt = blockDim.x;
  const ShortLayout ly = short_layout(CS, HW, ES, true);
  const BlockRuns<ES> r(p, ly, b, grp);
  const Staged<ES> lam = r.lam(ly.lam), gh = r.lam(ly.gh), hs = r.lam(ly.h);
  r.x.in(smem, p.x, 0, tid, nt);
  lam.in(smem, p.lam, 1, tid, nt);
  gh.in(smem, p.grad_h, 5, tid, nt);
  hs.in(smem, p.h_saved, 9, tid, nt);
  r.gates.in(smem, p.gates, 13, tid, nt);
  copy_async_commit();
  copy_async_wait_all();
  __syncthreads();

  const Lane v(p);
  const Bits* sx = reinterpret_cast<const Bits*>(r.x.run(smem, 0));
  Bits* sl = reinterpret_cast<Bits*>(lam.run(smem, v.d));  // grad_lam replaces lam
  const Bits* sgh = reinterpret_cast<const Bits*>(gh.run(smem, v.d));
  const Bits* shs = reinterpret_cast<const Bits*>(hs.run(smem, v.d));
  // The gate gradients replace the gates.
  Bits* const sg0 = reinterpret_cast<Bits*>(r.gates.run(smem, 3 * v.d));
  Bits* const sg1 = reinterpret_cast<Bits*>(r.gates.run(smem, 3 * v.d + 1));
  Bits* const sg2 = reinterpret_cast<Bits*>(r.gates.run(smem, 3 * v.d + 2));
  float* sgx = reinterpret_cast<float*>(smem + ly.gx) + v.d * CS * HW;  // this direction's grad_x terms

  // Inputs of reverse step i (scan step s = S - 1 - i), read one step ahead: x, lam, grad_h, and h_{s-1} at
  // q - 1, q, q + 1 (the position itself where a neighbour is missing: its product is masked). The gates
  // are read kAheadBwd steps at a time, before the group's steps write the gate gradients over them.
  struct In {
    Bits x[CS], l[CS], gh[CS], hl[CS], h0[CS], hr[CS];
  };
  auto load = [&](int i, In& in) {
    const int s = v.S - 1 - i;
    const int o = v.off(s);
    const bool has_prev = v.active && s >= 1 && s < v.S;
    const int oh = has_prev ? o - v.ds : o;
    const int ohl = (has_prev && v.q > 0) ? oh - v.dq : oh;
    const int ohr = (has_prev && v.q + 1 < v.L) ? oh + v.dq : oh;
    const bool own = v.has(s);  // grad_lam replaces lam (see Lane::off)
#pragma unroll
    for (int c = 0; c < CS; ++c) {
      in.x[c] = sx[c * HW + o];
      in.l[c] = own ? sl[c * HW + o] : Bits(0);
      in.gh[c] = sgh[c * HW + o];
      in.hl[c] = shs[c * HW + ohl];
      in.h0[c] = shs[c * HW + oh];
      in.hr[c] = shs[c * HW + ohr];
    }
  };
  In cur;
  load(0, cur);
  float tm[CS], t0[CS], tp[CS];  // C_-1, C_0, C_+1 of this lane's pixel one step later in scan order
#pragma unroll
  for (int c = 0; c < CS; ++c) tm[c] = t0[c] = tp[c] = 0.f;
  const int steps = max(p.H, p.W);
  int sm = (v.S - 1) % v.ce;  // s % ce of the step being processed
  for (int i0 = 0; i0 < steps; i0 += kAheadBwd) {
    Gates gq[kAheadBwd];  // the group's gates (branch-free: unused steps normalise zeros)
    int smt = sm;
#pragma unroll
    for (int j = 0; j < kAheadBwd; ++j) {
      const int s = v.S - 1 - (i0 + j);
      const int o = v.off(s);
      const bool own = v.has(s);  // the gate gradients replace the gates (see Lane::off)
      const Bits g0 = own ? sg0[o] : Bits(0), g1 = own ? sg1[o] : Bits(0), g2 = own ? sg2[o] : Bits(0);
      gq[j] = step_gates(EL::load(g0), EL::load(g1), EL::load(g2), smt == 0, v.q, v.L);
      smt = (smt == 0) ? v.ce - 1 : smt - 1;
    }
#pragma unroll
    for (int j = 0; j < kAheadBwd; ++j) {
      const int i = i0 + j;
      if (i >= steps) break;
      In nxt;
      load(i + 1, nxt);
      const int s = v.S - 1 - i;
      const bool restart = sm == 0;
      const bool has_next = i > 0 && sm + 1 != v.ce;
      const bool store = v.active && i < v.S;
      const int o = v.off(s);
      const Gates& gt = gq[j];
      const float w0 = gt.w0, w1 = gt.w1, w2 = gt.w2;
      float gw0 = 0.f, gw1 = 0.f, gw2 = 0.f;
#pragma unroll
      for (int c = 0; c < CS; ++c) {
        float from_right = __shfl_down_sync(kFullMask, tm[c], 1);  // C_-1 of q + 1
        float from_left = __shfl_up_sync(kFullMask, tp[c], 1);     // C_+1 of q - 1
        from_right = v.q + 1 < v.L ? from_right : 0.f;
        from_left = v.q > 0 ? from_left : 0.f;
        float adj = EL::load(cur.gh[c]);
        if (has_next) adj += (t0[c] + from_right) + from_left;
        const float glam = EL::load(cur.x[c]) * adj;
        const float gx = EL::load(cur.l[c]) * adj;
        if (!restart) {
          gw0 = fmaf(adj, EL::load(cur.hl[c]), gw0);
          gw1 = fmaf(adj, EL::load(cur.h0[c]), gw1);
          gw2 = fmaf(adj, EL::load(cur.hr[c]), gw2);
          tm[c] = w0 * adj;
          t0[c] = w1 * adj;
          tp[c] = w2 * adj;
        }
        if (store) {
          sl[c * HW + o] = EL::store(glam);
          sgx[c * HW + o] = gx;
        }
      }
      float gg0 = 0.f, gg1 = 0.f, gg2 = 0.f;
      if (!restart) gate_grads(gt, gw0, gw1, gw2, v.q, v.L, gg0, gg1, gg2);
      if (store) {
        sg0[o] = EL::store(gg0);
        sg1[o] = EL::store(gg1);
        sg2[o] = EL::store(gg2);
      }
      sm = (sm == 0) ? v.ce - 1 : sm - 1;
      cur = nxt;
    }
  }
  __syncthreads();
  // grad_x = the sum of the four directions' terms, over x in shared memory.
  Bits* sxw = reinterpret_cast<Bits*>(r.x.run(smem, 0));
  const float* gxs = reinterpret_cast<const float*>(smem + ly.gx);
  for (int e = tid; e < CS * HW; e += nt) {
    float t = gxs[e];
    t += gxs[e + CS * HW];
    t += gxs[e + 2 * CS * HW];
    t += gxs[e + 3 * CS * HW];
    sxw[e] = EL::store(t);
  }
  __syncthreads();
  r.x.out(p.grad_x, smem, 0, tid, nt);
  lam.out(p.grad_lam, smem, 1, tid, nt);
  r.gates.out(p.grad_gates, smem, 5, tid, nt);
}

template <typename Kernel>
void launch(Kernel kernel, const PropagateParams& p, cudaStream_t stream) {
  allow_dynamic_smem(kernel, p.smem_bytes);
  kernel<<<p.B * p.K, p.nt, p.smem_bytes, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Calls fn with the group's channel count as a compile-time constant (short_channels_supported).
template <typename Fn>
void dispatch_channels(int G, Fn&& fn) {
  switch (G) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 4: fn(std::integral_constant<int, 4>{}); break;
    case 8: fn(std::integral_constant<int, 8>{}); break;
    default: break;
  }
}

}  // namespace

void launch_forward_short(const PropagateParams& p, cudaStream_t stream) {
  dispatch_dtype(p.dtype, [&](auto elem) {
    dispatch_channels(p.G, [&](auto cs) { launch(short_forward_kernel<decltype(elem), decltype(cs)::value>, p, stream); });
  });
}

void launch_backward_short(const PropagateParams& p, cudaStream_t stream) {
  dispatch_dtype(p.dtype, [&](auto elem) {
    dispatch_channels(p.G, [&](auto cs) { launch(short_backward_kernel<decltype(elem), decltype(cs)::value>, p, stream); });
  });
}

}  // namespace gspn2
