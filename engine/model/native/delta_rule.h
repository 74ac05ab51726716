// The gated delta rule (the Gated-DeltaNet recurrence) on the CPU: the operands every
// instruction set's row kernel sees.
#pragma once

#include <cstdint>

namespace mtpserve {

// One layer's recurrence over T positions of B rows, every operand packed fp32 row-major:
//   S_t = g_t S_{t-1} + u_t k_t^T,  u_t = beta_t (v_t - g_t S_{t-1} k_t),  y_t = S_t q_t
// per value head h (key head h / (Hv / Hk)), S [Dv, Dk]. Computed row by row of S: row i
// needs only its own (S k)_i, so each row stays in L1 for all T positions.
struct DeltaArgs {
  int64_t B, T, Hk, Hv, Dk, Dv;
  const float* q;      // [B, T, Hk, Dk]
  const float* k;      // [B, T, Hk, Dk]
  const float* v;      // [B, T, Hv, Dv]; replay: unused
  const float* g;      // [B, T, Hv]: the decay exp(log g)
  const float* beta;   // [B, T, Hv]; replay: unused
  const float* u;      // replay: [B, T, Hv, Dv], the forward's u
  const int32_t* keep; // replay: [B], positions each row keeps
  const float* state;  // [B, Hv, Dv, Dk]: the state before the first position
  float* y;            // forward: [B, T, Hv, Dv]
  float* u_out;        // forward: [B, T, Hv, Dv]
  float* final;        // [B, Hv, Dv, Dk]: the state after the last (replay: the kept) position
};

// Rows of S a unit of work takes; units are (row of the batch, head, block of rows).
constexpr int64_t kDeltaRowsPerUnit = 16;

inline int64_t delta_units(const DeltaArgs& a) {
  return a.B * a.Hv * ((a.Dv + kDeltaRowsPerUnit - 1) / kDeltaRowsPerUnit);
}

// Runs units [first, last) of the forward recurrence (DeltaKernel) or of a replay: the state
// after `keep[b]` positions from `state`, `u` and `k` (ReplayKernel). Every operation is an fp32
// multiply or add in an order fixed by Dk alone (16 lanes, then a fixed tree), with no fused
// multiply-add, so every instruction set computes the same bits, and a replay the same bits as
// the forward pass (and as T one-position passes) computed.
using DeltaKernel = void (*)(const DeltaArgs&, int64_t first, int64_t last);

void delta_scalar(const DeltaArgs&, int64_t, int64_t);
void replay_scalar(const DeltaArgs&, int64_t, int64_t);
#if defined(__x86_64__) || defined(_M_X64)
void delta_avx2(const DeltaArgs&, int64_t, int64_t);
void replay_avx2(const DeltaArgs&, int64_t, int64_t);
void delta_avx512(const DeltaArgs&, int64_t, int64_t);
void replay_avx512(const DeltaArgs&, int64_t, int64_t);
void delta_avx512_vnni(const DeltaArgs&, int64_t, int64_t);
void replay_avx512_vnni(const DeltaArgs&, int64_t, int64_t);
#endif
#if defined(__aarch64__)
void delta_neon(const DeltaArgs&, int64_t, int64_t);
void replay_neon(const DeltaArgs&, int64_t, int64_t);
#endif

}  // namespace mtpserve
