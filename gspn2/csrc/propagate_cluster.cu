// The cluster kernels: forward and backward of the two horizontal directions (d = 0, 1: lines are image
// columns, steps along W) with each line split over a thread-block cluster (sm_90). Used by the streaming
// plan when they pay (docs/kernel.md, "Cluster kernels"); the vertical directions then run in the streaming
// kernels. The forward is described here; the backward (further down) uses the same tiling for the adjoint.
//
// Cluster of NCTA CTAs per (d, b, c): CTA `rank` owns rows [rank * R, rank * R + R) of the line and also
// computes HALO rows on either side ("trapezoid" tiling: a halo row's value goes stale one row further in
// per step, so after T = HALO steps the own rows are still exact; scripts/model_cluster_tiling.py models
// it and checks the halo width). Thread i <-> image row row0 + i, row0 = rank * R - HALO.
// Per tile of T steps:
//   1. the tile's five planes (x, lam, gate logits of offsets -1, 0, +1) arrive by TMA: thread 0 loads
//      3-D boxes of T columns x boxrows rows (rows outside the image zero-filled, swizzled at the row's
//      width) into the stage; completion counted on an mbarrier. A copy may bring SUB tiles at once (the
//      16-bit wide copies: rows of 2 * T columns, 64 bytes per row visit, in one stage buffer); the tiles of
//      a copy then read their columns of the stage in scan order;
//   2. each thread turns its row's T steps into x * lam and the normalised weights (registers), so the
//      step loop holds no transcendental work; the stage is then free (with one buffer once the copy's last
//      tile has read it) and the next copy's loads go out;
//   3. halo rows take the neighbours' exact values of the previous tile's last step from this CTA's
//      inbox (distributed shared memory, double buffered by tile parity), once its mbarrier says they
//      have landed;
//   4. T steps, one CTA barrier each, through a double-buffered fp32 line in shared memory;
//   5. the boundary rows' last values go to the neighbours' inboxes (st.async, each store counted on the
//      neighbour's inbox mbarrier: no fence and no cluster barrier inside the loop), the own rows' outputs
//      to an output stage that leaves as TMA box stores.
// An inbox half is rewritten two exchanges later, which a neighbour can only reach after it has this CTA's
// next exchange, sent after the half was read: the mbarriers alone order the exchange.
// The arithmetic per pixel is the streaming kernels' (same normalisation, same fma order): the outputs
// are bitwise equal to the streaming kernels' (kernel='fast'; tested).
#include <cooperative_groups.h>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include "message.h"
#include "propagate.h"
#include "propagate_device.cuh"
#include "tma.cuh"

namespace gspn2 {
namespace {

namespace cg = cooperative_groups;

constexpr int T = kClusterTile;  // steps per tile: 64 bytes of fp32 per row and plane
constexpr int HALO = T;          // halo rows per side (scripts/model_cluster_tiling.py: T is exact)
constexpr int NPLANE = 5;        // x, lam, gate logits of offsets -1, 0, +1
constexpr int kMaxThreads = kClusterMaxRows + 2 * HALO;

struct ClusterParams {
  CUtensorMap tm_x, tm_lam, tm_g, tm_h;  // (W, H, planes) maps, boxes of T columns
  // Backward: grad_h and the outputs (grad_lam, the grad_x terms, the gate gradients or their partials).
  CUtensorMap tm_gh, tm_glam, tm_gx, tm_gg;
  int B, C, K, H, W;
  int G, part;           // backward: channels per group; gate gradients as per-channel fp32 partials
  int R, NT;             // own rows per CTA, threads per CTA (R + 2 * HALO)
  int boxrows, nbox;     // input boxes per plane and tile
  int oboxrows, onbox;   // output boxes per tile
  int ce;                // restart period in scan steps (W when the scan never restarts)
};

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900  // the device code exists for sm_90 only
using tma::mbar_expect_tx;
using tma::mbar_init;
using tma::mbar_wait;
using tma::st_async;
using tma::smem_u32;
// A stage row holds one row's COLS columns of one plane, RB = COLS * element bytes: by default T steps, 64
// bytes (fp32) or 32 bytes (16-bit); the 16-bit forward's wide copies take 64 bytes. TMA's swizzle of that width
// XORs the 16-byte piece index with address bits 7 and up: piece ^= (r * RB / 128) & (RB / 16 - 1), that is
// (row >> 1) & 3 for 64-byte rows, (row >> 2) & 1 for 32-byte rows, row & 7 for 128-byte rows.
template <typename scalar_t, int COLS = T>
struct RowIO {
  using EL = dev::Elem<scalar_t>;
  using Bits = typename EL::bits;
  static constexpr int ES = int(sizeof(Bits)), EPP = 16 / ES, NPC = COLS / EPP, RB = COLS * ES;
  static_assert(RB == 32 || RB == 64 || RB == 128, "a swizzled stage row is 32, 64 or 128 bytes");
  static __device__ __forceinline__ int offset(int r, int pc) {
    return r * RB + 16 * (pc ^ ((r * RB >> 7) & (RB / 16 - 1)));
  }
  static __device__ __forceinline__ uint4 load(const unsigned char* plane, int r, int pc) {
    return *reinterpret_cast<const uint4*>(plane + offset(r, pc));
  }
  static __device__ __forceinline__ uint32_t word(const uint4& u, int k) {
    return k == 0 ? u.x : k == 1 ? u.y : k == 2 ? u.z : u.w;
  }
  // Element e of a 16-byte piece, as float (e a compile-time index after unrolling).
  static __device__ __forceinline__ float get(const uint4& u, int e) {
    if constexpr (ES == 4) {
      return __uint_as_float(word(u, e));
    } else {
      const uint32_t w = word(u, e >> 1);
      return EL::load(Bits((e & 1) ? (w >> 16) : (w & 0xffffu)));
    }
  }
  static __device__ __forceinline__ void store(unsigned char* plane, int r, int pc, const float (&v)[EPP]) {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if constexpr (ES == 4) {
        w[k] = EL::store(v[k]);
      } else {
        w[k] = uint32_t(EL::store(v[2 * k])) | (uint32_t(EL::store(v[2 * k + 1])) << 16);
      }
    }
    *reinterpret_cast<uint4*>(plane + offset(r, pc)) = make_uint4(w[0], w[1], w[2], w[3]);
  }
};

// The line a CTA of cluster `rank` works on (direction d in {0, 1}, batch b, channel c, gate group grp;
// clusters in (b, c, d) order, d fastest) and its thread's image row q (own rows are threads
// [HALO, HALO + R); the others are halo rows, or outside the image).
struct LineCoords {
  int d, b, c, grp, q;
  bool inimg, own;
};
template <int NCTA>
__device__ __forceinline__ LineCoords line_coords(const ClusterParams& p, int rank, int i) {
  const int cid = blockIdx.x / NCTA;
  LineCoords r;
  r.d = cid & 1;
  r.c = (cid >> 1) % p.C;
  r.b = (cid >> 1) / p.C;
  r.grp = r.c / p.G;
  r.q = rank * p.R - HALO + i;
  r.inimg = r.q >= 0 && r.q < p.H;
  r.own = i >= HALO && i < HALO + p.R && r.q < p.H;
  return r;
}

// Dynamic shared memory rounded up to 1024 bytes (TMA boxes with a swizzle need that alignment).
__device__ __forceinline__ unsigned char* smem_base(unsigned char* smem_raw) {
  return smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
}
#endif

// NSTAGE input stage buffers: with 2 the next copy's loads overlap the whole of this copy's work. A copy
// brings SUB tiles: 1, or 2 for the 16-bit wide copies (64-byte rows, one buffer).
template <typename scalar_t, int NCTA, int NSTAGE, int SUB>
__global__ void __launch_bounds__(kMaxThreads, 1) gspn_forward_cluster_kernel(const __grid_constant__ ClusterParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using IO = RowIO<scalar_t>;             // the output stage: T columns
  using IN = RowIO<scalar_t, SUB * T>;    // the input stage: SUB * T columns
  constexpr int RB = IO::RB, EPP = IO::EPP, RBI = IN::RB, TC = SUB * T;
  static_assert(IN::NPC == SUB * IO::NPC, "a copy's row is SUB tiles' rows");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank());
  const int nt = p.NT, i = threadIdx.x;
  const auto [d, b, c, grp, q, inimg, own] = line_coords<NCTA>(p, rank, i);
  const int row0 = rank * p.R - HALO;  // thread i <-> image row row0 + i

  // Layout: stage [NSTAGE][NPLANE][srows] rows of RB bytes, output stage [orows] rows, then the exchange
  // lines, the inboxes and one mbarrier per stage buffer.
  unsigned char* base = smem_base(smem_raw);
  const int srows = p.nbox * p.boxrows, orows = p.onbox * p.oboxrows;
  const size_t stage_bytes = size_t(NPLANE) * srows * RBI;  // one buffer; a multiple of the swizzle period
  unsigned char* const stage = base;
  unsigned char* const ostage = stage + NSTAGE * stage_bytes;
  float* const line = reinterpret_cast<float*>(ostage + size_t(orows) * RB);  // [2][nt + 2], row i at i + 1
  float* const inbox = line + 2 * (nt + 2);                                  // [2 tiles][lower, upper][HALO]
  uint64_t* const bar = reinterpret_cast<uint64_t*>(inbox + 4 * HALO + 2);  // [NSTAGE]
  uint64_t* const ibar = bar + NSTAGE;  // [2]: the inbox's two halves (tiles kt & 1) filled
  for (int k = i; k < 2 * (nt + 2) + 4 * HALO; k += blockDim.x) line[k] = 0.f;

  const int px = b * p.C + c;                    // plane of x
  const int pl = (b * 4 + d) * p.C + c;          // plane of lam and of h
  const int pg = (b * 4 + d) * 3 * p.K + grp;    // plane of the first gate logits
  const int ntl = p.W / T, ntc = p.W / TC;  // tiles, copies
  const uint32_t tx_bytes = uint32_t(NPLANE) * srows * RBI;
  auto col0 = [&](int kt) { return d == 0 ? kt * T : p.W - (kt + 1) * T; };        // a tile's first column
  auto issue = [&](int kc, int buf) {  // thread 0: copy kc
    uint64_t* mb = &bar[buf];
    mbar_expect_tx(mb, tx_bytes);
    const int j0 = d == 0 ? kc * TC : p.W - (kc + 1) * TC;
    for (int bx = 0; bx < p.nbox; ++bx) {
      const int r = row0 + bx * p.boxrows;
      unsigned char* dst = stage + buf * stage_bytes + size_t(bx) * p.boxrows * RBI;
      tma::load_3d(dst, &p.tm_x, j0, r, px, mb);
      tma::load_3d(dst + size_t(srows) * RBI, &p.tm_lam, j0, r, pl, mb);
#pragma unroll
      for (int k = 0; k < 3; ++k) tma::load_3d(dst + size_t(2 + k) * srows * RBI, &p.tm_g, j0, r, pg + k * p.K, mb);
    }
  };
  // the bytes that the neighbours store into my inbox per exchange (each of my halo rows' value)
  const uint32_t in_bytes = uint32_t((rank > 0) + (rank < NCTA - 1)) * HALO * 4;
  if (i == 0) {
    for (int k = 0; k < NSTAGE; ++k) mbar_init(&bar[k], 1);
    for (int k = 0; k < 2; ++k) mbar_init(&ibar[k], 1);
    tma::mbar_init_fence();
    for (int k = 0; k < 2 && k + 1 < ntl; ++k) mbar_expect_tx(&ibar[k], in_bytes);  // exchanges 0 and 1
  }
  __syncthreads();
  if (i == 0) issue(0, 0);
  cluster.sync();  // lines zeroed, inbox barriers set up, every CTA of the cluster running before any remote store

  float xl[T], w0[T], w1[T], w2[T];  // per step of the tile (scan order): x * lam, normalised weights
  int par = 0, sm = 0;               // exchange line in use; step index modulo the restart period
  for (int kt = 0; kt < ntl; ++kt) {
    const int kc = kt / SUB, sub = kt % SUB;  // copy, and this tile's place in it (scan order)
    const int buf = NSTAGE == 2 ? kc & 1 : 0;
    if (sub == 0) {
      // Two buffers: the other one was last read before the previous copy's last tile's first barrier, so
      // the next copy's loads go out now and overlap this whole copy.
      if (NSTAGE == 2 && i == 0 && kc + 1 < ntc) issue(kc + 1, buf ^ 1);
      mbar_wait(&bar[buf], (kc / NSTAGE) & 1);
    }
    const unsigned char* const sb = stage + buf * stage_bytes;
    const int pc0 = (d == 0 ? sub * T : TC - (sub + 1) * T) / EPP;  // the tile's first piece in the copy's row
#pragma unroll
    for (int pc = 0; pc < IO::NPC; ++pc) {
      uint4 f[NPLANE];
#pragma unroll
      for (int k = 0; k < NPLANE; ++k) f[k] = IN::load(sb + size_t(k) * srows * RBI, i, pc0 + pc);
#pragma unroll
      for (int e = 0; e < EPP; ++e) {
        const int j = pc * EPP + e;               // column j of the tile
        const int t = d == 0 ? j : T - 1 - j;     // d = 1 walks the tile's columns backwards
        const dev::Weights g = dev::weights(IO::get(f[2], e), IO::get(f[3], e), IO::get(f[4], e), q, p.H);
        xl[t] = IO::get(f[0], e) * IO::get(f[1], e);
        w0[t] = g.w0, w1[t] = g.w1, w2[t] = g.w2;
      }
    }
    float* const prev0 = line + par * (nt + 2);
    if (kt > 0) {
      // exchange kt - 1: the neighbours' values of the previous tile's last step are in my inbox
      const float* box = inbox + ((kt - 1) & 1) * 2 * HALO;
      if (i < HALO && rank > 0) {
        mbar_wait(&ibar[(kt - 1) & 1], ((kt - 1) >> 1) & 1);
        prev0[i + 1] = box[i];
      }
      if (i >= HALO + p.R && rank < NCTA - 1) {
        mbar_wait(&ibar[(kt - 1) & 1], ((kt - 1) >> 1) & 1);
        prev0[i + 1] = box[i - p.R];
      }
    }
    if (i == 0 && kt > 0) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");  // ostage read
    __syncthreads();  // stage read (it may be refilled), halo rows in place, output stage free
    if (NSTAGE == 1 && i == 0 && sub == SUB - 1 && kc + 1 < ntc) issue(kc + 1, 0);  // the copy is read
    // that inbox half was read before the barrier above: arm it for exchange kt + 1. Its phase of exchange
    // kt - 1 has completed (the halo rows waited for it), and no neighbour stores exchange kt + 1 before it
    // has my exchange kt, which goes out after this.
    if (i == 0 && kt > 0 && kt + 2 < ntl) mbar_expect_tx(&ibar[(kt + 1) & 1], in_bytes);

    float hv = 0.f;
#pragma unroll
    for (int t = 0; t < T; ++t) {
      const float* prev = line + par * (nt + 2);
      float* next = line + (par ^ 1) * (nt + 2);
      hv = 0.f;
      if (inimg) {
        hv = xl[t];
        if (sm != 0) {
          hv = fmaf(w0[t], prev[i], hv);
          hv = fmaf(w1[t], prev[i + 1], hv);
          hv = fmaf(w2[t], prev[i + 2], hv);
        }
      }
      next[i + 1] = hv;
      xl[t] = hv;  // the output takes the place of x * lam
      if (t + 1 < T) __syncthreads();
      par ^= 1;
      sm = (sm + 1 == p.ce) ? 0 : sm + 1;
    }
    if (kt + 1 < ntl) {
      // my boundary rows are the neighbours' halo rows: push this tile's last values (st.async, counted on
      // the neighbour's inbox barrier of this tile's parity)
      float* box = inbox + (kt & 1) * 2 * HALO;
      if (rank > 0 && i >= HALO && i < 2 * HALO) {  // the upper neighbour's lower halo
        st_async(tma::cluster_addr(box + i, rank - 1), hv, tma::cluster_addr(&ibar[kt & 1], rank - 1));
      }
      if (rank < NCTA - 1 && i >= p.R && i < p.R + HALO) {  // the lower neighbour's upper halo
        st_async(tma::cluster_addr(box + i - p.R, rank + 1), hv, tma::cluster_addr(&ibar[kt & 1], rank + 1));
      }
    }
    if (own) {
#pragma unroll
      for (int pc = 0; pc < IO::NPC; ++pc) {
        float v[EPP];
#pragma unroll
        for (int e = 0; e < EPP; ++e) {
          const int j = pc * EPP + e;
          v[e] = xl[d == 0 ? j : T - 1 - j];
        }
        IO::store(ostage, i - HALO, pc, v);
      }
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // visible to the TMA store
    }
    __syncthreads();  // output stage complete
    if (i == 0) {
      for (int bo = 0; bo < p.onbox; ++bo) {
        tma::store_3d(&p.tm_h, col0(kt), rank * p.R + bo * p.oboxrows, pl, ostage + size_t(bo) * p.oboxrows * RB);
      }
      asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
    }
  }
  if (i == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
  cluster.sync();  // no CTA leaves while a neighbour may still store into its shared memory
#endif
}

// Backward of the horizontal directions on the same tiling, tiles from the end of the scan. Per tile:
//   * TMA loads of 7 planes (x, lam, 3 gate logits, grad_h, the saved h) into one of two stage buffers
//     (the next tile's loads overlap this one, and bring h_{s-1} of this tile's first step);
//   * the tile's normalised weights and grad_h into registers;
//   * phase A, sequential: the adjoint adj_s = grad_h_s + sum_o w_o[s+1](q - o) adj_{s+1}(q - o) through
//     three double-buffered lines of C_o = w_o * adj, one CTA barrier per step; halo rows take the
//     neighbours' exact C_o of the previous tile's last step from the inbox (pushed with st.async and
//     counted on the inbox's mbarrier, as in the forward);
//   * phase B, parallel: grad_lam = x adj, the grad_x term lam adj, the gate-logit gradients (h_{s-1} of
//     rows q - 1, q, q + 1 from the stage), into an output stage that leaves as TMA box stores.
// Outputs of the own rows only; the arithmetic per pixel is the streaming backward's (backward_step).
// Every dtype: the input planes are RowIO rows (64 bytes fp32, 32 bytes 16-bit); grad_lam leaves in the
// input dtype, the grad_x terms and gate partials in fp32, unsplit gate gradients in the input dtype.
// Phase B runs on kBwdSlices threads per row, each on a contiguous share of the tile's columns: the steps of
// phase A (one thread per row) leave the adjoint in the output stage's grad_x plane, which phase B reads and
// overwrites position by position. Threads per CTA at most: rows (16-bit inputs up to kClusterMaxRowsBwd16
// with `cluster_ctas` set, two boxes per plane; float32 up to kClusterMaxRowsBwd) plus halo, times the slices.
template <typename scalar_t>
constexpr int kBwdSlices = cluster_bwd_slices(int(sizeof(scalar_t)));
template <typename scalar_t>
constexpr int kMaxThreadsBwd =
    ((sizeof(scalar_t) == 2 ? kClusterMaxRowsBwd16 : kClusterMaxRowsBwd) + 2 * HALO) * kBwdSlices<scalar_t>;
constexpr int NIN_B = 7, NOUT_B = 5;
// Bytes of the backward's output stage: grad_lam in rows of the input dtype (rb bytes: 32 for 16-bit inputs,
// which keeps the 16-bit kernel within half an SM's shared memory, two CTAs per SM), the other four planes in
// 64-byte rows. Every plane starts 512-byte aligned (R is a multiple of 16), where both swizzle patterns repeat.
__host__ __device__ constexpr int bwd_out_bytes(int R, int rb) { return R * (rb + (NOUT_B - 1) * 64); }
// Bytes of the backward's two input stage buffers (rows of rb bytes), rounded up to 1024 so the output
// stage behind them starts where TMA's swizzle pattern does.
__host__ __device__ constexpr int bwd_stage_bytes(int srows, int rb) { return (2 * NIN_B * srows * rb + 1023) / 1024 * 1024; }

template <typename scalar_t, int NCTA>
__global__ void __launch_bounds__(kMaxThreadsBwd<scalar_t>, 1) gspn_backward_cluster_kernel(const __grid_constant__ ClusterParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using IO = RowIO<scalar_t>;  // the seven input planes; grad_lam (and unsplit gate gradients) go out in this type
  using IO32 = RowIO<float>;   // the grad_x terms and gate partials: fp32
  constexpr int RB = IO::RB, EPP = IO::EPP;
  constexpr int WB = kBwdSlices<scalar_t>, CPS = IO::NPC / WB;  // phase B: slices per row, 16-byte pieces each
  static_assert(IO::NPC % WB == 0, "a slice is whole 16-byte pieces");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank());
  const int nt = p.NT, tid = threadIdx.x;
  const int slice = WB == 1 ? 0 : tid / nt, i = tid - slice * nt;  // thread <-> (slice of phase B, row i)
  const bool row = slice == 0;                        // one thread per row: the loads' set-up and phase A
  const auto [d, b, c, grp, q, inimg, own] = line_coords<NCTA>(p, rank, i);
  const int row0 = rank * p.R - HALO;  // row i <-> image row row0 + i

  unsigned char* base = smem_base(smem_raw);
  const int srows = p.nbox * p.boxrows;  // p.nbox TMA boxes of p.boxrows rows per plane
  unsigned char* const stage0 = base;  // [2][NIN_B][srows] rows of RB bytes
  // grad_lam's R rows of RB bytes, then [NOUT_B - 1][R] rows of 64 bytes (a 16-bit gate plane uses the first 32 of
  // each), 1024-byte aligned like the stage
  unsigned char* const ostage = stage0 + bwd_stage_bytes(srows, RB);
  float* const lines = reinterpret_cast<float*>(ostage + bwd_out_bytes(p.R, RB));  // [2][3][nt + 2]
  float* const inbox = lines + 6 * (nt + 2);                                        // [2][2 sides][3][HALO]
  uint64_t* const bar = reinterpret_cast<uint64_t*>(inbox + 12 * HALO + 2);         // [2], 8-byte aligned
  uint64_t* const ibar = bar + 2;  // [2]: the inbox's two halves (tiles m & 1) filled
  for (int k = tid; k < 6 * (nt + 2) + 12 * HALO; k += blockDim.x) lines[k] = 0.f;

  const int px = b * p.C + c;
  const int pl = (b * 4 + d) * p.C + c;        // lam, grad_h, h, grad_lam
  const int pg = (b * 4 + d) * 3 * p.K + grp;  // first gate plane
  const int pgx = (d * p.B + b) * p.C + c;      // grad_x term of direction d: (4, B, C, H, W)
  // gate gradients: (B, 4, 3, K, H, W), or the per-channel partials (G, B, 4, 3, K, H, W)
  const int pgg = p.part ? (c % p.G) * p.B * 12 * p.K + pg : pg;
  const int ntl = p.W / T;
  const uint32_t tx_bytes = uint32_t(NIN_B) * srows * RB;
  auto col0 = [&](int kt) { return d == 0 ? kt * T : p.W - (kt + 1) * T; };
  auto plane = [&](int buf, int k) { return stage0 + (size_t(buf) * NIN_B + k) * srows * RB; };
  auto oplane = [&](int k) { return ostage + (k == 0 ? 0 : size_t(p.R) * (RB + (k - 1) * 64)); };
  auto issue = [&](int kt, int buf) {  // thread 0
    uint64_t* mb = &bar[buf];
    mbar_expect_tx(mb, tx_bytes);
    const int j0 = col0(kt);
    for (int bx = 0; bx < p.nbox; ++bx) {
      const int r = row0 + bx * p.boxrows;
      const size_t off = size_t(bx) * p.boxrows * RB;
      tma::load_3d(plane(buf, 0) + off, &p.tm_x, j0, r, px, mb);
      tma::load_3d(plane(buf, 1) + off, &p.tm_lam, j0, r, pl, mb);
#pragma unroll
      for (int k = 0; k < 3; ++k) tma::load_3d(plane(buf, 2 + k) + off, &p.tm_g, j0, r, pg + k * p.K, mb);
      tma::load_3d(plane(buf, 5) + off, &p.tm_gh, j0, r, pl, mb);
      tma::load_3d(plane(buf, 6) + off, &p.tm_h, j0, r, pl, mb);
    }
  };
  // the bytes that the neighbours store into my inbox per exchange (three values per halo row)
  const uint32_t in_bytes = uint32_t((rank > 0) + (rank < NCTA - 1)) * 3 * HALO * 4;
  if (tid == 0) {
    for (int k = 0; k < 2; ++k) mbar_init(&bar[k], 1), mbar_init(&ibar[k], 1);
    tma::mbar_init_fence();
    for (int k = 0; k < 2 && k + 1 < ntl; ++k) mbar_expect_tx(&ibar[k], in_bytes);  // exchanges 0 and 1
  }
  __syncthreads();
  if (tid == 0) issue(ntl - 1, 0);
  cluster.sync();  // lines zeroed, inbox barriers set up, every CTA of the cluster running before any remote store

  float w0[T], w1[T], w2[T], A[T];  // per step t of the tile: weights; grad_h, then the adjoint
  int par = 0;
  int sm = (p.W - 1) % p.ce;
  for (int m = 0; m < ntl; ++m) {
    const int kt = ntl - 1 - m, buf = m & 1;
    mbar_wait(&bar[buf], (m >> 1) & 1);
    if (tid == 0 && kt > 0) issue(kt - 1, buf ^ 1);  // that buffer was last read before the previous tile's end
    if (row) {
#pragma unroll
      for (int pc = 0; pc < IO::NPC; ++pc) {
        const uint4 g0 = IO::load(plane(buf, 2), i, pc), g1 = IO::load(plane(buf, 3), i, pc);
        const uint4 g2 = IO::load(plane(buf, 4), i, pc), gh = IO::load(plane(buf, 5), i, pc);
#pragma unroll
        for (int e = 0; e < EPP; ++e) {
          const int j = pc * EPP + e;
          const int t = d == 0 ? j : T - 1 - j;
          const dev::Weights gt = dev::weights(IO::get(g0, e), IO::get(g1, e), IO::get(g2, e), q, p.H);
          w0[t] = gt.w0, w1[t] = gt.w1, w2[t] = gt.w2;
          A[t] = inimg ? IO::get(gh, e) : 0.f;
        }
      }
    }
    if (m > 0) {  // exchange m - 1: the neighbours' C_o of step (kt + 1) T are in my inbox
      const float* box = inbox + ((m - 1) & 1) * 6 * HALO;
      float* rd = lines + par * 3 * (nt + 2);
      if (row && i < HALO && rank > 0) {
        mbar_wait(&ibar[(m - 1) & 1], ((m - 1) >> 1) & 1);
#pragma unroll
        for (int o = 0; o < 3; ++o) rd[o * (nt + 2) + i + 1] = box[o * HALO + i];
      }
      if (row && i >= HALO + p.R && rank < NCTA - 1) {
        mbar_wait(&ibar[(m - 1) & 1], ((m - 1) >> 1) & 1);
#pragma unroll
        for (int o = 0; o < 3; ++o) rd[o * (nt + 2) + i + 1] = box[(3 + o) * HALO + i - HALO - p.R];
      }
    }
    __syncthreads();
    // that inbox half was read before the barrier above: arm it for exchange m + 1 (as in the forward)
    if (tid == 0 && m > 0 && m + 2 < ntl) mbar_expect_tx(&ibar[(m + 1) & 1], in_bytes);

    // Phase A: steps t = T - 1 .. 0 (scan step s = kt T + t).
    float c0v = 0.f, c1v = 0.f, c2v = 0.f;
#pragma unroll
    for (int tt = 0; tt < T; ++tt) {
      const int t = T - 1 - tt;
      const int s = kt * T + t;
      const bool restart = sm == 0;
      const bool has_next = s < p.W - 1 && sm + 1 != p.ce;
      const float* rd = lines + par * 3 * (nt + 2);
      float* wr = lines + (par ^ 1) * 3 * (nt + 2);
      float adj = A[t];
      if (row && has_next && inimg) adj += (rd[1 * (nt + 2) + i + 1] + rd[0 * (nt + 2) + i + 2]) + rd[2 * (nt + 2) + i];
      A[t] = adj;
      c0v = c1v = c2v = 0.f;
      if (row && !restart) {
        c0v = w0[t] * adj, c1v = w1[t] * adj, c2v = w2[t] * adj;
        wr[0 * (nt + 2) + i + 1] = c0v;
        wr[1 * (nt + 2) + i + 1] = c1v;
        wr[2 * (nt + 2) + i + 1] = c2v;
      }
      if (tt + 1 < T) __syncthreads();
      par ^= 1;
      sm = (sm == 0) ? p.ce - 1 : sm - 1;
    }
    if (kt > 0) {  // my boundary rows' C_o of step kt T go to the neighbours' halo rows
      // (st.async, counted on the neighbour's inbox barrier of this tile's parity)
      float* box = inbox + (m & 1) * 6 * HALO;
      if (row && rank > 0 && i >= HALO && i < 2 * HALO) {
        const uint32_t nb = tma::cluster_addr(box + 3 * HALO + i - HALO, rank - 1);
        const uint32_t mb = tma::cluster_addr(&ibar[m & 1], rank - 1);
        st_async(nb, c0v, mb), st_async(nb + 4 * HALO, c1v, mb), st_async(nb + 8 * HALO, c2v, mb);
      }
      if (row && rank < NCTA - 1 && i >= p.R && i < p.R + HALO) {
        const uint32_t nb = tma::cluster_addr(box + i - p.R, rank + 1);
        const uint32_t mb = tma::cluster_addr(&ibar[m & 1], rank + 1);
        st_async(nb, c0v, mb), st_async(nb + 4 * HALO, c1v, mb), st_async(nb + 8 * HALO, c2v, mb);
      }
    }
    if (tid == 0 && m > 0) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
    __syncthreads();  // output stage free
    if constexpr (WB > 1) {  // the own rows' adjoints to the grad_x plane (fp32, column j at piece j / 4)
      if (row && own) {
#pragma unroll
        for (int k4 = 0; k4 < T / 4; ++k4) {
          float v4[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) v4[e] = A[d == 0 ? 4 * k4 + e : T - 1 - (4 * k4 + e)];
          IO32::store(oplane(1), i - HALO, k4, v4);
        }
      }
      __syncthreads();
    }

    // Phase B, on the slice's pieces [slice CPS, slice CPS + CPS) (columns [J0, J0 + NJ)): h_{s-1} of rows
    // q - 1, q, q + 1 at step t is this tile's step t - 1 (the column before, d = 0, or after, d = 1), or for
    // t = 0 the last step of tile kt - 1 (the other stage buffer). With the direction a compile-time constant
    // every register array is indexed statically.
    auto phase_b = [&](auto dir) {
      constexpr int D = decltype(dir)::value;
      constexpr int NJ = CPS * EPP;
      const int pc0 = slice * CPS;
      // h of columns J0 - 1 .. J0 + NJ: index u + 1 <-> column J0 + u
      float hv[3][NJ + 2];
      const bool edge = D == 0 ? slice == 0 : slice == WB - 1;  // the tile's step 0 is in this slice
      if (edge && kt > 0) mbar_wait(&bar[buf ^ 1], ((m + 1) >> 1) & 1);
#pragma unroll
      for (int r = 0; r < 3; ++r) {
#pragma unroll
        for (int k = 0; k < CPS; ++k) {
          const uint4 f = IO::load(plane(buf, 6), i - 1 + r, pc0 + k);
#pragma unroll
          for (int e = 0; e < EPP; ++e) hv[r][1 + k * EPP + e] = IO::get(f, e);
        }
        // the column of the slice's first step's predecessor: in the neighbouring slice, else the other buffer's
        // element of tile kt - 1's last step (column T - 1 for d = 0, 0 for d = 1), else zero
        float hn = 0.f;
        if (!edge) {
          const uint4 f = IO::load(plane(buf, 6), i - 1 + r, D == 0 ? pc0 - 1 : pc0 + CPS);
          hn = IO::get(f, D == 0 ? EPP - 1 : 0);
        } else if (kt > 0) {
          const uint4 f = IO::load(plane(buf ^ 1, 6), i - 1 + r, D == 0 ? IO::NPC - 1 : 0);
          hn = IO::get(f, D == 0 ? EPP - 1 : 0);
        }
        if (D == 0) {
          hv[r][0] = hn;
        } else {
          hv[r][NJ + 1] = hn;
        }
      }
#pragma unroll
      for (int k = 0; k < CPS; ++k) {
        const int pc = pc0 + k;
        const uint4 fx = IO::load(plane(buf, 0), i, pc), fl = IO::load(plane(buf, 1), i, pc);
        const uint4 g0 = IO::load(plane(buf, 2), i, pc), g1 = IO::load(plane(buf, 3), i, pc);
        const uint4 g2 = IO::load(plane(buf, 4), i, pc);
        float adjs[EPP];  // the adjoint of column pc EPP + e
        if constexpr (WB > 1) {
#pragma unroll
          for (int h4 = 0; h4 < EPP / 4; ++h4) {
            const uint4 fa = IO32::load(oplane(1), i - HALO, pc * (EPP / 4) + h4);
#pragma unroll
            for (int e = 0; e < 4; ++e) adjs[4 * h4 + e] = IO32::get(fa, e);
          }
        } else {
#pragma unroll
          for (int e = 0; e < EPP; ++e) adjs[e] = A[D == 0 ? pc * EPP + e : T - 1 - (pc * EPP + e)];
        }
        float o[NOUT_B][EPP];
#pragma unroll
        for (int e = 0; e < EPP; ++e) {
          const int u = k * EPP + e;  // column J0 + u
          const int t = D == 0 ? pc * EPP + e : T - 1 - (pc * EPP + e);
          const float adj = adjs[e];
          const int up = D == 0 ? u : u + 2;  // h_{s-1}: the column before (d = 0) or after (d = 1)
          o[0][e] = IO::get(fx, e) * adj;
          o[1][e] = IO::get(fl, e) * adj;
          o[2][e] = o[3][e] = o[4][e] = 0.f;
          if ((kt * T + t) % p.ce != 0) {
            const dev::Gates gt = dev::normalise(IO::get(g0, e), IO::get(g1, e), IO::get(g2, e), q, p.H);
            const float gw0 = fmaf(adj, hv[0][up], 0.f), gw1 = fmaf(adj, hv[1][up], 0.f);
            const float gw2 = fmaf(adj, hv[2][up], 0.f);
            dev::gate_grads(gt, gw0, gw1, gw2, q, p.H, o[2][e], o[3][e], o[4][e]);
          }
        }
        IO::store(oplane(0), i - HALO, pc, o[0]);  // grad_lam, input dtype
#pragma unroll
        for (int kk = 1; kk < NOUT_B; ++kk) {
          if (kk == 1 || p.part || sizeof(scalar_t) == 4) {  // fp32: the grad_x term (over the adjoint), gate partials
#pragma unroll
            for (int h4 = 0; h4 < EPP / 4; ++h4) {
              const float v4[4] = {o[kk][4 * h4], o[kk][4 * h4 + 1], o[kk][4 * h4 + 2], o[kk][4 * h4 + 3]};
              IO32::store(oplane(kk), i - HALO, pc * (EPP / 4) + h4, v4);
            }
          } else {
            IO::store(oplane(kk), i - HALO, pc, o[kk]);  // the gate gradients themselves, input dtype
          }
        }
      }
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    };
    if (own) {
      if (d == 0) {
        phase_b(std::integral_constant<int, 0>{});
      } else {
        phase_b(std::integral_constant<int, 1>{});
      }
    }
    __syncthreads();  // output stage complete; stage buffer `buf` read
    if (tid == 0) {
      const int j0 = col0(kt), r0 = rank * p.R;
      tma::store_3d(&p.tm_glam, j0, r0, pl, oplane(0));
      tma::store_3d(&p.tm_gx, j0, r0, pgx, oplane(1));
#pragma unroll
      for (int k = 0; k < 3; ++k) tma::store_3d(&p.tm_gg, j0, r0, pgg + k * p.K, oplane(2 + k));
      asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
    }
  }
  if (tid == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
  cluster.sync();
#endif
}


PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  const PFN_cuTensorMapEncodeTiled_v12000 fn = tma::encoder();
  TORCH_CHECK(fn != nullptr,
              "gspn2: the CUDA driver has no cuTensorMapEncodeTiled (needed by the cluster kernel); "
              "set GSPN2_KERNEL=fast");
  return fn;
}

// (W, H, planes) map of a contiguous tensor; boxes of `cols` columns (T, or a wide copy's SUB * T) x boxrows
// rows x 1 plane, swizzled at the row's width (32, 64 or 128 bytes), as RowIO reads them.
void make_map(CUtensorMap* map, const void* ptr, int W, int H, int64_t planes, int boxrows,
              ScalarType dtype = ScalarType::Float, int cols = T) {
  const cuuint64_t es = dtype == ScalarType::Float ? 4 : 2;
  const cuuint64_t dims[3] = {cuuint64_t(W), cuuint64_t(H), cuuint64_t(planes)};
  const cuuint64_t strides[2] = {cuuint64_t(W) * es, cuuint64_t(W) * H * es};
  const cuuint32_t box[3] = {cuuint32_t(cols), cuuint32_t(boxrows), 1};
  const cuuint32_t estr[3] = {1, 1, 1};
  const cuuint64_t row_bytes = cols * es;
  const CUtensorMapSwizzle swizzle = row_bytes == 128  ? CU_TENSOR_MAP_SWIZZLE_128B
                                     : row_bytes == 64 ? CU_TENSOR_MAP_SWIZZLE_64B
                                                       : CU_TENSOR_MAP_SWIZZLE_32B;
  const CUresult r = encode_tiled()(map, tma::data_type(dtype), 3, const_cast<void*>(ptr), dims, strides, box, estr,
                                    CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                                    CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    throw std::runtime_error(message("gspn2: cuTensorMapEncodeTiled failed (CUresult ", int(r), ") for a (", W, ", ", H,
                                     ", ", planes, ") map with boxes of ", boxrows, " rows"));
  }
}

// The driver call that encodes tensor maps needs a current context on the calling thread. The backward
// runs on autograd's device thread, where no runtime call may have bound one yet (cuTensorMapEncodeTiled
// then returns CUDA_ERROR_INVALID_CONTEXT): bind the current device's primary context first.
void bind_context() { C10_CUDA_CHECK(tma::bind_context()); }

using ClusterKernel = void (*)(ClusterParams);

template <int NCTA>
ClusterKernel pick_kernel(ScalarType dtype, bool backward, int nstage, int sub) {
  if (backward) {
    switch (dtype) {
      case ScalarType::Half: return gspn_backward_cluster_kernel<__half, NCTA>;
      case ScalarType::BFloat16: return gspn_backward_cluster_kernel<__nv_bfloat16, NCTA>;
      default: return gspn_backward_cluster_kernel<float, NCTA>;
    }
  }
  // 16-bit inputs with copies of one tile always have room for two stage buffers (cluster_shape); the 16-bit
  // wide copies (two tiles) take one (plan_cluster)
  switch (dtype) {
    case ScalarType::Half:
      return sub == 2 ? gspn_forward_cluster_kernel<__half, NCTA, 1, 2> : gspn_forward_cluster_kernel<__half, NCTA, 2, 1>;
    case ScalarType::BFloat16:
      return sub == 2 ? gspn_forward_cluster_kernel<__nv_bfloat16, NCTA, 1, 2>
                      : gspn_forward_cluster_kernel<__nv_bfloat16, NCTA, 2, 1>;
    default:
      return nstage == 2 ? gspn_forward_cluster_kernel<float, NCTA, 2, 1> : gspn_forward_cluster_kernel<float, NCTA, 1, 1>;
  }
}

template <int NCTA>
void launch_cluster(const ClusterParams& p, const PropagateParams& pp, cudaStream_t stream, bool backward) {
  const ClusterKernel kernel = pick_kernel<NCTA>(pp.dtype, backward, pp.cluster_stages, pp.cluster_sub);
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, pp.cluster_smem));
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(NCTA * 2 * pp.B * pp.C);
  cfg.blockDim = dim3(pp.cluster_threads);
  cfg.dynamicSmemBytes = size_t(pp.cluster_smem);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = NCTA;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p));
}

}  // namespace

ClusterShape cluster_shape(int H, int ncta, bool backward, int esize, int sub) {
  ClusterShape s;
  s.sub = backward ? 1 : sub;
  s.R = round_up((H + ncta - 1) / ncta, 16);  // output boxes of a multiple of 8 rows end at the CTA's rows
  s.NT = s.R + 2 * kClusterTile;
  if (backward) {  // two buffers of 7 planes (one box per plane up to 256 rows, else two), 5 output planes
    s.nbox = (s.NT + 255) / 256;
    s.boxrows = round_up((s.NT + s.nbox - 1) / s.nbox, 8);
    s.onbox = 1;
    s.oboxrows = s.R;
    s.nstage = 2;
    s.smem = 1024 + bwd_stage_bytes(s.nbox * s.boxrows, kClusterTile * esize) +
             bwd_out_bytes(s.R, kClusterTile * esize) + (6 * (s.NT + 2) + 12 * kClusterTile + 2) * 4 + 32;
    s.threads = s.NT * cluster_bwd_slices(esize);
    return s;
  }
  s.nbox = (s.NT + 255) / 256;  // TMA boxes have at most 256 rows
  s.boxrows = round_up((s.NT + s.nbox - 1) / s.nbox, 8);
  s.onbox = (s.R + 255) / 256;
  s.oboxrows = s.R / s.onbox;
  // Two input stage buffers where they fit (16-bit inputs, or float32 with at most 256 rows per CTA), else one.
  auto smem = [&](int nstage) {
    return 1024 + nstage * NPLANE * s.nbox * s.boxrows * s.sub * kClusterTile * esize +
           s.onbox * s.oboxrows * kClusterTile * esize + (2 * (s.NT + 2) + 4 * kClusterTile + 2) * 4 + 8 * (nstage + 2);
  };
  s.nstage = smem(2) <= kSmemLimit ? 2 : 1;
  s.smem = smem(s.nstage);
  s.threads = s.NT;
  return s;
}

namespace {

ClusterParams cluster_params(const PropagateParams& pp, const ClusterShape& s) {
  ClusterParams p{};
  p.B = pp.B, p.C = pp.C, p.K = pp.K, p.H = pp.H, p.W = pp.W, p.G = pp.G;
  p.R = s.R, p.NT = s.NT, p.boxrows = s.boxrows, p.nbox = s.nbox, p.oboxrows = s.oboxrows, p.onbox = s.onbox;
  p.ce = pp.chunk > 0 && pp.chunk < pp.W ? pp.chunk : pp.W;
  make_map(&p.tm_x, pp.x, pp.W, pp.H, int64_t(pp.B) * pp.C, s.boxrows, pp.dtype, s.sub * T);
  make_map(&p.tm_lam, pp.lam, pp.W, pp.H, int64_t(pp.B) * 4 * pp.C, s.boxrows, pp.dtype, s.sub * T);
  make_map(&p.tm_g, pp.gates, pp.W, pp.H, int64_t(pp.B) * 12 * pp.K, s.boxrows, pp.dtype, s.sub * T);
  return p;
}

void launch_ncta(const ClusterParams& p, const PropagateParams& pp, cudaStream_t stream, bool backward) {
  switch (pp.ncta) {
    case 2: launch_cluster<2>(p, pp, stream, backward); break;
    case 4: launch_cluster<4>(p, pp, stream, backward); break;
    case 8: launch_cluster<8>(p, pp, stream, backward); break;
    default: throw std::runtime_error(message("gspn2: cluster of ", pp.ncta, " CTAs not built"));
  }
}

}  // namespace

void launch_forward_cluster(const PropagateParams& pp, cudaStream_t stream) {
  TORCH_CHECK(pp.ncta > 0, "gspn2: cluster kernel planned for an unsupported case");
  const ClusterShape s = cluster_shape(pp.H, pp.ncta, false, element_size(pp.dtype), pp.cluster_sub);
  const bool wide = s.sub == 2 && pp.dtype != ScalarType::Float && s.nstage == 1;
  TORCH_CHECK(s.nstage == pp.cluster_stages && (wide || (s.sub == 1 && (pp.dtype == ScalarType::Float || s.nstage == 2))),
              "gspn2: cluster forward planned with ", pp.cluster_stages, " stage buffers and copies of ", s.sub, " tiles");
  bind_context();
  ClusterParams p = cluster_params(pp, s);
  make_map(&p.tm_h, pp.h, pp.W, pp.H, int64_t(pp.B) * 4 * pp.C, s.oboxrows, pp.dtype);
  launch_ncta(p, pp, stream, false);
}

void launch_backward_cluster(const PropagateParams& pp, cudaStream_t stream) {
  TORCH_CHECK(pp.ncta > 0 && pp.cs == 1, "gspn2: cluster backward planned for an unsupported case");
  const ClusterShape s = cluster_shape(pp.H, pp.ncta, true, element_size(pp.dtype), 1);
  TORCH_CHECK(s.threads == pp.cluster_threads, "gspn2: cluster backward planned with ", pp.cluster_threads, " threads");
  bind_context();
  ClusterParams p = cluster_params(pp, s);
  p.part = pp.nsl > 1;
  // Inputs and grad_lam in the input dtype; the grad_x terms and gate partials in fp32.
  make_map(&p.tm_gh, pp.grad_h, pp.W, pp.H, int64_t(pp.B) * 4 * pp.C, s.boxrows, pp.dtype);
  make_map(&p.tm_h, pp.h_saved, pp.W, pp.H, int64_t(pp.B) * 4 * pp.C, s.boxrows, pp.dtype);
  make_map(&p.tm_glam, pp.grad_lam, pp.W, pp.H, int64_t(pp.B) * 4 * pp.C, s.R, pp.dtype);
  make_map(&p.tm_gx, pp.grad_x_part, pp.W, pp.H, int64_t(4) * pp.B * pp.C, s.R);
  if (p.part) {
    make_map(&p.tm_gg, pp.grad_gates_part, pp.W, pp.H, int64_t(pp.nsl) * pp.B * 12 * pp.K, s.R);
  } else {
    make_map(&p.tm_gg, pp.grad_gates, pp.W, pp.H, int64_t(pp.B) * 12 * pp.K, s.R, pp.dtype);
  }
  launch_ncta(p, pp, stream, true);
}

}  // namespace gspn2
