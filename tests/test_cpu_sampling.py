"""Inverse-CDF sampling against a brute-force search of the cumulative sum, and against the distribution it must
draw from (a chi-square test, and torch.multinomial's frequencies); what it leaves to SGLang."""

import pytest

torch = pytest.importorskip("torch")

from policies.cpu_sampling import inverse_cdf, sample, sampling_hook  # noqa: E402


def brute_force_token(row: list[float], u: float) -> int:
    """The first index whose running total exceeds u x the total, by walking the row."""
    total = sum(row)
    running = 0.0
    for index, p in enumerate(row):
        running += p
        if running > u * total:
            return index
    return len(row) - 1


def test_inverse_cdf_picks_the_token_a_walk_over_the_row_picks():
    generator = torch.Generator().manual_seed(0)
    probs = torch.rand(6, 40, generator=generator, dtype=torch.float64)
    probs[probs < 0.3] = 0.0  # tokens of probability zero among the others
    for u in (0.0, 0.01, 0.25, 0.5, 0.77, 0.999999):
        uniform = torch.full((6,), u, dtype=torch.float64)
        got = inverse_cdf(probs, uniform).tolist()
        assert got == [brute_force_token(row, u) for row in probs.tolist()]


def test_a_token_of_probability_zero_is_never_drawn():
    probs = torch.zeros(4, 1000)
    probs[:, [3, 500, 999]] = torch.tensor([0.2, 0.5, 0.3])
    probs[1, 0] = 0.0
    uniform = torch.cat([torch.zeros(1), torch.rand(20_000 - 2), torch.full((1,), 1 - 2**-24)])
    rows = probs[torch.arange(20_000) % 4]
    tokens = inverse_cdf(rows, uniform)
    assert set(tokens.unique().tolist()) <= {3, 500, 999}


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
