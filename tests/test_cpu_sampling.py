"""Inverse-CDF sampling against a brute-force search of the cumulative sum, and against the distribution it must
draw from (a chi-square test, and torch.multinomial's frequencies); what it leaves to SGLang."""

import pytest

torch = pytest.importorskip("torch")

from policies.cpu_sampling import (flush_denormals, inverse_cdf, sample, sampler_hook, sampling_hook,  # noqa: E402
                                   sampling_kernel, softmax_hook, split_hook)


def brute_force_token(row: list[float], u: float) -> int:
    """The first index whose running total exceeds u x the total, by walking the row."""
    total = sum(row)
    running = 0.0
    for index, p in enumerate(row):
        running += p
        if running > u * total:
            return index
    return len(row) - 1


def kernel_draw(probs, uniform):
    """The compiled draw of every row (policies/cpu_sampling.cpp), on fp32."""
    if sampling_kernel() is None:
        pytest.skip("the sampling kernel is not built here")
    return sampling_kernel().inverse_cdf_rows(probs.float(), torch.arange(len(probs)), uniform.float()).long()


DRAWS = {"torch": inverse_cdf, "kernel": kernel_draw}


@pytest.mark.parametrize("draw", DRAWS.values(), ids=DRAWS.keys())
def test_inverse_cdf_picks_the_token_a_walk_over_the_row_picks(draw):
    generator = torch.Generator().manual_seed(0)
    probs = torch.rand(6, 40, generator=generator, dtype=torch.float64).float().double()  # fp32 values
    probs[probs < 0.3] = 0.0  # tokens of probability zero among the others
    for u in (0.0, 0.01, 0.25, 0.5, 0.77, 0.999999):
        uniform = torch.full((6,), u, dtype=torch.float64)
        got = draw(probs, uniform).tolist()
        assert got == [brute_force_token(row, u) for row in probs.tolist()]


def test_the_kernel_draws_a_vocabulary_row_as_the_walk_does():
    """Rows of SmolLM2's vocabulary width (3,072 blocks of 16, the last ones partly zero), listed out of order from
    a wider tensor, each with its own uniform."""
    if sampling_kernel() is None:
        pytest.skip("the sampling kernel is not built here")
    generator = torch.Generator().manual_seed(3)
    wide = torch.softmax(torch.randn(5, 49_160, generator=generator) * 3, dim=-1)
    wide[:, 49_140:] = 0.0
    probs = wide[:, :49_152]  # rows 49,160 apart
    rows = torch.tensor([4, 0, 2, 2])
    uniform = torch.rand(4, generator=generator)
    got = sampling_kernel().inverse_cdf_rows(probs, rows, uniform)
    assert got.dtype == torch.int32
    assert got.tolist() == [brute_force_token(probs[r].double().tolist(), float(u)) for r, u in zip(rows, uniform)]


@pytest.mark.parametrize("draw", DRAWS.values(), ids=DRAWS.keys())
def test_a_token_of_probability_zero_is_never_drawn(draw):
    probs = torch.zeros(4, 1000)
    probs[:, [3, 500, 999]] = torch.tensor([0.2, 0.5, 0.3])
    probs[1, 0] = 0.0
    uniform = torch.cat([torch.zeros(1), torch.rand(20_000 - 2), torch.full((1,), 1 - 2**-24)])
    rows = probs[torch.arange(20_000) % 4]
    tokens = draw(rows, uniform)
    assert set(tokens.unique().tolist()) <= {3, 500, 999}


def test_the_kernel_gives_a_row_of_zeros_the_last_token_as_torch_does():
    probs = torch.zeros(2, 100)
    probs[1, 7] = 1.0
    assert kernel_draw(probs, torch.tensor([0.5, 0.5])).tolist() == inverse_cdf(probs, torch.tensor([0.5, 0.5])).tolist() \
        == [99, 7]


def test_the_sampler_softmax_is_written_over_the_logits_inside_the_sampler_only():
    """Inside Sampler.forward (marked by sampler_hook) the softmax is torch's, written over the logits; elsewhere
    (speculative decoding's draft calls the same function) and with temperatures it is SGLang's, the logits kept."""
    calls = []

    def original(logits, temperatures=None):
        calls.append(temperatures)
        return torch.softmax(logits if temperatures is None else logits / temperatures, dim=-1)

    logits = torch.randn(3, 50) * 4
    expected = torch.softmax(logits, dim=-1)
    kept = logits.clone()
    assert torch.equal(softmax_hook(original, logits), expected) and torch.equal(logits, kept) and calls == [None]

    def sampler_forward(sampler, logits, temperatures=None):
        assert sampler == "sampler"
        return softmax_hook(original, logits, temperatures)

    got = sampler_hook(sampler_forward, "sampler", logits)
    assert got.data_ptr() == logits.data_ptr() and torch.equal(logits, expected) and calls == [None]
    temperatures = torch.full((3, 1), 0.5)
    again = kept.clone()
    assert torch.equal(sampler_hook(sampler_forward, "sampler", again, temperatures),
                       torch.softmax(kept / temperatures, dim=-1))
    assert torch.equal(again, kept) and calls == [None, temperatures]

    def failing(sampler, logits):
        raise RuntimeError("inside the sampler")

    with pytest.raises(RuntimeError):
        sampler_hook(failing, "sampler", logits)
    softmax_hook(original, kept)  # the mark is gone after the sampler's call, even one that raised
    assert len(calls) == 3


@pytest.mark.parametrize("temperature", [0.3, 1.0])
def test_draws_follow_the_distribution(temperature):
    """20,000 draws from one softmax row: chi-square against p with the 5% critical value, and within a few
    standard errors of torch.multinomial's frequencies (SGLang's sampler)."""
    torch.manual_seed(1)
    logits = torch.randn(30) * 2
    probs = torch.softmax(logits / temperature, dim=-1)
    draws = 20_000
    tokens = sample(probs.expand(draws, -1).contiguous())
    assert tokens.dtype == torch.int32 and tokens.shape == (draws,)
    counts = torch.bincount(tokens.long(), minlength=30).double()
    expected = probs.double() * draws
    kept = expected >= 5  # the chi-square approximation's rule; the rare tokens pooled into one cell
    observed_cells = torch.cat([counts[kept], counts[~kept].sum().view(1)])
    expected_cells = torch.cat([expected[kept], expected[~kept].sum().view(1)])
    nonempty = expected_cells > 0
    chi2 = (((observed_cells - expected_cells) ** 2)[nonempty] / expected_cells[nonempty]).sum().item()
    from scipy.stats import chi2 as chi2_distribution

    assert chi2 < chi2_distribution.ppf(0.999, int(nonempty.sum()) - 1)
    reference = torch.bincount(torch.multinomial(probs, draws, replacement=True), minlength=30).double()
    standard_error = (expected * (1 - probs.double())).sqrt() * 2 ** 0.5 + 1
    assert ((counts - reference).abs() <= 5 * standard_error).all()


def test_seeded_sampling_and_other_shapes_go_to_sglang():
    calls = []

    def original(probs, sampling_seed=None, positions=None):
        calls.append(sampling_seed)
        return "sglang"

    probs = torch.softmax(torch.randn(3, 10), dim=-1)
    assert sampling_hook(original, probs, sampling_seed=torch.tensor([7, 7, 7]), positions=torch.arange(3)) \
        == "sglang"
    assert sampling_hook(original, probs[0]) == "sglang"  # not a [B, V] batch
    got = sampling_hook(original, probs)
    assert len(calls) == 2 and got.shape == (3,) and got.dtype == torch.int32
    assert ((0 <= got) & (got < 10)).all()


def test_a_batch_with_a_top_k_samples_each_row_by_what_it_asks():
    """Greedy rows are the argmax, unfiltered rows follow their distribution (with the greedy rows beside them), and
    only the rows with a real top-k / top-p go to SGLang's sort, with their own arguments."""
    from sglang.srt.layers.sampler import top_k_top_p_min_p_sampling_from_probs_torch as sglang_sort
    from sglang.srt.sampling.sampling_params import TOP_K_ALL

    torch.manual_seed(2)
    vocab, draws = 30, 4000
    row = torch.softmax(torch.randn(vocab) * 2, dim=-1)
    greedy_row = torch.softmax(torch.randn(vocab) * 2, dim=-1)
    probs = torch.stack([greedy_row, row, row]).repeat(draws, 1)  # per draw: a greedy, a plain, a top-k 3 row
    top_ks = torch.tensor([1, TOP_K_ALL, 3], dtype=torch.int32).repeat(draws)
    top_ps = torch.tensor([1.0, 1.0, 1.0]).repeat(draws)
    sent = []

    def original(probs, top_ks, top_ps, min_ps, need_min_p, seed, positions, **kwargs):
        sent.append((probs.shape[0], sorted(set(top_ks.tolist())), kwargs))
        return sglang_sort(probs, top_ks, top_ps, min_ps, need_min_p, seed, positions, **kwargs)

    tokens = split_hook(original, probs, top_ks, top_ps, torch.zeros(3 * draws), False, None, None,
                        max_top_k=None)
    assert tokens.dtype == torch.int32 and tokens.shape == (3 * draws,)
    assert (tokens[0::3] == int(greedy_row.argmax())).all()
    assert sent == [(draws, [3], {"max_top_k": 3})], "only the top-k rows, with their own k"
    top3 = set(row.topk(3).indices.tolist())
    assert set(tokens[2::3].tolist()) <= top3
    counts = torch.bincount(tokens[1::3].long(), minlength=vocab).double()
    standard_error = (row.double() * (1 - row.double()) * draws).sqrt() + 1
    assert ((counts - row.double() * draws).abs() <= 5 * standard_error).all(), "the plain rows follow p"
    assert len(set(tokens[1::3].tolist()) - top3) > 0, "the plain rows are not cut to the top 3"


def test_seeded_or_filtered_output_goes_to_sglang_whole():
    calls = []

    def original(*args, **kwargs):
        calls.append(kwargs)
        return "sglang"

    probs = torch.softmax(torch.randn(2, 10), dim=-1)
    top_ks, ps = torch.tensor([1, 5], dtype=torch.int32), torch.ones(2)
    assert split_hook(original, probs, top_ks, ps, ps * 0, False, torch.tensor([1, 2]), torch.arange(2)) == "sglang"
    assert split_hook(original, probs, top_ks, ps, ps * 0, False, None, None, return_filtered_probs=True) == "sglang"
    assert [c["return_filtered_probs"] for c in calls] == [False, True]


def test_denormals_are_flushed_to_zero_in_the_thread_that_asks_only():
    """FTZ/DAZ are per thread: the plugin flushes in the scheduler's thread, where the softmax runs."""
    import threading

    results = {}

    def product(flush: bool) -> None:
        if flush:
            assert flush_denormals()
        results[flush] = (torch.tensor([1e-20]) * torch.tensor([1e-20])).item()  # 1e-40: below fp32's 1.2e-38

    for flush in (True, False):
        worker = threading.Thread(target=product, args=(flush,))
        worker.start()
        worker.join()
    assert results[True] == 0.0
    assert 0.0 < results[False] < 1.2e-38


def test_cpu_runtimes_flush_denormals_unless_told_to_keep_them(monkeypatch):
    from sgl_tts import env_names
    from sgl_tts.runtime import server

    monkeypatch.delenv(env_names.CPU_DENORMALS, raising=False)
    assert server.server_env(server.RuntimeConfig())[env_names.CPU_DENORMALS] == "flush"
    assert server.server_env(server.RuntimeConfig(env={env_names.CPU_DENORMALS: "keep"}))[
        env_names.CPU_DENORMALS] == "keep"
    assert env_names.CPU_DENORMALS not in server.server_env(server.RuntimeConfig(device="cuda"))
    monkeypatch.setenv(env_names.CPU_DENORMALS, "keep")  # the caller's environment wins too
    assert server.server_env(server.RuntimeConfig())[env_names.CPU_DENORMALS] == "keep"
