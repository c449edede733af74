// y = x W^T for a weight on a 4-bit or an 8-bit grid, read from its 4 or 8 bits once for all the rows of x
// (policies/cpu_linear.py has the grids, the arithmetic and the measurements). torch's int4 CPU kernel unpacks the
// weight again for every 4 rows and rounds x, y and the scales to bf16; here each 16-output tile is unpacked into
// fp32 in vector registers and multiplied with up to kMaxRows rows of fp32 x at once: per group of 32 along K,
// d times the sum of q x (plus m times the sum of x for the 4-bit grid's zero), in fp32.
//
// Layout (built by cpu_linear.grid_tiles): for tile t of outputs 16t .. 16t + 15,
//   4 bits:  packed  uint8 [N / 16, K / 2, 16]:     byte [t, p, l] = q[16t + l, 2p] | q[16t + l, 2p + 1] << 4
//            scales  fp16  [N / 16, K / 32, 2, 16]: [t, g, 0, l] = d and [t, g, 1, l] = m of output 16t + l's group g
//   8 bits:  packed  int8  [N / 16, K, 16]:         [t, k, l] = q[16t + l, k]
//            scales  fp16  [N / 16, K / 32, 16]:    [t, g, l] = d of output 16t + l's group g
// The loops are written on GCC vector types of 16 lanes: one AVX-512 register, or two AVX2 ones.
//
// Where the CPU has AVX-512 VNNI (built with -mavx512vnni: policies/cpu_attention.py), a product takes x on a 16-bit
// grid instead: per row and group of 32, s = max |x| / 32767 and x16 = round(x / s), and a tile's q pairs (the two
// nibbles of a byte; at 8 bits the q of two neighbouring k) are multiplied with pairs of x16 by vpdpwssd, 32
// products an instruction summed in int32 (at 4 bits exactly: 15 * 32767 * 32 < 2^24, so the sum is exact in fp32
// too), then scaled by d s. So x is rounded to within s / 2 (a relative 1.5e-5 of the group's largest |x|; bf16
// rounds each x to 2^-9 of itself), and the multiply-adds per row are half the fp32 path's, on a weight unpacked in
// 3 instructions per 32 at 4 bits (not 5), 2 at 8 (not 4).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kLanes = 16;  // outputs per tile
constexpr int kGroup = 32;  // weights along K that share d and m
constexpr int kAhead = 8;  // groups ahead of the one in use whose q and scales are prefetched (into L2)
#if defined(__AVX512F__)
constexpr int kMaxRows = 8;  // rows multiplied per unpacked tile: their sums and partial sums in 16 of 32 registers
#else
constexpr int kMaxRows = 4;  // AVX2 has 16 registers of half the width: half the rows
#endif

typedef float Floats __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t Ints __attribute__((vector_size(kLanes * sizeof(int32_t))));

// 16 fp16 values as fp32 lanes.
inline Floats halves_to_floats(const at::Half* h) {
  Floats out;
#if defined(__AVX512F__)
  const __m512 wide = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
  std::memcpy(&out, &wide, sizeof(out));
#elif defined(__F16C__)
  const __m256 low = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
  const __m256 high = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 8)));
  std::memcpy(&out, &low, sizeof(low));
  std::memcpy(reinterpret_cast<char*>(&out) + sizeof(low), &high, sizeof(high));
#else
  for (int l = 0; l < kLanes; ++l) out[l] = static_cast<float>(h[l]);
#endif
  return out;
}

// The cache lines of `size` bytes from `start` asked for ahead of their use. The tiles a thread computes lie one
// after the other, so the groups ahead are the next ones in memory (past the last tile: a hint, never a fault);
// without it the loads of one row's product waited on memory (66 MB a decode step for SmolLM2's layers).
inline void prefetch(const void* start, int size) {
  for (int line = 0; line < size; line += 64) __builtin_prefetch(static_cast<const char*>(start) + line, 0, 2);
}

// 16 bytes (uint8_t or int8_t) widened to 16 int32 lanes (GCC's own conversion of a byte vector extracts them one
// by one).
template <typename Byte>
inline Ints widen(const Byte* bytes) {
  constexpr bool kSigned = std::is_signed_v<Byte>;
  Ints out;
#if defined(__AVX512F__)
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  const __m512i wide = kSigned ? _mm512_cvtepi8_epi32(raw) : _mm512_cvtepu8_epi32(raw);
  std::memcpy(&out, &wide, sizeof(out));
#elif defined(__AVX2__)
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)), upper = _mm_srli_si128(raw, 8);
  const __m256i low = kSigned ? _mm256_cvtepi8_epi32(raw) : _mm256_cvtepu8_epi32(raw);
  const __m256i high = kSigned ? _mm256_cvtepi8_epi32(upper) : _mm256_cvtepu8_epi32(upper);
  std::memcpy(&out, &low, sizeof(low));
  std::memcpy(reinterpret_cast<char*>(&out) + sizeof(low), &high, sizeof(high));
#else
  for (int l = 0; l < kLanes; ++l) out[l] = bytes[l];
#endif
  return out;
}

// How a tile of a Bits-bit weight lays out one group: its q (two a byte at 4 bits) and its scales (d and m at 4
// bits, d at 8).
template <int Bits>
struct Grid;
template <>
struct Grid<4> {
  using Byte = uint8_t;
  static constexpr int kBytes = kGroup / 2 * kLanes;
  static constexpr int kScales = 2;
};
template <>
struct Grid<8> {
  using Byte = int8_t;
  static constexpr int kBytes = kGroup * kLanes;
  static constexpr int kScales = 1;
};

// out[r, 0..15] = sum_k x[r, k] w[l, k] for R rows of x and one tile of a Bits-bit weight, w = d q (+ m at 4 bits):
// per group, d times the sums of q x (in kChains partial sums: a fused multiply-add waits ~4 cycles for its sum, so
// fewer than kMaxRows rows need more chains to keep the units busy, and more than the registers hold spill: two
// chains of 4 rows on AVX2 took 1.26x the time of one), plus at 4 bits m times the sum of x (x_sums, one per row
// and group).
template <int Bits, int R>
void tile_product(const float* x, const float* x_sums, int64_t columns, const typename Grid<Bits>::Byte* packed,
                  const at::Half* scales, float* out, int64_t out_stride) {
  constexpr int kChains = R >= kMaxRows ? 1 : kMaxRows / R;
  constexpr int kBytes = Grid<Bits>::kBytes, kScales = Grid<Bits>::kScales;
  const int64_t groups = columns / kGroup;
  Floats sums[R];
  for (int r = 0; r < R; ++r) sums[r] = Floats{};
  for (int64_t g = 0; g < groups; ++g) {
    Floats partial[R][kChains];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kChains; ++c) partial[r][c] = Floats{};
    const typename Grid<Bits>::Byte* bytes = packed + g * kBytes;
    const float* xg = x + g * kGroup;
    prefetch(bytes + kAhead * kBytes, kBytes);
    prefetch(scales + (g + kAhead) * kScales * kLanes, kScales * kLanes * sizeof(at::Half));
    if constexpr (Bits == 4) {
#pragma GCC unroll 16
      for (int p = 0; p < kGroup / 2; ++p) {
        const Ints q = widen(bytes + p * kLanes);
        const Floats even = __builtin_convertvector(q & 15, Floats);  // q[l, 2p]
        const Floats odd = __builtin_convertvector(q >> 4, Floats);   // q[l, 2p + 1]
        for (int r = 0; r < R; ++r) {
          partial[r][(2 * p) % kChains] += even * xg[r * columns + 2 * p];
          partial[r][(2 * p + 1) % kChains] += odd * xg[r * columns + 2 * p + 1];
        }
      }
    } else {
#pragma GCC unroll 32
      for (int k = 0; k < kGroup; ++k) {
        const Floats q = __builtin_convertvector(widen(bytes + k * kLanes), Floats);
        for (int r = 0; r < R; ++r) partial[r][k % kChains] += q * xg[r * columns + k];
      }
    }
    const Floats d = halves_to_floats(scales + g * kScales * kLanes);
    for (int r = 0; r < R; ++r) {
      Floats group = partial[r][0];
      for (int c = 1; c < kChains; ++c) group += partial[r][c];
      sums[r] += d * group;
    }
    if constexpr (Bits == 4) {
      const Floats m = halves_to_floats(scales + g * kScales * kLanes + kLanes);
      for (int r = 0; r < R; ++r) sums[r] += m * x_sums[r * groups + g];
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(out + r * out_stride, &sums[r], sizeof(Floats));
}

#if defined(__AVX512VNNI__)
constexpr bool kSixteenBitX = true;

// out[r, 0..15] = sum_k x[r, k] w[l, k] for R rows of x16 (x on its 16-bit grid: x = s x16, s per row and group)
// and one tile of a Bits-bit weight: per group, d s times the int32 sums of q x16 (in kChains sums, as above), plus
// at 4 bits m times the sum of x (x_sums, of the fp32 x). A tile's q come as pairs of 16-bit values, lane l's pair
// in its dword: at 4 bits the two nibbles of a byte (3 instructions per 32 q, where the fp32 path takes 5); at 8
// bits the q of k = 2p and 2p + 1 (two rows of 16 bytes) sign-extended and interleaved (2, where it takes 4), whose
// sums |sum| <= 127 * 32767 * 32 < 2^31 become fp32 within 2^-24 of themselves.
template <int Bits, int R>
void tile_product_x16(const int16_t* x16, const float* x_steps, const float* x_sums, int64_t columns,
                      const typename Grid<Bits>::Byte* packed, const at::Half* scales, float* out,
                      int64_t out_stride) {
  constexpr int kChains = R >= kMaxRows ? 1 : kMaxRows / R;
  constexpr int kBytes = Grid<Bits>::kBytes, kScales = Grid<Bits>::kScales;
  const int64_t groups = columns / kGroup;
  const __m512i nibbles = _mm512_set1_epi32(0x000F000F);  // a dword's low 16 bits q[2p], its high 16 q[2p + 1]
  // 16-bit element 2l of a pair of rows from element l of the first (q[2p, l]), 2l + 1 from l of the second
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  __m512 sums[R];
  for (int r = 0; r < R; ++r) sums[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i partial[R][kChains];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kChains; ++c) partial[r][c] = _mm512_setzero_si512();
    const typename Grid<Bits>::Byte* bytes = packed + g * kBytes;
    prefetch(bytes + kAhead * kBytes, kBytes);
    prefetch(scales + (g + kAhead) * kScales * kLanes, kScales * kLanes * sizeof(at::Half));
#pragma GCC unroll 16
    for (int p = 0; p < kGroup / 2; ++p) {
      __m512i q;
      if constexpr (Bits == 4) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + p * kLanes)));
        q = _mm512_ternarylogic_epi32(b, _mm512_slli_epi32(b, 12), nibbles, 0xA8);  // (b | b << 12) & mask
      } else {
        const auto* two_rows = reinterpret_cast<const __m256i*>(bytes + 2 * p * kLanes);
        q = _mm512_permutexvar_epi16(interleave, _mm512_cvtepi8_epi16(_mm256_loadu_si256(two_rows)));
      }
      for (int r = 0; r < R; ++r) {
        int32_t pair;  // x16[r, 2p] and x16[r, 2p + 1]
        std::memcpy(&pair, x16 + r * columns + g * kGroup + 2 * p, sizeof(pair));
        partial[r][p % kChains] = _mm512_dpwssd_epi32(partial[r][p % kChains], q, _mm512_set1_epi32(pair));
      }
    }
    const __m512 d = halves_to_floats(scales + g * kScales * kLanes);
    const __m512 m = Bits == 4 ? halves_to_floats(scales + g * kScales * kLanes + kLanes) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      __m512i group = partial[r][0];
      for (int c = 1; c < kChains; ++c) group = _mm512_add_epi32(group, partial[r][c]);
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(x_steps[r * groups + g]));
      sums[r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(group), sums[r]);
      if constexpr (Bits == 4) sums[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x_sums[r * groups + g]), sums[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * out_stride, sums[r]);
}
#else
constexpr bool kSixteenBitX = false;
#endif

}  // namespace

namespace {

// product(t, r, std::integral_constant<int, R>) for every tile t of the weight (the tiles split between torch's
// threads) and every block of R rows from row r on (blocks of kMaxRows, then 4, 2, 1).
template <typename Product>
void over_tiles_and_rows(int64_t tiles, int64_t rows, const Product& product) {
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t r = 0; r < rows;) {
        const int64_t left = rows - r;
        if (left >= kMaxRows) {
          product(t, r, std::integral_constant<int, kMaxRows>{});
          r += kMaxRows;
        } else if (kMaxRows > 4 && left >= 4) {
          product(t, r, std::integral_constant<int, 4>{});
          r += 4;
        } else if (left >= 2) {
          product(t, r, std::integral_constant<int, 2>{});
          r += 2;
        } else {
          product(t, r, std::integral_constant<int, 1>{});
          r += 1;
        }
      }
    }
  });
}

#if defined(__AVX512VNNI__)
constexpr int64_t kGroupsPerTask = 256;  // groups of x a thread puts on its grid at least (fewer: the caller alone)

// Each group of 32 values of x on its 16-bit grid: step s = max |x| / 32767 (0 for a group of zeros), x16 =
// round(x / s) to the nearest, ties to even (x * (1 / s) in fp32, rounded by the default MXCSR mode;
// cpu_linear.sixteen_bit_x is the same), and the group's sum of x (m's factor), two vector registers a group.
void x_on_sixteen_bits(const float* x, int64_t groups, int16_t* x16, float* steps, float* sums) {
  at::parallel_for(0, groups, kGroupsPerTask, [&](int64_t begin, int64_t end) {
    const __m512 sign = _mm512_set1_ps(-0.f);
    for (int64_t i = begin; i < end; ++i) {
      const __m512 low = _mm512_loadu_ps(x + i * kGroup), high = _mm512_loadu_ps(x + i * kGroup + kLanes);
      const float largest =
          _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, low), _mm512_andnot_ps(sign, high)));
      const float step = largest / 32767.f;
      const __m512 inverse = _mm512_set1_ps(step > 0.f ? 1.f / step : 0.f);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(x16 + i * kGroup),
                          _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(low, inverse))));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(x16 + i * kGroup + kLanes),
                          _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(high, inverse))));
      steps[i] = step;
      sums[i] = _mm512_reduce_add_ps(_mm512_add_ps(low, high));
    }
  });
}
#endif

void check_input(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() && x.size(1) % kGroup == 0,
              "x: float32 [M, K] contiguous, K a multiple of 32");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(2) == kLanes,
              "packed: [N / 16, ..., 16] contiguous");
  TORCH_CHECK(scales.scalar_type() == torch::kHalf && scales.is_contiguous() && scales.size(0) == packed.size(0) &&
                  scales.size(1) == x.size(1) / kGroup && scales.size(-1) == kLanes,
              "scales: float16 [N / 16, K / 32, ..., 16] contiguous");
}

}  // namespace

// y [rows, tiles * 16] = x [rows, columns] times the Bits-bit weight's tiles q, s (cpu_linear.grid_tiles), transposed;
// x and y contiguous, the shapes checked by the caller (grid_linear; policies/decode_step.cpp when a layer is added).
template <int Bits>
void grid_product(const float* in, int64_t rows, int64_t columns, const typename Grid<Bits>::Byte* q,
                  const at::Half* s, int64_t tiles, float* y) {
  const int64_t groups = columns / kGroup, out_stride = tiles * kLanes;
  std::vector<float> x_sums(Bits == 4 ? rows * groups : 0);  // sum of x over each group of each row (m's factor)
#if defined(__AVX512VNNI__)
  std::vector<int16_t> x16(rows * columns);
  std::vector<float> x_steps(rows * groups);
  x_sums.resize(rows * groups);  // the 8-bit grid has no m: its x sums go unused
  x_on_sixteen_bits(in, rows * groups, x16.data(), x_steps.data(), x_sums.data());
  over_tiles_and_rows(tiles, rows, [&](int64_t t, int64_t r, auto block) {
    tile_product_x16<Bits, decltype(block)::value>(x16.data() + r * columns, &x_steps[r * groups],
                                                   &x_sums[r * groups], columns, q + t * groups * Grid<Bits>::kBytes,
                                                   s + t * groups * Grid<Bits>::kScales * kLanes,
                                                   y + r * out_stride + t * kLanes, out_stride);
  });
  return;
#endif
  for (int64_t i = 0; i < static_cast<int64_t>(x_sums.size()); ++i) {
    float sum = 0.f;
    for (int k = 0; k < kGroup; ++k) sum += in[i * kGroup + k];
    x_sums[i] = sum;
  }
  over_tiles_and_rows(tiles, rows, [&](int64_t t, int64_t r, auto block) {
    tile_product<Bits, decltype(block)::value>(in + r * columns, x_sums.empty() ? nullptr : &x_sums[r * groups],
                                               columns, q + t * groups * Grid<Bits>::kBytes,
                                               s + t * groups * Grid<Bits>::kScales * kLanes,
                                               y + r * out_stride + t * kLanes, out_stride);
  });
}

// The checks of a Bits-bit weight's tiles against x's columns.
template <int Bits>
void check_grid(const torch::Tensor& packed, const torch::Tensor& scales, int64_t columns) {
  if constexpr (Bits == 4) {
    TORCH_CHECK(packed.scalar_type() == torch::kByte && packed.size(1) * 2 == columns && scales.dim() == 4 &&
                    scales.size(2) == 2,
                "a 4-bit weight: packed uint8 [N / 16, K / 2, 16], scales [N / 16, K / 32, 2, 16]");
  } else {
    TORCH_CHECK(packed.scalar_type() == torch::kChar && packed.size(1) == columns && scales.dim() == 3,
                "an 8-bit weight: packed int8 [N / 16, K, 16], scales [N / 16, K / 32, 16]");
  }
}

// x [M, K] fp32 contiguous times the Bits-bit weight [N, K] transposed: y [M, N] fp32.
template <int Bits>
torch::Tensor grid_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales) {
  check_input(x, packed, scales);
  check_grid<Bits>(packed, scales, x.size(1));
  const int64_t rows = x.size(0), tiles = packed.size(0);
  auto out = torch::empty({rows, tiles * kLanes}, x.options());
  grid_product<Bits>(x.data_ptr<float>(), rows, x.size(1), packed.data_ptr<typename Grid<Bits>::Byte>(),
                     scales.data_ptr<at::Half>(), tiles, out.data_ptr<float>());
  return out;
}

#ifndef SGLTTS_ONE_UNIT  // policies/decode_step.cpp is compiled after this file, with a module of its own
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("four_bit_linear", &grid_linear<4>, "x [M, K] fp32 times a 4-bit weight's tiles, transposed: [M, N] fp32");
  m.def("eight_bit_linear", &grid_linear<8>, "x [M, K] fp32 times an 8-bit weight's tiles, transposed: [M, N] fp32");
  m.attr("x_bits") = kSixteenBitX ? 16 : 32;  // x of a grid product: on its 16-bit grid, or fp32
}
#endif
