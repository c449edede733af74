"""The shared table formatter and "median [min-max]" cells, and every printed table built on them, checked
character for character on fixed inputs."""

import dataclasses
from types import SimpleNamespace

from sgl_tts.app.compare import ArmSummary, format_comparison
from sgl_tts.app.run_report import print_run
from sgl_tts.bench.fasttts import format_table as fasttts_table
from sgl_tts.bench.runtime import format_table as runtime_table
from sgl_tts.bench.serve import format_table as serve_table
from sgl_tts.bench.verifier_scoring import format_table as verifier_table
from sgl_tts.measure.rsd_sweep import format_sweep_table
from sgl_tts.measure.summary import median_min_max, median_range
from sgl_tts.measure.tables import Column, console_table, format_row, markdown_table
from sgl_tts.rsd.sweep import SweepRow
from sgl_tts.search.records import Candidate, SearchResult


def test_console_table_pads_fits_and_overflows():
    columns = [Column("name", align="<"), Column("n", 3), Column("note", 4, gap=2)]
    assert console_table(columns, [["ab", "1", "x"], ["abcdef", "22", "longer"]], rule=True).splitlines() == [
        "name     n  note",
        "----------------",
        "ab       1     x",
        "abcdef  22  longer",
    ], "the first column fits its widest cell; a cell wider than a fixed width overflows"
    assert format_row([Column("a", 2), Column("b", 2, "<")], ["1", "2"]) == " 1 2 "


def test_the_run_report_shows_the_graded_value_of_an_answer(capsys):
    result = SearchResult(problem_id="p1", program="best_of_n", answer="7 + 2 = 9", candidates=[], total_time_s=1.0)
    assert print_run([(SimpleNamespace(id="p1", gold="9"), result)], None) == 0
    assert capsys.readouterr().out.splitlines()[2].split()[:4] == ["p1", "9", "9", "yes"]


def test_markdown_table():
    assert markdown_table(["a", "b"], [["1", "2"]]) == "| a | b |\n|---|---|\n| 1 | 2 |"


def test_median_range():
    assert median_min_max([3.0, 1.0, 2.0, 10.0]) == (2.5, 1.0, 10.0)
    assert median_range([50.0, 70.0, 60.0]) == "60.0 [50.0-70.0]"
    assert median_range([0.5, 1.0, 1.2], ".2f", suffix="x") == "1.00x [0.50-1.20]"
    assert median_range([2.0, 4.0], "7.3f", "5.2f") == "  3.000 [ 2.00- 4.00]"
    assert median_range([1, 3], ".0f", brackets="()") == "2 (1-3)"
    assert median_range([]) == "-"


def test_bench_tables():
    tables = {}
    def cell(goodput, latency, speculation=None):
        return {"goodput": goodput, "p50_latency_s": latency, "verifier_share": 0.25, "verifier_cache_hit": 0.5,
                "planned_verifier_hit": 0.6, "kv_generator_tokens": 900, "kv_verifier_tokens": 450,
                "evicted_tokens": 12.0, "retracted": 1.0, "speculation": speculation or {}, "tail_idle_share": 0.3,
                "tail_filled_by_s": 0.2}

    spec = {"polls": 40, "idle_slot_polls": 30, "launched": 9, "tokens_used": 50, "tokens_discarded": 20}
    cells = {("beam_search", 8, 0.5, "baseline"): [cell(2.0, 10.0), cell(2.5, 12.0), cell(1.5, 11.0)],
             ("beam_search", 8, 0.5, "all"): [cell(5.0, 4.0, spec), cell(6.0, 3.0, spec), cell(4.0, 5.0, spec)],
             ("dvts", 16, 0.5, "all"): [cell(123.456, 1234.5, spec)]}
    tables["fasttts"] = fasttts_table(cells, ["beam_search", "dvts"], [8, 16], [0.5], ["baseline", "V", "all"])

    def run(requests, tokens, p50, p99, errors=0):
        return {"requests_per_s": requests, "tokens_per_s": tokens, "p50_s": p50, "p99_s": p99, "errors": errors}

    runs = {(1, "sequential"): [run(1.0, 10.0, 1.0, 2.0), run(3.0, 30.0, 1.5, 2.5)],
            (1, "concurrent"): [run(4.0, 40.5, 0.5, 1.0, 1)], (2, "concurrent"): [run(600.0, 1234567.0, 0.25, 0.75)]}
    tables["serve"] = serve_table(runs)

    def call(read, cached, steps, ms):
        return {"input_tokens": read, "cached_tokens": cached, "computed_tokens": read - cached, "scored_steps": steps,
                "time_ms": ms}

    calls = {"full": [[call(10, 0, 3, 5.0), call(20, 5, 8, 7.0)], [call(12, 0, 3, 6.0)]],
             "incremental": [[call(10, 0, 2, 4.0), call(8, 5, 3, 3.0), call(9, 6, 3, 2.0)]]}
    tables["verifier"] = verifier_table(calls)
    assert tables["fasttts"] == (
        "program                n frac arm            goodput tok/s  x base        p50 latency s  x base ver share ver hit plan/meas KV gen/ver tok  evicted retract tail idle share/S fill S idle/polls launched S tok used/discarded\n"
        "beam_search            8  0.5 baseline   2.000 [ 1.50- 2.50]  1.00x     11.0 [ 10.0- 12.0]  1.00x       0.25         0.60/0.50        900/450       12       1                 0.30/-                     -                    -\n"
        "beam_search            8  0.5 all       5.000 [ 4.00- 6.00]  2.50x*     4.0 [  3.0-  5.0]  0.36x*      0.25         0.60/0.50        900/450       12       1              0.30/0.20               30/40 9                50/20\n"
        "dvts                  16  0.5 all     123.456 [123.46-123.46]   nanx   1234.5 [1234.5-1234.5]   nanx       0.25         0.60/0.50        900/450       12       1              0.30/0.20               30/40 9                50/20"
    )
    assert tables["serve"] == (
        "replicas arm                    requests/s                 tokens/s                p50 s                p99 s errors  ratio\n"
        "       1 sequential    2.000 (1.000-3.000)         20.0 (10.0-30.0)     1.25 (1.00-1.50)     2.25 (2.00-2.50)      0  1.00x\n"
        "       1 concurrent    4.000 (4.000-4.000)         40.5 (40.5-40.5)     0.50 (0.50-0.50)     1.00 (1.00-1.00)      1  2.00x\n"
        "       2 concurrent 600.000 (600.000-600.000) 1234567.0 (1234567.0-1234567.0)     0.25 (0.25-0.25)     0.75 (0.75-0.75)      0 300.00x"
    )
    assert tables["verifier"] == (
        "iter  measure                          full            incremental  incr/full\n"
        "   1  input_tokens               11 (10-12)             10 (10-10)      0.91x\n"
        "   1  cached_tokens                 0 (0-0)                0 (0-0)       nanx\n"
        "   1  computed_tokens             11 (10-12)             10 (10-10)      0.91x\n"
        "   1  scored_steps                  3 (3-3)                2 (2-2)      0.67x\n"
        "   1  time_ms                       6 (5-6)                4 (4-4)      0.73x\n"
        "   2  input_tokens               20 (20-20)                8 (8-8)      0.40x\n"
        "   2  cached_tokens                 5 (5-5)                5 (5-5)      1.00x\n"
        "   2  computed_tokens             15 (15-15)                3 (3-3)      0.20x\n"
        "   2  scored_steps                  8 (8-8)                3 (3-3)      0.38x\n"
        "   2  time_ms                       7 (7-7)                3 (3-3)      0.43x\n"
        "   3  input_tokens                        -                9 (9-9)       nanx\n"
        "   3  cached_tokens                       -                6 (6-6)       nanx\n"
        "   3  computed_tokens                      -                3 (3-3)       nanx\n"
        "   3  scored_steps                        -                3 (3-3)       nanx\n"
        "   3  time_ms                             -                2 (2-2)       nanx\n"
        " all  input_tokens               21 (12-30)             27 (27-27)      1.29x\n"
        " all  cached_tokens                 2 (0-5)             11 (11-11)      4.40x\n"
        " all  computed_tokens             18 (12-25)             16 (16-16)      0.86x\n"
        " all  scored_steps                 7 (3-11)                8 (8-8)      1.14x\n"
        " all  time_ms                      9 (6-12)                9 (9-9)      1.00x"
    )
    samples = {("sg", 16): [50.0, 70.0, 60.0], ("hf", 16): [100.0, 70.0, 50.0]}
    assert runtime_table(samples, "hf") == (
        "parallel        arm   tok/s median [min-max]    vs hf: median [min-max]\n"
        "      16         sg         60.0 [50.0-70.0]          1.00x [0.50-1.20]\n"
        "      16         hf        70.0 [50.0-100.0]                          -"
    )


def test_sweep_comparison_and_run_tables(capsys):
    tables = {}
    tok = {"draft": 100, "target": 20, "prm": 50}
    srows = [SweepRow(0.0, 3, 1 / 3, 1.0, 0.0, 1.5e9, tok, 2.25, 44.4, 3.0, 0,
                      {"1": {"accuracy": 0.5, "draft_only_fraction": 1.0}, "2": {"accuracy": 0.0, "draft_only_fraction": 1.0}}),
             SweepRow(0.5, 3, 2 / 3, 0.5, 0.5, None, tok, 3.5, None, 1.0, 4,
                      {"1": {"accuracy": 1.0, "draft_only_fraction": 0.5}})]
    tables["rsd"] = format_sweep_table(srows)
    tables["rsd_plain"] = format_sweep_table([dataclasses.replace(r, by_level={}) for r in srows])
    greedy = ArmSummary("greedy", (True,) * 2 + (False,) * 18, 50.0, 1.0, 1.0, generated_tokens=1000)
    search = ArmSummary("a longer search label", (True,) * 12 + (False,) * 8, 300.0, 12.345, 2.0,
                        samples="3/4 samples", generated_tokens=6000)
    none = ArmSummary("none", (False,) * 20, 10.0, 1.0, 1.0, generated_tokens=200)
    tables["compare_ref"] = format_comparison([greedy, search, none], reference=greedy)
    tables["compare"] = format_comparison([greedy, none])

    def result(problem_id, answer, tokens, seconds, error=None):
        candidate = Candidate(steps=["a"], step_scores=[0.5], score=0.5, answer=answer, tokens=tokens,
                              completion_time_s=seconds, finish_reason="answer")
        return SearchResult(problem_id=problem_id, program="beam_search", answer=answer, candidates=[candidate],
                            generated_tokens=tokens, prompt_tokens=100, cached_tokens=40, total_time_s=seconds,
                            generator_time_s=seconds * 0.75, verifier_time_s=seconds * 0.25, error=error)

    long_id = "a-very-long-problem-id"
    pairs = [(SimpleNamespace(id="p1", gold="4"), result("p1", "4", 30, 3.0)),
             (SimpleNamespace(id=long_id, gold="123456789012"), result(long_id, "12\n3", 1234567, 12345.6, "boom")),
             (SimpleNamespace(id="p3", gold=None), result("p3", None, 0, 0.5))]
    assert tables["rsd"] == (
        "| delta | accuracy | draft only | target rate | FLOPs/problem | draft tok | target tok | prm tok | latency s | tok/s | elapsed s |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
        "| 0.00 | 33% | 100% | 0% | 1.5 G | 100 | 20 | 50 | 2.2 | 44.4 | 3 |\n"
        "| 0.50 | 67% | 50% | 50% | n/a | 100 | 20 | 50 | 3.5 | n/a | 1 |\n"
        "\n"
        "By level (accuracy / solved by draft alone):\n"
        "\n"
        "| delta | level 1 | level 2 |\n"
        "|---|---|---|\n"
        "| 0.00 | 50% / 100% | 0% / 100% |\n"
        "| 0.50 | 100% / 50% | - |"
    )
    assert tables["rsd_plain"] == (
        "| delta | accuracy | draft only | target rate | FLOPs/problem | draft tok | target tok | prm tok | latency s | tok/s | elapsed s |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
        "| 0.00 | 33% | 100% | 0% | 1.5 G | 100 | 20 | 50 | 2.2 | 44.4 | 3 |\n"
        "| 0.50 | 67% | 50% | 50% | n/a | 100 | 20 | 50 | 3.5 | n/a | 1 |"
    )
    assert tables["compare_ref"] == (
        "arm                                  solved  95% interval  tokens/problem  tokens/solved  goodput tok/s  p50 latency s  p vs greedy\n"
        "-----------------------------------------------------------------------------------------------------------------------------------\n"
        "greedy                                 2/20     0.03-0.30              50            500           1.00            1.0            -\n"
        "a longer search label (3/4 samples)   12/20     0.39-0.78             300            500          12.35            2.0        0.002\n"
        "none                                   0/20     0.00-0.16              10              -           1.00            1.0        0.500"
    )
    assert tables["compare"] == (
        "arm     solved  95% interval  tokens/problem  tokens/solved  goodput tok/s  p50 latency s\n"
        "-----------------------------------------------------------------------------------------\n"
        "greedy    2/20     0.03-0.30              50            500           1.00            1.0\n"
        "none      0/20     0.00-0.16              10              -           1.00            1.0"
    )
    assert print_run(pairs, None) == 1, "a failed search"
    assert print_run([], None) == 0
    assert capsys.readouterr().out == (
        "problem            gold       answer  ok  tokens  time s  goodput  cached  end\n"
        "------------------------------------------------------------------------------\n"
        "p1                    4            4 yes      30     3.0    10.00     40%\n"
        "a-very-long-p… 1234567…         12 3  no 1234567 12345.6   100.00     40%  error: boom\n"
        "p3                    -            -  no       0     0.5        -     40%\n"  # no tokens, no goodput (nor in the mean)
        "------------------------------------------------------------------------------\n"
        "solved 1/3 (33%) | generated tokens 1234597 | precise goodput mean 55.00 tok/s | latency p50 3.0 s | generator 9262 s, verifier 3087 s | prefix cache hit 40%\n"
        "problem            gold       answer  ok  tokens  time s  goodput  cached  end\n"
        "------------------------------------------------------------------------------\n"
        "no problems\n"
    )
