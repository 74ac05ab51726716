// 16 floats as one value, and the dot products and sums built from them: the gated delta
// rule's state rows, an RMS norm's sum of squares and attention's scores all sum a dot product
// the same way — lane l takes elements l, l + 16, ..., the tail element by element from lane 0,
// then a fixed tree (lane l += lane l + w for w = 8, 4, 2, 1) — so one definition serves them.
//
// No namespace of its own and no include guard: each includer puts it inside its own namespace
// (an instruction set's kernel file inside that set's, so each copy is compiled with that
// set's flags; shared_lanes.h inside mtpserve for the rest), and the functions are always
// inlined, target clones included. GCC and clang lower each operation on a `Lanes` to the instruction
// set's own vectors (one AVX-512 register, two AVX2 ones, four SSE ones), lane by lane; the
// build turns floating-point contraction off, so every set computes the same bits.
// Needs <cstdint>.

constexpr int kLanes = 16;

typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
typedef float LanesUnaligned __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));
// 16 int32 lanes: exponent bits (exp.h), the activations' magnitudes (products.h).
typedef int32_t LaneInts __attribute__((vector_size(kLanes * sizeof(int32_t))));

__attribute__((always_inline)) inline Lanes load(const float* p) {
  return *reinterpret_cast<const LanesUnaligned*>(p);
}
__attribute__((always_inline)) inline void store(float* p, Lanes v) {
  *reinterpret_cast<LanesUnaligned*>(p) = v;
}

// The lanes' sum by the fixed tree (each step one shuffle and one add of the whole vector: the
// same adds a scalar loop would make).
__attribute__((always_inline)) inline float reduce(Lanes v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 0, 0, 0, 0, 0, 0, 0);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  v += __builtin_shufflevector(v, v, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  return v[0];
}

// out[r] = reduce(v[r]) for R rows: four rows' sums in one tree, each pairing its lanes exactly
// as reduce() does (l with l + 8, then + 4, + 2, + 1), so the same bits in fewer operations.
template <int R>
__attribute__((always_inline)) inline void reduce_rows(const Lanes* v, float* out) {
  if constexpr (R == 4) {
    // lanes 0-7: a's l + (l + 8); lanes 8-15: b's
    const auto eighths = [](Lanes a, Lanes b) -> Lanes {
      return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
             __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                     30, 31);
    };
    const Lanes ab = eighths(v[0], v[1]);
    const Lanes cd = eighths(v[2], v[3]);
    // blocks of 4: a's, b's, c's, d's l + (l + 4)
    const Lanes q = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24,
                                            25, 26, 27) +
                    __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28,
                                            29, 30, 31);
    // pairs: each row's l + (l + 2) in lanes 2r, 2r + 1
    const Lanes h = __builtin_shufflevector(q, q, 0, 1, 4, 5, 8, 9, 12, 13, 0, 0, 0, 0, 0, 0, 0, 0) +
                    __builtin_shufflevector(q, q, 2, 3, 6, 7, 10, 11, 14, 15, 0, 0, 0, 0, 0, 0, 0, 0);
    const Lanes s = __builtin_shufflevector(h, h, 0, 2, 4, 6, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0) +
                    __builtin_shufflevector(h, h, 1, 3, 5, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int r = 0; r < 4; ++r) out[r] = s[r];
  } else if constexpr (R % 4 == 0) {
    for (int r = 0; r < R; r += 4) reduce_rows<4>(v + r, out + r);
  } else {
    for (int r = 0; r < R; ++r) out[r] = reduce(v[r]);
  }
}

// out[c][r] = rows[r] . xs[c] over n elements for R rows and C vectors: each row and vector
// read once for all of them, R * C independent chains of adds (one dot alone waits on each of
// its adds); row r's sum with xs[c] is the same bits whatever R and C are.
template <int R, int C>
__attribute__((always_inline)) inline void dots_by(const float* const* rows,
                                                   const float* const* xs, int64_t n,
                                                   float (*out)[R]) {
  Lanes acc[C][R] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    Lanes rv[R];
    for (int r = 0; r < R; ++r) rv[r] = load(rows[r] + j);
    for (int c = 0; c < C; ++c) {
      const Lanes xv = load(xs[c] + j);
      for (int r = 0; r < R; ++r) acc[c][r] += rv[r] * xv;
    }
  }
  for (int c = 0; c < C; ++c) {
    for (int r = 0; r < R; ++r)
      for (int l = 0; j + l < n; ++l) acc[c][r][l] += rows[r][j + l] * xs[c][j + l];
    reduce_rows<R>(acc[c], out[c]);
  }
}
// out[r] = rows[r] . x over n elements for R rows (dots_by of one vector).
template <int R>
__attribute__((always_inline)) inline void dots(const float* const* rows, const float* x,
                                                int64_t n, float* out) {
  dots_by<R, 1>(rows, &x, n, reinterpret_cast<float(*)[R]>(out));
}
