"""`sgl-tts train prm`: train the probe head (`sgl_tts.scoring.probe`) on step-labelled solutions, on CPU.

1. Features: the base model reads each solution as a search would show it to the scorer (the generator's
   chat prompt for the problem, then the steps, `step_spans`); per labelled step and per candidate layer L,
   the final-RMSNorm'd hidden state after L layers at the step's last token and its mean over the step's
   tokens. One file per solution in the cache folder, so an interrupted extraction resumes.
2. Labels: steps before the first wrong one are correct (1), the first wrong step is wrong (0), later
   steps are left out.
3. Model selection on the train part only: logistic regression (standardised features, L2) for every
   layer x pooling x L2 strength, scored by out-of-fold step AUROC over problem-grouped folds. The F1
   threshold is chosen on the chosen configuration's out-of-fold scores.
4. The chosen configuration is refit on the whole train part and reported on the held-out part (the split
   of `sgl_tts.scoring.step_labels.in_heldout`). Everything is float64 full-batch L-BFGS from zeros, so a
   run is deterministic given the features.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from sgl_tts.scoring.probe import DEFAULT_HEAD, POOLINGS, ProbeHead, readout_positions, step_spans
from sgl_tts.scoring.step_labels import LabelledSolution, fold_of, in_heldout, load_labelled
from sgl_tts.scoring.verifier_metrics import auroc, best_threshold, cross_fitted_f1, first_error, processbench_f1

DEFAULT_LAYERS = (6, 9, 12, 15, 18)
FEATURES_VERSION = 1  # bump when the feature layout changes
DEFAULT_L2 = (1e-3, 1e-2, 1e-1)


@dataclass
class StepFeatures:
    """One row per labelled step."""

    solution: np.ndarray  # index into the solution list
    step: np.ndarray  # step index within its solution
    correct: np.ndarray  # 1 before the first wrong step, 0 at it
    pooled: dict[tuple[str, int], np.ndarray]  # (pooling, layer) -> [rows, hidden]


def feature_dir(base_dir: str | Path, layers: Sequence[int], cache: Path) -> Path:
    """Where the per-solution feature files of this base model and these layers live."""
    digest = hashlib.sha256(json.dumps([FEATURES_VERSION, list(layers)]).encode())
    for name in ("config.json", "model.safetensors"):
        file = Path(base_dir) / name
        if file.exists():
            digest.update(f"{name}:{file.stat().st_size}".encode())
    return cache / "probe-features" / digest.hexdigest()[:16]


def _solution_key(solution: LabelledSolution) -> str:
    content = json.dumps([solution.problem, solution.steps, solution.label])
    return hashlib.sha256(content.encode()).hexdigest()[:24]


def extract_features(base_dir: str | Path, solutions: Sequence[LabelledSolution], layers: Sequence[int],
                     out_dir: Path, threads: int = 1, progress: bool = True) -> None:
    """Write one feature file per solution into `out_dir` (those already there are skipped)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sgl_tts.frontend.backend import chat_prompt

    torch.set_num_threads(threads)  # on a shared machine one thread per process avoids OpenMP spin-waits
    todo = [s for s in solutions if not (out_dir / f"{_solution_key(s)}.npz").is_file()]
    if not todo:
        return
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if max(layers) > model.config.num_hidden_layers:
        raise ValueError(f"layer {max(layers)} is beyond the base model's {model.config.num_hidden_layers} layers")
    decoder = model.model
    decoder.layers = decoder.layers[:max(layers)]  # later layers cannot change earlier hidden states
    captured: dict[int, torch.Tensor] = {}

    def capture(layer: int):
        def hook(module, inputs, output):
            captured[layer] = output[0] if isinstance(output, tuple) else output
        return hook

    for layer in layers:
        decoder.layers[layer - 1].register_forward_hook(capture(layer))
    out_dir.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    with torch.inference_mode():
        for done, solution in enumerate(todo, start=1):
            ids, spans = step_spans(tokenizer, chat_prompt(tokenizer, solution.problem), solution.search_steps())
            spans = spans[:solution.labelled_steps]
            decoder(torch.tensor([ids[:spans[-1][1]]]))  # causal: steps after the label cannot matter
            arrays = {"correct": np.array([int(k != solution.label) for k in range(len(spans))])}
            for layer in layers:
                normed = decoder.norm(captured[layer])[0]
                for pooling in POOLINGS:
                    arrays[f"{pooling}_{layer}"] = np.stack(
                        [normed[list(readout_positions(span, pooling))].mean(0).numpy() for span in spans])
            path = out_dir / f"{_solution_key(solution)}.npz"
            np.savez(path.with_suffix(".partial.npz"), **arrays)
            path.with_suffix(".partial.npz").rename(path)
            if progress and done % 20 == 0:
                print(f"features: {done}/{len(todo)} solutions, {time.monotonic() - began:.0f} s", flush=True)


def load_features(solutions: Sequence[LabelledSolution], layers: Sequence[int], out_dir: Path) -> StepFeatures:
    rows: dict[str, list] = {"solution": [], "step": [], "correct": []}
    pooled: dict[tuple[str, int], list] = {(p, layer): [] for p in POOLINGS for layer in layers}
    for index, solution in enumerate(solutions):
        data = np.load(out_dir / f"{_solution_key(solution)}.npz")
        steps = len(data["correct"])
        rows["solution"] += [index] * steps
        rows["step"] += list(range(steps))
        rows["correct"] += data["correct"].tolist()
        for key in pooled:
            pooled[key].append(data[f"{key[0]}_{key[1]}"])
    return StepFeatures(np.array(rows["solution"]), np.array(rows["step"]), np.array(rows["correct"]),
                        {key: np.concatenate(value).astype(np.float64) for key, value in pooled.items()})


def _extract_worker(job: tuple[str, list[LabelledSolution], list[int], str]) -> None:
    base_dir, solutions, layers, out_dir = job
    extract_features(base_dir, solutions, layers, Path(out_dir), threads=1)


def features_for(base_dir: str | Path, solutions: Sequence[LabelledSolution], layers: Sequence[int],
                 cache: Path, workers: int = 1) -> StepFeatures:
    """Features of `solutions`, extracting the missing ones with `workers` processes of one thread each."""
    out_dir = feature_dir(base_dir, layers, cache)
    if workers <= 1:
        extract_features(base_dir, solutions, layers, out_dir)
    else:
        import multiprocessing

        jobs = [(str(base_dir), list(solutions[i::workers]), list(layers), str(out_dir)) for i in range(workers)]
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            pool.map(_extract_worker, jobs)
    return load_features(solutions, layers, out_dir)


def training_order(solutions: Sequence[LabelledSolution], limit: int | None, seed: int) -> list[LabelledSolution]:
    """The first `limit` solutions of a fixed shuffle (all when None): any prefix is a random sample."""
    order = np.random.default_rng(seed).permutation(len(solutions))
    return [solutions[i] for i in order[:limit]]


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float) -> tuple[np.ndarray, float]:
    """Weights and bias on the raw features of an L2-regularised logistic regression fit on standardised ones:
    minimise mean BCE(z v + c, y) + l2/2 |v|^2 with z = (x - mu) / sd; then w = v / sd, b = c - (mu / sd)·v."""
    import torch

    mu, sd = x.mean(0), x.std(0) + 1e-8
    z = torch.tensor((x - mu) / sd, dtype=torch.float64)
    target = torch.tensor(y, dtype=torch.float64)
    v = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    c = torch.zeros((), dtype=torch.float64, requires_grad=True)
    optimiser = torch.optim.LBFGS([v, c], lr=1.0, max_iter=500, tolerance_grad=1e-9, tolerance_change=1e-12,
                                  history_size=20, line_search_fn="strong_wolfe")

    def loss_fn():
        optimiser.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(z @ v + c, target) + 0.5 * l2 * (v @ v)
        loss.backward()
        return loss

    optimiser.step(loss_fn)
    v_np, c_np = v.detach().numpy(), float(c.detach())
    return v_np / sd, c_np - float((mu / sd) @ v_np)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def per_solution(features: StepFeatures, rows: np.ndarray, scores: np.ndarray
                 ) -> tuple[list[list[float]], list[int]]:
    """Step scores regrouped by solution (labelled steps, in order) and each solution's label."""
    grouped: dict[int, list[tuple[int, float, int]]] = {}
    for row, score in zip(rows, scores):
        grouped.setdefault(int(features.solution[row]), []).append(
            (int(features.step[row]), float(score), int(features.correct[row])))
    step_scores, labels = [], []
    for index in sorted(grouped):
        steps = sorted(grouped[index])
        step_scores.append([s for _, s, _ in steps])
        wrong = [k for k, _, correct in steps if not correct]
        labels.append(wrong[0] if wrong else -1)
    return step_scores, labels


def out_of_fold_scores(features: StepFeatures, rows: np.ndarray, fold: np.ndarray, x: np.ndarray, l2: float
                       ) -> np.ndarray:
    scores = np.empty(len(rows))
    for k in np.unique(fold):
        fit, held = rows[fold != k], fold == k
        w, b = fit_logistic(x[fit], features.correct[fit], l2)
        scores[held] = _sigmoid(x[rows[held]] @ w + b)
    return scores


def evaluate(features: StepFeatures, rows: np.ndarray, scores: np.ndarray, threshold: float,
             folds: np.ndarray) -> dict[str, Any]:
    """Figures on `rows`: AUROC, F1 at the given threshold, and F1 cross-fitted within these rows."""
    correct = features.correct[rows].astype(bool)
    step_scores, labels = per_solution(features, rows, scores)
    at_threshold = processbench_f1([first_error(s, threshold) for s in step_scores], labels)
    solution_fold = {int(features.solution[r]): int(f) for r, f in zip(rows, folds)}
    crossed, _ = cross_fitted_f1(step_scores, labels, [solution_fold[i] for i in sorted(solution_fold)])
    return {"auroc": round(auroc(scores[correct], scores[~correct]), 4), "f1": round(100 * at_threshold.f1, 1),
            "accuracy_erroneous": round(100 * at_threshold.accuracy_erroneous, 1),
            "accuracy_correct": round(100 * at_threshold.accuracy_correct, 1),
            "f1_cross_fitted": round(100 * crossed.f1, 1), "solutions": len(labels), "steps": len(rows)}


def train(solutions: Sequence[LabelledSolution], features: StepFeatures, layers: Sequence[int],
          l2s: Sequence[float], folds: int = 5, log=print) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Select and fit the head; returns (the chosen fit with its held-out figures, the selection table)."""
    heldout = np.array([in_heldout(solutions[i]) for i in features.solution])
    train_rows, held_rows = np.flatnonzero(~heldout), np.flatnonzero(heldout)
    fold = np.array([fold_of(solutions[features.solution[r]], folds, salt="train-cv") for r in train_rows])
    correct = features.correct[train_rows].astype(bool)
    table = []
    for pooling in POOLINGS:
        for layer in layers:
            for l2 in l2s:
                scores = out_of_fold_scores(features, train_rows, fold, features.pooled[(pooling, layer)], l2)
                entry = {"pooling": pooling, "layer": layer, "l2": l2,
                         "cv_auroc": round(auroc(scores[correct], scores[~correct]), 4)}
                table.append(entry)
                log(json.dumps(entry))
    chosen = max(table, key=lambda e: (e["cv_auroc"], e["l2"]))  # ties: the stronger regularisation
    x = features.pooled[(chosen["pooling"], chosen["layer"])]
    oof = out_of_fold_scores(features, train_rows, fold, x, chosen["l2"])
    threshold = best_threshold(*per_solution(features, train_rows, oof))
    w, b = fit_logistic(x[train_rows], features.correct[train_rows], chosen["l2"])
    held_scores = _sigmoid(x[held_rows] @ w + b)
    held_fold = np.array([fold_of(solutions[features.solution[r]], 2, salt="heldout") for r in held_rows])
    result = {
        **chosen, "threshold": round(threshold, 4), "weight": w, "bias": b,
        "heldout": evaluate(features, held_rows, held_scores, threshold, held_fold),
        "heldout_threshold_0.5": evaluate(features, held_rows, held_scores, 0.5, held_fold),
        "train_solutions": len(set(features.solution[train_rows].tolist())), "train_steps": len(train_rows),
    }
    return result, table


def train_prm(*, data: str | None = None, base_model: str = "smollm2-135m",
              layers: Sequence[int] = DEFAULT_LAYERS, l2: Sequence[float] = DEFAULT_L2, seed: int = 0,
              solutions: int | None = None, workers: int = 1, out: str | Path = DEFAULT_HEAD) -> Path:
    """Train the probe head on the step-labelled solutions of `data` (default: the shared processbench-math set),
    the first `solutions` of the seeded order (all when None), choosing among `layers` x pooling x `l2`; write
    it to `out` and return that path."""
    import torch

    from sgl_tts.paths import cache_dir
    from sgl_tts.runtime.models import resolve_model

    torch.manual_seed(seed)
    ordered = training_order(load_labelled(data), solutions, seed)
    base_dir = resolve_model(base_model)
    began = time.monotonic()
    features = features_for(base_dir, ordered, layers, cache_dir(), workers=workers)
    print(f"features: {len(features.correct)} labelled steps of {len(ordered)} solutions "
          f"in {time.monotonic() - began:.0f} s", flush=True)
    result, table = train(ordered, features, layers, l2)
    metrics = {key: result[key] for key in ("l2", "threshold", "heldout", "heldout_threshold_0.5",
                                            "train_solutions", "train_steps")}
    trained_by = train_command(base_model=base_model, layers=layers, l2=l2, seed=seed, solutions=solutions, data=data)
    head = ProbeHead(base_model=base_model, layer=result["layer"], pooling=result["pooling"],
                     weight=tuple(round(float(v), 9) for v in result["weight"]), bias=round(float(result["bias"]), 9),
                     trained_by=trained_by, metrics={**metrics, "selection": table})
    path = head.save(out)
    print(json.dumps({"head": str(path), "layer": head.layer, "pooling": head.pooling, **metrics}, indent=1))
    print(f"done in {time.monotonic() - began:.0f} s")
    return path


def train_command(*, base_model: str, layers: Sequence[int], l2: Sequence[float], seed: int,
                  solutions: int | None = None, data: str | None = None) -> str:
    """The command line that reproduces this head (the data path is left out when it is the default)."""
    parts = ["sgl-tts train prm", f"--base-model {base_model}", "--layers", *map(str, layers),
             "--l2", *map(str, l2), f"--seed {seed}"]
    if solutions is not None:
        parts.append(f"--solutions {solutions}")
    return " ".join(parts + ([f"--data {data}"] if data else []))
