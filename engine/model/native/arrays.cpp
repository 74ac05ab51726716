// Reading mlx arrays as packed fp32 or int32 rows, and the CPU stream (primitive.h).
#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels.h"
#include "primitive.h"

namespace mx = mlx::core;

namespace mtpserve {

namespace {

// The offset in elements of row r of `a` along its last axis (rows in row-major order of the
// leading axes, any strides).
int64_t row_offset(const mx::array& a, int64_t r) {
  int64_t offset = 0;
  for (int d = a.ndim() - 2; d >= 0; --d) {
    offset += (r % a.shape(d)) * a.strides()[d];
    r /= a.shape(d);
  }
  return offset;
}

}  // namespace

void widen_rows(const mx::array& x, int64_t rows, int64_t in, int64_t stride, float* dst) {
  const Real type = real_of(x.dtype());
  const auto* base = x.data<char>();
  const size_t item = x.itemsize();
  const int nd = x.ndim();
  const auto& strides = x.strides();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t offset = row_offset(x, r);
    float* row = dst + r * stride;
    const int64_t step = strides[nd - 1];
    if (type == Real::f32 && step == 1) {
      std::memcpy(row, base + offset * item, in * sizeof(float));
    } else if (type == Real::bf16 && step == 1) {  // the type chosen once a row, not an element
      const auto* p = reinterpret_cast<const uint16_t*>(base + offset * item);
      for (int64_t k = 0; k < in; ++k) row[k] = bf16_to_float(p[k]);
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

const int32_t* packed_ints(const mx::array& a, std::vector<int32_t>& scratch) {
  if (a.dtype() != mx::int32) throw std::invalid_argument("packed_ints: the array must be int32");
  if (a.flags().row_contiguous) return a.data<int32_t>();
  scratch.resize(a.size());
  if (a.size() == 0) return scratch.data();
  const int64_t last = a.shape(-1);
  const int64_t step = a.strides().back();
  const int32_t* base = a.data<int32_t>();
  for (int64_t r = 0; r < static_cast<int64_t>(a.size()) / last; ++r) {
    const int32_t* row = base + row_offset(a, r);
    for (int64_t k = 0; k < last; ++k) scratch[r * last + k] = row[k * step];
  }
  return scratch.data();
}

mx::Stream cpu_stream(const char* what) {
  auto stream = mx::default_stream(mx::default_device());
  if (stream.device.type != mx::Device::cpu)
    throw std::invalid_argument(std::string(what) + " runs on the CPU only");
  return stream;
}

}  // namespace mtpserve
