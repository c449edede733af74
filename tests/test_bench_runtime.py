"""`sgl-tts bench runtime` without runtimes: arm parsing, the interleaved schedule, medians and ratios."""

import argparse
import statistics

import pytest

from sgl_tts.bench.runtime import RuntimeArm, interleaved, summary_rows
from sgl_tts.measure.summary import median_range
from sgl_tts.cli.bench import parse_arm


def test_arms_parse_like_a_shell_line():
    assert parse_arm("default=") == RuntimeArm("default", ())
    assert parse_arm("steps4=--num-continuous-decode-steps 4") == RuntimeArm("steps4",
                                                                          ("--num-continuous-decode-steps", "4"))
    arm = parse_arm("t1=OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE --max-running-requests '32'")
    assert arm.env == (("OMP_NUM_THREADS", "1"), ("OMP_WAIT_POLICY", "PASSIVE"))
    assert arm.server_args == ("--max-running-requests", "32")
    assert arm.describe() == "OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE --max-running-requests 32"
    for bad in ("no-equals", "=--flag", "hf=--flag", "a b=--flag"):
        with pytest.raises(argparse.ArgumentTypeError, match="NAME=ARGS"):
            parse_arm(bad)


def test_interleaved_runs_every_arm_once_per_round_and_rotates_the_order():
    calls = []

    def measure(arm):
        return lambda p: calls.append((arm, p)) or float(len(calls))

    samples = interleaved({"a": measure("a"), "b": measure("b"), "hf": measure("hf")}, [16, 64], repeats=3)
    assert len(calls) == 3 * 2 * 3 and all(len(v) == 3 for v in samples.values())
    rounds = [calls[i:i + 6] for i in range(0, 18, 6)]
    assert [r[0][0] for r in rounds] == ["a", "b", "hf"], "each round starts with the next arm"
    for r in rounds:
        assert sorted(r) == sorted((arm, p) for arm in ("a", "b", "hf") for p in (16, 64))
    # Samples keep round order: values are the call's position, so they increase.
    assert all(v == sorted(v) for v in samples.values())


def test_summary_reports_medians_ranges_and_per_round_ratios():
    samples = {("sg", 16): [50.0, 70.0, 60.0], ("hf", 16): [100.0, 70.0, 50.0]}
    rows = {(p, arm): (rate, ratio) for p, arm, rate, ratio in summary_rows(samples, "hf")}
    assert rows[16, "sg"][0] == "60.0 [50.0-70.0]" == median_range([50.0, 70.0, 60.0])
    # Per-round ratios 0.5, 1.0, 1.2: median 1.0 (the ratio of medians would be 60/70 = 0.86).
    assert rows[16, "sg"][1] == "1.00x [0.50-1.20]"
    assert statistics.median([0.5, 1.0, 1.2]) == 1.0
    assert rows[16, "hf"][1] == "-"
