// Depthwise convolution: the shared-memory tile kernels (dwconv.h). A CTA owns kTileLanes channels
// (lane = channel) of one spatial tile of sub_h x sub_w warp tiles; each thread computes kTileRows x CW output
// pixels of its channel. The tile's input and its halo are copied into shared memory in the tensor's dtype,
// laid out [pixel][lane], so a warp reads one pixel's 32 channels (64 or 128 contiguous bytes, no bank
// conflict) per load: on sm_90 as one TMA box per staged tensor and tile (one thread issues it; zeros outside
// the image and past channel C come from the copy engine; completion counted on an mbarrier per buffer),
// elsewhere, or where C is not a multiple of the 16-byte vector, by every thread's cp.async (16-byte copies
// that skip registers) or element copies. Each thread
// reads its channel's K * K taps (forward, input gradient) or keeps K * K partial sums (weight gradient) in
// float32 and slides over its (kTileRows + K - 1) x (CW + K - 1) input window once, so every staged input
// feeds all the outputs (or taps) it contributes to: K * K FMAs per output for
// (R + K - 1)(CW + K - 1) / (R * CW) shared loads.
// The backward runs as the input gradient (the forward kernel on grad_y with the flipped taps) and the
// weight gradient (kernel 0), or as one pass that stages grad_y and x once for both (kernel 1). Every kernel
// loops over tiles per CTA with two staging buffers: the copies of the next tile run while the current one
// is computed.
#include <algorithm>
#include <climits>

#include "dwconv_tile.cuh"

namespace gspn2 {
namespace {

// Stages rows x cols pixels (top-left corner (h0, w0), zeros outside the image and past channel C) of
// kTileLanes channels from c0 on, in T, at s[pixel * kTileLanes + lane]. `vec`: C is a multiple of the
// 16-byte vector (16-bit: 8 channels, float32: 4), so every vector is whole and aligned (the host passes
// 16-byte aligned tensors): asynchronous 16-byte copies, which the caller completes (cp_async_commit, then
// cp_async_wait and __syncthreads). Otherwise plain element copies, complete at the next __syncthreads.
template <typename T>
__device__ __forceinline__ void stage_tile(T* __restrict__ s, const T* __restrict__ src, int h0, int w0, int rows,
                                           int cols, int H, int W, int C, int c0, bool vec) {
  if (vec) {
    constexpr int V = 16 / sizeof(T);
    constexpr int NV = kTileLanes / V;  // vectors per pixel; blockDim.x is a multiple of it
    const int q = threadIdx.x % NV, step = blockDim.x / NV;
    const int c = c0 + q * V;
    const bool c_ok = c < C;
    // This thread's pixels p = threadIdx.x / NV + k * step, walked as (row, column) without a division per
    // pixel.
    const int p0 = threadIdx.x / NV, dr = step / cols, dc = step - dr * cols;
    int r = p0 / cols, col = p0 - r * cols;
    T* d = s + p0 * kTileLanes + q * V;
    for (; r < rows; d += step * kTileLanes) {
      const int h = h0 + r, w = w0 + col;
      const bool ok = c_ok && h >= 0 && h < H && w >= 0 && w < W;
      cp_async16(d, ok ? src + (int64_t(h) * W + w) * C + c : src, ok);
      r += dr;
      col += dc;
      if (col >= cols) col -= cols, ++r;
    }
  } else {
    const int n = rows * cols * kTileLanes;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const int p = i / kTileLanes, q = i % kTileLanes;
      const int r = p / cols, h = h0 + r, w = w0 + p - r * cols, c = c0 + q;
      s[i] = (h >= 0 && h < H && w >= 0 && w < W && c < C) ? src[(int64_t(h) * W + w) * C + c] : from_float<T>(0.f);
    }
  }
}

struct TileGeometry {
  int b, h0, w0;  // image and top-left output pixel of the CTA's tile
  int th, tw;     // tile size in output pixels
};

// Tile indices are 32-bit (the host checks the count); tiles_h and tiles_w divide by multiplication.
__device__ __forceinline__ TileGeometry tile_geometry(int tile, const FastDiv& tiles_h, const FastDiv& tiles_w,
                                                      int sub_h, int sub_w, int R, int CW) {
  TileGeometry g;
  const int rest = tiles_w.div(tile);
  const int tx = tile - rest * int(tiles_w.d);
  g.b = tiles_h.div(rest);
  const int ty = rest - g.b * int(tiles_h.d);
  g.th = sub_h * R;
  g.tw = sub_w * CW;
  g.h0 = ty * g.th;
  g.w0 = tx * g.tw;
  return g;
}

// The end of the weight-gradient CTAs: the warps' tap sums (and the bias sum, tap K * K) added in warp order
// (warp 0 first; deterministic) in shared memory (`red`: (KK + 1) * kTileLanes floats, reusing the staging
// memory) and written to partial[chunk][tap][c].
template <int KK>
__device__ __forceinline__ void store_chunk_partials(float* red, const float (&acc)[KK], float accb,
                                                     float* __restrict__ partial, int C, int c0) {
  const int lane = threadIdx.x % kTileLanes, warp = threadIdx.x / kTileLanes;
  const int warps = blockDim.x / kTileLanes;
  for (int w = 0; w < warps; ++w) {
    __syncthreads();  // every warp is done with the staged tiles, then with the previous warp's sums
    if (warp == w) {
#pragma unroll
      for (int t = 0; t < KK; ++t) red[t * kTileLanes + lane] = (w == 0 ? 0.f : red[t * kTileLanes + lane]) + acc[t];
      red[KK * kTileLanes + lane] = (w == 0 ? 0.f : red[KK * kTileLanes + lane]) + accb;
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < (KK + 1) * kTileLanes; e += blockDim.x) {
    const int tap = e / kTileLanes, l = e % kTileLanes;
    if (c0 + l < C) partial[(int64_t(wgrad_chunk()) * (KK + 1) + tap) * C + c0 + l] = red[e];
  }
}

// Slides over the thread's input window once: for each staged input v = x[ir][ic] of the warp tile's
// (R + K - 1) x (CW + K - 1) window (top-left halo pixel at `sx`), calls f(v, r, c, tap) for every output
// pixel (r, c) of the thread that v reaches through tap (ir - r) * K + (ic - c). Unrolled: r, c and tap are
// constants in f.
template <int K, int R, int CW, typename T, typename F>
__device__ __forceinline__ void for_each_window_tap(const T* sx, int cols, F&& f) {
#pragma unroll
  for (int ir = 0; ir < R + K - 1; ++ir) {
#pragma unroll
    for (int ic = 0; ic < CW + K - 1; ++ic) {
      const float v = to_float(sx[(ir * cols + ic) * kTileLanes]);
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

// The convolution of one warp tile: acc[r][c] += sum over taps of x[r + i][c + j] * w[i * K + j]. `w`: the
// thread's taps, in registers (an array) or in shared memory (a pointer: each tap is loaded where the
// window first needs it, so at most R rows of taps are live at once).
template <int K, int R, int CW, typename T, typename Taps>
__device__ __forceinline__ void convolve_tile(float (&acc)[R][CW], const Taps& w, const T* sx, int cols) {
  for_each_window_tap<K, R, CW>(sx, cols, [&](float v, int r, int c, int t) { acc[r][c] = fmaf(v, w[t], acc[r][c]); });
}

// One warp tile's products added to the tap sums: acc[i * K + j] += g[r][c] * x[r + i][c + j].
template <int K, int R, int CW, typename T>
__device__ __forceinline__ void accumulate_taps(float (&acc)[K * K], const float (&gv)[R][CW], const T* sx, int cols) {
  for_each_window_tap<K, R, CW>(sx, cols, [&](float v, int r, int c, int t) { acc[t] = fmaf(gv[r][c], v, acc[t]); });
}

// Writes a warp tile's R x CW outputs of channel c (out[r][j] at pixel (h, w) = (hb + r, wb + j)) through
// f(r, j, pointer): unguarded where the warp tile lies inside the image, else only the pixels inside it.
template <int R, int CW, typename T, typename F>
__device__ __forceinline__ void for_each_output(T* __restrict__ base, int hb, int wb, int H, int W, int C, F&& f) {
  T* p = base + (int64_t(hb) * W + wb) * C;
  const int64_t row = int64_t(W) * C;
  if (hb + R <= H && wb + CW <= W) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int j = 0; j < CW; ++j) f(r, j, p + r * row + j * C);
  } else {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int j = 0; j < CW; ++j)
        if (hb + r < H && wb + j < W) f(r, j, p + r * row + j * C);
  }
}

// Elements of T in a staged tensor of `pixels` pixels, rounded up to the 128-byte boundary of the next.
template <typename T>
__device__ __forceinline__ int staged_elems(int pixels) {
  return tile_smem_round(pixels * kTileLanes * int(sizeof(T))) / int(sizeof(T));
}

// Forward and input gradient: y = conv(x) (+ bias) (+ x, `add_input`, read from the staged tile) (then
// SiLU); the input gradient is the convolution of grad_y with the flipped taps (`flip`), plus grad_y for
// x + conv(x). Persistent CTAs: CTA i of a channel block computes tiles i, i + gridDim.x, ... (the grid is
// what fits on the GPU at once), staging the taps once and each tile's input double-buffered (`tma`: by the
// box of `tm_x`, (th + K - 1) x (tw + K - 1) pixels).
// Four CTAs of 8 warps per SM (at most 64 registers) with 4 columns per thread, two with 8; the 7x7 with 4
// columns takes three (80 registers: at 64 it spills in its inner loop, and three CTAs are faster on every
// gspn2_tiny shape, docs/benchmarks.md).
template <typename T, int K, int CW>
__global__ void __launch_bounds__(kTileLanes * kTileMaxWarps, K == 7 && CW == 4 ? 3 : CW == 4 ? 4 : 2)
    dwconv_tile_forward_kernel(
    const T* __restrict__ x, const float* __restrict__ weight, const float* __restrict__ bias, T* __restrict__ y,
    int H, int W, int C, FastDiv tiles_h, FastDiv tiles_w, int sub_h, int sub_w, int tiles, bool flip,
    bool add_input, bool silu_out, bool vec, const __grid_constant__ CUtensorMap tm_x, bool tma) {
  constexpr int R = kTileRows, P = K / 2, KK = K * K;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  uint64_t* const bars = reinterpret_cast<uint64_t*>(smem_raw);
  float* s_w = reinterpret_cast<float*>(smem_raw + kTileBarBytes);  // [lane][tap]: KK odd, no bank conflicts
  // Two buffers of [pixel][lane] after the taps (offsets, not a pointer array: the loads stay shared-memory
  // loads).
  T* const s_buf = reinterpret_cast<T*>(smem_raw + kTileBarBytes + kTileLanes * KK * sizeof(float));
  const int lane = threadIdx.x % kTileLanes, warp = threadIdx.x / kTileLanes;
  const int c0 = blockIdx.y * kTileLanes, c = c0 + lane;
  const int th = sub_h * R, tw = sub_w * CW, rows = th + K - 1, cols = tw + K - 1;
  const int elems = staged_elems<T>(rows * cols);
  const int sr = (warp / sub_w) * R, sc = (warp % sub_w) * CW;  // the warp tile in the CTA tile
  const int s_off = (sr * cols + sc) * kTileLanes + lane;
  const uint32_t box_bytes = uint32_t(rows * cols * kTileLanes * sizeof(T));

  stage_taps<KK>(s_w, weight, c0, C, flip);
  if (tma) tma_init(bars);
  __syncthreads();  // the taps and the mbarriers
  const float* const s_taps = s_w + lane * KK;
  const float bv = (bias != nullptr && c < C) ? bias[c] : 0.f;

  pipeline_tiles(
      int(blockIdx.x), tiles, int(gridDim.x), tma ? bars : nullptr,
      [&](int t, int b) {
        const TileGeometry g = tile_geometry(t, tiles_h, tiles_w, sub_h, sub_w, R, CW);
        if (tma) {
          if (threadIdx.x == 0) {
            tma_begin(&bars[b], box_bytes);
            tma_box(s_buf + b * elems, &tm_x, c0, g.w0 - P, g.h0 - P, g.b, &bars[b]);
          }
        } else {
          stage_tile<T>(s_buf + b * elems, x + int64_t(g.b) * H * W * C, g.h0 - P, g.w0 - P, rows, cols, H, W, C,
                        c0, vec);
        }
      },
      [&](int t, int b) {
        float acc[R][CW];
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int j = 0; j < CW; ++j) acc[r][j] = bv;
        const T* sx = s_buf + b * elems + s_off;
        convolve_tile<K, R, CW>(acc, s_taps, sx, cols);
        if (c >= C) return;
        const TileGeometry g = tile_geometry(t, tiles_h, tiles_w, sub_h, sub_w, R, CW);
        for_each_output<R, CW>(y + int64_t(g.b) * H * W * C + c, g.h0 + sr, g.w0 + sc, H, W, C,
                               [&](int r, int j, T* out) {
                                 float v = acc[r][j];
                                 if (add_input) v += to_float(sx[((r + P) * cols + j + P) * kTileLanes]);
                                 *out = from_float<T>(silu_out ? silu(v) : v);
                               });
      });
}

// Weight and bias gradients: each CTA sums grad_y (x) shifted x over its chunk of tiles for its 32 channels,
// one thread per (channel, warp tile) holding the K * K tap sums; the warps' sums are added in a fixed order
// into partial[chunk][tap][c] (tap K * K: the bias). `tma`: x staged by the box of `tm_x` (with the halo),
// grad_y by that of `tm_g` (th x tw). The 7x7 with 4 columns fits 80 registers, so three CTAs of 8 warps
// share an SM.
template <typename T, int K, int CW>
__global__ void __launch_bounds__(kTileLanes * kTileMaxWarps, K == 7 && CW == 4 ? 3 : 1) dwconv_tile_wgrad_kernel(
    const T* __restrict__ gy, const T* __restrict__ x, float* __restrict__ partial, int H, int W, int C,
    FastDiv tiles_h, FastDiv tiles_w, int sub_h, int sub_w, int tiles, int tiles_per_chunk, bool vec,
    const __grid_constant__ CUtensorMap tm_x, const __grid_constant__ CUtensorMap tm_g, bool tma) {
  constexpr int R = kTileRows, P = K / 2, KK = K * K;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  uint64_t* const bars = reinterpret_cast<uint64_t*>(smem_raw);
  const int lane = threadIdx.x % kTileLanes, warp = threadIdx.x / kTileLanes;
  const int c0 = wgrad_channel_block() * kTileLanes;
  const int th = sub_h * R, tw = sub_w * CW, cols = tw + K - 1;
  const int x_elems = staged_elems<T>((th + K - 1) * cols), g_elems = staged_elems<T>(th * tw);
  // Two buffers of [x with its halo: (th + K - 1) * cols pixels][lane], then [grad_y: th * tw pixels][lane]
  // (offsets from the buffers' start, not a pointer array: the loads stay shared-memory loads).
  T* const s_buf = reinterpret_cast<T*>(smem_raw + kTileBarBytes);
  const int buf_elems = x_elems + g_elems;
  const int sr = (warp / sub_w) * R, sc = (warp % sub_w) * CW;
  const uint32_t box_bytes = uint32_t(((th + K - 1) * cols + th * tw) * kTileLanes * sizeof(T));

  float acc[KK];
#pragma unroll
  for (int t = 0; t < KK; ++t) acc[t] = 0.f;
  float accb = 0.f;
  if (tma) tma_init(bars);
  __syncthreads();

  pipeline_chunk(
      tiles, tiles_per_chunk, tma ? bars : nullptr,
      [&](int t, int b) {
        const TileGeometry g = tile_geometry(t, tiles_h, tiles_w, sub_h, sub_w, R, CW);
        T* const sx = s_buf + b * buf_elems;
        if (tma) {
          if (threadIdx.x == 0) {
            tma_begin(&bars[b], box_bytes);
            tma_box(sx, &tm_x, c0, g.w0 - P, g.h0 - P, g.b, &bars[b]);
            tma_box(sx + x_elems, &tm_g, c0, g.w0, g.h0, g.b, &bars[b]);
          }
        } else {
          const int64_t img = int64_t(g.b) * H * W * C;
          stage_tile<T>(sx, x + img, g.h0 - P, g.w0 - P, th + K - 1, cols, H, W, C, c0, vec);
          stage_tile<T>(sx + x_elems, gy + img, g.h0, g.w0, th, tw, H, W, C, c0, vec);
        }
      },
      [&](int, int b) {
        const T* const sx = s_buf + b * buf_elems;
        const T* const sg = sx + x_elems + (sr * tw + sc) * kTileLanes + lane;
        float gv[R][CW];
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int j = 0; j < CW; ++j) {
            gv[r][j] = to_float(sg[(r * tw + j) * kTileLanes]);
            accb += gv[r][j];
          }
        accumulate_taps<K, R, CW>(acc, gv, sx + (sr * cols + sc) * kTileLanes + lane, cols);
      });

  store_chunk_partials<KK>(reinterpret_cast<float*>(smem_raw + kTileBarBytes), acc, accb, partial, C, c0);
}

// The whole backward in one pass: the weight and bias gradients as dwconv_tile_wgrad_kernel, and each tile's
// input gradient (grad_y convolved with the flipped taps, plus grad_y with `add_input`) on the way. grad_y is
// staged once with its halo for both, so the pass reads grad_y and x once and writes grad_x once (`tma`: by
// the boxes of `tm_x` and `tm_g`, both with the halo).
template <typename T, int K, int CW>
__global__ void __launch_bounds__(kTileLanes * kTileMaxWarps) dwconv_tile_backward_kernel(
    const T* __restrict__ gy, const T* __restrict__ x, const float* __restrict__ weight, T* __restrict__ gx,
    float* __restrict__ partial, int H, int W, int C, FastDiv tiles_h, FastDiv tiles_w, int sub_h, int sub_w,
    int tiles, int tiles_per_chunk, bool add_input, bool vec, const __grid_constant__ CUtensorMap tm_x,
    const __grid_constant__ CUtensorMap tm_g, bool tma) {
  constexpr int R = kTileRows, P = K / 2, KK = K * K;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  uint64_t* const bars = reinterpret_cast<uint64_t*>(smem_raw);
  const int lane = threadIdx.x % kTileLanes, warp = threadIdx.x / kTileLanes;
  const int c0 = wgrad_channel_block() * kTileLanes, c = c0 + lane;
  const int th = sub_h * R, tw = sub_w * CW, rows = th + K - 1, cols = tw + K - 1;
  const int elems = staged_elems<T>(rows * cols);  // one staged tensor with its halo
  float* s_w = reinterpret_cast<float*>(smem_raw + kTileBarBytes);  // [lane][tap], flipped
  // Two buffers of [x with its halo][lane], then [grad_y with its halo][lane], after the taps (offsets, not a
  // pointer array: the loads stay shared-memory loads).
  T* const s_buf = reinterpret_cast<T*>(smem_raw + kTileBarBytes + kTileLanes * KK * sizeof(float));
  const int sr = (warp / sub_w) * R, sc = (warp % sub_w) * CW;
  const int s_off = (sr * cols + sc) * kTileLanes + lane;
  const uint32_t box_bytes = uint32_t(2 * rows * cols * kTileLanes * sizeof(T));

  // The flipped taps of this thread's channel, through shared memory (coalesced reads of the weight).
  stage_taps<KK>(s_w, weight, c0, C, true);
  if (tma) tma_init(bars);
  __syncthreads();
  float wr[KK];
#pragma unroll
  for (int t = 0; t < KK; ++t) wr[t] = s_w[lane * KK + t];

  float acc_w[KK];
#pragma unroll
  for (int t = 0; t < KK; ++t) acc_w[t] = 0.f;
  float accb = 0.f;

  pipeline_chunk(
      tiles, tiles_per_chunk, tma ? bars : nullptr,
      [&](int t, int b) {
        const TileGeometry g = tile_geometry(t, tiles_h, tiles_w, sub_h, sub_w, R, CW);
        T* const sx = s_buf + b * 2 * elems;
        if (tma) {
          if (threadIdx.x == 0) {
            tma_begin(&bars[b], box_bytes);
            tma_box(sx, &tm_x, c0, g.w0 - P, g.h0 - P, g.b, &bars[b]);
            tma_box(sx + elems, &tm_g, c0, g.w0 - P, g.h0 - P, g.b, &bars[b]);
          }
        } else {
          const int64_t img = int64_t(g.b) * H * W * C;
          stage_tile<T>(sx, x + img, g.h0 - P, g.w0 - P, rows, cols, H, W, C, c0, vec);
          stage_tile<T>(sx + elems, gy + img, g.h0 - P, g.w0 - P, rows, cols, H, W, C, c0, vec);
        }
      },
      [&](int t, int b) {
        const TileGeometry g = tile_geometry(t, tiles_h, tiles_w, sub_h, sub_w, R, CW);
        const T* const sx = s_buf + b * 2 * elems + s_off;
        const T* const sg = sx + elems;
        float acc[R][CW];
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int j = 0; j < CW; ++j) acc[r][j] = 0.f;
        convolve_tile<K, R, CW>(acc, wr, sg, cols);
        if (c < C) {
          for_each_output<R, CW>(gx + int64_t(g.b) * H * W * C + c, g.h0 + sr, g.w0 + sc, H, W, C,
                                 [&](int r, int j, T* out) {
                                   float v = acc[r][j];
                                   if (add_input) v += to_float(sg[((r + P) * cols + j + P) * kTileLanes]);
                                   *out = from_float<T>(v);
                                 });
        }
        float gv[R][CW];  // grad_y at the warp tile's own pixels (zero outside the image)
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int j = 0; j < CW; ++j) {
            gv[r][j] = to_float(sg[((r + P) * cols + j + P) * kTileLanes]);
            accb += gv[r][j];
          }
        accumulate_taps<K, R, CW>(acc_w, gv, sx, cols);
      });

  store_chunk_partials<KK>(reinterpret_cast<float*>(smem_raw + kTileBarBytes), acc_w, accb, partial, C, c0);
}

template <typename T, int K, int CW, int kKind>  // kKind: 0 forward, 1 weight gradient, 2 one-pass backward
struct TileKernelTag {};

bool tile_vec_ok(int C, ScalarType dtype) { return C % (16 / element_size(dtype)) == 0; }

// The staging of one launch: by TMA (`on`, with the maps of the staged tensors) where the kernel has it, the
// channels fill whole 16-byte vectors (which also makes every stride a multiple of 16 bytes) and the tensor's
// strides fit the map; otherwise by cp.async or element copies (`vec`).
struct TileStaging {
  bool vec = false, on = false;
  CUtensorMap a{}, b{};
};

// Staging for tensors a (box a_cols x a_rows) and, where b is not null, b (b_cols x b_rows), all (B, H, W, C).
template <typename Tag, typename Kernel>
std::string tile_staging(TileStaging* s, Kernel kernel, ScalarType dtype, int B, int H, int W, int C, const void* a,
                         int a_cols, int a_rows, const void* b = nullptr, int b_cols = 0, int b_rows = 0) {
  s->vec = tile_vec_ok(C, dtype);
  const bool fits = (int64_t(H) * W * C * element_size(dtype)) < (int64_t(1) << 40);
  s->on = s->vec && fits && dwconv_tile_tma_enabled() && kernel_has_tma<Tag>(kernel);
  if (!s->on) return "";
  const cudaError_t bound = tma::bind_context();  // the encoder needs a current context (tma.cuh)
  if (bound != cudaSuccess) return std::string("CUDA error: ") + cudaGetErrorString(bound);
  std::string err = encode_tile_box(&s->a, a, dtype, B, H, W, C, a_cols, a_rows);
  if (err.empty() && b != nullptr) err = encode_tile_box(&s->b, b, dtype, B, H, W, C, b_cols, b_rows);
  return err;
}

template <typename T, int K, int CW>
std::string launch_tile_forward(const DwConvForwardParams& p, const DwTilePlan& q) {
  using Tag = TileKernelTag<T, K, CW, 0>;
  auto kernel = dwconv_tile_forward_kernel<T, K, CW>;
  allow_smem<Tag>(kernel, q.smem_forward);
  const int th = q.sub_h * q.rows, tw = q.sub_w * q.cols;
  TileStaging s;
  const std::string err = tile_staging<Tag>(&s, kernel, p.dtype, p.B, p.H, p.W, p.C, p.x, tw + p.K - 1, th + p.K - 1);
  if (!err.empty()) return err;
  const int threads = kTileLanes * q.sub_h * q.sub_w;
  // As many CTAs as fit at once, spread over the channel blocks; each loops over its share of the tiles.
  const int per_block = std::max(1, resident_ctas<Tag>(kernel, threads, q.smem_forward) / q.channel_blocks);
  const dim3 grid(unsigned(std::min<int64_t>(q.tiles, per_block)), unsigned(q.channel_blocks));
  kernel<<<grid, threads, q.smem_forward, p.stream>>>(
      static_cast<const T*>(p.x), p.weight, p.bias, static_cast<T*>(p.y), p.H, p.W, p.C, fast_div(q.tiles_h),
      fast_div(q.tiles_w), q.sub_h, q.sub_w, int(q.tiles), p.flip, p.add_input, p.silu, s.vec, s.a, s.on);
  return "";
}

template <typename T, int K, int CW>
std::string launch_tile_wgrad(const DwConvWgradParams& p, const DwTilePlan& q) {
  using Tag = TileKernelTag<T, K, CW, 1>;
  auto kernel = dwconv_tile_wgrad_kernel<T, K, CW>;
  allow_smem<Tag>(kernel, q.smem_wgrad);
  const int th = q.sub_h * q.rows, tw = q.sub_w * q.cols;
  TileStaging s;
  const std::string err = tile_staging<Tag>(&s, kernel, p.dtype, p.B, p.H, p.W, p.C, p.x, tw + p.K - 1,
                                            th + p.K - 1, p.grad_y, tw, th);
  if (!err.empty()) return err;
  const dim3 grid(unsigned(q.channel_blocks), unsigned(q.chunks));  // wgrad_channel_block(), wgrad_chunk()
  kernel<<<grid, kTileLanes * q.sub_h * q.sub_w, q.smem_wgrad, p.stream>>>(
      static_cast<const T*>(p.grad_y), static_cast<const T*>(p.x), p.partial, p.H, p.W, p.C, fast_div(q.tiles_h),
      fast_div(q.tiles_w), q.sub_h, q.sub_w, int(q.tiles), int(q.tiles_per_chunk), s.vec, s.a, s.b, s.on);
  return "";
}

template <typename T, int K, int CW>
std::string launch_tile_backward(const DwConvWgradParams& p, const DwTilePlan& q) {
  using Tag = TileKernelTag<T, K, CW, 2>;
  auto kernel = dwconv_tile_backward_kernel<T, K, CW>;
  allow_smem<Tag>(kernel, q.smem_backward);
  const int th = q.sub_h * q.rows, tw = q.sub_w * q.cols;
  TileStaging s;
  const std::string err = tile_staging<Tag>(&s, kernel, p.dtype, p.B, p.H, p.W, p.C, p.x, tw + p.K - 1,
                                            th + p.K - 1, p.grad_y, tw + p.K - 1, th + p.K - 1);
  if (!err.empty()) return err;
  const dim3 grid(unsigned(q.channel_blocks), unsigned(q.chunks));  // wgrad_channel_block(), wgrad_chunk()
  kernel<<<grid, kTileLanes * q.sub_h * q.sub_w, q.smem_backward, p.stream>>>(
      static_cast<const T*>(p.grad_y), static_cast<const T*>(p.x), p.weight, static_cast<T*>(p.grad_x), p.partial,
      p.H, p.W, p.C, fast_div(q.tiles_h), fast_div(q.tiles_w), q.sub_h, q.sub_w, int(q.tiles),
      int(q.tiles_per_chunk), p.add_input, s.vec, s.a, s.b, s.on);
  return "";
}

std::string too_many_tiles(const DwTilePlan& q) {
  return "gspn2: the depthwise tile kernels index tiles with 32-bit integers; this input has " +
         std::to_string(q.tiles) + " tiles (batch x tiles per image)";
}

template <typename T, template <typename, int, int> class F, typename Params>
std::string dispatch_tile(const Params& p, int cols) {
#define GSPN2_DW_TILE(KS) return cols == 8 ? F<T, KS, 8>::run(p) : F<T, KS, 4>::run(p)
  switch (p.K) {
    case 3: GSPN2_DW_TILE(3);
    case 5: GSPN2_DW_TILE(5);
    case 7: GSPN2_DW_TILE(7);
    default: return "";
  }
#undef GSPN2_DW_TILE
}

// The launchers return an error message, or "" once the kernels are launched.
template <typename T, int K, int CW>
struct TileForwardLauncher {
  static std::string run(const DwConvForwardParams& p) {
    const DwTilePlan q = dwconv_tile_plan(p.B, p.H, p.W, p.C, p.K, CW, int(sizeof(T)), dwconv_tile_smem_limit());
    if (q.tiles > INT_MAX) return too_many_tiles(q);
    return launch_tile_forward<T, K, CW>(p, q);
  }
};
template <typename T, int K, int CW>
struct TileWgradLauncher {
  static std::string run(const DwConvWgradParams& p) {
    const DwTilePlan q = dwconv_tile_plan(p.B, p.H, p.W, p.C, p.K, CW, int(sizeof(T)), dwconv_tile_smem_limit());
    if (q.tiles > INT_MAX) return too_many_tiles(q);
    const std::string err =
        p.grad_x != nullptr ? launch_tile_backward<T, K, CW>(p, q) : launch_tile_wgrad<T, K, CW>(p, q);
    if (!err.empty()) return err;
    launch_chunk_reduce(p.partial, p.grad_w, p.grad_b, q.chunks, p.C, p.K * p.K, p.stream);
    return "";
  }
};

std::atomic<bool> g_tile_tma{true};

}  // namespace

void dwconv_tile_set_tma(bool enabled) { g_tile_tma.store(enabled); }
bool dwconv_tile_tma_enabled() { return g_tile_tma.load(); }

int dwconv_tile_smem_limit() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> limits[kMaxDevices] = {};  // 0: not asked yet
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 0 || dev >= kMaxDevices) return kTileSmemBudget;
  int limit = limits[dev].load(std::memory_order_relaxed);
  if (limit == 0) {
    int optin = 0;
    cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    limit = optin > 0 ? std::min(kTileSmemBudget, optin) : kTileSmemBudget;
    limits[dev].store(limit, std::memory_order_relaxed);
  }
  return limit;
}

DwTilePlan dwconv_tile_plan(int B, int H, int W, int C, int K, int cols, int elem_bytes, int smem_limit) {
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
  const int taps = K * K * kTileLanes * int(sizeof(float));
  const int reduced = (K * K + 1) * kTileLanes * int(sizeof(float));
  // The most warps per CTA (8, else 4, 2, 1) whose three kernels fit in `smem_limit`.
  for (int warps = kTileMaxWarps;; warps /= 2) {
    q.sub_w = pick(nw, warps);
    q.sub_h = pick(nh, std::max(1, warps / q.sub_w));
    const int th = q.sub_h * q.rows, tw = q.sub_w * cols;
    // Bytes of one staged tile with its halo, and without.
    const int halo = tile_smem_round((th + K - 1) * (tw + K - 1) * kTileLanes * elem_bytes);
    const int own = tile_smem_round(th * tw * kTileLanes * elem_bytes);
    q.smem_forward = kTileBarBytes + taps + 2 * halo;                     // two staging buffers
    q.smem_wgrad = kTileBarBytes + std::max(2 * (halo + own), reduced);  // two buffers of x, grad_y
    q.smem_backward = kTileBarBytes + std::max(taps + 4 * halo, reduced);
    if (warps == 1 || std::max({q.smem_forward, q.smem_wgrad, q.smem_backward}) <= smem_limit) break;
  }
  q.tiles_w = (nw + q.sub_w - 1) / q.sub_w;
  q.tiles_h = (nh + q.sub_h - 1) / q.sub_h;
  q.tiles = int64_t(B) * q.tiles_h * q.tiles_w;
  q.channel_blocks = (C + kTileLanes - 1) / kTileLanes;
  split_tiles(q.tiles, kTileWgradCtas, q.channel_blocks, &q.tiles_per_chunk, &q.chunks);
  return q;
}

std::string dwconv_tile_forward_launch(const DwConvForwardParams& p) {
  std::string error;
  switch (p.dtype) {
    case ScalarType::Float: error = dispatch_tile<float, TileForwardLauncher>(p, p.cols); break;
    case ScalarType::Half: error = dispatch_tile<__half, TileForwardLauncher>(p, p.cols); break;
    case ScalarType::BFloat16: error = dispatch_tile<__nv_bfloat16, TileForwardLauncher>(p, p.cols); break;
  }
  return error.empty() ? last_launch_error() : error;
}

std::string dwconv_tile_wgrad_launch(const DwConvWgradParams& p) {
  std::string error;
  switch (p.dtype) {
    case ScalarType::Float: error = dispatch_tile<float, TileWgradLauncher>(p, p.cols); break;
    case ScalarType::Half: error = dispatch_tile<__half, TileWgradLauncher>(p, p.cols); break;
    case ScalarType::BFloat16: error = dispatch_tile<__nv_bfloat16, TileWgradLauncher>(p, p.cols); break;
  }
  return error.empty() ? last_launch_error() : error;
}

}  // namespace gspn2
