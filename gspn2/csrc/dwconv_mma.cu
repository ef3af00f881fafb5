// Depthwise convolution on tensor cores (dwconv.h): the forward, and the input gradient (the same kernel with
// the flipped taps), for 16-bit inputs on sm_80 and newer.
//
// Per channel, one kernel row i of a K x K convolution is a matrix product over the image's columns:
//
//   y[h, w] += sum_{w'} x[h + i - P, w'] * T_i[w', w],   T_i[w', w] = tap[i][w' - w + P]  (0 <= w' - w + P < K)
//
// T_i is banded (Toeplitz). A warp computes 16 output rows x 8 output columns of its channel as
// mma.m16n8k8 products: A = 16 input rows x 8 input columns (one aligned chunk of the staged tile), B = the
// 8 x 8 block of T_i that maps that chunk to the output columns. Output columns [8q, 8q + 8) read the chunks
// starting at 8(q - 1), 8q and 8(q + 1) (P <= 8), and the block of T_i depends only on the chunk's offset
// from the output columns, so each warp builds 3 K fragments of B (one register each) from its channel's taps
// once and reuses them for every output column group: 3 K mma per 16 x 8 outputs.
//
// A CTA owns 8 channels (one per warp) of 16 output rows x 8 * groups columns (groups <= 8). It stages the
// input rows with their halo channel by channel ([channel][row][column], rows padded to an odd number of
// 16-byte units so that ldmatrix's eight row addresses hit distinct banks), reading each pixel's 8 channels
// as one 16-byte vector; ldmatrix then loads the A fragments. Outputs go through shared memory, laid out
// [pixel][channel], and leave as one 16-byte vector per pixel. Accumulation is float32; the taps are rounded
// to the input's dtype, as cuDNN and F.conv2d under autocast use them.
#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <string>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "dwconv.h"
#include "dwconv_device.cuh"

namespace gspn2 {
namespace {

constexpr int kMmaLanes = 8;       // channels per CTA, one per warp
constexpr int kMmaThreads = 32 * kMmaLanes;
constexpr int kMmaRows = 16;       // output rows per CTA: the mma's M
constexpr int kMmaMaxGroups = 4;   // output column groups of 8 (the mma's N) per tile

// Two values packed as the mma's 16-bit pair (the first in the low half).
__device__ __forceinline__ uint32_t pack2(__half lo, __half hi) {
  return uint32_t(__half_as_ushort(lo)) | (uint32_t(__half_as_ushort(hi)) << 16);
}
__device__ __forceinline__ uint32_t pack2(__nv_bfloat16 lo, __nv_bfloat16 hi) {
  return uint32_t(__bfloat16_as_ushort(lo)) | (uint32_t(__bfloat16_as_ushort(hi)) << 16);
}
template <typename T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <typename T>
__device__ __forceinline__ float low_f32(uint32_t pair) {
  const unsigned short bits = static_cast<unsigned short>(pair & 0xffffu);
  if constexpr (std::is_same<T, __half>::value) return __half2float(__ushort_as_half(bits));
  else return __bfloat162float(__ushort_as_bfloat16(bits));
}
template <typename T>
__device__ __forceinline__ float high_f32(uint32_t pair) { return low_f32<T>(pair >> 16); }

// d += a (16 x 8, row-major) * b (8 x 8, column-major), float32 accumulators.
template <typename T>
__device__ __forceinline__ void mma_16x8x8(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same<T, __half>::value) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(b));
  } else {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(b));
  }
#endif
}

// The A fragment of rows 0-15 (addresses from lanes 0-15), 8 16-bit values (16 bytes) per row.
__device__ __forceinline__ void ldmatrix_x2(uint32_t& r0, uint32_t& r1, const void* row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(a) : "memory");
#endif
}

__device__ __forceinline__ float silu_f32(float v) { return __fdividef(v, 1.f + __expf(-v)); }

// ldmatrix.trans of four 8 x 8 matrices (row addresses from lanes 8m ... 8m + 7 for matrix m): this thread
// gets, of each matrix, the elements [2 tq][g] and [2 tq + 1][g] (g = lane / 4, tq = lane % 4) as one pair.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a)
               : "memory");
#endif
}

// Shared-memory layout of a tile with `groups` output column groups (host and device).
struct MmaLayout {
  int tw, cols, stride, plane, pixels;
  __host__ __device__ MmaLayout(int groups, int K) {
    const int rows = kMmaRows + K - 1;
    tw = 8 * groups;   // output columns
    cols = tw + 16;    // staged columns, w0 - 8 ... w0 + tw + 7: groups + 2 chunks of 8
    stride = 8 * ((cols / 8) | 1);  // a plane's row: an odd number of 16-byte units (ldmatrix: no conflicts)
    plane = rows * stride;
    if ((plane / 8) % 2 == 0) plane += 8;  // planes an odd number of 16-byte units apart (no conflicts below)
    pixels = rows * cols;
  }
  // Bytes: the channel planes (which the output stage, kMmaRows x (tw + 1) pixels of 8 channels, reuses),
  // then two staging buffers of [pixel][channel].
  __host__ __device__ int smem_bytes(int elem_bytes) const {
    return (kMmaLanes * plane + 2 * pixels * kMmaLanes) * elem_bytes;
  }
};

// Persistent CTAs: CTA i of channel block blockIdx.y computes tiles i, i + gridDim.x, ... (tile = image,
// row band, column tile) of NG output column groups. Each tile's input rows with their halo
// (x[h0 - P + r][w0 - 8 + col]) are copied by cp.async, 16 bytes (8 channels) per pixel, into one of two
// staging buffers while the previous tile is computed; ldmatrix.trans then spreads them into channel planes,
// each warp runs its channel's mma, and the outputs leave through shared memory.
template <typename T, int K, int NG>
__global__ void __launch_bounds__(kMmaThreads, 2) dwconv_mma_forward_kernel(
    const T* __restrict__ x, const float* __restrict__ weight, const float* __restrict__ bias, T* __restrict__ y,
    int H, int W, int C, int tiles_w, int bands, int tiles, bool flip, bool add_input, bool silu_out, bool vec) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr int P = K / 2, KK = K * K;
  constexpr int rows = kMmaRows + K - 1;  // staged input rows
  constexpr int chunks = NG + 2;          // staged 8-column chunks per row
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const MmaLayout L(NG, K);
  constexpr int tw = 8 * NG, cols = tw + 16;
  T* const s_plane = reinterpret_cast<T*>(smem_raw);  // [channel][row][stride]; then the output stage
  T* const s_raw = s_plane + kMmaLanes * L.plane;     // two buffers of [pixel][channel]
  const int c0 = blockIdx.y * kMmaLanes;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, ch = warp, c = c0 + ch;
  const int g = lane / 4, tq = lane % 4;  // the mma's groupID and thread-in-group

  // B fragments: for kernel row i and chunk offset s (the chunk starts 8(s - 1) columns from the output
  // group), this thread's pair B[k = 2 tq, 2 tq + 1][n = g] = tap[i][8(s - 1) + k - n + P].
  uint32_t bf[K][3];
  {
    const float* wc = weight + int64_t(c < C ? c : 0) * KK;
#pragma unroll
    for (int i = 0; i < K; ++i)
#pragma unroll
      for (int s = 0; s < 3; ++s) {
        const int j = 8 * (s - 1) + 2 * tq - g + P;
        float lo = 0.f, hi = 0.f;
        if (c < C && j >= 0 && j < K) lo = wc[flip ? KK - 1 - (i * K + j) : i * K + j];
        if (c < C && j + 1 >= 0 && j + 1 < K) hi = wc[flip ? KK - 1 - (i * K + j + 1) : i * K + j + 1];
        bf[i][s] = pack2(from_f32<T>(lo), from_f32<T>(hi));
      }
  }
  const float bv = (bias != nullptr && c < C) ? bias[c] : 0.f;

  // Staging and output loops: thread -> one column, every (kMmaThreads / width)-th row.
  constexpr int in_step = kMmaThreads / cols, out_step = kMmaThreads / tw;
  const int in_col = threadIdx.x % cols, in_row = threadIdx.x / cols;
  const int out_col = threadIdx.x % tw, out_row = threadIdx.x / tw;
  const int64_t row_elems = int64_t(W) * C;

  struct Tile {
    int64_t img;
    int h0, w0;
  };
  auto tile_at = [&](int t) {
    const int tx = t % tiles_w, rest = t / tiles_w;
    const int band = rest % bands, b = rest / bands;
    return Tile{int64_t(b) * H * W * C, band * kMmaRows, tx * tw};
  };

  pipeline_tiles(
      int(blockIdx.x), tiles, int(gridDim.x),
      [&](int t, int buf) {
        if (in_row >= in_step) return;
        const Tile tl = tile_at(t);
        const int w = tl.w0 - 8 + in_col;
        const bool col_ok = w >= 0 && w < W;
        T* dst = s_raw + (buf * L.pixels + in_row * cols + in_col) * kMmaLanes;
        const T* src = x + tl.img + (int64_t(tl.h0 - P + in_row) * W + w) * C + c0;
        for (int r = in_row; r < rows; r += in_step, dst += in_step * cols * kMmaLanes, src += in_step * row_elems) {
          const int h = tl.h0 - P + r;
          const bool ok = col_ok && h >= 0 && h < H;
          if (vec) {
            cp_async16(dst, ok ? src : x, ok);
          } else {
            for (int k = 0; k < kMmaLanes; ++k) dst[k] = ok && c0 + k < C ? src[k] : from_f32<T>(0.f);
          }
        }
      },
      [&](int t, int buf) {
        // The staged pixels into channel planes: a warp takes whole rows, four 8-pixel chunks per
        // ldmatrix.trans (lanes 8m ... 8m + 7 address chunk j0 + m), and stores each channel's pairs.
        {
          const T* raw = s_raw + buf * L.pixels * kMmaLanes;
          for (int r = warp; r < rows; r += kMmaLanes) {
#pragma unroll
            for (int j0 = 0; j0 < chunks; j0 += 4) {
              const int jl = min(j0 + lane / 8, chunks - 1);  // lanes past the last chunk re-read it
              uint32_t v[4];
              ldmatrix_x4_trans(v, raw + (r * cols + 8 * jl + lane % 8) * kMmaLanes);
#pragma unroll
              for (int m = 0; m < 4; ++m)
                if (j0 + m < chunks)
                  *reinterpret_cast<uint32_t*>(s_plane + g * L.plane + r * L.stride + 8 * (j0 + m) + 2 * tq) = v[m];
            }
          }
        }
        __syncthreads();

        const T* const s_ch = s_plane + ch * L.plane;
        // acc[q]: rows g and g + 8, columns 8q + 2tq and 8q + 2tq + 1 of the tile.
        float acc[NG][4];
#pragma unroll
        for (int q = 0; q < NG; ++q) {
          float x00 = 0.f, x01 = 0.f, x10 = 0.f, x11 = 0.f;
          if (add_input) {
            const T* px = s_ch + (g + P) * L.stride + 8 + 8 * q + 2 * tq;
            const uint32_t top = *reinterpret_cast<const uint32_t*>(px);
            const uint32_t bot = *reinterpret_cast<const uint32_t*>(px + 8 * L.stride);
            x00 = low_f32<T>(top), x01 = high_f32<T>(top), x10 = low_f32<T>(bot), x11 = high_f32<T>(bot);
          }
          acc[q][0] = bv + x00, acc[q][1] = bv + x01, acc[q][2] = bv + x10, acc[q][3] = bv + x11;
        }
#pragma unroll
        for (int i = 0; i < K; ++i) {
          const T* const a_row = s_ch + (i + (lane & 15)) * L.stride;
#pragma unroll
          for (int u = 0; u < chunks; ++u) {
            uint32_t a0, a1;
            ldmatrix_x2(a0, a1, a_row + 8 * u);
#pragma unroll
            for (int s = 0; s < 3; ++s) {
              const int q = u - s;
              if (q >= 0 && q < NG) mma_16x8x8<T>(acc[q], a0, a1, bf[i][s]);
            }
          }
        }
        __syncthreads();  // every warp is done with the planes

        // Outputs through shared memory ([pixel][channel], rows of tw + 1 pixels), then one 16-byte vector
        // per pixel.
        T* const s_out = s_plane;
        constexpr int pitch = tw + 1;
#pragma unroll
        for (int q = 0; q < NG; ++q)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = g + 8 * (e / 2), col = 8 * q + 2 * tq + (e % 2);
            const float v = silu_out ? silu_f32(acc[q][e]) : acc[q][e];
            s_out[(r * pitch + col) * kMmaLanes + ch] = from_f32<T>(v);
          }
        __syncthreads();
        if (out_row >= out_step) return;
        const Tile tl = tile_at(t);
        const int w = tl.w0 + out_col;
        if (w >= W) return;
        T* dst = y + tl.img + (int64_t(tl.h0 + out_row) * W + w) * C + c0;
        const int rmax = min(kMmaRows, H - tl.h0);
        for (int r = out_row; r < rmax; r += out_step, dst += out_step * row_elems) {
          const T* src = s_out + (r * pitch + out_col) * kMmaLanes;
          if (vec) {
            *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
          } else {
            for (int k = 0; k < kMmaLanes && c0 + k < C; ++k) dst[k] = src[k];
          }
        }
      });
#endif
}

template <typename T, int K, int NG>
struct MmaKernelTag {};

template <typename T, int K, int NG>
std::string launch_mma_forward(const DwConvForwardParams& p, const DwMmaPlan& q) {
  auto kernel = dwconv_mma_forward_kernel<T, K, NG>;
  allow_smem<MmaKernelTag<T, K, NG>>(kernel, q.smem);
  // As many CTAs as fit at once, spread over the channel blocks; each loops over its share of the tiles.
  const int per_block =
      std::max(1, resident_ctas<MmaKernelTag<T, K, NG>>(kernel, kMmaThreads, q.smem) / q.channel_blocks);
  const dim3 grid(unsigned(std::min<int64_t>(q.tiles, per_block)), unsigned(q.channel_blocks));
  const bool vec = p.C % kMmaLanes == 0;  // the host passes 16-byte aligned tensors
  kernel<<<grid, kMmaThreads, q.smem, p.stream>>>(
      static_cast<const T*>(p.x), p.weight, p.bias, static_cast<T*>(p.y), p.H, p.W, p.C, q.tiles_w, q.bands,
      int(q.tiles), p.flip, p.add_input, p.silu, vec);
  return last_launch_error();
}

template <typename T, int K>
std::string dispatch_groups(const DwConvForwardParams& p, const DwMmaPlan& q) {
  switch (q.groups) {
    case 1: return launch_mma_forward<T, K, 1>(p, q);
    case 2: return launch_mma_forward<T, K, 2>(p, q);
    default: return launch_mma_forward<T, K, 4>(p, q);
  }
}

template <typename T>
std::string dispatch_mma(const DwConvForwardParams& p, const DwMmaPlan& q) {
  switch (p.K) {
    case 3: return dispatch_groups<T, 3>(p, q);
    case 5: return dispatch_groups<T, 5>(p, q);
    case 7: return dispatch_groups<T, 7>(p, q);
    default: return "gspn2: the tensor-core depthwise kernel takes K in {3, 5, 7}, got K = " + std::to_string(p.K);
  }
}

}  // namespace

DwMmaPlan dwconv_mma_plan(int B, int H, int W, int C, int K, int elem_bytes) {
  DwMmaPlan q;
  q.groups = 1;  // 1, 2 or 4 column groups of 8: the fewest that cover W, at most 4
  while (q.groups < kMmaMaxGroups && 8 * q.groups < W) q.groups *= 2;
  q.tiles_w = (W + 8 * q.groups - 1) / (8 * q.groups);
  q.bands = (H + kMmaRows - 1) / kMmaRows;
  q.channel_blocks = (C + kMmaLanes - 1) / kMmaLanes;
  q.tiles = int64_t(B) * q.bands * q.tiles_w;
  q.smem = MmaLayout(q.groups, K).smem_bytes(elem_bytes);
  return q;
}

bool dwconv_mma_supported(ScalarType dtype) {
  if (dtype == ScalarType::Float) return false;
  constexpr int kMaxDevices = 64;
  static std::atomic<int> major[kMaxDevices] = {};  // 0: not asked yet
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 0 || dev >= kMaxDevices) return false;
  int m = major[dev].load(std::memory_order_relaxed);
  if (m == 0) {
    cudaDeviceGetAttribute(&m, cudaDevAttrComputeCapabilityMajor, dev);
    major[dev].store(m, std::memory_order_relaxed);
  }
  return m >= 8;
}

std::string dwconv_mma_forward_launch(const DwConvForwardParams& p) {
  const DwMmaPlan q = dwconv_mma_plan(p.B, p.H, p.W, p.C, p.K, 2);
  if (q.tiles > INT_MAX) {
    return "gspn2: the tensor-core depthwise kernel indexes tiles with 32-bit integers; this input has " +
           std::to_string(q.tiles) + " tiles (batch x row bands x column tiles)";
  }
  switch (p.dtype) {
    case ScalarType::Half: return dispatch_mma<__half>(p, q);
    case ScalarType::BFloat16: return dispatch_mma<__nv_bfloat16>(p, q);
    default: return "gspn2: the tensor-core depthwise kernel takes float16 or bfloat16 inputs";
  }
}

}  // namespace gspn2
