"""Training speed over a long run on CPU, for each memory allocator: does tokens/s hold, or fall as the process ages?

`benchmarks/train.py` times 100 updates of a fresh process; a recipe trains for an hour. Here each allocator
(`nmt train --cpu-allocator`: the system's glibc malloc, tcmalloc, jemalloc; those installed) trains the
Multi30k recipe's model (10k joint BPE, `small`, --max-tokens 4096, the recipe's dropouts and schedule) for the
same minutes in a fresh process, one after the other, and the table gives the target tokens/s of its first
and last 200 updates (wall-clock, the validations at epoch ends included, as the run spends them), the change
between them, and the updates done.

With `--translate MODEL`: `nmt translate` instead, as a user runs it (a whole process, start-up included) over
Multi30k's test_2016_flickr (1,000 lines, the model file's beam and length penalty), in fp32 and bf16, each
allocator `--repeat` times, the runs of one precision interleaved (system, tcmalloc, jemalloc, system, ...) so
that a drift of the host falls on every allocator alike: the median sentences/s, its ratio to the system
allocator's, and whether the output is the same as the system allocator's.

    python benchmarks/allocator.py [--minutes 6] [--allocators system,tcmalloc,jemalloc,system] [--train-flags "..."]
    python benchmarks/allocator.py --translate exp/multi30k/model.pt [--repeat 3] [--allocators system,tcmalloc]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import flickr_test_sources, machine, prepare_multi30k, print_table

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


def installed(allocators: list[str]) -> list[str]:
    """Those of `allocators` this machine has (system always), in order; a line on stderr for each left out."""
    kept = [a for a in allocators if a == "system" or find_allocator(a) is not None]
    for allocator in dict.fromkeys(set(allocators) - set(kept)):
        print(f"benchmark: {allocator} is not installed; skipped", file=sys.stderr)
    return kept


def translate_speed(model: str, allocators: list[str], repeat: int) -> list[list]:
    """`nmt translate -i test_2016_flickr` as a whole process on each allocator, `repeat` interleaved runs per
    precision: rows of precision, allocator, runs, median sent/s, ratio to the system's, same output."""
    sources = flickr_test_sources()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "test.en"
        src.write_text("".join(s + "\n" for s in sources), encoding="utf-8")
        for precision in ("fp32", "bf16"):
            speeds: dict[str, list[float]] = {a: [] for a in allocators}
            outputs: dict[str, str] = {}
            for _ in range(repeat):
                for allocator in allocators:
                    out = Path(tmp) / f"{allocator}.out"
                    start = time.perf_counter()
                    subprocess.run([sys.executable, "-m", "nmt_cli", "translate", "-m", model, "-i", str(src), "-o",
                                    str(out), "--precision", precision, "--device", "cpu", "--cpu-allocator",
                                    allocator, "--quiet"], check=True, stderr=subprocess.DEVNULL)
                    speeds[allocator].append(len(sources) / (time.perf_counter() - start))
                    outputs.setdefault(allocator, out.read_text(encoding="utf-8"))
            base = statistics.median(speeds.get("system") or next(iter(speeds.values())))
            for allocator, runs in speeds.items():
                median = statistics.median(runs)
                rows.append([precision, allocator, len(runs), round(median, 1), f"{median / base:.2f}",
                             "yes" if outputs[allocator] == outputs.get("system", outputs[allocator]) else "no"])
    return rows


def main() -> list[list]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=6.0)
    # training: the system's first and last, so that a drift of the host shows as a gap between its two rows
    parser.add_argument("--allocators", default=None, help="default: system,tcmalloc,jemalloc,system to train; "
                        "system,tcmalloc,jemalloc to translate")
    parser.add_argument("--train-flags", default=RECIPE_FLAGS)
    parser.add_argument("--translate", metavar="MODEL", help="time nmt translate with this model instead")
    parser.add_argument("--repeat", type=int, default=3, help="with --translate: runs per allocator and precision")
    args = parser.parse_args()
    if args.translate:
        allocators = installed((args.allocators or "system,tcmalloc,jemalloc").split(","))
        rows = translate_speed(args.translate, list(dict.fromkeys(allocators)), args.repeat)
        print_table(f"nmt translate, whole process, per allocator: Multi30k test_2016_flickr, 1,000 lines, CPU "
                    f"({machine()})", ["precision", "allocator", "runs", "sent/s (median)", "vs system",
                                       "same output as system"], rows)
        return rows
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        prepared = prepare_multi30k(Path(tmp) / "data")
        # a name twice: a second run, later
        for run, allocator in enumerate(installed((args.allocators or "system,tcmalloc,jemalloc,system").split(","))):
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
