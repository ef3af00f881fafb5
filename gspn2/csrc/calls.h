// Direct eager entries of gspn2's ops for Python (bound in propagate.cpp as gspn2._C.propagate and
// gspn2._C.depthwise_conv2d): the typed dispatcher calls of gspn2::propagate and gspn2::depthwise_conv2d. Every
// dispatch key (autograd, tracing, fake tensors, dispatch modes) sees the same op as through torch.ops; what
// they skip is torch.ops' boxed argument parsing. Dynamo cannot trace them: gspn2/ops calls torch.ops while
// compiling.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>

namespace gspn2 {

at::Tensor propagate_call(const at::Tensor& x, const at::Tensor& lam, const at::Tensor& gates,
                          std::optional<int64_t> chunk, const std::string& kernel, int64_t cluster_ctas);

at::Tensor depthwise_conv2d_call(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                 bool add_input, bool silu, int64_t kernel, int64_t cols);

}  // namespace gspn2
