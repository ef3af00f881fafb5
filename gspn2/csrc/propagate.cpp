// Host side of the CUDA propagation op: input checks, the launch plan, allocation, and the registration of
// the CUDA implementations of gspn2::propagate and gspn2::propagate_backward (schemas: gspn2/ops/propagate.py)
// together with their autograd formula for CUDA tensors, so that a call from Python runs no Python below
// torch.ops. Every choice (kernel family, CTAs per cluster line) arrives as an op argument.
#include <torch/extension.h>
#include <torch/library.h>

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "calls.h"
#include "dwconv.h"
#include "message.h"
#include "propagate.h"

#define CHECK_CUDA(t) GSPN2_CHECK((t).is_cuda(), "`" #t "` must be a CUDA tensor, got ", (t).device())
#define CHECK_SAME_DEVICE(t, ref) \
  GSPN2_CHECK((t).device() == (ref).device(), "`" #t "` must be on ", (ref).device(), " like `" #ref "`, got ", (t).device())
#define CHECK_DTYPE(t, dt) GSPN2_CHECK_TYPE((t).scalar_type() == (dt), "`" #t "` must have dtype ", (dt), " like `x`, got ", (t).scalar_type())
#define CHECK_STRIDED(t)                                                                                \
  GSPN2_CHECK_TYPE((t).layout() == at::kStrided && !(t).is_nested(), "`" #t "` must be a dense (strided) tensor, got ", \
                   (t).is_nested() ? "a nested tensor" : "layout " + layout_name((t).layout()))
#define CHECK_SHAPE(t, ...)                                                                                 \
  do {                                                                                                      \
    const std::vector<int64_t> expected_{__VA_ARGS__};                                                      \
    GSPN2_CHECK((t).sizes() == at::IntArrayRef(expected_), "`" #t "` must have shape (" #__VA_ARGS__ ") = ", \
                at::IntArrayRef(expected_), ", got ", (t).sizes());                                        \
  } while (0)

// Profiling ablations, a build flag (GSPN2_ABLATE=<bits> in the environment of the build, setup.py; results are
// wrong): the bits of PropagateParams::ablate (propagate.h).
#ifndef GSPN2_ABLATE
#define GSPN2_ABLATE 0
#endif

namespace gspn2 {
namespace {

constexpr int kAblate = GSPN2_ABLATE;

std::string layout_name(at::Layout layout) {
  switch (layout) {
    case at::kStrided: return "strided";
    case at::kSparse: return "sparse_coo";
    case at::kSparseCsr: return "sparse_csr";
    case at::kSparseCsc: return "sparse_csc";
    case at::kSparseBsr: return "sparse_bsr";
    case at::kSparseBsc: return "sparse_bsc";
    case at::kMkldnn: return "mkldnn";
    case at::kJagged: return "jagged";
    default: return "non-strided";
  }
}

// The kernel family asked for (the op's `kernel` argument): auto (the planner's choice), fast (streaming kernels
// only), general (general kernels), cluster (the streaming plan with the cluster kernels on every pass), short
// (the short-line kernels).
enum class Family { Auto, Fast, General, Cluster, Short };

struct PlanOptions {
  Family family = Family::Auto;
  int cluster_ctas = 0;  // CTAs per line of the cluster kernel: 0 = the planner's choice, else 2, 4 or 8
};

const char* family_name(Family f) {
  switch (f) {
    case Family::Fast: return "fast";
    case Family::General: return "general";
    case Family::Cluster: return "cluster";
    case Family::Short: return "short";
    default: return "auto";
  }
}

PlanOptions parse_options(c10::string_view kernel, int64_t cluster_ctas) {
  PlanOptions o;
  if (kernel == "auto") o.family = Family::Auto;
  else if (kernel == "fast") o.family = Family::Fast;
  else if (kernel == "general") o.family = Family::General;
  else if (kernel == "cluster") o.family = Family::Cluster;
  else if (kernel == "short") o.family = Family::Short;
  else GSPN2_CHECK(false, "`kernel` must be 'auto', 'fast', 'general', 'cluster' or 'short', got '", std::string(kernel), "'");
  GSPN2_CHECK(cluster_ctas == 0 || cluster_ctas == 2 || cluster_ctas == 4 || cluster_ctas == 8,
              "`cluster_ctas` must be 0 (the planner's choice), 2, 4 or 8, got ", cluster_ctas);
  o.cluster_ctas = int(cluster_ctas);
  return o;
}

ScalarType to_scalar_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ScalarType::Float;
    case at::kHalf: return ScalarType::Half;
    case at::kBFloat16: return ScalarType::BFloat16;
    default:
      GSPN2_CHECK_TYPE(false, "`x` must be float32, float16 or bfloat16 for the CUDA kernel, got ", t,
                       " (gspn2.ops.gspn_propagate runs float64 through the reference)");
  }
  return ScalarType::Float;
}

// Contiguous, and 16-byte aligned so that the kernel's wide accesses are legal.
at::Tensor prepare(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  if (reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 != 0) c = c.clone();
  return c;
}

void fill_copy_sets(PropagateParams& p, bool backward) {
  for (int o = 0; o < 2; ++o) {
    const bool horiz = o == 0;
    const int L = horiz ? p.H : p.W;
    // Loads: horizontal scans copy 4 bytes (1 or 2 elements) per line position and step pair,
    // vertical ones p.E elements along the line. Stores: p.E elements along W, at most a tile.
    const int le = horiz ? horiz_load_elems(p) : p.E;
    const int se = horiz ? std::min(p.E, p.T) : p.E;
    const int gg_esize = smem_layout(p, horiz, true).gg_esize;
    CopySet* c = p.copy[o];
    c[kLoadMain] = make_copy_set(backward ? 3 + 4 * p.cs : 3 + 2 * p.cs, p.T, le, L, horiz);
    c[kLoadBoundary] = make_copy_set(backward ? p.cs : 0, boundary_rows(p, horiz), le, L, horiz);
    c[kStoreMain] = make_copy_set(p.cs, p.T, se, L, horiz);
    c[kStoreGradX] = make_copy_set(p.cs, p.T, std::min(se, 4), L, horiz);
    c[kStoreGradGates] = make_copy_set(3, p.T, std::min(se, 16 / gg_esize), L, horiz);
  }
}

int smem_bytes(const PropagateParams& p, bool backward) {
  return std::max(smem_layout(p, true, backward).total, smem_layout(p, false, backward).total);
}

// Choose the channel slice, the tile length and the block shape. Longer tiles make the horizontal
// scans' copies longer runs along W (up to 128 bytes per line position and plane: whole cache lines),
// so the tile is the longest that fits the budget; then the widest channel slice (the gates of a
// group are read by fewer blocks). Two buffers (loads overlap compute) unless only one fits.
// Streaming kernels (propagate_streaming.cu) for lines of up to kFastMaxLine pixels: one thread per line
// position; blocks of more than kFastSmallThreads threads (64 registers each) keep one channel, smaller
// ones up to four channels of a group. Horizontal scans use the per-thread tile stage when W is a
// multiple of the tile and it fits. kernel='general' forces the general kernels (tests, comparisons).
// The horizontal directions go to the cluster kernels (W a multiple of its tile, sm_90): the forward (every
// dtype) for lines of at least kClusterAutoMinLine rows, the backward (every dtype) for problems of at least
// kClusterAutoMinElemsBwd elements (B * C * H * W), or always with kernel='cluster': the
// fewest CTAs per line whose rows fit one CTA, doubled (up to 8) while the launch leaves SMs idle;
// `cluster_ctas` overrides the count (benchmarks).
void plan_cluster(PropagateParams& p, bool backward, const PlanOptions& o, int smem_limit, int nsm, int cc_major) {
  const bool forced = o.family == Family::Cluster;
  p.ncta = 0;
  p.cluster_smem = 0;
  p.cluster_stages = 0;
  p.cluster_sub = 1;
  p.cluster_threads = 0;
  // Below these sizes the streaming kernels measured faster (bench_op.py --cluster-choice, docs/benchmarks.md).
  const bool large = backward ? int64_t(p.B) * p.C * p.H * p.W >= kClusterAutoMinElemsBwd : p.H >= kClusterAutoMinLine;
  if (!forced && !(o.family == Family::Auto && large)) return;
  if (!forced && backward && p.dtype != ScalarType::Float && p.H < kClusterAutoMinLineBwd16) return;
  if (p.W % kClusterTile != 0 || cc_major < 9) {
    GSPN2_CHECK(!forced, "kernel='cluster' needs W a multiple of ", kClusterTile,
                " and an sm_90 GPU; got W = ", p.W, ", compute capability ", cc_major, ".x");
    return;
  }
  const int max_rows = backward ? kClusterMaxRowsBwd : kClusterMaxRows;
  int ncta = 2;
  while (ncta < 8 && (p.H + ncta - 1) / ncta > max_rows) ncta *= 2;
  if ((p.H + ncta - 1) / ncta > max_rows) {
    GSPN2_CHECK(!forced, "kernel='cluster': ", p.H, " rows do not fit 8 CTAs of ", max_rows);
    return;
  }
  // 10 * CTAs < 9 * SMs: B16 C2 (128 CTAs of 2 per line on 132 SMs) measured faster than 4 per line.
  while (ncta < 8 && int64_t(20) * p.B * p.C * ncta < int64_t(9) * nsm &&
         (p.H + 2 * ncta - 1) / (2 * ncta) >= 2 * kClusterTile) {
    ncta *= 2;
  }
  if (o.cluster_ctas > 0) {  // benchmarks; the 16-bit backward also takes up to kClusterMaxRowsBwd16 rows there
    const int most = backward && p.dtype != ScalarType::Float ? kClusterMaxRowsBwd16 : max_rows;
    GSPN2_CHECK((p.H + o.cluster_ctas - 1) / o.cluster_ctas <= most, "`cluster_ctas` = ", o.cluster_ctas,
                " leaves more than ", most, " rows per CTA for H = ", p.H);
    ncta = o.cluster_ctas;
  }
  // The 16-bit forward's wide copies: where two input stage buffers of 64-byte rows (two tiles per copy) do
  // not fit but one does, that one instead of two of 32-byte rows: the same shared memory, row visits twice
  // as long (docs/kernel.md, "Cluster kernels"; measured 0.73-0.88x the forward at H = 768 and 1024 in bf16,
  // 0.73x at 16x2x1024^2 in fp16; where two 64-byte buffers fit, up to 256 rows per CTA, 1.00-1.18x).
  int sub = 1;
  if (!backward && p.dtype != ScalarType::Float && p.W % (2 * kClusterTile) == 0) {
    const ClusterShape wide = cluster_shape(p.H, ncta, false, element_size(p.dtype), 2);
    if (wide.nstage == 1 && wide.smem <= smem_limit) sub = 2;
  }
  const ClusterShape s = cluster_shape(p.H, ncta, backward, element_size(p.dtype), sub);
  if (s.smem > smem_limit) {
    GSPN2_CHECK(!forced, "kernel='cluster': ", s.smem, " bytes of shared memory per CTA do not fit ",
                smem_limit);
    return;
  }
  p.ncta = ncta;
  p.cluster_smem = s.smem;
  p.cluster_stages = s.nstage;
  p.cluster_sub = s.sub;
  p.cluster_threads = s.threads;
}

// Split vertical lines (propagate_streaming.cu), with the cluster kernels only (otherwise the horizontal
// blocks share the streaming launch with the vertical ones): under auto where one block per vertical line (one
// channel each) leaves SMs idle, 2, 4 or 8 CTAs per line, doubled while the launch covers less than 90% of
// the SMs and each CTA keeps at least kSplitMinOwn positions; kernel='cluster' splits every line (2 CTAs or
// more); `cluster_ctas` sets the count (benchmarks). The split kernel takes one channel per CTA.
void plan_split(PropagateParams& p, bool backward, const PlanOptions& o, int smem_limit, int nsm) {
  p.vsplit = 0;
  if (p.ncta == 0) return;
  const int64_t lines = int64_t(2) * p.B * p.C;
  int n = 1;
  while (n < 8 && 10 * lines * n < int64_t(9) * nsm && (p.W + 2 * n - 1) / (2 * n) >= kSplitMinOwn) n *= 2;
  if (o.family == Family::Cluster) n = std::max(n, 2);
  if (o.cluster_ctas > 0) n = o.cluster_ctas;
  if (n == 1) return;
  const int R = round_up((p.W + n - 1) / n, 16);
  const int nv = backward ? 3 : 1;  // exchange-line values a CTA hands on per position
  const int ls = fast_line_stride(1, backward);
  const int nt = round_up(R + 2 * kSplitHalo, 32);
  const int pp = round_up(nt + 2, 4);
  const int smem = (2 * ls * pp + 4 * kSplitHalo * nv) * 4;
  if (R > kSplitMaxOwn || smem > smem_limit) return;  // W <= kFastMaxLine: R fits from 2 CTAs on
  p.vsplit = n;
  p.vs_R = R;
  p.vs_nt = nt;
  p.vs_pp = pp;
  p.vs_smem = smem;
}

// The short-line kernels' horizontal lanes read one element of each of the H rows of a staged plane at once
// (lane q at q * W): the largest number of distinct 4-byte words of such a read that share one of the 32
// shared-memory banks (1: conflict-free), over both element parities of a 16-bit row.
int short_bank_conflicts(int H, int W, int esize) {
  int worst = 1;
  for (int parity = 0; parity < (esize == 2 ? 2 : 1); ++parity) {
    int count[32] = {};
    int64_t last_word[32];
    for (int k = 0; k < 32; ++k) last_word[k] = -1;
    for (int q = 0; q < H; ++q) {
      const int64_t word = (int64_t(q) * W * esize + parity * esize) / 4;
      const int bank = int(word % 32);
      if (word != last_word[bank]) ++count[bank];  // rows in order: a repeated word is adjacent
      last_word[bank] = word;
      worst = std::max(worst, count[bank]);
    }
  }
  return worst;
}

// Short-line kernels (propagate_short.cu) under auto or kernel='short': H and W at most kShortMaxLine, a group
// size they are built for, and the block's planes in shared memory. Under auto also where they measured
// faster than the streaming kernels (bench_op.py --short-lines, docs/benchmarks.md): blocks (B * K) for at
// least half the SMs (one block walks all four directions and the group's channels, where the streaming
// kernels launch 4 * B * C / cs blocks); bank conflicts of the horizontal lanes' reads at most 2-way, or
// 4-way on lines of at least 24 pixels, where the saving per step outweighs them (W = 16 and 32 have 4- to
// 32-way ones); and not 8-channel groups on lines of up to 8 pixels. Lines per warp: 2 for lines of up to
// 16 pixels, else 1, so a block is 2 or 4 warps.
bool make_plan_short(PropagateParams& p, bool backward, const PlanOptions& o, int smem_limit, int nsm) {
  if (o.family != Family::Auto && o.family != Family::Short) return false;
  const int lmax = std::max(p.H, p.W);
  const int smem = lmax <= kShortMaxLine ? short_layout(p.G, p.H * p.W, element_size(p.dtype), backward).total : 0;
  const bool fits = lmax <= kShortMaxLine && short_channels_supported(p.G) && smem <= smem_limit;
  if (!fits) {
    GSPN2_CHECK(o.family != Family::Short, "kernel='short' needs H and W of at most ", kShortMaxLine,
                ", C / K in {1, 2, 4, 8} and the block's planes in ", smem_limit, " bytes of shared memory; got H = ",
                p.H, ", W = ", p.W, ", C / K = ", p.G, ", ", smem, " bytes");
    return false;
  }
  if (o.family == Family::Auto) {
    if (int64_t(2) * p.B * p.K < nsm) return false;
    const int conflicts = short_bank_conflicts(p.H, p.W, element_size(p.dtype));
    if (conflicts > 4 || (conflicts > 2 && lmax < 24)) return false;
    if (p.G == 8 && lmax <= 8) return false;
  }
  p.kernel = 3;
  p.su = lmax <= 16 ? 2 : 1;
  p.nt = 32 * (4 / p.su);
  p.cs = p.G;
  p.nsl = 1;
  p.ncta = 0;
  p.overlap = 0;
  p.smem_bytes = smem;
  return true;
}

bool make_plan_fast(PropagateParams& p, bool backward, const PlanOptions& o, int smem_limit, int nsm, int cc_major) {
  const int lmax = std::max(p.H, p.W);
  p.ncta = 0;
  if (o.family == Family::General) return false;
  if (lmax > kFastMaxLine) {
    GSPN2_CHECK(o.family == Family::Auto, "kernel='", family_name(o.family), "': the streaming kernels take lines of up to ",
                kFastMaxLine, " pixels, got H = ", p.H, ", W = ", p.W, "; use kernel='auto'");
    return false;
  }
  plan_cluster(p, backward, o, smem_limit, nsm, cc_major);
  plan_split(p, backward, o, smem_limit, nsm);
  // The cluster kernel (horizontal directions) and the launch of the vertical ones are independent: side by
  // side on two streams, the second kernel's CTAs take the SMs the first leaves idle (its last wave, the SMs
  // no cluster fits). Not for the forward with one stage buffer (float32, more than 256 rows per CTA),
  // where it took 1.09x the time at B16xC2x1024^2 (docs/benchmarks.md, "Design choices of the kernels,
  // measured").
  p.overlap = p.ncta > 0 && (backward || p.cluster_stages == 2) && !(p.ablate & 128);
  const int esize = element_size(p.dtype);
  p.kernel = 2;
  p.nt = round_up(lmax, 32);
  // The widest slice (gates read by fewer blocks) that still gives every SM a block; one channel per
  // block when even that leaves SMs idle (B = 1 with shared gates).
  p.cs = 1;  // the backward with the cluster kernel: one channel per block, so both write gate partials per channel
  if (p.nt <= kFastSmallThreads && !(backward && p.ncta > 0) && p.vsplit == 0) {
    for (const int cs : {4, 2}) {
      if (p.G % cs == 0 && int64_t(4) * p.B * p.K * (p.G / cs) >= nsm) {
        p.cs = cs;
        break;
      }
    }
  }
  p.nsl = p.G / p.cs;
  p.pp = round_up(lmax + 2, 4);
  const int T = backward ? kFastTileB : kFastTileF;
  const int planes = backward ? 3 + 4 * p.cs : 3 + 2 * p.cs;
  // Backward tiles also stage their outputs: grad_lam (input dtype), grad_x term and gate gradients (fp32).
  const int out_bytes = backward ? align16(p.cs * T * p.nt * esize) + (p.cs + 3) * T * p.nt * 4 : 0;
  const int stage_bytes = p.nt * planes * T * esize + out_bytes;
  // The exchange line's stride: padded (conflict-free); unpadded for the 1024-thread blocks' backward where
  // only that leaves room for the horizontal scans' tile stage (lines of about 1000 pixels in float32;
  // otherwise they would fall back to the ring's strided loads, 2.5x slower at 1024^2). Not when the
  // cluster kernel takes the horizontal directions: the vertical blocks need no stage.
  p.ls = fast_line_stride(p.cs, backward);
  if (backward && p.nt > kFastSmallThreads && p.ncta == 0 && p.W % T == 0 &&
      2 * p.ls * p.pp * 4 + stage_bytes > smem_limit) {
    p.ls = 4 * p.cs;
  }
  const int line_bytes = 2 * p.ls * p.pp * 4;
  p.tile_h = (p.W % T == 0 && line_bytes + stage_bytes <= smem_limit && !(p.ablate & 64)) ? 1 : 0;
  p.smem_bytes = line_bytes + (p.tile_h ? stage_bytes : 0);
  p.T = p.tile_h ? T : 0;
  return true;
}

void make_plan(PropagateParams& p, bool backward, const PlanOptions& o) {
  const int esize = element_size(p.dtype);
  const int tmax = 128 / esize;
  const int tmin = esize == 2 ? 2 : 1;  // one 4-byte copy
  p.E = 16 / esize;
  while (p.W % p.E != 0) p.E /= 2;
  const int max_threads = backward ? kMaxThreadsBackward : kMaxThreadsForward;
  p.nx = std::min(round_up(std::max(p.H, p.W), 32), max_threads);
  int tcap = tmin;  // no longer than the longest scan, rounded up to a power of two
  while (tcap < tmax && tcap < std::max(p.H, p.W)) tcap *= 2;

  bool found = false;
  PropagateParams best = p;
  int nsm = 132;  // enough blocks to fill the GPU come first (B = 1 with shared gates has few)
  int smem_limit = kSmemLimit;  // sm_90; the device's own opt-in limit where one is present (sm_80: 163 KB)
  int cc_major = 9;  // planning without a device: an H200
  int dev = 0;
  if (cudaGetDevice(&dev) == cudaSuccess) {
    cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, dev);
    cudaDeviceGetAttribute(&cc_major, cudaDevAttrComputeCapabilityMajor, dev);
    int optin = 0;
    if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) == cudaSuccess && optin > 0) {
      smem_limit = std::min(smem_limit, optin - 1024);
    }
  }
  cudaGetLastError();  // no device here (planning only): keep the defaults
  if (make_plan_short(p, backward, o, smem_limit, nsm)) return;
  if (make_plan_fast(p, backward, o, smem_limit, nsm, cc_major)) return;
  p.kernel = 1;
  auto score = [&](const PropagateParams& q) {
    const int64_t blocks = int64_t(4) * q.B * q.K * q.nsl;
    return std::make_tuple(std::min<int64_t>(blocks, nsm), q.nbuf, std::min(q.T * esize, 16), q.cs, q.T);
  };
  // First pass: a footprint proportional to the block's threads, so that about 1024 threads' worth
  // of blocks share a multiprocessor (short lines, many small blocks); then whatever fits.
  const int threads = p.nx * std::min(std::min(p.G, 4), std::max(1, max_threads / p.nx));
  for (const int budget : {std::max(16 * 1024, int(int64_t(smem_limit) * threads / 1024)), smem_limit}) {
    for (int nbuf = 2; nbuf >= 1; --nbuf) {
      for (int cs = std::min(p.G, kMaxSlice); cs >= 1; --cs) {
        if (p.G % cs != 0) continue;
        for (int T = tcap; T >= tmin; T /= 2) {
          PropagateParams q = p;
          q.nbuf = nbuf;
          q.cs = cs;
          q.nsl = p.G / cs;
          q.T = T;
          q.ny = 1;  // extra staging threads for short lines with many planes
          while (q.ny * 2 <= std::min(cs, 4) && q.nx * q.ny * 2 <= max_threads) q.ny *= 2;
          q.smem_bytes = smem_bytes(q, backward);
          if (q.smem_bytes > budget) continue;
          if (!found || score(q) > score(best)) best = q;
          found = true;
          break;  // the longest tile that fits for this slice width
        }
      }
    }
    // Accept the small-footprint plan only if its tiles are at least 16 bytes per line position.
    if (found && best.T * esize >= std::min(16, tcap * esize)) break;
  }
  GSPN2_CHECK(found, "a line of ", std::max(p.H, p.W),
              " pixels does not fit in one block's shared memory; the CUDA kernel supports lines of up to "
              "about 4096 pixels (gspn_propagate_ref runs any size)");
  p = best;
  fill_copy_sets(p, backward);
  for (int r = 0; r < 2; ++r) {  // profiling ablations (build flag GSPN2_ABLATE), results are wrong
    for (int k = 0; k < kNumCopyKinds; ++k) {
      const bool load = k == kLoadMain || k == kLoadBoundary;
      if ((load && (p.ablate & 1)) || (!load && (p.ablate & 4))) p.copy[r][k].njobs = 0;
    }
  }
}

PropagateParams make_params(const at::Tensor& x, const at::Tensor& lam, const at::Tensor& gates,
                            std::optional<int64_t> chunk) {
  PropagateParams p{};
  p.dtype = to_scalar_type(x.scalar_type());
  p.B = int(x.size(0));
  p.C = int(x.size(1));
  p.H = int(x.size(2));
  p.W = int(x.size(3));
  p.K = int(gates.size(3));
  p.G = p.C / p.K;
  p.chunk = chunk.has_value() ? int(std::min<int64_t>(*chunk, INT32_MAX)) : 0;
  const int64_t HW = int64_t(p.H) * p.W;
  p.x_sb = int64_t(p.C) * HW;
  p.x_sc = HW;
  p.lam_sb = 4 * int64_t(p.C) * HW;
  p.lam_sd = int64_t(p.C) * HW;
  p.lam_sc = HW;
  p.g_sb = 4 * 3 * int64_t(p.K) * HW;
  p.g_sd = 3 * int64_t(p.K) * HW;
  p.g_so = int64_t(p.K) * HW;
  p.g_sk = HW;
  p.h_sb = p.lam_sb;
  p.h_sd = p.lam_sd;
  p.h_sc = p.lam_sc;
  p.gxp_sd = int64_t(p.B) * p.C * HW;
  p.ggp_ssl = int64_t(p.B) * 4 * 3 * p.K * HW;
  p.ablate = kAblate;
  p.x = x.data_ptr();
  p.lam = lam.data_ptr();
  p.gates = gates.data_ptr();
  return p;
}

void check_inputs(const at::Tensor& x, const at::Tensor& lam, const at::Tensor& gates,
                  std::optional<int64_t> chunk) {
  CHECK_STRIDED(x);
  CHECK_STRIDED(lam);
  CHECK_STRIDED(gates);
  CHECK_CUDA(x);
  CHECK_SAME_DEVICE(lam, x);
  CHECK_SAME_DEVICE(gates, x);
  to_scalar_type(x.scalar_type());
  CHECK_DTYPE(lam, x.scalar_type());
  CHECK_DTYPE(gates, x.scalar_type());
  GSPN2_CHECK(x.dim() == 4, "`x` must have shape (B, C, H, W), got ", x.sizes());
  const int64_t B = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  GSPN2_CHECK(B >= 1 && C >= 1 && H >= 1 && W >= 1, "`x` must have no empty dimension, got ", x.sizes());
  CHECK_SHAPE(lam, B, 4, C, H, W);
  GSPN2_CHECK(gates.dim() == 6, "`gates` must have shape (B, 4, 3, K, H, W), got ", gates.sizes());
  const int64_t K = gates.size(3);
  GSPN2_CHECK(K >= 1 && C % K == 0, "`gates` has K = ", K, " affinity groups (dim 3), which must divide C = ", C);
  CHECK_SHAPE(gates, B, 4, 3, K, H, W);
  GSPN2_CHECK(H * W < (int64_t(1) << 31), "`x`: H * W must be below 2^31, got ", H, " x ", W);
  GSPN2_CHECK(4 * B * C < (int64_t(1) << 31), "`x`: B * C = ", B * C, " is too large for one launch (4 * B * C must be below 2^31)");
  GSPN2_CHECK(!chunk.has_value() || *chunk >= 1, "`chunk` must be None or >= 1, got ", chunk.value_or(0));
}

void check_backward_inputs(const at::Tensor& grad_h, const at::Tensor& x, const at::Tensor& h) {
  const int64_t B = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  CHECK_STRIDED(grad_h);
  CHECK_STRIDED(h);
  CHECK_SAME_DEVICE(grad_h, x);
  CHECK_SAME_DEVICE(h, x);
  CHECK_DTYPE(grad_h, x.scalar_type());
  CHECK_DTYPE(h, x.scalar_type());
  CHECK_SHAPE(grad_h, B, 4, C, H, W);
  CHECK_SHAPE(h, B, 4, C, H, W);
}

// `first(stream)`, then `second(stream)`; with p.overlap, `second` on a stream of the pool instead, forked from
// `stream` before `first` and joined back into it after `second`. Both run to completion before anything
// enqueued on `stream` afterwards, so the tensors they touch follow `stream`'s order as usual (CUDA graphs
// capture the fork and join as edges).
template <class First, class Second>
void launch_side_by_side(const PropagateParams& p, cudaStream_t stream, const First& first, const Second& second) {
  if (!p.overlap) {
    first(stream);
    second(stream);
    return;
  }
  const cudaStream_t side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, c10::cuda::current_device()).stream();
  cudaEvent_t fork = nullptr, join = nullptr;
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  C10_CUDA_CHECK(cudaEventRecord(fork, stream));
  C10_CUDA_CHECK(cudaStreamWaitEvent(side, fork, 0));
  first(stream);
  second(side);
  C10_CUDA_CHECK(cudaEventRecord(join, side));
  C10_CUDA_CHECK(cudaStreamWaitEvent(stream, join, 0));
  C10_CUDA_CHECK(cudaEventDestroy(fork));  // released once the pending record and waits complete
  C10_CUDA_CHECK(cudaEventDestroy(join));
}

// The CUDA implementation of gspn2::propagate.
at::Tensor propagate_forward(const at::Tensor& x_, const at::Tensor& lam_, const at::Tensor& gates_,
                             std::optional<int64_t> chunk, c10::string_view kernel, int64_t cluster_ctas) {
  const PlanOptions o = parse_options(kernel, cluster_ctas);
  check_inputs(x_, lam_, gates_, chunk);
  const c10::cuda::CUDAGuard guard(x_.device());
  const at::Tensor x = prepare(x_), lam = prepare(lam_), gates = prepare(gates_);
  PropagateParams p = make_params(x, lam, gates, chunk);
  make_plan(p, /*backward=*/false, o);
  at::Tensor h = at::empty({p.B, 4, p.C, p.H, p.W}, x.options());
  p.h = h.data_ptr();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (p.kernel == 3) {
    launch_forward_short(p, stream);
  } else if (p.kernel == 2) {
    // With the cluster kernel: two launches, the horizontal directions first (side by side: p.overlap).
    launch_side_by_side(
        p, stream, [&](cudaStream_t s) { if (p.ncta > 0 && !(p.ablate & 8)) launch_forward_cluster(p, s); },
        [&](cudaStream_t s) { launch_forward_fast(p, s); });
  } else {
    launch_forward(p, stream);
  }
  return h;
}

// The CUDA implementation of gspn2::propagate_backward: (grad_x, grad_lam, grad_gates), contiguous.
std::tuple<at::Tensor, at::Tensor, at::Tensor> propagate_backward(
    const at::Tensor& grad_h_, const at::Tensor& x_, const at::Tensor& lam_, const at::Tensor& gates_,
    const at::Tensor& h_, std::optional<int64_t> chunk, c10::string_view kernel, int64_t cluster_ctas) {
  const PlanOptions o = parse_options(kernel, cluster_ctas);
  check_inputs(x_, lam_, gates_, chunk);
  check_backward_inputs(grad_h_, x_, h_);
  const int64_t B = x_.size(0), C = x_.size(1), H = x_.size(2), W = x_.size(3);
  const c10::cuda::CUDAGuard guard(x_.device());
  const at::Tensor x = prepare(x_), lam = prepare(lam_), gates = prepare(gates_);
  const at::Tensor gh = prepare(grad_h_), hs = prepare(h_);
  PropagateParams p = make_params(x, lam, gates, chunk);
  make_plan(p, /*backward=*/true, o);
  at::Tensor grad_x = at::empty_like(x);
  at::Tensor grad_lam = at::empty_like(lam);
  at::Tensor grad_gates = at::empty_like(gates);
  at::Tensor grad_x_part;  // the four directions' fp32 terms, summed by the reduce pass (not the short kernels)
  if (p.kernel != 3) grad_x_part = at::empty({4, B, C, H, W}, x.options().dtype(at::kFloat));
  at::Tensor grad_gates_part;
  if (p.nsl > 1) grad_gates_part = at::empty({p.nsl, B, 4, 3, p.K, H, W}, x.options().dtype(at::kFloat));
  p.grad_h = gh.data_ptr();
  p.h_saved = hs.data_ptr();
  p.grad_x = grad_x.data_ptr();
  p.grad_lam = grad_lam.data_ptr();
  p.grad_gates = grad_gates.data_ptr();
  p.grad_x_part = p.kernel != 3 ? grad_x_part.data_ptr<float>() : nullptr;
  p.grad_gates_part = p.nsl > 1 ? grad_gates_part.data_ptr<float>() : nullptr;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (p.kernel == 3) {
    launch_backward_short(p, stream);
  } else if (p.kernel == 2) {
    // With the cluster kernel: the horizontal directions first, then the vertical blocks (side by side:
    // p.overlap); then the reduce pass.
    launch_side_by_side(
        p, stream, [&](cudaStream_t s) { if (p.ncta > 0 && !(p.ablate & 8)) launch_backward_cluster(p, s); },
        [&](cudaStream_t s) { launch_backward_fast(p, s); });
    launch_backward_reduce(p, stream);
  } else {
    launch_backward(p, stream);
  }
  return {grad_x, grad_lam, grad_gates};
}

using PropagateOp = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, std::optional<int64_t>,
                                c10::string_view, int64_t);

const c10::TypedOperatorHandle<PropagateOp>& propagate_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("gspn2::propagate", "").typed<PropagateOp>();
  return op;
}

// Autograd for CUDA tensors (the AutogradCUDA key; CPU keeps the Python formula of gspn2/ops/propagate.py,
// which computes the same thing). Both passes redispatch through the dispatcher, so fake tensors
// (torch.compile, export) reach the fake implementations.
class PropagateFunction : public torch::autograd::Function<PropagateFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& lam,
                            const at::Tensor& gates, std::optional<int64_t> chunk, c10::string_view kernel,
                            int64_t cluster_ctas) {
    at::Tensor h;
    {
      at::AutoDispatchBelowADInplaceOrView below;
      h = propagate_op().call(x, lam, gates, chunk, kernel, cluster_ctas);
    }
    ctx->save_for_backward({x, lam, gates, h});
    // chunk (or -1 for None; chunks are >= 1) and cluster_ctas; the kernel family by name.
    ctx->saved_data["ints"] = std::vector<int64_t>{chunk.value_or(-1), cluster_ctas};
    ctx->saved_data["kernel"] = std::string(kernel);
    return h;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("gspn2::propagate_backward", "")
            .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                std::optional<int64_t>, c10::string_view, int64_t)>();
    const auto saved = ctx->get_saved_variables();
    const auto ints = ctx->saved_data["ints"].toIntVector();
    const std::optional<int64_t> chunk = ints[0] < 0 ? std::nullopt : std::optional<int64_t>(ints[0]);
    const std::string kernel = ctx->saved_data["kernel"].toStringRef();
    auto [grad_x, grad_lam, grad_gates] =
        op.call(grads[0].contiguous(), saved[0], saved[1], saved[2], saved[3], chunk, kernel, ints[1]);
    return {grad_x, grad_lam, grad_gates, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Records the autograd node only where it is wanted (calls.h); otherwise calls the kernels directly, as aten's
// own ops do.
at::Tensor propagate_autograd(const at::Tensor& x, const at::Tensor& lam, const at::Tensor& gates,
                              std::optional<int64_t> chunk, c10::string_view kernel, int64_t cluster_ctas) {
  if (!wants_autograd({&x, &lam, &gates})) {
    at::AutoDispatchBelowADInplaceOrView below;
    return propagate_op().call(x, lam, gates, chunk, kernel, cluster_ctas);
  }
  return PropagateFunction::apply(x, lam, gates, chunk, kernel, cluster_ctas);
}

// The decomposition the kernels would use (benchmarks, tests). Without a GPU the plan is an H200's.
py::dict plan(int64_t B, int64_t C, int64_t H, int64_t W, int64_t K, const std::string& dtype, bool backward,
              const std::string& kernel, int64_t cluster_ctas) {
  const PlanOptions o = parse_options(kernel, cluster_ctas);
  GSPN2_CHECK(dtype == "float32" || dtype == "float16" || dtype == "bfloat16",
              "`dtype` must be 'float32', 'float16' or 'bfloat16', got '", dtype, "'");
  GSPN2_CHECK(B >= 1 && C >= 1 && H >= 1 && W >= 1 && K >= 1 && C % K == 0,
              "B, C, H, W, K must be >= 1 with K dividing C, got ", B, ", ", C, ", ", H, ", ", W, ", ", K);
  PropagateParams p{};
  p.dtype = dtype == "float32" ? ScalarType::Float : dtype == "float16" ? ScalarType::Half : ScalarType::BFloat16;
  p.B = int(B);
  p.C = int(C);
  p.H = int(H);
  p.W = int(W);
  p.K = int(K);
  p.G = int(C / K);
  make_plan(p, backward, o);
  py::dict d;
  d["kernel"] = p.kernel == 3 ? "short" : p.kernel == 2 ? "fast" : "general";
  d["cs"] = p.cs;
  d["nsl"] = p.nsl;
  d["T"] = p.T;
  d["smem_bytes"] = p.smem_bytes;
  d["blocks"] = p.kernel == 3 ? p.B * p.K : 4 * p.B * p.K * p.nsl;
  if (p.kernel == 3) {
    d["threads"] = p.nt;
    d["lines_per_warp"] = p.su;
  } else if (p.kernel == 2) {
    d["threads"] = p.nt;
    d["tile_h"] = bool(p.tile_h);
    d["line_stride"] = p.ls;
    d["cluster_ctas"] = p.ncta;  // > 0: the horizontal directions run in the cluster kernel
    if (p.ncta > 0) {
      d["cluster_smem_bytes"] = p.cluster_smem;
      d["cluster_stages"] = p.cluster_stages;  // the cluster kernel's input stage buffers
      d["cluster_sub"] = p.cluster_sub;        // forward: tiles per input copy
      d["cluster_threads"] = p.cluster_threads;
      d["overlap"] = bool(p.overlap);  // the cluster kernel and the other launch side by side on two streams
    }
    d["split_ctas"] = p.vsplit;  // > 0: the vertical directions run split over that many CTAs per line
    if (p.vsplit > 0) {
      d["split_threads"] = p.vs_nt;
      d["split_smem_bytes"] = p.vs_smem;
    }
  } else {
    d["threads"] = p.nx * p.ny;
    d["nx"] = p.nx;
    d["ny"] = p.ny;
    d["nbuf"] = p.nbuf;
    d["E"] = p.E;
  }
  return d;
}

// The tiling both depthwise plans (DwTilePlan, MmaWgradPlan) have, into `d`.
template <typename Plan>
void put_tiling(py::dict& d, const Plan& q) {
  d["tiles_h"] = q.tiles_h;
  d["tiles_w"] = q.tiles_w;
  d["tiles"] = q.tiles;
  d["channel_blocks"] = q.channel_blocks;
  d["chunks"] = q.chunks;
  d["tiles_per_chunk"] = q.tiles_per_chunk;
}

// The depthwise tensor-core kernels' weight-gradient plan (dwconv.h), for Python: no GPU needed.
py::dict dwconv_mma_plan(int64_t B, int64_t C, int64_t H, int64_t W) {
  GSPN2_CHECK(B >= 1 && C >= 1 && H >= 1 && W >= 1, "B, C, H, W must be >= 1, got ", B, ", ", C, ", ", H, ", ", W);
  GSPN2_CHECK(B * H * W < (int64_t(1) << 40), "B x H x W is too large: ", B, " x ", H, " x ", W);
  py::dict d;
  put_tiling(d, dwconv_mma_wgrad_plan(int(B), int(H), int(W), int(C)));
  return d;
}

// The depthwise tile kernels' plan (dwconv.h), for Python: no GPU needed (smem_limit < 1: kTileSmemBudget).
py::dict dwconv_plan(int64_t B, int64_t C, int64_t H, int64_t W, int64_t K, const std::string& dtype, int64_t cols,
                     int64_t smem_limit) {
  GSPN2_CHECK(dtype == "float32" || dtype == "float16" || dtype == "bfloat16",
              "`dtype` must be 'float32', 'float16' or 'bfloat16', got '", dtype, "'");
  GSPN2_CHECK(B >= 1 && C >= 1 && H >= 1 && W >= 1, "B, C, H, W must be >= 1, got ", B, ", ", C, ", ", H, ", ", W);
  GSPN2_CHECK(dwconv_kernel_size_supported(int(K)), "`K` must be 3, 5 or 7, got ", K);
  GSPN2_CHECK(cols == 4 || cols == 8, "`cols` must be 4 or 8, got ", cols);
  const int limit = smem_limit >= 1 ? int(smem_limit) : kTileSmemBudget;
  const DwTilePlan q = dwconv_tile_plan(int(B), int(H), int(W), int(C), int(K), int(cols), dtype == "float32" ? 4 : 2,
                                        limit);
  py::dict d;
  d["rows"] = q.rows;
  d["cols"] = q.cols;
  d["sub_h"] = q.sub_h;
  d["sub_w"] = q.sub_w;
  put_tiling(d, q);
  d["smem_forward"] = q.smem_forward;
  d["smem_wgrad"] = q.smem_wgrad;
  d["smem_backward"] = q.smem_backward;
  d["smem_limit"] = limit;
  return d;
}

// The kernels' limits and the planner's thresholds, for Python (never copied there).
py::dict limits() {
  py::dict d;
  d["fast_max_line"] = kFastMaxLine;
  d["short_max_line"] = kShortMaxLine;
  d["cluster_tile"] = kClusterTile;
  d["cluster_auto_min_line"] = kClusterAutoMinLine;
  d["cluster_auto_min_elems_bwd"] = kClusterAutoMinElemsBwd;
  d["cluster_auto_min_line_bwd_16bit"] = kClusterAutoMinLineBwd16;
  py::list sizes;
  for (int k = 1; k <= 15; ++k) {
    if (dwconv_kernel_size_supported(k)) sizes.append(k);
  }
  d["dwconv_kernel_sizes"] = py::tuple(sizes);
  d["layer_norm_max_channels_32bit"] = layer_norm_max_channels(at::kFloat);
  d["layer_norm_max_channels_16bit"] = layer_norm_max_channels(at::kBFloat16);
  d["ablate"] = kAblate;
  return d;
}

}  // namespace

at::Tensor propagate_call(const at::Tensor& x, const at::Tensor& lam, const at::Tensor& gates,
                          std::optional<int64_t> chunk, const std::string& kernel, int64_t cluster_ctas) {
  return propagate_op().call(x, lam, gates, chunk, kernel, cluster_ctas);
}

}  // namespace gspn2

TORCH_LIBRARY_IMPL(gspn2, CUDA, m) {
  m.impl("propagate", &gspn2::propagate_forward);
  m.impl("propagate_backward", &gspn2::propagate_backward);
}

TORCH_LIBRARY_IMPL(gspn2, AutogradCUDA, m) { m.impl("propagate", &gspn2::propagate_autograd); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "gspn2 CUDA kernels: loading this module registers the CUDA implementations of the gspn2:: ops "
            "(imported by gspn2.ops._cuda only)";
  m.def("plan", &gspn2::plan, "The launch plan of a problem (dict)", py::arg("B"), py::arg("C"), py::arg("H"),
        py::arg("W"), py::arg("K"), py::arg("dtype"), py::arg("backward") = false, py::arg("kernel") = "auto",
        py::arg("cluster_ctas") = 0);
  m.def("limits", &gspn2::limits, "The kernels' limits and planning thresholds (dict)");
  m.def(
      "dwconv_set_tma",
      [](bool enabled) {
        const bool before = gspn2::dwconv_tile_tma_enabled();
        gspn2::dwconv_tile_set_tma(enabled);
        return before;
      },
      "Lets the depthwise tile kernels stage by TMA on sm_90 (True, the default) or not; returns the setting "
      "before",
      py::arg("enabled"));
  m.def("propagate", &gspn2::propagate_call,
        "gspn2::propagate for eager callers: the typed dispatcher call, without torch.ops' argument parsing",
        py::arg("x"), py::arg("lam"), py::arg("gates"), py::arg("chunk"), py::arg("kernel"), py::arg("cluster_ctas"));
  m.def("depthwise_conv2d", &gspn2::depthwise_conv2d_call,
        "gspn2::depthwise_conv2d for eager callers: the typed dispatcher call, without torch.ops' argument parsing",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("add_input"), py::arg("silu"), py::arg("kernel"),
        py::arg("cols"));
  m.def("rows_norm_linear", &gspn2::rows_norm_linear_call, "gspn2::rows_norm_linear for eager callers", py::arg("x"),
        py::arg("gate"), py::arg("norm_weight"), py::arg("norm_bias"), py::arg("weight"), py::arg("bias"),
        py::arg("eps"), py::arg("chunks"), py::arg("dtype"), py::arg("norm_kernel") = false);
  m.def("layer_norm", &gspn2::layer_norm_call, "gspn2::layer_norm for eager callers", py::arg("x"), py::arg("weight"),
        py::arg("bias"), py::arg("eps"), py::arg("gelu"));
  m.def("rows_linear", &gspn2::rows_linear_call, "gspn2::rows_linear for eager callers", py::arg("x"),
        py::arg("weight"), py::arg("bias"), py::arg("skip_input"), py::arg("skip_scale"), py::arg("dtype"));
  m.def("rows_gelu_linear", &gspn2::rows_gelu_linear_call, "gspn2::rows_gelu_linear for eager callers",
        py::arg("h"), py::arg("weight"), py::arg("bias"));
  m.def("dwconv_mma_plan", &gspn2::dwconv_mma_plan, "The depthwise tensor-core kernels' weight-gradient plan (dict)",
        py::arg("B"), py::arg("C"), py::arg("H"), py::arg("W"));
  m.def("dwconv_plan", &gspn2::dwconv_plan, "The depthwise tile kernels' plan (dict)", py::arg("B"), py::arg("C"),
        py::arg("H"), py::arg("W"), py::arg("K"), py::arg("dtype"), py::arg("cols") = 4, py::arg("smem_limit") = 0);
}
