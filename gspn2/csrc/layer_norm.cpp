// Host side of the LayerNorm kernels (layer_norm_rows.cu): checks, allocation, and the CUDA implementations of
// gspn2::layer_norm and gspn2::layer_norm_backward (schemas: gspn2/ops/layernorm.py) with their autograd
// formula for CUDA tensors. The training GEMM chains (rows.cpp) call the same functions.
#include <torch/extension.h>
#include <torch/library.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "calls.h"
#include "layer_norm.h"
#include "message.h"

namespace gspn2 {
namespace {

using at::Tensor;

int sm_count() {
  static const int n = [] {
    int dev = 0, count = 132;
    if (cudaGetDevice(&dev) == cudaSuccess) cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, dev);
    cudaGetLastError();
    return count;
  }();
  return n;
}

ScalarType kernel_type(at::ScalarType t) {
  return t == at::kFloat ? ScalarType::Float : t == at::kHalf ? ScalarType::Half : ScalarType::BFloat16;
}

void check_param(const std::optional<Tensor>& t, const char* name, const Tensor& x) {
  if (!t.has_value()) return;
  const int64_t C = x.size(-1);
  GSPN2_CHECK(t->layout() == at::kStrided, "layer_norm: `", name, "` must be a dense (strided) tensor");
  GSPN2_CHECK(t->is_floating_point(), "layer_norm: `", name, "` must be a floating-point tensor, got ",
              t->scalar_type());
  GSPN2_CHECK(t->dim() == 1 && t->size(0) == C, "layer_norm: `", name, "` must be (C,) with C = ", C,
              " (x's last dimension), got ", t->sizes());
  GSPN2_CHECK(t->device() == x.device(), "layer_norm: `", name, "` must be on ", x.device(), " like `x`, got ",
              t->device());
}

void check_x(const Tensor& x, const char* name) {
  GSPN2_CHECK(x.layout() == at::kStrided && !x.is_nested(), "layer_norm: `", name, "` must be a dense (strided) tensor");
  GSPN2_CHECK(x.is_cuda(), "layer_norm: `", name, "` must be a CUDA tensor, got ", x.device());
  GSPN2_CHECK(x.dim() >= 1 && x.size(-1) >= 1, "layer_norm: `", name, "` must have a non-empty last dimension, got ",
              x.sizes());
  GSPN2_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16,
                   "layer_norm: `", name, "` must be float32, float16 or bfloat16 for the CUDA kernel, got ",
                   x.scalar_type());
}

// A contiguous, 16-byte aligned copy of t where it is not one already.
Tensor rows_of(const Tensor& t) {
  Tensor c = t.contiguous();
  if (reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 != 0) c = c.clone();
  return c;
}

// The float32 contiguous, 16-byte aligned parameter (itself where it is one), or an undefined tensor.
Tensor param_f32(const std::optional<Tensor>& t) {
  if (!t.has_value()) return Tensor();
  if (t->scalar_type() == at::kFloat && t->is_contiguous() && reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0) {
    return *t;
  }
  return t->detach().to(at::kFloat).clone(at::MemoryFormat::Contiguous);
}

LayerNormPlan plan_for(const Tensor& x, bool backward) {
  const int64_t C = x.size(-1);
  const int64_t N = C > 0 ? x.numel() / C : 0;
  return layer_norm_plan(N, int(C), int(x.element_size()), true, true, backward, sm_count());
}

void check_plan(const LayerNormPlan& q, const Tensor& x) {
  GSPN2_CHECK(q.ok, "layer_norm: the CUDA kernel takes rows of C * element size a multiple of 4 bytes and C <= ",
              layer_norm_max_channels(x.scalar_type()), " (", x.scalar_type(), "; a quarter of that where C * element "
              "size is not a multiple of 16 bytes), got C = ", x.size(-1));
}

std::vector<int64_t> stat_shape(const Tensor& x) {
  std::vector<int64_t> s(x.sizes().begin(), x.sizes().end() - 1);
  return s;
}

}  // namespace

int64_t layer_norm_max_channels(at::ScalarType t) {
  const int64_t vec = t == at::kFloat ? 4 : 8;  // 16-byte vectors
  return int64_t(32) * kLayerNormMaxVectors * vec;
}

bool layer_norm_kernel_supported(const Tensor& x) {
  if (!x.defined() || !x.is_cuda() || x.dim() < 1 || x.size(-1) < 1 || x.numel() == 0) return false;
  const at::ScalarType t = x.scalar_type();
  if (t != at::kFloat && t != at::kHalf && t != at::kBFloat16) return false;
  return plan_for(x, false).ok && plan_for(x, true).ok;
}

std::tuple<Tensor, Tensor, Tensor> layer_norm_forward(const Tensor& x_, const std::optional<Tensor>& weight,
                                                      const std::optional<Tensor>& bias, double eps, bool gelu) {
  check_x(x_, "x");
  check_param(weight, "weight", x_);
  check_param(bias, "bias", x_);
  GSPN2_CHECK(eps >= 0, "layer_norm: `eps` must be >= 0, got ", eps);
  const c10::cuda::CUDAGuard guard(x_.device());
  const Tensor x = rows_of(x_);
  const LayerNormPlan q = plan_for(x, false);
  check_plan(q, x);
  const Tensor w = param_f32(weight), b = param_f32(bias);
  Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  const auto f32 = x.options().dtype(at::kFloat);
  Tensor mean = at::empty(stat_shape(x), f32), rstd = at::empty(stat_shape(x), f32);
  LayerNormParams p;
  p.x = x.data_ptr();
  p.weight = w.defined() ? w.data_ptr<float>() : nullptr;
  p.bias = b.defined() ? b.data_ptr<float>() : nullptr;
  p.y = y.data_ptr();
  p.mean = mean.data_ptr<float>();
  p.rstd = rstd.data_ptr<float>();
  p.N = x.numel() / x.size(-1);
  p.C = int(x.size(-1));
  p.eps = float(eps);
  p.gelu = gelu;
  p.dtype = kernel_type(x.scalar_type());
  p.stream = c10::cuda::getCurrentCUDAStream();
  const std::string err = layer_norm_forward_launch(p, q);
  GSPN2_CHECK(err.empty(), err);
  return {y, mean, rstd};
}

std::tuple<Tensor, Tensor, Tensor> layer_norm_backward(const Tensor& grad_y_, const Tensor& x_, const Tensor& mean_,
                                                       const Tensor& rstd_, const std::optional<Tensor>& weight,
                                                       const std::optional<Tensor>& bias, bool gelu,
                                                       std::array<bool, 3> mask) {
  check_x(x_, "x");
  check_x(grad_y_, "grad_y");
  GSPN2_CHECK(grad_y_.sizes() == x_.sizes() && grad_y_.scalar_type() == x_.scalar_type() &&
                  grad_y_.device() == x_.device(),
              "layer_norm: `grad_y` must match `x` in shape, dtype and device (", x_.sizes(), ", ", x_.scalar_type(),
              ", ", x_.device(), "), got ", grad_y_.sizes(), ", ", grad_y_.scalar_type(), ", ", grad_y_.device());
  check_param(weight, "weight", x_);
  check_param(bias, "bias", x_);
  const int64_t N = x_.numel() / x_.size(-1);
  for (const auto& [t, name] : {std::pair<const Tensor&, const char*>{mean_, "mean"}, {rstd_, "rstd"}}) {
    GSPN2_CHECK(t.scalar_type() == at::kFloat && t.numel() == N && t.device() == x_.device(), "layer_norm: `", name,
                "` must be float32 with one value per row of x (", N, ") on ", x_.device(), ", got ", t.scalar_type(),
                " ", t.sizes(), " on ", t.device());
  }
  const c10::cuda::CUDAGuard guard(x_.device());
  const Tensor x = rows_of(x_), gy = rows_of(grad_y_);
  const Tensor mean = mean_.contiguous(), rstd = rstd_.contiguous();
  const LayerNormPlan q = plan_for(x, true);
  check_plan(q, x);
  const Tensor w = param_f32(weight), b = param_f32(bias);
  const bool want_w = mask[1] && weight.has_value(), want_b = mask[2] && bias.has_value();
  const int64_t C = x.size(-1);
  const auto f32 = x.options().dtype(at::kFloat);
  Tensor grad_x = mask[0] ? at::empty_like(x, at::MemoryFormat::Contiguous) : Tensor();
  Tensor part_w = want_w ? at::empty({q.blocks, C}, f32) : Tensor();
  Tensor part_b = want_b ? at::empty({q.blocks, C}, f32) : Tensor();
  LayerNormParams p;
  p.x = x.data_ptr();
  p.weight = w.defined() ? w.data_ptr<float>() : nullptr;
  p.bias = b.defined() ? b.data_ptr<float>() : nullptr;
  p.mean = mean.data_ptr<float>();
  p.rstd = rstd.data_ptr<float>();
  p.grad_y = gy.data_ptr();
  p.grad_x = mask[0] ? grad_x.data_ptr() : nullptr;
  p.partial_w = want_w ? part_w.data_ptr<float>() : nullptr;
  p.partial_b = want_b ? part_b.data_ptr<float>() : nullptr;
  p.N = N;
  p.C = int(C);
  p.gelu = gelu;
  p.dtype = kernel_type(x.scalar_type());
  p.stream = c10::cuda::getCurrentCUDAStream();
  if (mask[0] || want_w || want_b) {
    const std::string err = layer_norm_backward_launch(p, q);
    GSPN2_CHECK(err.empty(), err);
  }
  // The partial rows summed in a fixed order (deterministic), in the parameters' dtypes.
  Tensor grad_w = want_w ? part_w.sum(0).to(weight->scalar_type()) : Tensor();
  Tensor grad_b = want_b ? part_b.sum(0).to(bias->scalar_type()) : Tensor();
  return {grad_x, grad_w, grad_b};
}

namespace {

using ForwardOp = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const std::optional<Tensor>&,
                                                     const std::optional<Tensor>&, double, bool);
using BackwardOp = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                      const std::optional<Tensor>&, const std::optional<Tensor>&, bool,
                                                      std::array<bool, 3>);

const c10::TypedOperatorHandle<ForwardOp>& forward_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("gspn2::layer_norm", "").typed<ForwardOp>();
  return op;
}

Tensor opt(const std::optional<Tensor>& t) { return t.has_value() ? *t : Tensor(); }
std::optional<Tensor> maybe(const Tensor& t) { return t.defined() ? std::optional<Tensor>(t) : std::nullopt; }

// Autograd for CUDA tensors (other devices: the Python formula of gspn2/ops/layernorm.py).
class LayerNormFunction : public torch::autograd::Function<LayerNormFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& x,
                                                const std::optional<Tensor>& weight, const std::optional<Tensor>& bias,
                                                double eps, bool gelu) {
    Tensor y, mean, rstd;
    {
      at::AutoDispatchBelowADInplaceOrView below;
      std::tie(y, mean, rstd) = forward_op().call(x, weight, bias, eps, gelu);
    }
    ctx->save_for_backward({x, opt(weight), opt(bias), mean, rstd});
    ctx->saved_data["gelu"] = gelu;
    ctx->mark_non_differentiable({mean, rstd});
    return {y, mean, rstd};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static const auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("gspn2::layer_norm_backward", "").typed<BackwardOp>();
    const auto s = ctx->get_saved_variables();
    const Tensor &x = s[0], &w = s[1], &b = s[2];
    const bool gelu = ctx->saved_data["gelu"].toBool();
    if (!grads[0].defined()) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    // needs_input_grad counts the defined tensor inputs (the autograd edges).
    size_t edge = 0;
    const bool need_x = ctx->needs_input_grad(edge++);
    const bool need_w = w.defined() && ctx->needs_input_grad(edge++);
    const bool need_b = b.defined() && ctx->needs_input_grad(edge++);
    auto [gx, gw, gb] = op.call(grads[0].contiguous(), x, s[3], s[4], maybe(w), maybe(b), gelu,
                                {need_x, need_w, need_b});
    return {gx, gw, gb, Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor, Tensor> layer_norm_autograd(const Tensor& x, const std::optional<Tensor>& weight,
                                                       const std::optional<Tensor>& bias, double eps, bool gelu) {
  if (!wants_autograd({&x, weight.has_value() ? &*weight : nullptr, bias.has_value() ? &*bias : nullptr})) {
    at::AutoDispatchBelowADInplaceOrView below;
    return forward_op().call(x, weight, bias, eps, gelu);
  }
  auto out = LayerNormFunction::apply(x, weight, bias, eps, gelu);
  return {out[0], out[1], out[2]};
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor> layer_norm_call(const Tensor& x, const std::optional<Tensor>& weight,
                                                   const std::optional<Tensor>& bias, double eps, bool gelu) {
  return forward_op().call(x, weight, bias, eps, gelu);
}

}  // namespace gspn2

TORCH_LIBRARY_IMPL(gspn2, CUDA, m) {
  m.impl("layer_norm", &gspn2::layer_norm_forward);
  m.impl("layer_norm_backward", &gspn2::layer_norm_backward);
}

TORCH_LIBRARY_IMPL(gspn2, AutogradCUDA, m) { m.impl("layer_norm", &gspn2::layer_norm_autograd); }
