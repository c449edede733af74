"""Tables from rows of cells (text already formatted): fixed-width console tables and Markdown tables."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Column:
    title: str
    width: int | None = None  # None: as wide as the title and the widest cell; a longer cell overflows a fixed width
    align: str = ">"  # '>' right, '<' left
    gap: int = 1  # spaces before the column (none before the first)


def fit(columns: Sequence[Column], rows: Sequence[Sequence[str]]) -> list[Column]:
    """`columns` with every width of None made that of its title and widest cell."""
    return [column if column.width is not None else
            Column(column.title, max([len(column.title)] + [len(row[i]) for row in rows]), column.align, column.gap)
            for i, column in enumerate(columns)]


def format_row(columns: Sequence[Column], cells: Sequence[str]) -> str:
    """One line of `cells` padded to fixed-width `columns` (fitted: no width of None)."""
    assert len(cells) == len(columns), f"{len(cells)} cells for {len(columns)} columns"
    return "".join((" " * column.gap if i else "") + f"{cell:{column.align}{column.width or 0}}"
                   for i, (column, cell) in enumerate(zip(columns, cells)))


def console_table(columns: Sequence[Column], rows: Sequence[Sequence[str]], rule: bool = False) -> str:
    """The header, a rule of dashes as long as the header when `rule`, then one line per row."""
    columns = fit(columns, rows)
    header = format_row(columns, [column.title for column in columns])
    return "\n".join([header] + (["-" * len(header)] if rule else []) + [format_row(columns, row) for row in rows])


def number_cell(value: float | None, spec: str = ".2f") -> str:
    """`value` formatted with `spec`; '-' for None, a number there is none of (no goodput without tokens)."""
    return "-" if value is None else f"{value:{spec}}"


def markdown_table(titles: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    return "\n".join(["| " + " | ".join(titles) + " |", "|" + "---|" * len(titles)]
                     + ["| " + " | ".join(row) + " |" for row in rows])
