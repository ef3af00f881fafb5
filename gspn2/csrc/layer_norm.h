// LayerNorm over the last (contiguous) dimension of rows, optionally followed by GELU (erf form): the kernels
// of gspn2::layer_norm and gspn2::layer_norm_backward (layer_norm_rows.cu), their launch parameters and limits.
//
// A row of C elements is spread over T = 1..32 lanes of one warp (32 / T rows per warp), each lane holding NV
// vectors of VEC elements (16 or 4 bytes) in registers; the row's sums are warp shuffles over its T lanes,
// the statistics are fp32 and two-pass (mean, then the centred sum of squares). The backward, one wave of
// blocks over a grid-stride loop of rows, keeps each lane's weight and bias gradient columns in registers
// (and, for rows of at most kLayerNormKeep elements per lane, the lane's parameters and the row between its
// two passes), sums them over the block's warps in shared memory and writes one fp32 partial row per block,
// which the host sums (a fixed order: deterministic).
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
  float* partial_w = nullptr;      // backward: (blocks, C) fp32 partial sums of grad_y * xhat, or null
  float* partial_b = nullptr;      // backward: (blocks, C) fp32 partial sums of grad_y, or null
  int64_t N = 0;
  int C = 0;
  float eps = 1e-5f;
  bool gelu = false;               // y = gelu(layer_norm(x))
  ScalarType dtype = ScalarType::Float;
  cudaStream_t stream = nullptr;
};

// The shape of one launch: lanes per row, vectors per lane, the vector width, blocks.
struct LayerNormPlan {
  bool ok = false;      // false: the kernels do not take this (C, dtype, alignment); the host falls back to ATen
  int lanes = 1;        // T, a power of two <= 32
  int vectors = 1;      // NV per lane, in {1, 2, 4, 8}
  int vec_bytes = 16;   // 16 or 4
  int blocks = 0;       // the backward: also the rows of its partial sums
};

constexpr int kLayerNormThreads = 256;
constexpr int kLayerNormMaxVectors = 8;
// Elements per lane up to which the backward keeps a lane's parameters and its part of the row in registers.
constexpr int kLayerNormKeep = 16;

// Resident blocks per SM the backward is built for (its register cap): its weight and bias gradient
// columns take 2 registers per element of a lane.
constexpr int layer_norm_backward_blocks_per_sm(int elements_per_lane) { return elements_per_lane <= 24 ? 2 : 1; }

// `aligned16` / `aligned4`: whether every row pointer the launch reads or writes is 16 (4) byte aligned.
LayerNormPlan layer_norm_plan(int64_t N, int C, int esize, bool aligned16, bool aligned4, bool backward, int nsm);

std::string layer_norm_forward_launch(const LayerNormParams& p, const LayerNormPlan& q);
std::string layer_norm_backward_launch(const LayerNormParams& p, const LayerNormPlan& q);

}  // namespace gspn2
