// Error messages without iostreams. On the H200 image (torch 2.11), formatting a number through an
// ostringstream (c10::str, TORCH_CHECK) inside this extension crashed with SIGSEGV (in the stream's
// number output) instead of raising; numbers here go through std::to_string, which needs no stream or
// locale facet. tests/ops/test_cuda.py::test_cpp_checks_name_the_tensor covers the path.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <string>
#include <type_traits>

namespace gspn2 {
namespace detail {

inline void append(std::string& s, const char* v) { s += v; }
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, const c10::Device& v) { s += v.str(); }
inline void append(std::string& s, c10::ScalarType v) { s += c10::toString(v); }
inline void append(std::string& s, c10::IntArrayRef v) {
  s += '[';
  for (size_t i = 0; i < v.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(v[i]);
  }
  s += ']';
}
template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>
void append(std::string& s, T v) {
  s += std::to_string(v);
}

}  // namespace detail

// message("x has ", 3, " dims") == "x has 3 dims"
template <typename... Args>
std::string message(const Args&... args) {
  std::string s;
  (detail::append(s, args), ...);
  return s;
}

}  // namespace gspn2

// Input errors raise ValueError / TypeError in Python (c10::ValueError / c10::TypeError), with messages built
// by message() above. They name the argument.
#define GSPN2_CHECK(cond, ...)                                                      \
  do {                                                                              \
    if (!(cond)) C10_THROW_ERROR(ValueError, gspn2::message("gspn2: ", __VA_ARGS__)); \
  } while (0)
#define GSPN2_CHECK_TYPE(cond, ...)                                                \
  do {                                                                             \
    if (!(cond)) C10_THROW_ERROR(TypeError, gspn2::message("gspn2: ", __VA_ARGS__)); \
  } while (0)
