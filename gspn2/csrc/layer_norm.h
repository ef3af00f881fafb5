// LayerNorm over the last (contiguous) dimension of rows, optionally followed by GELU (erf form): the kernels
// of gspn2::layer_norm and gspn2::layer_norm_backward (layer_norm_rows.cu), their launch parameters and limits.
//
// A row of C elements is spread over T = 1..32 lanes of one warp (32 / T rows per warp), each lane holding NV
// vectors of VEC elements (16 or 4 bytes) in registers; the row's sums are warp shuffles over its T lanes,
// the statistics are fp32 and two-pass (mean, then the centred sum of squares). The backward keeps each
// lane's weight and bias gradient columns in registers over a grid-stride loop of rows and writes one fp32
// partial row per warp, which the host sums (a fixed order: deterministic).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "propagate.h"  // ScalarType

namespace gspn2 {

struct LayerNormParams {
  const void* x = nullptr;         // (N, C) rows, 16-byte aligned for 16-byte vectors
  const float* weight = nullptr;   // (C,) or null (1)
  const float* bias = nullptr;     // (C,) or null (0)
  void* y = nullptr;               // forward: (N, C) output
  float* mean = nullptr;           // (N,) or null (forward: written when not null; backward: read)
  float* rstd = nullptr;           // (N,) or null
  const void* grad_y = nullptr;    // backward: (N, C)
  void* grad_x = nullptr;          // backward: (N, C) or null
  float* partial_w = nullptr;      // backward: (warps, C) fp32 partial sums of grad_y * xhat, or null
  float* partial_b = nullptr;      // backward: (warps, C) fp32 partial sums of grad_y, or null
  int64_t N = 0;
  int C = 0;
  float eps = 1e-5f;
  bool gelu = false;               // y = gelu(layer_norm(x))
  ScalarType dtype = ScalarType::Float;
  cudaStream_t stream = nullptr;
};

// The shape of one launch: lanes per row, vectors per lane, the vector width, blocks and warps.
struct LayerNormPlan {
  bool ok = false;      // false: the kernels do not take this (C, dtype, alignment); the host falls back to ATen
  int lanes = 1;        // T, a power of two <= 32
  int vectors = 1;      // NV per lane, in {1, 2, 4, 8}
  int vec_bytes = 16;   // 16 or 4
  int blocks = 0;
  int warps = 0;        // blocks * warps per block: the rows of the backward's partial sums
};

constexpr int kLayerNormThreads = 256;
constexpr int kLayerNormMaxVectors = 8;

// `aligned16` / `aligned4`: whether every row pointer the launch reads or writes is 16 (4) byte aligned.
LayerNormPlan layer_norm_plan(int64_t N, int C, int esize, bool aligned16, bool aligned4, bool backward, int nsm);

std::string layer_norm_forward_launch(const LayerNormParams& p, const LayerNormPlan& q);
std::string layer_norm_backward_launch(const LayerNormParams& p, const LayerNormPlan& q);

}  // namespace gspn2
