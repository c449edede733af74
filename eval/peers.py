"""`sgl-tts bench peers`: the run (one problem at a time, systems interleaved, resumable) and its report.

The run: one Session of the run config (`--enable-metrics` on its runtimes, one search at a time) whose generator
and PRM runtimes every system uses (`sgl_tts.bench.peers`). For each n, for each problem, every system once, in
an order rotated by one per problem (so no system always runs first, or always after the same one); before each,
the runtimes' radix caches are flushed, so no system inherits another's prefill of the problem. Each measurement
is appended to `peers.jsonl` in the output folder (`eval.results.ResultStore`: a provenance header per start,
fsync'ed lines); a run started again skips the (system, n, problem) lines it holds and measures the rest.

The report, from the lines alone (`peers_summary`, `report_markdown`, `plot_frontiers`): per algorithm × system
× n, the accuracy with its 95% Wilson interval, McNemar's exact p (and the paired-bootstrap difference) against
the system's sgl-tts counterpart (particle filtering's: DVTS), else the algorithm's sgl-tts reference system, at
the same n on the same problems (`eval.budget`), the wall time per problem (median [min-max], and the mean the
frontier uses), tokens and requests per problem by runtime, the request pattern, and the time ratio at matched
accuracy: the least mean time any sgl-tts system of the algorithm needs for at least this accuracy, over this
system's time (`measure.frontier.cost_to_reach`; < 1: sgl-tts is faster there), with its bootstrap interval over
the problems (`measure.frontier.reach_ratio_interval`). Two plots: accuracy against mean wall time and against
processed tokens per problem, one curve per system over its n values, each system's Pareto frontier points filled
(`measure.frontier.pareto_front`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml

from eval.budget import Outcome, accuracy, compare_paired
from eval.results import ResultStore, provenance
from sgl_tts.bench.peers import ALGORITHMS, SYSTEMS, PeerRuntimes, check_settings, measure_problem, systems_named
from sgl_tts.config import ConfigError, load_dataclass
from sgl_tts.measure.frontier import (cheapest_reaching, cost_to_reach, most_accurate_within, pareto_front,
                                      reach_ratio_interval)
from sgl_tts.measure.stats import paired_ratio_of_means
from sgl_tts.measure.summary import median_range
from sgl_tts.measure.tables import Column, console_table, markdown_table
from sgl_tts.paths import write_atomic
from sgl_tts.search.stopping import Stopping

RESULTS = "peers.jsonl"
LEAD_TIME_RATIO = 0.5  # a lead: the peer's accuracy in at most half its time,
LEAD_P = 0.05  # or a higher accuracy in no more time, McNemar's exact p below this
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
WARM_UP_QUESTION = "What is 2 + 3?"


@dataclasses.dataclass(frozen=True)
class PeersOptions:
    """What `sgl-tts bench peers` runs; None takes the run config's value."""

    config: str = "cpu-default"  # run config (YAML path or packaged name): models, PRM, search settings, dataset
    systems: str | None = None  # comma-separated system names (default: all of the algorithms)
    algorithms: str | None = None  # comma-separated, of ALGORITHMS (default: all)
    ns: str = "1,2,4,8,16"
    peer_ns: str | None = None  # the n of its-hub's and optillm's systems (default: ns)
    problems: int = 80
    offset: int = 0
    max_steps: int | None = None
    max_step_tokens: int | None = None
    max_tokens: int | None = None
    step_delimiter: str | None = None  # escapes allowed
    seed: int = 0
    stopping: str | None = None  # sgl-tts's `search.stopping` as a YAML mapping, e.g. "{rule: settled, agree: 2}"
    out: str = "bench-peers"
    log_dir: str | None = None
    report_only: bool = False  # report the results in `out`, run nothing


def run_config(options: PeersOptions) -> Any:
    from sgl_tts.app.session import load_run_config
    from sgl_tts.bench.fasttts import with_metrics

    config = with_metrics(load_run_config(options.config))
    overrides = {name: getattr(options, name) for name in ("max_steps", "max_step_tokens", "max_tokens")
                 if getattr(options, name) is not None}
    if options.step_delimiter is not None:
        overrides["step_delimiter"] = options.step_delimiter.encode().decode("unicode_escape")
    # none beneath sgl-tts's programs unless asked for, whatever the run config sets: the peers run as they ship
    overrides["stopping"] = stopping_option(options.stopping) if options.stopping is not None else Stopping()
    search = dataclasses.replace(config.search, seed=options.seed, **overrides)
    check_settings(search)
    return dataclasses.replace(config, search=search, concurrency=1, log_dir=options.log_dir)


def stopping_option(text: str) -> Any:
    """`--stopping`: the stopping rules beneath sgl-tts's programs (the peers have none of their own), a YAML
    mapping of `search.stopping`'s keys; a bad one is a ConfigError naming the key."""
    try:
        mapping = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"--stopping: expected a YAML mapping such as '{{rule: settled, agree: 2}}' "
                          f"({exc})") from None
    return load_dataclass(Stopping, mapping, source="--stopping", prefix="search.stopping.")


def rotated(items: list[Any], by: int) -> list[Any]:
    by %= len(items)
    return items[by:] + items[:by]


def n_values(text: str, flag: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]; anything but comma-separated whole numbers of at least 1 is refused, naming `flag`."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"{flag}: expected comma-separated whole numbers of at least 1, e.g. 1,2,4; got {text!r}")
    return values


def run_order(systems: list[Any], problems: list[Any], ns: list[int], peer_ns: list[int] | None = None
              ) -> list[tuple[int, Any, Any]]:
    """(n, problem, system) in run order: problem by problem, every arm (a system at an n: sgl-tts's at `ns`, the
    peers' at `peer_ns`, default `ns`) rotated by one per problem, so that every arm runs beside every other in
    time, whatever its n, and each runs first in turn."""
    arms = [(n, system) for n in sorted(set(ns) | set(peer_ns or ())) for system in systems
            if n in (ns if peer_ns is None or system.family == "sgl-tts" else peer_ns)]
    return [(n, problem, system) for index, problem in enumerate(problems) for n, system in rotated(arms, index)]


def run_peers(options: PeersOptions) -> int:
    out = Path(options.out)
    store = ResultStore(out / RESULTS)
    if options.report_only:
        return report(store.records(), out)
    from sgl_tts.app.session import Session
    from sgl_tts.bench.fasttts import flush_caches
    from sgl_tts.problems import Problem, load_problems
    from sgl_tts.runtime.hardware import cpu_summary

    config = run_config(options)
    systems = systems_named(options.systems, options.algorithms)
    ns = n_values(options.ns, "--ns")
    peer_ns = n_values(options.peer_ns, "--peer-ns") if options.peer_ns else None
    problems = list(load_problems(config.dataset.name, limit=options.problems, offset=options.offset))
    done = {(r["system"], r["n"], r["problem_id"]) for r in store.records() if not r.get("failed")}
    todo = [(n, p, s) for n, p, s in run_order(systems, problems, ns, peer_ns) if (s.name, n, str(p.id)) not in done]
    search = config.search
    store.append_run(provenance({"options": dataclasses.asdict(options), "search": dataclasses.asdict(search),
                                 "generator": config.generator.model, "scorer": config.scorer.kind,
                                 "cpu": cpu_summary(), "load_average": os.getloadavg()}))
    print(f"bench peers: {len(systems)} systems x n in {ns}{f' (peers: {peer_ns})' if peer_ns else ''} x "
          f"{len(problems)} problems; {len(todo)} measurements to "
          f"go ({len(done)} in {store.path}); temperature {search.temperature}, top_p {search.top_p}, max_tokens "
          f"{search.max_tokens}, steps <= {search.max_steps} x {search.max_step_tokens}, delimiter "
          f"{search.step_delimiter!r}, aggregation {search.aggregation}; {cpu_summary()}", flush=True)
    began = time.monotonic()
    if todo:
        with Session(config) as session:
            runtimes = PeerRuntimes.of_session(session)
            warm_up = Problem(id="warm-up", question=WARM_UP_QUESTION, gold="5")
            for system in {s.algorithm: s for s in systems}.values():  # one system per algorithm loads its code
                measure_problem(system, warm_up, dataclasses.replace(search, n=2), runtimes)
            for n, problem, system in todo:
                flush_caches(session.runtimes)
                try:
                    row = measure_problem(system, problem, dataclasses.replace(search, n=n), runtimes)
                except Exception as exc:  # one system failing one problem: recorded, the run goes on
                    row = {"system": system.name, "algorithm": system.algorithm, "n": n,
                           "problem_id": str(problem.id), "failed": True, "error": f"{type(exc).__name__}: {exc}"}
                store.append({**row, "load_average": os.getloadavg()[0]})
                print(f"[n={n} {problem.id}] {system.name}: " + (
                    f"FAILED {row['error']}" if row.get("failed") else
                    f"{'right' if row['correct'] else 'wrong'} ({row['answer']!r}), {row['wall_s']:.1f} s, generated "
                    f"{row['generator']['generated_tokens']:.0f} tok, requests gen "
                    f"{row['client_requests']['generator']} / PRM {row['client_requests']['prm']}"), flush=True)
    print(f"bench peers: {time.monotonic() - began:.0f} s; load average now {os.getloadavg()[0]:.2f}")
    return report(store.records(), out)


# ---- report ---------------------------------------------------------------------------------------------------


def latest_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The last successful line per (system, n, problem)."""
    latest: dict[tuple[str, int, str], dict[str, Any]] = {}
    for record in records:
        if not record.get("failed") and record.get("correct") is not None:
            latest[(record["system"], record["n"], record["problem_id"])] = record
    return list(latest.values())


def pooled_rows(runs: list[list[dict[str, Any]]], ns: set[int]) -> list[dict[str, Any]]:
    """The latest rows of several runs (e.g. one per seed) at the n in `ns`, each problem named by its run
    ("r0/<id>", "r1/<id>", ...), so the report pairs the systems by (run, problem); a system at an n that some run
    did not measure is left out, so every pooled cell spans the same runs."""
    rows = [[row for row in latest_rows(records) if row["n"] in ns] for records in runs]
    in_every_run = set.intersection(*({(row["system"], row["n"]) for row in run} for run in rows)) if rows else set()
    return [{**row, "problem_id": f"r{index}/{row['problem_id']}"} for index, run in enumerate(rows) for row in run
            if (row["system"], row["n"]) in in_every_run]


def processed_tokens(row: dict[str, Any]) -> float:
    """What the runtimes computed for a row: generated tokens plus prompt tokens not served from the radix cache,
    of the generator and of the PRM."""
    generator, prm = row["generator"], row.get("prm") or {}
    return (generator["generated_tokens"] + generator["prompt_tokens"] - generator["cached_tokens"]
            + prm.get("prompt_tokens", 0.0) - prm.get("cached_tokens", 0.0))


def _mean(rows: list[dict[str, Any]], get: Any) -> float:
    return statistics.fmean(get(r) for r in rows)


def cell_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One (system, n) cell: accuracy (eval.budget.accuracy over its problems), time and per-problem means."""
    outcomes = {(0, 0, r["problem_id"]): Outcome(bool(r["correct"]), int(r["generator"]["generated_tokens"]),
                                                r.get("level")) for r in rows}
    prm = lambda key: lambda r: (r.get("prm") or {}).get(key, 0.0)  # noqa: E731
    return {
        **accuracy(outcomes.values()), "outcomes": outcomes,
        "per_problem": {r["problem_id"]: (r["wall_s"], bool(r["correct"])) for r in rows},
        "wall_s": [r["wall_s"] for r in rows], "mean_wall_s": _mean(rows, lambda r: r["wall_s"]),
        "processed_tokens": _mean(rows, processed_tokens),
        "generator": {key: _mean(rows, lambda r: r["generator"][key]) for key in rows[0]["generator"]},
        "prm": {key: _mean(rows, prm(key)) for key in ("prompt_tokens", "cached_tokens", "requests")},
        "client_requests": {key: _mean(rows, lambda r: r["client_requests"][key]) for key in ("generator", "prm")},
    }


def time_ratio_interval(ours: list[dict[str, Any]], cell: dict[str, Any]) -> dict[str, Any] | None:
    """The time ratio at matched accuracy with its 95% bootstrap interval over the problems that `cell` and every
    sgl-tts cell of its algorithm ran (`measure.frontier.reach_ratio_interval`), or None when there are none."""
    problems = sorted(set(cell["per_problem"]).intersection(*(c["per_problem"] for c in ours))) if ours else []
    if not problems:
        return None

    def columns(c: dict[str, Any]) -> tuple[list[float], list[bool]]:
        return [c["per_problem"][p][0] for p in problems], [c["per_problem"][p][1] for p in problems]

    low, high, reached = reach_ratio_interval([columns(c) for c in ours], columns(cell), BOOTSTRAP_RESAMPLES,
                                              BOOTSTRAP_SEED)
    return {"low": low, "high": high, "reached": reached, "problems": len(problems)}


def paired_time_ratio(peer: dict[str, Any], ours: dict[str, Any]) -> dict[str, Any] | None:
    """`ours`'s mean wall time over `peer`'s on the problems both ran, with its paired 95% bootstrap interval
    (`measure.stats.paired_ratio_of_means`); None when they share none."""
    problems = sorted(peer["per_problem"].keys() & ours["per_problem"].keys())
    if not problems:
        return None
    ratio, low, high = paired_ratio_of_means([peer["per_problem"][p][0] for p in problems],
                                             [ours["per_problem"][p][0] for p in problems], BOOTSTRAP_RESAMPLES,
                                             BOOTSTRAP_SEED)
    return {"ratio": ratio, "low": low, "high": high, "problems": len(problems)}


def ratio_text(ratio: float | None, interval: dict[str, Any] | None) -> str:
    """'0.85x [0.71-1.02]'; an end where sgl-tts did not reach the accuracy reads 'unreached'."""
    if ratio is None and interval is None:
        return "-"
    text = "unreached" if ratio is None else f"{ratio:.2f}x"
    if interval is not None:
        ends = ["unreached" if math.isinf(v) else f"{v:.2f}" for v in (interval["low"], interval["high"])]
        text += f" [{ends[0]}-{ends[1]}]"
    return text


def peers_summary(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (algorithm, system, n) measured, in ALGORITHMS, SYSTEMS and n order: `cell_summary`, the
    paired comparison with the algorithm's reference system at that n, and the time ratio at matched accuracy."""
    grouped: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for row in latest_rows(records):
        grouped[(row["system"], row["n"])].append(row)
    known = {s.name: s for s in SYSTEMS}
    names = [s.name for s in SYSTEMS] + sorted({name for name, _ in grouped} - set(known))
    cells = []
    for name in names:
        for n in sorted(n for system, n in grouped if system == name):
            rows = grouped[(name, n)]
            cells.append({"system": name, "n": n, "algorithm": rows[0]["algorithm"], "family": rows[0].get("family"),
                          "pattern": rows[0].get("pattern"), **cell_summary(rows)})
    references = {s.algorithm: s.name for s in SYSTEMS if s.reference}
    counterparts = {s.name: s.counterpart for s in SYSTEMS if s.counterpart}
    by_key = {(c["system"], c["n"]): c for c in cells}
    for cell in cells:
        reference = (by_key.get((counterparts.get(cell["system"]), cell["n"]))
                     or by_key.get((references.get(cell["algorithm"]), cell["n"])))
        if reference is not None and reference is not cell:
            cell["vs_reference"] = {"system": reference["system"],
                                    **compare_paired(reference["outcomes"], cell["outcomes"])}
        ours = [c for c in cells if c["family"] == "sgl-tts" and c["algorithm"] == cell["algorithm"]]
        reach = cost_to_reach([(c["mean_wall_s"], c["accuracy"]) for c in ours], cell["accuracy"])
        cell["sgl_tts_time_ratio"] = reach / cell["mean_wall_s"] if reach is not None and cell["mean_wall_s"] else None
        cell["sgl_tts_time_ratio_interval"] = time_ratio_interval(ours, cell)
    order = {a: i for i, a in enumerate(ALGORITHMS)}
    return sorted(cells, key=lambda c: order.get(c["algorithm"], len(order)))


def against_every_point(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every peer cell against sgl-tts's cells of any algorithm (a user weighs a library by the best it offers at a
    budget, not one algorithm at a time): whether the cell is on its library's Pareto frontier (mean wall time and
    accuracy over all of the library's algorithms and n), sgl-tts's least mean time to its accuracy over its time
    (with the bootstrap interval over the problems) and the sgl-tts cell that takes it, and sgl-tts's most
    accurate cell within its mean time (`measure.frontier.most_accurate_within`), paired with it, accuracy and time
    (`within_time`: its mean time over the peer's, on the problems both ran, with the bootstrap interval). `lead`: the
    ratio at most LEAD_TIME_RATIO (`lead_by` "time"), or that cell the more accurate at McNemar p < LEAD_P
    ("accuracy")."""
    ours = [c for c in cells if c["family"] == "sgl-tts"]
    points = [(c["mean_wall_s"], c["accuracy"]) for c in ours]
    rows = []
    for family in dict.fromkeys(c["family"] for c in cells if c["family"] != "sgl-tts"):
        theirs = [c for c in cells if c["family"] == family]
        front = set(pareto_front([(c["mean_wall_s"], c["accuracy"]) for c in theirs]))
        for index, cell in enumerate(theirs):
            reaching_index = cheapest_reaching(points, cell["accuracy"])
            reaching = ours[reaching_index] if reaching_index is not None else None
            ratio = reaching["mean_wall_s"] / cell["mean_wall_s"] if reaching and cell["mean_wall_s"] else None
            within_index = most_accurate_within(points, cell["mean_wall_s"])
            within = ours[within_index] if within_index is not None else None
            versus = compare_paired(cell["outcomes"], within["outcomes"]) if within is not None else None
            within_time = paired_time_ratio(cell, within) if within is not None else None
            ahead = bool(versus and versus["pairs"] and versus["difference"] > 0 and versus["p_value"] < LEAD_P)
            faster = ratio is not None and ratio <= LEAD_TIME_RATIO
            rows.append({"cell": cell, "on_front": index in front, "ratio": ratio, "reaching": reaching,
                         "interval": time_ratio_interval(ours, cell), "within": within, "versus": versus,
                         "within_time": within_time,
                         "lead": faster or ahead,
                         "lead_by": [branch for branch, held in (("time", faster), ("accuracy", ahead)) if held]})
    return rows


def cell_name(cell: dict[str, Any] | None) -> str:
    return "-" if cell is None else f"{cell['system']} n={cell['n']} ({cell['solved']}/{cell['trials']})"


EVERY_POINT_COLUMNS = ("peer system", "n", "accuracy", "mean s", "on its frontier",
                       "sgl-tts's least time to ≥ acc [95% CI]", "taken by", "sgl-tts's most accurate in ≤ time",
                       "its time / the peer's [95% CI]", "Δ pt [95% CI], p", "lead")


def every_point_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    table = []
    for row in rows:
        cell, versus, within_time = row["cell"], row["versus"], row["within_time"]
        compared = "-" if not versus or not versus["pairs"] else (
            f"{100 * versus['difference']:+.1f} [{100 * versus['interval'][0]:+.1f}, "
            f"{100 * versus['interval'][1]:+.1f}], p={versus['p_value']:.3g}")
        table.append([cell["system"], str(cell["n"]), f"{cell['solved']}/{cell['trials']}",
                      f"{cell['mean_wall_s']:.2f}", "yes" if row["on_front"] else "-",
                      ratio_text(row["ratio"], row["interval"]), cell_name(row["reaching"]),
                      cell_name(row["within"]), ratio_text(within_time and within_time["ratio"], within_time), compared,
                      ", ".join(row["lead_by"]) or "-"])
    return table


COLUMNS = ("algorithm", "system", "n", "accuracy [95% CI]", "vs sgl-tts: Δ pt [95% CI], p",
           "wall s/problem median [min-max]", "mean s", "x sgl-tts at ≥ acc [95% CI]", "processed tok",
           "gen generated", "gen prompt/cached", "PRM prompt/cached", "requests gen server/client",
           "requests PRM server/client")


def table_rows(cells: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    references = {s.name for s in SYSTEMS if s.reference}
    for c in cells:
        low, high = c["interval"]
        versus = c.get("vs_reference")
        if versus is None:
            compared = "reference" if c["system"] in references else "-"
        elif not versus["pairs"]:
            compared = "no shared problems"
        else:
            d_low, d_high = versus["interval"]
            compared = (f"{100 * versus['difference']:+.1f} [{100 * d_low:+.1f}, {100 * d_high:+.1f}], "
                        f"p={versus['p_value']:.3g}")
            if versus["system"] not in references:
                compared = f"vs {versus['system']}: {compared}"
        g, p, r = c["generator"], c["prm"], c["client_requests"]
        rows.append([c["algorithm"], c["system"], str(c["n"]),
                     f"{100 * c['accuracy']:.1f}% [{100 * low:.1f}, {100 * high:.1f}] ({c['solved']}/{c['trials']})",
                     compared, median_range(c["wall_s"], ".2f"), f"{c['mean_wall_s']:.2f}",
                     ratio_text(c["sgl_tts_time_ratio"], c.get("sgl_tts_time_ratio_interval")),
                     f"{c['processed_tokens']:.0f}",
                     f"{g['generated_tokens']:.0f}", f"{g['prompt_tokens']:.0f}/{g['cached_tokens']:.0f}",
                     f"{p['prompt_tokens']:.0f}/{p['cached_tokens']:.0f}", f"{g['requests']:.1f}/{r['generator']:.1f}",
                     f"{p['requests']:.1f}/{r['prm']:.1f}"])
    return rows


def patterns(cells: list[dict[str, Any]]) -> list[str]:
    seen = dict.fromkeys((c["system"], c["pattern"]) for c in cells)
    return [f"- {system}: {pattern}" for system, pattern in seen]


def report_markdown(cells: list[dict[str, Any]], header: dict[str, Any] | None) -> str:
    machine = (f"Machine: {header['config'].get('cpu')}; load average at the start "
               f"{', '.join(f'{v:.2f}' for v in header['config'].get('load_average', []))}.") if header else ""
    return "\n".join([
        "Per problem, at the client: wall time (PRM included); tokens and requests from SGLang's /metrics deltas "
        "(server) and the clients' own counts (client). Accuracy with its 95% Wilson interval; Δ and McNemar's "
        "exact p against the system's sgl-tts counterpart where it ran ('vs ...'), else the algorithm's sgl-tts "
        "reference, at the same n, paired on the problems. 'x sgl-tts at ≥ "
        "acc': the least mean time of a sgl-tts system of the algorithm reaching at least this accuracy, over this "
        "one's, with its 95% bootstrap interval over the problems all of them ran ('unreached': beyond that end "
        "no sgl-tts system reached this accuracy). " + machine, "", markdown_table(COLUMNS, table_rows(cells)), "",
        "Request patterns:", *patterns(cells), *every_point_section(cells)])


def every_point_section(cells: list[dict[str, Any]]) -> list[str]:
    """The markdown of `against_every_point`, [] where the lines hold no peer cell or no sgl-tts cell."""
    rows = against_every_point(cells)
    if not rows or not any(c["family"] == "sgl-tts" for c in cells):
        return []
    return ["", "Every peer point against every sgl-tts point, whatever the algorithm: on its frontier, the peer's "
            "point is on its library's Pareto frontier (mean time, accuracy) over all its algorithms and n; "
            "sgl-tts's least mean time to at least its accuracy, over its time, with the 95% bootstrap interval, "
            "and the sgl-tts point that takes it; the most accurate sgl-tts point in at most its mean time, paired "
            f"with it (Δ for sgl-tts, McNemar's exact p). Lead: the peer's accuracy in at most {LEAD_TIME_RATIO}x "
            f"its time ('time'), or a higher accuracy in no more time at p < {LEAD_P} ('accuracy').", "",
            markdown_table(EVERY_POINT_COLUMNS, every_point_rows(rows))]


def accuracy_axes(ax: Any, cost_label: str) -> None:
    """Accuracy (%) against a cost on a log axis whose ticks read as plain numbers, with a grid."""
    from matplotlib.ticker import FuncFormatter

    ax.set_xscale("log")
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_formatter(plain)
    ax.tick_params(axis="x", which="both", labelsize=7)
    ax.set_xlabel(cost_label, fontsize=8)
    ax.set_ylabel("accuracy (%)")
    ax.grid(alpha=0.3, which="both")


COST_AXES = (("mean_wall_s", "wall time per problem, s (client, mean)", "time"),
             ("processed_tokens", "processed tokens per problem (generated + uncached prompt, generator + PRM)",
              "tokens"))  # (cell key, axis label, file name suffix) of the frontier plots' two costs


def plot_frontiers(cells: list[dict[str, Any]], out: Path) -> list[Path]:
    """Accuracy vs mean wall time and vs processed tokens per problem: one panel per algorithm, one curve per
    system over n (log x), Wilson error bars, the points on the system's Pareto frontier filled. [] without
    matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return []
    written = []
    algorithms = [a for a in ALGORITHMS if any(c["algorithm"] == a for c in cells)]
    for key, label, suffix in COST_AXES:
        fig = Figure(figsize=(5.2 * max(1, len(algorithms)), 4.2))
        for column, algorithm in enumerate(algorithms):
            ax = fig.add_subplot(1, len(algorithms), column + 1)
            ours = [c for c in cells if c["algorithm"] == algorithm]
            for index, system in enumerate(dict.fromkeys(c["system"] for c in ours)):
                series = sorted((c for c in ours if c["system"] == system), key=lambda c: c["n"])
                x = [max(c[key], 1e-9) for c in series]
                y = [100 * c["accuracy"] for c in series]
                errors = [[100 * (c["accuracy"] - c["interval"][0]) for c in series],
                          [100 * (c["interval"][1] - c["accuracy"]) for c in series]]
                style = "-" if series[0]["family"] == "sgl-tts" else "--"
                ax.errorbar(x, y, yerr=errors, linestyle=style, marker="o", markerfacecolor="none", capsize=2,
                            color=f"C{index}", label=system)
                front = pareto_front(list(zip(x, y)))
                ax.plot([x[i] for i in front], [y[i] for i in front], linestyle="none", marker="o", color=f"C{index}")
                for c, xi, yi in zip(series, x, y):
                    ax.annotate(f"n={c['n']}", (xi, yi), textcoords="offset points", xytext=(3, 3), fontsize=6)
            accuracy_axes(ax, label)
            low, high = min(c[key] for c in ours), max(c[key] for c in ours)
            if low > 0 and high / low < 2:  # a narrow range: widened to a factor 2, so the ticks stay few and plain
                middle = (low * high) ** 0.5
                ax.set_xlim(middle / 2 ** 0.5, middle * 2 ** 0.5)
            ax.set_title(algorithm, fontsize=9)
            ax.legend(fontsize=6)
        fig.tight_layout()
        path = out / f"peers-{suffix}.png"
        fig.savefig(path, dpi=110)
        written.append(path)
    return written


def plot_libraries(cells: list[dict[str, Any]], out: Path) -> list[Path]:
    """Accuracy vs mean wall time and vs processed tokens per problem, one colour per library: every point of it
    (system and n), its Pareto frontier over all its algorithms drawn as a line. [] without matplotlib or with one
    library only."""
    families = list(dict.fromkeys(c["family"] for c in cells))
    if len(families) < 2:
        return []
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return []
    written = []
    for key, label, suffix in COST_AXES:
        fig = Figure(figsize=(8.0, 5.2))
        ax = fig.add_subplot(1, 1, 1)
        for index, family in enumerate(sorted(families, key=lambda f: f != "sgl-tts")):
            theirs = [c for c in cells if c["family"] == family]
            x = [max(c[key], 1e-9) for c in theirs]
            y = [100 * c["accuracy"] for c in theirs]
            ax.plot(x, y, linestyle="none", marker="o", markerfacecolor="none", color=f"C{index}", alpha=0.6)
            for c, xi, yi in zip(theirs, x, y):
                short = c["system"].removeprefix(family).strip()
                ax.annotate(f"{short} {c['n']}", (xi, yi), textcoords="offset points", xytext=(3, 2), fontsize=5,
                            color=f"C{index}")
            front = pareto_front(list(zip(x, y)))
            ax.step([x[i] for i in front], [y[i] for i in front], where="post", marker="o", color=f"C{index}",
                    linestyle="-" if family == "sgl-tts" else "--", label=f"{family}: frontier over its algorithms")
        accuracy_axes(ax, label)
        ax.set_title("each library's Pareto frontier over all its algorithms and n", fontsize=9)
        ax.legend(fontsize=7, loc="best")
        fig.tight_layout()
        path = out / f"peers-libraries-{suffix}.png"
        fig.savefig(path, dpi=120)
        written.append(path)
    return written


def report(records: list[dict[str, Any]], out: Path, headers: list[dict[str, Any]] | None = None) -> int:
    cells = peers_summary(records)
    if not cells:
        print(f"bench peers: no measured line in {out / RESULTS}")
        return 1
    headers = ResultStore(out / RESULTS).runs() if headers is None else headers
    failed = sum(1 for r in records if r.get("failed"))
    print(console_table([Column(title, align="<" if i < 2 else ">") for i, title in enumerate(COLUMNS)],
                        table_rows(cells), rule=True))
    print("\n".join(["request patterns:", *patterns(cells)]) + (f"\n{failed} failed line(s), not counted"
                                                                if failed else ""))
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "peers.md", report_markdown(cells, headers[-1] if headers else None) + "\n")
    plots = plot_frontiers(cells, out) + plot_libraries(cells, out)
    print(f"wrote {out / 'peers.md'}" + "".join(f", {p}" for p in plots))
    return 0
