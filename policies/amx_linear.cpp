// y = x W^T on AMX's bf16 tiles, called directly: fp32 x rounded to bf16 (nearest, ties to even) into a buffer of
// whole tiles, a weight rounded to bf16 once and kept in the tiles' layout, and the tile unit's fp32 sums stored as
// y, fp32, with no rounding of the result (policies/cpu_linear.py has the arithmetic and the measurements).
//
// A tile product C += A B (_tile_dpbf16ps) takes A: 16 rows of 32 bf16 (16 rows of x, 32 along K), B: 16 rows of
// 16 pairs (the pairs of K of 16 outputs) and C: 16 x 16 fp32 sums:
//     C[m][n] += sum_p A[m][2p] B[p][2n] + A[m][2p + 1] B[p][2n + 1]
// so the weight [N, K] is kept as tiles of 16 outputs by 32 along K (cpu_linear.amx_tiles):
//     packed bf16 [N / 16, K / 32, 16, 32]:  [t, g, p, 2l + j] = W[16t + l, 32g + 2p + j]
// A block is 32 rows by 32 outputs: two A tiles, two B tiles, four C tiles (the 8 tile registers); a call of at most
// 16 rows takes one A tile of its rows and two C tiles, half the tile products (`Narrow`). The pairs of
// output tiles are split over the threads and taken a chunk of ~512 KB of weight at a time; each block of rows
// passes every pair of the chunk, so the block's x (36 KB at K = 576) stays in L1 and the chunk's weight, read from
// memory once (the first block prefetching it 8 groups of K ahead), stays in L2 for the other blocks of rows.
// Without the chunks and the prefetch the products were no faster than oneDNN's; with them one step's decoder
// products at 64-128 rows took 0.73-0.83x oneDNN's time (policies/cpu_linear.py).
//
// A weight on a 4- or 8-bit grid (cpu_linear.grid_tiles) needs no bf16 copy: amx_grid_product unpacks each chunk
// from the grid's q and fp16 scales into bf16 tiles in a buffer of the thread's (w = d q + m, rounded as the copy
// is), then the blocks of rows pass it as above: the same products to the bit, the weight read from memory in 4 or
// 8 bits (and its scales) instead of 16.
//
// Built with the tiles only where policies/cpu_attention.py defines SGLTTS_AMX (a CPU whose /proc/cpuinfo lists
// amx_bf16), and then only the functions here target AMX and AVX-512 BF16 (the pragma below): the kernels compiled
// in one unit with this file keep their own code. Linux lends a process the tile registers once it asks (arch_prctl
// ARCH_REQ_XCOMP_PERM), which `amx_ready` does once.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(SGLTTS_AMX)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kTileRows = 16;  // rows of x (and outputs) a tile holds
constexpr int64_t kTileDepth = 32;  // bf16 along K a tile row holds (64 bytes)
constexpr int64_t kTileElements = kTileRows * kTileDepth;  // one weight tile: 16 pairs-rows of 32 bf16
constexpr int64_t kPrefetchGroups = 8;  // groups of K ahead whose weight tiles a first pass prefetches
constexpr int64_t kChunkBytes = 512 * 1024;  // weight a block of rows passes before the next block (in L2)

#if defined(SGLTTS_AMX)
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512bf16")
constexpr long kGetPermission = 0x1022;  // ARCH_GET_XCOMP_PERM
constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
constexpr long kTileData = 18;  // XFEATURE_XTILEDATA

// Whether this process may use the tile registers (asked for once).
bool amx_ready() {
  static const bool ready = [] {
    unsigned long features = 0;
    if (syscall(SYS_arch_prctl, kGetPermission, &features) == 0 && (features & (1ul << kTileData))) return true;
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return ready;
}

// Palette 1 with tiles 0-7 of 64 bytes a row, for a call of `x_rows` rows: C tiles 0-3 and A tiles 4-5 of 16 rows,
// or of the call's rows where they fit one A tile (its blocks are `Narrow`, below); B tiles 6-7 of 16.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
  explicit TileConfig(int64_t x_rows) {
    const auto a_rows = static_cast<uint8_t>(std::min(x_rows, kTileRows));
    for (int i = 0; i < 8; ++i) bytes_per_row[i] = 64, rows[i] = i < 6 ? a_rows : kTileRows;
  }
};

// rows of x [rows, K] fp32 -> bf16 [padded, K], rounded to nearest (ties to even), rows past `rows` zero.
void round_rows(const float* x, int64_t rows, int64_t padded, int64_t columns, uint16_t* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* from = x + r * columns;
    uint16_t* to = out + r * columns;
    for (int64_t k = 0; k < columns; k += 32) {
      const __m512bh pairs = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(from + k + 16), _mm512_loadu_ps(from + k));
      _mm512_storeu_si512(to + k, reinterpret_cast<const __m512i&>(pairs));
    }
  }
  std::memset(out + rows * columns, 0, (padded - rows) * columns * sizeof(uint16_t));
}

// The rows of a C tile stored to scratch (16 x 16 fp32), copied to y's rows from `row` that are valid (below `rows`).
inline void copy_rows(const float* scratch, float* y, int64_t stride, int64_t row, int64_t rows, int64_t column) {
  for (int64_t r = 0; r < rows - row; ++r)
    std::memcpy(y + (row + r) * stride + column, scratch + r * kTileRows, kTileRows * sizeof(float));
}

// C tile `TILE` to y's rows from `ROW` (those below `rows`), columns from `COLUMN` (a macro: the tile intrinsics
// take the register's number as a literal).
#define SGLTTS_STORE(TILE, ROW, COLUMN)                                                        \
  if ((ROW) + kTileRows <= rows) {                                                             \
    _tile_stored(TILE, y + (ROW) * outputs + (COLUMN), outputs * sizeof(float));               \
  } else if ((ROW) < rows) {                                                                   \
    _tile_stored(TILE, scratch, kTileRows * sizeof(float));                                    \
    copy_rows(scratch, y, outputs, ROW, rows, COLUMN);                                         \
  }

// The word order of a tile row from _mm512_cvtne2ps_pbh(odd, even) (even's 16 bf16, then odd's): output l's pair
// (2l, 2l + 1) is words l and 16 + l.
alignas(64) constexpr int16_t kPairWords[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// Group g (32 along K) of tile t of a weight on a 4- or 8-bit grid (cpu_linear.grid_tiles' layout: q of 16 outputs
// side by side, fp16 d and m per output and group) as the bf16 tile amx_product reads, into `tile` [16, 32]: w = d q
// + m in fp32 (one rounding), then rounded to bf16 (nearest, ties to even), as amx_tiles rounds the fp32 weight. A
// row p of the tile holds the pairs (2p, 2p + 1) along K of the 16 outputs, which the grid keeps in one 16-byte vector
// at 4 bits (low and high nibble) and in two at 8 bits (k and k + 1): widened to 32-bit lanes (output l in lane l, as
// its d and m), computed and rounded as two vectors of 16, then their words interleaved by one permutation.
template <int Bits>
inline void unpack_group(const uint8_t* packed, const at::Half* scales, int64_t columns, int64_t t, int64_t g,
                         uint16_t* tile) {
  const int64_t groups = columns / kTileDepth;
  const __m512i pair_words = _mm512_load_si512(kPairWords);
  constexpr int64_t kScalesPerGroup = (Bits == 4 ? 2 : 1) * kTileRows;  // d (and m) of 16 outputs
  const at::Half* s = scales + (t * groups + g) * kScalesPerGroup;
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
  const __m512 m = Bits == 4 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 16)))
                             : _mm512_setzero_ps();
  // The q and scales kPrefetchGroups groups on, into cache: a tile's groups, and the tiles, lie one after the other
  // (past the last tile: a hint, never a fault).
  constexpr int64_t kGroupBytes = kTileRows * kTileDepth * Bits / 8;
  const uint8_t* ahead = packed + (t * groups + g + kPrefetchGroups) * kGroupBytes;
  for (int64_t line = 0; line < kGroupBytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(s + kPrefetchGroups * kScalesPerGroup), _MM_HINT_T0);
  for (int64_t p = 0; p < kTileRows; ++p) {
    __m512i even, odd;
    if constexpr (Bits == 4) {  // [t, K / 2, 16] bytes: q[2p] | q[2p + 1] << 4
      const uint8_t* bytes = packed + (t * columns / 2 + g * kTileRows + p) * kTileRows;
      const __m512i both = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
      even = _mm512_and_si512(both, _mm512_set1_epi32(15));
      odd = _mm512_srli_epi32(both, 4);
    } else {  // [t, K, 16] int8: q[2p] of the 16 outputs, then q[2p + 1]
      const uint8_t* bytes = packed + (t * columns + g * kTileDepth + 2 * p) * kTileRows;
      even = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
      odd = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + kTileRows)));
    }
    const __m512bh words = _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(_mm512_cvtepi32_ps(odd), d, m),
                                               _mm512_fmadd_ps(_mm512_cvtepi32_ps(even), d, m));
    _mm512_storeu_si512(tile + p * kTileDepth,
                        _mm512_permutexvar_epi16(pair_words, reinterpret_cast<const __m512i&>(words)));
  }
}

// The tiles of a chunk of a grid weight being unpacked into `out` [count, K / 32, 16, 32] a few groups at a time:
// `some` is called between the tile products of the chunk before, so that the vector units unpack while the tile
// unit multiplies; `rest` unpacks what is left.
struct Unpacking {
  const uint8_t* packed;
  const at::Half* scales;
  int64_t columns, groups;
  int bits;
  int64_t first = 0, total = 0, done = 0, per_call = 0;  // tiles from `first`: groups in all, unpacked, a call
  uint16_t* out = nullptr;

  // `count` tiles from `tile` into `into`, over `calls` calls of `some`.
  void start(int64_t tile, int64_t count, uint16_t* into, int64_t calls) {
    first = tile, total = count * groups, done = 0, out = into;
    per_call = (total + calls - 1) / std::max<int64_t>(calls, 1);
  }
  void one() {  // the next group: tile first + done / groups, group done % groups, at out's tile `done`
    if (bits == 4) {
      unpack_group<4>(packed, scales, columns, first + done / groups, done % groups, out + done * kTileElements);
    } else {
      unpack_group<8>(packed, scales, columns, first + done / groups, done % groups, out + done * kTileElements);
    }
    ++done;
  }
  void some() {
    for (int64_t i = 0; i < per_call && done < total; ++i) one();
  }
  void rest() {
    while (done < total) one();
  }
};

// One block of 32 rows (from `row`) by 16 Outputs x 16 outputs (the weight's tiles from b0, y's columns from
// `column`): C = A B over all of K, `between()` called after each group's tile products are issued. `Narrow`: x's
// rows (at most 16) are one A tile of as many rows, and the block is those rows alone: half the tile products of a
// block of 32.
template <int Outputs, bool Narrow, typename Between>
inline void block(const uint16_t* a, int64_t columns, int64_t row, int64_t rows, const uint16_t* b0, int64_t column,
                  float* y, int64_t outputs, float* scratch, bool prefetch, Between& between) {
  const int64_t groups = columns / kTileDepth, a_stride = columns * sizeof(uint16_t);
  const uint16_t* a0 = a + row * columns;
  const uint16_t* a1 = a0 + kTileRows * columns;
  const uint16_t* b1 = b0 + groups * kTileElements;
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (!Narrow) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t g = 0; g < groups; ++g) {
    if (prefetch) {  // the weight's tiles kPrefetchGroups groups on, into cache: a first pass reads them from memory
      const char* ahead = reinterpret_cast<const char*>(b0 + (g + kPrefetchGroups) * kTileElements);
      for (int line = 0; line < Outputs * 16; ++line)
        _mm_prefetch(ahead + (line & 15) * 64 + (line >> 4) * groups * kTileElements * sizeof(uint16_t),
                     _MM_HINT_T0);
    }
    _tile_loadd(4, a0 + g * kTileDepth, a_stride);
    if constexpr (!Narrow) _tile_loadd(5, a1 + g * kTileDepth, a_stride);
    _tile_loadd(6, b0 + g * kTileElements, kTileDepth * sizeof(uint16_t));
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (!Narrow) _tile_dpbf16ps(2, 5, 6);
    if constexpr (Outputs == 2) {
      _tile_loadd(7, b1 + g * kTileElements, kTileDepth * sizeof(uint16_t));
      _tile_dpbf16ps(1, 4, 7);
      if constexpr (!Narrow) _tile_dpbf16ps(3, 5, 7);
    }
    between();
  }
  if constexpr (Narrow) {  // C tiles of x's rows alone
    _tile_stored(0, y + column, outputs * sizeof(float));
    if constexpr (Outputs == 2) _tile_stored(1, y + column + kTileRows, outputs * sizeof(float));
  } else {
    SGLTTS_STORE(0, row, column)
    SGLTTS_STORE(2, row + kTileRows, column)
    if constexpr (Outputs == 2) {
      SGLTTS_STORE(1, row, column + kTileRows)
      SGLTTS_STORE(3, row + kTileRows, column + kTileRows)
    }
  }
}

// The pairs of output tiles first .. last - 1, whose tiles start at `tiles_of_first` (K / 32 groups a tile): each
// block of 32 rows passes every pair, so the rows' tiles stay in L1 while the pairs' weight stays in L2; the first
// block prefetches the weight ahead where `prefetch` (a first pass reads it from memory).
template <bool Narrow, typename Between>
void pass_pairs_of(const uint16_t* a, int64_t rows, int64_t columns, const uint16_t* tiles_of_first, int64_t first,
                   int64_t last, int64_t tiles, float* y, float* scratch, bool prefetch, Between& between) {
  const int64_t groups = columns / kTileDepth, outputs = tiles * kTileRows;
  for (int64_t row = 0; row < rows; row += 2 * kTileRows) {
    for (int64_t pair = first; pair < last; ++pair) {
      const int64_t t = 2 * pair;
      const uint16_t* b0 = tiles_of_first + (t - 2 * first) * groups * kTileElements;
      const bool ahead = prefetch && row == 0;
      if (t + 1 < tiles) {
        block<2, Narrow>(a, columns, row, rows, b0, t * kTileRows, y, outputs, scratch, ahead, between);
      } else {
        block<1, Narrow>(a, columns, row, rows, b0, t * kTileRows, y, outputs, scratch, ahead, between);
      }
    }
  }
}

template <typename Between>
void pass_pairs(const uint16_t* a, int64_t rows, int64_t columns, const uint16_t* tiles_of_first, int64_t first,
                int64_t last, int64_t tiles, float* y, float* scratch, bool prefetch, Between& between) {
  if (rows <= kTileRows) {
    pass_pairs_of<true>(a, rows, columns, tiles_of_first, first, last, tiles, y, scratch, prefetch, between);
  } else {
    pass_pairs_of<false>(a, rows, columns, tiles_of_first, first, last, tiles, y, scratch, prefetch, between);
  }
}

// y [rows, N] = bf16 x [padded rows, K] (`rounded_blocks`) times the packed weight [N / 16, K / 32, 16, 32]. The
// pairs of output tiles go by chunks of about kChunkBytes of weight (`pass_pairs`), the chunk's weight read from
// memory once.
void amx_product(const uint16_t* a, int64_t rows, int64_t columns, const uint16_t* packed, int64_t tiles, float* y) {
  if (rows == 0) return;  // no tiles of 0 rows to configure
  const int64_t pairs = (tiles + 1) / 2, groups = columns / kTileDepth;
  const int64_t pair_bytes = 2 * kTileRows * columns * sizeof(uint16_t);
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / pair_bytes);
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    TileConfig config(rows);
    _tile_loadconfig(&config);
    alignas(64) float scratch[kTileRows * kTileRows];
    auto nothing = [] {};
    for (int64_t first = begin; first < end; first += chunk) {
      pass_pairs(a, rows, columns, packed + 2 * first * groups * kTileElements, first, std::min(end, first + chunk),
                 tiles, y, scratch, true, nothing);
    }
    _tile_release();
  });
}

// y [rows, N] = bf16 x [padded rows, K] times a weight on a 4- or 8-bit grid (cpu_linear.grid_tiles), on the tiles:
// as amx_product, each chunk of pairs of output tiles unpacked into bf16 (buffers of the thread's, in L2) before the
// blocks of rows pass it, so the weight is read from memory in its 4 or 8 bits (and 16 or 32 bits of scales a group
// of 32) instead of 16. The first chunk is unpacked at once, every later one while the tiles multiply the one before.
void amx_grid_product(const uint16_t* a, int64_t rows, int64_t columns, const uint8_t* packed,
                      const at::Half* scales, int bits, int64_t tiles, float* y) {
  if (rows == 0) return;
  const int64_t pairs = (tiles + 1) / 2, groups = columns / kTileDepth;
  const int64_t pair_bytes = 2 * kTileRows * columns * sizeof(uint16_t);
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / pair_bytes), blocks = (rows + 31) / 32;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    TileConfig config(rows);
    _tile_loadconfig(&config);
    alignas(64) float scratch[kTileRows * kTileRows];
    const int64_t buffer = 2 * chunk * groups * kTileElements;  // one chunk's tiles
    thread_local std::vector<uint16_t> unpacked;
    unpacked.resize(std::max<size_t>(unpacked.size(), 2 * buffer));
    uint16_t* buffers[2] = {unpacked.data(), unpacked.data() + buffer};
    const auto tiles_from = [&](int64_t first) {  // the tiles of the chunk of pairs from `first`
      return std::min(tiles, 2 * std::min(end, first + chunk)) - 2 * first;
    };
    Unpacking unpacking{packed, scales, columns, groups, bits};
    unpacking.start(2 * begin, tiles_from(begin), buffers[0], 1);
    unpacking.rest();
    auto between = [&] { unpacking.some(); };
    for (int64_t first = begin, which = 0; first < end; first += chunk, which ^= 1) {
      const int64_t last = std::min(end, first + chunk);
      if (last < end) {
        unpacking.start(2 * last, tiles_from(last), buffers[which ^ 1], blocks * (last - first) * groups);
      } else {
        unpacking.start(0, 0, nullptr, 1);
      }
      pass_pairs(a, rows, columns, buffers[which], first, last, tiles, y, scratch, false, between);
      unpacking.rest();
    }
    _tile_release();
  });
}
#pragma GCC pop_options
#endif

// The buffer of x in bf16 that a product on the calling thread rounds its rows into (grown, never shrunk).
uint16_t* rounded_buffer(int64_t elements) {
  thread_local std::vector<uint16_t> buffer;
  if (static_cast<int64_t>(buffer.size()) < elements) buffer.resize(elements);
  return buffer.data();
}

void check_amx_weight(const torch::Tensor& packed, int64_t columns) {
  TORCH_CHECK(packed.scalar_type() == torch::kBFloat16 && packed.is_contiguous() && packed.dim() == 4 &&
                  packed.size(1) * kTileDepth == columns && packed.size(2) == kTileRows &&
                  packed.size(3) == kTileDepth,
              "an AMX weight: bfloat16 [N / 16, K / 32, 16, 32] contiguous, K of x");
}

#if defined(SGLTTS_AMX)
// x [rows, K] fp32 rounded into the calling thread's buffer of whole blocks of 32 rows (`round_rows`); a call of
// at most 16 rows, whose one A tile holds its rows alone (`Narrow`), is not padded.
const uint16_t* rounded_blocks(const float* x, int64_t rows, int64_t columns) {
  const int64_t padded =
      rows <= kTileRows ? rows : (rows + 2 * kTileRows - 1) / (2 * kTileRows) * (2 * kTileRows);
  uint16_t* a = rounded_buffer(padded * columns);
  round_rows(x, rows, padded, columns, a);
  return a;
}
#endif

// y = x W^T into y (rows x N fp32) for x [rows, K] fp32 (rows contiguous) and W's tiles.
void amx_into(const float* x, int64_t rows, int64_t columns, const torch::Tensor& packed, float* y) {
#if defined(SGLTTS_AMX)
  amx_product(rounded_blocks(x, rows, columns), rows, columns,
              reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), packed.size(0), y);
#else
  TORCH_CHECK(false, "built without AMX");
#endif
}

// y = x W^T into y (rows x N fp32) for x [rows, K] fp32 (rows contiguous) and W on a 4- or 8-bit grid
// (cpu_linear.grid_tiles: `packed` and `scales`), on the tiles.
void amx_grid_into(const float* x, int64_t rows, int64_t columns, const torch::Tensor& packed,
                   const torch::Tensor& scales, float* y) {
#if defined(SGLTTS_AMX)
  amx_grid_product(rounded_blocks(x, rows, columns), rows, columns, static_cast<const uint8_t*>(packed.data_ptr()),
                   scales.data_ptr<at::Half>(), scales.dim() == 4 ? 4 : 8, packed.size(0), y);
#else
  TORCH_CHECK(false, "built without AMX");
#endif
}

void check_grid_tiles(const torch::Tensor& packed, const torch::Tensor& scales, int64_t columns) {
  const bool four = scales.dim() == 4;
  TORCH_CHECK(packed.is_contiguous() && scales.is_contiguous() && scales.scalar_type() == torch::kHalf &&
                  packed.dim() == 3 && packed.size(2) == kTileRows && columns % kTileDepth == 0 &&
                  packed.size(1) == (four ? columns / 2 : columns) && scales.size(0) == packed.size(0) &&
                  scales.size(1) == columns / kTileDepth &&
                  packed.scalar_type() == (four ? torch::kByte : torch::kChar),
              "a grid weight's tiles: packed uint8 [N / 16, K / 2, 16] with scales float16 [N / 16, K / 32, 2, 16], "
              "or packed int8 [N / 16, K, 16] with scales float16 [N / 16, K / 32, 16], K of x");
}

// x [M, K] fp32 times the weight on a grid of `packed` and `scales` (cpu_linear.grid_tiles) transposed, on the
// tiles: y [M, N] fp32.
torch::Tensor amx_grid_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "x: float32 [M, K] contiguous on the CPU");
  check_grid_tiles(packed, scales, x.size(1));
  auto out = torch::empty({x.size(0), packed.size(0) * kTileRows}, x.options());
  amx_grid_into(x.data_ptr<float>(), x.size(0), x.size(1), packed, scales, out.data_ptr<float>());
  return out;
}

// x [M, K] fp32 times the weight of `packed` (cpu_linear.amx_tiles) transposed: y [M, N] fp32.
torch::Tensor amx_linear(const torch::Tensor& x, const torch::Tensor& packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "x: float32 [M, K] contiguous on the CPU");
  check_amx_weight(packed, x.size(1));
  auto out = torch::empty({x.size(0), packed.size(0) * kTileRows}, x.options());
  amx_into(x.data_ptr<float>(), x.size(0), x.size(1), packed, out.data_ptr<float>());
  return out;
}

bool amx_usable() {
#if defined(SGLTTS_AMX)
  return amx_ready();
#else
  return false;
#endif
}

}  // namespace

#ifndef SGLTTS_ONE_UNIT  // policies/decode_step.cpp is compiled after this file, with a module of its own
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("amx_linear", &amx_linear, "x [M, K] fp32 times a weight's AMX tiles, transposed: [M, N] fp32");
  m.def("amx_grid_linear", &amx_grid_linear,
        "x [M, K] fp32 times a 4- or 8-bit grid weight's tiles, transposed, on AMX's tiles: [M, N] fp32");
  m.def("usable", &amx_usable, "whether this build has AMX and this process may use its tiles");
}
#endif
