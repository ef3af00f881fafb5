// The training GEMM chains of gspn2/layers/pointwise.py as C++ ops with C++ autograd, so that an eager
// training step runs their forward and backward without Python:
//
//   gspn2::rows_norm_linear(x, gate, norm_weight, norm_bias, weight, bias, eps, chunks, dtype) -> Tensor[]
//       linear(layer_norm(x) [* silu(gate)], weight, bias) in `chunks` outputs; saves x, its row statistics
//       and gate, and recomputes the normalised x in backward; the norm is gspn2::layer_norm's CUDA kernel
//       with `norm_kernel` (layer_norm.cpp), ATen's otherwise
//   gspn2::rows_linear(x, weight, bias, skip_input, skip_scale, dtype) -> Tensor
//       linear(x, weight, bias) [+ skip_input * skip_scale]
//   gspn2::rows_gelu_linear(h, weight, bias) -> Tensor
//       linear(gelu(h), weight, bias); saves h and recomputes gelu(h) in backward
//
// Each computes what the Python autograd function of the same name in gspn2/layers/pointwise.py computes,
// op for op (the same ATen calls on the same inputs, so the same bits), with the casts to the compute dtype
// `dtype` inside the op: gradients come back in each input's own dtype, as they would through the casts'
// autograd nodes. The ops are device-generic (every ATen call here has CPU and CUDA kernels). Autocast does
// not reach the ATen calls inside: the caller passes the dtype autocast would pick.
#include <torch/extension.h>
#include <torch/library.h>

#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <array>
#include <optional>
#include <tuple>
#include <vector>

#include "calls.h"
#include "message.h"

namespace gspn2 {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

Tensor cast(const Tensor& t, at::ScalarType dtype) { return t.defined() ? t.to(dtype) : t; }
Tensor opt(const std::optional<Tensor>& t) { return t.has_value() ? *t : Tensor(); }
std::optional<Tensor> maybe(const Tensor& t) { return t.defined() ? std::optional<Tensor>(t) : std::nullopt; }
// The dtype of each input the op casts, kept for backward as an int (-1: an undefined input), so that
// backward returns each gradient in its input's dtype (what the cast's autograd node would return) without
// keeping the uncast input alive.
int64_t dtype_of(const Tensor& t) { return t.defined() ? int64_t(t.scalar_type()) : -1; }
Tensor back(const Tensor& grad, int64_t d) {
  return grad.defined() && d >= 0 ? grad.to(at::ScalarType(d)) : Tensor();
}

// needs_input_grad(i) counts the tensor inputs that were defined (the autograd edges), not the argument
// positions: whether autograd wants the gradient of each of the first `defined.size()` arguments.
std::vector<bool> needs_grad(AutogradContext* ctx, const std::vector<bool>& defined) {
  std::vector<bool> need;
  size_t edge = 0;
  for (const bool d : defined) need.push_back(d && ctx->needs_input_grad(edge++));
  return need;
}

void check_rows(const char* op, const Tensor& x, const Tensor& weight, const char* xname) {
  GSPN2_CHECK(x.dim() == 2, op, ": `", xname, "` must be (N, C) rows, got ", x.sizes());
  GSPN2_CHECK(weight.dim() == 2 && weight.size(1) == x.size(1), op, ": `weight` must be (out, ", x.size(1),
                   "), got ", weight.sizes());
}

// ---- rows_norm_linear -----------------------------------------------------------------------------------

struct NormLinearForward {
  std::vector<Tensor> outs;
  Tensor mean, rstd;
};

// x, gate and the norm parameters in the dtypes the op computes in (gate, weight, bias: `dtype`; the norm's
// parameters: x's dtype).
// The norm of the rows: gspn2's LayerNorm kernel (`norm_kernel`, CUDA; layer_norm.cpp) or ATen's.
std::tuple<Tensor, Tensor, Tensor> row_norm(const Tensor& x, const Tensor& nw, const Tensor& nb, double eps,
                                            bool norm_kernel) {
  if (norm_kernel) return layer_norm_call(x, maybe(nw), maybe(nb), eps, false);
  return at::native_layer_norm(x, {x.size(-1)}, nw, nb, eps);
}

NormLinearForward norm_linear_math(const Tensor& x, const Tensor& gate, const Tensor& nw, const Tensor& nb,
                                   const Tensor& w, const Tensor& b, double eps, int64_t chunks, bool norm_kernel) {
  auto [n, mean, rstd] = row_norm(x, nw, nb, eps, norm_kernel);
  Tensor m = n.to(w.scalar_type());
  if (gate.defined()) m = m * at::silu(gate);
  NormLinearForward r;
  const int64_t rows = w.size(0) / chunks;
  for (int64_t i = 0; i < chunks; ++i) {
    const Tensor wi = chunks > 1 ? w.narrow(0, i * rows, rows) : w;
    const Tensor bi = b.defined() && chunks > 1 ? b.narrow(0, i * rows, rows) : b;
    r.outs.push_back(at::linear(m, wi, bi));
  }
  r.mean = mean;
  r.rstd = rstd;
  return r;
}

void check_norm_linear(const Tensor& x, const Tensor& gate, const Tensor& weight, int64_t chunks, bool norm_kernel) {
  check_rows("rows_norm_linear", x, weight, "x");
  GSPN2_CHECK(!norm_kernel || layer_norm_kernel_supported(x),
              "rows_norm_linear: `norm_kernel` needs CUDA rows that gspn2's LayerNorm kernel takes (float32, float16 "
              "or bfloat16; C * element size a multiple of 4 bytes, C <= ", layer_norm_max_channels(x.scalar_type()),
              "), got ", x.scalar_type(), " ", x.sizes(), " on ", x.device());
  GSPN2_CHECK(chunks >= 1 && weight.size(0) % chunks == 0,
                   "rows_norm_linear: `chunks` must be a positive int dividing ", weight.size(0), " outputs, got ",
                   chunks);
  GSPN2_CHECK(!gate.defined() || gate.sizes() == x.sizes(), "rows_norm_linear: `gate` must have x's shape ",
                   x.sizes(), ", got ", gate.sizes());
}

class NormLinearFunction : public torch::autograd::Function<NormLinearFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const std::optional<Tensor>& gate_,
                               const std::optional<Tensor>& norm_weight_, const std::optional<Tensor>& norm_bias_,
                               const Tensor& weight, const std::optional<Tensor>& bias_, double eps, int64_t chunks,
                               at::ScalarType dtype, bool norm_kernel) {
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const Tensor gate = opt(gate_), norm_weight = opt(norm_weight_), norm_bias = opt(norm_bias_), bias = opt(bias_);
    const Tensor gate_c = cast(gate, dtype), nw = cast(norm_weight, x.scalar_type());
    const Tensor nb = cast(norm_bias, x.scalar_type()), w = cast(weight, dtype), b = cast(bias, dtype);
    NormLinearForward f = norm_linear_math(x, gate_c, nw, nb, w, b, eps, chunks, norm_kernel);
    ctx->save_for_backward({x, gate_c, nw, nb, f.mean, f.rstd, w});
    ctx->saved_data["dtypes"] = std::vector<int64_t>{dtype_of(gate), dtype_of(norm_weight), dtype_of(norm_bias),
                                                     dtype_of(weight), dtype_of(bias)};
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["chunks"] = chunks;
    ctx->saved_data["norm_kernel"] = norm_kernel;
    return f.outs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outs) {
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto s_ = ctx->get_saved_variables();
    const Tensor &x = s_[0], &gate = s_[1], &nw = s_[2], &nb = s_[3], &mean = s_[4], &rstd = s_[5], &w = s_[6];
    const double eps = ctx->saved_data["eps"].toDouble();
    const int64_t chunks = ctx->saved_data["chunks"].toInt();
    const bool norm_kernel = ctx->saved_data["norm_kernel"].toBool();
    const int64_t rows = w.size(0) / chunks;
    std::vector<Tensor> weights, grads;
    for (int64_t i = 0; i < chunks; ++i) {
      weights.push_back(chunks > 1 ? w.narrow(0, i * rows, rows) : w);
      const Tensor& g = grad_outs[i];
      grads.push_back(g.defined() ? g : at::zeros({x.size(0), rows}, w.options()));
    }
    const std::vector<int64_t> dt = ctx->saved_data["dtypes"].toIntVector();
    const std::vector<bool> need = needs_grad(ctx, {true, dt[0] >= 0, dt[1] >= 0, dt[2] >= 0, true, dt[4] >= 0});
    const bool need_x = need[0], need_gate = need[1], need_nw = need[2], need_nb = need[3];
    const bool need_w = need[4], need_b = need[5];
    Tensor grad_x, grad_gate, grad_nw, grad_nb, grad_w, grad_b;
    // The same kernel on the same input as in forward: bitwise the forward's normalised x.
    const Tensor n = std::get<0>(row_norm(x, nw, nb, eps, norm_kernel));
    const Tensor m0 = n.to(w.scalar_type());
    const Tensor s = gate.defined() ? at::silu(gate) : Tensor();
    if (need_w) {
      const Tensor m = s.defined() ? m0 * s : m0;
      if (chunks > 1) {
        std::vector<Tensor> parts;
        for (const Tensor& g : grads) parts.push_back(at::mm(g.t(), m));
        grad_w = at::cat(parts);
      } else {
        grad_w = at::mm(grads[0].t(), m);
      }
    }
    if (need_b) {
      if (chunks > 1) {
        std::vector<Tensor> parts;
        for (const Tensor& g : grads) parts.push_back(g.sum(0));
        grad_b = at::cat(parts);
      } else {
        grad_b = grads[0].sum(0);
      }
    }
    if (need_x || need_gate || need_nw || need_nb) {
      // The chunks' input gradients are summed in x's dtype, as autograd sums the gradients of the
      // per-GEMM casts of the unfused path.
      Tensor grad_n;
      for (int64_t i = 0; i < chunks; ++i) {
        Tensor grad_m = at::mm(grads[i], weights[i]);
        if (s.defined()) {
          if (need_gate) {
            const Tensor gg = at::silu_backward(grad_m * m0, gate);
            grad_gate = grad_gate.defined() ? grad_gate + gg : gg;
          }
          grad_m = grad_m * s;
        }
        grad_n = grad_n.defined() ? grad_n + grad_m.to(x.scalar_type()) : grad_m.to(x.scalar_type());
      }
      if (need_x || need_nw || need_nb) {
        const std::array<bool, 3> mask{need_x, need_nw && nw.defined(), need_nb && nb.defined()};
        std::tie(grad_x, grad_nw, grad_nb) =
            norm_kernel ? layer_norm_backward(grad_n, x, mean, rstd, maybe(nw), maybe(nb), false, mask)
                        : at::native_layer_norm_backward(grad_n, x, {x.size(-1)}, mean, rstd, nw, nb, mask);
      }
    }
    return {grad_x,         back(grad_gate, dt[0]), back(grad_nw, dt[1]), back(grad_nb, dt[2]),
            back(grad_w, dt[3]), back(grad_b, dt[4]),  Tensor(),              Tensor(), Tensor(), Tensor()};
  }
};

std::vector<Tensor> rows_norm_linear_autograd(const Tensor& x, const std::optional<Tensor>& gate,
                                              const std::optional<Tensor>& norm_weight,
                                              const std::optional<Tensor>& norm_bias, const Tensor& weight,
                                              const std::optional<Tensor>& bias, double eps, int64_t chunks,
                                              at::ScalarType dtype, bool norm_kernel) {
  check_norm_linear(x, opt(gate), weight, chunks, norm_kernel);
  return NormLinearFunction::apply(x, gate, norm_weight, norm_bias, weight, bias, eps, chunks, dtype, norm_kernel);
}

// Below autograd (an inference call, a trace below the autograd key): the forward alone.
std::vector<Tensor> rows_norm_linear_plain(const Tensor& x, const std::optional<Tensor>& gate,
                                           const std::optional<Tensor>& norm_weight,
                                           const std::optional<Tensor>& norm_bias, const Tensor& weight,
                                           const std::optional<Tensor>& bias, double eps, int64_t chunks,
                                           at::ScalarType dtype, bool norm_kernel) {
  check_norm_linear(x, opt(gate), weight, chunks, norm_kernel);
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  return norm_linear_math(x, cast(opt(gate), dtype), cast(opt(norm_weight), x.scalar_type()),
                          cast(opt(norm_bias), x.scalar_type()), weight.to(dtype), cast(opt(bias), dtype), eps,
                          chunks, norm_kernel)
      .outs;
}

// ---- rows_linear ----------------------------------------------------------------------------------------

Tensor rows_linear_math(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& skip_input,
                        const Tensor& skip_scale) {
  Tensor out = at::linear(x, w, b);
  if (skip_input.defined()) out = at::addcmul(out, skip_input, skip_scale);
  return out;
}

void check_rows_linear(const Tensor& x, const Tensor& weight, const Tensor& skip_input, const Tensor& skip_scale) {
  check_rows("rows_linear", x, weight, "x");
  GSPN2_CHECK(skip_input.defined() == skip_scale.defined(),
                   "rows_linear: `skip_input` and `skip_scale` go together (both or neither)");
}

class RowsLinearFunction : public torch::autograd::Function<RowsLinearFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight,
                        const std::optional<Tensor>& bias_, const std::optional<Tensor>& skip_input_,
                        const std::optional<Tensor>& skip_scale_, at::ScalarType dtype) {
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const Tensor bias = opt(bias_), skip_input = opt(skip_input_), skip_scale = opt(skip_scale_);
    const Tensor x_c = x.to(dtype), w = weight.to(dtype), b = cast(bias, dtype);
    const Tensor ss = skip_input.defined() ? skip_scale.to(skip_input.scalar_type()) : Tensor();
    ctx->save_for_backward({x_c, w, skip_input, ss});
    ctx->saved_data["dtypes"] =
        std::vector<int64_t>{dtype_of(x), dtype_of(weight), dtype_of(bias), dtype_of(skip_scale)};
    return rows_linear_math(x_c, w, b, skip_input, ss);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outs) {
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto s_ = ctx->get_saved_variables();
    const Tensor &x = s_[0], &w = s_[1], &si = s_[2], &ss = s_[3];
    const std::vector<int64_t> dt = ctx->saved_data["dtypes"].toIntVector();
    const Tensor& g = grad_outs[0];
    // A skip input of a wider dtype widens the output and its gradient; the GEMM's part of it is in the
    // GEMM's dtype (as autograd casts the gradient of a GEMM's output).
    const Tensor g_mm = g.to(x.scalar_type());
    const std::vector<bool> need = needs_grad(ctx, {true, true, dt[2] >= 0, si.defined(), dt[3] >= 0});
    Tensor grad_x, grad_w, grad_b, grad_si, grad_ss;
    if (need[0]) grad_x = at::mm(g_mm, w);
    if (need[1]) grad_w = at::mm(g_mm.t(), x);
    if (need[2]) grad_b = g_mm.sum(0);
    if (need[3]) grad_si = g * ss;
    if (need[4]) grad_ss = (g * si).sum(0);
    return {back(grad_x, dt[0]), back(grad_w, dt[1]), back(grad_b, dt[2]), grad_si, back(grad_ss, dt[3]), Tensor()};
  }
};

Tensor rows_linear_autograd(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                            const std::optional<Tensor>& skip_input, const std::optional<Tensor>& skip_scale,
                            at::ScalarType dtype) {
  check_rows_linear(x, weight, opt(skip_input), opt(skip_scale));
  return RowsLinearFunction::apply(x, weight, bias, skip_input, skip_scale, dtype);
}

Tensor rows_linear_plain(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                         const std::optional<Tensor>& skip_input, const std::optional<Tensor>& skip_scale,
                         at::ScalarType dtype) {
  check_rows_linear(x, weight, opt(skip_input), opt(skip_scale));
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const Tensor si = opt(skip_input);
  return rows_linear_math(x.to(dtype), weight.to(dtype), cast(opt(bias), dtype), si,
                          si.defined() ? skip_scale->to(si.scalar_type()) : Tensor());
}

// ---- rows_gelu_linear -----------------------------------------------------------------------------------

class GeluLinearFunction : public torch::autograd::Function<GeluLinearFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& h, const Tensor& weight,
                        const std::optional<Tensor>& bias_) {
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const Tensor bias = opt(bias_);
    const Tensor w = weight.to(h.scalar_type()), b = cast(bias, h.scalar_type());
    ctx->save_for_backward({h, w});
    ctx->saved_data["dtypes"] = std::vector<int64_t>{dtype_of(weight), dtype_of(bias)};
    return at::linear(at::gelu(h), w, b);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outs) {
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto s_ = ctx->get_saved_variables();
    const Tensor &h = s_[0], &w = s_[1];
    const std::vector<int64_t> dt = ctx->saved_data["dtypes"].toIntVector();
    const Tensor& g = grad_outs[0];
    const std::vector<bool> need = needs_grad(ctx, {true, true, dt[1] >= 0});
    Tensor grad_h, grad_w, grad_b;
    if (need[0]) grad_h = at::gelu_backward(at::mm(g, w), h);
    if (need[1]) grad_w = at::mm(g.t(), at::gelu(h));
    if (need[2]) grad_b = g.sum(0);
    return {grad_h, back(grad_w, dt[0]), back(grad_b, dt[1])};
  }
};

Tensor rows_gelu_linear_autograd(const Tensor& h, const Tensor& weight, const std::optional<Tensor>& bias) {
  check_rows("rows_gelu_linear", h, weight, "h");
  return GeluLinearFunction::apply(h, weight, bias);
}

Tensor rows_gelu_linear_plain(const Tensor& h, const Tensor& weight, const std::optional<Tensor>& bias) {
  check_rows("rows_gelu_linear", h, weight, "h");
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  return at::linear(at::gelu(h), weight.to(h.scalar_type()), cast(opt(bias), h.scalar_type()));
}

}  // namespace

std::vector<at::Tensor> rows_norm_linear_call(const at::Tensor& x, const std::optional<at::Tensor>& gate,
                                              const std::optional<at::Tensor>& norm_weight,
                                              const std::optional<at::Tensor>& norm_bias, const at::Tensor& weight,
                                              const std::optional<at::Tensor>& bias, double eps, int64_t chunks,
                                              at::ScalarType dtype, bool norm_kernel) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("gspn2::rows_norm_linear", "")
                             .typed<decltype(rows_norm_linear_call)>();
  return op.call(x, gate, norm_weight, norm_bias, weight, bias, eps, chunks, dtype, norm_kernel);
}

at::Tensor rows_linear_call(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            const std::optional<at::Tensor>& skip_input, const std::optional<at::Tensor>& skip_scale,
                            at::ScalarType dtype) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("gspn2::rows_linear", "").typed<decltype(rows_linear_call)>();
  return op.call(x, weight, bias, skip_input, skip_scale, dtype);
}

at::Tensor rows_gelu_linear_call(const at::Tensor& h, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("gspn2::rows_gelu_linear", "")
                             .typed<decltype(rows_gelu_linear_call)>();
  return op.call(h, weight, bias);
}

}  // namespace gspn2

TORCH_LIBRARY_FRAGMENT(gspn2, m) {
  m.def("rows_norm_linear(Tensor x, Tensor? gate, Tensor? norm_weight, Tensor? norm_bias, Tensor weight, "
        "Tensor? bias, float eps, int chunks, ScalarType dtype, bool norm_kernel=False) -> Tensor[]");
  m.def("rows_linear(Tensor x, Tensor weight, Tensor? bias, Tensor? skip_input, Tensor? skip_scale, "
        "ScalarType dtype) -> Tensor");
  m.def("rows_gelu_linear(Tensor h, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(gspn2, Autograd, m) {
  m.impl("rows_norm_linear", &gspn2::rows_norm_linear_autograd);
  m.impl("rows_linear", &gspn2::rows_linear_autograd);
  m.impl("rows_gelu_linear", &gspn2::rows_gelu_linear_autograd);
}

TORCH_LIBRARY_IMPL(gspn2, CompositeExplicitAutograd, m) {
  m.impl("rows_norm_linear", &gspn2::rows_norm_linear_plain);
  m.impl("rows_linear", &gspn2::rows_linear_plain);
  m.impl("rows_gelu_linear", &gspn2::rows_gelu_linear_plain);
}
