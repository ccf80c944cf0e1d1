"""Gradients all-reduced in fp32 or in bf16 (`nmt train --comm-precision`): the training curve of two real
runs under torchrun with 2 gloo processes on this CPU (same data, seed and schedule), and the bytes each
process sends per update for base and big.

    python benchmarks/comm_precision.py --data DATA_DIR [--arch tiny] [--updates 1000] [--max-tokens 2048]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import machine, print_table

from nmt_cli.model.transformer import Transformer, make_config


def run(data: Path, save: Path, args, precision: str) -> list[dict]:
    """One torchrun of `nmt train`; its log records."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "nmt_cli",
           "train", str(data), "--save-dir", str(save), "--arch", args.arch, "--max-updates", str(args.updates),
           "--max-tokens", str(args.max_tokens), "--warmup", "400", "--precision", "fp32", "--device", "cpu",
           "--seed", "1", "--log-interval", str(max(1, args.updates // 10)), "--valid-interval",
           str(max(1, args.updates // 4)), "--comm-precision", precision, "--quiet"]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return [json.loads(line) for line in (save / "train.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="a folder of nmt prepare")
    parser.add_argument("--arch", default="tiny")
    parser.add_argument("--updates", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=2048, help="per process and update")
    args = parser.parse_args()
    print(f"{machine()}; {args.arch}, 2 processes x {args.max_tokens} tokens, fp32 training, seed 1")
    rows = []
    for arch in ("base", "big"):
        model = Transformer(make_config(arch, 36_997))
        params = sum(p.numel() for p in model.parameters())
        rows.append([arch, f"{params:,}", f"{params * 4 / 1e6:,.0f} MB", f"{params * 2 / 1e6:,.0f} MB"])
        del model
    print_table("gradient bytes each process all-reduces per update (vocabulary 36,997)",
                ["model", "parameters", "fp32", "bf16"], rows)
    with tempfile.TemporaryDirectory() as work:
        logs = {p: run(args.data, Path(work) / p, args, p) for p in ("fp32", "bf16")}
    train = {p: {r["update"]: r["loss"] for r in log if r["event"] == "train"} for p, log in logs.items()}
    valid = {p: {r["update"]: r["valid_loss"] for r in log if r["event"] == "valid"} for p, log in logs.items()}
    ends = {p: next(r for r in log if r["event"] == "end") for p, log in logs.items()}
    rows = [[u, f"{train['fp32'][u]:.4f}", f"{train['bf16'][u]:.4f}",
             f"{valid['fp32'][u]:.4f}" if u in valid["fp32"] else "", f"{valid['bf16'][u]:.4f}" if u in valid["bf16"]
             else ""] for u in sorted(train["fp32"])]
    print_table(f"{args.arch} on {args.data}, {args.updates} updates ({ends['fp32']['elapsed']:.0f} s fp32, "
                f"{ends['bf16']['elapsed']:.0f} s bf16 all-reduce)",
                ["update", "train loss, fp32 all-reduce", "bf16", "valid loss, fp32", "bf16"], rows)


if __name__ == "__main__":
    main()
