import numpy as np
import pytest

from sgl_tts.cli import build_parser
from sgl_tts.cli import plan as plan_cli
from sgl_tts.rsd.specdec import (
    CONTRACTS,
    acceptance_probability,
    distribution_preserving_round,
    expected_emitted_tokens,
    greedy_round,
    plan_spec,
    residual_distribution,
    round_cost,
    speculative_round,
    speed_ratio,
)

DRAWS = 200_000

# Upper 0.001 quantiles of the chi-square distribution by degrees of freedom (standard table).
CHI2_CRITICAL_0_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}

PAIRS = {
    "opposite": ([0.5, 0.3, 0.2], [0.2, 0.3, 0.5]),
    "target_has_zero": ([0.1, 0.0, 0.6, 0.3], [0.25, 0.25, 0.25, 0.25]),
    "six_tokens": ([0.05, 0.15, 0.3, 0.2, 0.25, 0.05], [0.4, 0.05, 0.05, 0.1, 0.1, 0.3]),
    "equal": ([0.2, 0.2, 0.6], [0.2, 0.2, 0.6]),
}


def chi_square(tokens: np.ndarray, p) -> tuple[float, int]:
    """Pearson statistic of the observed token counts against p, and its degrees of freedom."""
    p = np.asarray(p)
    observed = np.bincount(tokens, minlength=p.size)
    expected = p * tokens.size
    support = expected > 0
    assert observed[~support].sum() == 0, "a token with p = 0 was emitted"
    stat = float((((observed - expected) ** 2)[support] / expected[support]).sum())
    return stat, int(support.sum()) - 1


@pytest.mark.parametrize("name", PAIRS)
def test_distribution_preserving_output_follows_target(name):
    p, q = PAIRS[name]
    tokens = speculative_round(p, q, np.random.default_rng(1234), "distribution_preserving", size=DRAWS)
    stat, dof = chi_square(tokens, p)
    assert stat < CHI2_CRITICAL_0_001[dof], f"{name}: chi2={stat:.1f} with {dof} dof"


@pytest.mark.parametrize("name", ["opposite", "target_has_zero", "six_tokens"])
def test_greedy_output_does_not_follow_target(name):
    p, q = PAIRS[name]
    tokens = speculative_round(p, q, np.random.default_rng(1234), "greedy", size=DRAWS)
    stat, dof = chi_square(tokens, p)
    assert stat > 100 * CHI2_CRITICAL_0_001[dof]
    assert np.all(tokens == np.argmax(p))


def test_drafts_alone_do_not_follow_target():
    # the chi-square check has power: unverified drafts follow q, and q != p is detected
    p, q = PAIRS["six_tokens"]
    drafts = np.random.default_rng(5).choice(len(q), size=DRAWS, p=q)
    stat, dof = chi_square(drafts, p)
    assert stat > 100 * CHI2_CRITICAL_0_001[dof]


def test_acceptance_probability_and_residual():
    p, q = PAIRS["opposite"]
    np.testing.assert_allclose(acceptance_probability(p, q, [0, 1, 2]), [1.0, 1.0, 0.4])
    np.testing.assert_allclose(residual_distribution(p, q), [1.0, 0.0, 0.0])
    p, q = PAIRS["six_tokens"]
    expected = np.array([0.0, 0.10, 0.25, 0.10, 0.15, 0.0]) / 0.6
    np.testing.assert_allclose(residual_distribution(p, q), expected)


def test_acceptance_rate_is_one_minus_total_variation():
    p, q = np.array(PAIRS["six_tokens"][0]), np.array(PAIRS["six_tokens"][1])
    rng = np.random.default_rng(7)
    drafts = rng.choice(q.size, size=DRAWS, p=q)
    accepted = rng.random(DRAWS) < acceptance_probability(p, q, drafts)
    assert accepted.mean() == pytest.approx(np.minimum(p, q).sum(), abs=0.005)


def test_rejected_token_comes_from_residual():
    # p = [0.5, 0.3, 0.2], q = [0.2, 0.3, 0.5]: a draft of token 2 is either kept or replaced by token 0
    p, q = PAIRS["opposite"]
    emitted = distribution_preserving_round(p, q, np.full(10_000, 2), np.random.default_rng(3))
    assert set(np.unique(emitted)) == {0, 2}
    assert (emitted == 2).mean() == pytest.approx(0.4, abs=0.02)


def test_single_round_returns_int_and_is_reproducible():
    p, q = PAIRS["six_tokens"]
    first = [speculative_round(p, q, np.random.default_rng(42)) for _ in range(3)]
    assert all(isinstance(token, int) for token in first)
    assert len(set(first)) == 1, "same seed, same token"
    run_a = speculative_round(p, q, np.random.default_rng(9), size=1000)
    run_b = speculative_round(p, q, np.random.default_rng(9), size=1000)
    run_c = speculative_round(p, q, np.random.default_rng(10), size=1000)
    assert np.array_equal(run_a, run_b)
    assert not np.array_equal(run_a, run_c)


def test_greedy_round_contract():
    p, q = PAIRS["opposite"]
    assert greedy_round(p, q, 0) == 0
    assert greedy_round(p, q, 2) == 0
    assert CONTRACTS == {"distribution_preserving": distribution_preserving_round, "greedy": greedy_round}


def test_unknown_contract_lists_known_names():
    with pytest.raises(ValueError, match="distribution_preserving, greedy"):
        speculative_round([1.0], [1.0], np.random.default_rng(0), "typical")


def test_bad_distributions_rejected():
    with pytest.raises(ValueError, match="sum to 1"):
        acceptance_probability([0.5, 0.4], [0.5, 0.5], 0)
    with pytest.raises(ValueError, match="same vocabulary"):
        acceptance_probability([0.5, 0.5], [0.2, 0.3, 0.5], 0)
    with pytest.raises(ValueError, match="q\\(x\\) = 0"):
        acceptance_probability([0.5, 0.5], [1.0, 0.0], 1)


# --- planner ---------------------------------------------------------------------------------------------

ILLUSTRATION = dict(k=4, t_draft=0.05, t_verify=1.4, t_handle=0.1)


@pytest.mark.parametrize(
    "alpha, tokens, ratio", [(0.2, 1.2496, 0.7351), (0.6, 2.3056, 1.3562), (0.9, 4.0951, 2.4089)]
)
def test_edge_inference_illustration(alpha, tokens, ratio):
    assert round(expected_emitted_tokens(alpha, 4), 4) == tokens
    assert round(speed_ratio(alpha, **ILLUSTRATION), 4) == ratio


def test_illustration_round_cost_and_t1_scaling():
    assert round_cost(4, 0.05, 1.4, 0.1) == pytest.approx(1.7)
    # the same times in milliseconds with T1 = 20 ms give the same ratio
    assert speed_ratio(0.6, 4, 1.0, 28.0, 2.0, t1=20.0) == pytest.approx(speed_ratio(0.6, **ILLUSTRATION))


def test_alpha_one_limit():
    assert expected_emitted_tokens(1.0, 4) == 5.0
    assert expected_emitted_tokens(1.0 - 1e-9, 4) == pytest.approx(5.0, rel=1e-6)
    assert expected_emitted_tokens(0.0, 7) == 1.0


def test_expected_tokens_matches_sum():
    for alpha in (0.1, 0.5, 0.95):
        for k in (1, 3, 8):
            assert expected_emitted_tokens(alpha, k) == pytest.approx(sum(alpha**i for i in range(k + 1)))


def test_planner_rejects_bad_values():
    with pytest.raises(ValueError, match="alpha"):
        expected_emitted_tokens(1.2, 4)
    with pytest.raises(ValueError, match="k must"):
        expected_emitted_tokens(0.5, 0)
    with pytest.raises(ValueError, match="times"):
        round_cost(4, -0.1, 1.4, 0.1)


def _cli():
    return build_parser()


def test_plan_spec_cli_prints_illustration(capsys):
    args = _cli().parse_args(
        "plan spec --alpha 0.2 --alpha 0.6 --alpha 0.9 --k 4 --td 0.05 --tv 1.4 --th 0.1".split()
    )
    assert args.func(args) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert rows == [
        ["0.2", "1.2496", "1.7000", "0.7351"],
        ["0.6", "2.3056", "1.7000", "1.3562"],
        ["0.9", "4.0951", "1.7000", "2.4089"],
    ]


def test_plan_spec_sits_beside_plan_memory():
    parser = _cli()
    assert parser.parse_args("plan memory".split()).func is plan_cli.plan_memory_command
    args = parser.parse_args("plan spec --alpha 1 --k 3 --td 0 --tv 2 --th 0".split())
    assert args.func is plan_cli.plan_spec_command
    assert plan_spec(args.alpha, args.k, args.td, args.tv, args.th, args.t1)[0].speed_ratio == pytest.approx(2.0)


@pytest.mark.parametrize(
    "bad, flag",
    [
        ("--alpha 1.5", "--alpha"),
        ("--alpha -0.1", "--alpha"),
        ("--alpha x", "--alpha"),
        ("--k 0", "--k"),
        ("--td -0.05", "--td"),
        ("--th -1", "--th"),
        ("--tv 0", "--tv"),
        ("--t1 -1", "--t1"),
    ],
)
def test_plan_spec_cli_bad_input_names_the_flag(bad, flag, capsys):
    good = {"--alpha": "0.5", "--k": "4", "--td": "0.05", "--tv": "1.4", "--th": "0.1"}
    bad_flag, bad_value = bad.split()
    good[bad_flag] = bad_value
    argv = ["plan", "spec"] + [item for pair in good.items() for item in pair]
    with pytest.raises(SystemExit) as exit_info:
        _cli().parse_args(argv)
    assert exit_info.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err
