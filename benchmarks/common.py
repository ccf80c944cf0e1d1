"""Helpers shared by the benchmarks: where the data is, and how to print a table."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
MULTI30K = Path(os.environ.get("DATA", REPO.parent / "shared" / "data" / "multi30k"))


def require_multi30k() -> Path:
    """The Multi30k folder, or exit with a one-line message."""
    if not (MULTI30K / "train.en.gz").exists() and not (MULTI30K / "train.en").exists():
        sys.exit(f"benchmark: Multi30k not found in {MULTI30K} (set DATA=)")
    return MULTI30K


def flickr_test_sources() -> list[str]:
    """The English side of Multi30k test_2016_flickr (1,000 sentences), the translation benchmarks' input."""
    from nmt_cli.textio import read_lines

    data = require_multi30k()
    path = data / "test_2016_flickr.en.gz"
    return read_lines(path if path.exists() else data / "test_2016_flickr.en")


def machine() -> str:
    """A one-line description of this machine, its kind first (Intel Xeon with AMX or not, AMD EPYC, ...)."""
    from nmt_cli.hardware import describe_machine

    return describe_machine()


def print_table(title: str, columns: list[str], rows: list[list]) -> None:
    """A rich table on stdout."""
    table = Table(title=title)
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*[f"{x:,.1f}" if isinstance(x, float) else str(x) for x in row])
    Console(width=max(Console().width, 140)).print(table)
