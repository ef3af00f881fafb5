// Depthwise convolution on channels-last (NHWC) memory: the kernels of dwconv_tile.cu and dwconv_kernel.cu
// and the host code of dwconv.cpp share these plain structs (no torch headers, so the .cu files compile
// without them).
//
//   y[b, h, w, c] = bias[c] + sum_{i, j < K} x[b, h + i - K/2, w + j - K/2, c] * tap[i * K + j][c]
//                   (+ residual[b, h, w, c]) (then SiLU, if asked)
//
// with zero padding ("same" output, stride 1). The taps are float32, laid out (K*K, C) so that a warp
// reads consecutive channels; `flip` reads tap K*K-1-t for tap t, which turns the forward into the input
// gradient (the convolution of grad_y with the flipped kernel). Sums are accumulated in float32.
#pragma once

#include <cstdint>
#include <string>

#include <cuda_runtime.h>

#include "propagate.h"  // ScalarType

namespace gspn2 {

// Kernel sizes with compiled kernels (odd, "same" padding). Others run aten's convolution.
inline bool dwconv_kernel_size_supported(int K) { return K == 3 || K == 5 || K == 7; }

// Output pixels along W per thread, `tile` (4 or 8): a register sliding window over K + tile - 1 input
// columns; and channels per thread, `vec`: 8 (16 bytes of a 16-bit dtype) or 4. Both arrive as op arguments
// (gspn2/ops/options.py: dwconv_tile, dwconv_vec; defaults 4 and 8).

struct DwConvForwardParams {
  const void* x = nullptr;         // (B, H, W, C)
  const float* taps = nullptr;     // (K*K, C), the row kernels (tile 4 or 8)
  const float* weight = nullptr;   // (C, K*K), the shared-memory tile kernels (tile 0)
  const float* bias = nullptr;     // (C,) or null
  const void* residual = nullptr;  // (B, H, W, C) added to the output, or null
  void* y = nullptr;               // (B, H, W, C)
  int B = 0, H = 0, W = 0, C = 0, K = 0;
  bool flip = false;
  bool silu = false;
  int tile = 4;
  int vec = 8;
  ScalarType dtype = ScalarType::Float;
  cudaStream_t stream = nullptr;
};

// Weight and bias gradients: partial sums per chunk of output strips (deterministic: a fixed split that
// depends on the shape only), then one pass that sums the chunks in order.
struct DwConvWgradPlan {
  int vec = 1;                   // channels per thread
  int tile = 4;                  // output pixels per strip
  int block_x = 1, block_y = 1;  // threads: channel vectors x strips
  int channel_tiles = 1;
  int row_groups = 1;            // CTAs along the kernel rows (K / rows per CTA)
  int chunks = 1;
  int64_t strips = 0;            // output strips: one thread's work unit
  int64_t strips_per_chunk = 0;
};

struct DwConvWgradParams {
  const void* grad_y = nullptr;  // (B, H, W, C)
  const void* x = nullptr;       // (B, H, W, C)
  float* partial = nullptr;      // (chunks, K*K + 1, C): taps then bias
  float* out = nullptr;          // (K*K + 1, C) (row kernels); the tile kernels write grad_w and grad_b:
  float* grad_w = nullptr;       // (C, K*K)
  float* grad_b = nullptr;       // (C,)
  // The tile kernels' one-pass backward (tile 1) also writes the input gradient:
  const float* weight = nullptr;  // (C, K*K)
  void* grad_x = nullptr;         // (B, H, W, C), or null: weight and bias gradients only
  bool add_input = false;
  int B = 0, H = 0, W = 0, C = 0, K = 0;
  ScalarType dtype = ScalarType::Float;
  DwConvWgradPlan plan;
  cudaStream_t stream = nullptr;
};

DwConvWgradPlan dwconv_wgrad_plan(int B, int H, int W, int C, int K, ScalarType dtype, int tile, int vec);

// Shared-memory tile kernels (tile 0; tile 1: the same with a one-pass backward): a CTA holds 32 channels
// (one per lane) of a spatial tile of sub_h x sub_w warp tiles, each warp tile kRows x `cols` output pixels
// (cols = vec: 4 or 8), and stages the tile's input with its halo in shared memory in the tensor's dtype.
// The weight gradient's CTAs each sum a chunk of tiles, double-buffered; the chunk count depends on the
// shape, the dtype and the shared-memory budget only (deterministic: kTileSmemBudget is below every
// supported GPU's limit but the smallest).
constexpr int kTileLanes = 32;      // channels per CTA
constexpr int kTileRows = 4;        // output rows per thread
constexpr int kTileMaxWarps = 8;    // warp tiles per CTA
constexpr int kTileWgradCtas = 1024;  // the weight gradient's target CTA count
constexpr int kTileSmemBudget = 96 * 1024;  // bytes per CTA the plan stays within
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

// Both return an empty string, or the CUDA error of the launch. Tile 0 (and 1) go to the tile kernels'
// entry points (dwconv_tile.cu), which take the same structs.
std::string dwconv_forward_launch(const DwConvForwardParams& p);
std::string dwconv_wgrad_launch(const DwConvWgradParams& p);
std::string dwconv_tile_forward_launch(const DwConvForwardParams& p);
std::string dwconv_tile_wgrad_launch(const DwConvWgradParams& p);

}  // namespace gspn2
