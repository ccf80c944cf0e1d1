"""CPU training with the cores as threads of one process, or as gloo processes of one thread each.

On 2 cores `nmt train` can run one process on 2 threads (PyTorch's intra-op parallelism), or two processes of
one thread each under `torchrun` (data parallel over gloo, as on GPUs). Each layout trains the same model on
Multi30k (10k joint BPE) with the same target tokens per update: one process reads `--update-freq P x F`
batches per update, P processes read F each. The layouts alternate (1, P, 1, P, ...) so that a drift of the
host falls on both; each run is a fresh process, its tokens/s the target tokens of the updates after the
first `--warm-up` over their wall-clock time (no validation or saving inside the window). Where the update's
batches divide among the processes (`tiny-literature`), both layouts train on the same batches in the same
updates of the first epoch; later ones part where an epoch's batch count is not a multiple of P (one process
ends the epoch with a smaller update, P processes leave the odd batches out), so the table gives the mean
training loss over the timed updates, the same to a few hundredths. `small`'s one batch of 4,096 tokens becomes P
batches of 4,096 / P, formed anew from the length-sorted data.

    python benchmarks/processes.py [--shapes tiny-literature,small] [--updates 300] [--repeats 2] [--processes 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import REPO, machine, prepare_multi30k, print_table

# The model and update of each shape: `small` is `make multi30k`'s (one batch of 4,096 tokens per update;
# P processes then read --max-tokens 4096 / P each), `tiny-literature` the literature's Transformer-Tiny of the
# recipes' lever table (two batches of 4,096 per update).
SHAPES = {
    "small": ("--arch small --lr-scale 0.5 --warmup 1000", 4096, 1),
    "tiny-literature": ("--arch tiny --layers 4 --d-model 128 --ffn 256 --heads 4 --dropout 0.3 --lr-scale 2.53 "
                        "--warmup 2000", 4096, 2),
}
COMMON = ("--precision auto --attention-dropout 0.1 --activation-dropout 0.1 --label-smoothing 0.2 --seed 1 "
          "--device cpu --log-interval 1 --valid-interval 1000000 --keep-last 1 --quiet")
COLUMNS = ["shape", "layout", "batches x tokens per update", "runs", "tgt tok/s (median)", "spread", "vs 1 process",
           "mean loss, timed updates"]


def batches_per_process(shape: str, processes: int) -> tuple[int, int]:
    """(--max-tokens, --update-freq) of each of `processes` processes for the shape's tokens per update."""
    _, max_tokens, batches = SHAPES[shape]
    if processes > batches:  # fewer batches than processes: split their tokens
        return max_tokens * batches // processes, 1
    return max_tokens, batches // processes


def layout_command(shape: str, processes: int, threads: int, data: Path, save: Path, updates: int) -> list[str]:
    """`nmt train` for one shape in one layout: `processes` gloo processes (torchrun) of `threads` threads each,
    each reading its share of the shape's batches per update."""
    flags = SHAPES[shape][0]
    max_tokens, update_freq = batches_per_process(shape, processes)
    train = ["train", str(data), "--save-dir", str(save), *shlex.split(flags), *shlex.split(COMMON),
             "--max-tokens", str(max_tokens), "--update-freq", str(update_freq), "--threads", str(threads),
             "--max-updates", str(updates)]
    if processes == 1:
        return [sys.executable, "-m", "nmt_cli", *train]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
            "-m", "nmt_cli", *train]


def timed(save: Path, warm_up: int) -> tuple[float, float]:
    """Target tokens/s over the updates after `warm_up`, and their mean training loss, from train.jsonl."""
    records = [json.loads(line) for line in (save / "train.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["event"] == "train"]
    window = steps[warm_up:]
    tokens = sum(r["tgt_tokens_per_s"] * (r["time"] - prev["time"]) for prev, r in zip(steps[warm_up - 1 :], window))
    return tokens / (window[-1]["time"] - steps[warm_up - 1]["time"]), statistics.mean(r["loss"] for r in window)


def main() -> list[list]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="tiny-literature,small", help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--updates", type=int, default=300, help="updates per run, warm-up included")
    parser.add_argument("--warm-up", type=int, default=20, help="updates left out of the timing")
    parser.add_argument("--repeats", type=int, default=2, help="runs per layout (median and spread)")
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 2, help="processes of the second layout")
    args = parser.parse_args()
    if args.updates <= args.warm_up:
        sys.exit(f"benchmark: --updates {args.updates} leaves nothing after --warm-up {args.warm_up}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        prepared = prepare_multi30k(Path(tmp) / "data")
        layouts = [(1, args.processes), (args.processes, 1)]
        for shape in args.shapes.split(","):
            if shape not in SHAPES:
                sys.exit(f"benchmark: unknown shape {shape!r}; known: {', '.join(SHAPES)}")
            results: dict[tuple[int, int], list[tuple[float, float]]] = {layout: [] for layout in layouts}
            for repeat in range(args.repeats):
                for processes, threads in layouts:
                    save = Path(tmp) / f"{shape}-{processes}x{threads}-{repeat}"
                    command = layout_command(shape, processes, threads, prepared, save, args.updates)
                    subprocess.run(command, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
                    results[(processes, threads)].append(timed(save, args.warm_up))
            base = statistics.median(speed for speed, _ in results[layouts[0]])
            for processes, threads in layouts:
                speeds = sorted(speed for speed, _ in results[(processes, threads)])
                median = statistics.median(speeds)
                losses = sorted(loss for _, loss in results[(processes, threads)])
                max_tokens, update_freq = batches_per_process(shape, processes)
                rows.append([shape, f"{processes} process(es) x {threads} thread(s)",
                             f"{processes * update_freq} x {max_tokens}",
                             len(speeds), median, f"{speeds[0]:,.0f}-{speeds[-1]:,.0f}", f"{median / base:.2f}x",
                             ", ".join(f"{loss:.3f}" for loss in losses)])
            print_table("(partial)", COLUMNS, rows[-2:])
    print_table(f"train: Multi30k en-de, {args.updates} updates per run ({args.warm_up} untimed), layouts "
                f"alternating ({machine()})", COLUMNS, rows)
    return rows


if __name__ == "__main__":
    main()
