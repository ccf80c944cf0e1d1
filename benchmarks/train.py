"""Training throughput on CPU: target tokens/s and peak memory for `small` and `base`, fp32 and bf16.

Each configuration runs `nmt train` on Multi30k (10k joint BPE, --max-tokens 4096) in a fresh process:
a few warm-up updates, then a fixed number of timed updates (validation and saving excluded); with
--repeats N each configuration runs N times and the table gives the median and the spread (min-max).

    python benchmarks/train.py [--archs small,base] [--precisions fp32,bf16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import machine, print_table, require_multi30k

COLUMNS = ["model", "precision", "params", "timed updates", "tgt tok/s (median)", "spread", "peak MB"]
UPDATES = {"small": (10, 100), "base": (3, 20), "tiny": (10, 100), "big": (2, 8)}  # (warm-up, timed)


def worker(data_dir: str, arch: str, precision: str, save_dir: str) -> None:
    """Run inside the child: train warm-up + timed updates, print tokens/s and peak RSS as JSON.

    Every update is logged, and tokens/s is the timed updates' target tokens over their wall-clock time
    (each log record covers exactly one update; the last validation and save come after them).
    """
    from nmt_cli.train import TrainOptions, train

    warm, timed = UPDATES[arch]
    train(TrainOptions(data=Path(data_dir), save_dir=Path(save_dir), arch=arch, precision=precision,
                       max_tokens=4096, max_updates=warm + timed, log_interval=1, warmup=4000, device="cpu",
                       quiet=True, keep_last=1))
    records = [json.loads(x) for x in (Path(save_dir) / "train.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["event"] == "train"]
    timed_steps = steps[warm:]
    seconds = timed_steps[-1]["time"] - steps[warm - 1]["time"]
    tokens = sum(r["tgt_tokens_per_s"] * (r["time"] - prev["time"]) for prev, r in zip(steps[warm - 1 :], timed_steps))
    start = [r for r in records if r["event"] == "start"][0]
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"tok_s": tokens / seconds, "peak_mb": peak_mb, "params": start["parameters"]}))


def main() -> list[list]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--archs", default="small,base")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--repeats", type=int, default=1, help="runs per configuration (median and spread)")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return []
    data = require_multi30k()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        prepared = Path(tmp) / "data"
        subprocess.run([sys.executable, "-m", "nmt_cli", "prepare", "-s", "en", "-t", "de", "--train",
                        str(data / "train"), "--valid", str(data / "val"), "--bpe-merges", "10000", "--out",
                        str(prepared), "--quiet"], check=True)
        for arch in args.archs.split(","):
            for precision in args.precisions.split(","):
                runs = []
                for repeat in range(args.repeats):
                    save = Path(tmp) / f"{arch}-{precision}-{repeat}"
                    out = subprocess.run([sys.executable, __file__, "--worker", str(prepared), arch, precision,
                                          str(save)], check=True, capture_output=True, text=True).stdout
                    runs.append(json.loads(out.strip().splitlines()[-1]))
                speeds = sorted(r["tok_s"] for r in runs)
                rows.append([arch, precision, f"{runs[0]['params'] / 1e6:.1f}M", UPDATES[arch][1],
                             statistics.median(speeds), f"{speeds[0]:,.0f}-{speeds[-1]:,.0f}",
                             max(r["peak_mb"] for r in runs)])
                print_table("(partial)", COLUMNS, rows[-1:])
    print_table(f"train: Multi30k en-de, max-tokens 4096, CPU, {args.repeats} run(s) each ({machine()})", COLUMNS,
                rows)
    return rows


if __name__ == "__main__":
    main()
