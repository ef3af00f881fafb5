// Shared by the host code (propagate.cpp) and the kernels (propagate_general.cu): the one params
// struct, the launch plan and the shared-memory layout. No torch headers here, so the .cu file
// compiles without them.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace gspn2 {

enum class ScalarType : int { Float = 0, Half = 1, BFloat16 = 2 };

inline int element_size(ScalarType t) { return t == ScalarType::Float ? 4 : 2; }

// Tuning constants shared by the planner and the kernels.
constexpr int kMaxThreadsForward = 1024;  // threads per block (64 registers each)
constexpr int kMaxThreadsBackward = 512;  // the reverse scan keeps more state: 128 registers each
constexpr int kMaxSlice = 16;           // channels of one affinity group handled by one block, at most
constexpr int kSmemLimit = 227 * 1024;  // opt-in shared memory per block on sm_90 (sm_80: 163 KB)
constexpr float kNormEps = 1e-7f;       // gspn2.ops.reference.NORM_EPS
// Streaming kernels: longest line, thread classes (launch bounds), tile lengths of horizontal scans.
constexpr int kFastMaxLine = 1024;
constexpr int kFastSmallThreads = 256;  // blocks of at most this many threads may keep up to 4 channels
constexpr int kFastTileF = 8;           // forward: scan steps per horizontal tile (32 B fp32, 16 B 16-bit)
constexpr int kFastTileB = 4;           // backward: scan steps per horizontal tile (16 B fp32, 8 B 16-bit)
// Streaming kernels' fp32 exchange line: per line position, the values of all channels side by side (forward:
// h of cs channels; backward: C_-1, C_0, C_+1 and h_{s-1} of cs channels), padded to an odd float count so
// that a warp's accesses at consecutive positions fall in different banks. Two such lines (double buffer).
// The backward of the 1024-thread blocks may run unpadded (PropagateParams::ls) where the padding would
// push the horizontal tile stage out of shared memory.
__host__ __device__ constexpr int fast_line_stride(int cs, bool backward) { return (backward ? 4 * cs : cs) | 1; }
// Cluster kernels (propagate_cluster.cu, sm_90, forward and backward of the horizontal directions): each line
// split over 2, 4 or 8 CTAs of a thread-block cluster, at most kClusterMaxRows own rows per CTA.
constexpr int kClusterTile = 16;        // scan steps per tile = halo rows per side
constexpr int kClusterMaxRows = 512;
constexpr int kClusterMaxRowsBwd = 128;  // the backward stages 7 planes twice and 5 output planes
constexpr int kClusterMaxRowsBwd16 = 256;  // ... 16-bit planes with `cluster_ctas` set (auto keeps 128)
// Threads per row in the backward's phase B (float32: two, on half a tile's columns each; 16-bit: one, which
// keeps two CTAs per SM within the register file).
__host__ __device__ constexpr int cluster_bwd_slices(int esize) { return esize == 4 ? 2 : 1; }
constexpr int kClusterAutoMinLine = 512;  // GSPN2_KERNEL=auto: the forward for H >= this (bench_op.py --cluster-choice)
constexpr int64_t kClusterAutoMinElemsBwd = int64_t(1) << 20;  // ... the backward for B * C * H * W >= this
constexpr int kClusterAutoMinLineBwd16 = 64;  // ... and, with 16-bit inputs, H >= this (bf16 32x49x32^2 measured slower)
// Split vertical lines (propagate_streaming.cu, with the cluster kernels): each vertical line on a cluster of 2, 4 or 8
// CTAs, CTA `rank` owning positions [rank R, rank R + R) and computing kSplitHalo more on each side; the CTAs
// swap their boundary values every kSplitHalo steps (the cluster kernels' tiling along the other axis).
constexpr int kSplitHalo = 16;
constexpr int kSplitMaxOwn = kFastMaxLine / 2;             // own positions per CTA, at most (R)
constexpr int kSplitMaxThreads = kSplitMaxOwn + 2 * kSplitHalo;
constexpr int kSplitMinOwn = 64;  // auto: CTAs per line doubled while each keeps at least this many positions

// Short-line kernels (propagate_short.cu): H and W at most kShortMaxLine; one block per (batch, affinity group)
// holds every input plane of the four directions in shared memory; a direction's line sits in one warp.
constexpr int kShortMaxLine = 32;
// The group sizes (channels per affinity group) they are built for.
__host__ __device__ constexpr bool short_channels_supported(int G) { return G == 1 || G == 2 || G == 4 || G == 8; }
// Their shared memory, in bytes from the start: a slot per staged run (the group's channels of x, of lam,
// grad_h and h per direction; one gate plane), 16 bytes longer than the run so that the copy can start at the
// run's own misalignment; then (backward) the four directions' fp32 grad_x terms.
struct ShortLayout {
  int pb, pg;  // bytes of a channel-group slot and of a gate-plane slot
  int x, lam, gh, h, gates, gx, total;
};
__host__ __device__ inline ShortLayout short_layout(int G, int HW, int esize, bool backward) {
  ShortLayout s;
  s.pb = ((G * HW * esize + 15) & ~15) + 16;
  s.pg = ((HW * esize + 15) & ~15) + 16;
  int off = 0;
  s.x = off;
  off += s.pb;
  s.lam = off;
  off += 4 * s.pb;
  s.gh = s.h = 0;
  if (backward) {
    s.gh = off;
    off += 4 * s.pb;
    s.h = off;
    off += 4 * s.pb;
  }
  s.gates = off;
  off += 12 * s.pg;
  s.gx = off;
  if (backward) off += 4 * G * HW * 4;
  s.total = off;
  return s;
}

// Division by a launch-invariant divisor through a multiply (Granlund-Montgomery round-up method):
// d >= 1 and numerators below 2^31. Set up on the host, used by the kernels.
struct FastDiv {
  uint32_t d, m, s;
  void init(uint32_t divisor) {
    d = divisor;
    s = 0;
    while ((uint64_t(1) << s) < d) ++s;
    m = uint32_t(((((uint64_t(1) << s) - d) << 32) / d) + 1);
  }
#ifdef __CUDACC__
  __device__ __forceinline__ int div(int n) const { return int((__umulhi(uint32_t(n), m) + uint32_t(n)) >> s); }
#endif
};

// A set of `nplanes` tile planes copied between global and shared memory with one geometry: `rows`
// scan steps (image indices row0 .. row0 + rows - 1 along the scan axis, row0 given per tile) by the
// whole line, in accesses of E consecutive elements along W. A job is one access: for horizontal
// scans (lines are image rows, W is the scan axis) it runs along the scan axis and lands transposed,
// in E rows of one column; for vertical scans it runs along the line, into one row.
struct CopySet {
  int nplanes;
  int rows;
  int E;
  int njobs;      // nplanes * jobs per plane
  FastDiv units;  // jobs per plane
  FastDiv inner;  // horizontal: accesses per line position (rows / E); vertical: per row (L / E)
};

inline CopySet make_copy_set(int nplanes, int rows, int E, int L, bool horiz) {
  CopySet s;
  s.nplanes = nplanes;
  s.rows = rows;
  s.E = E;
  const int inner = horiz ? rows / E : L / E;
  const int units = horiz ? L * inner : rows * inner;
  s.inner.init(uint32_t(inner));
  s.units.init(uint32_t(units));
  s.njobs = nplanes * units;
  return s;
}

// Copy sets of a launch, per orientation ([0]: horizontal scans d = 0, 1; [1]: vertical d = 2, 3).
enum CopyKind {
  kLoadMain = 0,   // forward: 3 gates, x, lam; backward: 3 gates, x, lam, grad_h, h
  kLoadBoundary,   // backward: h just outside the tile (one access per line position / one row)
  kStoreMain,      // forward: h; backward: grad_lam
  kStoreGradX,     // backward: this direction's grad_x term (fp32)
  kStoreGradGates, // backward: gate gradients (input dtype, or fp32 partials)
  kNumCopyKinds
};

// Everything a kernel needs. Strides are in elements; the host makes every tensor contiguous, the
// kernels only rely on a unit stride along W (the innermost dimension).
struct PropagateParams {
  ScalarType dtype;
  int B, C, H, W, K;
  int G;       // channels per affinity group, C / K
  int chunk;   // restart period in scan steps; 0 = one scan over the whole image
  // Decomposition chosen by make_plan().
  int cs;      // channels per block (a slice of one affinity group)
  int nsl;     // blocks per affinity group, G / cs
  int nx;      // threads along the line (one line position each, looping when the line is longer)
  int ny;      // nx * ny threads stage tiles; the first nx compute
  int T;       // scan steps per tile (a multiple of 4 / element size)
  int nbuf;    // input tile buffers: 2 = the next tile lands while this one is computed; 1 for long lines
  int E;       // elements per vertical-scan access along W: the widest power of two <= 16 bytes dividing W
  int smem_bytes;
  // Streaming kernels (propagate_streaming.cu), chosen when kernel == 2.
  int kernel;  // 1: general kernels, 2: streaming kernels, 3: short-line kernels
  int su;      // short-line kernels: lines (directions) per warp, 2 (lines of up to 16 pixels) or 1
  int nt;      // threads per block: one per line position, rounded up to a warp
  int pp;      // positions per exchange line (longest line + 2 halo, rounded); ls floats each
  int tile_h;  // horizontal scans load tiles of kFastTileF / kFastTileB steps through a per-thread stage
  int ls;      // floats per line position of the exchange line (fast_line_stride, or unpadded: see there)
  int ncta;          // > 0: the horizontal directions run in the cluster kernel, ncta CTAs per line
  int cluster_smem;  // its dynamic shared memory per CTA
  int cluster_stages;  // its input stage buffers
  int cluster_sub;     // forward: tiles per input copy (1, or 2: 16-bit rows of 64 bytes)
  int cluster_threads;  // its threads per CTA
  int vsplit;        // > 0 (only with ncta > 0): the vertical directions run split, vsplit CTAs per line
  int vs_R, vs_nt, vs_pp, vs_smem;  // ... own positions, threads, exchange-line positions and shared memory per CTA
  int overlap;  // 1 (only with ncta > 0): the cluster kernel and the streaming / split launch run side by side on two streams
  int ablate;  // profiling only (GSPN2_ABLATE): general kernels: bit 0 skips the tile loads, bit 1 the scan steps, bit 2 the stores; streaming kernels: bit 3 skips horizontal blocks, bit 4 vertical ones, bit 6 forces the ring for horizontal scans, bit 7 keeps the cluster and streaming launches in one stream
  CopySet copy[2][kNumCopyKinds];
  // x (B, C, H, W)
  int64_t x_sb, x_sc;
  // lam (B, 4, C, H, W)
  int64_t lam_sb, lam_sd, lam_sc;
  // gates (B, 4, 3, K, H, W)
  int64_t g_sb, g_sd, g_so, g_sk;
  // h, grad_h, grad_lam (B, 4, C, H, W)
  int64_t h_sb, h_sd, h_sc;
  // grad_x partials (4, B, C, H, W) fp32: stride of the direction; b and c strides are x's
  int64_t gxp_sd;
  // grad_gates partials (nsl, B, 4, 3, K, H, W) fp32: stride of the slice; the rest are gates'
  int64_t ggp_ssl;
  // Forward.
  const void* x;
  const void* lam;
  const void* gates;
  void* h;
  // Backward.
  const void* grad_h;
  const void* h_saved;
  void* grad_x;
  void* grad_lam;
  void* grad_gates;
  float* grad_x_part;
  float* grad_gates_part;
};

__host__ __device__ inline int round_up(int a, int b) { return (a + b - 1) / b * b; }

// Elements per horizontal-scan load: one 4-byte copy (a pair of scan steps for 16-bit types) when
// the row allows it, else one element.
__host__ __device__ inline int horiz_load_elems(const PropagateParams& p) {
  return (p.dtype != ScalarType::Float && p.W % 2 == 0) ? 2 : 1;
}

// Rows of the backward's boundary planes (h just outside the tile, loaded with the tile).
__host__ __device__ inline int boundary_rows(const PropagateParams& p, bool horiz) {
  return horiz ? horiz_load_elems(p) : 1;
}

// Byte offsets into a block's dynamic shared memory. A tile plane holds T scan steps by the whole
// line. Element (t, q) lives at t * pitch + q, except for 16-bit types in horizontal scans, where the
// two steps of a 4-byte copy sit side by side: ((t / 2) * pitch + q) * 2 + t % 2. Either way the
// compute loop reads step t at consecutive line positions, conflict-free. Input planes are double
// buffered: tile k + 1 lands (cp.async) while tile k is computed.
struct SmemLayout {
  int pitch;        // line positions per plane row (pairs of rows for 16-bit horizontal planes)
  int pp;           // floats per line of the fp32 line buffers (pitch + 2 halo, rounded)
  int plane_bytes;  // one T-row input plane
  int bnd_plane_bytes;
  int nplanes;      // input planes per buffer (forward: 3 gates, cs x, cs lam; backward: + cs grad_h, cs h)
  int buf_bytes;    // one input buffer: nplanes planes + (backward) cs boundary planes
  int gx_off;       // backward, 16-bit inputs: cs fp32 planes of lam_d * adjoint (fp32 uses the lam planes)
  int gx_plane_bytes;
  int gg_off;       // backward, fp32 partials of 16-bit inputs: 3 fp32 planes (else the gate planes)
  int gg_plane_bytes;
  int gg_esize;     // element size of the gate-gradient planes
  int line_off;     // fp32 line buffers: forward prev[2][cs]; backward exchange[2][3][cs]
  int total;
};

__host__ __device__ inline int align16(int bytes) { return (bytes + 15) & ~15; }

__host__ __device__ inline SmemLayout smem_layout(const PropagateParams& p, bool horiz, bool backward) {
  const int esize = p.dtype == ScalarType::Float ? 4 : 2;
  const int L = horiz ? p.H : p.W;
  SmemLayout s;
  if (horiz) {
    // cp.async lanes cover (32 / n) line positions x n row groups: a pitch of 32 / n modulo 32 words
    // puts the n row groups in different banks.
    const int pair = esize == 2 ? 2 : 1;
    const int n = (p.T + pair - 1) / pair;
    s.pitch = round_up(L, 32) + (n > 1 ? 32 / n : 0);
  } else {
    s.pitch = round_up(L, 8);  // rows 16-byte aligned for 16-byte copies
  }
  s.pp = round_up(s.pitch + 2, 4);
  const bool paired = horiz && esize == 2;
  s.plane_bytes = align16((paired ? round_up(p.T, 2) : p.T) * s.pitch * esize);
  s.nplanes = backward ? 3 + 4 * p.cs : 3 + 2 * p.cs;
  s.bnd_plane_bytes = backward ? align16((paired ? 2 : 1) * s.pitch * esize) : 0;
  s.buf_bytes = s.nplanes * s.plane_bytes + p.cs * s.bnd_plane_bytes;
  int off = p.nbuf * s.buf_bytes;
  s.gx_off = s.gg_off = 0;
  s.gx_plane_bytes = s.gg_plane_bytes = 0;
  s.gg_esize = esize;
  if (backward) {
    if (esize != 4) {
      s.gx_off = off;
      s.gx_plane_bytes = align16(p.T * s.pitch * 4);
      off += p.cs * s.gx_plane_bytes;
    }
    s.gg_esize = (p.nsl > 1) ? 4 : esize;
    if (s.gg_esize != esize) {
      s.gg_off = off;
      s.gg_plane_bytes = align16(p.T * s.pitch * 4);
      off += 3 * s.gg_plane_bytes;
    }
  }
  s.line_off = off;
  off += (backward ? 2 * 3 : 2) * p.cs * s.pp * 4;
  s.total = off;
  return s;
}

// Launchers. Each launches on `stream` and checks the launch.
// propagate_general.cu: the general kernels (shared-memory tiles, any line length up to ~4096).
void launch_forward(const PropagateParams& p, cudaStream_t stream);
void launch_backward(const PropagateParams& p, cudaStream_t stream);
// grad_x = sum of the four directions' fp32 terms, gate gradients = sum of the slices' partials.
void launch_backward_reduce(const PropagateParams& p, cudaStream_t stream);
// propagate_streaming.cu: the streaming kernels (lines of up to kFastMaxLine pixels; plan_fast() decides).
void launch_forward_fast(const PropagateParams& p, cudaStream_t stream);

struct ClusterShape {
  int R, NT;            // own rows per CTA (a multiple of 16), threads per CTA
  int boxrows, nbox;    // TMA input boxes per plane and tile
  int oboxrows, onbox;  // TMA output boxes per tile
  int nstage;           // input stage buffers (the backward always has two)
  int sub;              // forward: tiles of kClusterTile steps per input copy (1, or 2: the bf16 wide copies)
  int smem;             // dynamic shared memory per CTA
  int threads;          // threads per CTA: NT, times cluster_bwd_slices in the backward
};
ClusterShape cluster_shape(int H, int ncta, bool backward, int esize, int sub = 1);
void launch_forward_cluster(const PropagateParams& p, cudaStream_t stream);
void launch_backward_cluster(const PropagateParams& p, cudaStream_t stream);
void launch_backward_fast(const PropagateParams& p, cudaStream_t stream);
// propagate_short.cu: the short-line kernels, one launch per pass (make_plan_short() decides).
void launch_forward_short(const PropagateParams& p, cudaStream_t stream);
void launch_backward_short(const PropagateParams& p, cudaStream_t stream);

}  // namespace gspn2
