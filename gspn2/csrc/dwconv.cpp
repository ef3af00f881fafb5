// Host side of the depthwise convolution kernels (dwconv_tile.cu): checks, layouts, allocation, and the
// registration of the CUDA implementations of gspn2::depthwise_conv2d and gspn2::depthwise_conv2d_backward
// (schemas: gspn2/ops/dwconv.py) with their autograd formula for CUDA tensors. The backward's form and the
// columns per thread arrive as op arguments (`kernel`, `cols`).
#include <torch/extension.h>
#include <torch/library.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <optional>
#include <tuple>
#include <string>
#include <vector>

#include "calls.h"
#include "dwconv.h"
#include "message.h"

namespace gspn2 {
namespace {

ScalarType dw_scalar_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ScalarType::Float;
    case at::kHalf: return ScalarType::Half;
    case at::kBFloat16: return ScalarType::BFloat16;
    default:
      C10_THROW_ERROR(TypeError, gspn2::message("gspn2: `x` must be float32, float16 or bfloat16 for the depthwise "
                                                "convolution kernel, got ", t));
  }
  return ScalarType::Float;
}

// Channels-last contiguous and 16-byte aligned (the kernels' wide accesses).
at::Tensor nhwc(const at::Tensor& t) {
  at::Tensor c = t.contiguous(at::MemoryFormat::ChannelsLast);
  if (reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 != 0) c = c.clone(at::MemoryFormat::ChannelsLast);
  return c;
}

// `kernel`: 0, the input-gradient and weight-gradient kernels, 1, the one-pass backward, or 2, the tensor-core
// kernels (forward, input gradient, weight gradient); `cols`: output columns per thread of the tile kernels
// (dwconv.h; unused by kernel 2).
void check_variant(int64_t kernel, int64_t cols) {
  GSPN2_CHECK(kernel >= 0 && kernel <= 2, "`kernel` must be 0, 1 or 2, got ", kernel);
  GSPN2_CHECK(cols == 4 || cols == 8, "`cols` must be 4 or 8, got ", cols);
}

// The tensor-core kernels' inputs (`kernel` 2): 16-bit, C a multiple of 8.
void check_mma_input(const at::Tensor& x, int64_t kernel, const char* xname) {
  if (kernel != 2) return;
  GSPN2_CHECK_TYPE(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16,
              "`kernel` 2 (the depthwise tensor-core kernels) takes float16 or bfloat16 `", xname, "`, got ",
              x.scalar_type());
  GSPN2_CHECK(x.size(1) % 8 == 0, "`kernel` 2 (the depthwise tensor-core kernels) takes C a multiple of 8, got C = ",
              x.size(1));
}

void check_common(const at::Tensor& x, const at::Tensor& weight, const char* xname) {
  GSPN2_CHECK(x.layout() == at::kStrided && weight.layout() == at::kStrided && !x.is_nested(),
                 "`", xname, "` and `weight` must be dense (strided) tensors");
  GSPN2_CHECK(x.is_cuda(), "`", xname, "` must be a CUDA tensor, got ", x.device());
  GSPN2_CHECK(x.dim() == 4, "`", xname, "` must be (B, C, H, W), got ", x.sizes());
  GSPN2_CHECK(x.size(0) >= 1 && x.size(1) >= 1 && x.size(2) >= 1 && x.size(3) >= 1, "`", xname,
                 "` must have no empty dimension, got ", x.sizes());
  const int64_t C = x.size(1);
  GSPN2_CHECK(weight.dim() == 4 && weight.size(0) == C && weight.size(1) == 1 && weight.size(2) == weight.size(3),
                 "`weight` must be (C, 1, K, K) with C = ", C, ", got ", weight.sizes());
  GSPN2_CHECK(dwconv_kernel_size_supported(int(weight.size(2))),
                 "`weight`: the depthwise convolution kernel takes K in {3, 5, 7}, got K = ", weight.size(2));
  GSPN2_CHECK(weight.is_floating_point(), "`weight` must be a floating-point tensor, got ", weight.scalar_type());
  GSPN2_CHECK(weight.device() == x.device(), "`weight` must be on ", x.device(), " like `", xname, "`, got ",
                 weight.device());
  GSPN2_CHECK(x.numel() < (int64_t(1) << 31) * 16, "`", xname, "` is too large: ", x.sizes());
}

// The float32 (C, K*K) taps of a (C, 1, K, K) weight: the weight itself where it is float32 and contiguous
// (the same memory), else a converted copy.
at::Tensor weight_rows(const at::Tensor& weight) {
  if (weight.scalar_type() == at::kFloat && weight.is_contiguous()) return weight;
  return weight.detach().reshape({weight.size(0), -1}).to(at::kFloat).contiguous();
}

// A float32 contiguous bias: the bias itself where it is one, else a converted copy.
at::Tensor bias_f32(const at::Tensor& bias) {
  if (bias.scalar_type() == at::kFloat && bias.is_contiguous()) return bias;
  return bias.detach().to(at::kFloat).contiguous();
}

// The forward kernel on x (channels-last, 16-byte aligned) into y of its shape: y = conv(x) with the float32
// (C, K*K) taps `w` (`flip`: the input gradient's flipped taps), plus `bias` (float32, or null), plus x if
// `add_input`, then SiLU if `silu`; the tensor-core kernel for `kernel` 2, else the tile kernel.
void launch_forward(const at::Tensor& x, const at::Tensor& w, int K, const float* bias, bool add_input, bool silu,
                    bool flip, at::Tensor& y, int64_t kernel, int64_t cols) {
  DwConvForwardParams p;
  p.x = x.data_ptr();
  p.weight = w.data_ptr<float>();
  p.bias = bias;
  p.add_input = add_input;
  p.y = y.data_ptr();
  p.B = int(x.size(0));
  p.C = int(x.size(1));
  p.H = int(x.size(2));
  p.W = int(x.size(3));
  p.K = K;
  p.flip = flip;
  p.silu = silu;
  p.dtype = dw_scalar_type(x.scalar_type());
  p.cols = int(cols);
  p.stream = c10::cuda::getCurrentCUDAStream();
  const std::string err = kernel == 2 ? dwconv_mma_forward_launch(p) : dwconv_tile_forward_launch(p);
  GSPN2_CHECK(err.empty(), err);
}

at::Tensor dwconv_forward(const at::Tensor& x_, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                          bool add_input, bool silu, int64_t kernel, int64_t cols) {
  check_variant(kernel, cols);  // kernels 0 and 1 share the forward
  check_common(x_, weight, "x");
  check_mma_input(x_, kernel, "x");
  const int64_t C = x_.size(1);
  if (bias.has_value()) {
    GSPN2_CHECK(bias->layout() == at::kStrided, "`bias` must be a dense (strided) tensor");
    GSPN2_CHECK(bias->is_floating_point(), "`bias` must be a floating-point tensor, got ", bias->scalar_type());
    GSPN2_CHECK(bias->dim() == 1 && bias->size(0) == C, "`bias` must be (C,) with C = ", C, ", got ",
                   bias->sizes());
    GSPN2_CHECK(bias->device() == x_.device(), "`bias` must be on ", x_.device(), ", got ", bias->device());
  }
  const c10::cuda::CUDAGuard guard(x_.device());
  const at::Tensor x = nhwc(x_);
  const at::Tensor w = weight_rows(weight);
  at::Tensor b32;
  if (bias.has_value()) b32 = bias_f32(*bias);
  at::Tensor y = at::empty_like(x, x.options(), at::MemoryFormat::ChannelsLast);
  launch_forward(x, w, int(weight.size(2)), bias.has_value() ? b32.data_ptr<float>() : nullptr, add_input, silu, false,
                 y, kernel, cols);
  // The op promises x's strides (its fake implementation is empty_like(x)).
  if (!x_.is_contiguous(at::MemoryFormat::ChannelsLast)) return at::empty_like(x_).copy_(y);
  return y;
}

// The weight and bias gradients (float32 (C, 1, K, K) and (C,)) of gy and x (channels-last, 16-byte aligned):
// by the tensor-core kernels (`kernel` 2), else by the tile kernels, which with `grad_x` (allocated channels-last
// like gy) also write the input gradient in the same pass (the one-pass backward).
void weight_grads(const at::Tensor& gy, const at::Tensor& x, const at::Tensor& weight, int kernel, int cols,
                  at::Tensor* grad_x, bool add_input, at::Tensor& grad_w, at::Tensor& grad_b) {
  const int B = int(x.size(0)), C = int(x.size(1)), H = int(x.size(2)), W = int(x.size(3));
  const int K = int(weight.size(2));
  const auto f32 = x.options().dtype(at::kFloat);
  const int chunks = kernel == 2 ? dwconv_mma_wgrad_plan(B, H, W, C).chunks
                                 : dwconv_tile_plan(B, H, W, C, K, cols, int(x.element_size()),
                                                    dwconv_tile_smem_limit()).chunks;
  const at::Tensor partial = at::empty({chunks, K * K + 1, C}, f32);
  const at::Tensor w = grad_x != nullptr ? weight_rows(weight) : at::Tensor();
  grad_w = at::empty({C, 1, K, K}, f32);
  grad_b = at::empty({C}, f32);
  DwConvWgradParams p;
  p.cols = cols;
  p.grad_y = gy.data_ptr();
  p.x = x.data_ptr();
  if (grad_x != nullptr) {
    p.weight = w.data_ptr<float>();
    p.grad_x = grad_x->data_ptr();
    p.add_input = add_input;
  }
  p.partial = partial.data_ptr<float>();
  p.grad_w = grad_w.data_ptr<float>();
  p.grad_b = grad_b.data_ptr<float>();
  p.B = B, p.C = C, p.H = H, p.W = W, p.K = K;
  p.dtype = dw_scalar_type(x.scalar_type());
  p.stream = c10::cuda::getCurrentCUDAStream();
  const std::string err = kernel == 2 ? dwconv_mma_wgrad_launch(p) : dwconv_tile_wgrad_launch(p);
  GSPN2_CHECK(err.empty(), err);
}

// grad_x (x's dtype, channels_last), grad_weight (C, 1, K, K) and grad_bias (C,) in float32: the one-pass
// backward (`kernel` 1), or the forward kernel on grad_y with the flipped taps and the weight-gradient kernel (the
// tile kernels, or with `kernel` 2 the tensor-core ones).
std::vector<at::Tensor> dwconv_backward_raw(const at::Tensor& grad_y_, const at::Tensor& x_, const at::Tensor& weight,
                                            bool add_input, int kernel, int cols) {
  check_common(x_, weight, "x");
  check_common(grad_y_, weight, "grad_y");
  GSPN2_CHECK(grad_y_.sizes() == x_.sizes(), "`grad_y` must have x's shape ", x_.sizes(), ", got ",
                 grad_y_.sizes());
  GSPN2_CHECK(grad_y_.scalar_type() == x_.scalar_type(), "`grad_y` must have x's dtype ", x_.scalar_type(),
                 ", got ", grad_y_.scalar_type());
  GSPN2_CHECK(grad_y_.device() == x_.device(), "`grad_y` must be on ", x_.device(), ", got ", grad_y_.device());
  check_mma_input(grad_y_, kernel, "grad_y");
  const c10::cuda::CUDAGuard guard(x_.device());
  const at::Tensor gy = nhwc(grad_y_);
  at::Tensor grad_x = at::empty_like(gy, gy.options(), at::MemoryFormat::ChannelsLast), grad_w, grad_b;
  const at::Tensor x = nhwc(x_);
  if (kernel == 1) {
    weight_grads(gy, x, weight, kernel, cols, &grad_x, add_input, grad_w, grad_b);
    return {grad_x, grad_w, grad_b};
  }
  launch_forward(gy, weight_rows(weight), int(weight.size(2)), nullptr, add_input, false, true, grad_x, kernel, cols);
  weight_grads(gy, x, weight, kernel, cols, nullptr, false, grad_w, grad_b);
  return {grad_x, grad_w, grad_b};
}

// The CUDA implementation of gspn2::depthwise_conv2d_backward: grad_x with x's strides, grad_weight and
// grad_bias in the weight's dtype (grad_bias zeros without a bias).
std::tuple<at::Tensor, at::Tensor, at::Tensor> dwconv_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                                               const at::Tensor& weight, bool has_bias, bool add_input,
                                                               int64_t kernel, int64_t cols) {
  check_variant(kernel, cols);
  std::vector<at::Tensor> g = dwconv_backward_raw(grad_y, x, weight, add_input, int(kernel), int(cols));
  at::Tensor grad_x = g[0];
  if (!x.is_contiguous(at::MemoryFormat::ChannelsLast)) grad_x = at::empty_like(x).copy_(grad_x);
  at::Tensor grad_b = has_bias ? g[2].to(weight.scalar_type()) : at::zeros({weight.size(0)}, weight.options());
  return {grad_x, g[1].to(weight.scalar_type()).contiguous(), grad_b};
}

using ForwardOp = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, bool, bool,
                              int64_t, int64_t);
using BackwardOp = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                  const at::Tensor&, bool, bool, int64_t, int64_t);

const c10::TypedOperatorHandle<ForwardOp>& forward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("gspn2::depthwise_conv2d", "").typed<ForwardOp>();
  return op;
}

// The op's flags, packed into one saved integer (bits: has_bias, add_input, silu, kernel (two bits); cols above
// them).
int64_t pack_flags(bool has_bias, bool add_input, bool silu, int64_t kernel, int64_t cols) {
  return int64_t(has_bias) | int64_t(add_input) << 1 | int64_t(silu) << 2 | (kernel & 3) << 3 | cols << 5;
}

// Autograd for CUDA tensors (CPU keeps the Python formula of gspn2/ops/dwconv.py).
class DwConvFunction : public torch::autograd::Function<DwConvFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, bool add_input, bool silu, int64_t kernel,
                            int64_t cols) {
    at::Tensor y;
    {
      at::AutoDispatchBelowADInplaceOrView below;
      y = forward_op().call(x, weight, bias, add_input, silu, kernel, cols);
    }
    ctx->save_for_backward({x, weight});
    ctx->saved_data["flags"] = pack_flags(bias.has_value() && bias->defined(), add_input, silu, kernel, cols);
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const int64_t flags = ctx->saved_data["flags"].toInt();
    const bool has_bias = flags & 1, add_input = flags & 2, silu = flags & 4;
    GSPN2_CHECK(!silu,
                "gspn2::depthwise_conv2d with `silu`=True has no backward; depthwise_conv2d(..., silu=True) applies "
                "SiLU separately whenever autograd records");
    static const auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("gspn2::depthwise_conv2d_backward", "").typed<BackwardOp>();
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor grad_y = grads[0].contiguous(x.is_contiguous(at::MemoryFormat::ChannelsLast)
                                                      ? at::MemoryFormat::ChannelsLast
                                                      : at::MemoryFormat::Contiguous);
    auto [grad_x, grad_w, grad_b] = op.call(grad_y, x, saved[1], has_bias, add_input, (flags >> 3) & 3, flags >> 5);
    return {grad_x, grad_w, has_bias ? grad_b : at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Records the autograd node only where it is wanted (calls.h); otherwise calls the kernel directly, as aten's
// own ops do (no node, no saved tensors).
at::Tensor dwconv_autograd(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           bool add_input, bool silu, int64_t kernel, int64_t cols) {
  if (!wants_autograd({&x, &weight, bias.has_value() ? &*bias : nullptr})) {
    at::AutoDispatchBelowADInplaceOrView below;
    return forward_op().call(x, weight, bias, add_input, silu, kernel, cols);
  }
  return DwConvFunction::apply(x, weight, bias, add_input, silu, kernel, cols);
}

}  // namespace

at::Tensor depthwise_conv2d_call(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                 bool add_input, bool silu, int64_t kernel, int64_t cols) {
  return forward_op().call(x, weight, bias, add_input, silu, kernel, cols);
}

}  // namespace gspn2

TORCH_LIBRARY_IMPL(gspn2, CUDA, m) {
  m.impl("depthwise_conv2d", &gspn2::dwconv_forward);
  m.impl("depthwise_conv2d_backward", &gspn2::dwconv_backward);
}

TORCH_LIBRARY_IMPL(gspn2, AutogradCUDA, m) { m.impl("depthwise_conv2d", &gspn2::dwconv_autograd); }
