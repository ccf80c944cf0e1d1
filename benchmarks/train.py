"""Training throughput on CPU: target tokens/s and peak memory for `small` and `base`, fp32 and bf16.

Each configuration runs `nmt train` on Multi30k (10k joint BPE, --max-tokens 4096) in a fresh process:
a few warm-up updates, then a fixed number of timed updates (validation and saving excluded).

    python benchmarks/train.py [--archs small,base] [--precisions fp32,bf16]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from common import machine, print_table, require_multi30k

UPDATES = {"small": (5, 30), "base": (3, 8), "tiny": (5, 30), "big": (2, 4)}  # (warm-up, timed)


def worker(data_dir: str, arch: str, precision: str, save_dir: str) -> None:
    """Run inside the child: train warm-up + timed updates, print tokens/s and peak RSS as JSON."""
    from nmt_cli.train import TrainOptions, train

    warm, timed = UPDATES[arch]
    train(TrainOptions(data=Path(data_dir), save_dir=Path(save_dir), arch=arch, precision=precision,
                       max_tokens=4096, max_updates=warm + timed, log_interval=warm, warmup=4000, device="cpu",
                       quiet=True, keep_last=1))
    records = [json.loads(x) for x in (Path(save_dir) / "train.jsonl").read_text().splitlines()]
    last = [r for r in records if r["event"] == "train"][-1]
    start = [r for r in records if r["event"] == "start"][0]
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"tok_s": last["tgt_tokens_per_s"], "peak_mb": peak_mb, "params": start["parameters"]}))


def main() -> list[list]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--archs", default="small,base")
    parser.add_argument("--precisions", default="fp32,bf16")
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
                save = Path(tmp) / f"{arch}-{precision}"
                out = subprocess.run([sys.executable, __file__, "--worker", str(prepared), arch, precision, str(save)],
                                     check=True, capture_output=True, text=True).stdout
                result = json.loads(out.strip().splitlines()[-1])
                rows.append([arch, precision, f"{result['params'] / 1e6:.1f}M", UPDATES[arch][1], result["tok_s"],
                             result["peak_mb"]])
                print_table("(partial)", ["model", "precision", "params", "timed updates", "tgt tok/s", "peak MB"],
                            rows[-1:])
    print_table(f"train: Multi30k en-de, max-tokens 4096, CPU ({machine()})",
                ["model", "precision", "params", "timed updates", "tgt tok/s", "peak MB"], rows)
    return rows


if __name__ == "__main__":
    main()
