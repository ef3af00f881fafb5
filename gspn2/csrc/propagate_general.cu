// The general kernels (any line length up to about 4096 pixels): forward and backward of all four directions,
// and the backward's reduce pass, which every kernel family shares (grad_x = the sum of the directions' fp32
// terms, gate gradients = the sum of the slices' partials).
//
// One launch covers all four directions: block (d, b, group, slice) scans one direction of one image
// for a slice of `cs` channels that share one affinity group. The whole line (H or W positions) lives
// in the block, because every step couples neighbouring positions; the scan axis is walked in tiles
// of T steps, double buffered in shared memory:
//
//   * staging (cp.async, no registers): tile k + 1 (raw gate logits, x, lam, ...: T steps x the
//     line) is copied while tile k is computed. Vertical scans copy rows in 16-byte pieces along the
//     line; horizontal scans copy each line position's T consecutive steps (contiguous along W) in
//     4-byte pieces placed transposed, so a warp covers whole 32-byte sectors and the compute loop
//     always reads "step t at consecutive line positions" without bank conflicts.
//   * compute: one thread per line position (looping over positions for lines longer than the block)
//     and all channels of the slice: the gates are normalised once per pixel (sigmoid, boundary-aware
//     sum, divide) and reused for every channel. The previous line is kept on chip in fp32; one
//     barrier per step.
//   * outputs are written from shared memory after each tile, in accesses of up to 16 bytes along W.
//
// No float atomics: the backward reduces gate gradients over the slice's channels in registers, and
// writes per-direction grad_x terms and, when a group spans several blocks, per-slice gate-gradient
// partials that a second small kernel sums in a fixed order. Both passes are deterministic.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <c10/cuda/CUDAException.h>

#include "propagate.h"
#include "propagate_device.cuh"

namespace gspn2 {
namespace {

using namespace dev;

__device__ __forceinline__ uint32_t get_word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}
__device__ __forceinline__ void set_word(uint4& v, int i, uint32_t w) {
  if (i == 0) v.x = w;
  else if (i == 1) v.y = w;
  else if (i == 2) v.z = w;
  else v.w = w;
}
// Element e of a 16-byte register chunk (e is a compile-time constant after unrolling).
template <typename Bits>
__device__ __forceinline__ void pack(uint4& v, int e, Bits b);
template <>
__device__ __forceinline__ void pack<uint32_t>(uint4& v, int e, uint32_t b) { set_word(v, e, b); }
template <>
__device__ __forceinline__ void pack<uint16_t>(uint4& v, int e, uint16_t b) {
  const uint32_t w = get_word(v, e >> 1);
  set_word(v, e >> 1, (e & 1) ? ((w & 0xffffu) | (uint32_t(b) << 16)) : ((w & 0xffff0000u) | b));
}

// Stores of 2, 4, 8 or 16 bytes (uniform per launch).
__device__ __forceinline__ void stg_chunk(void* p, const uint4& v, int bytes) {
  if (bytes == 16) {
    *static_cast<uint4*>(p) = v;
  } else if (bytes == 8) {
    *static_cast<uint2*>(p) = make_uint2(v.x, v.y);
  } else if (bytes == 4) {
    *static_cast<unsigned int*>(p) = v.x;
  } else {
    *static_cast<unsigned short*>(p) = static_cast<unsigned short>(v.x);
  }
}
__device__ __forceinline__ uint4 lds_chunk(const void* p, int bytes) {
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  if (bytes == 16) {
    v = *static_cast<const uint4*>(p);
  } else if (bytes == 8) {
    const uint2 t = *static_cast<const uint2*>(p);
    v.x = t.x;
    v.y = t.y;
  } else if (bytes == 4) {
    v.x = *static_cast<const unsigned int*>(p);
  } else {
    v.x = *static_cast<const unsigned short*>(p);
  }
  return v;
}

// Barrier over the block's first `n` threads (a multiple of 32); warps past `n` have exited.
__device__ __forceinline__ void block_sync(int n) { asm volatile("bar.sync 1, %0;" ::"r"(n) : "memory"); }

// Offset of element (t, q) in a tile plane (SmemLayout): 16-bit horizontal planes keep the two scan
// steps of a 4-byte copy side by side.
template <typename Bits, bool HORIZ>
struct PlaneIndex {
  static constexpr bool kPaired = HORIZ && sizeof(Bits) == 2;
  static constexpr int kQ = kPaired ? 2 : 1;  // element stride between line positions
  static __device__ __forceinline__ int row(int t, int pitch) {
    return kPaired ? (((t >> 1) * pitch) << 1) + (t & 1) : t * pitch;
  }
  static __device__ __forceinline__ int at(int t, int q, int pitch) { return row(t, pitch) + q * kQ; }
};

// ------------------------------------------------------------------------------------------------
// Tile copies between global memory and the shared-memory tile planes (CopySet: propagate.h).
// ------------------------------------------------------------------------------------------------

// The copy loops run plane by plane, so a job only decodes its position inside the plane. Horizontal
// scans: unit u = (line position q, access b along W), E elements landing transposed in rows
// b*E .. b*E+E-1 of column q. Vertical scans: unit u = (tile row r, access b along the line).
template <bool HORIZ>
__device__ __forceinline__ void unit_pos(const CopySet& s, int u, int W, int pitch, int& r, int& q, int& goff_rel) {
  const int a = s.inner.div(u);
  const int b = u - a * int(s.inner.d);
  if (HORIZ) {
    q = a;
    r = b * s.E;
    goff_rel = a * W + r;  // plus the tile's first image index
  } else {
    r = a;
    q = b * s.E;
    goff_rel = a * W + q;  // plus (first image index) * W
  }
}

// Issue the copies of one tile (image indices row0 .. row0 + rows - 1 of every plane) into shared memory.
template <typename Bits, bool HORIZ, typename GPtr, typename SPtr>
__device__ __forceinline__ void load_tile(const CopySet& s, int row0, int tid, int nta, int W, int S, int pitch,
                                          GPtr gptr, SPtr sptr) {
  const int bytes = s.E * int(sizeof(Bits));
  const int units = int(s.units.d);
  const int64_t gshift = HORIZ ? row0 : int64_t(row0) * W;
  for (int pl = 0; pl < s.nplanes; ++pl) {
    const Bits* const g = gptr(pl) + gshift;
    Bits* const sp = sptr(pl);
    for (int u = tid; u < units; u += nta) {
      int r, q, go;
      unit_pos<HORIZ>(s, u, W, pitch, r, q, go);
      const int idx = row0 + r;
      if (idx < 0 || idx >= S) continue;
      const int so = HORIZ ? PlaneIndex<Bits, HORIZ>::at(r, q, pitch) : r * pitch + q;
      copy_async(sp + so, g + go, bytes);
    }
  }
}

// Shared planes -> global memory (outputs are written once, straight after their tile).
template <typename Bits, bool HORIZ, typename GPtr, typename SPtr>
__device__ __forceinline__ void store_tile(const CopySet& s, int row0, int tid, int nta, int W, int S, int pitch,
                                           GPtr gptr, SPtr sptr) {
  const int bytes = s.E * int(sizeof(Bits));
  const int units = int(s.units.d);
  const int64_t gshift = HORIZ ? row0 : int64_t(row0) * W;
  for (int pl = 0; pl < s.nplanes; ++pl) {
    Bits* const g = gptr(pl) + gshift;
    const Bits* const sp = sptr(pl);
    for (int u = tid; u < units; u += nta) {
      int r, q, go;
      unit_pos<HORIZ>(s, u, W, pitch, r, q, go);
      const int idx = row0 + r;
      if (idx < 0 || idx >= S) continue;
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (HORIZ) {
#pragma unroll
        for (int e = 0; e < int(16 / sizeof(Bits)); ++e) {
          if (e < s.E) pack<Bits>(v, e, sp[PlaneIndex<Bits, HORIZ>::at(r + e, q, pitch)]);
        }
      } else {
        v = lds_chunk(sp + r * pitch + q, bytes);
      }
      stg_chunk(g + go, v, bytes);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Forward
// ------------------------------------------------------------------------------------------------

template <typename scalar_t, bool HORIZ>
__device__ __forceinline__ void forward_block(const PropagateParams& p, const BlockIndex& bi,
                                              unsigned char* smem) {
  using EL = Elem<scalar_t>;
  using Bits = typename EL::bits;
  using PI = PlaneIndex<Bits, HORIZ>;
  const int L = HORIZ ? p.H : p.W;  // line length
  const int S = HORIZ ? p.W : p.H;  // scan steps
  const int W = p.W;
  const bool inc = (bi.d & 1) == 0;  // directions 0 and 2 walk the image index upwards
  const int nxa = min(p.nx, round_up(L, 32));
  const int nta = nxa * p.ny;
  const int tid = threadIdx.x;
  if (tid >= nta) return;

  const SmemLayout lay = smem_layout(p, HORIZ, false);
  const int pitch = lay.pitch;
  const int pp = lay.pp;
  const int cs = p.cs;
  const int T = p.T;
  const int c0 = bi.grp * p.G + bi.sl * cs;
  const int plane_elems = lay.plane_bytes / int(sizeof(Bits));
  const int buf_elems = lay.buf_bytes / int(sizeof(Bits));
  Bits* const planes = reinterpret_cast<Bits*>(smem);
  float* const line = reinterpret_cast<float*>(smem + lay.line_off);

  // Input planes of a buffer: 0..2 gate logits, 3 .. 3+cs-1 x, then lam (overwritten in place by h).
  auto in_gptr = [&](int pl) -> const Bits* {
    if (pl < 3) {
      return static_cast<const Bits*>(p.gates) + (bi.b * p.g_sb + bi.d * p.g_sd + pl * p.g_so + bi.grp * p.g_sk);
    }
    if (pl < 3 + cs) return static_cast<const Bits*>(p.x) + (bi.b * p.x_sb + (c0 + pl - 3) * p.x_sc);
    return static_cast<const Bits*>(p.lam) + (bi.b * p.lam_sb + bi.d * p.lam_sd + (c0 + pl - 3 - cs) * p.lam_sc);
  };
  auto out_gptr = [&](int pl) -> Bits* {
    return static_cast<Bits*>(p.h) + (bi.b * p.h_sb + bi.d * p.h_sd + (c0 + pl) * p.h_sc);
  };

  for (int i = tid; i < 2 * cs * pp; i += nta) line[i] = 0.f;

  const CopySet& ld = p.copy[HORIZ ? 0 : 1][kLoadMain];
  const CopySet& st = p.copy[HORIZ ? 0 : 1][kStoreMain];
  const int nt = (S + T - 1) / T;
  const int ce = (p.chunk > 0 && p.chunk < S) ? p.chunk : S;  // restart period in steps

  load_tile<Bits, HORIZ>(ld, (inc ? 0 : nt - 1) * T, tid, nta, W, S, pitch, in_gptr,
                         [&](int pl) { return planes + pl * plane_elems; });
  copy_async_commit();

  int parity = 0;
  int sm = 0;  // s % ce of the step being computed
  for (int it = 0; it < nt; ++it) {
    const int k = inc ? it : nt - 1 - it;
    const int kn = inc ? k + 1 : k - 1;
    Bits* const buf = planes + (p.nbuf == 2 ? it & 1 : 0) * buf_elems;
    auto load_next = [&]() {
      Bits* const nb = planes + (p.nbuf == 2 ? (it + 1) & 1 : 0) * buf_elems;
      load_tile<Bits, HORIZ>(ld, kn * T, tid, nta, W, S, pitch, in_gptr, [&](int pl) { return nb + pl * plane_elems; });
      copy_async_commit();
    };
    copy_async_wait_all();
    block_sync(nta);  // tile k has landed, and everyone is done with the other buffer
    if (p.nbuf == 2 && it + 1 < nt) load_next();  // tile k +- 1 lands while this one is computed

    const int nvalid = min(T, S - k * T);
    for (int i = 0; i < nvalid; ++i) {
      const int t = inc ? i : nvalid - 1 - i;
      const bool restart = sm == 0;
      const float* prev = line + parity * cs * pp;
      float* next = line + (parity ^ 1) * cs * pp;
      if (tid < nxa && !(p.ablate & 2)) {
        const int rb = PI::row(t, pitch);
        for (int q = tid; q < L; q += nxa) {
          const int o = rb + q * PI::kQ;
          float w0 = 0.f, w1 = 0.f, w2 = 0.f;
          if (!restart) {
            const Weights g = weights(EL::load(buf[o]), EL::load(buf[plane_elems + o]),
                                      EL::load(buf[2 * plane_elems + o]), q, L);
            w0 = g.w0;
            w1 = g.w1;
            w2 = g.w2;
          }
          for (int c = 0; c < cs; ++c) {
            Bits* lam_c = buf + (3 + cs + c) * plane_elems;
            float hv = EL::load(buf[(3 + c) * plane_elems + o]) * EL::load(lam_c[o]);
            if (!restart) {
              const float* pc = prev + c * pp + q;  // positions q-1, q, q+1 (halo-shifted by one)
              hv = fmaf(w0, pc[0], hv);
              hv = fmaf(w1, pc[1], hv);
              hv = fmaf(w2, pc[2], hv);
            }
            next[c * pp + q + 1] = hv;
            lam_c[o] = EL::store(hv);
          }
        }
      }
      block_sync(nta);
      parity ^= 1;
      sm = (sm + 1 == ce) ? 0 : sm + 1;
    }

    store_tile<Bits, HORIZ>(st, k * T, tid, nta, W, S, pitch, out_gptr,
                            [&](int pl) -> const Bits* { return buf + (3 + cs + pl) * plane_elems; });
    if (p.nbuf == 1 && it + 1 < nt) {  // one buffer (long lines): refill it once it is written out
      block_sync(nta);
      load_next();
    }
  }
}

template <typename scalar_t>
__global__ void __launch_bounds__(kMaxThreadsForward, 1) gspn_forward_kernel(const __grid_constant__ PropagateParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const BlockIndex bi = block_index(p);
  if (bi.d < 2) {
    forward_block<scalar_t, true>(p, bi, smem);
  } else {
    forward_block<scalar_t, false>(p, bi, smem);
  }
}

// ------------------------------------------------------------------------------------------------
// Backward: the reverse scan (gspn2.ops.reference.gspn_propagate_backward_ref)
//
//   adj_s(q)  = grad_h_s(q) + sum_o C_o[s+1](q - o),   C_o[s](q) = w_o[s](q) * adj_s(q)
//   grad_lam  = x * adj,  grad_x += lam * adj,  grad_w_o[s](q) = sum_c adj_s(q) * h_{s-1}(q + o)
//
// and the gate-logit gradient through the normalisation. C_o is exchanged through a double-buffered
// fp32 line in shared memory; h_{s-1} comes from the saved forward output (plus the step just outside
// the tile, loaded with it).
// ------------------------------------------------------------------------------------------------

template <typename scalar_t, bool HORIZ>
__device__ __forceinline__ void backward_block(const PropagateParams& p, const BlockIndex& bi,
                                               unsigned char* smem) {
  using EL = Elem<scalar_t>;
  using Bits = typename EL::bits;
  using PI = PlaneIndex<Bits, HORIZ>;
  const int L = HORIZ ? p.H : p.W;
  const int S = HORIZ ? p.W : p.H;
  const int W = p.W;
  const bool inc = (bi.d & 1) == 0;
  const int nxa = min(p.nx, round_up(L, 32));
  const int nta = nxa * p.ny;
  const int tid = threadIdx.x;
  if (tid >= nta) return;

  const SmemLayout lay = smem_layout(p, HORIZ, true);
  const int pitch = lay.pitch;
  const int pp = lay.pp;
  const int cs = p.cs;
  const int T = p.T;
  const int ext = boundary_rows(p, HORIZ);
  const int c0 = bi.grp * p.G + bi.sl * cs;
  const int plane_elems = lay.plane_bytes / int(sizeof(Bits));
  const int bnd_elems = lay.bnd_plane_bytes / int(sizeof(Bits));
  const int buf_elems = lay.buf_bytes / int(sizeof(Bits));
  const int nplanes = lay.nplanes;
  Bits* const planes = reinterpret_cast<Bits*>(smem);
  float* const line = reinterpret_cast<float*>(smem + lay.line_off);
  const bool gg_f32 = lay.gg_esize == 4;

  // Input planes of a buffer: 0..2 gates, then cs each of x, lam, grad_h, h; then the cs boundary
  // planes (set 1: h just outside the tile).
  auto in_gptr = [&](int pl) -> const Bits* {
    if (pl < 3) {
      return static_cast<const Bits*>(p.gates) + (bi.b * p.g_sb + bi.d * p.g_sd + pl * p.g_so + bi.grp * p.g_sk);
    }
    pl -= 3;
    if (pl < cs) return static_cast<const Bits*>(p.x) + (bi.b * p.x_sb + (c0 + pl) * p.x_sc);
    pl -= cs;
    if (pl < cs) return static_cast<const Bits*>(p.lam) + (bi.b * p.lam_sb + bi.d * p.lam_sd + (c0 + pl) * p.lam_sc);
    pl -= cs;
    const Bits* base = static_cast<const Bits*>(pl < cs ? p.grad_h : p.h_saved);
    return base + (bi.b * p.h_sb + bi.d * p.h_sd + (c0 + (pl < cs ? pl : pl - cs)) * p.h_sc);
  };
  auto bnd_gptr = [&](int pl) -> const Bits* {
    return static_cast<const Bits*>(p.h_saved) + (bi.b * p.h_sb + bi.d * p.h_sd + (c0 + pl) * p.h_sc);
  };

  for (int i = tid; i < 2 * 3 * cs * pp; i += nta) line[i] = 0.f;

  const CopySet& ld = p.copy[HORIZ ? 0 : 1][kLoadMain];
  const CopySet& lb = p.copy[HORIZ ? 0 : 1][kLoadBoundary];
  const CopySet& st_lam = p.copy[HORIZ ? 0 : 1][kStoreMain];
  const CopySet& st_gx = p.copy[HORIZ ? 0 : 1][kStoreGradX];
  const CopySet& st_gg = p.copy[HORIZ ? 0 : 1][kStoreGradGates];
  const int nt = (S + T - 1) / T;
  const int ce = (p.chunk > 0 && p.chunk < S) ? p.chunk : S;

  // Tile k into buffer `b`: its T steps, and the boundary rows just before (inc) or after it.
  auto load = [&](int k, int b) {
    Bits* const base = planes + b * buf_elems;
    load_tile<Bits, HORIZ>(ld, k * T, tid, nta, W, S, pitch, in_gptr,
                           [&](int pl) { return base + pl * plane_elems; });
    load_tile<Bits, HORIZ>(lb, inc ? k * T - ext : k * T + T, tid, nta, W, S, pitch, bnd_gptr,
                           [&](int pl) { return base + nplanes * plane_elems + pl * bnd_elems; });
    copy_async_commit();
  };

  load(inc ? nt - 1 : 0, 0);

  int parity = 0;
  int sm = (S - 1) % ce;  // s % ce of the step being processed (the scan runs s = S-1 .. 0)
  bool first = true;
  for (int it = 0; it < nt; ++it) {
    const int k = inc ? nt - 1 - it : it;
    const int kn = inc ? k - 1 : k + 1;
    Bits* const buf = planes + (p.nbuf == 2 ? it & 1 : 0) * buf_elems;
    copy_async_wait_all();
    block_sync(nta);
    if (p.nbuf == 2 && it + 1 < nt) load(kn, (it + 1) & 1);

    // fp32 planes of this tile's grad_x terms and (if fp32) gate gradients.
    float* const gxs = lay.gx_plane_bytes > 0 ? reinterpret_cast<float*>(smem + lay.gx_off)
                                              : reinterpret_cast<float*>(buf + (3 + cs) * plane_elems);
    const int gx_elems = lay.gx_plane_bytes > 0 ? lay.gx_plane_bytes / 4 : plane_elems;
    unsigned char* const ggs = lay.gg_plane_bytes > 0 ? smem + lay.gg_off : reinterpret_cast<unsigned char*>(buf);
    const int gg_elems = lay.gg_plane_bytes > 0 ? lay.gg_plane_bytes / 4 : lay.plane_bytes / lay.gg_esize;

    const int nvalid = min(T, S - k * T);
    for (int i = 0; i < nvalid; ++i) {
      const int t = inc ? nvalid - 1 - i : i;
      const bool restart = sm == 0;                  // h_{s-1} does not feed step s
      const bool has_next = !first && sm + 1 != ce;  // step s+1 exists and feeds back into s
      const float* rd = line + parity * 3 * cs * pp;
      float* wr = line + (parity ^ 1) * 3 * cs * pp;
      // h_{s-1}: image index kT + t - 1 (inc) or kT + t + 1 (dec); outside the tile it sits in the
      // boundary planes. (A partial last tile of a decreasing scan ends on s = 0, a restart.)
      const bool from_bnd = inc ? t == 0 : t == T - 1;
      const int hrb = PI::row(from_bnd ? (inc ? ext - 1 : 0) : (inc ? t - 1 : t + 1), pitch);
      if (tid < nxa && !(p.ablate & 2)) {
        const int rb = PI::row(t, pitch);
        for (int q = tid; q < L; q += nxa) {
          const int o = rb + q * PI::kQ;  // this step's element in the Bits planes
          const int o32 = t * pitch + q;  // ... and in the fp32 planes
          Gates g = {0.f, 0.f, 0.f, 1.f, 0.f, 0.f, 0.f, false};  // a restart step: zero weights
          if (!restart) {
            g = normalise(EL::load(buf[o]), EL::load(buf[plane_elems + o]), EL::load(buf[2 * plane_elems + o]), q, L);
          }
          const float w0 = g.w0;
          const float w1 = g.w1;
          const float w2 = g.w2;
          float gw0 = 0.f, gw1 = 0.f, gw2 = 0.f;
          for (int c = 0; c < cs; ++c) {
            Bits* x_c = buf + (3 + c) * plane_elems;
            const Bits* lam_c = buf + (3 + cs + c) * plane_elems;
            const Bits* gh_c = buf + (3 + 2 * cs + c) * plane_elems;
            float adj = EL::load(gh_c[o]);
            if (has_next) {
              const float* r0 = rd + (0 * cs + c) * pp;
              const float* r1 = rd + (1 * cs + c) * pp;
              const float* r2 = rd + (2 * cs + c) * pp;
              // C_0 from q, C_-1 from q + 1, C_+1 from q - 1 (lines are halo-shifted by one).
              adj += (r1[q + 1] + r0[q + 2]) + r2[q];
            }
            const float xv = EL::load(x_c[o]);
            const float lv = EL::load(lam_c[o]);
            x_c[o] = EL::store(xv * adj);        // grad_lam, in place of x
            gxs[c * gx_elems + o32] = lv * adj;  // this direction's grad_x term (fp32)
            if (!restart) {
              const Bits* hr = (from_bnd ? buf + nplanes * plane_elems + c * bnd_elems
                                         : buf + (3 + 3 * cs + c) * plane_elems) + hrb;
              const float hm = q > 0 ? EL::load(hr[(q - 1) * PI::kQ]) : 0.f;
              const float h0 = EL::load(hr[q * PI::kQ]);
              const float hp = q < L - 1 ? EL::load(hr[(q + 1) * PI::kQ]) : 0.f;
              gw0 = fmaf(adj, hm, gw0);
              gw1 = fmaf(adj, h0, gw1);
              gw2 = fmaf(adj, hp, gw2);
              wr[(0 * cs + c) * pp + q + 1] = w0 * adj;
              wr[(1 * cs + c) * pp + q + 1] = w1 * adj;
              wr[(2 * cs + c) * pp + q + 1] = w2 * adj;
            }
          }
          float gg0 = 0.f, gg1 = 0.f, gg2 = 0.f;
          if (!restart) gate_grads(g, gw0, gw1, gw2, q, L, gg0, gg1, gg2);
          if (gg_f32) {  // fp32 planes (gate planes of fp32 inputs, or a separate area)
            float* gp = reinterpret_cast<float*>(ggs);
            gp[o32] = gg0;
            gp[gg_elems + o32] = gg1;
            gp[2 * gg_elems + o32] = gg2;
          } else {  // in the input dtype, in place of the gate logits
            Bits* gp = reinterpret_cast<Bits*>(ggs);
            gp[o] = EL::store(gg0);
            gp[plane_elems + o] = EL::store(gg1);
            gp[2 * plane_elems + o] = EL::store(gg2);
          }
        }
      }
      block_sync(nta);
      parity ^= 1;
      first = false;
      sm = (sm == 0) ? ce - 1 : sm - 1;
    }

    const int64_t hoff = bi.b * p.h_sb + bi.d * p.h_sd + c0 * p.h_sc;
    store_tile<Bits, HORIZ>(
        st_lam, k * T, tid, nta, W, S, pitch,
        [&](int pl) -> Bits* { return static_cast<Bits*>(p.grad_lam) + hoff + pl * p.h_sc; },
        [&](int pl) -> const Bits* { return buf + (3 + pl) * plane_elems; });
    float* const gxp = p.grad_x_part + (bi.d * p.gxp_sd + bi.b * p.x_sb + c0 * p.x_sc);
    store_tile<uint32_t, HORIZ>(
        st_gx, k * T, tid, nta, W, S, pitch,
        [&](int pl) -> uint32_t* { return reinterpret_cast<uint32_t*>(gxp + pl * p.x_sc); },
        [&](int pl) -> const uint32_t* { return reinterpret_cast<const uint32_t*>(gxs + pl * gx_elems); });
    const int64_t goff = bi.b * p.g_sb + bi.d * p.g_sd + bi.grp * p.g_sk;
    if (gg_f32) {
      uint32_t* const dst = p.nsl > 1 ? reinterpret_cast<uint32_t*>(p.grad_gates_part + bi.sl * p.ggp_ssl + goff)
                                      : static_cast<uint32_t*>(p.grad_gates) + goff;
      store_tile<uint32_t, HORIZ>(
          st_gg, k * T, tid, nta, W, S, pitch, [&](int pl) -> uint32_t* { return dst + pl * p.g_so; },
          [&](int pl) -> const uint32_t* { return reinterpret_cast<const uint32_t*>(ggs) + pl * gg_elems; });
    } else {
      Bits* const dst = static_cast<Bits*>(p.grad_gates) + goff;
      store_tile<Bits, HORIZ>(
          st_gg, k * T, tid, nta, W, S, pitch, [&](int pl) -> Bits* { return dst + pl * p.g_so; },
          [&](int pl) -> const Bits* { return reinterpret_cast<const Bits*>(ggs) + pl * plane_elems; });
    }
    if (p.nbuf == 1 && it + 1 < nt) {
      block_sync(nta);
      load(kn, 0);
    }
  }
}

template <typename scalar_t>
__global__ void __launch_bounds__(kMaxThreadsBackward, 1) gspn_backward_kernel(const __grid_constant__ PropagateParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const BlockIndex bi = block_index(p);
  if (bi.d < 2) {
    backward_block<scalar_t, true>(p, bi, smem);
  } else {
    backward_block<scalar_t, false>(p, bi, smem);
  }
}

// grad_x = sum of the four directions' terms; grad_gates = sum of the slices' partials (if any).
// Fixed summation order: deterministic.
template <typename scalar_t>
__global__ void gspn_backward_reduce_kernel(const PropagateParams p) {
  using EL = Elem<scalar_t>;
  using Bits = typename EL::bits;
  const int64_t nx = int64_t(p.B) * p.C * p.H * p.W;
  const int64_t ng = p.nsl > 1 ? int64_t(p.B) * 4 * 3 * p.K * p.H * p.W : 0;
  Bits* gx = static_cast<Bits*>(p.grad_x);
  Bits* gg = static_cast<Bits*>(p.grad_gates);
  const float* gxp = p.grad_x_part;
  const float* ggp = p.grad_gates_part;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < nx + ng;
       i += int64_t(gridDim.x) * blockDim.x) {
    if (i < nx) {
      float s = gxp[i];
      s += gxp[i + p.gxp_sd];
      s += gxp[i + 2 * p.gxp_sd];
      s += gxp[i + 3 * p.gxp_sd];
      gx[i] = EL::store(s);
    } else {
      const int64_t j = i - nx;
      float s = ggp[j];
      for (int sl = 1; sl < p.nsl; ++sl) s += ggp[j + sl * p.ggp_ssl];
      gg[j] = EL::store(s);
    }
  }
}

int device_sm_count() {
  int dev = 0, n = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  return n;
}

template <typename scalar_t>
void forward_impl(const PropagateParams& p, cudaStream_t stream) {
  const dim3 grid(4 * p.B * p.K * p.nsl);
  const dim3 block(p.nx * p.ny);
  allow_dynamic_smem(gspn_forward_kernel<scalar_t>, p.smem_bytes);
  gspn_forward_kernel<scalar_t><<<grid, block, p.smem_bytes, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t>
void backward_impl(const PropagateParams& p, cudaStream_t stream) {
  const dim3 grid(4 * p.B * p.K * p.nsl);
  const dim3 block(p.nx * p.ny);
  allow_dynamic_smem(gspn_backward_kernel<scalar_t>, p.smem_bytes);
  gspn_backward_kernel<scalar_t><<<grid, block, p.smem_bytes, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  launch_backward_reduce(p, stream);
}

template <typename scalar_t>
void backward_reduce_impl(const PropagateParams& p, cudaStream_t stream) {
  const int64_t n = int64_t(p.B) * p.C * p.H * p.W + (p.nsl > 1 ? int64_t(p.B) * 12 * p.K * p.H * p.W : 0);
  const int threads = 256;
  const int64_t want = (n + threads - 1) / threads;
  const int blocks = int(want < 8 * int64_t(device_sm_count()) ? want : 8 * int64_t(device_sm_count()));
  gspn_backward_reduce_kernel<scalar_t><<<blocks, threads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void launch_forward(const PropagateParams& p, cudaStream_t stream) {
  dispatch_dtype(p.dtype, [&](auto elem) { forward_impl<decltype(elem)>(p, stream); });
}

void launch_backward_reduce(const PropagateParams& p, cudaStream_t stream) {
  dispatch_dtype(p.dtype, [&](auto elem) { backward_reduce_impl<decltype(elem)>(p, stream); });
}

void launch_backward(const PropagateParams& p, cudaStream_t stream) {
  dispatch_dtype(p.dtype, [&](auto elem) { backward_impl<decltype(elem)>(p, stream); });
}

}  // namespace gspn2
