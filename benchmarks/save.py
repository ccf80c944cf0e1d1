"""Saving without stalling training: updates per minute and bytes written per save with a numbered checkpoint
every N updates, checkpoints written on the training thread (`--no-background-save`) and on the background
writer (the default), in one run; and the time from SIGTERM to exit with a save in flight (torchrun gives a
stopped job 30 s). Bytes are what the training process wrote (/proc/self/io's wchar), beyond a run without
saves. Run it with PYTHONPATH pointing at another checkout to measure that version's saving alike.

The model is `base` on Multi30k (10k joint BPE: ~52M parameters, a ~0.6 GB checkpoint with Adam's moments), so
that serializing, hashing and fsyncing one checkpoint takes seconds on a small CPU, as a big model's 2.6 GB do on
a GPU node.

    python benchmarks/save.py [--updates 40] [--every 5] [--max-tokens 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import machine, prepare_multi30k, print_table

COLUMNS = ["checkpoints written", "updates", "saves", "seconds", "updates/min", "MB written", "stall per save (s)"]
# Runs `nmt` (argv[2:]) and, at its exit, writes the bytes the process wrote to the file argv[1].
COUNTING = """
import atexit, sys
out = sys.argv[1]
def record():
    fields = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
    open(out, "w").write(fields["wchar"])
atexit.register(record)
sys.argv = ["nmt", *sys.argv[2:]]
from nmt_cli.cli.main import main
main()
"""


def run(data: Path, save: Path, updates: int, every: int, max_tokens: int, background: bool) -> dict:
    """One training run; updates/min between the first and the last update record (saves included)."""
    written = save.parent / f"{save.name}.wchar"
    cmd = [sys.executable, "-c", COUNTING, str(written), "train", str(data), "--save-dir", str(save), "--arch",
           "base", "--precision", "bf16", "--max-tokens", str(max_tokens), "--max-updates", str(updates),
           "--save-interval-updates", str(every), "--keep-last", "2", "--valid-interval", "100000",
           "--log-interval", "1", "--device", "cpu", "--quiet",
           "--background-save" if background else "--no-background-save"]
    subprocess.run(cmd, check=True)
    records = [json.loads(x) for x in (save / "train.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["event"] == "train"]
    seconds = steps[-1]["time"] - steps[0]["time"]
    return {"updates": len(steps) - 1, "seconds": seconds, "per_min": 60 * (len(steps) - 1) / seconds,
            "saves": (steps[-1]["update"] - 1) // every, "bytes": int(written.read_text())}


def stop_time(data: Path, save: Path, every: int, max_tokens: int) -> float:
    """Seconds from SIGTERM, sent just after a numbered save began on the background writer, to exit."""
    cmd = [sys.executable, "-m", "nmt_cli", "train", str(data), "--save-dir", str(save), "--arch", "base",
           "--precision", "bf16", "--max-tokens", str(max_tokens), "--max-updates", "100000",
           "--save-interval-updates", str(every), "--keep-last", "2", "--valid-interval", "100000",
           "--log-interval", "1", "--device", "cpu", "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = save / "train.jsonl"
    while True:
        if log.exists() and any(f'"update": {every},' in x for x in log.read_text().splitlines()
                                if '"event": "train"' in x):
            break
        if proc.poll() is not None:
            raise SystemExit("benchmark: training ended before its first save")
        time.sleep(0.02)
    time.sleep(0.1)  # the save of update `every` is in flight
    begin = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait()
    return time.monotonic() - begin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--updates", type=int, default=40)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=1024)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        prepared = prepare_multi30k(Path(tmp) / "data")
        results = {}
        for background in (False, True):
            results[background] = run(prepared, Path(tmp) / f"bg{int(background)}", args.updates, args.every,
                                      args.max_tokens, background)
        no_save = run(prepared, Path(tmp) / "nosave", args.updates, 10**6, args.max_tokens, True)
        size = max((p.stat().st_size for p in (Path(tmp) / "bg1").glob("checkpoint_*.pt")), default=0)
        numbered = max((p.stat().st_size for p in (Path(tmp) / "bg1").glob("checkpoint_[0-9]*.pt")), default=0)
        stop = stop_time(prepared, Path(tmp) / "stop", args.every, args.max_tokens)
    base_per_update = no_save["seconds"] / no_save["updates"]
    rows = []
    for name, key in (("training thread (--no-background-save)", False), ("background writer (default)", True)):
        r = results[key]
        stall = (r["seconds"] - r["updates"] * base_per_update) / max(r["saves"], 1)
        megabytes = (r["bytes"] - no_save["bytes"]) / 1e6 / max(r["saves"], 1)
        rows.append([name, r["updates"], r["saves"], r["seconds"], r["per_min"], f"{megabytes:.0f} per save",
                     f"{stall:.2f}"])
    rows.append(["none (no saves)", no_save["updates"], 0, no_save["seconds"], no_save["per_min"],
                 f"{no_save['bytes'] / 1e6:.0f} in all", "-"])
    print_table(f"save: base bf16, max-tokens {args.max_tokens}, a numbered checkpoint every {args.every} updates, "
                f"largest checkpoint {size / 1e9:.2f} GB, numbered {numbered / 1e9:.2f} GB ({machine()})", COLUMNS,
                rows)
    print(f"SIGTERM with a save in flight: exit after {stop:.1f} s (torchrun's grace: 30 s)")


if __name__ == "__main__":
    main()
