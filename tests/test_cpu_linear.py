"""The packed oneDNN linear layers against F.linear / SGLang's own code, and what they leave to SGLang."""

import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang.srt.layers.quantization.unquant")

from policies import cpu_linear  # noqa: E402
from policies.cpu_linear import (applies, hooks_for, linear_hook, live_rows, lm_head_hook,  # noqa: E402
                                 packed_bf16_weight, packed_linear, packed_weight)

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")


def layer_of(rows: int, columns: int, seed: int = 0) -> types.SimpleNamespace:
    generator = torch.Generator().manual_seed(seed)
    return types.SimpleNamespace(weight=torch.nn.Parameter(torch.randn(rows, columns, generator=generator),
                                                          requires_grad=False))


@pytest.mark.parametrize("shape", [(1, 576), (7, 576), (64, 1536), (3, 5, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear(shape, with_bias):
    """Within fp32's bound for a sum of K products in any order (|error| <= K eps sum_k |x_k w_k|) of the float64
    product, as F.linear is: a fixed tolerance fails now and then at K = 1536, where the terms reach tens."""
    layer = layer_of(96, shape[-1], seed=len(shape))
    generator = torch.Generator().manual_seed(len(shape) + 10 * with_bias)
    x = torch.randn(*shape, generator=generator)
    bias = torch.randn(96, generator=generator) if with_bias else None
    exact = torch.nn.functional.linear(x.double(), layer.weight.double(), None if bias is None else bias.double())
    bound = shape[-1] * torch.finfo(torch.float32).eps * (
        torch.nn.functional.linear(x.double().abs(), layer.weight.double().abs()) + (0 if bias is None else
                                                                                      bias.double().abs()))
    got = packed_linear(x, packed_weight(layer), bias)
    expected = torch.nn.functional.linear(x, layer.weight, bias)
    assert got.shape == expected.shape
    assert ((got.double() - exact).abs() <= bound).all()
    assert ((expected.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("shape", [(1, 576), (16, 576), (64, 1536), (3, 5, 64)])
def test_the_bf16_linear_is_the_product_of_the_rounded_factors(shape):
    """packed-bf16: the exact product of x and W each rounded to bf16, summed in fp32 and rounded to bf16 (relative
    error <= u = 2^-8 of a bf16 rounding), plus the fp32 bias; so within ~3u of sum_k |x_k w_k| of the exact fp32
    product (three roundings); and not the fp32 product itself (it does round)."""
    layer = layer_of(96, shape[-1], seed=len(shape))
    generator = torch.Generator().manual_seed(len(shape) + 1)
    x = torch.randn(*shape, generator=generator)
    bias = torch.randn(96, generator=generator)
    calls = []
    got = linear_hook(lambda *args: calls.append(args), None, layer, x, bias, bf16=True)
    assert calls == [] and got.dtype == torch.float32 and got.shape == (*shape[:-1], 96)
    magnitude = torch.nn.functional.linear(x.double().abs(), layer.weight.double().abs())
    summation = shape[-1] * torch.finfo(torch.float32).eps * magnitude
    rounded = torch.nn.functional.linear(x.bfloat16().double(), layer.weight.bfloat16().double())
    assert ((got.double() - bias - rounded).abs() <= 2.0 ** -8 * rounded.abs() + summation + 1e-5).all()
    exact = torch.nn.functional.linear(x.double(), layer.weight.double(), bias.double())
    assert ((got.double() - exact).abs() <= 3.01 * 2.0 ** -8 * magnitude + summation + 1e-5).all()
    assert (got.double() - exact).abs().max() > 1e-4
    assert packed_bf16_weight(layer) is packed_bf16_weight(layer)  # packed once
    assert linear_hook(lambda *args: "sglang", None, layer, x.bfloat16(), bias=None, bf16=True) == "sglang"


@pytest.mark.parametrize("rows", [0, 1, 15, 16, 17, 33, 64, 100])
@pytest.mark.parametrize("outputs, columns", [(48, 64), (96, 576)])
def test_the_amx_product_is_the_product_of_the_bf16_factors_summed_in_fp32(rows, outputs, columns):
    """policies/amx_linear.cpp: x and W each rounded to bf16 (nearest, ties to even), their exact products summed
    in fp32 (within K eps sum_k |x_k w_k| of the float64 sum, in any order) and not rounded again: the result is not
    on bf16's grid. Rows that fill no whole tile (at most 16: one A tile of those rows), an odd count of 16-output
    tiles and no rows at all (an empty result) included."""
    if cpu_linear.amx_kernels() is None:
        pytest.skip("no AMX product on this CPU or build")
    layer = layer_of(outputs, columns, seed=rows)
    x = torch.randn(rows, columns, generator=torch.Generator().manual_seed(rows + 1))
    got = cpu_linear.amx_linear(x, cpu_linear.amx_weight(layer))
    assert got.dtype == torch.float32 and got.shape == (rows, outputs)
    rounded = torch.nn.functional.linear(x.bfloat16().double(), layer.weight.bfloat16().double())
    magnitude = torch.nn.functional.linear(x.bfloat16().double().abs(), layer.weight.bfloat16().double().abs())
    assert ((got.double() - rounded).abs() <= columns * torch.finfo(torch.float32).eps * magnitude + 1e-30).all()
    assert not rows or not torch.equal(got, got.bfloat16().float())
    assert cpu_linear.amx_weight(layer) is cpu_linear.amx_weight(layer)  # laid out once


@pytest.mark.parametrize("rows", [0, 1, 9, 16, 17, 33, 100])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("outputs, columns", [(48, 64), (96, 576), (64, 1536)])
def test_the_amx_product_from_a_grid_is_the_product_on_the_fp32_weights_tiles(rows, bits, outputs, columns):
    """policies/amx_linear.cpp: a weight on a 4- or 8-bit grid, unpacked from its q and fp16 scales into bf16 tiles
    a chunk at a time, gives to the bit the product on the tiles of its fp32 weight (`amx_tiles`); an odd count
    of 16-output tiles, rows that fill no whole block (at most 16: one A tile) and no rows included. Tiles of another
    K are refused, naming the layout expected."""
    if cpu_linear.amx_kernels() is None or cpu_linear.grid_kernels() is None:
        pytest.skip("no AMX product on this CPU or build")
    generator = torch.Generator().manual_seed(rows + bits)
    rounding = cpu_linear.q4_1_round if bits == 4 else cpu_linear.q8_0_round
    weight = rounding(torch.randn(outputs, columns, generator=generator) * 0.05)
    tiles = cpu_linear.grid_tiles(weight)
    assert cpu_linear.grid_bits(tiles) == bits
    x = torch.randn(rows, columns, generator=generator)
    bias = torch.randn(outputs, generator=generator)
    got = cpu_linear.amx_grid_linear(x, tiles, bias)
    assert got.shape == (rows, outputs) and got.dtype == torch.float32
    assert torch.equal(got, cpu_linear.amx_linear(x, cpu_linear.amx_tiles(weight), bias))
    assert not rows or not torch.equal(got, cpu_linear.grid_linear(x, tiles, bias))  # x and W rounded to bf16
    other = cpu_linear.grid_tiles(rounding(torch.randn(outputs, columns + 32, generator=generator)))
    with pytest.raises(RuntimeError, match="K of x"):
        cpu_linear.amx_grid_linear(x, other)


def test_amx_tiles_lay_out_16_outputs_by_32_along_k_in_pairs():
    """[t, g, p, 2l + j] = bf16(W[16t + l, 32g + 2p + j]), and no tiles where N or K does not fill them."""
    weight = torch.randn(48, 96)
    tiles = cpu_linear.amx_tiles(weight)
    assert tiles.shape == (3, 3, 16, 32) and tiles.dtype == torch.bfloat16
    for t, g, p, lane, j in [(0, 0, 0, 0, 0), (2, 1, 5, 9, 1), (1, 2, 15, 15, 0)]:
        assert tiles[t, g, p, 2 * lane + j] == weight[16 * t + lane, 32 * g + 2 * p + j].bfloat16()
    assert cpu_linear.amx_tiles(weight[:40]) is None and cpu_linear.amx_tiles(weight[:, :80]) is None


def four_bit_layer(rows: int, columns: int, seed: int = 0) -> tuple[types.SimpleNamespace, dict]:
    """A layer whose weight a Q4_1 quantizer wrote, as a GGUF file's converted weight has it: per group of 32 along
    K, w = float(d) q + float(m) with fp16 d and m, q in 0..15, and both 0 and 15 in every group (the quantizer's
    m is the group's least weight, d its range / 15). Returns the layer and its q, d and m."""
    generator = torch.Generator().manual_seed(seed)
    groups = columns // 32
    q = torch.randint(0, 16, (rows, groups, 32), generator=generator)
    q[..., 0], q[..., 1] = 0, 15
    q = q[..., torch.randperm(32, generator=generator)]
    d = (torch.rand(rows, groups, generator=generator) * 0.02 + 1e-3).half().float()
    m = (torch.randn(rows, groups, generator=generator) * 0.1).half().float()
    weight = (d[..., None] * q + m[..., None]).reshape(rows, columns)
    layer = types.SimpleNamespace(weight=torch.nn.Parameter(weight, requires_grad=False))
    return layer, {"q": q.reshape(rows, columns), "d": d, "m": m}


def test_a_weight_on_a_four_bit_grid_is_found_exactly_and_others_are_not():
    layer, truth = four_bit_layer(48, 96)
    q, step, low = cpu_linear.four_bit_grid(layer.weight)
    assert torch.equal(q, truth["q"].to(torch.int32)) and torch.equal(low, truth["m"])
    torch.testing.assert_close(step, truth["d"], rtol=1e-6, atol=0)
    off = layer.weight.clone()
    off[3, 40] += 0.01 * truth["d"][3, 1]  # one weight a hundredth of a step off its group's grid
    assert cpu_linear.four_bit_grid(off) is None
    assert cpu_linear.four_bit_grid(layer_of(48, 96).weight) is None  # a plain fp32 weight
    assert cpu_linear.four_bit_grid(layer.weight[:, :80]) is None  # K not a multiple of the group
    constant = torch.full((16, 32), 0.25)  # a group with one value: d = 0, every q 0
    assert torch.equal(cpu_linear.four_bit_grid(constant)[0], torch.zeros(16, 32, dtype=torch.int32))
    rounded = cpu_linear.q4_1_round(layer_of(48, 96).weight)  # the quantizer's output is on the grid it reads
    q, step, low = cpu_linear.four_bit_grid(rounded)
    assert torch.equal(low, low.half().float())  # fp16 m and d, as the file stores them
    torch.testing.assert_close(step, step.half().float(), rtol=1e-6, atol=0)


def eight_bit_layer(rows: int, columns: int, seed: int = 0) -> tuple[types.SimpleNamespace, dict]:
    """A layer whose weight a Q8_0 quantizer wrote (per group of 32 along K, w = float(d) q with fp16 d, q in
    -127..127, and +-127 in every group: d is the group's largest |w| / 127). Returns the layer and its q and d."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (rows, columns // 32, 32), generator=generator)
    q[..., 0] = 127 * torch.where(torch.rand(rows, columns // 32, generator=generator) < 0.5, -1, 1)
    q = q[..., torch.randperm(32, generator=generator)]
    d = (torch.rand(rows, columns // 32, generator=generator) * 1e-3 + 1e-5).half().float()
    weight = (d[..., None] * q).reshape(rows, columns)
    return types.SimpleNamespace(weight=torch.nn.Parameter(weight, requires_grad=False)), {"q": q, "d": d}


def test_a_weight_on_an_eight_bit_grid_is_found_exactly_and_others_are_not():
    layer, truth = eight_bit_layer(48, 96)
    q, step = cpu_linear.eight_bit_grid(layer.weight)
    assert torch.equal(q, truth["q"].reshape(48, 96).to(torch.int8))
    torch.testing.assert_close(step, truth["d"], rtol=1e-6, atol=0)
    off = layer.weight.clone()
    off[5, 70] += 0.01 * truth["d"][5, 2]
    assert cpu_linear.eight_bit_grid(off) is None
    assert cpu_linear.eight_bit_grid(layer_of(48, 96).weight) is None
    rounded = cpu_linear.q8_0_round(layer_of(48, 96).weight)
    assert cpu_linear.eight_bit_grid(rounded) is not None
    assert cpu_linear.four_bit_grid(rounded) is None  # 255 levels are not 16


def test_grid_tiles_judge_the_whole_weight_not_its_first_rows():
    """`grid_tiles` tries each grid on a weight's first 16 rows before the whole weight: rows past them decide too.
    A weight whose first 16 rows lie on both grids (constant groups) and the rest on the 8-bit one gets 8-bit tiles;
    a 4-bit weight with one weight off its grid past the first rows, and an 8-bit one likewise, get none."""
    four, _ = four_bit_layer(48, 96)
    eight, _ = eight_bit_layer(48, 96)
    mixed = eight.weight.clone()
    mixed[:16] = 127 / 512  # each group one value: d = 0 on the 4-bit grid, d = 2^-9 and q = 127 on the 8-bit one
    assert cpu_linear.four_bit_grid(mixed[:16]) is not None and cpu_linear.four_bit_grid(mixed) is None
    tiles = cpu_linear.grid_tiles(mixed)
    assert cpu_linear.grid_bits(tiles) == 8 and torch.equal(unpacked(tiles).float(), mixed)
    for weight in (four.weight, eight.weight):
        off = weight.clone()
        off[40, 50] += 1e-3 * off[40].abs().max()
        assert cpu_linear.grid_tiles(weight) is not None and cpu_linear.grid_tiles(off) is None


def unpacked(tiles: tuple) -> torch.Tensor:
    """The weight [N, K] that `grid_tiles` laid out, rebuilt from the layout alone (float64)."""
    packed, scales = tiles
    if scales.dim() == 4:  # 4 bits: two q a byte, d and m
        q = torch.stack([packed & 15, packed >> 4], dim=2).flatten(1, 2).double()  # [N / 16, K, 16]
        step, low = scales[:, :, 0].double(), scales[:, :, 1].double()
    else:
        q, step = packed.double(), scales.double()
        low = torch.zeros_like(step)
    weight = step.repeat_interleave(32, dim=1) * q + low.repeat_interleave(32, dim=1)  # [N / 16, K, 16]
    return weight.permute(0, 2, 1).reshape(-1, q.shape[1])


@pytest.mark.parametrize("make", [four_bit_layer, eight_bit_layer], ids=["4-bit", "8-bit"])
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 17])
def test_the_grid_product_is_the_fp32_weights_product(make, rows):
    """The tiles hold the weight exactly (rebuilt from the layout alone), and the kernel's product over any number
    of rows (blocks of 8, 4, 2 and 1) is the float64 product of the fp32 weight and x within fp32's bound for a
    sum of K products (K eps sum_k |x_k w_k|), plus the bias: no bf16 rounding anywhere (the bf16 copy's error
    is ~2^-8 of the magnitude, far above the bound). Where a product takes x on its 16-bit grid (VNNI), it is the
    float64 product of that x (`sixteen_bit_x`; a 4-bit weight's zeros' term m sum x of the fp32 x) within the same
    bound, and the fp32 product within the grid's rounding (s / 2 per x) more."""
    if cpu_linear.grid_kernels() is None:
        pytest.skip("no compiler for the grid kernel")
    layer, truth = make(64, 576, seed=rows)
    tiles = cpu_linear.grid_tiles(layer.weight)
    assert cpu_linear.grid_bits(tiles) == (4 if make is four_bit_layer else 8)
    assert torch.equal(unpacked(tiles), layer.weight.double())
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(64)
    got = cpu_linear.grid_linear(x, tiles, bias)
    exact = x.double() @ layer.weight.double().T + bias.double()
    bound = 576 * torch.finfo(torch.float32).eps * (x.double().abs() @ layer.weight.double().abs().T + bias.abs())
    assert got.dtype == torch.float32
    if cpu_linear.grid_kernels().x_bits == 16:
        x16, step = cpu_linear.sixteen_bit_x(x)
        rounded = (x16.reshape(rows, 18, 32) * step[..., None].double()).reshape(rows, 576)
        off = (rounded - x.double()).abs().reshape(rows, 18, 32)
        assert (off <= 0.501 * step[..., None].double()).all()  # s / 2, and fp32's rounding of x / s (<= 32767 eps)
        slope = (truth["d"][..., None] * truth["q"].reshape(64, 18, 32)).reshape(64, 576).double()  # w - m
        zeros = truth["m"].double().repeat_interleave(32, dim=1) if "m" in truth else torch.zeros(64, 576).double()
        on_grid = rounded @ slope.T + x.double() @ zeros.T + bias.double()
        assert ((got.double() - on_grid).abs() <= bound).all()
        rounding = (0.501 * step.double().repeat_interleave(32, dim=1)) @ slope.abs().T
        assert ((got.double() - exact).abs() <= bound + rounding).all()
        assert (got.double() - exact).abs().max() > bound.max() / 100  # x was rounded: not the fp32 product
    else:
        assert ((got.double() - exact).abs() <= bound).all()
    assert torch.equal(cpu_linear.grid_linear(x.reshape(rows, 1, 576), tiles, bias).reshape(rows, 64), got)
    assert cpu_linear.grid_tiles(layer.weight[:40]) is None  # N not a multiple of 16: the kernel's layout


def bf16_beyond_the_grid(x, layer):
    """A decoder layer's bf16 product beyond its grid's rows: on AMX's tiles where the AMX product is usable,
    unpacked from the grid where the weight has one."""
    if cpu_linear.amx_kernels() is not None:
        tiles = cpu_linear.grid_weight(layer)
        if tiles is not None:
            return cpu_linear.amx_grid_linear(x, tiles)
        return cpu_linear.amx_linear(x, cpu_linear.amx_weight(layer))
    return cpu_linear.bf16_packed_linear(x, packed_bf16_weight(layer))


@pytest.mark.parametrize("value, beyond, head_beyond", [
    (cpu_linear.PACKED_BF16_INT4, bf16_beyond_the_grid,
     lambda x, layer: cpu_linear.bf16_packed_linear(x, packed_bf16_weight(layer))),
    (cpu_linear.PACKED_INT4, lambda x, layer: packed_linear(x, packed_weight(layer)),
     lambda x, layer: packed_linear(x, packed_weight(layer)))])
def test_grid_weights_are_read_at_a_few_rows_and_the_packed_copy_beyond(value, beyond, head_beyond):
    """A 4-bit layer and an 8-bit head from their grids up to `most_grid_rows` rows, larger products and weights off
    both grids from the packed copy (a bf16 layer's on AMX's tiles where they are usable, a grid layer's unpacked
    from its grid with no bf16 copy kept; a head keeps oneDNN's bf16 copy); the first grid read is told once."""
    if cpu_linear.grid_kernels() is None:
        pytest.skip("no compiler for the grid kernel")
    from sglang.srt.layers.quantization.unquant import UnquantizedEmbeddingMethod

    layer_hook, head_hook = hooks_for(value)
    layer, _ = four_bit_layer(64, 576)
    head, _ = eight_bit_layer(256, 576)
    head.quant_method = UnquantizedEmbeddingMethod()
    processor = types.SimpleNamespace(rl_on_policy_target=None, use_fp32_lm_head=False)
    heard = []
    cpu_linear.tell_grid_read(heard.append)
    sglang = lambda *args: "sglang"  # noqa: E731
    bf16 = value in cpu_linear.BF16
    on_amx = bf16 and cpu_linear.amx_kernels() is not None  # a layer's rows above on AMX's tiles, from its grid
    most = {4: cpu_linear.most_grid_rows(bf16, 4, on_amx), 8: cpu_linear.most_grid_rows(bf16, 8)}
    for rows in sorted({1, most[4], most[4] + 1, most[8], most[8] + 1}):
        x = torch.randn(rows, 576)
        from_grid = cpu_linear.grid_linear(x, cpu_linear.grid_weight(layer))
        assert torch.equal(layer_hook(sglang, None, layer, x), from_grid if rows <= most[4] else beyond(x, layer))
        assert not torch.equal(from_grid, beyond(x, layer))
        head_from_grid = cpu_linear.grid_linear(x, cpu_linear.grid_weight(head))
        assert torch.equal(head_hook(sglang, processor, x, head),
                           head_from_grid if rows <= most[8] else head_beyond(x, head))
    assert heard == ["a product of 1 row(s) read its (64, 576) weight from 4 bits"]
    if value == cpu_linear.PACKED_BF16_INT4 and cpu_linear.amx_kernels() is not None:  # read from its grid only
        assert not hasattr(layer, cpu_linear._AMX_CACHE) and not hasattr(layer, cpu_linear._BF16_CACHE)
    plain = layer_of(64, 576)  # off both grids: the packed copy at any size
    x = torch.randn(1, 576)
    assert cpu_linear.grid_weight(plain) is None
    assert torch.equal(layer_hook(sglang, None, plain, x), beyond(x, plain))
    assert layer_hook(sglang, None, layer, x.bfloat16()) == "sglang"  # not an fp32 product


def test_the_bf16_heads_hook_rounds_a_dense_head_and_keeps_a_sparse_one_exact():
    from sglang.srt.layers.quantization.unquant import UnquantizedEmbeddingMethod

    processor = types.SimpleNamespace(rl_on_policy_target=None, use_fp32_lm_head=False)
    hidden = torch.randn(6, 64)
    head = layer_of(500, 64)
    head.quant_method = UnquantizedEmbeddingMethod()
    got = lm_head_hook(None, processor, hidden, head, bf16=True)
    rounded = hidden.bfloat16().double() @ head.weight.bfloat16().double().T
    torch.testing.assert_close(got.double(), rounded, rtol=2.0 ** -8, atol=1e-4)
    assert (got.double() - hidden.double() @ head.weight.double().T).abs().max() > 1e-4
    sparse = layer_of(4096, 64)
    sparse.weight.data[:] = 0
    sparse.weight.data[[3, 4000]] = torch.randn(2, 64)
    sparse.quant_method = head.quant_method
    torch.testing.assert_close(lm_head_hook(None, processor, hidden, sparse, bf16=True), hidden @ sparse.weight.T,
                               rtol=1e-5, atol=1e-5)


def test_the_weight_is_packed_once_and_again_after_it_changes():
    layer = layer_of(32, 16)
    first = packed_weight(layer)
    assert packed_weight(layer) is first  # cached
    with torch.no_grad():
        layer.weight.mul_(2.0)  # an in-place weight update
    second = packed_weight(layer)
    assert second is not first
    x = torch.randn(4, 16)
    torch.testing.assert_close(packed_linear(x, second), x @ layer.weight.T, rtol=1e-5, atol=1e-4)


def test_the_linear_hook_takes_fp32_cpu_products_and_passes_the_rest_to_sglang():
    calls = []

    def original(method, layer, x, bias=None):
        calls.append(x.dtype)
        return "sglang"

    layer = layer_of(8, 4)
    x = torch.randn(3, 4)
    torch.testing.assert_close(linear_hook(original, None, layer, x), x @ layer.weight.T, rtol=1e-5, atol=1e-5)
    assert calls == []
    assert linear_hook(original, None, layer, x.bfloat16()) == "sglang"  # another dtype
    amx = types.SimpleNamespace(weight=layer.weight, use_intel_amx_backend=True)
    assert linear_hook(original, None, amx, x) == "sglang"  # SGLang's own AMX kernel
    assert len(calls) == 2
    assert not applies(x.requires_grad_(), layer.weight)


def test_the_lm_head_hook_matches_sglangs_plain_head_and_leaves_other_heads():
    from sglang.srt.layers.quantization.unquant import UnquantizedEmbeddingMethod

    head = layer_of(500, 64)
    head.quant_method = UnquantizedEmbeddingMethod()
    processor = types.SimpleNamespace(rl_on_policy_target=None, use_fp32_lm_head=False)
    hidden = torch.randn(6, 64)
    calls = []

    def original(processor, hidden_states, lm_head, embedding_bias=None, **kwargs):
        calls.append(lm_head)
        return torch.matmul(hidden_states.to(lm_head.weight.dtype), lm_head.weight.T)

    torch.testing.assert_close(lm_head_hook(original, processor, hidden, head, out=None),
                               original(processor, hidden, head), rtol=1e-5, atol=1e-4)
    assert len(calls) == 1  # only the reference call above
    lora = types.SimpleNamespace(weight=head.weight, quant_method=head.quant_method, set_lora=None)
    quantized = types.SimpleNamespace(weight=head.weight, quant_method=object())
    for other in (lora, quantized):
        lm_head_hook(original, processor, hidden, other)
    lm_head_hook(original, types.SimpleNamespace(rl_on_policy_target="x", use_fp32_lm_head=False), hidden, head)
    assert calls[1:] == [lora, quantized, head]


def test_a_head_of_few_live_rows_is_computed_on_them_alone_and_equals_the_full_product():
    from sglang.srt.layers.quantization.unquant import UnquantizedEmbeddingMethod

    head = layer_of(4096, 64)
    head.weight.data[:] = 0
    head.weight.data[[3, 4000]] = torch.randn(2, 64)  # a classifier folded into an LM head (scoring/probe.py)
    head.quant_method = UnquantizedEmbeddingMethod()
    processor = types.SimpleNamespace(rl_on_policy_target=None, use_fp32_lm_head=False)
    hidden = torch.randn(5, 7, 64)
    expected = torch.matmul(hidden, head.weight.T)
    rows, _ = live_rows(head)
    assert rows.tolist() == [3, 4000]
    got = lm_head_hook(lambda *args, **kwargs: pytest.fail("SGLang's head called"), processor, hidden, head)
    assert got.shape == expected.shape and got[..., 5].abs().max() == 0
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        head.weight[7] = 1.0  # changed in place: its live rows are found again
    assert live_rows(head)[0].tolist() == [3, 7, 4000]
    torch.testing.assert_close(lm_head_hook(None, processor, hidden, head), torch.matmul(hidden, head.weight.T),
                               rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        head.weight[:100] = 1.0  # more live rows than SPARSE_HEAD_SHARE: the packed product
    assert live_rows(head) is None
    torch.testing.assert_close(lm_head_hook(None, processor, hidden, head), torch.matmul(hidden, head.weight.T),
                               rtol=1e-5, atol=1e-4)
    dense = layer_of(4096, 64)
    with torch.no_grad():
        dense.weight.copy_(head.weight)
        dense.weight[100:] = 0
        dense.weight[5] = 2.0
    dense.quant_method = head.quant_method
    torch.testing.assert_close(hooks_for(cpu_linear.PACKED_DENSE)[1](None, processor, hidden, dense),
                               torch.matmul(hidden, dense.weight.T), rtol=1e-5, atol=1e-4)
    assert not hasattr(dense, "_sgltts_live_rows"), "packed-dense never looks for live rows"


def test_the_normalizer_of_a_sparse_heads_logits_is_sglangs_from_the_live_rows_alone():
    """compute_row_log_normalizer's (max, logsumexp - max), exact, for rows that are 0 outside the live columns:
    live values far above, near and far below 0 (where the zeros dominate the sum), and a row of zeros."""
    from sglang.srt.layers.logprob_processor import compute_row_log_normalizer

    from policies.cpu_linear import sparse_row_log_normalizer

    rows = torch.tensor([3, 7, 4000])
    logits = torch.zeros(6, 4096)
    logits[:, rows] = torch.tensor([[90.0, 1.0, -3.0], [0.5, -0.5, 2.0], [-80.0, -90.0, -70.0], [0.0, 0.0, 0.0],
                                    [12.0, 11.5, 12.0], [-1e-3, 3e-4, 0.0]])
    expected_max, expected_sum = compute_row_log_normalizer(logits)
    got_max, got_sum = sparse_row_log_normalizer(logits, rows)
    torch.testing.assert_close(got_max, expected_max)
    torch.testing.assert_close(got_sum, expected_sum, rtol=1e-6, atol=1e-5)


def test_the_normalizer_hook_serves_only_a_process_whose_head_took_the_live_rows_path():
    from sglang.srt.layers.quantization.unquant import UnquantizedEmbeddingMethod

    from policies import cpu_linear

    processor = types.SimpleNamespace(rl_on_policy_target=None, use_fp32_lm_head=False)
    sglangs = []

    def original(logits):
        sglangs.append(logits.shape)
        return "sglang"

    head = layer_of(4096, 64)
    head.weight.data[:] = 0
    head.weight.data[[3, 4000]] = torch.randn(2, 64)
    head.quant_method = UnquantizedEmbeddingMethod()
    dense = layer_of(4096, 64)
    dense.quant_method = head.quant_method
    hidden = torch.randn(5, 64)
    lm_head_hook(None, processor, hidden, dense)
    assert cpu_linear.normalizer_hook(original, torch.zeros(5, 4096)) == "sglang"
    logits = lm_head_hook(None, processor, hidden, head)
    got_max, got_sum = cpu_linear.normalizer_hook(original, logits)
    torch.testing.assert_close(got_sum + got_max, torch.logsumexp(logits, dim=-1), rtol=1e-6, atol=1e-5)
    assert cpu_linear.normalizer_hook(original, torch.zeros(5, 1000)) == "sglang"  # another vocabulary
    lm_head_hook(None, processor, hidden, dense)  # a dense head again: SGLang's normalizer
    assert cpu_linear.normalizer_hook(original, logits) == "sglang"
    assert sglangs == [(5, 4096), (5, 1000), (5, 4096)]
    biased = lm_head_hook(lambda *args, **kwargs: "sglang's head", processor, hidden, head, torch.ones(4096))
    assert biased == "sglang's head", "a head with an embedding bias is SGLang's (the packed paths add none)"


def test_cpu_runtimes_choose_their_linear_layers_by_the_cpus_flags(monkeypatch):
    from sgl_tts import env_names
    from sgl_tts.runtime import server

    monkeypatch.delenv(env_names.CPU_LINEAR, raising=False)
    monkeypatch.setattr(server, "cpu_flags", lambda: {"avx2", "avx512f", "amx_tile", "amx_bf16"})
    assert server.server_env(server.RuntimeConfig())[env_names.CPU_LINEAR] == "packed-bf16-int4"
    kept = server.RuntimeConfig(env={env_names.CPU_LINEAR: "packed"})  # a config that keeps fp32
    assert server.server_env(kept)[env_names.CPU_LINEAR] == "packed"
    assert env_names.CPU_LINEAR not in server.server_env(server.RuntimeConfig(device="cuda"))
    monkeypatch.setattr(server, "cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})  # bf16 dot products, no AMX
    assert server.server_env(server.RuntimeConfig())[env_names.CPU_LINEAR] == "packed-int4"
    monkeypatch.setattr(server, "cpu_flags", lambda: {"sse4_2"})  # no AVX2: the grid kernel unvectorized
    assert server.server_env(server.RuntimeConfig())[env_names.CPU_LINEAR] == "packed"
    monkeypatch.setenv(env_names.CPU_LINEAR, "sglang")  # the caller's environment wins
    assert server.server_env(server.RuntimeConfig())[env_names.CPU_LINEAR] == "sglang"


def greedy_logprobs(url: str, ids: list[int]) -> list:
    """(logprob, token, text) of 8 greedy tokens after `ids`, end of sequence ignored."""
    from sgl_tts.runtime.server import http_json

    answer = http_json(url + "/generate", {"input_ids": ids, "return_logprob": True, "sampling_params": {
        "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}})
    return answer["meta_info"]["output_token_logprobs"]


def fp32_logprobs(model, ids: list[int], generated: list[int]):
    """transformers' fp32 logprobs of `generated` after `ids`."""
    with torch.no_grad():
        logits = model(torch.tensor([ids + generated])).logits[0, len(ids) - 1:-1]
    return torch.log_softmax(logits, dim=-1)[torch.arange(len(generated)), generated]


BF16_PROMPTS = [[1, 2, 3], list(range(5, 40)), [7] * 60]


@pytest.mark.runtime
def test_a_bf16_runtime_decodes_as_transformers_does_to_bf16s_precision(tiny_runtime, tmp_path):
    """A runtime with $SGLTTS_CPU_LINEAR=packed-bf16: greedy decoding with the logprobs of transformers' fp32 model to
    within bf16's rounding, and not the fp32 runtime's exact ones (the bf16 path did run). Both runtimes answer the
    same prompts; the fp32 one is the shared test runtime."""
    from transformers import AutoModelForCausalLM

    from sgl_tts import env_names
    from sgl_tts.runtime.server import Runtime, RuntimeConfig

    config = RuntimeConfig(model="tiny-random", max_total_tokens=4096, env={env_names.CPU_LINEAR: "packed-bf16"})
    with Runtime.start(config, name="tiny-bf16", log_dir=tmp_path) as bf16_runtime:
        served = [greedy_logprobs(bf16_runtime.url, ids) for ids in BF16_PROMPTS]
        log = bf16_runtime.log_path.read_text()
    assert "packed-bf16 linear layers installed" in log
    model = AutoModelForCausalLM.from_pretrained(tiny_runtime.model_path, dtype=torch.float32).eval()
    largest_difference_from_fp32 = 0.0
    for ids, answer in zip(BF16_PROMPTS, served):
        generated = [token for _, token, _ in answer]
        got = torch.tensor([logprob for logprob, _, _ in answer])
        torch.testing.assert_close(got, fp32_logprobs(model, ids, generated), atol=2e-2, rtol=0)
        fp32 = torch.tensor([logprob for logprob, _, _ in greedy_logprobs(tiny_runtime.url, ids)[:len(generated)]])
        largest_difference_from_fp32 = max(largest_difference_from_fp32, (got - fp32).abs().max().item())
    assert largest_difference_from_fp32 > 1e-5


@pytest.mark.runtime
@pytest.mark.parametrize("linear", ["packed-bf16-int4", "packed-int4"])
def test_a_quantized_model_decodes_from_its_grids_as_transformers_does(tiny_grid_model, tmp_path, linear):
    """The tiny model with every decoder linear weight put on a Q4_1 grid and its embedding (its tied LM head) on a
    Q8_0 grid, as a GGUF file's converted weights are, served with $SGLTTS_CPU_LINEAR=packed-bf16-int4 (the default
    where the CPU has AMX) or packed-int4 (where it has AVX2 and no AMX): one request at a time reads the grids (the
    plugin says so), and greedy decoding keeps transformers' fp32 logprobs of that model; with packed-int4 to 1e-3
    (a grid product is the fp32 weight's, or with VNNI that of x within 1.5e-5 of its group's largest |x|, and
    longer prompts' prefills read fp32), with packed-bf16-int4 to bf16's precision (those prefills read bf16)."""
    from sgl_tts import env_names
    from sgl_tts.runtime.server import Runtime, RuntimeConfig

    folder, model = tiny_grid_model
    config = RuntimeConfig(model=str(folder), max_total_tokens=4096, env={env_names.CPU_LINEAR: linear})
    with Runtime.start(config, name="tiny-grids", log_dir=tmp_path) as grid_runtime:
        served = [greedy_logprobs(grid_runtime.url, ids) for ids in BF16_PROMPTS]
        log = grid_runtime.log_path.read_text()
    assert f"{linear} linear layers installed" in log
    assert "row(s) read its" in log and "weight from 4 bits" in log
    assert "lean decode took a compiled step" in log  # policies/decode_step.cpp
    for ids, answer in zip(BF16_PROMPTS, served):
        generated = [token for _, token, _ in answer]
        got = torch.tensor([logprob for logprob, _, _ in answer])
        fp32_prefills = linear == cpu_linear.PACKED_INT4 or len(ids) <= cpu_linear.most_grid_rows(
            True, 4, cpu_linear.amx_kernels() is not None)
        torch.testing.assert_close(got, fp32_logprobs(model, ids, generated), atol=1e-3 if fp32_prefills else 2e-2,
                                   rtol=0)
