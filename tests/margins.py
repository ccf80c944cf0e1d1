"""Print the thresholds a test run measured (`NMT_MARGINS=FILE pytest`, or `make test-margins`) as a table:
each figure, its bounds, and how far inside them it landed on this kind of machine.

    python tests/margins.py FILE [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table


def load(path: Path) -> list[dict]:
    """The JSON lines `conftest.threshold` wrote, in the order the tests ran."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def bounds(record: dict) -> str:
    """'>= low', '<= high' or both."""
    parts = [f"{sign} {record[key]:g}" for sign, key in ((">=", "low"), ("<=", "high")) if record[key] is not None]
    return " ".join(parts)


def relative_margin(record: dict) -> float | None:
    """The margin as a share of the room the bounds leave: half the band between two bounds, or the size of a
    single bound (None for a single bound of 0)."""
    low, high = record["low"], record["high"]
    room = (high - low) / 2 if low is not None and high is not None else abs(low if high is None else high)
    return record["margin"] / room if room else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", type=Path)
    parser.add_argument("--json", action="store_true", help="print the records as one JSON list instead")
    args = parser.parse_args()
    if not args.file.exists():
        sys.exit(f"margins: {args.file}: no such file (run the tests with NMT_MARGINS={args.file})")
    records = load(args.file)
    if args.json:
        print(json.dumps(records, indent=1))
        return
    kinds = sorted({r["kind"] for r in records})
    table = Table(title=f"test thresholds and their margins ({', '.join(kinds)})")
    for column in ("test", "figure", "measured", "bounds", "margin", "margin / room"):
        table.add_column(column, justify="left" if column in ("test", "figure") else "right")
    for r in records:
        share = relative_margin(r)
        table.add_row(r["test"].removeprefix("tests/"), r["what"], f"{r['value']:.4g}", bounds(r), f"{r['margin']:.3g}",
                      "" if share is None else f"{100 * share:.0f}%")
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
