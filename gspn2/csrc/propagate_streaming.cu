// Streaming propagation kernels for lines of up to kFastMaxLine (1024) pixels: every model shape and
// images up to 1024^2. Lines longer than that run the general kernels (propagate_general.cu).
//
// Same decomposition as the general kernels: one launch covers the four directions, block
// (d, b, group, slice) owns whole lines of `CS` channels of one affinity group, one thread per line
// position, and the previous line (forward) or the adjoint terms (backward) are exchanged through an
// fp32 line in shared memory, double buffered, one barrier per scan step. What differs is how the
// inputs arrive: nothing is staged cooperatively, every thread streams its own pixels.
//
//   * ring (vertical scans, and horizontal scans whose W is not a multiple of the tile): each thread
//     keeps the next D scan steps of its own pixel in registers; the loads of step s + D are issued
//     as step s is consumed, so D steps of every thread are always in flight. Vertical scans load
//     rows: consecutive threads read consecutive addresses.
//   * tile (horizontal scans): a thread's pixels along the scan axis are contiguous in memory, so it
//     copies the next T steps of each plane with cp.async (16 or 32 bytes: whole sectors) into its own
//     slice of shared memory while it computes the current T steps from registers; outputs are kept
//     in registers and written as vectors once per tile. No barrier guards the stage: only the thread
//     that copied a slice reads it.
//
// Split vertical lines (with the cluster kernels, where one block per vertical line would leave SMs idle):
// the vertical directions run in a second kernel, each line on a thread-block cluster of 2, 4 or 8 CTAs. CTA
// `rank` owns positions [rank R, rank R + R) and also computes kSplitHalo positions on each side through the
// same ring. A value at the CTA's edge goes stale one position further in per step, so after kSplitHalo
// steps the own positions are still exact; then each CTA pushes its first and last kSplitHalo own positions'
// exchange-line values into its neighbours' inboxes (distributed shared memory) and, after one cluster
// barrier, its halo positions take the neighbours' values. Per pixel the arithmetic is the unsplit kernel's.
//
// The backward is the reverse scan of gspn_propagate_backward_ref. Besides the adjoint terms C_o, the
// exchange line carries h_{s-1}, the saved output of the step before, that grad_w needs at q - 1, q
// and q + 1; it is written one step ahead. grad_x is written per direction (fp32) and summed by the
// general kernels' reduce pass, in a fixed order, as are the gate gradients of groups split over
// several blocks: deterministic, no float atomics.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cooperative_groups.h>
#include <type_traits>

#include <c10/cuda/CUDAException.h>

#include "propagate.h"
#include "propagate_device.cuh"

namespace gspn2 {
namespace {

using namespace dev;

// ------------------------------------------------------------------------------------------------
// Packed register tiles: NW 32-bit words holding elements of type Bits (indices are compile-time
// constants after unrolling, so the arrays live in registers).
// ------------------------------------------------------------------------------------------------

template <typename Bits>
struct Packed;

template <>
struct Packed<uint32_t> {
  template <int NW>
  static __device__ __forceinline__ uint32_t get(const uint32_t (&r)[NW], int e) { return r[e]; }
  template <int NW>
  static __device__ __forceinline__ void put(uint32_t (&r)[NW], int e, uint32_t b) { r[e] = b; }
  template <int NW>
  static __device__ __forceinline__ void reverse(uint32_t (&r)[NW]) {
#pragma unroll
    for (int i = 0; i < NW / 2; ++i) {
      const uint32_t t = r[i];
      r[i] = r[NW - 1 - i];
      r[NW - 1 - i] = t;
    }
  }
};

template <>
struct Packed<uint16_t> {
  template <int NW>
  static __device__ __forceinline__ uint16_t get(const uint32_t (&r)[NW], int e) {
    return uint16_t((e & 1) ? (r[e >> 1] >> 16) : (r[e >> 1] & 0xffffu));
  }
  template <int NW>
  static __device__ __forceinline__ void put(uint32_t (&r)[NW], int e, uint16_t b) {
    const uint32_t w = r[e >> 1];
    r[e >> 1] = (e & 1) ? ((w & 0xffffu) | (uint32_t(b) << 16)) : ((w & 0xffff0000u) | b);
  }
  template <int NW>
  static __device__ __forceinline__ void reverse(uint32_t (&r)[NW]) {
#pragma unroll
    for (int i = 0; i < NW / 2; ++i) {
      const uint32_t t = r[i];
      r[i] = r[NW - 1 - i];
      r[NW - 1 - i] = t;
    }
#pragma unroll
    for (int i = 0; i < NW; ++i) r[i] = __byte_perm(r[i], 0, 0x1032);
  }
};

template <int NW>
__device__ __forceinline__ void reverse_f(float (&r)[NW]) {
#pragma unroll
  for (int i = 0; i < NW / 2; ++i) {
    const float t = r[i];
    r[i] = r[NW - 1 - i];
    r[NW - 1 - i] = t;
  }
}

__device__ __forceinline__ uint32_t ldg_bits(const uint32_t* p) { return __ldg(reinterpret_cast<const unsigned int*>(p)); }
__device__ __forceinline__ uint16_t ldg_bits(const uint16_t* p) { return __ldg(reinterpret_cast<const unsigned short*>(p)); }
// Global stores through a held() pointer, which the compiler no longer knows to be global.
// (Outputs only: nothing in the kernel reads them back, so the stores need no ordering against its loads.)
__device__ __forceinline__ void stg_bits(uint32_t* p, uint32_t v) { asm volatile("st.global.b32 [%0], %1;" ::"l"(p), "r"(v)); }
__device__ __forceinline__ void stg_bits(uint16_t* p, uint16_t v) { asm volatile("st.global.b16 [%0], %1;" ::"l"(p), "h"(v)); }
__device__ __forceinline__ void stg_bits(float* p, float v) { asm volatile("st.global.f32 [%0], %1;" ::"l"(p), "f"(v)); }

// Element at byte offset `o` (32-bit, unsigned) from a block's plane base: the base can stay in uniform
// registers and the address costs one 64-bit add.
template <typename T, typename C>
__device__ __forceinline__ T* at(C* base, uint32_t o) {
  return reinterpret_cast<T*>(base + o);
}

// A pointer the compiler keeps in a register as it is, instead of re-deriving it from the kernel parameters
// at every use (which costs a 64-bit add and a shift per access).
// H = false leaves it to the compiler (blocks of 1024 threads, whose 64 registers would spill).
template <bool H = true, typename T>
__device__ __forceinline__ T* held(T* ptr) {
  if constexpr (H) asm("" : "+l"(ptr));
  return ptr;
}

// A thread's slice of the stage: VB bytes per plane, plane k of thread q at (k * nthreads + q) * VB.
// 32-byte slices swap their halves on every other group of four threads, so that a quarter warp's
// 16-byte shared loads hit 32 different banks.
template <int VB>
struct Stage {
  unsigned char* base;
  int nthr;
  int q;
  __device__ __forceinline__ unsigned char* slice(int k) const { return base + (size_t(k) * nthr + q) * VB; }
  __device__ __forceinline__ int half(int h) const { return VB == 32 ? (h ^ ((q >> 2) & 1)) : h; }
  // Global -> stage (cp.async, no registers). src must be VB-aligned.
  __device__ __forceinline__ void copy(int k, const void* src) const {
    unsigned char* d = slice(k);
    const unsigned char* s = static_cast<const unsigned char*>(src);
    if (VB == 32) {
      copy_async(d + half(0) * 16, s, 16);
      copy_async(d + half(1) * 16, s + 16, 16);
    } else {
      copy_async(d, s, VB);
    }
  }
  // Stage -> registers.
  template <int NW>
  __device__ __forceinline__ void read(int k, uint32_t (&r)[NW]) const {
    const unsigned char* d = slice(k);
    if constexpr (VB == 32) {
      const uint4 a = *reinterpret_cast<const uint4*>(d + half(0) * 16);
      const uint4 b = *reinterpret_cast<const uint4*>(d + half(1) * 16);
      r[0] = a.x, r[1] = a.y, r[2] = a.z, r[3] = a.w;
      r[4] = b.x, r[5] = b.y, r[6] = b.z, r[7] = b.w;
    } else if constexpr (VB == 16) {
      const uint4 a = *reinterpret_cast<const uint4*>(d);
      r[0] = a.x, r[1] = a.y, r[2] = a.z, r[3] = a.w;
    } else {
      const uint2 a = *reinterpret_cast<const uint2*>(d);
      r[0] = a.x, r[1] = a.y;
    }
  }
  // One element (index e in memory order) of plane k, for slices of at most 16 bytes.
  template <typename Bits>
  __device__ __forceinline__ Bits peek(int k, int e) const {
    return reinterpret_cast<const Bits*>(slice(k))[e];
  }
};

// Registers -> global memory, NW words (VB = 4 * NW bytes, aligned).
template <int NW>
__device__ __forceinline__ void stg_words(void* dst, const uint32_t (&r)[NW]) {
  if constexpr (NW == 8) {
    reinterpret_cast<uint4*>(dst)[0] = make_uint4(r[0], r[1], r[2], r[3]);
    reinterpret_cast<uint4*>(dst)[1] = make_uint4(r[4], r[5], r[6], r[7]);
  } else if constexpr (NW == 4) {
    *reinterpret_cast<uint4*>(dst) = make_uint4(r[0], r[1], r[2], r[3]);
  } else if constexpr (NW == 2) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(r[0], r[1]);
  } else {
    *reinterpret_cast<uint32_t*>(dst) = r[0];
  }
}

template <int N>
__device__ __forceinline__ void stg_floats(float* dst, const float (&r)[N]) {
  uint32_t w[N];
#pragma unroll
  for (int i = 0; i < N; ++i) w[i] = __float_as_uint(r[i]);
  stg_words<N>(dst, w);
}

// Where a block's threads sit on its line. Unsplit: thread t is line position t. Split: thread t is position
// base + t, threads [lo, hi) own their positions, threads below `span` compute (own and halo).
struct Split {
  int rank = 0, n = 1;
  int base = 0, lo = 0, hi = 1 << 30, span = 1 << 30;
  int pp = 0;               // positions per exchange line
  float* inbox = nullptr;   // [2 parities][lower, upper][kSplitHalo][values per position]
};

// The block's view of its problem: line geometry and plane base pointers (q = 0, scan index 0).
// Offsets within a plane are 32-bit (planes hold at most kFastMaxLine^2 = 2^20 pixels here): an access's
// address is then the block's 64-bit plane base plus one sign-extended 32-bit offset.
template <typename Bits, int CS>
struct BlockView {
  int L, S, W, q, t;  // q: this thread's line position, t: its slot in the exchange line
  bool inc, active, own;
  int ce;      // restart period in steps
  int o0, ds;  // this thread's pixel at scan step 0, and the offset of one scan step (elements)
  int oa;      // o0 with q clamped to the line: where a thread off the line loads (and discards) its inputs
  const Bits* g;
  const Bits* x;
  const Bits* lam;
  __device__ __forceinline__ BlockView(const PropagateParams& p, const BlockIndex& bi, bool horiz,
                                       const Split& sp = Split{}) {
    L = horiz ? p.H : p.W;
    S = horiz ? p.W : p.H;
    W = p.W;
    t = threadIdx.x;
    q = t + sp.base;
    inc = (bi.d & 1) == 0;
    active = q >= 0 && q < L && t < sp.span;
    own = active && t >= sp.lo && t < sp.hi;
    ce = (p.chunk > 0 && p.chunk < S) ? p.chunk : S;
    ds = horiz ? (inc ? 1 : -1) : (inc ? W : -W);
    o0 = horiz ? q * W + (inc ? 0 : S - 1) : (inc ? 0 : (S - 1) * W) + q;
    const int qa = min(max(q, 0), L - 1);
    oa = horiz ? qa * W + (inc ? 0 : S - 1) : (inc ? 0 : (S - 1) * W) + qa;
    const int c0 = bi.grp * p.G + bi.sl * CS;
    g = static_cast<const Bits*>(p.gates) + (bi.b * p.g_sb + bi.d * p.g_sd + bi.grp * p.g_sk);
    x = static_cast<const Bits*>(p.x) + (bi.b * p.x_sb + c0 * p.x_sc);
    lam = static_cast<const Bits*>(p.lam) + (bi.b * p.lam_sb + bi.d * p.lam_sd + c0 * p.lam_sc);
  }
  // Offset of this thread's pixel at scan step s.
  __device__ __forceinline__ int off(int s) const { return o0 + s * ds; }
  // Offset of scan step s from step 0, s clamped to the line: the ring's loads past the end reread the last step.
  __device__ __forceinline__ int step(int s) const { return min(s, S - 1) * ds; }
  // This thread's offset at the first image column of horizontal tile kt (T steps).
  template <int T>
  __device__ __forceinline__ int tile_off(int kt) const {
    return q * W + (inc ? kt * T : W - (kt + 1) * T);
  }
};

// After the last step of a tile of a split line: the first and last kSplitHalo own positions' NV values (at
// `slot`, this thread's place in the exchange line just written) go to the neighbours' inboxes; after one
// cluster barrier the halo positions take the neighbours' values. Every thread of the cluster calls it.
template <int NV>
__device__ __forceinline__ void split_exchange(const Split& sp, float* slot, int parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int t = threadIdx.x;
  float* const box = sp.inbox + parity * 2 * kSplitHalo * NV;
  const bool left = sp.rank > 0 && t >= sp.lo && t < sp.lo + kSplitHalo;
  const bool right = sp.rank < sp.n - 1 && t >= sp.hi - kSplitHalo && t < sp.hi;
  if (left) {  // the left neighbour's upper halo
    float* const nb = cluster.map_shared_rank(box, sp.rank - 1) + (kSplitHalo + t - sp.lo) * NV;
#pragma unroll
    for (int k = 0; k < NV; ++k) nb[k] = slot[k];
  }
  if (right) {  // the right neighbour's lower halo
    float* const nb = cluster.map_shared_rank(box, sp.rank + 1) + (t - (sp.hi - kSplitHalo)) * NV;
#pragma unroll
    for (int k = 0; k < NV; ++k) nb[k] = slot[k];
  }
  dev::cluster_arrive(left || right);  // release only where a warp stored (see there)
  dev::cluster_wait_acquire();
  const float* mine = nullptr;
  if (sp.rank > 0 && t < sp.lo) mine = box + t * NV;
  if (sp.rank < sp.n - 1 && t >= sp.hi && t < sp.hi + kSplitHalo) mine = box + (kSplitHalo + t - sp.hi) * NV;
  if (mine != nullptr) {
#pragma unroll
    for (int k = 0; k < NV; ++k) slot[k] = mine[k];
  }
  __syncthreads();
#endif
}

// ------------------------------------------------------------------------------------------------
// Forward
// ------------------------------------------------------------------------------------------------

// AHEAD (blocks of up to kFastSmallThreads threads): the gates of a group of steps (the ring's D steps,
// a horizontal tile's T) are normalised together before the group's first step, D or T independent
// chains of transcendental work, so that the step-to-step chain (one barrier per step) is only the
// exchange line's loads, the FMAs and the stores. The 1024-thread blocks (64 registers per thread)
// normalise each step's gates in that step: the extra live registers would spill, and their 32 warps per
// SM hide the chain.
template <typename scalar_t, int CS, int D, bool HORIZ, bool AHEAD, bool SPLIT = false>
__device__ __forceinline__ void forward_ring(const PropagateParams& p, const BlockIndex& bi, float* line,
                                             const Split& sp = Split{}) {
  using EL = Elem<scalar_t>;
  using Bits = typename EL::bits;
  static_assert(!SPLIT || kSplitHalo % D == 0, "a split line's exchanges fall on a group's last step");
  const BlockView<Bits, CS> v(p, bi, HORIZ, sp);
  constexpr int LS = fast_line_stride(CS, false);
  float* const lq0 = line + (v.t + 1) * LS;        // this thread's slot in exchange line 0 (halo-shifted by one)
  float* const lq1 = lq0 + (SPLIT ? sp.pp : p.pp) * LS;  // ... and in line 1
  Bits* const h = static_cast<Bits*>(p.h) + (bi.b * p.h_sb + bi.d * p.h_sd + (bi.grp * p.G + bi.sl * CS) * p.h_sc);

  // Slot j holds step s with s % D == j. AHEAD: the gate slots are refilled a group at a time (after the
  // group's weights are computed), x and lam slots one step at a time, D steps ahead either way. The loads
  // are unconditional, from each plane's pointer at this thread's pixel of step 0 plus one offset per step
  // (BlockView::oa, BlockView::step): threads off the line and steps past its end load pixels of the line
  // and never use them.
  const Bits* pg[3];
  const Bits *px[CS], *pl[CS];
  Bits* ph[CS];
#pragma unroll
  for (int k = 0; k < 3; ++k) pg[k] = held(v.g + k * p.g_so + v.oa);
#pragma unroll
  for (int c = 0; c < CS; ++c) {
    px[c] = held(v.x + c * p.x_sc + v.oa);
    pl[c] = held(v.lam + c * p.lam_sc + v.oa);
    ph[c] = held(h + c * p.h_sc + v.oa);
  }
  Bits rg[D][3] = {}, rx[D][CS], rl[D][CS];
#define GSPN2_FWD_LOAD_GATES(j, s)                                                           \
  {                                                                                          \
    const int o_ = v.step(s);                                                                \
    _Pragma("unroll") for (int k = 0; k < 3; ++k) rg[j][k] = ldg_bits(pg[k] + o_);           \
  }
#define GSPN2_FWD_LOAD_XL(j, s)                                                              \
  {                                                                                          \
    const int o_ = v.step(s);                                                                \
    _Pragma("unroll") for (int c = 0; c < CS; ++c) {                                         \
      rx[j][c] = ldg_bits(px[c] + o_);                                                       \
      rl[j][c] = ldg_bits(pl[c] + o_);                                                       \
    }                                                                                        \
  }
#pragma unroll
  for (int j = 0; j < D; ++j) {
    GSPN2_FWD_LOAD_GATES(j, j)
    GSPN2_FWD_LOAD_XL(j, j)
  }

  float wq[AHEAD ? D : 1][3];  // AHEAD: the weights of the group's steps
  int sm = 0;
  for (int s0 = 0; s0 < v.S; s0 += D) {
    if constexpr (AHEAD) {
      int smt = sm;
#pragma unroll
      for (int j = 0; j < D; ++j) {
        // Branch-free, so that the D chains interleave; unused slots hold zeros or stale gates.
        const Weights gt = weights(EL::load(rg[j][0]), EL::load(rg[j][1]), EL::load(rg[j][2]), v.q, v.L);
        const bool use = smt != 0;
        wq[j][0] = use ? gt.w0 : 0.f;
        wq[j][1] = use ? gt.w1 : 0.f;
        wq[j][2] = use ? gt.w2 : 0.f;
        smt = (smt + 1 == v.ce) ? 0 : smt + 1;
      }
#pragma unroll
      for (int j = 0; j < D; ++j) {
        GSPN2_FWD_LOAD_GATES(j, s0 + D + j)
      }
    }
#pragma unroll
    for (int j = 0; j < D; ++j) {
      const int s = s0 + j;
      if (s >= v.S) break;
      const bool restart = sm == 0;
      const bool odd = (D % 2 == 0 ? j : s) & 1;  // step s reads line s % 2 (a constant when D is even)
      const float* prev = odd ? lq1 : lq0;
      float* next = odd ? lq0 : lq1;
      if (v.active) {
        float w0 = 0.f, w1 = 0.f, w2 = 0.f;
        if constexpr (AHEAD) {
          w0 = wq[j][0], w1 = wq[j][1], w2 = wq[j][2];
        } else if (!restart) {
          const Weights gt = weights(EL::load(rg[j][0]), EL::load(rg[j][1]), EL::load(rg[j][2]), v.q, v.L);
          w0 = gt.w0;
          w1 = gt.w1;
          w2 = gt.w2;
        }
        const int o = s * v.ds;
#pragma unroll
        for (int c = 0; c < CS; ++c) {
          float hv = EL::load(rx[j][c]) * EL::load(rl[j][c]);
          if (!restart) {  // positions q - 1, q, q + 1
            hv = fmaf(w0, prev[c - LS], hv);
            hv = fmaf(w1, prev[c], hv);
            hv = fmaf(w2, prev[c + LS], hv);
          }
          next[c] = hv;
          if (v.own) stg_bits(ph[c] + o, EL::store(hv));
        }
        if (!AHEAD) {
          GSPN2_FWD_LOAD_GATES(j, s + D)
        }
        GSPN2_FWD_LOAD_XL(j, s + D)
      }
      __syncthreads();
      if constexpr (SPLIT) {
        if ((s + 1) % kSplitHalo == 0 && s + 1 < v.S) split_exchange<CS>(sp, next, (s / kSplitHalo) & 1);
      }
      sm = (sm + 1 == v.ce) ? 0 : sm + 1;
    }
  }
#undef GSPN2_FWD_LOAD_GATES
#undef GSPN2_FWD_LOAD_XL
}

template <typename scalar_t, int CS, bool AHEAD>
__device__ __forceinline__ void forward_tile(const PropagateParams& p, const BlockIndex& bi, float* line,
                                             unsigned char* stage_mem) {
  using EL = Elem<scalar_t>;
  using Bits = typename EL::bits;
  using PK = Packed<Bits>;
  constexpr int T = kFastTileF;
  constexpr int VB = T * int(sizeof(Bits));
  constexpr int NW = VB / 4;
  const BlockView<Bits, CS> v(p, bi, true);
  constexpr int LS = fast_line_stride(CS, false);
  float* const lq0 = line + (v.q + 1) * LS;  // this thread's position in exchange lines 0 and 1
  float* const lq1 = lq0 + p.pp * LS;
  Bits* const h = static_cast<Bits*>(p.h) + (bi.b * p.h_sb + bi.d * p.h_sd + (bi.grp * p.G + bi.sl * CS) * p.h_sc);
  const Stage<VB> st{stage_mem, int(blockDim.x), v.q};
  const int ntl = v.S / T;  // W % T == 0 (plan)

  auto issue = [&](int kt) {
    const int o = v.template tile_off<T>(kt);
#pragma unroll
    for (int k = 0; k < 3; ++k) st.copy(k, v.g + k * p.g_so + o);
#pragma unroll
    for (int c = 0; c < CS; ++c) {
      st.copy(3 + c, v.x + c * p.x_sc + o);
      st.copy(3 + CS + c, v.lam + c * p.lam_sc + o);
    }
  };

  uint32_t tg[3][NW] = {}, tx[CS][NW], tl[CS][NW];
  if (v.active) issue(0);
  copy_async_commit();
  int sm = 0;
  for (int kt = 0; kt < ntl; ++kt) {
    if (v.active) {
      copy_async_wait_all();
#pragma unroll
      for (int k = 0; k < 3; ++k) st.read(k, tg[k]);
#pragma unroll
      for (int c = 0; c < CS; ++c) {
        st.read(3 + c, tx[c]);
        st.read(3 + CS + c, tl[c]);
      }
      if (!v.inc) {  // element t is scan step kt * T + t
#pragma unroll
        for (int k = 0; k < 3; ++k) PK::reverse(tg[k]);
#pragma unroll
        for (int c = 0; c < CS; ++c) {
          PK::reverse(tx[c]);
          PK::reverse(tl[c]);
        }
      }
      if (kt + 1 < ntl) issue(kt + 1);  // lands while this tile is computed
      copy_async_commit();
    }
    // AHEAD: the tile's normalised weights before its steps.
    float wt[AHEAD ? T : 1][3];
    if constexpr (AHEAD) {
      int smt = sm;
#pragma unroll
      for (int t = 0; t < T; ++t) {
        const Weights gt = weights(EL::load(PK::get(tg[0], t)), EL::load(PK::get(tg[1], t)),
                                   EL::load(PK::get(tg[2], t)), v.q, v.L);  // branch-free (see forward_ring)
        const bool use = smt != 0;
        wt[t][0] = use ? gt.w0 : 0.f;
        wt[t][1] = use ? gt.w1 : 0.f;
        wt[t][2] = use ? gt.w2 : 0.f;
        smt = (smt + 1 == v.ce) ? 0 : smt + 1;
      }
    }
#pragma unroll
    for (int t = 0; t < T; ++t) {
      const bool restart = sm == 0;
      const float* prev = (t & 1) ? lq1 : lq0;  // step kt * T + t reads line t % 2 (T is even)
      float* next = (t & 1) ? lq0 : lq1;
      if (v.active) {
        float w0 = 0.f, w1 = 0.f, w2 = 0.f;
        if constexpr (AHEAD) {
          w0 = wt[t][0], w1 = wt[t][1], w2 = wt[t][2];
        } else if (!restart) {
          const Weights gt = weights(EL::load(PK::get(tg[0], t)), EL::load(PK::get(tg[1], t)),
                                     EL::load(PK::get(tg[2], t)), v.q, v.L);
          w0 = gt.w0;
          w1 = gt.w1;
          w2 = gt.w2;
        }
#pragma unroll
        for (int c = 0; c < CS; ++c) {
          float hv = EL::load(PK::get(tx[c], t)) * EL::load(PK::get(tl[c], t));
          if (!restart) {
            hv = fmaf(w0, prev[c - LS], hv);
            hv = fmaf(w1, prev[c], hv);
            hv = fmaf(w2, prev[c + LS], hv);
          }
          next[c] = hv;
          PK::put(tx[c], t, EL::store(hv));  // the output takes the place of x
        }
      }
      __syncthreads();
      sm = (sm + 1 == v.ce) ? 0 : sm + 1;
    }
    if (v.active) {
      const int o = v.template tile_off<T>(kt);
#pragma unroll
      for (int c = 0; c < CS; ++c) {
        if (!v.inc) PK::reverse(tx[c]);
        stg_words<NW>(h + c * p.h_sc + o, tx[c]);
      }
    }
  }
}

template <typename scalar_t, int CS, int NT>
__global__ void __launch_bounds__(NT) gspn_forward_fast_kernel(const __grid_constant__ PropagateParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  // Ring depth (steps in flight per thread): big blocks have 64 registers per thread.
  constexpr int D = NT > kFastSmallThreads ? 4 : CS <= 2 ? 8 : 4;
  constexpr bool AHEAD = NT <= kFastSmallThreads;
  const BlockIndex bi = block_index(p);
  if (bi.d < 2 ? p.ncta > 0 : p.vsplit > 0) return;  // the cluster kernel / the split kernel computes them
  if (p.ablate & (bi.d < 2 ? 8 : 16)) return;  // profiling only: skip one orientation
  float* const line = reinterpret_cast<float*>(smem);
  constexpr int LS = fast_line_stride(CS, false);
  static_assert(kFastTileF % 2 == 0, "the tile's steps alternate the two exchange lines");
  for (int i = threadIdx.x; i < 2 * LS * p.pp; i += blockDim.x) line[i] = 0.f;
  __syncthreads();
  if (bi.d < 2) {
    if (p.tile_h) {
      forward_tile<scalar_t, CS, AHEAD>(p, bi, line, smem + 2 * LS * p.pp * 4);
    } else {
      forward_ring<scalar_t, CS, D, true, AHEAD>(p, bi, line);
    }
  } else {
    forward_ring<scalar_t, CS, D, false, AHEAD>(p, bi, line);
  }
}

// ------------------------------------------------------------------------------------------------
// Backward: the reverse scan (see propagate_general.cu for the recurrence). Exchange line layout:
// ex[parity][position][kind * CS + c], LS floats per position (fast_line_stride, or unpadded:
// PropagateParams::ls), kinds 0..2 = C_o = w_o * adj of offsets -1, 0, +1; kind 3 = h_{s-1}.
// ------------------------------------------------------------------------------------------------

// One reverse-scan step of one pixel, given its gates (step_gates, computed ahead of the step): reads
// x, lam, grad_h of the CS channels and h_{s-1} from the exchange line, writes C_o and (given) h_{s-2}
// for the next step; returns grad_lam, the grad_x term and the gate-logit gradients.
template <int CS>
struct StepOut {
  float glam[CS], gx[CS], gg[3];
};

template <int CS>
__device__ __forceinline__ void backward_step(const Gates& gt, const float (&xv)[CS], const float (&lv)[CS],
                                              const float (&ghv)[CS], bool restart, bool has_next, int q, int L,
                                              const float* rq, float* wq, int LS, StepOut<CS>& out) {
  // rq, wq: this thread's position in the line read and the line written (kinds 0..3 x CS channels each,
  // LS floats per position: a constant in blocks of up to 256 threads).
  const float w0 = gt.w0, w1 = gt.w1, w2 = gt.w2;
  float gw0 = 0.f, gw1 = 0.f, gw2 = 0.f;
#pragma unroll
  for (int c = 0; c < CS; ++c) {
    float adj = ghv[c];
    if (has_next) {
      // C_0 from q, C_-1 from q + 1, C_+1 from q - 1.
      adj += (rq[1 * CS + c] + rq[LS + 0 * CS + c]) + rq[-LS + 2 * CS + c];
    }
    out.glam[c] = xv[c] * adj;
    out.gx[c] = lv[c] * adj;
    if (!restart) {
      gw0 = fmaf(adj, rq[-LS + 3 * CS + c], gw0);  // h_{s-1} at q - 1, q, q + 1
      gw1 = fmaf(adj, rq[3 * CS + c], gw1);
      gw2 = fmaf(adj, rq[LS + 3 * CS + c], gw2);
      wq[0 * CS + c] = w0 * adj;
      wq[1 * CS + c] = w1 * adj;
      wq[2 * CS + c] = w2 * adj;
    }
  }
  out.gg[0] = out.gg[1] = out.gg[2] = 0.f;
  if (!restart) gate_grads(gt, gw0, gw1, gw2, q, L, out.gg[0], out.gg[1], out.gg[2]);
}

// Output pointers of a block (q = 0, scan index 0).
template <typename Bits, int CS>
struct BackwardOut {
  Bits* glam;
  float* gx;
  Bits* gg;       // nsl == 1: the gate gradients in the input dtype
  float* gg_part; // nsl > 1: this slice's fp32 partials
  __device__ __forceinline__ BackwardOut(const PropagateParams& p, const BlockIndex& bi) {
    const int c0 = bi.grp * p.G + bi.sl * CS;
    glam = static_cast<Bits*>(p.grad_lam) + (bi.b * p.h_sb + bi.d * p.h_sd + c0 * p.h_sc);
    gx = p.grad_x_part + (bi.d * p.gxp_sd + bi.b * p.x_sb + c0 * p.x_sc);
    const int64_t goff = bi.b * p.g_sb + bi.d * p.g_sd + bi.grp * p.g_sk;
    gg = static_cast<Bits*>(p.grad_gates) + goff;
    gg_part = p.nsl > 1 ? p.grad_gates_part + bi.sl * p.ggp_ssl + goff : nullptr;
  }
};

template <typename scalar_t, int CS, int D, bool HORIZ, bool AHEAD, bool SPLIT = false>
__device__ __forceinline__ void backward_ring(const PropagateParams& p, const BlockIndex& bi, float* ex,
                                              const Split& sp = Split{}) {
  using EL = Elem<scalar_t>;
  using Bits = typename EL::bits;
  static_assert(D >= 3, "the ring must hold h two steps ahead");
  static_assert(!SPLIT || (AHEAD && kSplitHalo % D == 0), "a split line's exchanges fall on a group's last step");
  const BlockView<Bits, CS> v(p, bi, HORIZ, sp);
  constexpr bool UB = SPLIT;        // uniform plane bases and byte offsets, not pointers per thread
  constexpr bool H = AHEAD && !UB;  // held pointers (see held())
  const BackwardOut<Bits, CS> out(p, bi);
  const int LS = AHEAD ? fast_line_stride(CS, true) : p.ls;
  float* const eq0 = ex + (v.t + 1) * LS;  // this thread's slot in exchange lines 0 and 1
  float* const eq1 = eq0 + (SPLIT ? sp.pp : p.pp) * LS;
  const int c0 = bi.grp * p.G + bi.sl * CS;
  const Bits* const gh = static_cast<const Bits*>(p.grad_h) + (bi.b * p.h_sb + bi.d * p.h_sd + c0 * p.h_sc);
  const Bits* const hs = static_cast<const Bits*>(p.h_saved) + (bi.b * p.h_sb + bi.d * p.h_sd + c0 * p.h_sc);
  const bool part = p.nsl > 1;

  // Slot j holds processing index i (scan step s = S - 1 - i) with i % D == j. AHEAD: the gate slots are
  // refilled a group of D at a time, after the group's gates are normalised (see forward_ring, also for the
  // unconditional loads from plane pointers at this thread's pixel of step 0; here steps before the first
  // reread step 0). The outputs' pointers likewise, the gate gradients' in the dtype of where they go.
  // The 1024-thread blocks (64 registers) form them without holding them. UB: the split kernel (96
  // registers at 544 threads) has no room for them (held, they spilled and it took 1.35-1.40x the time, an
  // H100): each plane is its block base, the same for every thread and so kept in uniform registers, plus
  // a 32-bit byte offset, two instructions per access and no registers per thread. (The same addressing in
  // the 1024-thread blocks removed their spills but took 1.05x the time at B2xC2x512^2, an H100.)
  const Bits* pg[3];
  const Bits *px[CS], *pl[CS], *pgh[CS], *phs[CS];
  Bits* pglam[CS];
  float* pgx[CS];
  void* pgg[3];
#pragma unroll
  for (int k = 0; k < 3; ++k) {
    pg[k] = held<H>(v.g + k * p.g_so + v.oa);
    pgg[k] = part ? static_cast<void*>(held<H>(out.gg_part + k * p.g_so + v.oa))
                  : static_cast<void*>(held<H>(out.gg + k * p.g_so + v.oa));
  }
#pragma unroll
  for (int c = 0; c < CS; ++c) {
    px[c] = held<H>(v.x + c * p.x_sc + v.oa);
    pl[c] = held<H>(v.lam + c * p.lam_sc + v.oa);
    pgh[c] = held<H>(gh + c * p.h_sc + v.oa);
    phs[c] = held<H>(hs + c * p.h_sc + v.oa);
    pglam[c] = held<H>(out.glam + c * p.h_sc + v.oa);
    pgx[c] = held<H>(out.gx + c * p.x_sc + v.oa);
  }
  // UB: the planes' block bases (byte offsets from these).
  struct {
    const char *g[3], *x[CS], *l[CS], *gh[CS], *hs[CS];
    char *glam[CS], *gx[CS], *gg[3];
  } ub;
  if constexpr (UB) {
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      ub.g[k] = reinterpret_cast<const char*>(v.g + k * p.g_so);
      ub.gg[k] = part ? reinterpret_cast<char*>(out.gg_part + k * p.g_so) : reinterpret_cast<char*>(out.gg + k * p.g_so);
    }
#pragma unroll
    for (int c = 0; c < CS; ++c) {
      ub.x[c] = reinterpret_cast<const char*>(v.x + c * p.x_sc);
      ub.l[c] = reinterpret_cast<const char*>(v.lam + c * p.lam_sc);
      ub.gh[c] = reinterpret_cast<const char*>(gh + c * p.h_sc);
      ub.hs[c] = reinterpret_cast<const char*>(hs + c * p.h_sc);
      ub.glam[c] = reinterpret_cast<char*>(out.glam + c * p.h_sc);
      ub.gx[c] = reinterpret_cast<char*>(out.gx + c * p.x_sc);
    }
  }
  Bits rg[D][3] = {}, rx[D][CS], rl[D][CS], rgh[D][CS], rh[D][CS];
#define GSPN2_BWD_LOAD_GATES(j, i)                                                           \
  if constexpr (UB) {                                                                     \
    const uint32_t o_ = uint32_t(v.oa + max(v.S - 1 - (i), 0) * v.ds) * uint32_t(sizeof(Bits)); \
    _Pragma("unroll") for (int k = 0; k < 3; ++k) rg[j][k] = ldg_bits(at<const Bits>(ub.g[k], o_)); \
  } else {                                                                                   \
    const int o_ = max(v.S - 1 - (i), 0) * v.ds;                                             \
    _Pragma("unroll") for (int k = 0; k < 3; ++k) rg[j][k] = ldg_bits(pg[k] + o_);           \
  }
#define GSPN2_BWD_LOAD_REST(j, i)                                                            \
  if constexpr (UB) {                                                                     \
    const uint32_t o_ = uint32_t(v.oa + max(v.S - 1 - (i), 0) * v.ds) * uint32_t(sizeof(Bits)); \
    _Pragma("unroll") for (int c = 0; c < CS; ++c) {                                         \
      rx[j][c] = ldg_bits(at<const Bits>(ub.x[c], o_));                                      \
      rl[j][c] = ldg_bits(at<const Bits>(ub.l[c], o_));                                      \
      rgh[j][c] = ldg_bits(at<const Bits>(ub.gh[c], o_));                                    \
      rh[j][c] = ldg_bits(at<const Bits>(ub.hs[c], o_));                                     \
    }                                                                                        \
  } else {                                                                                   \
    const int o_ = max(v.S - 1 - (i), 0) * v.ds;                                             \
    _Pragma("unroll") for (int c = 0; c < CS; ++c) {                                         \
      rx[j][c] = ldg_bits(px[c] + o_);                                                       \
      rl[j][c] = ldg_bits(pl[c] + o_);                                                       \
      rgh[j][c] = ldg_bits(pgh[c] + o_);                                                     \
      rh[j][c] = ldg_bits(phs[c] + o_);                                                      \
    }                                                                                        \
  }
#pragma unroll
  for (int j = 0; j < D; ++j) {
    GSPN2_BWD_LOAD_GATES(j, j)
    GSPN2_BWD_LOAD_REST(j, j)
  }
  // The first step (s = S - 1) reads h_{S-2}: write it before the loop.
  if (v.active && v.S >= 2) {
#pragma unroll
    for (int c = 0; c < CS; ++c) eq0[3 * CS + c] = EL::load(rh[1][c]);
  }
  __syncthreads();

  int sm = (v.S - 1) % v.ce;  // s % ce of the step being processed
  Gates gq[AHEAD ? D : 1];    // the gates of the group's steps (AHEAD), or of the current step
  for (int i0 = 0; i0 < v.S; i0 += D) {
    if constexpr (AHEAD) {
      int smt = sm;
#pragma unroll
      for (int j = 0; j < D; ++j) {
        gq[j] = step_gates(EL::load(rg[j][0]), EL::load(rg[j][1]), EL::load(rg[j][2]), smt == 0, v.q, v.L);
        smt = (smt == 0) ? v.ce - 1 : smt - 1;
      }
#pragma unroll
      for (int j = 0; j < D; ++j) {
        GSPN2_BWD_LOAD_GATES(j, i0 + D + j)
      }
    }
#pragma unroll
    for (int j = 0; j < D; ++j) {
      const int i = i0 + j;
      if (i >= v.S) break;
      const int s = v.S - 1 - i;
      const bool restart = sm == 0;
      const bool has_next = i > 0 && sm + 1 != v.ce;
      const bool odd = (D % 2 == 0 ? j : i) & 1;  // step i reads line i % 2 (a constant when D is even)
      const float* rq = odd ? eq1 : eq0;
      float* wq = odd ? eq0 : eq1;
      if (v.active) {
        if constexpr (!AHEAD) {
          gq[0] = step_gates(EL::load(rg[j][0]), EL::load(rg[j][1]), EL::load(rg[j][2]), restart, v.q, v.L);
        }
        float xv[CS], lv[CS], ghv[CS];
#pragma unroll
        for (int c = 0; c < CS; ++c) {
          xv[c] = EL::load(rx[j][c]);
          lv[c] = EL::load(rl[j][c]);
          ghv[c] = EL::load(rgh[j][c]);
        }
        StepOut<CS> r;
        backward_step<CS>(gq[AHEAD ? j : 0], xv, lv, ghv, restart, has_next, v.q, v.L, rq, wq, LS, r);
        if (i + 2 < v.S) {  // h_{s-2} for the next step
#pragma unroll
          for (int c = 0; c < CS; ++c) wq[3 * CS + c] = EL::load(rh[(j + 2) % D][c]);
        }
        if (v.own && UB) {
          const uint32_t o = uint32_t(v.off(s));
          const uint32_t o2 = o * uint32_t(sizeof(Bits)), o4 = o * 4u;
#pragma unroll
          for (int c = 0; c < CS; ++c) {
            *at<Bits>(ub.glam[c], o2) = EL::store(r.glam[c]);
            *at<float>(ub.gx[c], o4) = r.gx[c];
          }
          if (part) {  // one branch for the three (uniform: predicated stores cost more here)
#pragma unroll
            for (int k = 0; k < 3; ++k) *at<float>(ub.gg[k], o4) = r.gg[k];
          } else {
#pragma unroll
            for (int k = 0; k < 3; ++k) *at<Bits>(ub.gg[k], o2) = EL::store(r.gg[k]);
          }
        } else if (v.own) {
          const int o = s * v.ds;
#pragma unroll
          for (int c = 0; c < CS; ++c) {
            stg_bits(pglam[c] + o, EL::store(r.glam[c]));
            stg_bits(pgx[c] + o, r.gx[c]);
          }
#pragma unroll
          for (int k = 0; k < 3; ++k) {
            if (part) {
              stg_bits(static_cast<float*>(pgg[k]) + o, r.gg[k]);
            } else {
              stg_bits(static_cast<Bits*>(pgg[k]) + o, EL::store(r.gg[k]));
            }
          }
        }
        if (!AHEAD) {
          GSPN2_BWD_LOAD_GATES(j, i + D)
        }
        GSPN2_BWD_LOAD_REST(j, i + D)
      }
      __syncthreads();
      if constexpr (UB) {  // the state handed on: C_o (kinds 0..2); h_{s-1} comes from memory
        if ((i + 1) % kSplitHalo == 0 && i + 1 < v.S) split_exchange<3 * CS>(sp, wq, (i / kSplitHalo) & 1);
      }
      sm = (sm == 0) ? v.ce - 1 : sm - 1;
    }
  }
#undef GSPN2_BWD_LOAD_GATES
#undef GSPN2_BWD_LOAD_REST
}

template <typename scalar_t, int CS, bool AHEAD>
__device__ __forceinline__ void backward_tile(const PropagateParams& p, const BlockIndex& bi, float* ex,
                                              unsigned char* stage_mem, unsigned char* out_mem) {
  using EL = Elem<scalar_t>;
  using Bits = typename EL::bits;
  using PK = Packed<Bits>;
  constexpr int T = kFastTileB;
  constexpr int VB = T * int(sizeof(Bits));
  constexpr int NW = VB / 4;
  const BlockView<Bits, CS> v(p, bi, true);
  const BackwardOut<Bits, CS> out(p, bi);
  const int LS = AHEAD ? fast_line_stride(CS, true) : p.ls;
  float* const eq0 = ex + (v.q + 1) * LS;  // this thread's position in exchange lines 0 and 1
  float* const eq1 = eq0 + p.pp * LS;
  const int c0 = bi.grp * p.G + bi.sl * CS;
  const Bits* const gh = static_cast<const Bits*>(p.grad_h) + (bi.b * p.h_sb + bi.d * p.h_sd + c0 * p.h_sc);
  const Bits* const hs = static_cast<const Bits*>(p.h_saved) + (bi.b * p.h_sb + bi.d * p.h_sd + c0 * p.h_sc);
  const bool part = p.nsl > 1;
  const Stage<VB> st{stage_mem, int(blockDim.x), v.q};
  const int nthr = blockDim.x;
  const int ntl = v.S / T;  // W % T == 0 (plan)
  // Stage planes: 0..2 gates, then CS each of x, lam, grad_h, h.
  const int kh = 3 + 3 * CS;

  auto issue = [&](int kt) {
    const int o = v.template tile_off<T>(kt);
#pragma unroll
    for (int k = 0; k < 3; ++k) st.copy(k, v.g + k * p.g_so + o);
#pragma unroll
    for (int c = 0; c < CS; ++c) {
      st.copy(3 + c, v.x + c * p.x_sc + o);
      st.copy(3 + CS + c, v.lam + c * p.lam_sc + o);
      st.copy(3 + 2 * CS + c, gh + c * p.h_sc + o);
      st.copy(kh + c, hs + c * p.h_sc + o);
    }
  };

  uint32_t tg[3][NW] = {}, tx[CS][NW], tl[CS][NW], tgh[CS][NW], th[CS][NW];
  if (v.active) issue(ntl - 1);
  copy_async_commit();
  int sm = (v.S - 1) % v.ce;
  for (int m = 0; m < ntl; ++m) {
    const int kt = ntl - 1 - m;  // tiles from the end of the scan
    if (v.active) {
      copy_async_wait_all();
#pragma unroll
      for (int k = 0; k < 3; ++k) st.read(k, tg[k]);
#pragma unroll
      for (int c = 0; c < CS; ++c) {
        st.read(3 + c, tx[c]);
        st.read(3 + CS + c, tl[c]);
        st.read(3 + 2 * CS + c, tgh[c]);
        st.read(kh + c, th[c]);
      }
      if (!v.inc) {  // element t is scan step kt * T + t
#pragma unroll
        for (int k = 0; k < 3; ++k) PK::reverse(tg[k]);
#pragma unroll
        for (int c = 0; c < CS; ++c) {
          PK::reverse(tx[c]);
          PK::reverse(tl[c]);
          PK::reverse(tgh[c]);
          PK::reverse(th[c]);
        }
      }
      if (kt > 0) issue(kt - 1);
      copy_async_commit();
    }
    if (m == 0) {  // the first step (s = S - 1 = element T - 1) reads h_{S-2} = element T - 2
      if (v.active) {
#pragma unroll
        for (int c = 0; c < CS; ++c) eq0[3 * CS + c] = EL::load(PK::get(th[c], T - 2));
      }
      __syncthreads();
    }
    // AHEAD: the tile's gates before its steps.
    Gates gts[AHEAD ? T : 1];
    if constexpr (AHEAD) {
      int smt = sm;
#pragma unroll
      for (int t = T - 1; t >= 0; --t) {
        gts[t] = step_gates(EL::load(PK::get(tg[0], t)), EL::load(PK::get(tg[1], t)), EL::load(PK::get(tg[2], t)),
                            smt == 0, v.q, v.L);
        smt = (smt == 0) ? v.ce - 1 : smt - 1;
      }
    }
    // Outputs wait in a per-thread output stage, element (plane, t) of thread q at (plane * T + t) *
    // nthreads + q (conflict-free stores), until the tile is written as vectors: holding them in
    // registers would spill.
    Bits* const o_lam = reinterpret_cast<Bits*>(out_mem);
    float* const o_f = reinterpret_cast<float*>(out_mem + align16(CS * T * nthr * int(sizeof(Bits))));
#pragma unroll
    for (int t = T - 1; t >= 0; --t) {
      const int s = kt * T + t;
      const bool restart = sm == 0;
      const bool has_next = s < v.S - 1 && sm + 1 != v.ce;
      const bool odd = (T - 1 - t) & 1;  // processing index m * T + T - 1 - t reads line (T - 1 - t) % 2
      const float* rq = odd ? eq1 : eq0;
      float* wq = odd ? eq0 : eq1;
      if (v.active) {
        float xv[CS], lv[CS], ghv[CS];
#pragma unroll
        for (int c = 0; c < CS; ++c) {
          xv[c] = EL::load(PK::get(tx[c], t));
          lv[c] = EL::load(PK::get(tl[c], t));
          ghv[c] = EL::load(PK::get(tgh[c], t));
        }
        if constexpr (!AHEAD) {
          gts[0] = step_gates(EL::load(PK::get(tg[0], t)), EL::load(PK::get(tg[1], t)), EL::load(PK::get(tg[2], t)),
                              restart, v.q, v.L);
        }
        StepOut<CS> r;
        backward_step<CS>(gts[AHEAD ? t : 0], xv, lv, ghv, restart, has_next, v.q, v.L, rq, wq, LS, r);
        if (s >= 2) {  // h_{s-2} for the next step: this tile's element t - 2, or the next tile's
#pragma unroll
          for (int c = 0; c < CS; ++c) {
            float hv;
            if (t >= 2) {
              hv = EL::load(PK::get(th[c], t - 2));
            } else {
              if (t == 1) copy_async_wait_all();  // tile kt - 1 has landed in the stage
              const int u = T - 2 + t;            // its element holding scan step s - 2
              hv = EL::load(st.template peek<Bits>(kh + c, v.inc ? u : T - 1 - u));
            }
            wq[3 * CS + c] = hv;
          }
        }
#pragma unroll
        for (int c = 0; c < CS; ++c) {
          o_lam[(c * T + t) * nthr + v.q] = EL::store(r.glam[c]);
          o_f[(c * T + t) * nthr + v.q] = r.gx[c];
        }
#pragma unroll
        for (int k = 0; k < 3; ++k) o_f[((CS + k) * T + t) * nthr + v.q] = r.gg[k];
      }
      __syncthreads();
      sm = (sm == 0) ? v.ce - 1 : sm - 1;
    }
    if (v.active) {  // memory order: element t of the stage is scan step kt * T + t
      const int o = v.template tile_off<T>(kt);
      auto at = [&](int t) { return v.inc ? t : T - 1 - t; };
#pragma unroll
      for (int c = 0; c < CS; ++c) {
        uint32_t w[NW];
        float f[T];
#pragma unroll
        for (int t = 0; t < T; ++t) {
          PK::put(w, t, o_lam[(c * T + at(t)) * nthr + v.q]);
          f[t] = o_f[(c * T + at(t)) * nthr + v.q];
        }
        stg_words<NW>(out.glam + c * p.h_sc + o, w);
        stg_floats<T>(out.gx + c * p.x_sc + o, f);
      }
#pragma unroll
      for (int k = 0; k < 3; ++k) {
        float f[T];
#pragma unroll
        for (int t = 0; t < T; ++t) f[t] = o_f[((CS + k) * T + at(t)) * nthr + v.q];
        if (part) {
          stg_floats<T>(out.gg_part + k * p.g_so + o, f);
        } else {
          uint32_t w[NW];
#pragma unroll
          for (int t = 0; t < T; ++t) PK::put(w, t, EL::store(f[t]));
          stg_words<NW>(out.gg + k * p.g_so + o, w);
        }
      }
    }
  }
}

template <typename scalar_t, int CS, int NT>
__global__ void __launch_bounds__(NT) gspn_backward_fast_kernel(const __grid_constant__ PropagateParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int D = NT > kFastSmallThreads ? 3 : 4;
  constexpr bool AHEAD = NT <= kFastSmallThreads;
  const BlockIndex bi = block_index(p);
  if (bi.d < 2 ? p.ncta > 0 : p.vsplit > 0) return;  // the cluster kernel / the split kernel computes them
  if (p.ablate & (bi.d < 2 ? 8 : 16)) return;  // profiling only: skip one orientation
  float* const ex = reinterpret_cast<float*>(smem);
  const int LS = AHEAD ? fast_line_stride(CS, true) : p.ls;
  static_assert(kFastTileB % 2 == 0, "the tile's steps alternate the two exchange lines");
  for (int i = threadIdx.x; i < 2 * LS * p.pp; i += blockDim.x) ex[i] = 0.f;
  __syncthreads();
  if (bi.d < 2) {
    if (p.tile_h) {
      constexpr int T = kFastTileB;
      constexpr int esize = int(sizeof(typename Elem<scalar_t>::bits));
      unsigned char* const stage = smem + 2 * LS * p.pp * 4;
      backward_tile<scalar_t, CS, AHEAD>(p, bi, ex, stage, stage + blockDim.x * (3 + 4 * CS) * T * esize);
    } else {
      backward_ring<scalar_t, CS, D, true, AHEAD>(p, bi, ex);
    }
  } else {
    backward_ring<scalar_t, CS, D, false, AHEAD>(p, bi, ex);
  }
}

// ------------------------------------------------------------------------------------------------
// Split vertical lines: one channel per CTA, grid (cluster rank fastest, then direction 2 / 3, slice,
// group, batch), the ring with the gates normalised ahead (D = 8 forward, 4 backward).
// ------------------------------------------------------------------------------------------------

__device__ __forceinline__ BlockIndex split_block_index(const PropagateParams& p) {
  int bid = blockIdx.x / p.vsplit;
  BlockIndex r;
  r.d = 2 + (bid & 1);
  bid >>= 1;
  r.sl = bid % p.nsl;
  bid /= p.nsl;
  r.grp = bid % p.K;
  r.b = bid / p.K;
  return r;
}

// Zeroes the exchange lines and the inboxes (NV values per position), then waits for every CTA of the
// cluster: none may store into a neighbour that has not started.
__device__ __forceinline__ Split split_setup(const PropagateParams& p, float* lines, int ls, int nv) {
  Split sp;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  sp.rank = int(cluster.block_rank());
  sp.n = p.vsplit;
  sp.base = sp.rank * p.vs_R - kSplitHalo;
  sp.lo = kSplitHalo;
  sp.hi = kSplitHalo + p.vs_R;
  sp.span = p.vs_R + 2 * kSplitHalo;
  sp.pp = p.vs_pp;
  sp.inbox = lines + 2 * ls * p.vs_pp;
  const int nz = 2 * ls * p.vs_pp + 4 * kSplitHalo * nv;
  for (int i = threadIdx.x; i < nz; i += blockDim.x) lines[i] = 0.f;
  cluster.sync();
#endif
  return sp;
}

template <typename scalar_t>
__global__ void __launch_bounds__(kSplitMaxThreads)
    gspn_forward_split_kernel(const __grid_constant__ PropagateParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  float* const line = reinterpret_cast<float*>(smem);
  const Split sp = split_setup(p, line, fast_line_stride(1, false), 1);
  forward_ring<scalar_t, 1, 8, false, true, true>(p, split_block_index(p), line, sp);
}

template <typename scalar_t>
__global__ void __launch_bounds__(kSplitMaxThreads)
    gspn_backward_split_kernel(const __grid_constant__ PropagateParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  float* const ex = reinterpret_cast<float*>(smem);
  const Split sp = split_setup(p, ex, fast_line_stride(1, true), 3);
  backward_ring<scalar_t, 1, 4, false, true, true>(p, split_block_index(p), ex, sp);
}

// ------------------------------------------------------------------------------------------------
// Launch
// ------------------------------------------------------------------------------------------------

template <typename Kernel>
void launch_split(Kernel kernel, const PropagateParams& p, cudaStream_t stream) {
  allow_dynamic_smem(kernel, p.vs_smem);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(p.vsplit * 2 * p.B * p.K * p.nsl);
  cfg.blockDim = dim3(p.vs_nt);
  cfg.dynamicSmemBytes = size_t(p.vs_smem);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = p.vsplit;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p));
}

// Whether the streaming kernel has blocks to run: not when the cluster kernel takes the horizontal directions
// and the split kernel the vertical ones.
bool streaming_blocks_left(const PropagateParams& p) { return p.ncta == 0 || p.vsplit == 0; }

template <typename Kernel>
void launch(Kernel kernel, const PropagateParams& p, cudaStream_t stream) {
  allow_dynamic_smem(kernel, p.smem_bytes);
  kernel<<<dim3(4 * p.B * p.K * p.nsl), dim3(p.nt), p.smem_bytes, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The streaming kernels' instantiations: (channels per block, threads per block) for the plan.
template <typename Fn>
void dispatch_fast_shape(const PropagateParams& p, Fn&& fn) {
  using std::integral_constant;
  if (p.nt > kFastSmallThreads) {
    fn(integral_constant<int, 1>{}, integral_constant<int, kFastMaxLine>{});
  } else if (p.cs == 4) {
    fn(integral_constant<int, 4>{}, integral_constant<int, kFastSmallThreads>{});
  } else if (p.cs == 2) {
    fn(integral_constant<int, 2>{}, integral_constant<int, kFastSmallThreads>{});
  } else {
    fn(integral_constant<int, 1>{}, integral_constant<int, kFastSmallThreads>{});
  }
}

}  // namespace

void launch_forward_fast(const PropagateParams& p, cudaStream_t stream) {
  dispatch_dtype(p.dtype, [&](auto elem) {
    if (streaming_blocks_left(p)) {
      dispatch_fast_shape(p, [&](auto cs, auto nt) {
        launch(gspn_forward_fast_kernel<decltype(elem), decltype(cs)::value, decltype(nt)::value>, p, stream);
      });
    }
    if (p.vsplit > 0 && !(p.ablate & 16)) launch_split(gspn_forward_split_kernel<decltype(elem)>, p, stream);
  });
}

void launch_backward_fast(const PropagateParams& p, cudaStream_t stream) {
  dispatch_dtype(p.dtype, [&](auto elem) {
    if (streaming_blocks_left(p)) {
      dispatch_fast_shape(p, [&](auto cs, auto nt) {
        launch(gspn_backward_fast_kernel<decltype(elem), decltype(cs)::value, decltype(nt)::value>, p, stream);
      });
    }
    if (p.vsplit > 0 && !(p.ablate & 16)) launch_split(gspn_backward_split_kernel<decltype(elem)>, p, stream);
  });
}

}  // namespace gspn2
