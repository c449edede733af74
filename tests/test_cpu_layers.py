"""The compiled RMSNorm and rotary embedding (policies/cpu_layers.py) against SGLang's own torch versions, and the
calls they leave to SGLang."""

import shutil

import pytest

torch = pytest.importorskip("torch")
layernorm = pytest.importorskip("sglang.srt.layers.layernorm")
rope_base = pytest.importorskip("sglang.srt.layers.rotary_embedding.base")

from policies.cpu_layers import layer_kernels, norm_hook, rotary_hook  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="no C++ compiler here: the kernels are not built, SGLang's own run")
NORM = layernorm.RMSNorm.forward_native
ROTARY = rope_base.RotaryEmbedding.forward_native


def a_norm(hidden=576, seed=0):
    norm = layernorm.RMSNorm(hidden, eps=1e-5)
    norm.weight.data = torch.randn(hidden, generator=torch.Generator().manual_seed(seed))
    return norm


def a_rotary(head_size=64, rotary_dim=64, neox=True, max_position=512, cached=True):
    """SGLang's RotaryEmbedding with the fields forward_native reads (its constructor outside a runtime looks for a
    CUDA kernel), the cache in its layout: cos | sin of position x 10000^(-2i / rotary_dim)."""
    rotary = rope_base.RotaryEmbedding.__new__(rope_base.RotaryEmbedding)
    torch.nn.Module.__init__(rotary)
    rotary.head_size, rotary.rotary_dim, rotary.is_neox_style = head_size, rotary_dim, neox
    inverse_frequency = 1.0 / 10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim)
    angles = torch.outer(torch.arange(max_position, dtype=torch.float), inverse_frequency)
    rotary.register_buffer("cos_sin_cache", torch.cat([angles.cos(), angles.sin()], dim=-1), persistent=False)
    rotary._apply_rotary_emb_wrapped = rope_base.apply_rotary_emb if cached else torch.compile(
        rope_base.apply_rotary_emb)
    return rotary


@pytest.mark.parametrize("rows", [1, 3, 64])
def test_the_norm_matches_sglangs_with_and_without_a_residual(rows):
    norm = a_norm()
    generator = torch.Generator().manual_seed(rows)
    fused = torch.randn(rows, 3 * 576, generator=generator)
    x = fused[:, 576:1152]  # a strided view, as a slice of a fused projection is
    residual = torch.randn(rows, 576, generator=generator)
    torch.testing.assert_close(norm_hook(NORM, norm, x), NORM(norm, x), rtol=1e-5, atol=1e-5)
    normed, added = norm_hook(NORM, norm, x, residual.clone())
    expected_normed, expected_added = NORM(norm, x, residual.clone())
    torch.testing.assert_close(added, expected_added, rtol=0, atol=0)  # the sum is one rounding either way
    torch.testing.assert_close(normed, expected_normed, rtol=1e-5, atol=1e-5)
    assert layer_kernels() is not None


def test_the_norm_leaves_what_it_does_not_cover_to_sglang():
    calls = []

    def original(norm, x, residual=None, post=None, quant=None):
        calls.append(x.dtype)
        return "sglang"

    norm = a_norm()
    assert norm_hook(original, norm, torch.randn(2, 576, dtype=torch.bfloat16)) == "sglang"  # another dtype
    assert norm_hook(original, norm, torch.randn(2, 576), torch.randn(2, 576), torch.randn(2, 576)) == "sglang"
    norm.variance_size_override = 64  # a norm over part of the hidden size
    assert norm_hook(original, norm, torch.randn(2, 576)) == "sglang"
    assert len(calls) == 3


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [64, 32])
@pytest.mark.parametrize("rows", [1, 5])
def test_the_rotary_embedding_matches_sglangs(neox, rotary_dim, rows):
    """Both rotations (neox halves, GPT-J pairs), a partial rotary dimension, query and key as the strided slices
    of the fused qkv projection SGLang passes, 9 query heads and 3 KV heads of 64, positions anywhere in the cache."""
    rotary = a_rotary(rotary_dim=rotary_dim, neox=neox)
    generator = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (9 + 3 + 3) * 64, generator=generator)
    query, key = qkv[:, : 9 * 64], qkv[:, 9 * 64: 12 * 64]
    positions = torch.randint(0, 512, (rows,), generator=generator)
    rotated_query, rotated_key = rotary_hook(ROTARY, rotary, positions, query, key)
    expected_query, expected_key = ROTARY(rotary, positions, query, key)
    torch.testing.assert_close(rotated_query, expected_query, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rotated_key, expected_key, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(qkv[:, : 9 * 64], query)  # the inputs are left as they were


def test_the_rotary_embedding_leaves_what_it_does_not_cover_to_sglang():
    calls = []

    def original(rotary, positions, query, key, offsets=None, fused=None):
        calls.append(1)
        return "sglang"

    query, key, positions = torch.randn(2, 9 * 64), torch.randn(2, 3 * 64), torch.tensor([3, 4])
    assert rotary_hook(original, a_rotary(), positions, query, key, offsets=torch.tensor([1, 1])) == "sglang"
    assert rotary_hook(original, a_rotary(cached=False), positions, query, key) == "sglang"  # its own rotation
    assert rotary_hook(original, a_rotary(), positions, query.bfloat16(), key.bfloat16()) == "sglang"
    assert len(calls) == 3
