"""A timeline of one search: what each slot of each runtime did over time (`sgl-tts run --timeline`, `eval`).

Drawn from the search's `timeline()` (`sgl_tts.search.context`): its standard requests from the request ledger
(sent and answered on the client's clock, with the context tokens the server counted) and the windows it
recorded with `record_timeline` on: `expand`'s iterations, the verifier's calls, FastTTS S's speculative
requests.

A slot is one of the runtime's concurrent lanes of this search's work: requests are placed in slots by
interval partitioning (`assign_slots`: by start time, each into the lowest-numbered slot free by then), which
uses as many slots as requests ever overlap, the fewest any placement can. Each slot's time is then cut into
states (`slot_segments`):
- generate: a standard request of the generator; verify: a verifier call; speculative: S's head start;
- straggler tail: a slot whose standard request was answered before its iteration's last answer, from that
  answer until the iteration ends, but for the time a speculative request fills it;
- idle: any other time.
Iteration boundaries are drawn as vertical lines. `latency_points` gives the step latency against context
length of the generator's requests and of the verifier's calls (tokens per scored path) for the second plot.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

STATES = ("generate", "verify", "speculative", "tail", "idle")
COLORS = {"generate": "#2b6cb0", "verify": "#c05621", "speculative": "#38a169", "tail": "#e53e3e",
          "idle": "#edf2f7"}
LABELS = {"generate": "generate", "verify": "verify", "speculative": "speculative head start",
          "tail": "straggler tail", "idle": "idle"}
ROLE = {"generator": "generator", "target": "target", "scorer": "verifier"}


@dataclass(frozen=True)
class Busy:
    """One stretch of work on a runtime: `kind` generate, verify or speculative, from `began` to `ended`."""

    runtime: str
    kind: str
    began: float
    ended: float


@dataclass(frozen=True)
class Segment:
    state: str
    began: float
    ended: float


def assign_slots(intervals: Sequence[tuple[float, float]]) -> list[int]:
    """The slot of each (began, ended) interval: by start time (ties: the earlier end first), each takes the
    lowest-numbered slot whose last interval ended by its start. As many slots as the most intervals that
    overlap at one time (an interval ending when another begins does not overlap it)."""
    order = sorted(range(len(intervals)), key=lambda i: (intervals[i][0], intervals[i][1], i))
    slots = [0] * len(intervals)
    running: list[tuple[float, int]] = []  # (ended, slot) of the intervals holding a slot
    free: list[int] = []
    opened = 0
    for index in order:
        began, ended = intervals[index]
        while running and running[0][0] <= began:
            heapq.heappush(free, heapq.heappop(running)[1])
        if free:
            slot = heapq.heappop(free)
        else:
            slot, opened = opened, opened + 1
        slots[index] = slot
        heapq.heappush(running, (ended, slot))
    return slots


def busy_of(timeline: dict[str, Any]) -> list[Busy]:
    """The timeline's work: standard requests (generate, on their runtime), verifier calls and speculative
    requests (from its windows)."""
    work = [Busy(r["runtime"], "generate", r["began"], r["ended"]) for r in timeline["requests"]]
    work += [Busy(w["runtime"], w["kind"], w["began"], w["ended"]) for w in timeline["windows"]
             if w["kind"] in ("verify", "speculative")]
    return work


def iterations_of(timeline: dict[str, Any]) -> list[tuple[float, float]]:
    return sorted((w["began"], w["ended"]) for w in timeline["windows"] if w["kind"] == "iteration")


def _iteration_end(busy: Busy, iterations: Sequence[tuple[float, float]]) -> float | None:
    """The end of the iteration a standard request was sent in (None: sent outside every iteration)."""
    for began, ended in iterations:
        if began <= busy.began <= ended:
            return ended
    return None


def slot_segments(work: Sequence[Busy], slots: Sequence[int], iterations: Sequence[tuple[float, float]],
                  horizon: float) -> dict[int, list[Segment]]:
    """Each slot's time from 0 to `horizon` as consecutive segments (see the module docstring): its work, the
    straggler tail after a standard request answered before its iteration ended, idle otherwise."""
    by_slot: dict[int, list[Busy]] = {}
    for busy, slot in zip(work, slots):
        by_slot.setdefault(slot, []).append(busy)
    segments: dict[int, list[Segment]] = {}
    for slot, items in sorted(by_slot.items()):
        items.sort(key=lambda b: (b.began, b.ended))
        cut: list[Segment] = []
        now, tail_until = 0.0, None
        for busy in items:
            if busy.began > now:
                _gap(cut, now, busy.began, tail_until)
            cut.append(Segment(busy.kind, busy.began, busy.ended))
            now = max(now, busy.ended)
            if busy.kind == "generate":  # a speculative request in the tail leaves the rest of it a tail
                tail_until = _iteration_end(busy, iterations)
        if horizon > now:
            _gap(cut, now, horizon, tail_until)
        segments[slot] = cut
    return segments


def _gap(cut: list[Segment], began: float, ended: float, tail_until: float | None) -> None:
    """Fill [began, ended): straggler tail up to `tail_until`, idle after it."""
    split = min(ended, tail_until) if tail_until is not None else began
    if split > began:
        cut.append(Segment("tail", began, split))
    if ended > split:
        cut.append(Segment("idle", max(began, split), ended))


def lanes(timeline: dict[str, Any]) -> list[tuple[str, int, list[Segment]]]:
    """(role, slot, segments) for every slot of every runtime the search used, generator first."""
    work = busy_of(timeline)
    iterations = iterations_of(timeline)
    horizon = max([b.ended for b in work] + [end for _, end in iterations] + [0.0])
    rows = []
    for runtime in sorted({b.runtime for b in work}, key=lambda r: (r != "generator", r)):
        mine = [b for b in work if b.runtime == runtime]
        slots = assign_slots([(b.began, b.ended) for b in mine])
        for slot, segments in slot_segments(mine, slots, iterations, horizon).items():
            rows.append((ROLE.get(runtime, runtime), slot, segments))
    return rows


def state_seconds(rows: Sequence[tuple[str, int, list[Segment]]]) -> dict[str, dict[str, float]]:
    """Slot-seconds per state, per role: what the legend's shares are made of."""
    totals: dict[str, dict[str, float]] = {}
    for role, _, segments in rows:
        for segment in segments:
            role_totals = totals.setdefault(role, dict.fromkeys(STATES, 0.0))
            role_totals[segment.state] += segment.ended - segment.began
    return totals


def latency_points(timelines: Sequence[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """(context tokens, seconds) per step: each generator request's context (prompt tokens as the server
    counted them) and its latency, and each verifier call's input tokens per scored path and its time."""
    points: dict[str, list[tuple[int, float]]] = {"generator": [], "verifier": []}
    for timeline in timelines:
        points["generator"] += [(r["prompt_tokens"], r["ended"] - r["began"]) for r in timeline["requests"]
                                if r["runtime"] == "generator" and r["prompt_tokens"]]
        points["verifier"] += [(round(w["input_tokens"] / w["paths"]), w["ended"] - w["began"])
                               for w in timeline["windows"] if w["kind"] == "verify" and w.get("paths")]
    return points


def plot_timeline(timeline: dict[str, Any], path: str | Path, title: str) -> None:
    """Draw one search's timeline (one row per slot, generator first, iteration boundaries) as a PNG or SVG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = lanes(timeline)
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.22 * max(1, len(rows))))
    for y, (_, _, segments) in enumerate(rows):
        for state in STATES:
            bars = [(s.began, s.ended - s.began) for s in segments if s.state == state]
            if bars:
                ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=COLORS[state], linewidth=0)
    for began, ended in iterations_of(timeline):
        ax.axvline(began, color="#4a5568", linewidth=0.6, linestyle="--")
        ax.axvline(ended, color="#4a5568", linewidth=0.6, linestyle=":")
    ax.set_yticks(range(len(rows)), [f"{role} {slot}" for role, slot, _ in rows], fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the search's start (dashed: an iteration begins, dotted: it ends)", fontsize=7)
    ax.tick_params(axis="x", labelsize=7)
    shares = state_seconds(rows)
    legend = [Patch(color=COLORS[s], label=LABELS[s]) for s in STATES]
    ax.legend(handles=legend, fontsize=6, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.32), frameon=False)
    summary = "; ".join(f"{role}: " + ", ".join(f"{LABELS[s]} {v / max(1e-9, sum(t.values())):.0%}"
                                                for s, v in t.items() if v > 0) for role, t in shares.items())
    ax.set_title(f"{title}\n{summary}", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_latency_vs_context(timelines: Sequence[dict[str, Any]], path: str | Path, title: str) -> None:
    """Step latency against context length: the generator's requests and the verifier's calls, one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = latency_points(timelines)
    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    for ax, (role, xlabel) in zip(axes, (("generator", "context tokens of the step request"),
                                         ("verifier", "input tokens per scored path"))):
        xs, ys = [p[0] for p in points[role]], [p[1] for p in points[role]]
        ax.scatter(xs, ys, s=6, alpha=0.6, color=COLORS["generate" if role == "generator" else "verify"])
        ax.set_xlabel(xlabel, fontsize=7)
        ax.set_ylabel("seconds", fontsize=7)
        ax.set_title(f"{role}: {len(xs)} steps", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def safe_name(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in str(text))
