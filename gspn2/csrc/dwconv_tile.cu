// Depthwise convolution: the shared-memory tile kernels (tile 0 and 1; dwconv.h). A CTA owns kTileLanes
// channels (lane = channel) of one spatial tile of sub_h x sub_w warp tiles; each thread computes kTileRows x CW output pixels of its channel. The tile's
// input and its halo are staged once in shared memory as float32, laid out [pixel][lane], so a warp reads
// one pixel's 32 channels (128 bytes, no bank conflict) per load. Each thread keeps its channel's K * K taps
// (forward, input gradient) or K * K partial sums (weight gradient) in registers and slides over its
// (kTileRows + K - 1) x (CW + K - 1) input window once, so every staged input feeds all the outputs (or
// taps) it contributes to: K * K FMAs per output for (R + K - 1)(CW + K - 1) / (R * CW) shared loads.
// The backward runs as the input gradient (the forward kernel on grad_y with the flipped taps) and the
// weight gradient (tile 0), or as one pass that stages grad_y and x once for both (tile 1).
#include <algorithm>
#include <atomic>

#include "dwconv.h"
#include "dwconv_device.cuh"

namespace gspn2 {
namespace {

// Stages rows x cols pixels (top-left corner (h0, w0), zeros outside the image and past channel C) of
// kTileLanes channels from c0 on, as float32 at s[pixel * kTileLanes + lane]. `vec`: C is a multiple of
// the 16-byte vector (16-bit: 8 channels, float32: 4), so every vector is whole and aligned.
template <typename T>
__device__ __forceinline__ void stage_tile(float* __restrict__ s, const T* __restrict__ src, int h0, int w0,
                                           int rows, int cols, int H, int W, int C, int c0, bool vec) {
  constexpr int V = 16 / sizeof(T);
  constexpr int NV = kTileLanes / V;  // vectors per pixel
  const int n = rows * cols;
  if (vec) {
    constexpr int kBatch = 4;  // loads in flight per thread before their stores
    for (int base = threadIdx.x; base < n * NV; base += kBatch * blockDim.x) {
      float v[kBatch][V];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int i = base + k * blockDim.x;
        const int p = i / NV, q = i % NV;
        const int r = p / cols, h = h0 + r, w = w0 + p - r * cols, c = c0 + q * V;
        if (i < n * NV && h >= 0 && h < H && w >= 0 && w < W && c < C) {
          load_vec<T, V>(src + (int64_t(h) * W + w) * C + c, v[k]);
        } else {
          zero_vec(v[k]);
        }
      }
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int i = base + k * blockDim.x;
        if (i < n * NV) {
          float4* d = reinterpret_cast<float4*>(s + (i / NV) * kTileLanes + (i % NV) * V);
#pragma unroll
          for (int u = 0; u < V / 4; ++u) d[u] = make_float4(v[k][4 * u], v[k][4 * u + 1], v[k][4 * u + 2], v[k][4 * u + 3]);
        }
      }
    }
  } else {
    for (int i = threadIdx.x; i < n * kTileLanes; i += blockDim.x) {
      const int p = i / kTileLanes, q = i % kTileLanes;
      const int r = p / cols, h = h0 + r, w = w0 + p - r * cols, c = c0 + q;
      s[i] = (h >= 0 && h < H && w >= 0 && w < W && c < C) ? to_float(src[(int64_t(h) * W + w) * C + c]) : 0.f;
    }
  }
}

// Stages the KK taps of the CTA's kTileLanes channels from the (C, KK) float32 weight (coalesced reads) at
// s[lane * KK + tap], flipped (tap KK - 1 - t) for the input gradient; zeros past channel C. KK is odd, so
// the threads' reads s[lane * KK + t] hit distinct banks.
template <int KK>
__device__ __forceinline__ void stage_taps(float* __restrict__ s, const float* __restrict__ weight, int c0, int C,
                                           bool flip) {
  for (int i = threadIdx.x; i < kTileLanes * KK; i += blockDim.x) {
    const int cc = i / KK, tap = i % KK;
    s[cc * KK + (flip ? KK - 1 - tap : tap)] = c0 + cc < C ? weight[int64_t(c0) * KK + i] : 0.f;
  }
}

struct TileGeometry {
  int b, h0, w0;  // image and top-left output pixel of the CTA's tile
  int th, tw;     // tile size in output pixels
};

__device__ __forceinline__ TileGeometry tile_geometry(int64_t tile, int tiles_h, int tiles_w, int sub_h, int sub_w,
                                                      int R, int CW) {
  TileGeometry g;
  const int tx = int(tile % tiles_w);
  const int64_t rest = tile / tiles_w;
  const int ty = int(rest % tiles_h);
  g.b = int(rest / tiles_h);
  g.th = sub_h * R;
  g.tw = sub_w * CW;
  g.h0 = ty * g.th;
  g.w0 = tx * g.tw;
  return g;
}

// The end of the weight-gradient CTAs: the warps' tap sums (and the bias sum, tap K * K) added in warp order
// through shared memory (`red`, reusing the staging memory) into partial[blockIdx.x][tap][c].
template <int KK>
__device__ __forceinline__ void store_chunk_partials(float* red, const float (&acc)[KK], float accb,
                                                     float* __restrict__ partial, int C, int c0) {
  const int lane = threadIdx.x % kTileLanes, warp = threadIdx.x / kTileLanes;
  const int warps = blockDim.x / kTileLanes;
  __syncthreads();  // every warp is done with the staged tiles
#pragma unroll
  for (int t = 0; t < KK; ++t) red[(warp * (KK + 1) + t) * kTileLanes + lane] = acc[t];
  red[(warp * (KK + 1) + KK) * kTileLanes + lane] = accb;
  __syncthreads();
  for (int e = threadIdx.x; e < (KK + 1) * kTileLanes; e += blockDim.x) {
    const int tap = e / kTileLanes, l = e % kTileLanes;
    if (c0 + l >= C) continue;
    float sum = 0.f;
    for (int w = 0; w < warps; ++w) sum += red[(w * (KK + 1) + tap) * kTileLanes + l];
    partial[(int64_t(blockIdx.x) * (KK + 1) + tap) * C + c0 + l] = sum;
  }
}

// Slides over the thread's input window once: for each staged input v = x[ir][ic] of the warp tile's
// (R + K - 1) x (CW + K - 1) window (top-left halo pixel at `sx`), calls f(v, r, c, tap) for every output
// pixel (r, c) of the thread that v reaches through tap (ir - r) * K + (ic - c). Unrolled: r, c and tap are
// constants in f.
template <int K, int R, int CW, typename F>
__device__ __forceinline__ void for_each_window_tap(const float* sx, int cols, F&& f) {
#pragma unroll
  for (int ir = 0; ir < R + K - 1; ++ir) {
#pragma unroll
    for (int ic = 0; ic < CW + K - 1; ++ic) {
      const float v = sx[(ir * cols + ic) * kTileLanes];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int i = ir - r;
        if (i < 0 || i >= K) continue;
#pragma unroll
        for (int c = 0; c < CW; ++c) {
          const int j = ic - c;
          if (j < 0 || j >= K) continue;
          f(v, r, c, i * K + j);
        }
      }
    }
  }
}

// The convolution of one warp tile: acc[r][c] += sum over taps of x[r + i][c + j] * wr[i * K + j].
template <int K, int R, int CW>
__device__ __forceinline__ void convolve_tile(float (&acc)[R][CW], const float (&wr)[K * K], const float* sx,
                                              int cols) {
  for_each_window_tap<K, R, CW>(sx, cols, [&](float v, int r, int c, int t) { acc[r][c] = fmaf(v, wr[t], acc[r][c]); });
}

// One warp tile's products added to the tap sums: acc[i * K + j] += g[r][c] * x[r + i][c + j].
template <int K, int R, int CW>
__device__ __forceinline__ void accumulate_taps(float (&acc)[K * K], const float (&gv)[R][CW], const float* sx,
                                                int cols) {
  for_each_window_tap<K, R, CW>(sx, cols, [&](float v, int r, int c, int t) { acc[t] = fmaf(gv[r][c], v, acc[t]); });
}

// Forward and input gradient: y = conv(x) (+ bias) (+ x, `add_input`, read from the staged tile) (then
// SiLU); the input gradient is the convolution of grad_y with the flipped taps (`flip`), plus grad_y for
// x + conv(x).
template <typename T, int K, int CW>
__global__ void __launch_bounds__(kTileLanes * kTileMaxWarps) dwconv_tile_forward_kernel(
    const T* __restrict__ x, const float* __restrict__ weight, const float* __restrict__ bias, T* __restrict__ y,
    int H, int W, int C, int tiles_h, int tiles_w, int sub_h, int sub_w, bool flip, bool add_input, bool silu,
    bool vec) {
  constexpr int R = kTileRows, P = K / 2, KK = K * K;
  extern __shared__ float smem[];
  float* s_w = smem;                    // [lane][tap]: lane * KK + tap, KK odd: no bank conflicts
  float* s_x = smem + kTileLanes * KK;  // [pixel][lane]
  const int lane = threadIdx.x % kTileLanes, warp = threadIdx.x / kTileLanes;
  const int c0 = blockIdx.y * kTileLanes, c = c0 + lane;
  const TileGeometry g = tile_geometry(blockIdx.x, tiles_h, tiles_w, sub_h, sub_w, R, CW);
  const int cols = g.tw + K - 1;

  stage_taps<KK>(s_w, weight, c0, C, flip);
  const int64_t img = int64_t(g.b) * H * W * C;
  stage_tile<T>(s_x, x + img, g.h0 - P, g.w0 - P, g.th + K - 1, cols, H, W, C, c0, vec);
  __syncthreads();

  float wr[KK];
#pragma unroll
  for (int t = 0; t < KK; ++t) wr[t] = s_w[lane * KK + t];
  const float bv = (bias != nullptr && c < C) ? bias[c] : 0.f;
  float acc[R][CW];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < CW; ++j) acc[r][j] = bv;

  const int sr = (warp / sub_w) * R, sc = (warp % sub_w) * CW;  // the warp tile in the CTA tile
  const float* sx = s_x + (sr * cols + sc) * kTileLanes + lane;
  convolve_tile<K, R, CW>(acc, wr, sx, cols);
  if (c >= C) return;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int h = g.h0 + sr + r;
    if (h >= H) break;
#pragma unroll
    for (int j = 0; j < CW; ++j) {
      const int w = g.w0 + sc + j;
      if (w >= W) break;
      float v = acc[r][j];
      if (add_input) v += sx[((r + P) * cols + j + P) * kTileLanes];
      if (silu) v = v / (1.f + __expf(-v));
      y[img + (int64_t(h) * W + w) * C + c] = from_float<T>(v);
    }
  }
}

// Weight and bias gradients: each CTA sums grad_y (x) shifted x over its chunk of tiles for its 32 channels,
// one thread per (channel, warp tile) holding the K * K tap sums; the warps' sums are added in a fixed order
// into partial[chunk][tap][c] (tap K * K: the bias).
template <typename T, int K, int CW>
__global__ void __launch_bounds__(kTileLanes * kTileMaxWarps) dwconv_tile_wgrad_kernel(
    const T* __restrict__ gy, const T* __restrict__ x, float* __restrict__ partial, int H, int W, int C,
    int tiles_h, int tiles_w, int sub_h, int sub_w, int64_t tiles, int64_t tiles_per_chunk, bool vec) {
  constexpr int R = kTileRows, P = K / 2, KK = K * K;
  extern __shared__ float smem[];
  const int lane = threadIdx.x % kTileLanes, warp = threadIdx.x / kTileLanes;
  const int c0 = blockIdx.y * kTileLanes;
  const int th = sub_h * R, tw = sub_w * CW, cols = tw + K - 1;
  float* s_x = smem;                                  // [(th + K - 1) * cols][lane]
  float* s_g = smem + (th + K - 1) * cols * kTileLanes;  // [th * tw][lane]
  const int sr = (warp / sub_w) * R, sc = (warp % sub_w) * CW;

  float acc[KK];
#pragma unroll
  for (int t = 0; t < KK; ++t) acc[t] = 0.f;
  float accb = 0.f;

  const int64_t t_begin = int64_t(blockIdx.x) * tiles_per_chunk;
  const int64_t t_end = t_begin + tiles_per_chunk < tiles ? t_begin + tiles_per_chunk : tiles;
  for (int64_t t = t_begin; t < t_end; ++t) {
    const TileGeometry g = tile_geometry(t, tiles_h, tiles_w, sub_h, sub_w, R, CW);
    const int64_t img = int64_t(g.b) * H * W * C;
    __syncthreads();  // the previous tile's reads are done
    stage_tile<T>(s_x, x + img, g.h0 - P, g.w0 - P, th + K - 1, cols, H, W, C, c0, vec);
    stage_tile<T>(s_g, gy + img, g.h0, g.w0, th, tw, H, W, C, c0, vec);
    __syncthreads();
    float gv[R][CW];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int j = 0; j < CW; ++j) {
        gv[r][j] = s_g[((sr + r) * tw + sc + j) * kTileLanes + lane];
        accb += gv[r][j];
      }
    accumulate_taps<K, R, CW>(acc, gv, s_x + (sr * cols + sc) * kTileLanes + lane, cols);
  }

  store_chunk_partials<KK>(smem, acc, accb, partial, C, c0);
}

// The whole backward in one pass: the weight and bias gradients as dwconv_tile_wgrad_kernel, and each tile's
// input gradient (grad_y convolved with the flipped taps, plus grad_y with `add_input`) on the way. grad_y is
// staged once with its halo for both, so the pass reads grad_y and x once and writes grad_x once.
template <typename T, int K, int CW>
__global__ void __launch_bounds__(kTileLanes * kTileMaxWarps) dwconv_tile_backward_kernel(
    const T* __restrict__ gy, const T* __restrict__ x, const float* __restrict__ weight, T* __restrict__ gx,
    float* __restrict__ partial, int H, int W, int C, int tiles_h, int tiles_w, int sub_h, int sub_w, int64_t tiles,
    int64_t tiles_per_chunk, bool add_input, bool vec) {
  constexpr int R = kTileRows, P = K / 2, KK = K * K;
  extern __shared__ float smem[];
  const int lane = threadIdx.x % kTileLanes, warp = threadIdx.x / kTileLanes;
  const int c0 = blockIdx.y * kTileLanes, c = c0 + lane;
  const int th = sub_h * R, tw = sub_w * CW, rows = th + K - 1, cols = tw + K - 1;
  float* s_x = smem;                           // [rows * cols][lane]: x with its halo
  float* s_g = s_x + rows * cols * kTileLanes;  // [rows * cols][lane]: grad_y with its halo
  const int sr = (warp / sub_w) * R, sc = (warp % sub_w) * CW;
  const int s_off = (sr * cols + sc) * kTileLanes + lane;

  // The flipped taps of this thread's channel, through shared memory (coalesced reads of the weight).
  float wr[KK];
  stage_taps<KK>(s_g, weight, c0, C, true);
  __syncthreads();
#pragma unroll
  for (int t = 0; t < KK; ++t) wr[t] = s_g[lane * KK + t];

  float acc_w[KK];
#pragma unroll
  for (int t = 0; t < KK; ++t) acc_w[t] = 0.f;
  float accb = 0.f;

  const int64_t t_begin = int64_t(blockIdx.x) * tiles_per_chunk;
  const int64_t t_end = t_begin + tiles_per_chunk < tiles ? t_begin + tiles_per_chunk : tiles;
  for (int64_t t = t_begin; t < t_end; ++t) {
    const TileGeometry g = tile_geometry(t, tiles_h, tiles_w, sub_h, sub_w, R, CW);
    const int64_t img = int64_t(g.b) * H * W * C;
    __syncthreads();  // the previous tile's (or the taps') reads are done
    stage_tile<T>(s_x, x + img, g.h0 - P, g.w0 - P, rows, cols, H, W, C, c0, vec);
    stage_tile<T>(s_g, gy + img, g.h0 - P, g.w0 - P, rows, cols, H, W, C, c0, vec);
    __syncthreads();
    {
      float acc[R][CW];
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < CW; ++j) acc[r][j] = 0.f;
      convolve_tile<K, R, CW>(acc, wr, s_g + s_off, cols);
      if (c < C) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const int h = g.h0 + sr + r;
          if (h >= H) break;
#pragma unroll
          for (int j = 0; j < CW; ++j) {
            const int w = g.w0 + sc + j;
            if (w >= W) break;
            float v = acc[r][j];
            if (add_input) v += s_g[s_off + ((r + P) * cols + j + P) * kTileLanes];
            gx[img + (int64_t(h) * W + w) * C + c] = from_float<T>(v);
          }
        }
      }
    }
    float gv[R][CW];  // grad_y at the warp tile's own pixels (zero outside the image)
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int j = 0; j < CW; ++j) {
        gv[r][j] = s_g[s_off + ((r + P) * cols + j + P) * kTileLanes];
        accb += gv[r][j];
      }
    accumulate_taps<K, R, CW>(acc_w, gv, s_x + s_off, cols);
  }

  store_chunk_partials<KK>(smem, acc_w, accb, partial, C, c0);
}

// The chunks' partial sums in chunk order: grad_w (C, K*K) and grad_b (C,).
__global__ void dwconv_tile_reduce_kernel(const float* __restrict__ partial, float* __restrict__ grad_w,
                                          float* __restrict__ grad_b, int chunks, int C, int KK) {
  const int64_t n = int64_t(KK + 1) * C;
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= n) return;
  float sum = 0.f;
  for (int k = 0; k < chunks; ++k) sum += partial[int64_t(k) * n + e];
  const int tap = int(e / C), c = int(e % C);
  if (tap < KK) {
    grad_w[int64_t(c) * KK + tap] = sum;
  } else {
    grad_b[c] = sum;
  }
}

// Opts `kernel` in to `bytes` of dynamic shared memory where that is over the default 48 KB. One flag per
// kernel instantiation (the tag types), so each is raised once per size it grows to.
template <typename Tag, typename Kernel>
void allow_smem(Kernel kernel, int bytes) {
  static std::atomic<int> allowed{48 * 1024};
  if (bytes <= allowed.load()) return;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  allowed.store(bytes);
}
template <typename T, int K, int CW, int kKind>  // kKind: 0 forward, 1 weight gradient, 2 one-pass backward
struct TileKernelTag {};

bool tile_vec_ok(int C, ScalarType dtype) { return C % (16 / element_size(dtype)) == 0; }

template <typename T, int K, int CW>
void launch_tile_forward(const DwConvForwardParams& p) {
  const DwTilePlan q = dwconv_tile_plan(p.B, p.H, p.W, p.C, p.K, CW);
  auto kernel = dwconv_tile_forward_kernel<T, K, CW>;
  allow_smem<TileKernelTag<T, K, CW, 0>>(kernel, q.smem_forward);
  const dim3 grid(unsigned(q.tiles), unsigned(q.channel_blocks));
  // The tile kernels add their own input: the residual must be x (forward) or grad_y (input gradient).
  kernel<<<grid, kTileLanes * q.sub_h * q.sub_w, q.smem_forward, p.stream>>>(
      static_cast<const T*>(p.x), p.weight, p.bias, static_cast<T*>(p.y), p.H, p.W, p.C, q.tiles_h, q.tiles_w,
      q.sub_h, q.sub_w, p.flip, p.residual != nullptr, p.silu, tile_vec_ok(p.C, p.dtype));
}

template <typename T, int K, int CW>
void launch_tile_wgrad(const DwConvWgradParams& p, const DwTilePlan& q) {
  auto kernel = dwconv_tile_wgrad_kernel<T, K, CW>;
  allow_smem<TileKernelTag<T, K, CW, 1>>(kernel, q.smem_wgrad);
  const dim3 grid(unsigned(q.chunks), unsigned(q.channel_blocks));
  kernel<<<grid, kTileLanes * q.sub_h * q.sub_w, q.smem_wgrad, p.stream>>>(
      static_cast<const T*>(p.grad_y), static_cast<const T*>(p.x), p.partial, p.H, p.W, p.C, q.tiles_h, q.tiles_w,
      q.sub_h, q.sub_w, q.tiles, q.tiles_per_chunk, tile_vec_ok(p.C, p.dtype));
}

template <typename T, int K, int CW>
void launch_tile_backward(const DwConvWgradParams& p, const DwTilePlan& q) {
  auto kernel = dwconv_tile_backward_kernel<T, K, CW>;
  allow_smem<TileKernelTag<T, K, CW, 2>>(kernel, q.smem_backward);
  const dim3 grid(unsigned(q.chunks), unsigned(q.channel_blocks));
  kernel<<<grid, kTileLanes * q.sub_h * q.sub_w, q.smem_backward, p.stream>>>(
      static_cast<const T*>(p.grad_y), static_cast<const T*>(p.x), p.weight, static_cast<T*>(p.grad_x), p.partial,
      p.H, p.W, p.C, q.tiles_h, q.tiles_w, q.sub_h, q.sub_w, q.tiles, q.tiles_per_chunk, p.add_input,
      tile_vec_ok(p.C, p.dtype));
}

template <typename T, template <typename, int, int> class F, typename Params>
void dispatch_tile(const Params& p, int cols) {
#define GSPN2_DW_TILE(KS)                  \
  if (cols == 8) {                         \
    F<T, KS, 8>::run(p);                   \
  } else {                                 \
    F<T, KS, 4>::run(p);                   \
  }
  switch (p.K) {
    case 3: GSPN2_DW_TILE(3); break;
    case 5: GSPN2_DW_TILE(5); break;
    case 7: GSPN2_DW_TILE(7); break;
    default: break;
  }
#undef GSPN2_DW_TILE
}

template <typename T, int K, int CW>
struct TileForwardLauncher {
  static void run(const DwConvForwardParams& p) { launch_tile_forward<T, K, CW>(p); }
};
template <typename T, int K, int CW>
struct TileWgradLauncher {
  static void run(const DwConvWgradParams& p) {
    const DwTilePlan q = dwconv_tile_plan(p.B, p.H, p.W, p.C, p.K, CW);
    if (p.grad_x != nullptr) {
      launch_tile_backward<T, K, CW>(p, q);
    } else {
      launch_tile_wgrad<T, K, CW>(p, q);
    }
    dwconv_tile_reduce_kernel<<<unsigned(((p.K * p.K + 1) * int64_t(p.C) + 255) / 256), 256, 0, p.stream>>>(
        p.partial, p.grad_w, p.grad_b, q.chunks, p.C, p.K * p.K);
  }
};

}  // namespace

DwTilePlan dwconv_tile_plan(int B, int H, int W, int C, int K, int cols) {
  DwTilePlan q;
  q.cols = cols;
  const int nh = (H + q.rows - 1) / q.rows, nw = (W + cols - 1) / cols;  // warp tiles to cover the image
  // Warp tiles per CTA along one side: the count up to `limit` that covers n with the fewest (ties: the
  // larger count, fewer CTAs and less halo).
  auto pick = [](int n, int limit) {
    int best = 1, best_cover = n;
    for (int s = 1; s <= std::min(n, limit); ++s) {
      const int cover = (n + s - 1) / s * s;
      if (cover <= best_cover) best = s, best_cover = cover;
    }
    return best;
  };
  q.sub_w = pick(nw, kTileMaxWarps);
  q.sub_h = pick(nh, std::max(1, kTileMaxWarps / q.sub_w));
  q.tiles_w = (nw + q.sub_w - 1) / q.sub_w;
  q.tiles_h = (nh + q.sub_h - 1) / q.sub_h;
  q.tiles = int64_t(B) * q.tiles_h * q.tiles_w;
  q.channel_blocks = (C + kTileLanes - 1) / kTileLanes;
  const int th = q.sub_h * q.rows, tw = q.sub_w * cols;
  const int halo = (th + K - 1) * (tw + K - 1);
  q.smem_forward = (K * K + halo) * kTileLanes * int(sizeof(float));
  const int staged = (halo + th * tw) * kTileLanes, reduced = q.sub_h * q.sub_w * (K * K + 1) * kTileLanes;
  q.smem_wgrad = std::max(staged, reduced) * int(sizeof(float));
  q.smem_backward = std::max(2 * halo * kTileLanes, reduced) * int(sizeof(float));
  const int64_t target = std::max(1, kTileWgradCtas / q.channel_blocks);
  q.tiles_per_chunk = std::max<int64_t>(1, (q.tiles + target - 1) / target);
  q.chunks = int((q.tiles + q.tiles_per_chunk - 1) / q.tiles_per_chunk);
  return q;
}

std::string dwconv_tile_forward_launch(const DwConvForwardParams& p) {
  if (p.residual != nullptr && p.residual != p.x) return "gspn2: the tile kernels add only their own input";
  switch (p.dtype) {
    case ScalarType::Float: dispatch_tile<float, TileForwardLauncher>(p, p.vec); break;
    case ScalarType::Half: dispatch_tile<__half, TileForwardLauncher>(p, p.vec); break;
    case ScalarType::BFloat16: dispatch_tile<__nv_bfloat16, TileForwardLauncher>(p, p.vec); break;
  }
  return last_launch_error();
}

std::string dwconv_tile_wgrad_launch(const DwConvWgradParams& p) {
  switch (p.dtype) {
    case ScalarType::Float: dispatch_tile<float, TileWgradLauncher>(p, p.plan.vec); break;
    case ScalarType::Half: dispatch_tile<__half, TileWgradLauncher>(p, p.plan.vec); break;
    case ScalarType::BFloat16: dispatch_tile<__nv_bfloat16, TileWgradLauncher>(p, p.plan.vec); break;
  }
  return last_launch_error();
}

}  // namespace gspn2
