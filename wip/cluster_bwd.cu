// PROTOTYPE (branch wip/cluster-backward; not built by setup.py; JIT-built by wip/check_cluster_bwd.py):
// the backward of the two horizontal directions (d = 0, 1) on the cluster tiling of the forward's
// cluster kernel (gspn2/csrc/propagate_cluster.cu, docs/kernel.md "Cluster kernel").
//
// float32, K == C (no gate-gradient partials), W % 16 == 0, H <= 1024, R = own rows per CTA <= 128.
// Per tile of T = 16 scan steps, processed from the end of the scan:
//   * TMA loads of 7 planes (x, lam, 3 gate logits, grad_h, the saved h) into one of two stage buffers:
//     the next tile's loads overlap this one (and bring h_{s-1} of the tile's first step);
//   * pre-pass: the normalised weights of the tile's 16 steps and grad_h into registers;
//   * phase A, the sequential part: the adjoint, adj_s = grad_h_s + sum_o w_o[s+1](q - o) adj_{s+1}(q - o),
//     through three double-buffered lines of C_o = w_o * adj; one CTA barrier per step; halo rows take
//     the neighbours' exact C_o of the previous tile's last step from the inbox (pushed, one split
//     cluster barrier per tile), as in the forward;
//   * phase B, parallel: grad_lam = x adj, the grad_x term lam adj, gate-logit gradients through the
//     normalisation (h_{s-1} of rows q - 1, q, q + 1 from the stage), into an output stage that leaves
//     as TMA box stores (own rows only).
// The arithmetic per pixel is the streaming backward's (backward_step, gate_grads in propagate_fast.cu).
#include <cooperative_groups.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <torch/extension.h>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include "propagate.h"
#include "propagate_device.cuh"

namespace {

namespace cg = cooperative_groups;
using gspn2::dev::Gates;
using gspn2::dev::normalise;

constexpr int T = 16;
constexpr int HALO = T;
constexpr int NIN = 7;   // x, lam, g0, g1, g2, grad_h, h
constexpr int NOUT = 5;  // grad_lam, grad_x term, 3 gate-logit gradients
constexpr int kMaxRows = 128;
constexpr float kEps = 1e-7f;

struct Params {
  CUtensorMap tm_x, tm_lam, tm_g, tm_gh, tm_h, tm_glam, tm_gx, tm_gg;
  int B, C, K, H, W;
  int R, NT, srows, ce;
};

__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred P;\n WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 P, [%0], %1;\n"
      " @!P bra WAIT_%=;\n}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, int c0, int c1, int c2, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(
          smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(smem_u32(bar))
      : "memory");
}
__device__ __forceinline__ void tma_store(const CUtensorMap* map, int c0, int c1, int c2, const void* src) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1), "r"(c2), "r"(smem_u32(src))
               : "memory");
}
__device__ __forceinline__ void cluster_arrive_release() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait_acquire() {
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ float4* piece(float4* base, int r, int v) { return base + r * 4 + (v ^ ((r >> 1) & 3)); }
__device__ __forceinline__ float el(const float4& f, int e) { return reinterpret_cast<const float*>(&f)[e]; }

// gate_grads of propagate_fast.cu
__device__ __forceinline__ void gate_grads(const Gates& gt, float gw0, float gw1, float gw2, int q, int L, float& gg0,
                                           float& gg1, float& gg2) {
  const float dot = (gw0 * gt.a0 + gw1 * gt.s1) + gw2 * gt.a2;
  const float corr = gt.total >= kEps ? dot * gt.inv * gt.inv : 0.f;
  gg0 = q > 0 ? (gw0 * gt.inv - corr) * (gt.s0 * (1.f - gt.s0)) : 0.f;
  gg1 = (gw1 * gt.inv - corr) * (gt.s1 * (1.f - gt.s1));
  gg2 = q < L - 1 ? (gw2 * gt.inv - corr) * (gt.s2 * (1.f - gt.s2)) : 0.f;
}

template <int NCTA>
__global__ void __launch_bounds__(kMaxRows + 2 * HALO, 1) cluster_backward_kernel(const __grid_constant__ Params p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank());
  const int cid = blockIdx.x / NCTA;
  const int d = cid & 1;
  const int c = (cid >> 1) % p.C;
  const int b = (cid >> 1) / p.C;
  const int grp = c / (p.C / p.K);
  const int nt = p.NT, i = threadIdx.x;
  const int row0 = rank * p.R - HALO;
  const int q = row0 + i;
  const bool inimg = q >= 0 && q < p.H;
  const bool own = i >= HALO && i < HALO + p.R && q < p.H;

  unsigned char* base = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  const int srows = p.srows;
  float4* const stage0 = reinterpret_cast<float4*>(base);              // [2][NIN][srows][4]
  float4* const ostage = stage0 + size_t(2) * NIN * srows * 4;          // [NOUT][R][4]
  float* const lines = reinterpret_cast<float*>(ostage + size_t(NOUT) * p.R * 4);  // [2][3][nt + 2]
  float* const inbox = lines + 6 * (nt + 2);                            // [2][2 sides][3][HALO]
  uint64_t* const bar = reinterpret_cast<uint64_t*>(inbox + 12 * HALO + 2);  // [2]
  for (int k = i; k < 6 * (nt + 2) + 12 * HALO; k += blockDim.x) lines[k] = 0.f;

  const int px = b * p.C + c;
  const int pl = (b * 4 + d) * p.C + c;       // lam, grad_h, h, grad_lam
  const int pg = (b * 4 + d) * 3 * p.K + grp;  // first gate plane (and its gradient)
  const int pgx = (d * p.B + b) * p.C + c;     // grad_x term of direction d
  const int ntl = p.W / T;
  const uint32_t tx_bytes = uint32_t(NIN) * srows * T * 4;
  auto col0 = [&](int kt) { return d == 0 ? kt * T : p.W - (kt + 1) * T; };
  auto plane = [&](int buf, int k) { return stage0 + (size_t(buf) * NIN + k) * srows * 4; };
  auto issue = [&](int kt, int buf) {  // thread 0
    mbar_expect_tx(&bar[buf], tx_bytes);
    const int j0 = col0(kt);
    uint64_t* mb = &bar[buf];
    tma_load(plane(buf, 0), &p.tm_x, j0, row0, px, mb);
    tma_load(plane(buf, 1), &p.tm_lam, j0, row0, pl, mb);
#pragma unroll
    for (int k = 0; k < 3; ++k) tma_load(plane(buf, 2 + k), &p.tm_g, j0, row0, pg + k * p.K, mb);
    tma_load(plane(buf, 5), &p.tm_gh, j0, row0, pl, mb);
    tma_load(plane(buf, 6), &p.tm_h, j0, row0, pl, mb);
  };
  if (i == 0) {
    mbar_init(&bar[0], 1);
    mbar_init(&bar[1], 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (i == 0) issue(ntl - 1, 0);
  cluster.sync();

  float w0[T], w1[T], w2[T], A[T];  // per step t of the tile: weights, grad_h then the adjoint
  int par = 0;
  int sm = (p.W - 1) % p.ce;
  for (int m = 0; m < ntl; ++m) {
    const int kt = ntl - 1 - m, buf = m & 1;
    mbar_wait(&bar[buf], (m >> 1) & 1);
    if (i == 0 && kt > 0) issue(kt - 1, buf ^ 1);  // that buffer was last read before the previous B3
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const float4 g0 = *piece(plane(buf, 2), i, v), g1 = *piece(plane(buf, 3), i, v);
      const float4 g2 = *piece(plane(buf, 4), i, v), gh = *piece(plane(buf, 5), i, v);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = d == 0 ? 4 * v + e : T - 1 - 4 * v - e;
        const Gates gt = normalise(el(g0, e), el(g1, e), el(g2, e), q, p.H);
        w0[t] = gt.a0 * gt.inv, w1[t] = gt.s1 * gt.inv, w2[t] = gt.a2 * gt.inv;
        A[t] = inimg ? el(gh, e) : 0.f;
      }
    }
    if (m > 0) {
      cluster_wait_acquire();  // neighbours' C_o of step (kt + 1) T are in my inbox
      const float* box = inbox + ((m - 1) & 1) * 6 * HALO;
      float* rd = lines + par * 3 * (nt + 2);
      if (i < HALO && rank > 0) {
#pragma unroll
        for (int o = 0; o < 3; ++o) rd[o * (nt + 2) + i + 1] = box[o * HALO + i];
      }
      if (i >= HALO + p.R && rank < NCTA - 1) {
#pragma unroll
        for (int o = 0; o < 3; ++o) rd[o * (nt + 2) + i + 1] = box[(3 + o) * HALO + i - HALO - p.R];
      }
    }
    __syncthreads();  // B1

    // Phase A: the adjoint, steps t = T - 1 .. 0 (scan step s = kt T + t).
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
      if (has_next && inimg) adj += (rd[1 * (nt + 2) + i + 1] + rd[0 * (nt + 2) + i + 2]) + rd[2 * (nt + 2) + i];
      A[t] = adj;
      c0v = c1v = c2v = 0.f;
      if (!restart) {
        c0v = w0[t] * adj, c1v = w1[t] * adj, c2v = w2[t] * adj;
        wr[0 * (nt + 2) + i + 1] = c0v;
        wr[1 * (nt + 2) + i + 1] = c1v;
        wr[2 * (nt + 2) + i + 1] = c2v;
      }
      if (tt + 1 < T) __syncthreads();
      par ^= 1;
      sm = (sm == 0) ? p.ce - 1 : sm - 1;
    }
    if (kt > 0) {  // push my boundary rows' C_o of step kt T to the neighbours' halo rows, then arrive
      float* box = inbox + (m & 1) * 6 * HALO;
      if (rank > 0 && i >= HALO && i < 2 * HALO) {
        float* nb = cluster.map_shared_rank(box, rank - 1);
        nb[3 * HALO + i - HALO] = c0v, nb[4 * HALO + i - HALO] = c1v, nb[5 * HALO + i - HALO] = c2v;
      }
      if (rank < NCTA - 1 && i >= p.R && i < p.R + HALO) {
        float* nb = cluster.map_shared_rank(box, rank + 1);
        nb[i - p.R] = c0v, nb[HALO + i - p.R] = c1v, nb[2 * HALO + i - p.R] = c2v;
      }
      cluster_arrive_release();
    }
    if (i == 0 && m > 0) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
    __syncthreads();  // B2: output stage free

    // Phase B: outputs of the own rows. h_{s-1} of rows q - 1, q, q + 1 at step t: this tile's step t - 1,
    // or for t = 0 the last step of tile kt - 1 (the other stage buffer, loading since this tile began).
    if (own) {
      float hs[3][T];
#pragma unroll
      for (int r = 0; r < 3; ++r) {
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          const float4 f = *piece(plane(buf, 6), i - 1 + r, v);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int t = d == 0 ? 4 * v + e : T - 1 - 4 * v - e;
            if (t + 1 < T) hs[r][t + 1] = el(f, e);
          }
        }
        hs[r][0] = 0.f;
      }
      if (kt > 0) {
        mbar_wait(&bar[buf ^ 1], ((m + 1) >> 1) & 1);
        const int jl = d == 0 ? T - 1 : 0;  // stage element of the tile's last scan step
#pragma unroll
        for (int r = 0; r < 3; ++r) {
          hs[r][0] = el(*piece(plane(buf ^ 1, 6), i - 1 + r, jl >> 2), jl & 3);
        }
      }
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        const float4 fx = *piece(plane(buf, 0), i, v), fl = *piece(plane(buf, 1), i, v);
        const float4 g0 = *piece(plane(buf, 2), i, v), g1 = *piece(plane(buf, 3), i, v);
        const float4 g2 = *piece(plane(buf, 4), i, v);
        float o[NOUT][4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int t = d == 0 ? 4 * v + e : T - 1 - 4 * v - e;
          const int s = kt * T + t;
          const float adj = A[t];
          o[0][e] = el(fx, e) * adj;
          o[1][e] = el(fl, e) * adj;
          o[2][e] = o[3][e] = o[4][e] = 0.f;
          if (s % p.ce != 0) {
            const Gates gt = normalise(el(g0, e), el(g1, e), el(g2, e), q, p.H);
            const float gw0 = fmaf(adj, hs[0][t], 0.f), gw1 = fmaf(adj, hs[1][t], 0.f);
            const float gw2 = fmaf(adj, hs[2][t], 0.f);
            gate_grads(gt, gw0, gw1, gw2, q, p.H, o[2][e], o[3][e], o[4][e]);
          }
        }
#pragma unroll
        for (int k = 0; k < NOUT; ++k) {
          *piece(ostage + size_t(k) * p.R * 4, i - HALO, v) = make_float4(o[k][0], o[k][1], o[k][2], o[k][3]);
        }
      }
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    }
    __syncthreads();  // B3: output stage complete, stage buffer `buf` read
    if (i == 0) {
      const int j0 = col0(kt), r0 = rank * p.R;
      tma_store(&p.tm_glam, j0, r0, pl, ostage);
      tma_store(&p.tm_gx, j0, r0, pgx, ostage + size_t(1) * p.R * 4);
#pragma unroll
      for (int k = 0; k < 3; ++k) tma_store(&p.tm_gg, j0, r0, pg + k * p.K, ostage + size_t(2 + k) * p.R * 4);
      asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
    }
  }
  if (i == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
  cluster.sync();
}

PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult res{};
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &res));
    TORCH_CHECK(res == cudaDriverEntryPointSuccess && ptr != nullptr, "no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

void make_map(CUtensorMap* map, const void* ptr, int W, int H, int64_t planes, int boxrows) {
  const cuuint64_t dims[3] = {cuuint64_t(W), cuuint64_t(H), cuuint64_t(planes)};
  const cuuint64_t strides[2] = {cuuint64_t(W) * 4, cuuint64_t(W) * H * 4};
  const cuuint32_t box[3] = {cuuint32_t(T), cuuint32_t(boxrows), 1};
  const cuuint32_t estr[3] = {1, 1, 1};
  const CUresult r = encode_tiled()(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 3, const_cast<void*>(ptr), dims, strides, box,
                                    estr, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_64B,
                                    CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed (", int(r), ")");
}

template <int NCTA>
void launch(const Params& p, size_t smem, cudaStream_t stream) {
  auto kernel = cluster_backward_kernel<NCTA>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(NCTA * 2 * p.B * p.C);
  cfg.blockDim = dim3(p.NT);
  cfg.dynamicSmemBytes = smem;
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

// Directions 0 and 1: grad_lam (B, 4, C, H, W; zero for d = 2, 3), grad_x terms (2, B, C, H, W),
// gate-logit gradients (B, 4, 3, K, H, W; zero for d = 2, 3). fp32, contiguous inputs.
std::vector<torch::Tensor> cluster_backward(torch::Tensor grad_h, torch::Tensor x, torch::Tensor lam,
                                            torch::Tensor gates, torch::Tensor h, int64_t chunk, int64_t ncta) {
  for (const auto* t : {&grad_h, &x, &lam, &gates, &h}) {
    TORCH_CHECK(t->is_cuda() && t->scalar_type() == torch::kFloat32 && t->is_contiguous(), "fp32 contiguous CUDA");
  }
  TORCH_CHECK(ncta == 2 || ncta == 4 || ncta == 8, "ncta must be 2, 4 or 8");
  Params p{};
  p.B = int(x.size(0)), p.C = int(x.size(1)), p.H = int(x.size(2)), p.W = int(x.size(3)), p.K = int(gates.size(3));
  TORCH_CHECK(p.K == p.C, "prototype: K == C only");
  TORCH_CHECK(p.W % T == 0, "prototype: W % 16 == 0");
  p.R = int((p.H + ncta - 1) / ncta);
  p.R = (p.R + 15) / 16 * 16;
  TORCH_CHECK(p.R <= kMaxRows, "prototype: at most ", kMaxRows, " rows per CTA; use more CTAs");
  p.NT = p.R + 2 * HALO;
  p.srows = (p.NT + 7) / 8 * 8;
  p.ce = (chunk > 0 && chunk < p.W) ? int(chunk) : p.W;
  auto f32 = x.options();
  auto glam = torch::zeros({p.B, 4, p.C, p.H, p.W}, f32);
  auto gx = torch::empty({2, p.B, p.C, p.H, p.W}, f32);
  auto gg = torch::zeros({p.B, 4, 3, p.K, p.H, p.W}, f32);
  make_map(&p.tm_x, x.data_ptr(), p.W, p.H, int64_t(p.B) * p.C, p.srows);
  make_map(&p.tm_lam, lam.data_ptr(), p.W, p.H, int64_t(p.B) * 4 * p.C, p.srows);
  make_map(&p.tm_g, gates.data_ptr(), p.W, p.H, int64_t(p.B) * 12 * p.K, p.srows);
  make_map(&p.tm_gh, grad_h.data_ptr(), p.W, p.H, int64_t(p.B) * 4 * p.C, p.srows);
  make_map(&p.tm_h, h.data_ptr(), p.W, p.H, int64_t(p.B) * 4 * p.C, p.srows);
  make_map(&p.tm_glam, glam.data_ptr(), p.W, p.H, int64_t(p.B) * 4 * p.C, p.R);
  make_map(&p.tm_gx, gx.data_ptr(), p.W, p.H, int64_t(2) * p.B * p.C, p.R);
  make_map(&p.tm_gg, gg.data_ptr(), p.W, p.H, int64_t(p.B) * 12 * p.K, p.R);
  const size_t smem = 1024 + size_t(2) * NIN * p.srows * T * 4 + size_t(NOUT) * p.R * T * 4 +
                      (6 * (p.NT + 2) + 12 * HALO + 2) * 4 + 16;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (ncta == 2) {
    launch<2>(p, smem, stream);
  } else if (ncta == 4) {
    launch<4>(p, smem, stream);
  } else {
    launch<8>(p, smem, stream);
  }
  return {glam, gx, gg};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("cluster_backward", &cluster_backward); }
