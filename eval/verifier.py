"""`sgl-tts eval verifier`: how well configured scorers find the first wrong step of step-labelled solutions.

Each `--config` is a run config (its `scorer` section, and its `generator` for the prompt and, when the scorer
has no runtime of its own, for scoring). For each, the scorer's runtime is started as a run would start it,
and every solution (ProcessBench format, `sgl_tts.scoring.step_labels`) is scored as the search would show
it: the generator's chat prompt for the problem, then the steps. Results go to `results.jsonl` in the run
folder (append-only; a rerun with `--out` on the same folder skips what is done) and `summary.md`:
ProcessBench F1 with the threshold chosen on one fold and applied to the other (cross-fitted, folds by
problem), both accuracies, step AUROC, scoring time and tokens, one row per config.
"""

from __future__ import annotations

import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from eval.results import ResultStore, provenance
from sgl_tts.app.session import RunConfig, load_run_config
from sgl_tts.config import ConfigError, to_dict
from sgl_tts.paths import write_atomic
from sgl_tts.scoring.step_labels import LabelledSolution, fold_of, load_labelled, select_part
from sgl_tts.scoring.verifier_metrics import cross_fitted_f1, step_auroc

FOLD_SALT = "verifier-eval"


def arm_name(config_path: str) -> str:
    return Path(config_path).stem


def start_scorer(config: RunConfig, log_dir: Path) -> tuple[Any, Any, list[Any]]:
    """(scorer, prompt function, started runtimes): only the runtime the scorer reads is started."""
    from transformers import AutoTokenizer

    from sgl_tts.frontend.backend import chat_prompt
    from sgl_tts.runtime.models import resolve_model
    from sgl_tts.runtime.server import Runtime
    from sgl_tts.scoring.factory import make_scorer
    from sgl_tts.scoring.probe import generator_with_probe

    runtime_config = config.scorer.runtime or generator_with_probe(config.generator, config.scorer)
    runtime = Runtime.start(runtime_config, name="scorer", log_dir=log_dir)
    try:
        generator_tokenizer = AutoTokenizer.from_pretrained(resolve_model(config.generator.model))
        scorer = make_scorer(config.scorer, runtime, AutoTokenizer.from_pretrained(runtime.model_path))
    except BaseException:
        runtime.stop()
        raise
    return scorer, (lambda question: chat_prompt(generator_tokenizer, question)), [runtime]


def score_solutions(arm: str, scorer: Any, prompt_of: Any, solutions: Sequence[LabelledSolution],
                    store: ResultStore, concurrency: int, log=print) -> float:
    """Score and append one record per solution; returns the wall time."""
    began = time.monotonic()

    def one(solution: LabelledSolution) -> None:
        start = time.monotonic()
        scores = scorer.score(prompt_of(solution.problem), [solution.search_steps()])[0]
        store.append({"problem_id": f"{arm}/{solution.id}", "arm": arm, "id": solution.id, "label": solution.label,
                      "scores": scores, "seconds": time.monotonic() - start})

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for done, _ in enumerate(pool.map(one, solutions), start=1):
            if done % 50 == 0:
                log(f"{arm}: {done}/{len(solutions)} solutions scored, {time.monotonic() - began:.0f} s")
    return time.monotonic() - began


def summarise(records: list[dict[str, Any]], solutions: Sequence[LabelledSolution], folds: int) -> dict[str, Any]:
    """The figures of one arm from its result records (only solutions in `solutions` count)."""
    by_id = {s.id: s for s in solutions}
    records = [r for r in records if r["id"] in by_id]
    scores = [r["scores"] for r in records]
    labels = [by_id[r["id"]].label for r in records]
    f1, thresholds = cross_fitted_f1(scores, labels, [fold_of(by_id[r["id"]], folds, FOLD_SALT) for r in records])
    return {
        "solutions": len(records), "f1": 100 * f1.f1, "accuracy_erroneous": 100 * f1.accuracy_erroneous,
        "accuracy_correct": 100 * f1.accuracy_correct, "auroc": step_auroc(scores, labels),
        "thresholds": [thresholds[k] for k in sorted(thresholds)],
        "seconds_per_solution": statistics.median(r["seconds"] for r in records),
    }


def render_summary(rows: dict[str, dict[str, Any]], header: str) -> str:
    lines = [f"# Verifier evaluation\n\n{header}\n",
             "| config | solutions | F1 | acc. erroneous | acc. correct | step AUROC | thresholds | "
             "s/solution (median) | tokens | wall s | tokens/s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for arm, row in rows.items():
        wall = row["wall_s"]
        lines.append(f"| {arm} | {row['solutions']} | {row['f1']:.1f} | {row['accuracy_erroneous']:.1f} | "
                     f"{row['accuracy_correct']:.1f} | {row['auroc']:.3f} | "
                     f"{', '.join(f'{t:.3g}' for t in row['thresholds'])} | {row['seconds_per_solution']:.2f} | "
                     f"{row['tokens']} | {wall:.0f} | {row['tokens'] / wall if wall else float('nan'):.0f} |")
    lines.append("\nF1: threshold chosen on one fold (by problem), applied to the other; a solution's predicted "
                 "first error is its first step scored below it. Step AUROC: first wrong steps against the "
                 "correct steps (before the first wrong one, and all steps of correct solutions). Tokens: prompt "
                 "tokens sent to the scorer's runtime (cached ones included); wall time summed over the sessions "
                 "that scored the arm.")
    return "\n".join(lines) + "\n"


def evaluate_verifiers(configs: Sequence[str], data: str | None = None, part: str = "heldout",
                       limit: int | None = None, folds: int = 2, concurrency: int = 8,
                       out: str | Path | None = None) -> int:
    """Score the step-labelled solutions of `data` (default: the shared processbench-math set; `part` of the fixed
    split, a seeded sample of `limit`) with each run config's scorer, `concurrency` at a time; append the records
    to `out` (default: a new folder under results/), write and print the summary (`folds` for the threshold)."""
    if folds < 2:
        raise ConfigError(f"--folds must be at least 2, got {folds}")
    arms = {arm_name(path): load_run_config(path) for path in configs}
    if len(arms) != len(configs):
        raise ConfigError("two --config files have the same file name; each arm is named by its file's stem")
    solutions = select_part(load_labelled(data), part)
    if limit is not None:  # a seeded sample: the file may be sorted (e.g. erroneous solutions first)
        solutions = [solutions[i] for i in sorted(random.Random(0).sample(range(len(solutions)),
                                                                           min(limit, len(solutions))))]
    out = Path(out or Path("results") / ("verifier-" + datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")))
    store = ResultStore(out / "results.jsonl")
    options = {"data": data, "part": part, "limit": limit, "folds": folds}
    for run in store.runs():
        if "config" in run and run["config"].get("options") != options:
            raise ConfigError(f"{out} holds a verifier run with other options {run.get('config', {}).get('options')}; "
                              "use another --out")
    store.append_run(provenance({"options": options, "arms": {a: to_dict(c) for a, c in arms.items()}}))
    done = store.done_ids()
    for arm, config in arms.items():
        todo = [s for s in solutions if f"{arm}/{s.id}" not in done]
        print(f"{arm}: scorer {config.scorer.kind}, {len(todo)} of {len(solutions)} solutions to score", flush=True)
        if not todo:
            continue
        scorer, prompt_of, runtimes = start_scorer(config, out / "logs")
        try:
            wall = score_solutions(arm, scorer, prompt_of, todo, store, concurrency)
            store.append_run({"arm": arm, "scored": len(todo), "wall_s": wall, "tokens": scorer.tokens_processed})
        finally:
            for runtime in runtimes:
                runtime.stop()
    records = store.records()
    sessions = [run for run in store.runs() if "arm" in run]
    rows = {}
    for arm in arms:
        rows[arm] = summarise([r for r in records if r["arm"] == arm], solutions, folds)
        rows[arm]["wall_s"] = sum(run["wall_s"] for run in sessions if run["arm"] == arm)
        rows[arm]["tokens"] = sum(run["tokens"] for run in sessions if run["arm"] == arm)
    header = f"{len(solutions)} solutions of {data or 'processbench-math'} (part {part}), {folds} folds."
    summary = render_summary(rows, header)
    write_atomic(out / "summary.md", summary)
    print(summary)
    print(f"results: {out / 'results.jsonl'}")
    return 0
