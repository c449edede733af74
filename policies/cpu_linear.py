"""The linear layers of a CPU runtime through oneDNN, on weights packed once.

Without the CPU build of sgl-kernel, SGLang 0.5.23 computes every unquantized linear layer on a CPU as
`F.linear(x, W)` (`UnquantizedLinearMethod.apply`) and the LM head as `x @ W^T` (`LogitsProcessor._compute_lm_head`):
MKL's sgemm reading W [N, K] in its row-major layout, transposed. At decode batches (1-64 rows) that is a
memory-bound product whose weight is read in an order the kernel then has to re-block on every call, and the LM
head (49,152 x 576 for SmolLM2) runs at a fraction of the others' rate. oneDNN's inner product reads a weight that
was reordered once into its own blocked layout:

    W_packed = reorder(W)                    once per weight (torch.ops.mkldnn._reorder_linear_weight)
    y        = x W^T + b                     every call, any number of rows (torch.ops.mkldnn._linear_pointwise)

The same fp32 arithmetic in another summation order (differences of ~1e-6 relative). Measured on a 2-core AMD EPYC
(AVX-512), 2 threads, SmolLM2-135M's 121 linear layers of one decode step: 63 -> 27 ms at 16 rows, 180 -> 115 ms at
64 (`docs/runtime-speed.md` has the runtime's figures). The packed copy costs the weights' size again in memory (540
MB for SmolLM2-135M fp32, per scheduler process); SGLang's own weights stay, for the embedding the LM head shares and
for anything else that reads them. A weight changed in place (a weight update) is packed again on its next use.

A head whose rows are almost all zero, as a classifier folded into an LM head is (`sgl_tts/scoring/probe.py`: one
live row of 49,152), is computed on its live rows R only, found once per weight:

    y[:, R] = x W_R^T,   y[:, j] = 0 for j not in R

exactly the product (a zero row gives 0), for ~1/V of the work: a verifier reading input logprobs of every token
otherwise spends a full-vocabulary product per token on a head of one row (0.83 -> 0.12 ms a token at 512 rows,
one thread, AVX2 EPYC).

The same head leaves SGLang's input logprobs a full-vocabulary pass per token: `compute_row_log_normalizer` takes
each row's max and log-sum-exp over all V logits, of which V - |R| are exactly 0. For such a row x

    m = max(max_R x, 0),     log sum_j exp(x_j - m) = log(sum_R exp(x_R - m) + (V - |R|) exp(-m))

is the same normalizer from the live rows alone (`sparse_row_log_normalizer`, installed in a process once its head
took the live-rows path: its only caller reads logits of that head). 94 -> 0.06 ms for 256 rows of 49,152, one
thread; in a py-spy sample of the probe verifier during `make run` the normalizer was 14% of its time.

On a CPU with AMX (amx_bf16), oneDNN multiplies bf16 matrices on its tile units. With $SGLTTS_CPU_LINEAR=packed-bf16
the packed copy is the weight rounded to bf16 (half the memory of the fp32 copy) and every call rounds its input
to bf16; oneDNN sums in fp32 and rounds the result to bf16:

    y = float(bf16(bf16(x) bf16(W)^T)) + b    three roundings of <= 2^-8 each; ~4e-3 relative on SmolLM2's head

The model's state between layers (residual stream, norms, attention, KV cache) stays fp32, as does a live-rows
head. SmolLM2-135M's linear layers of one decode step on a 2-core Xeon with AMX: 39 -> 21 ms at 16 rows, 82 -> 57
ms at 64 (`scripts/bench_linear_bf16.py`); on a CPU without AMX bf16 is emulated and slower, so
`sgl_tts/runtime/server.py` chooses it only where /proc/cpuinfo lists amx_bf16.

Where the project's AMX product is built (`policies/amx_linear.cpp`, on a CPU that lists amx_bf16) the decoder
layers' bf16 products call AMX's tiles directly instead: the weight rounded to bf16 once and laid out in tiles
(`amx_tiles`), x rounded to bf16 into a buffer of whole tiles, and the tiles' fp32 sums are y, not rounded again:

    y = sum_k bf16(x_k) bf16(W_k)   in fp32, + b     two roundings of <= 2^-8 each

without oneDNN's per-call primitive lookup, torch's conversions of x and y and their allocations. One decode step's
120 decoder products of SmolLM2-135M (`scripts/bench_linear_bf16.py`, one thread, as a busy rank runs; 2-core Xeon
with AMX, 2026-12-06): 50.2 and 48.5 ms at 128 rows against oneDNN's 68.3 and 63.4, 52.7 against 63.5 at 64, level
at 33 (37.2 and 49.6 against 36.4 and 55.3: a 33rd row costs a second block of 32). The LM head keeps oneDNN's copy:
with its fp32 result (25 MB at 128 rows of 49,152) the tiles took 0.6-1.3x oneDNN's time over four runs, not
separated.

A decoder weight on a 4- or 8-bit grid (below) needs no bf16 copy for the tiles: `amx_grid_linear` unpacks each
chunk of ~512 KB of tiles from the grid into a buffer of the thread's (in L2) before the blocks of rows pass it,

    w = bf16(d q + m)   per weight, in fp32 (one fused multiply-add), then rounded as `amx_tiles` rounds w

which on a weight on its grid is the tiles' product to the bit (tests/test_cpu_linear.py), reading 4 bits and 1 of
scales a weight (8 and 0.5 at 8 bits) from memory instead of 16, at 4-6 ms of one core's unpacking for one step's
106M weights, done between the tile products of the chunk before; no bf16 tiles or oneDNN copy of the layer are kept
(212 MB a rank for SmolLM2-135M). One step's decoder products on a 2-core Xeon with AMX, one thread: level with the
bf16 tiles at 8-128 rows, and so is the runtime (docs/runtime-speed.md, "the grids on AMX's tiles"). A call of at
most 16 rows multiplies one A tile of its rows (a block of 32 padded rows took twice the tile products): the step's
decoder products from the grids on the tiles then cost about the same at 1 to 16 rows, where the grid kernel's
vector multiply-adds grow a row at a time, so beside AMX's grid product the grid kernel takes a decoder layer's
products up to GRID_ROWS_BESIDE_AMX rows (docs/runtime-speed.md, "AMX's products of a few rows").

Weights that a quantizer wrote are read from the bits it wrote them in, at a few rows. SmolLM2-135M ships as GGUF
with its decoder layers in Q4_1 (each group of 32 weights along K is m + d q, q in 0..15, fp16 d and m; the
quantizer sets m to the group's least weight and d to its range / 15, so q = 0 and q = 15 both occur) and its
embedding, which is its LM head, in Q8_0 (each group of 32 is d q, q in -127..127, fp16 d = the group's largest
|w| / 127); the converted fp32 weights keep those grids. With $SGLTTS_CPU_LINEAR=packed-bf16-int4 or packed-int4
each weight is checked once for either grid, and where every group is on it (and the fp16 d and m hold it) the
weight is kept again as its q with fp16 d (and m) per group, in tiles of 16 outputs (`grid_tiles`):

    4-bit, per group:  m = min w,  d = (max w - m) / 15,  q = round((w - m) / d)    |w - (m + d q)| <= d/1000
    8-bit, per group:  d = max |w| / 127,  q = round(w / d)                          |w - d q| <= d/1000
    y[r, n] = sum_g ( d[n, g] sum_{k in g} q[n, k] x[r, k]  +  m[n, g] sum_{k in g} x[r, k] )     in fp32

(`policies/grid_linear.cpp`: the 4 or 8 bits of a tile unpacked once in vector registers for up to 8 rows of x).
The weights are the fp32 weights themselves, and x and y stay fp32: the product is the fp32 product in another
summation order (~1e-7 relative), where the bf16 copy rounds x, W and y (~4e-3), and torch's int4 kernel rounded x,
y and the scales to bf16. A 4-bit weight is a quarter of the bf16 copy's bytes, an 8-bit one half, but every row
costs its multiply-adds on the vector units, where oneDNN's bf16 product of many rows runs on AMX's tiles: one decode
step's 120 decoder products of SmolLM2-135M from 4 bits took 4.5 / 6.2 / 10.2 / 18.3 ms at 1 / 4 / 8 / 16 rows
against 15.0 / 15.5 / 16.4 / 17.8 in bf16, and its head from 8 bits 1.27 / 1.61 / 2.38 / 4.56 against 2.66 / 2.72 /
2.83 / 3.24 (2-core Xeon with AMX, 2 threads; held to AVX2, against fp32: level at 64 and 32 rows), so products of
at most GRID_ROWS rows read the grids, larger ones the packed copy (`scripts/bench_linear_bf16.py`,
`docs/runtime-speed.md`). On a CPU without AMX, `packed-int4` does the same beside the packed fp32 copy. Weights on
neither grid (any fp32 model) keep the packed copy; so does every weight when the kernel could not be built.

Where the CPU has AVX-512 VNNI, a product takes x on a 16-bit grid of its own (`sixteen_bit_x`):

    per row and group:  s = max |x| / 32767,  x16 = round(x / s)                    |x - s x16| <= s/2
    y[r, n] = sum_g ( d[n, g] s[r, g] sum_{k in g} q[n, k] x16[r, k]  +  m[n, g] sum_{k in g} x[r, k] )

(no m term on the 8-bit grid), the sums of q x16 in int32, 32 products an instruction (vpdpwssd), half the fp32
path's multiply-adds a row on a weight unpacked in fewer instructions. x moves by at most 1.5e-5 of its group's
largest |x| (bf16 moves each x by up to 2^-9 of itself). The layers from 4 bits at 1 / 4 / 8 / 16 / 32 rows: 4.27 /
4.91 / 6.65 / 11.8 / 21.2 ms, against bf16's 16.5 / 16.8 / 17.8 / 18.9 / 22.7; the head from 8 bits at 1 / 8 / 16 /
32 / 48 rows: 0.57 / 1.03 / 2.02 / 4.61 / 7.17 ms, against fp32 x's 0.84 / 2.00 / 3.98 / 8.69 / 13.6, bf16's 2.06 /
2.02 / 3.18 / 5.17 / 5.50 and fp32's 12.6 at 48, 15.3 at 64 (x16: 11.0) rows (the same Xeon, 2 threads). So there a
product reads its grid up to GRID_ROWS_X16 rows, at either bits.

The plugin (`policies/plugin.py`) installs the hooks (`hooks_for`) with $SGLTTS_CPU_LINEAR=packed, packed-bf16,
packed-bf16-int4 or packed-int4 (`sgl_tts/runtime/server.py` sets one on every CPU runtime; packed-dense packs every
head whole, to measure the live-rows head against); any call that is not a plain fp32 product on the CPU (CUDA,
bf16 models, quantized or LoRA heads, SGLang's own AMX path) goes to SGLang's code unchanged.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable

LINEAR_TARGET = "sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.apply"
LM_HEAD_TARGET = "sglang.srt.layers.logits_processor.LogitsProcessor._compute_lm_head"
NORMALIZER_TARGET = "sglang.srt.layers.logprob_processor.compute_row_log_normalizer"
PACKED = "packed"  # the value of $SGLTTS_CPU_LINEAR that installs them
PACKED_DENSE = "packed-dense"  # the same with every head packed whole (to measure the live-rows head against)
PACKED_BF16 = "packed-bf16"  # the same on weights and inputs rounded to bf16 (CPUs with AMX)
PACKED_BF16_INT4 = "packed-bf16-int4"  # the same, and weights on a 4- or 8-bit grid from those bits at a few rows
PACKED_INT4 = "packed-int4"  # packed fp32, and weights on a 4- or 8-bit grid from those bits at a few rows (no AMX)
VALUES = (PACKED, PACKED_DENSE, PACKED_BF16, PACKED_BF16_INT4, PACKED_INT4)
BF16 = (PACKED_BF16, PACKED_BF16_INT4)  # the values whose packed copies are bf16
FOUR_BIT = (PACKED_BF16_INT4, PACKED_INT4)  # the values that read weights from their 4- or 8-bit grids
GRID_GROUP = 32  # weights along K that share a scale (and a zero): GGUF's Q4_1 and Q8_0 block
INT4_LEVELS = 15  # q in 0..15
INT8_LEVELS = 127  # q in -127..127
X16_LEVELS = 32767  # x16 in -32767..32767: x of a grid product on a CPU with VNNI (`sixteen_bit_x`)
TILE = 16  # outputs per tile of a grid weight (the kernel's vector lanes)
# The most rows a product reads a weight's grid at, by its bits, beside a packed bf16 copy (AMX) or an fp32 one:
# below the measured crossovers (module docstring); a product whose x the kernel puts on its 16-bit grid (VNNI)
# costs half the multiply-adds a row, and reads its grid up to GRID_ROWS_X16 rows (`most_grid_rows`).
GRID_ROWS = {True: {4: 12, 8: 8}, False: {4: 32, 8: 24}}
GRID_ROWS_X16 = {True: 32, False: 64}
# The most rows at which a decoder product reads its grid by the grid kernel where AMX's grid product takes the rows
# above (`amx_grid_linear`): its unpacking costs the same at 1-16 rows, the grid kernel's multiply-adds grow a row at
# a time; they cross at 10-12 rows (module docstring).
GRID_ROWS_BESIDE_AMX = 10
GRID_TOLERANCE = 1e-3  # of a group's step d: how far from m + d q a weight on the grid may lie (fp32 rounding)
GRID_KERNEL_SOURCE = Path(__file__).with_name("grid_linear.cpp")
AMX_KERNEL_SOURCE = Path(__file__).with_name("amx_linear.cpp")
AMX_TILE_ROWS, AMX_TILE_DEPTH = 16, 32  # outputs and K of one AMX weight tile (policies/amx_linear.cpp)
_CACHE = "_sgltts_packed_weight"  # module attribute: (the weight's identity, its packed copy)
_BF16_CACHE = "_sgltts_packed_bf16_weight"  # module attribute: (the weight's identity, its packed bf16 copy)
_AMX_CACHE = "_sgltts_amx_weight"  # module attribute: (the weight's identity, its AMX tiles or None)
_GRID_CACHE = "_sgltts_grid_weight"  # module attribute: (the weight's identity, its 4- or 8-bit tiles or None)
_ROWS_CACHE = "_sgltts_live_rows"  # module attribute: (the weight's identity, (live rows, their weights) or None)
SPARSE_HEAD_SHARE = 1 / 64  # at most this share of a head's rows live: computed on those rows alone
PLAIN_LM_HEAD_METHODS = ("UnquantizedEmbeddingMethod", "UnquantizedLinearMethod")
_sparse_head: list[Any] = []  # (live rows, vocabulary size) once this process's head took the live-rows path
_grid_listeners: list[Callable[[str], None]] = []  # hear once that a product read a grid weight (`tell_grid_read`)


def applies(x: Any, weight: Any) -> bool:
    """Whether y = x W^T is a plain fp32 product on the CPU that oneDNN can take."""
    import torch

    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and weight.dim() == 2 and weight.layout == torch.strided and not x.requires_grad
            and torch.backends.mkldnn.is_available())


def packed_weight(module: Any) -> Any:
    """`module.weight` reordered into oneDNN's layout, packed on first use and again after the weight changed."""
    import torch

    return per_weight(module, _CACHE, torch.ops.mkldnn._reorder_linear_weight)


def packed_bf16_weight(module: Any) -> Any:
    """`module.weight` rounded to bf16 and reordered into oneDNN's layout, as `packed_weight`."""
    import torch

    return per_weight(module, _BF16_CACHE, lambda weight: torch.ops.mkldnn._reorder_linear_weight(weight.bfloat16()))


def four_bit_grid(weight: Any, checked: bool = True) -> tuple[Any, Any, Any] | None:
    """(q [N, K] int32 in 0..INT4_LEVELS, d [N, K / GRID_GROUP], m [N, K / GRID_GROUP]) with weight = m + d q per
    group of GRID_GROUP along K (to GRID_TOLERANCE of d), or None when the weight is not on such a grid (not
    `checked`: the nearest such grid's q, d and m, whether or not the weight lies on it)."""
    import torch

    rows, columns = weight.shape
    if columns % GRID_GROUP:
        return None
    groups = weight.float().reshape(rows, columns // GRID_GROUP, GRID_GROUP)
    low, high = torch.aminmax(groups, dim=-1, keepdim=True)
    step = (high - low) / INT4_LEVELS
    q = grid_levels(groups, low, step)
    if checked and off_grid(groups, q, step, low):
        return None
    return q.to(torch.int32).reshape(rows, columns), step[..., 0], low[..., 0]


def off_grid(groups: Any, q: Any, step: Any, low: Any = None) -> bool:
    """Whether a weight of `groups` [N, G, GRID_GROUP] lies farther than GRID_TOLERANCE of its group's step d from
    m + d q (q as floats of the groups' shape; d and m [N, G, 1]; m = 0 where `low` is None)."""
    import torch

    rebuilt = step * q if low is None else torch.addcmul(low, step, q)
    return bool(((groups - rebuilt).abs_() > GRID_TOLERANCE * step).any())


def grid_levels(groups: Any, low: Any, step: Any) -> Any:
    """round((w - m) / d) in 0..INT4_LEVELS for the weights [N, K / GRID_GROUP, GRID_GROUP] of groups with least
    value m and step d (each [..., 1]); 0 in a group of one value (d = 0)."""
    import torch

    return torch.round((groups - low) / torch.where(step > 0, step, torch.ones_like(step))).clamp(0, INT4_LEVELS)


def q4_1_round(weight: Any) -> Any:
    """`weight` [N, K] rounded as GGUF's Q4_1 quantizer writes it (per group of GRID_GROUP along K: m = fp16(min w),
    d = fp16((max w - min w) / 15), q = round((w - m) / d) in 0..15), as the converted fp32 weight it reads back,
    m + d q: a weight on the grid `four_bit_grid` finds. For benches and tests of the 4-bit path."""
    groups = weight.float().reshape(weight.shape[0], -1, GRID_GROUP)
    least = groups.amin(dim=-1, keepdim=True)
    low = least.half().float()
    step = ((groups.amax(dim=-1, keepdim=True) - least) / INT4_LEVELS).half().float()
    return (low + step * grid_levels(groups, low, step)).reshape(weight.shape)


def eight_bit_grid(weight: Any, checked: bool = True) -> tuple[Any, Any] | None:
    """(q [N, K] int8 in -INT8_LEVELS..INT8_LEVELS, d [N, K / GRID_GROUP]) with weight = d q per group of
    GRID_GROUP along K (to GRID_TOLERANCE of d), or None when the weight is not on such a grid (not `checked`: the
    nearest such grid's q and d)."""
    import torch

    rows, columns = weight.shape
    if columns % GRID_GROUP:
        return None
    groups = weight.float().reshape(rows, columns // GRID_GROUP, GRID_GROUP)
    step = groups.abs().amax(dim=-1, keepdim=True) / INT8_LEVELS
    q = torch.round(groups / torch.where(step > 0, step, torch.ones_like(step)))
    if checked and off_grid(groups, q, step):
        return None
    return q.to(torch.int8).reshape(rows, columns), step[..., 0]


@functools.lru_cache(maxsize=None)
def grid_kernels() -> Any:
    """The compiled products of GRID_KERNEL_SOURCE for this CPU (threaded), or None when they cannot be built."""
    from policies.cpu_attention import build_kernel

    return build_kernel(GRID_KERNEL_SOURCE.read_bytes(), GRID_KERNEL_SOURCE, threads=True)


def by_tile(values: Any) -> Any:
    """[N, G, ...] per output -> [N / TILE, G, ..., TILE]: the layout of the kernel's tiles."""
    tiles = values.reshape(values.shape[0] // TILE, TILE, *values.shape[1:])
    return tiles.permute(0, *range(2, tiles.dim()), 1).contiguous()


def grid_tiles(weight: Any) -> tuple[Any, Any] | None:
    """`weight` [N, K] on a 4-bit grid as (packed [N / TILE, K / 2, TILE] uint8, two q a byte, scales [N / TILE,
    K / GRID_GROUP, 2, TILE] fp16: d and m), or on an 8-bit grid as (packed [N / TILE, K, TILE] int8, scales
    [N / TILE, K / GRID_GROUP, TILE] fp16: d); None when it is on neither, or N is not a multiple of TILE, or the
    fp16 scales would move a weight off its grid."""
    if weight.dim() != 2 or weight.shape[0] % TILE:
        return None
    return four_bit_tiles(weight) or eight_bit_tiles(weight)


# Each grid is tried on a weight's first TILE rows before the whole weight (a weight on a grid has its first rows on
# it), and the whole weight is checked once, with its scales rounded to fp16 as the tiles keep them: finding the
# grids of SmolLM2-135M took 1.96 s of one core instead of 3.58 (docs/runtime-speed.md).
def four_bit_tiles(weight: Any) -> tuple[Any, Any] | None:
    """`grid_tiles` on the 4-bit grid."""
    import torch

    if four_bit_grid(weight[:TILE]) is None:
        return None
    q, step, low = four_bit_grid(weight, checked=False)
    step, low = step.half(), low.half()
    levels = torch.stack([q[:, 0::2], q[:, 1::2]], dim=-1).to(torch.uint8)  # [N, K / 2, 2]: q[2p], q[2p + 1]
    tiles = by_tile(levels[..., 0] | (levels[..., 1] << 4)), by_tile(torch.stack([step, low], dim=-1))
    return on_its_grid(weight, tiles, q, step.float(), low.float())


def eight_bit_tiles(weight: Any) -> tuple[Any, Any] | None:
    """`grid_tiles` on the 8-bit grid."""
    if eight_bit_grid(weight[:TILE]) is None:
        return None
    q, step = eight_bit_grid(weight, checked=False)
    step = step.half()
    return on_its_grid(weight, (by_tile(q), by_tile(step)), q, step.float())


def on_its_grid(weight: Any, tiles: tuple[Any, Any], q: Any, step: Any, low: Any = None) -> tuple[Any, Any] | None:
    """`tiles` where every weight lies on the grid of q [N, K] with the scales d (and m) [N, K / GRID_GROUP] as
    the tiles keep them, else None."""
    groups = weight.float().reshape(*step.shape, GRID_GROUP)
    off = off_grid(groups, q.reshape(groups.shape).float(), step[..., None], None if low is None else low[..., None])
    return None if off else tiles


def q8_0_round(weight: Any) -> Any:
    """`weight` [N, K] rounded as GGUF's Q8_0 quantizer writes it (per group of GRID_GROUP along K: d = fp16(max |w|
    / 127), q = round(w / d) in -127..127), as the converted fp32 weight it reads back, d q: a weight on the grid
    `eight_bit_grid` finds. For benches and tests of the 8-bit path."""
    import torch

    groups = weight.float().reshape(weight.shape[0], -1, GRID_GROUP)
    step = (groups.abs().amax(dim=-1, keepdim=True) / INT8_LEVELS).half().float()
    q = torch.round(groups / torch.where(step > 0, step, torch.ones_like(step))).clamp(-INT8_LEVELS, INT8_LEVELS)
    return (step * q).reshape(weight.shape)


def grid_weight(module: Any) -> tuple[Any, Any] | None:
    """`module.weight`'s tiles (`grid_tiles`) when it is on a 4- or 8-bit grid and the kernel is built, else None;
    found once per weight, and again after it changed."""
    if grid_kernels() is None:
        return None
    return per_weight(module, _GRID_CACHE, grid_tiles)


def most_grid_rows(bf16: bool, bits: int, on_amx: bool = False) -> int:
    """The most rows at which a product reads a `bits`-bit weight from its grid by the grid kernel: beside a bf16 copy
    with `bf16`, beside AMX's product from the same grid with `on_amx`."""
    if on_amx:
        return GRID_ROWS_BESIDE_AMX
    kernels = grid_kernels()
    if kernels is not None and kernels.x_bits == 16:
        return GRID_ROWS_X16[bf16]
    return GRID_ROWS[bf16][bits]


def grid_bits(tiles: tuple[Any, Any]) -> int:
    """4 or 8: the bits a weight's tiles (`grid_tiles`) keep its q in."""
    return 4 if tiles[1].dim() == 4 else 8


def sixteen_bit_x(x: Any) -> tuple[Any, Any]:
    """(x16 [..., K], s [..., K / GRID_GROUP]): x [..., K] on the 16-bit grid a grid product takes it on where the
    kernel has VNNI (`grid_kernels().x_bits == 16`): per group of GRID_GROUP, s = max |x| / 32767 and x16 =
    round(x / s), as the kernel computes them (in fp32, x times 1 / s, ties to even); x16 as floats."""
    import torch

    groups = x.float().reshape(*x.shape[:-1], -1, GRID_GROUP)
    step = groups.abs().amax(dim=-1) / X16_LEVELS
    inverse = torch.where(step > 0, 1 / torch.where(step > 0, step, torch.ones_like(step)), torch.zeros_like(step))
    return torch.round(groups * inverse[..., None]).reshape(x.shape), step


def grid_linear(x: Any, tiles: tuple[Any, Any], bias: Any = None) -> Any:
    """fp32 x [..., K] times the weight of `tiles` (`grid_tiles`) transposed, in fp32, plus bias."""
    kernels = grid_kernels()
    return on_rows(kernels.four_bit_linear if grid_bits(tiles) == 4 else kernels.eight_bit_linear, x, bias, *tiles)


def on_rows(product: Callable[..., Any], x: Any, bias: Any, *weight: Any) -> Any:
    """`product(rows, *weight)` of a compiled kernel ([M, K] contiguous fp32 rows -> [M, N]) on x [..., K], as
    [..., N], plus bias."""
    out = product(x.reshape(-1, x.shape[-1]).contiguous(), *weight)
    out = out.reshape(*x.shape[:-1], out.shape[-1])
    return out if bias is None else out + bias


def tell_grid_read(listener: Callable[[str], None]) -> None:
    """`listener` hears, once in this process, the first product that reads a weight from its grid."""
    _grid_listeners.append(listener)


def told_grid_read(rows: int, module: Any) -> None:
    """Tell the listeners of `tell_grid_read`, once, that a product of `rows` rows read `module`'s weight from its
    grid."""
    while _grid_listeners:
        _grid_listeners.pop()(f"a product of {rows} row(s) read its {tuple(module.weight.shape)} weight from "
                              f"{grid_bits(grid_weight(module))} bits")


def per_weight(module: Any, attribute: str, derive: Callable[[Any], Any]) -> Any:
    """`derive(module.weight)` (detached), kept in `module.<attribute>` with the weight's identity (storage,
    version, shape): derived once per weight, and again after it changed in place."""
    weight = module.weight
    identity = (weight.data_ptr(), weight._version, tuple(weight.shape))
    cached = getattr(module, attribute, None)
    if cached is None or cached[0] != identity:
        cached = (identity, derive(weight.detach()))
        setattr(module, attribute, cached)
    return cached[1]


def live_rows(module: Any) -> tuple[Any, Any] | None:
    """(indices of the non-zero rows of `module.weight`, those rows) when at most SPARSE_HEAD_SHARE of its rows
    are non-zero, else None; found once per weight, and again after it changed."""
    import torch

    def find(weight: Any) -> tuple[Any, Any] | None:
        rows = torch.nonzero(weight.ne(0).any(dim=1)).flatten()
        return (rows, weight[rows].contiguous()) if len(rows) <= SPARSE_HEAD_SHARE * len(weight) else None

    return per_weight(module, _ROWS_CACHE, find)


def sparse_rows_linear(x: Any, rows: Any, row_weights: Any, out_features: int) -> Any:
    """x [..., K] times a weight [out_features, K] that is zero outside `rows` (whose rows are `row_weights`),
    transposed: [..., out_features]."""
    import torch

    out = x.new_zeros(*x.shape[:-1], out_features)
    out[..., rows] = torch.matmul(x, row_weights.T)
    return out


def packed_linear(x: Any, packed: Any, bias: Any = None) -> Any:
    """x [..., K] times the packed weight [N, K], transposed, plus bias: [..., N]."""
    import torch

    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out.shape[-1])


@functools.lru_cache(maxsize=None)
def amx_kernels() -> Any:
    """The compiled product of AMX_KERNEL_SOURCE (threaded), or None where it is not built with AMX or this
    process may not use the tiles."""
    from policies.cpu_attention import build_kernel

    kernels = build_kernel(AMX_KERNEL_SOURCE.read_bytes(), AMX_KERNEL_SOURCE, threads=True)
    return kernels if kernels is not None and kernels.usable() else None


def amx_tiles(weight: Any) -> Any:
    """`weight` [N, K] rounded to bf16 (nearest, ties to even) in AMX's tile layout, bf16 [N / 16, K / 32, 16, 32]:
    [t, g, p, 2l + j] = W[16t + l, 32g + 2p + j] (policies/amx_linear.cpp); None where N or K does not fill whole
    tiles."""
    rows, columns = weight.shape
    if rows % AMX_TILE_ROWS or columns % AMX_TILE_DEPTH:
        return None
    tiles = weight.bfloat16().reshape(rows // AMX_TILE_ROWS, AMX_TILE_ROWS, columns // AMX_TILE_DEPTH,
                                      AMX_TILE_DEPTH // 2, 2)
    return tiles.permute(0, 2, 3, 1, 4).reshape(rows // AMX_TILE_ROWS, columns // AMX_TILE_DEPTH, AMX_TILE_ROWS,
                                                AMX_TILE_DEPTH).contiguous()


def amx_weight(module: Any) -> Any:
    """`module.weight`'s AMX tiles (`amx_tiles`) where the AMX product is built and usable, else None; made once per
    weight, and again after it changed."""
    if amx_kernels() is None:
        return None
    return per_weight(module, _AMX_CACHE, amx_tiles)


def amx_linear(x: Any, tiles: Any, bias: Any = None) -> Any:
    """fp32 x [..., K] rounded to bf16, times the bf16 weight of `tiles` (`amx_tiles`) transposed, summed and
    returned in fp32, plus bias."""
    return on_rows(amx_kernels().amx_linear, x, bias, tiles)


def amx_grid_linear(x: Any, tiles: tuple[Any, Any], bias: Any = None) -> Any:
    """fp32 x [..., K] rounded to bf16, times the weight of `tiles` (`grid_tiles`) on AMX's tiles: unpacked to bf16
    a chunk at a time (d q + m rounded to bf16, as `amx_tiles` rounds the fp32 weight), summed and returned in fp32,
    plus bias."""
    return on_rows(amx_kernels().amx_grid_linear, x, bias, *tiles)


def bf16_packed_linear(x: Any, packed_bf16: Any, bias: Any = None) -> Any:
    """fp32 x [..., K] rounded to bf16, times the packed bf16 weight [N, K] transposed (a bf16 result), in fp32,
    plus bias."""
    out = packed_linear(x.bfloat16(), packed_bf16).float()
    return out if bias is None else out + bias


def dense_linear(x: Any, module: Any, bias: Any = None, bf16: bool = False, grids: bool = False,
                 on_amx: bool = True) -> Any:
    """x times `module.weight` transposed, plus bias, on its packed fp32 copy or (`bf16`) its AMX tiles where
    `on_amx` and the AMX product is usable, else its packed bf16 copy; with `grids`, from the weight's 4- or 8-bit
    grid where it has one: by the grid kernel at up to `most_grid_rows` rows, and (`bf16` and `on_amx`) on AMX's
    tiles above, unpacked from the grid (`amx_grid_linear`)."""
    on_amx = bf16 and on_amx and amx_kernels() is not None
    if grids:
        tiles = grid_weight(module)  # found on the first call, whatever its rows
        rows = x.numel() // x.shape[-1]
        if tiles is not None and rows <= most_grid_rows(bf16, grid_bits(tiles), on_amx):
            told_grid_read(rows, module)
            return grid_linear(x, tiles, bias)
        if tiles is not None and on_amx:
            return amx_grid_linear(x, tiles, bias)
    if bf16:
        amx = amx_weight(module) if on_amx else None
        if amx is not None:
            return amx_linear(x, amx, bias)
        return bf16_packed_linear(x, packed_bf16_weight(module), bias)
    return packed_linear(x, packed_weight(module), bias)


def linear_hook(original: Callable[..., Any], method: Any, layer: Any, x: Any, bias: Any = None,
                bf16: bool = False, grids: bool = False) -> Any:
    """An AROUND hook for `UnquantizedLinearMethod.apply(layer, x, bias)`."""
    if getattr(layer, "use_intel_amx_backend", False) or not applies(x, layer.weight):
        return original(method, layer, x, bias)
    return dense_linear(x, layer, bias, bf16, grids)


def hooks_for(value: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The hooks of the linear layers and of the LM head that `value` of $SGLTTS_CPU_LINEAR installs."""
    bf16, grids = value in BF16, value in FOUR_BIT
    return (functools.partial(linear_hook, bf16=bf16, grids=grids),
            functools.partial(lm_head_hook, sparse_heads=value != PACKED_DENSE, bf16=bf16, grids=grids))


def lm_head_hook(original: Callable[..., Any], processor: Any, hidden_states: Any, lm_head: Any,
                 embedding_bias: Any = None, sparse_heads: bool = True, bf16: bool = False, grids: bool = False,
                 **kwargs: Any) -> Any:
    """An AROUND hook for `LogitsProcessor._compute_lm_head`: the plain head (an unquantized weight, no LoRA, no
    fp32-upcast or RL settings) on its live rows when it has few (`sparse_heads`), else through `dense_linear`
    (on bf16 weights with `bf16`, from its grid at a few rows with `grids`); every other head through SGLang's
    code."""
    plain = (type(getattr(lm_head, "quant_method", None)).__name__ in PLAIN_LM_HEAD_METHODS
             and not hasattr(lm_head, "set_lora") and hasattr(lm_head, "weight")
             and not getattr(lm_head, "use_intel_amx_backend", False)
             and getattr(processor, "rl_on_policy_target", None) is None
             and not getattr(processor, "use_fp32_lm_head", False))
    if not plain or embedding_bias is not None or not applies(hidden_states, lm_head.weight):
        return original(processor, hidden_states, lm_head, embedding_bias, **kwargs)
    sparse = live_rows(lm_head) if sparse_heads else None
    if sparse is not None:
        _sparse_head[:] = [sparse[0], lm_head.weight.shape[0]]
        return sparse_rows_linear(hidden_states, *sparse, lm_head.weight.shape[0])
    _sparse_head.clear()
    return dense_linear(hidden_states, lm_head, bf16=bf16, grids=grids, on_amx=False)


def sparse_row_log_normalizer(logits: Any, rows: Any) -> tuple[Any, Any]:
    """SGLang's per-row (max, logsumexp - max) of `logits` [T, V] that are 0 outside the columns `rows`."""
    import torch

    live = logits[:, rows].float()
    row_max = live.amax(dim=-1).clamp_min(0.0)
    rest = (logits.shape[-1] - len(rows)) * torch.exp(-row_max)
    return row_max, torch.log(torch.exp(live - row_max[:, None]).sum(dim=-1) + rest)


def normalizer_hook(original: Callable[..., Any], logits: Any) -> Any:
    """An AROUND hook for `compute_row_log_normalizer(logits)`: from the live rows when this process's head is
    sparse (`lm_head_hook`), else SGLang's."""
    if not _sparse_head or logits.dim() != 2 or logits.shape[-1] != _sparse_head[1] or logits.is_cuda:
        return original(logits)
    return sparse_row_log_normalizer(logits, _sparse_head[0])
