// AVX-512 with AMX-INT8 (Intel's tile matrix unit): 8-bit affine weights of products of 4 rows
// or more multiplied as tiles of 16 weight rows by 32 codes against tiles of the quantized
// activations, and a prompt's 4-bit and (with AMX-BF16) bf16 products on tiles too; every other
// weight on the AVX-512 VNNI kernel.
//
// y[t, o] = sum over runs j of  C[j][o, t] * (xs[t, j] * scale[o, g(j)])
//                               + (after a group's last run) bias[o, g] * group_sum[t, g]
// C[j][o, t] = sum over the run's 32 codes of code[o, i] * q[t, i]: with 4 rows or more one
// TDPBUSD a run (the codes, unsigned, the A tile, read where they lie; the activations, signed
// and quantized per run of 32 as on every instruction set, the B tile in the unit's
// 4-byte-interleaved layout, prepared once a product); with 1-3 rows VPDPBUSD's lane sums of
// four codes, a run's eight lanes added in integers (lane_columns). A run's sum is an exact
// integer either way, and each output's float sequence — one multiply-add a run, one a group
// for the bias, no horizontal sum — is the same whatever the row count, the way the sums were
// made or the thread: a row is bit for bit its one-row product. These are not the VNNI
// kernel's bits (that one sums floats lane by lane), so the whole instruction set takes one
// path or the other.
//
// A tile product costs about the same for 1 to 16 rows, the float work per run grows with them:
// every 8-bit projection of a Qwen3.5-0.8B-shaped token on a 2-core Xeon VM, taking turns with
// the VNNI kernel in one process (scripts/experiments/amx_token.py), is level with it at 1-3
// rows and faster from 4 (see docs/CPU_CHOICES.md). 4-bit codes unpacked to bytes
// for the tiles cost a product of 1-5 rows 1.2-1.6x the VNNI kernel's, so 4-bit weights stay on
// it while decoding; a prompt's products (ProductArgs::prompt: a prefill chunk, up to 128 rows)
// take the tiles for every row count, each 16-row weight tile unpacked once for all of them,
// so a prompt's rows are bit for bit the same however its chunks split. A prompt's bf16 products
// take TDPBF16PS over the activation in three bf16 parts (bf16_columns below).

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <vector>

#include "products.h"

namespace mtpserve {
namespace {

constexpr int kRun = kActivationRun;  // codes a tile product: one activation run
constexpr int kTile = 16;  // weight rows (outputs) a tile, activation rows a block
constexpr int kBTile = kRun / 4 * 64;  // bytes of one run's B tile (8 rows of 64)
// Products of up to this many rows take the VNNI instruction's lane sums (lane_columns): a tile
// product costs as much for one row as for 16, so 1-3 rows ran slower on tiles (0.8B-shaped
// token, 8 bits: 1 / 2 / 3 rows 41.9 / 43.5 / 51.0 ms on tiles, 36.3 / 39.9 / 46.8 by lanes, 4
// rows 49.2 on tiles).
constexpr int kLaneRows = 3;

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0-3: C, `m` outputs by `n` activation rows of int32; tmm4-5: A, `m` rows of 32 codes;
// tmm6-7: B, 8 rows of `n` x 4 bytes.
void configure(int m, int n) {
  TileConfig c;
  for (int i = 0; i < 4; ++i) {
    c.rows[i] = static_cast<uint8_t>(m);
    c.colsb[i] = static_cast<uint16_t>(n * 4);
  }
  for (int i = 4; i < 6; ++i) {
    c.rows[i] = static_cast<uint8_t>(m);
    c.colsb[i] = kRun;
  }
  for (int i = 6; i < 8; ++i) {
    c.rows[i] = kRun / 4;
    c.colsb[i] = static_cast<uint16_t>(n * 4);
  }
  _tile_loadconfig(&c);
}

// The activation rows as the product's path takes them, in blocks of 16 rows (zero rows past
// the last): q, [block][run] B tiles for tile products or the rows in order for lane sums (1-3
// rows); scales: [block][run][16] (xs); group_sums: [block][group][16], each the run-by-run
// sum of xs times the run's sum of q, as kernel_impl.h's quantize_rows.
void quantize(const ProductArgs& a, QuantizedRows& out) {
  const WeightView& w = a.w;
  const int64_t runs = w.in / kRun;
  const int64_t groups = w.in / w.group;
  const int runs_a_group = w.group / kRun;
  const int64_t blocks = (a.rows + kTile - 1) / kTile;
  // B tiles for tile products, the rows in order for lane sums (lane_columns)
  const bool tiled = a.rows > kLaneRows || w.bits == 4;
  out.q.assign(static_cast<size_t>(tiled ? blocks * runs * kBTile : a.rows * w.in), 0);
  out.scales.assign(static_cast<size_t>(blocks * runs * kTile), 0.0f);
  out.group_sums.assign(static_cast<size_t>(blocks * groups * kTile), 0.0f);
  int8_t q[kRun];
  for (int t = 0; t < a.rows; ++t) {
    const int64_t b = t / kTile;
    const int n = t % kTile;
    const float* xr = a.x + t * a.x_stride;
    for (int64_t j = 0; j < runs; ++j) {
      int32_t run_sum = 0;
      const float scale = quantize_run(xr + j * kRun, q, run_sum);
      if (tiled) {
        int8_t* tile = out.q.data() + (b * runs + j) * kBTile;
        for (int k = 0; k < kRun; k += 4) std::memcpy(tile + (k / 4) * 64 + n * 4, q + k, 4);
      } else {
        std::memcpy(out.q.data() + t * w.in + j * kRun, q, kRun);
      }
      out.scales[(b * runs + j) * kTile + n] = scale;
      float& sum = out.group_sums[(b * groups + j / runs_a_group) * kTile + n];
      sum = __builtin_fmaf(scale, static_cast<float>(run_sum), sum);
    }
  }
}

// n (<= 16) reals of `type` from element `first` of `p` as fp32 lanes, zero past n.
inline __m512 load_reals(const void* p, Real type, int64_t first, int n) {
  const __mmask16 k = static_cast<__mmask16>((1u << n) - 1u);
  switch (type) {
    case Real::f32:
      return _mm512_maskz_loadu_ps(k, static_cast<const float*>(p) + first);
    case Real::bf16: {
      const __m256i h = _mm256_maskz_loadu_epi16(k, static_cast<const uint16_t*>(p) + first);
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    default:
      return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, static_cast<const uint16_t*>(p) + first));
  }
}

// r[i] lane j <- r[j] lane i.
inline void transpose16(__m512 r[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  // u[4i + e], 128-bit lane k: element 4k + e of rows 4i .. 4i + 3
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512 x0 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0x88);
    const __m512 x1 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0xdd);
    const __m512 y0 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0x88);
    const __m512 y1 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0xdd);
    r[e] = _mm512_shuffle_f32x4(x0, y0, 0x88);
    r[8 + e] = _mm512_shuffle_f32x4(x0, y0, 0xdd);
    r[4 + e] = _mm512_shuffle_f32x4(x1, y1, 0x88);
    r[12 + e] = _mm512_shuffle_f32x4(x1, y1, 0xdd);
  }
}

// The [rows o0 .. o0 + m) x [groups] reals of `src` as fp32 in dst[g * 16 + row] (zero rows
// past m).
inline void transpose_groups(const void* src, Real type, int64_t o0, int m, int64_t groups,
                             float* dst) {
  __m512 r[16];
  for (int64_t g0 = 0; g0 < groups; g0 += 16) {
    const int len = static_cast<int>(std::min<int64_t>(16, groups - g0));
    for (int i = 0; i < 16; ++i)
      r[i] = i < m ? load_reals(src, type, (o0 + i) * groups + g0, len) : _mm512_setzero_ps();
    transpose16(r);
    if (len == 16) {  // a store each, from registers (the loop below became a rep movsq)
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + (g0 + i) * 16, r[i]);
    } else {
      for (int i = 0; i < len; ++i) _mm512_storeu_ps(dst + (g0 + i) * 16, r[i]);
    }
  }
}

// Rows [o0, o0 + m) of a [out, groups] scale or bias array into the cache, a line at a time.
inline void prefetch_groups(const void* src, Real type, int64_t o0, int m, int64_t groups) {
  const int64_t size = type == Real::f32 ? 4 : 2;
  const char* first = static_cast<const char*>(src) + o0 * groups * size;
  const char* end = first + m * groups * size;
  for (const char* p = first; p < end; p += 64) _mm_prefetch(p, _MM_HINT_T0);
}

// The scales and biases of the weight tile at o0 (m rows; the thread's columns end at `last`)
// as [group][16] floats, and the next tile's rows into the cache while this one's codes are
// read: those rows are a few lines every 16 KiB of codes, too sparse a stream for the hardware
// prefetcher, and waiting on them took ~6% of an 8-bit product's samples (0.8B shape, 4 rows).
inline void tile_groups(const WeightView& w, int64_t o0, int m, int64_t last, int64_t groups,
                        float* scales, float* biases) {
  transpose_groups(w.scales, w.scale_type, o0, m, groups, scales);
  transpose_groups(w.biases, w.scale_type, o0, m, groups, biases);
  if (o0 + kTile < last) {
    const int next = static_cast<int>(std::min<int64_t>(kTile, last - o0 - kTile));
    prefetch_groups(w.scales, w.scale_type, o0 + kTile, next, groups);
    prefetch_groups(w.biases, w.scale_type, o0 + kTile, next, groups);
  }
}

// Sixteen vectors' two runs of eight lanes each, added: lane i of out[h] is the sum of lanes
// 8h .. 8h + 7 of v[i] (pairs, then fours, then eights; integers, so any order is exact).
inline void run_sums16(const __m512i v[kTile], __m512i out[2]) {
  __m512i s2[8], t4[4];
  for (int i = 0; i < 8; ++i)
    s2[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  // lane (128-bit) L of t4[i] element e holds the sum of lane L of vector 4i + e
  for (int i = 0; i < 4; ++i)
    t4[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(s2[2 * i], s2[2 * i + 1]),
                             _mm512_unpackhi_epi64(s2[2 * i], s2[2 * i + 1]));
  // lanes 0-1 are the first run, 2-3 the second: [first of 0-3, second of 0-3, first of 4-7,
  // second of 4-7], then of 8-15
  const __m512i u01 = _mm512_add_epi32(_mm512_shuffle_i32x4(t4[0], t4[1], 0x88),
                                       _mm512_shuffle_i32x4(t4[0], t4[1], 0xdd));
  const __m512i u23 = _mm512_add_epi32(_mm512_shuffle_i32x4(t4[2], t4[3], 0x88),
                                       _mm512_shuffle_i32x4(t4[2], t4[3], 0xdd));
  out[0] = _mm512_shuffle_i32x4(u01, u23, 0x88);
  out[1] = _mm512_shuffle_i32x4(u01, u23, 0xdd);
}

// One 16-row weight tile of a product of N (1-3) rows on the VNNI instruction instead of
// tiles (lane_columns): the rows' run sums, then the same float work per run as the tile
// paths, so a row's outputs are the same bits.
template <int N>
struct LaneTile {
  int64_t o0 = 0;
  int m = 0;
  int64_t next_run = 0;  // the float work's next run
  __m512 acc[N];
  // run sums [t][span][half][weight row]: lane s of half h is run 32 span + 2 s + h of that
  // weight row (a span: 16 steps of 64 codes)
  std::vector<__m512i> sums;
  std::vector<float> scales, biases;  // [group][16 weight rows]
  __m512 by_run[N][2][kTile];  // the current span's sums, lane r: weight row r
};

// Products of 1-3 rows of 8-bit codes on the VNNI instruction: each weight row's 64-code
// steps against a row's quantized activation give 16 lane sums of 4 codes each, run_sums16
// adds sixteen steps into their 32 runs' exact sums, and a transpose turns a tile's rows of
// run sums into vectors of its 16 weight rows a run, for the float work. Each weight row is
// read from start to end (a step of all 16 rows in turn, 16 streams a row apart, read at
// 0.65 of the read bandwidth on an Intel Xeon VM: kernel_impl.h, code_row), and a tile's float
// work runs a sixteenth at a time between the next tile's rows, while their reads are under
// way (after the tile's last row, it took 0.05 of the read: scripts/experiments/kernel_token.cpp).
template <int N>
void lane_columns(const ProductArgs& a, int64_t first, int64_t last, const QuantizedRows& xq) {
  const WeightView& w = a.w;
  const int64_t in = w.in;
  const int64_t runs = in / kRun;
  const int64_t groups = in / w.group;
  const int runs_a_group = w.group / kRun;
  const int64_t steps = (in + 2 * kRun - 1) / (2 * kRun);  // 64 codes, 32 in an odd last one
  const int64_t spans = (steps + kTile - 1) / kTile;
  const int8_t* q = xq.q.data();
  const float* xs = xq.scales.data();
  const float* gs = xq.group_sums.data();
  thread_local LaneTile<N> tiles[2];  // the tile being read and the one being summed
  LaneTile<N>* reading = &tiles[0];
  LaneTile<N>* summing = &tiles[1];
  for (LaneTile<N>* t : {reading, summing}) {
    if (t->sums.size() < static_cast<size_t>(N * spans * 2 * kTile))
      t->sums.resize(N * spans * 2 * kTile);
    t->scales.resize(groups * kTile);
    t->biases.resize(groups * kTile);
  }
  bool pending = false;  // whether `summing` holds a tile whose float work is not done
  // the float work of runs [next_run, end) of tile `tile`
  const auto float_runs = [&](LaneTile<N>& tile, int64_t end) {
    for (int64_t j = tile.next_run; j < end; ++j) {
      const int64_t span = j / (2 * kTile);
      const int s = static_cast<int>(j % (2 * kTile)) / 2, h = static_cast<int>(j % 2);
      if (j % (2 * kTile) == 0)
        for (int t = 0; t < N; ++t)
          for (int hh = 0; hh < 2; ++hh) {
            const __m512i* rows = tile.sums.data() + ((t * spans + span) * 2 + hh) * kTile;
            for (int r = 0; r < kTile; ++r) tile.by_run[t][hh][r] = _mm512_castsi512_ps(rows[r]);
            transpose16(tile.by_run[t][hh]);
          }
      const int64_t g = j / runs_a_group;
      const __m512 scale = _mm512_loadu_ps(tile.scales.data() + g * kTile);
      for (int t = 0; t < N; ++t) {
        const __m512 ws = _mm512_mul_ps(_mm512_set1_ps(xs[j * kTile + t]), scale);
        tile.acc[t] = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(_mm512_castps_si512(tile.by_run[t][h][s])), ws, tile.acc[t]);
        if (j % runs_a_group == runs_a_group - 1)
          tile.acc[t] = _mm512_fmadd_ps(_mm512_loadu_ps(tile.biases.data() + g * kTile),
                                        _mm512_set1_ps(gs[g * kTile + t]), tile.acc[t]);
      }
    }
    tile.next_run = std::max(tile.next_run, end);
  };
  const auto finish = [&](LaneTile<N>& tile) {
    float_runs(tile, runs);
    for (int t = 0; t < N; ++t) {
      alignas(64) float out[kTile];
      _mm512_store_ps(out, tile.acc[t]);
      for (int r = 0; r < tile.m; ++r) store_real(a.y, a.y_type, t * w.out + tile.o0 + r, out[r]);
    }
  };
  for (int64_t o0 = first; o0 < last; o0 += kTile) {
    LaneTile<N>& tile = *reading;
    tile.o0 = o0;
    tile.m = static_cast<int>(std::min<int64_t>(kTile, last - o0));
    tile.next_run = 0;
    for (int t = 0; t < N; ++t) tile.acc[t] = _mm512_setzero_ps();
    tile_groups(w, o0, tile.m, last, groups, tile.scales.data(), tile.biases.data());
    __m512i* const sums_of = tile.sums.data();
    const uint8_t* codes = static_cast<const uint8_t*>(w.data) + o0 * in;
    for (int r = 0; r < kTile; ++r) {
      if (r < tile.m) {
        const uint8_t* row = codes + r * in;
        for (int64_t span = 0; span < spans; ++span) {
          __m512i v[N][kTile];
          for (int i = 0; i < kTile; ++i) {
            const int64_t k = (span * kTile + i) * 2 * kRun;
            if (k >= in) {
              for (int t = 0; t < N; ++t) v[t][i] = _mm512_setzero_si512();
              continue;
            }
            const uint8_t* p = row + k;
            // the line 512 bytes on into L1 and 4 KiB on into L2 (a tile's last rows reach
            // the next tile's first)
            __builtin_prefetch(p + 512, 0, 3);
            __builtin_prefetch(p + 4096, 0, 2);
            if (k + 2 * kRun <= in) {
              const __m512i c = _mm512_loadu_si512(p);
              for (int t = 0; t < N; ++t)
                v[t][i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c,
                                              _mm512_loadu_si512(q + t * in + k));
            } else {  // an odd last run
              const __mmask64 part = _cvtu64_mask64((uint64_t{1} << kRun) - 1);
              const __m512i c = _mm512_maskz_loadu_epi8(part, p);
              for (int t = 0; t < N; ++t)
                v[t][i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c,
                                              _mm512_maskz_loadu_epi8(part, q + t * in + k));
            }
          }
          for (int t = 0; t < N; ++t) {
            __m512i halves[2];
            run_sums16(v[t], halves);
            for (int h = 0; h < 2; ++h)
              sums_of[((t * spans + span) * 2 + h) * kTile + r] = halves[h];
          }
        }
      } else {
        for (int64_t i = 0; i < N * spans * 2; ++i) sums_of[i * kTile + r] = _mm512_setzero_si512();
      }
      if (pending) float_runs(*summing, (r + 1) * runs / kTile);
    }
    if (pending) finish(*summing);
    std::swap(reading, summing);
    pending = true;
  }
  if (pending) finish(*summing);
}

// The 4-bit codes of `m` weight rows (`in` codes each, two a byte: the even code in the low
// nibble) as one byte a code, rows `in` bytes apart: the A tiles' layout.
inline void unpack_codes(const uint8_t* packed, int m, int64_t in, uint8_t* dst) {
  const int64_t row_bytes = in / 2;
  const __m256i low = _mm256_set1_epi8(0x0f);
  for (int r = 0; r < m; ++r) {
    const uint8_t* src = packed + r * row_bytes;
    uint8_t* out = dst + r * in;
    int64_t i = 0;
    for (; i + 32 <= row_bytes; i += 32) {  // 64 codes
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
      const __m256i lo = _mm256_and_si256(v, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      // per 128-bit lane: bytes 0-7 (unpacklo) and 8-15 (unpackhi) of lo and hi interleaved
      const __m256i a = _mm256_unpacklo_epi8(lo, hi), b = _mm256_unpackhi_epi8(lo, hi);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2 * i),
                          _mm256_permute2x128_si256(a, b, 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2 * i + 32),
                          _mm256_permute2x128_si256(a, b, 0x31));
    }
    for (; i < row_bytes; ++i) {
      out[2 * i] = src[i] & 0x0f;
      out[2 * i + 1] = src[i] >> 4;
    }
  }
}

// Tile products of runs j0 .. j0 + count - 1 (count 1..4) into `c`, rows `cs` bytes apart: run
// j's codes at a + j * 32 (rows a_stride apart) against its B tile at b + j * kBTile.
inline void run_tiles(const uint8_t* a, int64_t a_stride, const int8_t* b, int64_t j0, int count,
                      int64_t cs, int32_t (*c)[kTile * kTile]) {
  constexpr int64_t a_step = kRun, b_step = kBTile;
  _tile_zero(0);
  _tile_loadd(4, a + j0 * a_step, a_stride);
  _tile_loadd(6, b + j0 * b_step, 64);
  _tile_dpbusd(0, 4, 6);
  if (count > 1) {
    _tile_zero(1);
    _tile_loadd(5, a + (j0 + 1) * a_step, a_stride);
    _tile_loadd(7, b + (j0 + 1) * b_step, 64);
    _tile_dpbusd(1, 5, 7);
  }
  if (count > 2) {
    _tile_zero(2);
    _tile_loadd(4, a + (j0 + 2) * a_step, a_stride);
    _tile_loadd(6, b + (j0 + 2) * b_step, 64);
    _tile_dpbusd(2, 4, 6);
  }
  if (count > 3) {
    _tile_zero(3);
    _tile_loadd(5, a + (j0 + 3) * a_step, a_stride);
    _tile_loadd(7, b + (j0 + 3) * b_step, 64);
    _tile_dpbusd(3, 5, 7);
  }
  _tile_stored(0, c[0], cs);
  if (count > 1) _tile_stored(1, c[1], cs);
  if (count > 2) _tile_stored(2, c[2], cs);
  if (count > 3) _tile_stored(3, c[3], cs);
}

void integer_columns(const ProductArgs& a, int64_t first, int64_t last) {
  const WeightView& w = a.w;
  const int64_t in = w.in;
  const int64_t out = w.out;
  const int64_t runs = in / kRun;
  const int64_t groups = in / w.group;
  const int runs_a_group = w.group / kRun;
  const int64_t row_bytes = in * w.bits / 8;
  // 4-bit codes take the tiles for every row count (a prompt's products), one byte a code in
  // this thread's scratch, unpacked once a weight tile for every block of rows
  const bool four_bit = w.bits == 4;
  thread_local std::vector<uint8_t> unpacked;
  if (four_bit && unpacked.size() < static_cast<size_t>(kTile * in)) unpacked.resize(kTile * in);
  const int64_t a_stride = in;  // bytes between an A tile's rows: a code a byte
  a.quantized->once.run([&] { quantize(a, *a.quantized); });
  const QuantizedRows& xq = *a.quantized;
  const int n = std::min(a.rows, kTile);
  if (n <= kLaneRows && !four_bit) {  // 1-3 rows of 8-bit codes: no tiles
    if (n == 1)
      lane_columns<1>(a, first, last, xq);
    else if (n == 2)
      lane_columns<2>(a, first, last, xq);
    else
      lane_columns<3>(a, first, last, xq);
    return;
  }
  const int64_t blocks = (a.rows + kTile - 1) / kTile;
  // a tile's scales and biases, [group][16], taken by pointer once (each use of a
  // thread_local in a shared library is a call)
  thread_local std::vector<float> tile_scales, tile_biases;
  tile_scales.resize(groups * kTile);
  tile_biases.resize(groups * kTile);
  float* const scales = tile_scales.data();
  float* const biases = tile_biases.data();
  alignas(64) int32_t c[2][4][kTile * kTile] = {};
  alignas(64) float lanes[kTile];
  int configured = 0;

  for (int64_t o0 = first; o0 < last; o0 += kTile) {
    const int m = static_cast<int>(std::min<int64_t>(kTile, last - o0));
    if (m != configured) {
      configure(m, n);
      configured = m;
    }
    tile_groups(w, o0, m, last, groups, scales, biases);
    const uint8_t* packed = static_cast<const uint8_t*>(w.data) + o0 * row_bytes;
    const uint8_t* codes = packed;  // the A tiles' rows, a_stride apart
    if (four_bit) {
      unpack_codes(packed, m, in, unpacked.data());
      codes = unpacked.data();
    }
    for (int64_t b = 0; b < blocks; ++b) {
      const int8_t* tile_b = xq.q.data() + b * runs * kBTile;
      const float* xs = xq.scales.data() + b * runs * kTile;
      const float* gs = xq.group_sums.data() + b * groups * kTile;
      // the tile products of runs in batches of four, each batch's sums combined while the
      // next batch's tile products run (a sum read back right after its tile store waits)
      const int64_t batches = (runs + 3) / 4;
      const auto tiles = [&](int64_t k) {  // runs 4k .. 4k + 3
        if (b == 0)  // the next tile's rows, a batch's 128 codes of each
          for (int r = 0; r < kTile; ++r) {
            const uint8_t* p = packed + (kTile + r) * row_bytes + 128 * w.bits / 8 * k;
            __builtin_prefetch(p, 0, 2);
            if (!four_bit) __builtin_prefetch(p + 64, 0, 2);
          }
        run_tiles(codes, a_stride, tile_b, 4 * k,
                  static_cast<int>(std::min<int64_t>(4, runs - 4 * k)), n * 4, c[k & 1]);
      };
      // every run in order, body(run, its sums), batch k's sums combined while batch k + 1's
      // tile products run
      const auto each_run = [&](auto&& body) {
        tiles(0);
        for (int64_t k = 0; k < batches; ++k) {
          if (k + 1 < batches) tiles(k + 1);
          const int64_t j0 = 4 * k, j1 = std::min<int64_t>(runs, j0 + 4);
          for (int64_t j = j0; j < j1; ++j) body(j, c[k & 1][j - j0]);
        }
      };
      // 4-8 rows: C (m outputs by n rows, row-major) read as n vectors of 16 (output, row)
      // pairs, each pair's scale product gathered into the same lanes by two permutes
      const auto pairs = [&](auto rows_const) {
        constexpr int N = decltype(rows_const)::value;
        __m512i output_of[N], row_of[N];
        for (int i = 0; i < N; ++i) {
          alignas(64) int32_t o_lane[kTile], t_lane[kTile];
          for (int l = 0; l < kTile; ++l) {
            o_lane[l] = (kTile * i + l) / N;
            t_lane[l] = (kTile * i + l) % N;
          }
          output_of[i] = _mm512_load_si512(o_lane);
          row_of[i] = _mm512_load_si512(t_lane);
        }
        __m512 acc[N];
        for (int i = 0; i < N; ++i) acc[i] = _mm512_setzero_ps();
        each_run([&](int64_t j, const int32_t* sums) {
          const int64_t g = j / runs_a_group;
          const __m512 xsv = _mm512_loadu_ps(xs + j * kTile);
          const __m512 wsv = _mm512_loadu_ps(scales + g * kTile);
          for (int i = 0; i < N; ++i) {
            const __m512 ws = _mm512_mul_ps(_mm512_permutexvar_ps(row_of[i], xsv),
                                            _mm512_permutexvar_ps(output_of[i], wsv));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums + kTile * i)), ws,
                                     acc[i]);
          }
          if (j % runs_a_group == runs_a_group - 1) {
            const __m512 gsv = _mm512_loadu_ps(gs + g * kTile);
            const __m512 bv = _mm512_loadu_ps(biases + g * kTile);
            for (int i = 0; i < N; ++i)
              acc[i] = _mm512_fmadd_ps(_mm512_permutexvar_ps(output_of[i], bv),
                                       _mm512_permutexvar_ps(row_of[i], gsv), acc[i]);
          }
        });
        alignas(64) float flat[kTile * N];
        for (int i = 0; i < N; ++i) _mm512_store_ps(flat + kTile * i, acc[i]);
        const int rows = static_cast<int>(std::min<int64_t>(kTile, a.rows - b * kTile));
        for (int r = 0; r < m; ++r)
          for (int t = 0; t < rows; ++t)
            store_real(a.y, a.y_type, (b * kTile + t) * out + o0 + r, flat[r * N + t]);
      };
      switch (n) {
        case 4: pairs(std::integral_constant<int, 4>{}); continue;
        case 5: pairs(std::integral_constant<int, 5>{}); continue;
        case 6: pairs(std::integral_constant<int, 6>{}); continue;
        case 7: pairs(std::integral_constant<int, 7>{}); continue;
        case 8: pairs(std::integral_constant<int, 8>{}); continue;
        default: break;
      }
      // more rows: each output's rows in one vector
      const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
      __m512 acc[kTile];
      for (int r = 0; r < kTile; ++r) acc[r] = _mm512_setzero_ps();
      each_run([&](int64_t j, const int32_t* sums) {
        const int64_t g = j / runs_a_group;
        const __m512 xsv = _mm512_loadu_ps(xs + j * kTile);
        const float* sg = scales + g * kTile;
        for (int r = 0; r < kTile; ++r) {
          const __m512 v = _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(valid, sums + r * n));
          acc[r] = _mm512_fmadd_ps(v, _mm512_mul_ps(xsv, _mm512_set1_ps(sg[r])), acc[r]);
        }
        if (j % runs_a_group == runs_a_group - 1) {
          const __m512 gsv = _mm512_loadu_ps(gs + g * kTile);
          const float* bg = biases + g * kTile;
          for (int r = 0; r < kTile; ++r)
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(bg[r]), gsv, acc[r]);
        }
      });
      const int rows = static_cast<int>(std::min<int64_t>(kTile, a.rows - b * kTile));
      for (int r = 0; r < m; ++r) {
        _mm512_store_ps(lanes, acc[r]);
        for (int t = 0; t < rows; ++t)
          store_real(a.y, a.y_type, (b * kTile + t) * out + o0 + r, lanes[t]);
      }
    }
  }
  if (configured) _tile_release();
}

// -- a prompt's bf16 weights: TDPBF16PS over the activation in three bf16 parts --------------
//
// y[t, o] = sum over steps of 32 columns k of  A[o, k..] . (hi + mid + lo)[t, k..]
// where x = hi + mid + lo exactly enough for fp32 (hi = bf16(x), mid = bf16(x - hi), lo =
// bf16(x - hi - mid)): each part's products are exact, and the tile sums them in fp32, C kept
// over the whole row. A (16 weight rows of 32 bf16) is read where it lies; B (16 column pairs by
// 16 activation rows, the unit's pair-interleaved layout) is prepared once an op, for all its
// bf16 weights (SharedRows).
// Each output's sequence is the same for every row count, so a prompt's chunks agree however
// they split (not the AVX-512 kernel's bits, which decoding keeps).

constexpr int kPairStep = 32;  // columns a tile product: 16 pairs
constexpr int kBf16BTile = 16 * 64;  // bytes of one part's B tile

// CPUID leaf 7's EDX: the AMX feature bits (22 BF16, 24 TILE, 25 INT8); 0 without the leaf.
inline unsigned amx_features() {
  unsigned eax, ebx, ecx, edx;
  return __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) ? edx : 0;
}

bool amx_bf16_usable() {
  static const bool usable = amx_usable() && (amx_features() & (1u << 22));
  return usable;
}

// tmm0-3: C, `m` outputs by `n` rows of fp32 (four blocks of rows); tmm4: A, `m` rows of 32
// bf16; tmm5-7: the three parts' B tiles, 16 pairs by `n` rows.
void configure_bf16(int m, int n) {
  TileConfig c;
  for (int i = 0; i < 4; ++i) {
    c.rows[i] = static_cast<uint8_t>(m);
    c.colsb[i] = static_cast<uint16_t>(n * 4);
  }
  c.rows[4] = static_cast<uint8_t>(m);
  c.colsb[4] = 64;
  for (int i = 5; i < 8; ++i) {
    c.rows[i] = 16;
    c.colsb[i] = static_cast<uint16_t>(n * 4);
  }
  _tile_loadconfig(&c);
}

// 16 floats rounded to bf16 (nearest, ties to even) as the high halves of 32-bit lanes, the
// rest zero; inf and NaN stay what they are (a row's non-finite input stays in its outputs),
// and a finite |x| within half a bf16 step of fp32's largest rounds to inf.
inline __m512i bf16_high(__m512 x) {
  return _mm512_and_si512(bf16_rounded_bits(x), _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
}

// B tiles of every block of 16 rows (zero rows past the last), step and part:
// b[((block * steps + s) * 3 + part) * kBf16BTile], pair r of row n at bytes r * 64 + n * 4.
void split_rows(const ProductArgs& a, std::vector<uint16_t>& b) {
  const int64_t steps = a.w.in / kPairStep;
  const int64_t blocks = (a.rows + kTile - 1) / kTile;
  b.assign(static_cast<size_t>(blocks * steps * 3 * kBf16BTile / 2), 0);
  auto* tiles = reinterpret_cast<int32_t*>(b.data());
  constexpr int64_t kTileWords = kBf16BTile / 4;
  // pair r of a half's 16 columns (columns 2r, 2r + 1) is row r of the tile: 16 words apart
  const __m256i pair_rows = _mm256_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112);
  const __m512i low16 = _mm512_set1_epi64(0xffff), high16 = _mm512_set1_epi64(0xffff0000);
  for (int t = 0; t < a.rows; ++t) {
    const int64_t block = t / kTile;
    const int n = t % kTile;
    const float* xr = a.x + t * a.x_stride;
    for (int64_t s = 0; s < steps; ++s) {
      int32_t* step = tiles + (block * steps + s) * 3 * kTileWords + n;
      for (int h = 0; h < 2; ++h) {
        __m512 rest = _mm512_loadu_ps(xr + s * kPairStep + 16 * h);
        for (int part = 0; part < 3; ++part) {
          const __m512i high = bf16_high(rest);
          rest = _mm512_sub_ps(rest, _mm512_castsi512_ps(high));
          // 64-bit lane r: column 2r's bf16 in its low 16 bits, column 2r + 1's above
          const __m512i pairs =
              _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi64(high, 16), low16),
                              _mm512_and_si512(_mm512_srli_epi64(high, 32), high16));
          _mm256_i32scatter_epi32(step + part * kTileWords + h * 8 * 16, pair_rows,
                                  _mm512_cvtepi64_epi32(pairs), 4);
        }
      }
    }
  }
}

void bf16_columns(const ProductArgs& a, int64_t first, int64_t last) {
  const WeightView& w = a.w;
  const int64_t in = w.in;
  const int64_t out = w.out;
  const int64_t steps = in / kPairStep;
  const int64_t row_bytes = in * 2;
  a.shared->once.run([&] { split_rows(a, a.shared->bf16_parts); });
  const uint16_t* b_tiles = a.shared->bf16_parts.data();
  const int n = std::min(a.rows, kTile);
  const int64_t blocks = (a.rows + kTile - 1) / kTile;
  alignas(64) float c[kTile * kTile];
  int configured = 0;
  for (int64_t o0 = first; o0 < last; o0 += kTile) {
    const int m = static_cast<int>(std::min<int64_t>(kTile, last - o0));
    if (m != configured) {
      configure_bf16(m, n);
      configured = m;
    }
    const auto* weights = static_cast<const uint8_t*>(w.data) + o0 * row_bytes;
    constexpr int64_t part = kBf16BTile / 2;  // uint16 a part's tile
    // up to four blocks of rows at a time (C in tmm0-3): each A tile loaded once for them
    for (int64_t block = 0; block < blocks; block += 4) {
      const int count = static_cast<int>(std::min<int64_t>(4, blocks - block));
      const uint16_t* b0 = b_tiles + block * steps * 3 * part;
      const int64_t block_step = steps * 3 * part;
      _tile_zero(0);
      if (count > 1) _tile_zero(1);
      if (count > 2) _tile_zero(2);
      if (count > 3) _tile_zero(3);
#define MTPSERVE_BF16_PARTS(C, K)                             \
  {                                                           \
    const uint16_t* pk = b0 + (K) * block_step + s * 3 * part; \
    _tile_loadd(5, pk, 64);                                   \
    _tile_loadd(6, pk + part, 64);                            \
    _tile_loadd(7, pk + 2 * part, 64);                        \
    _tile_dpbf16ps(C, 4, 5);                                  \
    _tile_dpbf16ps(C, 4, 6);                                  \
    _tile_dpbf16ps(C, 4, 7);                                  \
  }
      for (int64_t s = 0; s < steps; ++s) {
        _tile_loadd(4, weights + s * 64, row_bytes);
        MTPSERVE_BF16_PARTS(0, 0)
        if (count > 1) MTPSERVE_BF16_PARTS(1, 1)
        if (count > 2) MTPSERVE_BF16_PARTS(2, 2)
        if (count > 3) MTPSERVE_BF16_PARTS(3, 3)
      }
#undef MTPSERVE_BF16_PARTS
      for (int k = 0; k < count; ++k) {
        switch (k) {
          case 0: _tile_stored(0, c, n * 4); break;
          case 1: _tile_stored(1, c, n * 4); break;
          case 2: _tile_stored(2, c, n * 4); break;
          default: _tile_stored(3, c, n * 4);
        }
        const int64_t bk = block + k;
        const int rows = static_cast<int>(std::min<int64_t>(kTile, a.rows - bk * kTile));
        for (int r = 0; r < m; ++r)
          for (int t = 0; t < rows; ++t)
            store_real(a.y, a.y_type, (bk * kTile + t) * out + o0 + r, c[r * n + t]);
      }
    }
  }
  if (configured) _tile_release();
}

}  // namespace

bool amx_usable() {
  static const bool usable = [] {
    const unsigned edx = amx_features();
    const bool tile = edx & (1u << 24), int8 = edx & (1u << 25);
    // Linux hands a process the tile state only when asked (ARCH_REQ_XCOMP_PERM, XTILEDATA)
    constexpr int kRequestPermission = 0x1023, kTileData = 18;
    return tile && int8 && syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return usable;
}

void columns_amx(const ProductArgs& a, int64_t first, int64_t last) {
  const WeightView& w = a.w;
  if (w.interleaved) {  // the tiles take row-major codes
    columns_avx512_vnni(a, first, last);
    return;
  }
  if (w.kind == WeightKind::affine && (w.bits == 8 || (w.bits == 4 && a.prompt)) &&
      w.group % kRun == 0) {
    integer_columns(a, first, last);
    return;
  }
  if (a.prompt && w.kind == WeightKind::bf16 && w.in % kPairStep == 0 && amx_bf16_usable()) {
    bf16_columns(a, first, last);
    return;
  }
  columns_avx512_vnni(a, first, last);
}

}  // namespace mtpserve
