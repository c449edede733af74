"""Pools runs of `sgl-tts bench peers` (e.g. one per seed) by (run, problem) and prints the report's tables over
the pooled lines: the systems at each n, and every peer point against every sgl-tts point (`eval/peers.py`); a
system at an n that not every run measured is left out. `--plot DIR` draws each library's frontier over the pooled
points into DIR: peers-libraries-time.png (against wall time) and peers-libraries-tokens.png (processed tokens).
Pairs of one problem under several seeds are not independent, so the pooled p overstates the certainty.

    .venv/bin/python scripts/pool_peers.py --ns 1,2,4 bench-peers-s0 bench-peers-s1 [--plot pooled]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from eval.peers import (COLUMNS, EVERY_POINT_COLUMNS, RESULTS, against_every_point, every_point_rows, n_values,
                        peers_summary, plot_libraries, pooled_rows, table_rows)
from eval.results import ResultStore
from sgl_tts.measure.tables import markdown_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outs", nargs="+", type=Path, help="`--out` folders of bench peers runs")
    parser.add_argument("--ns", required=True, help="comma-separated n that every run measured")
    parser.add_argument("--plot", type=Path, help="a folder for the pooled points' library frontiers")
    args = parser.parse_args()
    ns = set(n_values(args.ns, "--ns"))
    cells = peers_summary(pooled_rows([ResultStore(out / RESULTS).records() for out in args.outs], ns))
    print(markdown_table(COLUMNS, table_rows(cells)))
    print()
    print(markdown_table(EVERY_POINT_COLUMNS, every_point_rows(against_every_point(cells))))
    if args.plot is not None:
        args.plot.mkdir(parents=True, exist_ok=True)
        for path in plot_libraries(cells, args.plot):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
