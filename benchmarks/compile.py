"""torch.compile of the layers (`nmt train --compile`) against the eager update on this CPU: compile time and
target tokens/s per preset, and the training curve of one real run each way (same data, seed and schedule).

Speed: synthetic WMT-like batches of 4,096 target tokens (`gpu_check.synthetic_batches`), a 7,997-symbol
vocabulary (unaligned, as BPE gives), bf16 autocast where the CPU multiplies it, else fp32; the first update
(compilation) is timed apart, then 2 warm-up and N timed updates. The curve: `nmt train` on DATA (a folder of
`nmt prepare`) for --curve-updates updates of 4,096 tokens, eager and compiled, dropout as the preset says
(the compiled kernels draw their own random numbers, so the curves agree within noise, not bit for bit).

    python benchmarks/compile.py [--archs tiny,small] [--updates 10] [--data DATA_DIR --curve-updates 1000]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from common import machine, print_table

from nmt_cli.hardware import cpu_has_bf16
from nmt_cli.model.transformer import Transformer, make_config
from nmt_cli.training import distributed as D
from nmt_cli.training.gpu_check import synthetic_batches
from nmt_cli.training.options import TrainOptions
from nmt_cli.training.update import TranslationLoss, train_step

VOCAB = 7_997


def speed(arch: str, compiled: bool, updates: int, precision: str) -> tuple[float, float]:
    """(first update's seconds, target tokens/s after it) for one preset, eager or compiled."""
    torch.manual_seed(1)
    model = Transformer(make_config(arch, VOCAB))
    if compiled:
        model.compile_layers()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    opts = TrainOptions(data=Path("."), save_dir=Path("."), arch=arch, precision=precision)
    runner, device = TranslationLoss(model, 0.1), torch.device("cpu")
    batches = [synthetic_batches(1, 4096, seed=seed, vocab=VOCAB)[0] for seed in range(updates + 3)]

    def step(batch) -> None:
        train_step(runner, model, [batch], optimizer, scaler, opts, D.DistContext(), device)

    start = time.perf_counter()
    step(batches[0])
    first = time.perf_counter() - start
    for batch in batches[1:3]:
        step(batch)
    start = time.perf_counter()
    for batch in batches[3:]:
        step(batch)
    return first, sum(b.ntokens for b in batches[3:]) / (time.perf_counter() - start)


def curve(data: Path, arch: str, updates: int, compiled: bool, precision: str, work: Path) -> list[dict]:
    """The train and valid records of one `nmt train` run."""
    from nmt_cli.training.trainer import train

    save = work / ("compiled" if compiled else "eager")
    shutil.rmtree(save, ignore_errors=True)
    train(TrainOptions(data=data, save_dir=save, arch=arch, max_updates=updates, max_tokens=4096, warmup=400,
                       precision=precision, device="cpu", seed=1, compile=compiled, quiet=True,
                       log_interval=max(1, updates // 10), valid_interval=max(1, updates // 4),
                       background_save=False))
    return [json.loads(line) for line in (save / "train.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", default="tiny,small")
    parser.add_argument("--updates", type=int, default=10, help="timed updates per preset and mode")
    parser.add_argument("--data", type=Path, help="a folder of nmt prepare: also train one curve each way")
    parser.add_argument("--curve-arch", default="tiny")
    parser.add_argument("--curve-updates", type=int, default=1000)
    args = parser.parse_args()
    import torch._inductor.config as inductor

    inductor.force_disable_caches = True  # the compile time a first run pays (no kernels cached from before)
    precision = "bf16" if cpu_has_bf16() else "fp32"
    print(f"{machine()}; {precision}, 4096 target tokens per update, vocabulary {VOCAB:,}")
    rows = []
    for arch in args.archs.split(","):
        (_, eager), (first, compiled) = (speed(arch, c, args.updates, precision) for c in (False, True))
        rows.append([arch, f"{eager:,.0f}", f"{compiled:,.0f}", f"{compiled / eager:.2f}x", f"{first:.0f} s"])
    print_table("training speed, target tokens/s", ["preset", "eager", "compiled", "ratio",
                                                    "first compiled update"], rows)
    if args.data is None:
        return
    with tempfile.TemporaryDirectory() as work:
        logs = {c: curve(args.data, args.curve_arch, args.curve_updates, c, precision, Path(work))
                for c in (False, True)}
    train = {c: {r["update"]: r["loss"] for r in log if r["event"] == "train"} for c, log in logs.items()}
    valid = {c: {r["update"]: r["valid_loss"] for r in log if r["event"] == "valid"} for c, log in logs.items()}

    def shown(figures: dict, update: int) -> str:
        return f"{figures[update]:.3f}" if update in figures else ""

    updates = sorted({u for figures in (*train.values(), *valid.values()) for u in figures})
    rows = [[u, shown(train[False], u), shown(train[True], u), shown(valid[False], u), shown(valid[True], u)]
            for u in updates]
    ends = [next(r for r in log if r["event"] == "end") for log in logs.values()]
    print_table(f"{args.curve_arch} on {args.data}, {args.curve_updates} updates, seed 1 "
                f"({ends[0]['elapsed']:.0f} s eager, {ends[1]['elapsed']:.0f} s compiled)",
                ["update", "train loss eager", "compiled", "valid loss eager", "compiled"], rows)


if __name__ == "__main__":
    main()
