"""Training speed over a long run on CPU, for each memory allocator: does tokens/s hold, or fall as the process ages?

`benchmarks/train.py` times 100 updates of a fresh process; a recipe trains for an hour. Here each allocator
(`nmt train --cpu-allocator`: the system's glibc malloc, tcmalloc, jemalloc; those installed) trains the
Multi30k recipe's model (10k joint BPE, `small`, --max-tokens 4096, the recipe's dropouts and schedule) for the
same minutes in a fresh process, one after the other, and the table gives the target tokens/s of its first
and last 200 updates (wall-clock, the validations at epoch ends included, as the run spends them), the change
between them, and the updates done.

    python benchmarks/allocator.py [--minutes 6] [--allocators system,tcmalloc,jemalloc,system] [--train-flags "..."]
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from common import machine, print_table, require_multi30k

from nmt_cli.torch_env import find_allocator

WINDOW = 200  # updates
COLUMNS = ["allocator", "minutes", "updates", f"tok/s, updates 1-{WINDOW}", f"tok/s, last {WINDOW}", "change",
           "library"]
RECIPE_FLAGS = ("--arch small --precision auto --max-tokens 4096 --lr-scale 0.5 --warmup 1000 --cooldown 0.3 "
                "--attention-dropout 0.1 --activation-dropout 0.1 --label-smoothing 0.2 --ema 0.999")


def window_speed(steps: list[dict], first: bool, every: int = 50) -> float:
    """Target tokens/s over the first (or last) WINDOW updates of a run's `train` records (logged every `every`
    updates, the first record the start), each interval weighted by its time."""
    chosen = steps[: WINDOW // every + 1] if first else steps[-(WINDOW // every + 1):]
    pairs = list(zip(chosen, chosen[1:]))
    seconds = sum(b["elapsed_s"] - a["elapsed_s"] for a, b in pairs)
    return sum(b["tgt_tokens_per_s"] * (b["elapsed_s"] - a["elapsed_s"]) for a, b in pairs) / seconds


def main() -> list[list]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--minutes", type=float, default=6.0)
    # the system's first and last: a drift of the host shows as a gap between its two rows
    parser.add_argument("--allocators", default="system,tcmalloc,jemalloc,system")
    parser.add_argument("--train-flags", default=RECIPE_FLAGS)
    args = parser.parse_args()
    data = require_multi30k()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        prepared = Path(tmp) / "data"
        subprocess.run([sys.executable, "-m", "nmt_cli", "prepare", "-s", "en", "-t", "de", "--train",
                        str(data / "train"), "--valid", str(data / "val"), "--bpe-merges", "10000", "--out",
                        str(prepared), "--quiet"], check=True)
        for run, allocator in enumerate(args.allocators.split(",")):  # a name twice: a second run, later
            if allocator != "system" and find_allocator(allocator) is None:
                print(f"benchmark: {allocator} is not installed; skipped", file=sys.stderr)
                continue
            save = Path(tmp) / f"{run}-{allocator}"
            # --max-time ends the run at the clock; the cool-down's share is of that time, as in the recipe
            subprocess.run([sys.executable, "-m", "nmt_cli", "train", str(prepared), "--save-dir", str(save),
                            "--device", "cpu", "--max-time", str(args.minutes), "--log-interval", "50",
                            "--cpu-allocator", allocator, "--quiet", *shlex.split(args.train_flags)], check=True)
            log = [json.loads(line) for line in (save / "train.jsonl").read_text().splitlines()]
            steps = [{"elapsed_s": 0.0, "tgt_tokens_per_s": 0.0}] + [r for r in log if r["event"] == "train"]
            start = next(r for r in log if r["event"] == "start")
            first, last = window_speed(steps, first=True), window_speed(steps, first=False)
            rows.append([allocator, args.minutes, steps[-1]["update"], round(first), round(last),
                         f"{100 * (last / first - 1):+.0f}%", Path(start["allocator"]).name])
            print_table("(partial)", COLUMNS, rows[-1:])
    print_table(f"train over {args.minutes:g} minutes per allocator: Multi30k en-de, CPU ({machine()})", COLUMNS,
                rows)
    return rows


if __name__ == "__main__":
    main()
