"""The RSD delta sweep's output (`sgl-tts rsd-sweep`): its Markdown table, and the table, plots and results
written to a folder."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path
from typing import Sequence

from sgl_tts.measure.tables import markdown_table
from sgl_tts.paths import write_atomic
from sgl_tts.rsd.sweep import TABLE_COLUMNS, SweepRow, plot_levels, plot_sweep, table_cells
from sgl_tts.search.records import SearchResult


def format_sweep_table(rows: Sequence[SweepRow]) -> str:
    """A Markdown table: one row per delta, then per-level accuracy and draft-only fraction when present."""
    text = markdown_table(TABLE_COLUMNS, [table_cells(row) for row in rows])
    levels = sorted({level for row in rows for level in row.by_level})
    if levels:
        by_level = [[f"{row.delta:.2f}"] + [f"{row.by_level[lv]['accuracy']:.0%} / "
                                            f"{row.by_level[lv]['draft_only_fraction']:.0%}"
                                            if lv in row.by_level else "-" for lv in levels] for row in rows]
        text += ("\n\nBy level (accuracy / solved by draft alone):\n\n"
                 + markdown_table(["delta"] + [f"level {lv}" for lv in levels], by_level))
    return text


def write_sweep_outputs(rows: Sequence[SweepRow], results: dict[float, list[SearchResult]], out: Path, title: str,
                        notes: Sequence[str] = ()) -> list[Path]:
    """Write the table (Markdown, CSV, JSON), the plots and each delta's results (JSONL) under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "sweep.md", out / "sweep.csv", out / "sweep.json", out / "sweep.png"]
    write_atomic(out / "sweep.md", f"# {title}\n\n" + "".join(f"{n}\n\n" for n in notes) + format_sweep_table(rows)
                                  + "\n")
    with open(out / "sweep.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(TABLE_COLUMNS)
        writer.writerows(table_cells(row) for row in rows)
    write_atomic(out / "sweep.json", json.dumps([dataclasses.asdict(row) for row in rows], indent=2))
    plot_sweep(rows, out / "sweep.png", title)
    if any(row.by_level for row in rows):
        plot_levels(rows, out / "sweep_levels.png", title)
        written.append(out / "sweep_levels.png")
    for delta, delta_results in results.items():
        path = out / f"results-delta-{delta:.2f}.jsonl"
        write_atomic(path, "".join(json.dumps(r.to_dict()) + "\n" for r in delta_results))
        written.append(path)
    return written
