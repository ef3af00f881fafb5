// Depthwise convolution on channels-last (NHWC) memory: the shared-memory tile kernels of dwconv_tile.cu and
// the host code of dwconv.cpp share these plain structs (no torch headers, so the .cu file compiles
// without them).
//
//   y[b, h, w, c] = bias[c] + sum_{i, j < K} x[b, h + i - K/2, w + j - K/2, c] * tap[c][i * K + j]
//                   (+ x[b, h, w, c]) (then SiLU, if asked)
//
// with zero padding ("same" output, stride 1). The taps are float32, laid out (C, K*K) as the (C, 1, K, K)
// weight; `flip` reads tap K*K-1-t for tap t, which turns the forward into the input gradient (the
// convolution of grad_y with the flipped kernel, plus grad_y for x + conv(x)). Sums are accumulated in
// float32.
#pragma once

#include <cstdint>
#include <string>

#include <cuda_runtime.h>

#include "propagate.h"  // ScalarType

namespace gspn2 {

// Kernel sizes with compiled kernels (odd, "same" padding). Others run aten's convolution.
inline bool dwconv_kernel_size_supported(int K) { return K == 3 || K == 5 || K == 7; }

struct DwConvForwardParams {
  const void* x = nullptr;        // (B, H, W, C)
  const float* weight = nullptr;  // (C, K*K)
  const float* bias = nullptr;    // (C,) or null
  bool add_input = false;         // y += x (the input gradient: grad_x += grad_y)
  void* y = nullptr;              // (B, H, W, C)
  int B = 0, H = 0, W = 0, C = 0, K = 0;
  bool flip = false;
  bool silu = false;
  int cols = 4;                   // output columns per thread: 4 or 8
  ScalarType dtype = ScalarType::Float;
  cudaStream_t stream = nullptr;
};

// Weight and bias gradients: partial sums per chunk of tiles (deterministic: a fixed split that depends on
// the shape only), then one pass that sums the chunks in order; with `grad_x`, the one-pass backward.
struct DwConvWgradParams {
  const void* grad_y = nullptr;  // (B, H, W, C)
  const void* x = nullptr;       // (B, H, W, C)
  float* partial = nullptr;      // (chunks, K*K + 1, C): taps then bias
  float* grad_w = nullptr;       // (C, K*K)
  float* grad_b = nullptr;       // (C,)
  // The one-pass backward also writes the input gradient:
  const float* weight = nullptr;  // (C, K*K)
  void* grad_x = nullptr;         // (B, H, W, C), or null: weight and bias gradients only
  bool add_input = false;
  int B = 0, H = 0, W = 0, C = 0, K = 0;
  int cols = 4;
  ScalarType dtype = ScalarType::Float;
  cudaStream_t stream = nullptr;
};

// Shared-memory tile kernels (kernel 0; kernel 1: the same with a one-pass backward): a CTA holds 32 channels
// (one per lane) of a spatial tile of sub_h x sub_w warp tiles, each warp tile kRows x `cols` output pixels
// (cols: 4 or 8), and stages the tile's input with its halo in shared memory in the tensor's dtype.
// The weight gradient's CTAs each sum a chunk of tiles, double-buffered; the chunk count depends on the
// shape, the dtype and the shared-memory budget only (deterministic: kTileSmemBudget is below every
// supported GPU's limit but the smallest).
constexpr int kTileLanes = 32;      // channels per CTA
constexpr int kTileRows = 4;        // output rows per thread
constexpr int kTileMaxWarps = 8;    // warp tiles per CTA
constexpr int kTileWgradCtas = 1024;  // the weight gradient's target CTA count
constexpr int kTileSmemBudget = 96 * 1024;  // bytes per CTA the plan stays within
// Dynamic shared memory of every tile kernel: the two staging buffers' mbarriers (kTileBarBytes), the taps
// where the kernel has them (a multiple of 128 bytes), then the buffers, each staged tensor rounded up to 128
// bytes so that every one starts where TMA may write (with 4-row warp tiles and odd K the pixel counts are
// even, so the rounding adds nothing for 16-bit or float32 elements; it keeps the layout valid if that
// changes).
constexpr int kTileBarBytes = 128;
#ifdef __CUDACC__
__host__ __device__
#endif
    constexpr int tile_smem_round(int bytes) {
  return (bytes + 127) / 128 * 128;
}
// The weight gradients' split of `tiles` (per channel block) into chunks of `*tiles_per_chunk` consecutive tiles,
// `*chunks` in all, for about `ctas` CTAs over `channel_blocks` blocks: a split that depends on the shape only,
// which fixes the summation order.
inline void split_tiles(int64_t tiles, int ctas, int channel_blocks, int64_t* tiles_per_chunk, int* chunks) {
  const int64_t target = ctas / channel_blocks > 1 ? ctas / channel_blocks : 1;
  *tiles_per_chunk = tiles > target ? (tiles + target - 1) / target : 1;
  *chunks = int((tiles + *tiles_per_chunk - 1) / *tiles_per_chunk);
}
struct DwTilePlan {
  int rows = kTileRows, cols = 4;  // output pixels per thread
  int sub_h = 1, sub_w = 1;        // warp tiles per CTA
  int tiles_h = 1, tiles_w = 1;    // CTA tiles per image
  int64_t tiles = 0;               // B * tiles_h * tiles_w
  int channel_blocks = 1;
  int chunks = 1;                  // weight gradient: CTAs along the tiles
  int64_t tiles_per_chunk = 1;
  int smem_forward = 0, smem_wgrad = 0, smem_backward = 0;  // bytes
};
// The plan for `elem_bytes`-sized elements within `smem_limit` bytes per CTA (dwconv_tile_smem_limit():
// kTileSmemBudget, or the current GPU's opt-in limit where that is smaller).
DwTilePlan dwconv_tile_plan(int B, int H, int W, int C, int K, int cols, int elem_bytes, int smem_limit);
int dwconv_tile_smem_limit();

// Whether the tile kernels may stage by TMA where they have sm_90 code (the default), or stage by cp.async
// (or element copies) everywhere: the staging of builds without sm_90 code, for the tests on an sm_90 GPU.
// Process-wide, read at each launch.
void dwconv_tile_set_tma(bool enabled);
bool dwconv_tile_tma_enabled();

// Both return an empty string, or the error of the launch.
std::string dwconv_tile_forward_launch(const DwConvForwardParams& p);
std::string dwconv_tile_wgrad_launch(const DwConvWgradParams& p);

// The tensor-core kernels (dwconv_mma.cu, the op's `kernel` 2) for float16 and bfloat16 inputs with C a multiple
// of 8, on GPUs of compute capability 9.0 (`cols` unused). Whether the dtype and C allow them, and the forward's
// (and input gradient's) launch ("" or the error: other dtypes, no sm_90 code, ...).
bool dwconv_mma_available_for(int C, ScalarType dtype);
std::string dwconv_mma_forward_launch(const DwConvForwardParams& p);
// Their weight gradient: CTAs of 16 warps, each summing a chunk of consecutive tiles (16 rows x 8 or 16 columns,
// 32 channels) into partial[chunk][tap][c]; the chunk count depends on the shape only (deterministic). The launch
// sums the chunks into grad_w and grad_b (the tile kernels' reduce pass); p.partial holds plan.chunks chunks.
constexpr int kMmaWgradCtas = 256;  // the weight gradient's target CTA count
struct MmaWgradPlan {
  int tiles_h = 1, tiles_w = 1, channel_blocks = 1, chunks = 1;
  int64_t tiles = 0, tiles_per_chunk = 1;
};
MmaWgradPlan dwconv_mma_wgrad_plan(int B, int H, int W, int C);
std::string dwconv_mma_wgrad_launch(const DwConvWgradParams& p);

}  // namespace gspn2
