// The product kernel, written once over a vector type `V` and compiled once per instruction
// set (kernel_*.cpp include this file inside their own namespace, with their own compiler
// flags).
//
// Layout of the work, for output columns [first, last):
// - tiles of V::J weight rows (output columns) by up to V::R activation rows, taken
//   V::tile_columns weight rows at a time, every (row, column) sum in one vector accumulator
//   of its own; up to V::whole_float_rows activation rows (and one row of 8-bit codes where
//   V::whole_code_row) take the tile's weight rows one after the other instead, each whole;
// - fp32, bf16 and fp16 weight rows are read where they lie (half precision widened in
//   registers: a tile's first row tile reads them from memory, the next ones from cache, and
//   prefetches the next tile's); 4- and 8-bit affine codes are read in registers too, as
//   integers multiplied by the activation quantized to 8 bits (code_tile: what llama.cpp's
//   Q4_0 and Q8_0 products do, and 2-3x fewer instructions than decoding codes to fp32);
//   other affine widths are dequantized per tile into a per-thread fp32 scratch that every
//   row tile reads from cache;
// - rows wider than kWholeRow go in chunks, the accumulators kept in a small buffer between
//   chunks (stored and loaded exactly).
// One output element's sum is the same sequence of vector operations over the same values (a
// weight widened in registers is the same number as read in place; the one partial vector at
// the end of a row is zero-filled either way; an activation row is quantized alone) followed
// by the same horizontal sum, whatever the number of rows, the tile it sits in or the thread
// that runs it.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <vector>

namespace mtpserve {
namespace KERNEL_NAMESPACE {

// Rows up to this wide are taken whole; wider ones in chunks of kChunk, a multiple of every
// vector width and of every group size mlx writes (32, 64, 128).
constexpr int64_t kWholeRow = 8192;
constexpr int64_t kChunk = 2048;
// Activation rows whose accumulators are kept at once; more rows run in blocks of this many.
constexpr int kBlockRows = 64;

inline int64_t round_up(int64_t n, int64_t m) {
  return (n + m - 1) / m * m;
}

// -- weight rows as fp32 vectors: where they lie, or widened in registers --------------------

template <class V>
struct F32Rows {  // fp32 rows in memory (the weight itself, or the scratch)
  const float* row[V::J];
  int64_t ahead = 0;  // bytes from a row to the same row of the next tile (0: no prefetch)
  void prefetch(int j, int64_t k) const {
    if (ahead) __builtin_prefetch(reinterpret_cast<const char*>(row[j] + k) + ahead, 0, 2);
  }
  const char* at(int j, int64_t k) const { return reinterpret_cast<const char*>(row[j] + k); }
  typename V::reg load(int j, int64_t k) const { return V::load(row[j] + k); }
  typename V::reg load_tail(int j, int64_t k, int n) const {
    return V::load_partial(row[j] + k, n);
  }
};

template <class V, bool Bf16>
struct HalfRows {  // bf16 or fp16 rows, widened in registers
  const uint16_t* row[V::J];
  int64_t ahead = 0;
  void prefetch(int j, int64_t k) const {
    if (ahead && (k * 2) % 64 == 0)
      __builtin_prefetch(reinterpret_cast<const char*>(row[j] + k) + ahead, 0, 2);
  }
  const char* at(int j, int64_t k) const { return reinterpret_cast<const char*>(row[j] + k); }
  typename V::reg load(int j, int64_t k) const {
    return Bf16 ? V::load_bf16(row[j] + k) : V::load_f16(row[j] + k);
  }
  typename V::reg load_tail(int j, int64_t k, int n) const {
    alignas(64) float part[V::W] = {};
    for (int i = 0; i < n; ++i)
      part[i] = Bf16 ? bf16_to_float(row[j][k + i]) : half_to_float(row[j][k + i]);
    return V::load(part);
  }
};

template <class V, int RN, int JN, class Rows>
inline void tile(
    const Rows& w,
    int jb,  // the tile's first column within the J-row tile
    int64_t steps,
    int tail,
    const float* x,
    int64_t x_stride,
    typename V::reg (*acc)[V::J]) {
  using reg = typename V::reg;
  constexpr int W = V::W;
  reg c[RN][JN];
  for (int r = 0; r < RN; ++r)
    for (int j = 0; j < JN; ++j) c[r][j] = acc[r][jb + j];
  // the RN activation vectors stay in registers while each weight vector is loaded and used
  // once: RN + 1 + RN * JN registers
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t k = s * W;
    reg xv[RN];
    for (int r = 0; r < RN; ++r) xv[r] = V::load(x + r * x_stride + k);
    for (int j = 0; j < JN; ++j) {
      w.prefetch(jb + j, k);
      const reg wj = w.load(jb + j, k);
      for (int r = 0; r < RN; ++r) c[r][j] = V::fma(wj, xv[r], c[r][j]);
    }
  }
  if (tail) {
    const int64_t k = steps * W;
    reg xv[RN];
    for (int r = 0; r < RN; ++r) xv[r] = V::load(x + r * x_stride + k);  // zero past the end
    for (int j = 0; j < JN; ++j) {
      const reg wj = w.load_tail(jb + j, k, tail);
      for (int r = 0; r < RN; ++r) c[r][j] = V::fma(wj, xv[r], c[r][j]);
    }
  }
  for (int r = 0; r < RN; ++r)
    for (int j = 0; j < JN; ++j) acc[r][jb + j] = c[r][j];
}

// RN activation rows against `jn` weight rows taken one after the other, each read from start
// to end (V::whole_float_rows): the same operations per output as tile's, in the order memory
// lies. A tile of 1-3 rows by 8 weight rows (8 streams a row apart) read bf16 weights of a
// Qwen3.5-0.8B token at 1 / 2 / 3 rows in 61-64 / 63-67 / 66-70 ms on an Intel Xeon VM, each row
// whole in 50-53 / 56-57 / 62 (fp32 103-110 / 105-107 / 105-111 against 92-96 / 97-98 /
// 102-106); 4-5 rows keep the tile (each row whole was level at 4 and 1.05-1.1x slower at 5, two
// weight rows at a time 1.04-1.1x slower), as AVX2 does for all (its 8 lanes a chain wait on
// the multiply-adds: kernel_avx2.cpp) and NEON and the scalar path, unmeasured, for all
// (scripts/bench_kernel.py --dtypes f32,bf16).
template <class V, int RN, class Rows>
inline void float_rows(const Rows& w, int jn, int64_t steps, int tail, const float* x,
                       int64_t x_stride, typename V::reg (*acc)[V::J]) {
  using reg = typename V::reg;
  constexpr int W = V::W;
  const int64_t step_bytes = w.at(0, W) - w.at(0, 0);
  for (int j = 0; j < jn; ++j) {
    reg c[RN];
    for (int r = 0; r < RN; ++r) c[r] = acc[r][j];
    for (int64_t s = 0; s < steps; ++s) {
      const int64_t k = s * W;
      // 2-3 rows prefetch into L1 and L2; one row's stream is the hardware prefetcher's alone
      // (with them, an fp32 0.8B token of one row took 1.03-1.15x the time, bf16 1.05-1.09x)
      if (RN > 1 && w.ahead && (s * step_bytes) % 64 == 0) {
        __builtin_prefetch(w.at(j, k) + 512, 0, 3);
        __builtin_prefetch(w.at(j, k) + 4096, 0, 2);
      }
      const reg wj = w.load(j, k);
      for (int r = 0; r < RN; ++r) c[r] = V::fma(wj, V::load(x + r * x_stride + k), c[r]);
    }
    if (tail) {
      const reg wj = w.load_tail(j, steps * W, tail);
      for (int r = 0; r < RN; ++r) c[r] = V::fma(wj, V::load(x + r * x_stride + steps * W), c[r]);
    }
    for (int r = 0; r < RN; ++r) acc[r][j] = c[r];
  }
}

template <class V, int RN, int JN, class Rows>
inline void tile_jn(int jn, const Rows& w, int jb, int64_t steps, int tail, const float* x,
                    int64_t xs, typename V::reg (*acc)[V::J]) {
  if constexpr (JN > 1) {
    if (jn < JN) return tile_jn<V, RN, JN - 1>(jn, w, jb, steps, tail, x, xs, acc);
  }
  tile<V, RN, JN>(w, jb, steps, tail, x, xs, acc);
}

// RN rows of one J-row tile, V::tile_columns of its columns at a time.
template <class V, int RN = V::R, class Rows>
inline void tile_rn(int rn, int jn, const Rows& w, int64_t steps, int tail, const float* x,
                    int64_t xs, typename V::reg (*acc)[V::J]) {
  if constexpr (RN > 1) {
    if (rn < RN) return tile_rn<V, RN - 1>(rn, jn, w, steps, tail, x, xs, acc);
  }
  if constexpr (RN <= V::whole_float_rows) {
    return float_rows<V, RN>(w, jn, steps, tail, x, xs, acc);
  }
  constexpr int JN = V::tile_columns;
  for (int jb = 0; jb < jn; jb += JN)
    tile_jn<V, RN, JN>(std::min(JN, jn - jb), w, jb, steps, tail, x, xs, acc);
}

// Decodes codes [k0, k0 + n) of one affine-quantized row to fp32 in `dst` (k0 a multiple of
// the group size).
template <class V>
inline void decode_affine(const WeightView& wv, int64_t row, int64_t k0, int64_t n, float* dst) {
  const int bits = wv.bits;
  const int group = wv.group;
  const int64_t groups_per_row = wv.in / group;
  const auto* codes = static_cast<const uint8_t*>(wv.data) + row * (wv.in * bits / 8);
  for (int64_t g0 = 0; g0 < n; g0 += group) {
    const int64_t gi = row * groups_per_row + (k0 + g0) / group;
    const float scale = real_at(wv.scales, wv.scale_type, gi);
    const float bias = real_at(wv.biases, wv.scale_type, gi);
    const int64_t len = std::min<int64_t>(group, n - g0);
    const int64_t first = k0 + g0;
    for (int64_t i = 0; i < len; ++i)
      dst[g0 + i] = scale * static_cast<float>(code_at(codes, bits, first + i)) + bias;
  }
}

// Decodes elements [k0, k0 + n) of affine row `row` to fp32 in `dst`, zero up to a whole
// vector (the widths read through the scratch).
template <class V>
inline void decode_row(const WeightView& wv, int64_t row, int64_t k0, int64_t n, float* dst) {
  decode_affine<V>(wv, row, k0, n, dst);
  for (int64_t i = n, e = round_up(n, V::W); i < e; ++i) dst[i] = 0.0f;
}

// Runs every row tile of one J-row weight tile over [k0, k0 + kn).
template <class V, class Rows>
inline void row_tiles(const Rows& w, int jn, int tn, int64_t kn, const float* x, int64_t xs,
                      typename V::reg (*acc)[V::J]) {
  const int64_t steps = kn / V::W;
  const int tail = static_cast<int>(kn % V::W);
  tile_rn<V>(std::min(V::R, tn), jn, w, steps, tail, x, xs, acc);
  if (tn <= V::R) return;
  Rows cached = w;  // the first row tile brought these rows in: no more prefetching
  cached.ahead = 0;
  for (int t0 = V::R; t0 < tn; t0 += V::R)
    tile_rn<V>(std::min(V::R, tn - t0), jn, cached, steps, tail, x + t0 * xs, xs, acc + t0);
}

// n reals of `type` from element `first` of `src` as fp32 at dst[0], dst[stride], ...
inline void widen_strided(const void* src, Real type, int64_t first, int64_t n, float* dst,
                          int64_t stride) {
  switch (type) {
    case Real::f32: {
      const float* p = static_cast<const float*>(src) + first;
      for (int64_t i = 0; i < n; ++i) dst[i * stride] = p[i];
      break;
    }
    case Real::bf16: {
      const uint16_t* p = static_cast<const uint16_t*>(src) + first;
      for (int64_t i = 0; i < n; ++i) dst[i * stride] = bf16_to_float(p[i]);
      break;
    }
    default: {
      const uint16_t* p = static_cast<const uint16_t*>(src) + first;
      for (int64_t i = 0; i < n; ++i) dst[i * stride] = half_to_float(p[i]);
    }
  }
}

// -- 4- and 8-bit affine weights: integer sums against 8-bit activations ------------------
//
// y[t, o] = sum over groups g of  scale[o, g] * xs[t, g] * sum_{i in g} code[o, i] * q[t, i]
//                               + bias[o, g] * sum_{i in g} xs[t, g] * q[t, i]
// Each activation row is quantized in runs of kRun elements, x ~ xs * q with q in [-127, 127]
// and xs the run's largest |x| / 127 (quantize_rows; xs[t, g] above stands for the run's):
// the code-times-q sums are exact integers (any instruction set gets the same ones), and the
// bias term sums the same quantized x (xs * q) so that it cancels the codes' own mean: summing
// the exact x there instead tripled the error, the codes' mean times every rounding of x.
// A vector holds 4W code bytes; lane i sums bytes 4i..4i+3 of the codes times the same bytes
// of q. A block is one vector of codes:
//   8-bit: 4W codes, lane i codes 4i..4i+3;
//   4-bit: 8W codes in 4W bytes (low nibble the even code, high nibble the odd), lane i codes
//          8i..8i+7; q holds each block's 4W even positions, then its 4W odd ones.
// Per block, lane sums become floats times (weight scale * activation scale) of the lane's
// group and run: one fixed sequence of fp32 operations per output, whatever the row count or
// thread.

// Activation elements that share one scale (products.h).
constexpr int kRun = kActivationRun;

// One 4-bit block's lane sums added to acc: low nibbles by the even activations, high ones by
// the odd. An instruction set may add both nibbles' pair sums before widening them
// (V::dot_u4_pair): the same integers in fewer instructions.
template <class V>
inline typename V::ireg dot_u4_block(typename V::ireg acc, typename V::ireg lo,
                                     typename V::ireg even, typename V::ireg hi,
                                     typename V::ireg odd) {
  if constexpr (requires { V::dot_u4_pair(acc, lo, even, hi, odd); })
    return V::dot_u4_pair(acc, lo, even, hi, odd);
  else
    return V::dot_u4(V::dot_u4(acc, lo, even), hi, odd);
}

template <int Bits, class V>
constexpr int block_codes() {
  return Bits == 4 ? 8 * V::W : 4 * V::W;
}

// Whether the integer path takes these affine weights: 4 or 8 bits, and groups that hold
// whole runs and either fill whole blocks or sit whole inside one.
template <class V>
inline bool integer_affine(const WeightView& wv) {
  if (wv.kind != WeightKind::affine || (wv.bits != 4 && wv.bits != 8) || wv.group % kRun)
    return false;
  const int b = wv.bits == 4 ? block_codes<4, V>() : block_codes<8, V>();
  return wv.group % b == 0 || b % wv.group == 0;
}

// Fills `out` (products.h) from the activation rows: 8-bit integers laid out for `Bits`-bit
// codes, one fp32 scale per run followed by V::W zero scales (a block's lanes may read past
// the last run), each run's sum of q (run_sums, laid out as the scales) and each group's sum
// of the quantized x, scale times the run's sum of q run by run in order:
// group_sums[t * (in / group) + g].
template <class V, int Bits>
inline void quantize_rows(const float* x, int64_t xs, int rows, int64_t in, int group,
                          QuantizedRows& out) {
  constexpr int B = block_codes<Bits, V>();
  const int64_t runs = in / kRun;
  const int64_t groups = in / group;
  const int runs_a_group = group / kRun;
  out.q_stride = round_up(in, B);
  out.scale_stride = runs + V::W;
  out.q.assign(static_cast<size_t>(rows * out.q_stride), 0);
  out.scales.assign(static_cast<size_t>(rows * out.scale_stride), 0.0f);
  out.run_sums.assign(static_cast<size_t>(rows * out.scale_stride), 0);
  out.group_sums.assign(static_cast<size_t>(rows * groups), 0.0f);
  for (int t = 0; t < rows; ++t) {
    const float* xr = x + t * xs;
    int8_t* qr = out.q.data() + t * out.q_stride;
    for (int64_t run = 0; run < runs; ++run) {
      int8_t codes[kRun];
      int32_t run_sum = 0;
      const float scale = quantize_run(xr + run * kRun, codes, run_sum);
      out.scales[t * out.scale_stride + run] = scale;
      out.run_sums[t * out.scale_stride + run] = run_sum;
      for (int i = 0; i < kRun; ++i) {
        const int64_t p = run * kRun + i;  // position in the row
        const int8_t code = codes[i];
        if constexpr (Bits == 4) {
          const int64_t block = p / B;
          const int64_t r = p % B;
          qr[block * B + (r & 1) * (B / 2) + r / 2] = code;
        } else {
          qr[p] = code;
        }
      }
      float& sum = out.group_sums[t * groups + run / runs_a_group];
      sum = __builtin_fmaf(scale, static_cast<float>(run_sum), sum);
    }
  }
}

// The codes of one J-row tile over a chunk, and each row's fp32 scales from the chunk's first
// group (followed by V::W zeros): row j's codes at codes + j * row_bytes, its scales at
// scales + j * scale_stride (two registers address every row, where eight pointers each left
// the loop too few for its own work).
template <class V>
struct CodeRows {
  const uint8_t* codes = nullptr;
  int64_t row_bytes = 0;
  const float* scales = nullptr;
  int64_t scale_stride = 0;
  int64_t ahead = 0;  // bytes from a row to the same row of the next tile
};

// The line at p of the next J-row tile into L1 and of the sixth tile on into L2 (the next
// tile into L2 alone, as for floats: 4-bit products of one row at the 0.8B shape ~5% slower).
inline void prefetch_codes(const uint8_t* p, int64_t ahead) {
  __builtin_prefetch(p + ahead, 0, 3);
  __builtin_prefetch(p + 6 * ahead, 0, 2);
}

// The group of each block's first lane, m * B / group for block m = 0, 1, ..., stepped
// without a division a block.
struct GroupCursor {
  int64_t g = 0;
  int64_t groups_a_block, blocks_a_group, blocks_left;
  GroupCursor(int block_codes, int group)
      : groups_a_block(block_codes >= group ? block_codes / group : 0),
        blocks_a_group(block_codes >= group ? 1 : group / block_codes),
        blocks_left(blocks_a_group) {}
  void next() {
    if (groups_a_block) {
      g += groups_a_block;
    } else if (--blocks_left == 0) {
      ++g;
      blocks_left = blocks_a_group;
    }
  }
};

// RN activation rows by JN weight rows (from column `jb` of the J-row tile) over `blocks`
// whole blocks and `tail_bytes` of one partial block.
template <class V, int Bits, int RN, int JN>
inline void code_tile(const CodeRows<V>& w, int jb, int64_t blocks, int tail_bytes, int group,
                      const int8_t* q, int64_t qs, const float* xscale, int64_t xss,
                      typename V::ireg lanes, typename V::ireg runs, typename V::reg (*acc)[V::J]) {
  using reg = typename V::reg;
  using ireg = typename V::ireg;
  constexpr int B = block_codes<Bits, V>();
  constexpr int BB = 4 * V::W;  // code bytes a block
  reg c[RN][JN];
  for (int r = 0; r < RN; ++r)
    for (int j = 0; j < JN; ++j) c[r][j] = acc[r][jb + j];
  const int64_t n = blocks + (tail_bytes ? 1 : 0);
  GroupCursor group_of(B, group);
  for (int64_t m = 0; m < n; ++m) {
    const int64_t g = group_of.g;
    reg xsc[RN];
    for (int r = 0; r < RN; ++r) xsc[r] = V::expand(xscale + r * xss + m * B / kRun, runs);
    if constexpr (Bits == 4) {
      ireg even[RN], odd[RN];
      for (int r = 0; r < RN; ++r) {
        even[r] = V::bytes(q + r * qs + m * B);
        odd[r] = V::bytes(q + r * qs + m * B + BB);
      }
      for (int j = 0; j < JN; ++j) {
        const uint8_t* p = w.codes + (jb + j) * w.row_bytes + m * BB;
        if ((m * BB) % 64 == 0) prefetch_codes(p, w.ahead);
        const ireg v = m < blocks ? V::bytes(p) : V::bytes_partial(p, tail_bytes);
        const ireg lo = V::low_nibbles(v);
        const ireg hi = V::high_nibbles(v);
        const reg ws = V::expand(w.scales + (jb + j) * w.scale_stride + g, lanes);
        for (int r = 0; r < RN; ++r) {
          const ireg d = dot_u4_block<V>(V::izero(), lo, even[r], hi, odd[r]);
          c[r][j] = V::fma(V::to_float(d), V::mul(ws, xsc[r]), c[r][j]);
        }
      }
    } else {
      ireg xq[RN];
      for (int r = 0; r < RN; ++r) xq[r] = V::bytes(q + r * qs + m * B);
      for (int j = 0; j < JN; ++j) {
        const uint8_t* p = w.codes + (jb + j) * w.row_bytes + m * BB;
        if ((m * BB) % 64 == 0) prefetch_codes(p, w.ahead);
        const ireg v = m < blocks ? V::bytes(p) : V::bytes_partial(p, tail_bytes);
        const reg ws = V::expand(w.scales + (jb + j) * w.scale_stride + g, lanes);
        for (int r = 0; r < RN; ++r) {
          const ireg d = V::dot_u8(V::izero(), v, xq[r]);
          c[r][j] = V::fma(V::to_float(d), V::mul(ws, xsc[r]), c[r][j]);
        }
      }
    }
    group_of.next();
  }
  for (int r = 0; r < RN; ++r)
    for (int j = 0; j < JN; ++j) acc[r][jb + j] = c[r][j];
}

// One activation row against `jn` rows of 8-bit codes taken one after the other, each read
// from start to end (V::whole_code_row): the same operations per output as code_tile's one-row
// tile, in the order memory lies. A block of all eight rows in turn (eight streams 1-3.5 KiB
// apart) read them at 0.65-0.68 of the read bandwidth on an Intel Xeon VM, each row whole at
// 0.74-0.76 (scripts/experiments/kernel_token.cpp). 4-bit codes keep the tile: their loops bound
// them, not the reading, and each row's own activation loads made them 1.06x slower this way;
// so does AVX2, whose 8-bit sums take several instructions (1.1x slower whole).
template <class V>
inline void code_row(int jn, const CodeRows<V>& w, int64_t blocks, int tail_bytes, int group,
                     const int8_t* q, const float* xscale, typename V::ireg lanes,
                     typename V::ireg runs, typename V::reg* acc) {
  using reg = typename V::reg;
  using ireg = typename V::ireg;
  constexpr int B = block_codes<8, V>();
  constexpr int BB = 4 * V::W;  // code bytes a block
  const int64_t n = blocks + (tail_bytes ? 1 : 0);
  for (int j = 0; j < jn; ++j) {
    const uint8_t* row = w.codes + j * w.row_bytes;
    const float* scales = w.scales + j * w.scale_stride;
    reg c = acc[j];
    GroupCursor group_of(B, group);
    for (int64_t m = 0; m < n; ++m) {
      const int64_t g = group_of.g;
      const reg xsc = V::expand(xscale + m * B / kRun, runs);
      const uint8_t* p = row + m * BB;
      // the line 512 bytes on into L1 and 4 KiB on into L2 (8 KiB: the same; 256 and 2 KiB,
      // or L2 alone: 0.69 of the read)
      __builtin_prefetch(p + 512, 0, 3);
      __builtin_prefetch(p + 4096, 0, 2);
      const ireg v = m < blocks ? V::bytes(p) : V::bytes_partial(p, tail_bytes);
      const reg ws = V::expand(scales + g, lanes);
      const ireg d = V::dot_u8(V::izero(), v, V::bytes(q + m * B));
      c = V::fma(V::to_float(d), V::mul(ws, xsc), c);
      group_of.next();
    }
    acc[j] = c;
  }
}

template <class V, int Bits, int RN, int JN>
inline void code_tile_jn(int jn, const CodeRows<V>& w, int jb, int64_t blocks, int tail_bytes,
                         int group, const int8_t* q, int64_t qs, const float* xscale, int64_t xss,
                         typename V::ireg lanes, typename V::ireg runs,
                         typename V::reg (*acc)[V::J]) {
  if constexpr (JN > 1) {
    if (jn < JN)
      return code_tile_jn<V, Bits, RN, JN - 1>(jn, w, jb, blocks, tail_bytes, group, q, qs,
                                                xscale, xss, lanes, runs, acc);
  }
  code_tile<V, Bits, RN, JN>(w, jb, blocks, tail_bytes, group, q, qs, xscale, xss, lanes, runs, acc);
}

// RN rows of one J-row tile: one row takes the J columns at once (8-bit codes where
// V::whole_code_row one after the other: code_row); more rows take them V::AJ at a time (so
// that the accumulators and the rows' activations fit the registers).
template <class V, int Bits, int RN = V::AR>
inline void code_rows(int rn, int jn, const CodeRows<V>& w, int64_t blocks, int tail_bytes,
                      int group, const int8_t* q, int64_t qs, const float* xscale, int64_t xss,
                      typename V::ireg lanes, typename V::ireg runs, typename V::reg (*acc)[V::J]) {
  if constexpr (RN > 1) {
    if (rn < RN)
      return code_rows<V, Bits, RN - 1>(rn, jn, w, blocks, tail_bytes, group, q, qs, xscale,
                                         xss, lanes, runs, acc);
    for (int jb = 0; jb < jn; jb += V::AJ)
      code_tile_jn<V, Bits, RN, V::AJ>(std::min(V::AJ, jn - jb), w, jb, blocks, tail_bytes,
                                        group, q, qs, xscale, xss, lanes, runs, acc);
  } else if constexpr (Bits == 8 && V::whole_code_row) {
    code_row<V>(jn, w, blocks, tail_bytes, group, q, xscale, lanes, runs, acc[0]);
  } else {
    code_tile_jn<V, Bits, 1, V::J>(jn, w, 0, blocks, tail_bytes, group, q, qs, xscale, xss,
                                    lanes, runs, acc);
  }
}

// n reals of `type` from element `first` of `src` as fp32 in `dst`, then V::W zeros (two short
// runs for each row of a tile, 16 floats at the 0.8B shape: with a fill and a scalar tail call
// they took a quarter of a 4-bit product's samples; as a call of its own, a fifth).
template <class V>
__attribute__((always_inline)) inline void widen_padded(const void* src, Real type, int64_t first,
                                                        int64_t n, float* dst) {
  constexpr int W = V::W;
  int64_t i = 0;
  if (type == Real::f32) {
    const float* p = static_cast<const float*>(src) + first;
    for (; i + W <= n; i += W) V::store(dst + i, V::load(p + i));
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(src) + first;
    if (type == Real::bf16)
      for (; i + W <= n; i += W) V::store(dst + i, V::load_bf16(p + i));
    else
      for (; i + W <= n; i += W) V::store(dst + i, V::load_f16(p + i));
  }
  if (i < n) widen_strided(src, type, first + i, n - i, dst + i, 1);
  V::store(dst + n, V::zero());
}

// acc + a[i] * b[i] lane by lane over n fp32 values.
template <class V>
inline typename V::reg fma_lanes(const float* a, const float* b, int64_t n, typename V::reg acc) {
  constexpr int W = V::W;
  int64_t i = 0;
  for (; i + W <= n; i += W) acc = V::fma(V::load(a + i), V::load(b + i), acc);
  if (i < n) {
    const int tail = static_cast<int>(n - i);
    acc = V::fma(V::load_partial(a + i, tail), V::load_partial(b + i, tail), acc);
  }
  return acc;
}

// Every row tile of one J-row tile of 4- or 8-bit weights over [k0, k0 + kn).
// `tile_scales` and `tile_biases` each hold J rows of (chunk groups + W) floats.
template <class V, int Bits>
inline void code_tiles(const WeightView& wv, int64_t j0, int jn, int64_t k0, int64_t kn, int tn,
                       const QuantizedRows& xq, int t_begin, const float* group_sums,
                       int64_t gs_stride, float* tile_scales, float* tile_biases,
                       typename V::ireg lanes, typename V::ireg runs,
                       typename V::reg (*acc)[V::J]) {
  constexpr int B = block_codes<Bits, V>();
  const int64_t groups_per_row = wv.in / wv.group;
  const int64_t groups = kn / wv.group;
  const int64_t stride = groups + V::W;
  CodeRows<V> rows{};
  rows.row_bytes = wv.in * Bits / 8;
  rows.codes = static_cast<const uint8_t*>(wv.data) + j0 * rows.row_bytes + k0 * Bits / 8;
  rows.scales = tile_scales;
  rows.scale_stride = stride;
  rows.ahead = V::J * rows.row_bytes;
  for (int j = 0; j < jn; ++j) {
    const int64_t g0 = (j0 + j) * groups_per_row + k0 / wv.group;
    widen_padded<V>(wv.scales, wv.scale_type, g0, groups, tile_scales + j * stride);
    widen_padded<V>(wv.biases, wv.scale_type, g0, groups, tile_biases + j * stride);
  }
  const int64_t blocks = kn / B;
  const int tail_bytes = static_cast<int>((kn % B) * Bits / 8);
  const int8_t* q = xq.q.data() + t_begin * xq.q_stride + k0;
  const float* xscale = xq.scales.data() + t_begin * xq.scale_stride + k0 / kRun;
  for (int t0 = 0; t0 < tn; t0 += V::AR)
    code_rows<V, Bits>(std::min(V::AR, tn - t0), jn, rows, blocks, tail_bytes, wv.group,
                       q + t0 * xq.q_stride, xq.q_stride, xscale + t0 * xq.scale_stride,
                       xq.scale_stride, lanes, runs, acc + t0);
  // the biases: each row's group sums of x against each column's biases, lane by lane into
  // the same accumulators (one horizontal sum an output, not two)
  const float* gs = group_sums + k0 / wv.group;
  for (int t = 0; t < tn; ++t)
    for (int j = 0; j < jn; ++j)
      acc[t][j] = fma_lanes<V>(gs + t * gs_stride, tile_biases + j * stride, groups, acc[t][j]);
}

// W scales (or biases) of `type` from element `index` on, as fp32.
template <class V>
inline typename V::reg real_lanes(const void* p, Real type, int64_t index) {
  if (type == Real::f32) return V::load(static_cast<const float*>(p) + index);
  const uint16_t* h = static_cast<const uint16_t*>(p) + index;
  return type == Real::bf16 ? V::load_bf16(h) : V::load_f16(h);
}

// RN activation rows by one tile of kInterleave output columns of an interleaved 8- or 4-bit
// weight (WeightView::interleaved), tile `tile`: each vector lane one output, so that a
// vector of codes (four of each of its outputs side by side; 4-bit: eight, as low and high
// nibbles) meets the same four activation codes in every lane, broadcast. Run by run: the
// integer sums of the run's words, then that sum as fp32 times (the lanes' group scales times
// the row's run scale) added to the lane; then each group's bias times the row's group sum.
// Row-major 8-bit codes take four operations every 64 codes and row (the integer sum, its
// conversion, the two scales' product and the multiply-add: code_tile), these one and 3/8: on
// one core of an AMD EPYC (Zen 4) 2.5x the multiply-adds a second at 2-5 rows, weights in
// cache (scripts/experiments/interleaved_codes.cpp). The same operations per output whatever
// RN or the thread: row t's outputs are its one-row product's, bit for bit. A tile's codes are
// one sequential stream, left to the hardware prefetcher while the tile reads them faster than
// it multiplies (software prefetches into L1 and L2 made a 0.8B step 7-9% (8-bit) and 6-13%
// (4-bit) slower at 1-5 rows). From four dot products a line of codes (8-bit codes for 4-5
// rows, 4-bit for 2-5) the loop consumes the stream too slowly for the prefetcher to run far
// ahead, and each line came late: there each line is prefetched into L2 a page ahead, the 0.8B
// trunk and vocabulary projection 0.87-0.94x the time at 4-5 rows (8-bit) and 2-5 (4-bit),
// where 8-bit codes for 3 rows were level (docs/CPU_CHOICES.md).
//
// Without an unsigned-by-signed 4-byte sum (VNNI's), blocks of at least V::signed_codes_rows
// rows sum 8-bit codes u as signed codes c = u - 128 (V::to_signed): |c| times q with c's
// sign, whose pair sums fit 16 bits (2 * 128 * 127, where u's own would saturate: 2 * 255 *
// 127), each run's sum starting at 128 times the run's sum of q. The same integers as u times
// q, in one byte product a word where the nibbles took two.
template <class V, int RN>
constexpr bool signed_codes() {
  if constexpr (requires(typename V::ireg u) { V::to_signed(u); })
    return RN >= V::signed_codes_rows;
  else
    return false;
}

// A word's vector of 8-bit codes as the rows' sums take it (Signed: V::to_signed's), and one
// row's sum over it.
template <class V, bool Signed>
inline auto codes8(typename V::ireg u) {
  if constexpr (Signed)
    return V::to_signed(u);
  else
    return u;
}

template <class V, bool Signed, class Codes>
inline typename V::ireg dot8(typename V::ireg acc, const Codes& codes, typename V::ireg s) {
  if constexpr (Signed)
    return V::dot_signed(acc, codes, s);
  else
    return V::dot_u8(acc, codes, s);
}

template <class V, int Bits, int RN>
inline void interleaved_tile(const WeightView& wv, int64_t tile, const int8_t* q, int64_t qs,
                             const float* xscale, int64_t xss, const int32_t* run_sums,
                             const float* gs, int64_t gss,
                             typename V::reg (*c)[kInterleave / V::W]) {
  using reg = typename V::reg;
  using ireg = typename V::ireg;
  constexpr int N = kInterleave / V::W;  // vectors a tile
  constexpr int codes_a_word = 32 / Bits;
  constexpr int words_a_run = kRun / codes_a_word;
  constexpr int B = block_codes<Bits, V>();  // the activation's layout (quantize_rows)
  const int64_t words = wv.in / codes_a_word;  // a row's
  const int64_t groups = wv.in / wv.group;
  const auto* codes = static_cast<const uint32_t*>(wv.data) + tile * words * kInterleave;
  // a word's vectors are one line of codes, RN * 8 / Bits dot products
  constexpr bool kPageAhead = RN * 8 / Bits >= 4;
  constexpr bool kSigned = Bits == 8 && signed_codes<V, RN>();
  for (int r = 0; r < RN; ++r)
    for (int n = 0; n < N; ++n) c[r][n] = V::zero();
  for (int64_t run = 0; run < wv.in / kRun; ++run) {
    ireg d[RN][N];
    for (int r = 0; r < RN; ++r) {
      ireg start = V::izero();
      if constexpr (kSigned)
        start = V::splat_word(static_cast<uint32_t>(128 * run_sums[r * xss + run]));
      for (int n = 0; n < N; ++n) d[r][n] = start;
    }
    for (int w = 0; w < words_a_run; ++w) {
      const int64_t word = run * words_a_run + w;
      ireg v[N];
      const uint32_t* p = codes + word * kInterleave;
      if constexpr (kPageAhead) __builtin_prefetch(reinterpret_cast<const char*>(p) + 4096, 0, 2);
      for (int n = 0; n < N; ++n) v[n] = V::bytes(p + n * V::W);
      if constexpr (Bits == 8) {
        decltype(codes8<V, kSigned>(v[0])) c8[N];
        for (int n = 0; n < N; ++n) c8[n] = codes8<V, kSigned>(v[n]);
        for (int r = 0; r < RN; ++r) {
          uint32_t x4;
          std::memcpy(&x4, q + r * qs + word * 4, 4);
          const ireg b = V::splat_word(x4);
          for (int n = 0; n < N; ++n) d[r][n] = dot8<V, kSigned>(d[r][n], c8[n], b);
        }
      } else {
        // a word's low nibbles are its codes 0, 2, 4, 6, the high ones 1, 3, 5, 7: against the
        // activation's even and odd codes, which quantize_rows lays out four to a word
        ireg lo[N], hi[N];
        for (int n = 0; n < N; ++n) {
          lo[n] = V::low_nibbles(v[n]);
          hi[n] = V::high_nibbles(v[n]);
        }
        const int64_t k = word * codes_a_word;
        const int64_t even = k / B * B + k % B / 2;
        for (int r = 0; r < RN; ++r) {
          uint32_t xe, xo;
          std::memcpy(&xe, q + r * qs + even, 4);
          std::memcpy(&xo, q + r * qs + even + B / 2, 4);
          const ireg be = V::splat_word(xe), bo = V::splat_word(xo);
          for (int n = 0; n < N; ++n)
            d[r][n] = dot_u4_block<V>(d[r][n], lo[n], be, hi[n], bo);
        }
      }
    }
    const int64_t g = run * kRun / wv.group;
    for (int n = 0; n < N; ++n) {
      const reg scale =
          real_lanes<V>(wv.scales, wv.scale_type, (tile * groups + g) * kInterleave + n * V::W);
      for (int r = 0; r < RN; ++r)
        c[r][n] = V::fma(V::to_float(d[r][n]), V::mul(scale, V::splat(xscale[r * xss + run])),
                         c[r][n]);
    }
  }
  for (int64_t g = 0; g < groups; ++g)
    for (int n = 0; n < N; ++n) {
      const reg bias =
          real_lanes<V>(wv.biases, wv.scale_type, (tile * groups + g) * kInterleave + n * V::W);
      for (int r = 0; r < RN; ++r) c[r][n] = V::fma(bias, V::splat(gs[r * gss + g]), c[r][n]);
    }
}

// Rows t.. t + RN - 1 of the output, columns j0.. j0 + N * V::W - 1, from accumulators of one
// output a lane.
template <class V, int RN, int N>
inline void store_lanes(const ProductArgs& a, int t, int64_t j0, const typename V::reg (*c)[N]) {
  // a vector at a time where the ISA converts y's type as store_real does, bit for bit: element
  // by element through a stack copy, stores forwarded to narrower loads took a tenth of a 5-row
  // 8-bit product (perf, in-cache weight)
  if (a.y_type == Real::f32) {
    for (int r = 0; r < RN; ++r)
      for (int n = 0; n < N; ++n)
        V::store(static_cast<float*>(a.y) + (t + r) * a.w.out + j0 + n * V::W, c[r][n]);
    return;
  }
  if constexpr (requires(uint16_t* p, typename V::reg v) { V::store_bf16(p, v); }) {
    if (a.y_type == Real::bf16) {
      for (int r = 0; r < RN; ++r)
        for (int n = 0; n < N; ++n)
          V::store_bf16(static_cast<uint16_t*>(a.y) + (t + r) * a.w.out + j0 + n * V::W, c[r][n]);
      return;
    }
  }
  for (int r = 0; r < RN; ++r) {
    alignas(64) float lanes[N * V::W];
    for (int n = 0; n < N; ++n) V::store(lanes + n * V::W, c[r][n]);
    for (int j = 0; j < N * V::W; ++j)
      store_real(a.y, a.y_type, (t + r) * a.w.out + j0 + j, lanes[j]);
  }
}

// Rows t..t + RN - 1 of an interleaved weight's `tiles` tiles from column j0 on, one tile at a
// time: one stream of codes (two or four tiles side by side, sharing the activation's
// broadcast words, made a 0.8B 8-bit plain step 5% slower than row-major codes and one tile
// 5% faster; verifies of 3-5 as fast or faster).
template <class V, int Bits, int RN>
inline void interleaved_block(const ProductArgs& a, int t, int64_t j0, int tiles) {
  constexpr int N = kInterleave / V::W;
  const WeightView& wv = a.w;
  const QuantizedRows& xq = *a.quantized;
  const int64_t groups = wv.in / wv.group;
  const int8_t* q = xq.q.data() + t * xq.q_stride;
  const float* xscale = xq.scales.data() + t * xq.scale_stride;
  const int32_t* run_sums = xq.run_sums.data() + t * xq.scale_stride;
  const float* gs = xq.group_sums.data() + t * groups;
  for (int done = 0; done < tiles; ++done) {
    alignas(64) typename V::reg c[RN][N];
    interleaved_tile<V, Bits, RN>(wv, j0 / kInterleave + done, q, xq.q_stride, xscale,
                                  xq.scale_stride, run_sums, gs, groups, c);
    store_lanes<V, RN, N>(a, t, j0 + done * kInterleave, c);
  }
}

// Rows [t0, t0 + tn) at the tiles from j0 on, RN rows a block and the last few as a smaller one.
template <class V, int Bits, int RN>
inline void interleaved_blocks(const ProductArgs& a, int t0, int tn, int64_t j0, int tiles) {
  if constexpr (RN > 1) {
    if (tn < RN) return interleaved_blocks<V, Bits, RN - 1>(a, t0, tn, j0, tiles);
  }
  int t = t0;
  for (; t + RN <= t0 + tn; t += RN) interleaved_block<V, Bits, RN>(a, t, j0, tiles);
  if constexpr (RN > 1) {
    if (t < t0 + tn) interleaved_blocks<V, Bits, RN - 1>(a, t, t0 + tn - t, j0, tiles);
  }
}

// Columns [first, last) (whole tiles) of every row of an interleaved weight, x quantized
// (`a.quantized`): four tiles at a time, every block of rows over them before the next four, so
// that only the first block reads them from memory (a verify of 5 as a block of 4 and then one
// row over all the weights took 1.31x a row alone at the 0.8B shape, in blocks 1.15x at 4 rows).
template <class V>
inline void interleaved_columns(const ProductArgs& a, int64_t first, int64_t last) {
  constexpr int rows_a_block = V::W == 16 ? 5 : 2;  // what the registers hold
  constexpr int tiles_a_step = 4;
  for (int64_t j0 = first; j0 < last; j0 += tiles_a_step * kInterleave) {
    const int tiles =
        static_cast<int>(std::min<int64_t>(tiles_a_step, (last - j0) / kInterleave));
    if (a.w.bits == 8)
      interleaved_blocks<V, 8, rows_a_block>(a, 0, a.rows, j0, tiles);
    else
      interleaved_blocks<V, 4, rows_a_block>(a, 0, a.rows, j0, tiles);
  }
}

template <class V>
void columns(const ProductArgs& a, int64_t first, int64_t last) {
  using reg = typename V::reg;
  constexpr int R = V::R;
  constexpr int J = V::J;
  const WeightView& wv = a.w;
  const int64_t in = wv.in;
  const int64_t out = wv.out;
  const int64_t chunk = in <= kWholeRow ? in : kChunk;
  // Every row count reads the weights the same way (so rows stay bit-identical across counts):
  // floats in place or widened in registers (widening once per tile into a scratch instead
  // made bf16 products of 24 rows 3x slower; 512-column slices that stay in L1, every row tile
  // run over each, 1.1x slower at 24 rows and the same at 64 and 128 on an Intel Xeon VM: the
  // multiply-adds bound them, not the widening), 4- and 8-bit affine codes as integers against
  // 8-bit activations, other affine widths through the scratch.
  const bool integer = integer_affine<V>(wv);
  const bool in_registers = wv.kind != WeightKind::affine || integer;
  thread_local std::vector<float> scratch;  // J rows of one chunk, widened
  const int64_t scratch_stride = round_up(chunk, 16);
  if (!in_registers && scratch.size() < static_cast<size_t>(J * scratch_stride))
    scratch.resize(J * scratch_stride);
  thread_local std::vector<float> tile_scales;  // integer path: a tile's scales of one chunk
  thread_local std::vector<float> tile_biases;  // and its biases, laid out alike
  int64_t gs_stride = 0;
  // integer path: each lane's group and activation run from a block's first (once a call: as
  // constants of each tile they took 32 divisions a tile, a tenth of a 4-bit product)
  typename V::ireg lanes{}, runs{};
  if (integer) {
    const int codes_per_lane = wv.bits == 4 ? 8 : 4;
    lanes = V::lane_groups(codes_per_lane, wv.group);
    runs = V::lane_groups(codes_per_lane, kRun);
    const int64_t groups = chunk / wv.group;
    if (tile_scales.size() < static_cast<size_t>(J * (groups + V::W)))
      tile_scales.resize(J * (groups + V::W));
    if (tile_biases.size() < static_cast<size_t>(J * (groups + V::W)))
      tile_biases.resize(J * (groups + V::W));
    gs_stride = in / wv.group;
    // once a product, by whichever of its column blocks starts first
    a.quantized->once.run([&] {
      QuantizedRows& xq = *a.quantized;
      if (wv.bits == 4)
        quantize_rows<V, 4>(a.x, a.x_stride, a.rows, in, wv.group, xq);
      else
        quantize_rows<V, 8>(a.x, a.x_stride, a.rows, in, wv.group, xq);
    });
  }
  if (wv.interleaved) {
    interleaved_columns<V>(a, first, last);
    return;
  }
  const QuantizedRows* quantized = a.quantized;
  alignas(64) reg acc[kBlockRows][J];
  for (int t_begin = 0; t_begin < a.rows; t_begin += kBlockRows) {
    const int tn = std::min(kBlockRows, a.rows - t_begin);
    const float* xb = a.x + t_begin * a.x_stride;
    for (int64_t j0 = first; j0 < last; j0 += J) {
      const int jn = static_cast<int>(std::min<int64_t>(J, last - j0));
      for (int t = 0; t < tn; ++t)
        for (int j = 0; j < J; ++j) acc[t][j] = V::zero();
      for (int64_t k0 = 0; k0 < in; k0 += chunk) {
        const int64_t kn = std::min(chunk, in - k0);
        const float* xk = xb + k0;
        if (!in_registers) {
          F32Rows<V> rows{};
          for (int j = 0; j < jn; ++j) {
            float* row = scratch.data() + j * scratch_stride;
            decode_row<V>(wv, j0 + j, k0, kn, row);
            rows.row[j] = row;
          }
          row_tiles<V>(rows, jn, tn, kn, xk, a.x_stride, acc);
        } else if (integer) {
          const float* gs = quantized->group_sums.data() + t_begin * gs_stride;
          if (wv.bits == 8)
            code_tiles<V, 8>(wv, j0, jn, k0, kn, tn, *quantized, t_begin, gs, gs_stride,
                             tile_scales.data(), tile_biases.data(), lanes, runs, acc);
          else
            code_tiles<V, 4>(wv, j0, jn, k0, kn, tn, *quantized, t_begin, gs, gs_stride,
                             tile_scales.data(), tile_biases.data(), lanes, runs, acc);
        } else if (wv.kind == WeightKind::f32) {
          F32Rows<V> rows{};
          rows.ahead = J * in * 4;
          for (int j = 0; j < jn; ++j)
            rows.row[j] = static_cast<const float*>(wv.data) + (j0 + j) * in + k0;
          row_tiles<V>(rows, jn, tn, kn, xk, a.x_stride, acc);
        } else {
          const auto* base = static_cast<const uint16_t*>(wv.data);
          if (wv.kind == WeightKind::bf16) {
            HalfRows<V, true> rows{};
            rows.ahead = J * in * 2;
            for (int j = 0; j < jn; ++j) rows.row[j] = base + (j0 + j) * in + k0;
            row_tiles<V>(rows, jn, tn, kn, xk, a.x_stride, acc);
          } else {
            HalfRows<V, false> rows{};
            rows.ahead = J * in * 2;
            for (int j = 0; j < jn; ++j) rows.row[j] = base + (j0 + j) * in + k0;
            row_tiles<V>(rows, jn, tn, kn, xk, a.x_stride, acc);
          }
        }
      }
      for (int t = 0; t < tn; ++t) {
        alignas(64) float sums[J];
        if constexpr (requires { V::sums8(acc[t], sums); })
          V::sums8(acc[t], sums);  // all J: the accumulators past jn hold zeros
        else
          for (int j = 0; j < jn; ++j) sums[j] = V::sum(acc[t][j]);
        for (int j = 0; j < jn; ++j)
          store_real(a.y, a.y_type, (t_begin + t) * out + j0 + j, sums[j]);
      }
    }
  }
}

}  // namespace KERNEL_NAMESPACE
}  // namespace mtpserve
