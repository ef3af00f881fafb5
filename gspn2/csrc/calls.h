// The host side shared by the op registrations: when the CUDA autograd kernels record a node, and the direct
// eager entries of gspn2's ops for Python (bound in propagate.cpp as gspn2._C.<op>): the typed
// dispatcher calls of gspn2::propagate, gspn2::depthwise_conv2d and the GEMM chains gspn2::rows_*. Every
// dispatch key (autograd, fake tensors, dispatch modes) sees the same op as through torch.ops; what they skip
// is torch.ops' boxed argument parsing. Dynamo cannot trace them and torch.jit.trace records torch.ops calls
// only: there gspn2/ops calls torch.ops (gspn2.ops._cuda.direct_call_allowed).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>

#include <cstdint>
#include <initializer_list>
#include <array>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace gspn2 {

// Whether an op's CUDA autograd kernel records its node: grad mode is on and an input requires grad, or an
// input carries a forward-mode tangent (the node's forward-mode formula then raises, since the C++ custom
// Function has none, instead of the output silently dropping the tangent). Null entries: absent inputs.
inline bool wants_autograd(std::initializer_list<const at::Tensor*> inputs) {
  const bool grad_mode = at::GradMode::is_enabled();
  for (const at::Tensor* t : inputs) {
    if (t == nullptr || !t->defined()) continue;
    if ((grad_mode && t->requires_grad()) || t->_fw_grad(/*level=*/0).defined()) return true;
  }
  return false;
}

at::Tensor propagate_call(const at::Tensor& x, const at::Tensor& lam, const at::Tensor& gates,
                          std::optional<int64_t> chunk, const std::string& kernel, int64_t cluster_ctas);

at::Tensor depthwise_conv2d_call(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                 bool add_input, bool silu, int64_t kernel, int64_t cols);

std::vector<at::Tensor> rows_norm_linear_call(const at::Tensor& x, const std::optional<at::Tensor>& gate,
                                              const std::optional<at::Tensor>& norm_weight,
                                              const std::optional<at::Tensor>& norm_bias, const at::Tensor& weight,
                                              const std::optional<at::Tensor>& bias, double eps, int64_t chunks,
                                              at::ScalarType dtype, bool norm_kernel);

at::Tensor rows_linear_call(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            const std::optional<at::Tensor>& skip_input, const std::optional<at::Tensor>& skip_scale,
                            at::ScalarType dtype);

// gspn2::layer_norm (layer_norm.cpp): its dispatcher call, the CUDA implementations of the op and its backward
// (called directly by the GEMM chains, rows.cpp), whether the kernel takes x, and the longest rows it takes.
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_call(const at::Tensor& x,
                                                               const std::optional<at::Tensor>& weight,
                                                               const std::optional<at::Tensor>& bias, double eps,
                                                               bool gelu);
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                                                   const at::Tensor& mean, const at::Tensor& rstd,
                                                                   const std::optional<at::Tensor>& weight,
                                                                   const std::optional<at::Tensor>& bias, bool gelu,
                                                                   std::array<bool, 3> mask);
bool layer_norm_kernel_supported(const at::Tensor& x);
int64_t layer_norm_max_channels(at::ScalarType t);

at::Tensor rows_gelu_linear_call(const at::Tensor& h, const at::Tensor& weight, const std::optional<at::Tensor>& bias);

}  // namespace gspn2
