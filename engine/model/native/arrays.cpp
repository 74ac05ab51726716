// Reading mlx arrays as packed fp32 rows, and the CPU stream (primitive.h).
#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels.h"
#include "primitive.h"

namespace mx = mlx::core;

namespace mtpserve {

void widen_rows(const mx::array& x, int64_t rows, int64_t in, int64_t stride, float* dst) {
  const Real type = real_of(x.dtype());
  const auto* base = x.data<char>();
  const size_t item = x.itemsize();
  const int nd = x.ndim();
  const auto& shape = x.shape();
  const auto& strides = x.strides();
  for (int64_t r = 0; r < rows; ++r) {
    int64_t offset = 0;  // of row r, in elements
    int64_t rest = r;
    for (int d = nd - 2; d >= 0; --d) {
      offset += (rest % shape[d]) * strides[d];
      rest /= shape[d];
    }
    float* row = dst + r * stride;
    const int64_t step = strides[nd - 1];
    if (type == Real::f32 && step == 1) {
      std::memcpy(row, base + offset * item, in * sizeof(float));
    } else {
      const char* p = base + offset * item;
      for (int64_t k = 0; k < in; ++k) row[k] = real_at(p, type, k * step);
    }
    std::memset(row + in, 0, (stride - in) * sizeof(float));
  }
}

void pack(const mx::array& a, std::vector<float>& dst) {
  dst.resize(a.size());
  if (a.size() == 0) return;
  const int64_t last = a.shape(-1);
  widen_rows(a, static_cast<int64_t>(a.size()) / last, last, last, dst.data());
}

const float* packed(const mx::array& a, std::vector<float>& scratch) {
  if (a.dtype() == mx::float32 && a.flags().row_contiguous) return a.data<float>();
  pack(a, scratch);
  return scratch.data();
}

mx::Stream cpu_stream(const char* what) {
  auto stream = mx::default_stream(mx::default_device());
  if (stream.device.type != mx::Device::cpu)
    throw std::invalid_argument(std::string(what) + " runs on the CPU only");
  return stream;
}

}  // namespace mtpserve
