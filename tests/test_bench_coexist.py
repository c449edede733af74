"""`sgl-tts bench coexist`: pass-through arms, config overrides, failed arms kept, the report's rows from records
and a synthetic loop trace; one end-to-end run on the tiny model (runtime tier)."""

import argparse
import json
import threading
from types import SimpleNamespace

import pytest

from sgl_tts.bench.coexist import (BenchOptions, CoexistArm, arm_config, arm_rows, cancel_rows, chosen_arms,
                                   loop_figures, machine_cells, run_arm, run_searches, with_overrides)
from sgl_tts.cli.bench import parse_coexist_arm
from sgl_tts.config import ConfigError
from sgl_tts.measure.periodic import Period

QUIET = {"load": [0.5, 0.4, 0.3], "cpuinfo_mhz": [2600.0, 2600.0], "cpufreq_mhz": [], "temperatures_c": {}}


def tiny_config():
    from sgl_tts.app.session import load_run_config

    return load_run_config("serve-tiny")


def test_pass_through_arms_parse_keys_and_yaml_values():
    arm = parse_coexist_arm("budget=search.n=2,fasttts.speculative=true,concurrency=3,search.step_delimiter=' , '")
    assert arm == CoexistArm("budget", concurrency=3,
                             overrides=(("search.n", 2), ("fasttts.speculative", True),
                                        ("search.step_delimiter", " , ")))
    for bad in ("budget", "=search.n=2", "x=", "x=search.n", "x=concurrency=0", "x=search n=2"):
        with pytest.raises(argparse.ArgumentTypeError, match="--arm"):
            parse_coexist_arm(bad)


def test_overrides_are_checked_like_the_config_file():
    config = with_overrides(tiny_config(), [("search.n", 2), ("fasttts.prefix_order", True), ("concurrency", 3)],
                            "--arm a")
    assert (config.search.n, config.fasttts.prefix_order, config.concurrency) == (2, True, 3)
    with pytest.raises(ConfigError, match=r"--arm a: unknown key 'search.no_such_key'"):
        with_overrides(tiny_config(), [("search.no_such_key", 1)], "--arm a")
    with pytest.raises(ConfigError, match=r"'search.n.x': 'search.n' is not a section"):
        with_overrides(tiny_config(), [("search.n.x", 1)], "--arm a")
    with pytest.raises(ConfigError, match="n must be at least 1"):
        with_overrides(tiny_config(), [("search.n", 0)], "--arm a")
    deepconf = with_overrides(tiny_config(), [("search.program", "deepconf"), ("search.settings.keep_fraction", 0.5)],
                              "--arm d")
    assert deepconf.search.settings.keep_fraction == 0.5  # the program's own Settings, validated


def test_arm_config_varies_one_mechanism():
    base = tiny_config()
    for arm, switches in ((CoexistArm("S", switches="S"), "S"), (CoexistArm("x4", concurrency=4), "baseline")):
        config = arm_config(base, arm)
        assert config.fasttts.label == switches and config.concurrency == arm.concurrency
        assert config.search == base.search


def test_chosen_arms_names_and_duplicates():
    names = [a.name for a in chosen_arms(BenchOptions(several=3))]
    assert names == ["idle", "search x1", "search x3", "P", "M", "S"]
    assert [a.name for a in chosen_arms(BenchOptions(arms="idle,xC", arm=(CoexistArm("b"),)))] == \
        ["idle", "search x4", "b"]
    with pytest.raises(ValueError, match="unknown arm 'Q'"):
        chosen_arms(BenchOptions(arms="Q"))
    with pytest.raises(ValueError, match="already in the bench"):
        chosen_arms(BenchOptions(arm=(CoexistArm("idle"),)))


class FailingPool:
    kept = {}

    def switch(self, config):
        raise RuntimeError("generator failed to start: out of memory")


def test_a_failing_arm_keeps_its_error_and_the_bench_goes_on():
    record = run_arm(CoexistArm("broken"), tiny_config(), [object()], 1, 0.0, FailingPool(), loop_pid=0)
    assert record == {"arm": "broken", "error": "RuntimeError: generator failed to start: out of memory"}
    bad = run_arm(CoexistArm("bad", overrides=(("search.n", 0),)), tiny_config(), [object()], 1, 0.0,
                  FailingPool(), loop_pid=0)
    assert bad["error"].startswith("ConfigError: --arm bad:")


class ClockedSession:
    """A session whose every search takes one second of a shared fake clock; the third problem's search fails."""

    def __init__(self):
        self.now, self.lock, self.solved = 0.0, threading.Lock(), []

    def clock(self):
        with self.lock:
            return self.now

    def solve(self, problem, search):
        from sgl_tts.search.api import SearchError

        with self.lock:
            self.now += 1.0
            self.solved.append(problem)
        result = SimpleNamespace(error="generator died" if problem == "p2" else None, generated_tokens=10)
        if result.error:
            raise SearchError(result.error, result)
        return result


def test_an_arms_searches_keep_its_concurrency_for_its_rounds_then_until_its_length():
    config = SimpleNamespace(concurrency=2, search=None)
    problems = ["p0", "p1", "p2"]
    session = ClockedSession()
    counts = run_searches(session, config, problems, rounds=3, arm_s=0.0, clock=session.clock)
    assert counts == {"searches": 6, "search_errors": 2, "tokens": 60}  # 2 workers x 3 rounds, p2 twice
    assert sorted(session.solved) == sorted(problems * 2)  # taken in turn, cycled
    session = ClockedSession()
    counts = run_searches(session, config, problems, rounds=1, arm_s=7.0, clock=session.clock)
    # a worker starts a search while less than 7 s have passed: at least 7 in all, and the other worker may start
    # one more
    assert 7 <= counts["searches"] <= 7 + config.concurrency - 1
    assert counts["searches"] == len(session.solved) and session.now >= 7.0


def trace(missed_indices, count=100, period=0.02):
    """Periods released every 20 ms from t = 0; those in `missed_indices` complete 5 ms late."""
    rows = []
    for k in range(count):
        release = k * period
        late = 0.025 if k in missed_indices else 0.004
        rows.append(Period(k, release, release + period, release + 0.001, release + late))
    return rows


def test_loop_figures_cut_the_trace_at_the_window_and_find_the_recovery():
    loop = trace({12, 13, 14, 30})
    figures = loop_figures({"began": 0.19, "ended": 0.79}, loop)  # periods 10 to 39
    assert (figures["periods"], figures["missed"], figures["skipped"]) == (30, 4, 0)
    assert figures["jitter_p50_s"] == pytest.approx(0.001)
    assert figures["worst_late_s"] == pytest.approx(0.005)
    cancel = loop_figures({"began": 0.19, "ended": 0.79, "cancel_at": 0.25}, loop)
    # from 0.25 on: periods 13, 14 missed, 15-24 the first ten met in a row
    assert cancel["recovery_s"] == pytest.approx(0.30 - 0.25)
    assert (cancel["missed_before_cancel"], cancel["missed_after_cancel"]) == (1, 3)
    assert loop_figures({"arm": "x", "error": "e"}, loop) == {}


def test_arm_rows_medians_failures_and_machine_state():
    loop = trace(set(range(50, 60)))
    records = [
        {"arm": "idle", "began": 0.0, "ended": 0.39, "wall_s": 0.4, "loop_cpu_percent": 30.0,
         "machine_cpu_percent": 40.0, "loop_rss_mib": 60.0, "machine_memory_used_gib": 3.0, "machine": QUIET,
         "runtimes_alive": 0},
        {"arm": "search x1", "began": 0.99, "ended": 1.39, "wall_s": 0.4, "loop_cpu_percent": 31.0,
         "machine_cpu_percent": 190.0, "loop_rss_mib": 61.0, "machine_memory_used_gib": 6.0, "searches": 1,
         "search_errors": 0, "tokens": 40, "machine": {**QUIET, "temperatures_c": {"a": 61.0, "b": 70.0}}},
        {"arm": "search x1", "began": 0.39, "ended": 0.79, "wall_s": 0.4, "loop_cpu_percent": 33.0,
         "machine_cpu_percent": 180.0, "loop_rss_mib": 62.0, "machine_memory_used_gib": 6.2, "searches": 1,
         "search_errors": 1, "tokens": 80, "machine": {**QUIET, "load": [1.5, 1, 1],
                                                       "temperatures_c": {"a": 66.0}}},
        {"arm": "search x1", "error": "RuntimeError: the verifier died"},
        {"arm": "P", "error": "RuntimeError: boom"},
    ]
    rows = {row[0]: row for row in arm_rows(records, loop, ["idle", "search x1", "P", "never ran"])}
    idle = rows["idle"]
    assert idle[1:5] == ["1/1", "20", "0", "0"]
    x1 = rows["search x1"]
    # windows [1.0, 1.4) holds periods 50-69 (10 missed), [0.4, 0.8) periods 20-39 (none)
    assert x1[1:5] == ["2/3", "20 [20-20]", "5 [0-10]", "0 [0-0]"]
    assert x1[8:14] == ["32 [31-33]", "185 [180-190]", "62 [61-62]", "6.1 [6.0-6.2]", "2 (1)", "150.0 [100.0-200.0]"]
    assert x1[14:17] == ["1.00 [0.50-1.50]", "2600 [2600-2600]", "68 [66-70]"]
    assert x1[17] == "1 failed: RuntimeError: the verifier died"
    assert idle[16] == "not exposed" and idle[13] == "-"
    assert rows["P"][1] == "0/1" and rows["P"][2] == "-" and rows["P"][17] == "1 failed: RuntimeError: boom"
    assert rows["never ran"][1] == "0/0"


def test_machine_cells_without_frequency_or_temperature():
    assert machine_cells([{"machine": {**QUIET, "cpuinfo_mhz": []}}]) == ["0.50", "not exposed", "not exposed"]
    assert machine_cells([]) == ["-", "not exposed", "not exposed"]


def test_cancel_rows_show_recovery_and_freed_kv():
    loop = trace({12, 13, 14})
    record = {"arm": "cancel x2", "repeat": 1, "began": 0.19, "ended": 0.79, "cancel_at": 0.25,
              "in_flight_at_cancel": 5, "abort_s": 0.12, "searches_ended_s": 0.3, "stopped": 2, "returned": 0,
              "kv_before": {"generator": 900, "scorer": None}, "kv_after": {"generator": 100, "scorer": None},
              "kv_settle_s": 0.6, "machine": QUIET}
    (row,) = cancel_rows([record], loop)
    assert row[:11] == ["cancel x2", "1", "5", "0.12", "0.30", "2/0", "0.05", "1/2", "900->100 (800)",
                        "not readable", "0.6"]
    (failed,) = cancel_rows([{"arm": "cancel x2", "repeat": 2, "error": "RuntimeError: x"}], loop)
    assert failed[2] == "-" and failed[6] == "-" and failed[-1] == "RuntimeError: x"
    never = dict(record, ended=0.4, cancel_at=0.25)  # the window ends before ten deadlines are met
    assert cancel_rows([never], loop)[0][6] == "not within the run"


@pytest.mark.runtime
def test_bench_coexist_end_to_end_on_the_tiny_model(tmp_path):
    """idle, one search, two at once and a cancel beside the loop: every arm measured, the cancel's KV read from
    the engine's counters and nothing left in use once the aborted searches' KV has settled."""
    from sgl_tts.bench.coexist import run_bench

    out = tmp_path / "out"
    options = BenchOptions(config="serve-tiny", program="beam_search", n=2, beam_width=2, max_steps=2,
                           max_step_tokens=8, several=2, idle_s=0.5, repeats=1, arms="idle,x1,xC",
                           arm_s=0.0, cancel_after_s=0.0, watch_s=0.5, live_sessions=1, out=str(out))
    assert run_bench(options) == 0
    data = json.loads((out / "bench-coexist.json").read_text())
    assert [r["arm"] for r in data["records"]] == ["idle", "search x1", "search x2"]
    assert all("error" not in r for r in data["records"]), data["records"]
    figures = {f["arm"]: f for f in data["figures"]}
    assert all(f["periods"] > 0 for f in figures.values())
    assert figures["search x2"]["searches"] == 2 and figures["search x2"]["search_errors"] == 0
    (cancel,) = data["cancels"]
    assert "error" not in cancel, cancel
    assert set(cancel["kv_before"]) == {"generator"} and isinstance(cancel["kv_after"]["generator"], int)
    assert cancel["stopped"] + cancel["returned"] == 2
    assert "recovery_s" in figures["cancel x2"]
    assert "| arm |" in (out / "bench-coexist.md").read_text()
