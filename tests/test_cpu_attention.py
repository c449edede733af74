"""The batched and paged decode attention against SGLang's own per-sequence loop, and their fallbacks."""

import os
import shutil

import pytest

torch = pytest.importorskip("torch")
torch_native = pytest.importorskip("sglang.srt.layers.attention.torch_native_backend")

from policies.cpu_attention import (batched_decode, extend_hook, make_decode_hook, paged_decode,  # noqa: E402
                                    paged_kernel)

needs_a_compiler = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                      reason="no C++ compiler here: the kernel is not built, the torch paths run")
LOOP = torch_native.TorchNativeAttnBackend._run_sdpa_forward_decode
EXTEND_LOOP = torch_native.TorchNativeAttnBackend._run_sdpa_forward_extend


def paged_batch(batch, heads=9, kv_heads=3, dim=16, slots=600, seed=0):
    generator = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(slots, kv_heads, dim, generator=generator)
    v_cache = torch.randn(slots, kv_heads, dim, generator=generator)
    req_to_token = torch.randint(0, slots - 1, (batch + 3, 64), generator=generator, dtype=torch.int32)
    req_pool_indices = torch.randperm(batch + 3, generator=generator)[:batch]
    seq_lens = torch.randint(1, 64, (batch,), generator=generator)
    query = torch.randn(batch, heads, dim, generator=generator)
    return query, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens


@pytest.mark.parametrize("batch", [1, 2, 7, 32])
@pytest.mark.parametrize("kv_heads", [3, 9])
def test_batched_decode_matches_sglangs_loop(batch, kv_heads):
    query, k_cache, v_cache, req_to_token, pool, seq_lens = paged_batch(batch, kv_heads=kv_heads, seed=batch)
    gqa = kv_heads != 9
    expected = LOOP(None, query, torch.empty_like(query), k_cache, v_cache, req_to_token, pool, seq_lens,
                    scaling=0.25, enable_gqa=gqa)
    output = torch.full_like(query, float("nan"))
    batched_decode(query, output, k_cache, v_cache, req_to_token, pool, seq_lens, scaling=0.25, enable_gqa=gqa)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("decode", [batched_decode, paged_decode])
def test_padding_slots_are_never_attended(decode):
    query, k_cache, v_cache, req_to_token, pool, seq_lens = paged_batch(4)
    seq_lens[:] = torch.tensor([1, 5, 63, 20])
    first = decode(query, torch.empty_like(query), k_cache, v_cache, req_to_token, pool, seq_lens,
                   scaling=0.25, enable_gqa=True).clone()
    # Point every slot past each sequence's length at the one slot no sequence uses, and poison it.
    poison = k_cache.shape[0] - 1
    for row, length in zip(pool.tolist(), seq_lens.tolist()):
        req_to_token[row, length:] = poison
    k_cache[poison], v_cache[poison] = 1e4, -1e4
    second = decode(query, torch.empty_like(query), k_cache, v_cache, req_to_token, pool, seq_lens,
                    scaling=0.25, enable_gqa=True)
    torch.testing.assert_close(second, first)


@needs_a_compiler
def test_the_paged_kernel_is_built_where_a_compiler_is():
    kernel = paged_kernel()
    assert kernel is not None and callable(kernel.paged_attention)


def test_the_kernel_builds_from_its_own_copy_of_the_source(tmp_path, monkeypatch):
    """ninja rebuilds when a source's path changes: two checkouts (a CI clone, a worktree) must not take turns
    rebuilding one kernel, so the build reads a copy kept in its own directory, written only when it differs."""
    import torch.utils.cpp_extension as cpp_extension

    import policies.cpu_attention as cpu_attention

    monkeypatch.setenv("SGLTTS_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: calls.append(kwargs) or "built")
    paged_kernel.cache_clear()
    try:
        assert paged_kernel() == "built"
        [source] = calls[0]["sources"]
        assert source.startswith(calls[0]["build_directory"])
        assert open(source, "rb").read() == cpu_attention.KERNEL_SOURCE.read_bytes()
        written = os.stat(source).st_mtime_ns
        paged_kernel.cache_clear()
        paged_kernel()
        assert calls[1]["sources"] == [source] and os.stat(source).st_mtime_ns == written
    finally:
        paged_kernel.cache_clear()


@pytest.mark.parametrize("level, flags, vnni", [("AVX512", {"avx512f", "avx512_vnni"}, True),
                                               ("AVX512", {"avx512f"}, False), ("AVX2", {"avx2", "avx512_vnni"}, False)])
def test_kernels_use_vnni_where_the_cpu_has_it(tmp_path, monkeypatch, level, flags, vnni):
    """An AVX-512 build adds VNNI's dot products where /proc/cpuinfo lists avx512_vnni (x86-64-v4 leaves them out),
    under a name of its own, so a cache shared with a CPU without them never loads them there."""
    import torch
    import torch.utils.cpp_extension as cpp_extension

    import policies.cpu_attention as cpu_attention

    monkeypatch.setenv("SGLTTS_CACHE", str(tmp_path))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: level)
    monkeypatch.setattr(cpu_attention, "cpu_flags", lambda cpuinfo=None: flags)
    calls = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: calls.append(kwargs) or "built")
    assert cpu_attention.build_kernel(b"// a kernel", tmp_path / "kernel.cpp") == "built"
    assert ("-mavx512vnni" in calls[0]["extra_cflags"]) == vnni
    assert calls[0]["name"].startswith(f"sgltts_kernel_{level.lower()}{'_vnni' if vnni else ''}_")


@pytest.mark.parametrize("batch", [1, 2, 7, 32])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 16), (9, 9, 16), (9, 3, 64), (9, 9, 64), (8, 1, 64),
                                                (14, 2, 64), (12, 2, 128), (10, 1, 64)])
def test_paged_decode_matches_sglangs_loop(batch, heads, kv_heads, dim):
    """The compiled kernel against SGLang's loop, on a query that is a strided view (as SGLang's q is: a slice of
    the fused qkv projection) and a cache whose pool rows are shared by several sequences (forks). Head dimensions
    64 and 128 with up to 8 query heads per KV head take the kernel's register path, the others its plain loops;
    the lengths (1-63) cover its blocks of 8 or 16 keys (AVX2, AVX-512) in pass 1 and in the exponentials, and the
    keys after the last block."""
    query, k_cache, v_cache, req_to_token, pool, seq_lens = paged_batch(batch, heads=heads, kv_heads=kv_heads,
                                                                        dim=dim, seed=batch)
    req_to_token[:, :10] = req_to_token[0, :10]  # a prefix every sequence shares
    fused = torch.cat([query, torch.randn_like(query)], dim=2)  # [batch, heads, 2 * dim]
    query = fused[:, :, : query.shape[2]]
    gqa = kv_heads != heads
    expected = LOOP(None, query.contiguous(), torch.empty_like(query), k_cache, v_cache, req_to_token, pool,
                    seq_lens, scaling=0.25, enable_gqa=gqa)
    output = torch.full_like(expected, float("nan"))
    paged_decode(query, output, k_cache, v_cache, req_to_token, pool, seq_lens, scaling=0.25, enable_gqa=gqa)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)


@needs_a_compiler
@pytest.mark.parametrize("dim", [16, 64])
def test_the_kernel_reads_a_bf16_pool_as_those_values_in_fp32(dim):
    """With `--kv-cache-dtype bf16` the pool holds bf16 keys and values: decode and extend read them widened to fp32,
    so they equal SGLang's loop over the same bf16 values held in fp32, on either of the kernel's paths."""
    query, k_cache, v_cache, req_to_token, pool, seq_lens = paged_batch(7, dim=dim, seed=dim)
    k_bf16, v_bf16 = k_cache.bfloat16(), v_cache.bfloat16()
    assert not torch.equal(k_bf16.float(), k_cache)  # the rounding is real: the test would see fp32 values read
    expected = LOOP(None, query, torch.empty_like(query), k_bf16.float(), v_bf16.float(), req_to_token, pool,
                    seq_lens, scaling=0.25, enable_gqa=True)
    output = torch.full_like(query, float("nan"))
    paged_decode(query, output, k_bf16, v_bf16, req_to_token, pool, seq_lens, scaling=0.25, enable_gqa=True)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)

    extend_seq_lens = torch.minimum(seq_lens, torch.tensor(5))
    prefix_lens = seq_lens - extend_seq_lens
    rows = torch.randn(int(extend_seq_lens.sum()), 9, dim)
    expected = EXTEND_LOOP(None, rows, torch.empty_like(rows), k_bf16.float(), v_bf16.float(), req_to_token, pool,
                           seq_lens, prefix_lens, extend_seq_lens, scaling=0.25, enable_gqa=True, causal=True)
    output = torch.full_like(rows, float("nan"))
    extend_hook(EXTEND_LOOP, None, rows, output, k_bf16, v_bf16, req_to_token, pool, seq_lens, prefix_lens,
                extend_seq_lens, scaling=0.25, enable_gqa=True, causal=True)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("extends", [[1, 1, 1], [5, 1, 12], [30, 2, 7, 1]])
@pytest.mark.parametrize("dim", [16, 64])
def test_paged_extend_matches_sglangs_loop(extends, dim):
    """Extend after a cached prefix (the prefix lengths differ, one sequence has none): the kernel's rows against
    SGLang's loop, which attends from the whole sequence and keeps the new rows."""
    batch = len(extends)
    query, k_cache, v_cache, req_to_token, pool, seq_lens = paged_batch(batch, dim=dim, seed=sum(extends))
    extend_seq_lens = torch.tensor(extends)
    prefix_lens = torch.randint(0, 40, (batch,), generator=torch.Generator().manual_seed(batch))
    prefix_lens[-1] = 0
    seq_lens = prefix_lens + extend_seq_lens
    query = torch.randn(int(extend_seq_lens.sum()), 9, k_cache.shape[2])
    expected = EXTEND_LOOP(None, query, torch.empty_like(query), k_cache, v_cache, req_to_token, pool, seq_lens,
                           prefix_lens, extend_seq_lens, scaling=0.25, enable_gqa=True, causal=True)
    output = torch.full_like(query, float("nan"))
    assert extend_hook(EXTEND_LOOP, None, query, output, k_cache, v_cache, req_to_token, pool, seq_lens,
                       prefix_lens, extend_seq_lens, scaling=0.25, enable_gqa=True, causal=True) is output
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)


@needs_a_compiler
def test_the_extend_hook_passes_what_the_kernel_does_not_cover_to_sglang():
    query, k_cache, v_cache, req_to_token, pool, seq_lens = paged_batch(2)
    calls = []

    def original(backend, *args, **kwargs):
        calls.append(kwargs)
        return "loop"

    extend_seq_lens = torch.tensor([2, 3])
    args = (torch.randn(5, 9, 16), torch.empty(5, 9, 16), k_cache, v_cache, req_to_token, pool,
            extend_seq_lens + 4, torch.tensor([4, 4]), extend_seq_lens)
    assert extend_hook(original, None, *args, causal=False) == "loop"  # an encoder's attention
    assert extend_hook(original, None, *args, causal=True, sliding_window_size=8) == "loop"
    assert extend_hook(original, None, *args, causal=True, is_cross_attn=True) == "loop"
    assert len(calls) == 3
    assert extend_hook(original, None, *args, causal=True, sliding_window_size=-1) is args[1]
    assert len(calls) == 3


def test_paged_decode_takes_the_torch_path_for_what_the_kernel_does_not_take():
    """bf16 caches: not the kernel's (fp32 only), batched_decode's result."""
    query, k_cache, v_cache, req_to_token, pool, seq_lens = paged_batch(5)
    k_cache, v_cache = k_cache.to(torch.bfloat16), v_cache.to(torch.bfloat16)
    expected = batched_decode(query, torch.empty_like(query), k_cache, v_cache, req_to_token, pool, seq_lens,
                              scaling=0.25, enable_gqa=True)
    output = paged_decode(query, torch.empty_like(query), k_cache, v_cache, req_to_token, pool, seq_lens,
                          scaling=0.25, enable_gqa=True)
    torch.testing.assert_close(output, expected)


def test_hook_passes_what_it_does_not_cover_to_sglang():
    query, k_cache, v_cache, req_to_token, pool, seq_lens = paged_batch(3)
    calls = []

    def original(backend, *args, **kwargs):
        calls.append(kwargs)
        return "loop"

    args = (query, torch.empty_like(query), k_cache, v_cache, req_to_token, pool, seq_lens)
    decode_hook = make_decode_hook(batched_decode)
    assert decode_hook(original, None, *args, sliding_window_size=8) == "loop"
    assert decode_hook(original, None, *args, encoder_lens=seq_lens) == "loop"
    assert decode_hook(original, None, *args, is_cross_attn=True) == "loop"
    assert len(calls) == 3
    assert decode_hook(original, None, *args, sliding_window_size=-1, enable_gqa=True) is args[1]
    assert len(calls) == 3


@pytest.mark.runtime
def test_a_cpu_runtime_decodes_as_transformers_does(tiny_runtime):
    """Greedy decoding of several prompts of different lengths at once on the CPU runtime (batched decode attention
    by default): every generated token's logprob is what transformers computes for the same token sequence."""
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoModelForCausalLM

    from sgl_tts.runtime.server import http_json

    prompts = [[1, 2, 3], list(range(5, 40)), list(range(100, 117)), [7] * 60]

    def generate(ids):
        return http_json(tiny_runtime.url + "/generate", {
            "input_ids": ids, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}})

    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(generate, prompts))
    model = AutoModelForCausalLM.from_pretrained(tiny_runtime.model_path, dtype=torch.float32).eval()
    for ids, answer in zip(prompts, answers):
        generated = [token for _, token, _ in answer["meta_info"]["output_token_logprobs"]]
        served = torch.tensor([logprob for logprob, _, _ in answer["meta_info"]["output_token_logprobs"]])
        assert len(generated) == 12
        with torch.no_grad():
            logits = model(torch.tensor([ids + generated])).logits[0, len(ids) - 1:-1]
        reference = torch.log_softmax(logits.float(), dim=-1)
        torch.testing.assert_close(served, reference[torch.arange(12), generated], atol=2e-3, rtol=0)
        # Greedy: each token is transformers' best (or within the tolerance of it).
        best = reference.max(dim=-1).values
        assert bool((reference[torch.arange(12), generated] >= best - 2e-3).all())
