"""Replays stopping rules on recorded best-of-N searches (eval/stopping_replay.py): prints, per rule, the tokens
against the full searches' and the paired accuracy difference on the half of the problems its setting is chosen on
and on the half it is reported on (medians over the replays, with ranges), and the setting chosen.

    .venv/bin/sgl-tts run --config cpu-default --out runs/bon-s0          # best-of-16, 80 problems; again with
    .venv/bin/python scripts/replay_stopping.py runs/bon-s0/results.jsonl runs/bon-s1/results.jsonl  # search.seed 1
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from eval.stopping_replay import FLOOR_PT, TOGETHER, as_self_consistency, report, searches_from


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="results.jsonl files of best_of_n runs")
    parser.add_argument("--every", type=int, default=4,
                        help=f"samples sent at a time (the rule asked after each); {TOGETHER}: all at once, the rule "
                             "asked as each ends (they end in the order of their lengths), the others then aborted")
    parser.add_argument("--replays", type=int, default=5, help="orders drawn per search")
    parser.add_argument("--majority", action="store_true",
                        help="replay as self-consistency: every sample weighs one (the plain majority of the answers)")
    args = parser.parse_args()
    searches = []
    for path in args.results:
        with path.open() as lines:
            searches += searches_from((json.loads(line) for line in lines if line.strip()), where=str(path))
    if args.majority:
        searches = as_self_consistency(searches)
    out = report(searches, every=args.every, replays=args.replays)
    together = args.every == TOGETHER
    sent = "all samples at once" if together else f"{args.every} samples at a time"
    selection = ", as self-consistency (the majority)" if args.majority else ""
    print(f"{len(searches)} searches{selection}, {sent}, medians of {args.replays} replays [min-max]")
    print("| rule | tokens (choosing half) | Δ pt, low end (choosing) | tokens (reporting half) | Δ pt [95% CI], p "
          "(reporting) | solved |" + (" decode steps (reporting) |" if together else ""))
    print("| --- | --- | --- | --- | --- | --- |" + (" --- |" if together else ""))
    for name, row in out["table"].items():
        c, r = row["choosing"], row["reporting"]
        steps = (f" {r['steps_ratio']:.2f} [{r['steps_ratio_range'][0]:.2f}-{r['steps_ratio_range'][1]:.2f}] |"
                 if together else "")
        print(f"| {name} | {c['tokens_ratio']:.2f} | {c['delta_pt']:+.1f}, {c['low_pt']:+.1f} "
              f"| {r['tokens_ratio']:.2f} [{r['tokens_ratio_range'][0]:.2f}-{r['tokens_ratio_range'][1]:.2f}] "
              f"| {r['delta_pt']:+.1f} [{r['low_pt']:+.1f}, {r['high_pt']:+.1f}], p {r['p']:.2f} "
              f"| {r['solved']:.0f} of {r['searches']} against {r['solved_full']} |" + steps)
    print(f"chosen (fewest tokens with the choosing half's interval above -{FLOOR_PT:g} pt): {out['chosen']}")


if __name__ == "__main__":
    main()
