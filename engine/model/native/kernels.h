// The kernels of the instruction set in use and the thread pool they run on (products.cpp
// chooses them; every primitive of the module asks here).
#pragma once

#include <memory>

#include "delta_rule.h"
#include "pool.h"
#include "products.h"

namespace nanobind {
class module_;
}
namespace mlx::core {
struct Dtype;
}

namespace mtpserve {

struct Kernels {
  ColumnsKernel columns;
  DeltaKernel delta;
  DeltaKernel replay;
  std::shared_ptr<ThreadPool> pool;
};

Kernels current_kernels();

// The kernels' element type of an mlx float array (invalid_argument for any other).
Real real_of(mlx::core::Dtype t);

// Adds delta_rule and delta_rule_replay to the module (delta_rule.cpp).
void bind_delta_rule(nanobind::module_& m);

// Adds rms_norm and gated_rms_norm to the module (norms.cpp).
void bind_norms(nanobind::module_& m);

// Adds causal_conv_silu, swiglu and rope to the module (elementwise.cpp).
void bind_elementwise(nanobind::module_& m);

// Adds attend to the module (attention.cpp).
void bind_attention(nanobind::module_& m);

// Adds top_k_truncate, argmax and accept_candidates to the module (sampler.cpp).
void bind_sampler(nanobind::module_& m);

// The Python functions of tape.cpp: a traced block of ops run as one primitive.
void bind_tape(nanobind::module_& m);

}  // namespace mtpserve
