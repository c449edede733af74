// y = x W^T on AMX's bf16 tiles, called directly: fp32 x rounded to bf16 (nearest, ties to even) into a buffer of
// whole tiles, a weight rounded to bf16 once and kept in the tiles' layout, and the tile unit's fp32 sums stored as
// y, fp32, with no rounding of the result (policies/cpu_linear.py has the arithmetic and the measurements).
//
// A tile product C += A B (_tile_dpbf16ps) takes A: 16 rows of 32 bf16 (16 rows of x, 32 along K), B: 16 rows of
// 16 pairs (the pairs of K of 16 outputs) and C: 16 x 16 fp32 sums:
//     C[m][n] += sum_p A[m][2p] B[p][2n] + A[m][2p + 1] B[p][2n + 1]
// so the weight [N, K] is kept as tiles of 16 outputs by 32 along K (cpu_linear.amx_tiles):
//     packed bf16 [N / 16, K / 32, 16, 32]:  [t, g, p, 2l + j] = W[16t + l, 32g + 2p + j]
// A block is 32 rows by 32 outputs: two A tiles, two B tiles, four C tiles (the 8 tile registers). The pairs of
// output tiles are split over the threads and taken a chunk of ~512 KB of weight at a time; each block of rows
// passes every pair of the chunk, so the block's x (36 KB at K = 576) stays in L1 and the chunk's weight, read from
// memory once (the first block prefetching it 8 groups of K ahead), stays in L2 for the other blocks of rows.
// Without the chunks and the prefetch the products were no faster than oneDNN's; with them one step's decoder
// products at 64-128 rows took 0.73-0.83x oneDNN's time (policies/cpu_linear.py).
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

// Palette 1 with tiles 0-7 of 16 rows by 64 bytes: C tiles 0-3, A tiles 4-5, B tiles 6-7.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int i = 0; i < 8; ++i) bytes_per_row[i] = 64, rows[i] = kTileRows;
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

// One block of 32 rows (from `row`) by 16 Outputs x 16 outputs (tile t onwards): C = A B over all of K.
template <int Outputs>
inline void block(const uint16_t* a, int64_t columns, int64_t row, int64_t rows, const uint16_t* packed, int64_t t,
                  float* y, int64_t outputs, float* scratch, bool prefetch) {
  const int64_t groups = columns / kTileDepth, a_stride = columns * sizeof(uint16_t);
  const uint16_t* a0 = a + row * columns;
  const uint16_t* a1 = a0 + kTileRows * columns;
  const uint16_t* b0 = packed + t * groups * kTileElements;
  const uint16_t* b1 = b0 + groups * kTileElements;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t g = 0; g < groups; ++g) {
    if (prefetch) {  // the weight's tiles kPrefetchGroups groups on, into cache: a first pass reads them from memory
      const char* ahead = reinterpret_cast<const char*>(b0 + (g + kPrefetchGroups) * kTileElements);
      for (int line = 0; line < Outputs * 16; ++line)
        _mm_prefetch(ahead + (line & 15) * 64 + (line >> 4) * groups * kTileElements * sizeof(uint16_t),
                     _MM_HINT_T0);
    }
    _tile_loadd(4, a0 + g * kTileDepth, a_stride);
    _tile_loadd(5, a1 + g * kTileDepth, a_stride);
    _tile_loadd(6, b0 + g * kTileElements, kTileDepth * sizeof(uint16_t));
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if constexpr (Outputs == 2) {
      _tile_loadd(7, b1 + g * kTileElements, kTileDepth * sizeof(uint16_t));
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  const int64_t column = t * kTileRows;
  SGLTTS_STORE(0, row, column)
  SGLTTS_STORE(2, row + kTileRows, column)
  if constexpr (Outputs == 2) {
    SGLTTS_STORE(1, row, column + kTileRows)
    SGLTTS_STORE(3, row + kTileRows, column + kTileRows)
  }
}

// y [rows, N] = bf16 x [padded rows, K] (whole blocks of 32 rows) times the packed weight [N / 16, K / 32, 16, 32].
// The pairs of output tiles go by chunks of about kChunkBytes of weight: per chunk, each block of 32 rows passes
// every pair of the chunk, so the rows' tiles stay in L1 while the chunk's weight (read from memory once) stays in L2.
void amx_product(const uint16_t* a, int64_t rows, int64_t columns, const uint16_t* packed, int64_t tiles, float* y) {
  const int64_t pairs = (tiles + 1) / 2, outputs = tiles * kTileRows;
  const int64_t pair_bytes = 2 * kTileRows * columns * sizeof(uint16_t);
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / pair_bytes);
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    TileConfig config;
    _tile_loadconfig(&config);
    alignas(64) float scratch[kTileRows * kTileRows];
    for (int64_t first = begin; first < end; first += chunk) {
      const int64_t last = std::min(end, first + chunk);
      for (int64_t row = 0; row < rows; row += 2 * kTileRows) {
        for (int64_t pair = first; pair < last; ++pair) {
          const int64_t t = 2 * pair;
          if (t + 1 < tiles) {
            block<2>(a, columns, row, rows, packed, t, y, outputs, scratch, row == 0);
          } else {
            block<1>(a, columns, row, rows, packed, t, y, outputs, scratch, row == 0);
          }
        }
      }
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

// y = x W^T into y (rows x N fp32) for x [rows, K] fp32 (rows contiguous) and W's tiles.
void amx_into(const float* x, int64_t rows, int64_t columns, const torch::Tensor& packed, float* y) {
#if defined(SGLTTS_AMX)
  const int64_t padded = (rows + 2 * kTileRows - 1) / (2 * kTileRows) * (2 * kTileRows);
  uint16_t* a = rounded_buffer(padded * columns);
  round_rows(x, rows, padded, columns, a);
  amx_product(a, rows, columns, reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), packed.size(0),
              y);
#else
  TORCH_CHECK(false, "built without AMX");
#endif
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
  m.def("usable", &amx_usable, "whether this build has AMX and this process may use its tiles");
}
#endif
