// Host side of the depthwise convolution kernels (dwconv_kernel.cu): checks, layouts, allocation. Bound in
// propagate.cpp's module as dwconv_forward / dwconv_backward; gspn2/layers/dwconv.py registers them as
// the CUDA kernels of gspn2::depthwise_conv2d and its backward.
#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "dwconv.h"
#include "message.h"

#define GSPN2_DW_CHECK(cond, ...)                                                     \
  do {                                                                                \
    if (!(cond)) throw std::invalid_argument(gspn2::message("gspn2: ", __VA_ARGS__)); \
  } while (0)

namespace gspn2 {
namespace {

ScalarType dw_scalar_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ScalarType::Float;
    case at::kHalf: return ScalarType::Half;
    case at::kBFloat16: return ScalarType::BFloat16;
    default: GSPN2_DW_CHECK(false, "the depthwise convolution kernel supports float32, float16 and bfloat16, got ", t);
  }
  return ScalarType::Float;
}

// Channels-last contiguous and 16-byte aligned (the kernels' wide accesses).
at::Tensor nhwc(const at::Tensor& t) {
  at::Tensor c = t.contiguous(at::MemoryFormat::ChannelsLast);
  if (reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 != 0) c = c.clone(at::MemoryFormat::ChannelsLast);
  return c;
}

// Output pixels per thread and channels per thread of the 16-bit kernels (dwconv.h). GSPN2_DWCONV_TILE
// (4 or 8) and GSPN2_DWCONV_VEC (4 or 8) override the defaults, for benchmarks.
int env_choice(const char* name, int fallback) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return fallback;
  const std::string v(env);
  GSPN2_DW_CHECK(v == "4" || v == "8", name, " must be 4 or 8, got '", v, "'");
  return std::atoi(env);
}

int tile_choice() { return env_choice("GSPN2_DWCONV_TILE", 4); }
int vec_choice() { return env_choice("GSPN2_DWCONV_VEC", 8); }

void check_common(const at::Tensor& x, const at::Tensor& weight, const char* xname) {
  GSPN2_DW_CHECK(x.is_cuda(), "`", xname, "` must be a CUDA tensor, got ", x.device());
  GSPN2_DW_CHECK(x.dim() == 4, "`", xname, "` must be (B, C, H, W), got ", x.sizes());
  const int64_t C = x.size(1);
  GSPN2_DW_CHECK(weight.dim() == 4 && weight.size(0) == C && weight.size(1) == 1 && weight.size(2) == weight.size(3),
                 "`weight` must be (C, 1, K, K) with C = ", C, ", got ", weight.sizes());
  GSPN2_DW_CHECK(dwconv_kernel_size_supported(int(weight.size(2))),
                 "the depthwise convolution kernel takes K in {3, 5, 7}, got K = ", weight.size(2));
  GSPN2_DW_CHECK(weight.device() == x.device(), "`weight` must be on ", x.device(), " like `", xname, "`, got ",
                 weight.device());
  GSPN2_DW_CHECK(x.numel() < (int64_t(1) << 31) * 16, "`", xname, "` is too large: ", x.sizes());
}

// (C, 1, K, K) -> (K*K, C) float32, taps row-major.
at::Tensor taps_of(const at::Tensor& weight) {
  return weight.detach().reshape({weight.size(0), -1}).t().to(at::kFloat).contiguous();
}

}  // namespace

at::Tensor dwconv_forward(const at::Tensor& x_, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                          bool add_input, bool silu) {
  check_common(x_, weight, "x");
  const int64_t C = x_.size(1);
  if (bias.has_value()) {
    GSPN2_DW_CHECK(bias->dim() == 1 && bias->size(0) == C, "`bias` must be (C,) with C = ", C, ", got ",
                   bias->sizes());
    GSPN2_DW_CHECK(bias->device() == x_.device(), "`bias` must be on ", x_.device(), ", got ", bias->device());
  }
  const c10::cuda::CUDAGuard guard(x_.device());
  const at::Tensor x = nhwc(x_);
  const at::Tensor taps = taps_of(weight);
  at::Tensor b32;
  if (bias.has_value()) b32 = bias->detach().to(at::kFloat).contiguous();
  at::Tensor y = at::empty_like(x, x.options(), at::MemoryFormat::ChannelsLast);
  DwConvForwardParams p;
  p.x = x.data_ptr();
  p.taps = taps.data_ptr<float>();
  p.bias = bias.has_value() ? b32.data_ptr<float>() : nullptr;
  p.residual = add_input ? x.data_ptr() : nullptr;
  p.y = y.data_ptr();
  p.B = int(x.size(0));
  p.C = int(C);
  p.H = int(x.size(2));
  p.W = int(x.size(3));
  p.K = int(weight.size(2));
  p.silu = silu;
  p.dtype = dw_scalar_type(x.scalar_type());
  p.tile = tile_choice();
  p.vec = vec_choice();
  p.stream = c10::cuda::getCurrentCUDAStream();
  const std::string err = dwconv_forward_launch(p);
  GSPN2_DW_CHECK(err.empty(), err);
  return y;
}

// [grad_x (x's dtype, channels_last; undefined unless need_input), grad_weight (C, 1, K, K) and grad_bias (C,)
// in float32 (undefined unless need_weight)].
std::vector<at::Tensor> dwconv_backward(const at::Tensor& grad_y_, const at::Tensor& x_, const at::Tensor& weight,
                                        bool add_input, bool need_input, bool need_weight) {
  check_common(x_, weight, "x");
  check_common(grad_y_, weight, "grad_y");
  GSPN2_DW_CHECK(grad_y_.sizes() == x_.sizes(), "`grad_y` must have x's shape ", x_.sizes(), ", got ",
                 grad_y_.sizes());
  GSPN2_DW_CHECK(grad_y_.scalar_type() == x_.scalar_type(), "`grad_y` must have x's dtype ", x_.scalar_type(),
                 ", got ", grad_y_.scalar_type());
  GSPN2_DW_CHECK(grad_y_.device() == x_.device(), "`grad_y` must be on ", x_.device(), ", got ", grad_y_.device());
  const c10::cuda::CUDAGuard guard(x_.device());
  const at::Tensor gy = nhwc(grad_y_);
  const int B = int(x_.size(0)), C = int(x_.size(1)), H = int(x_.size(2)), W = int(x_.size(3));
  const int K = int(weight.size(2));
  const ScalarType dtype = dw_scalar_type(x_.scalar_type());
  const int tile = tile_choice();
  const int vec = vec_choice();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor grad_x, grad_w, grad_b;
  if (need_input) {
    const at::Tensor taps = taps_of(weight);
    grad_x = at::empty_like(gy, gy.options(), at::MemoryFormat::ChannelsLast);
    DwConvForwardParams p;
    p.x = gy.data_ptr();
    p.taps = taps.data_ptr<float>();
    p.residual = add_input ? gy.data_ptr() : nullptr;
    p.y = grad_x.data_ptr();
    p.B = B, p.C = C, p.H = H, p.W = W, p.K = K;
    p.flip = true;
    p.dtype = dtype;
    p.tile = tile;
    p.vec = vec;
    p.stream = stream;
    const std::string err = dwconv_forward_launch(p);
    GSPN2_DW_CHECK(err.empty(), err);
  }
  if (need_weight) {
    const at::Tensor x = nhwc(x_);
    const auto f32 = x.options().dtype(at::kFloat);
    at::Tensor out = at::empty({K * K + 1, C}, f32);
    if (x.numel() == 0) {
      out.zero_();
    } else {
      DwConvWgradParams p;
      p.plan = dwconv_wgrad_plan(B, H, W, C, K, dtype, tile, vec);
      at::Tensor partial = at::empty({p.plan.chunks, K * K + 1, C}, f32);
      p.grad_y = gy.data_ptr();
      p.x = x.data_ptr();
      p.partial = partial.data_ptr<float>();
      p.out = out.data_ptr<float>();
      p.B = B, p.C = C, p.H = H, p.W = W, p.K = K;
      p.dtype = dtype;
      p.stream = stream;
      const std::string err = dwconv_wgrad_launch(p);
      GSPN2_DW_CHECK(err.empty(), err);
    }
    grad_w = out.narrow(0, 0, K * K).t().reshape({C, 1, K, K});
    grad_b = out.select(0, K * K);
  }
  return {grad_x, grad_w, grad_b};
}

}  // namespace gspn2
