// What every mlx primitive of the module shares: reading an operand as packed rows, the
// CPU stream the primitives run on, and handing a primitive's work to that stream's thread.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"

namespace mtpserve {

// The rows of `x` along its last axis (`in` elements each; any strides, any float type) widened
// to fp32: row r at dst + r * stride, zeros from column `in` to `stride`.
void widen_rows(const mlx::core::array& x, int64_t rows, int64_t in, int64_t stride, float* dst);

// `a` as packed fp32, row-major.
void pack(const mlx::core::array& a, std::vector<float>& dst);

// `a`'s floats, packed: its own buffer when it is row-contiguous fp32, else `scratch` filled.
const float* packed(const mlx::core::array& a, std::vector<float>& scratch);

// `a`'s int32 elements, packed row-major: its own buffer when it is row-contiguous, else
// `scratch` filled (invalid_argument for another type).
const int32_t* packed_ints(const mlx::core::array& a, std::vector<int32_t>& scratch);

// The default stream when it is the CPU's (invalid_argument naming `what` otherwise).
mlx::core::Stream cpu_stream(const char* what);

// One primitive's work as a tape (tape.cpp) records it: `body(in, out)` over weak copies of the
// primitive's inputs and outputs, in their order (a tape may run it again over other arrays of
// the same shapes).
struct RecordedWork {
  std::function<void(std::vector<mlx::core::array>&, std::vector<mlx::core::array>&)> body;
  std::vector<mlx::core::array> in, out;
  void operator()() { body(in, out); }
};

// Where the work of this module's primitives goes while a tape lays out its nodes on this
// thread: recorded, to run as one task of the stream, instead of a task each; null otherwise.
std::vector<RecordedWork>*& recorded_work();

// `task` handed to the stream's thread: recorded while a tape lays out its nodes (as work over
// no arrays: a tape cannot run it again), else dispatched by the stream's encoder.
template <class Task>
void hand_out(mlx::core::Stream stream, Task task) {
  if (auto* sink = recorded_work())
    sink->push_back({[task](auto&, auto&) mutable { task(); }, {}, {}});
  else
    mlx::core::cpu::get_command_encoder(stream).dispatch(std::move(task));
}

// Registers every input and output with the stream's encoder and runs `body(in, out)` on its
// thread with weak copies (mlx keeps the arrays alive until the task has run; a tape until its
// task has).
template <class Body>
void dispatch(mlx::core::Stream stream, const std::vector<mlx::core::array>& inputs,
              std::vector<mlx::core::array>& outputs, Body body) {
  namespace mx = mlx::core;
  auto& encoder = mx::cpu::get_command_encoder(stream);
  std::vector<mx::array> in, out;
  for (const auto& a : inputs) {
    encoder.set_input_array(a);
    in.push_back(mx::array::unsafe_weak_copy(a));
  }
  for (auto& a : outputs) {
    a.set_data(mx::allocator::malloc(a.nbytes()));
    encoder.set_output_array(a);
    out.push_back(mx::array::unsafe_weak_copy(a));
  }
  if (auto* sink = recorded_work())
    sink->push_back({body, std::move(in), std::move(out)});
  else
    encoder.dispatch([in = std::move(in), out = std::move(out), body]() mutable { body(in, out); });
}

}  // namespace mtpserve
